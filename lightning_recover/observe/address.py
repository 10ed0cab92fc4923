"""The status address (``--status-address``, ``status_address=``): parsed where it enters, with no import
beyond the standard library (the strategies' options check it before anything starts)."""

from __future__ import annotations


def parse_address(text: str, what: str = "status address", option: str = "--status-address") -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``PORT`` (loopback) as ``(host, port)``; ``ValueError`` says how to write it
    (``what`` and ``option``: the address's name and its command-line option, for the message).

    Raises:
        ValueError: not an address with a port in 0..65535.
    """
    hint = f"HINT: {option} PORT (loopback), HOST:PORT or [IPV6]:PORT, e.g. 127.0.0.1:9400 (0 = any free port)"
    value = str(text).strip()
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", value
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} {text!r} is not HOST:PORT. {hint}")
    return host, int(port)
