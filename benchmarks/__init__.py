"""Research and profiling benchmarks: not part of the installed package.

Run from the repository root, e.g. ``python -m benchmarks.profile_save --state small10k``. What
users run to compare on their own hardware stays in the product (``lightning-recover bench``,
``lightning_recover/bench/``); result files live in ``benchmarks/results/``, the dated history
of every run in ``benchmarks/LOG.md``, today's figures in ``docs/benchmarks.md``.
"""
