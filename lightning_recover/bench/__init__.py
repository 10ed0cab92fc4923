"""Benchmarks behind ``lightning-recover bench`` (``checkpoint``: durable save / cold load)."""
