"""Process-wide state of the checkpoint package used from several threads at once.

Each saver has its own flusher thread, the DCP lazy snapshot its own pool, and any thread may save through the
shared default engine, so whatever the package fills lazily at module level is first touched by several threads
together. These tests make that first touch happen in many threads at once, with the interpreter switching
threads as often as it can, and compare every result with the sequential one.
"""

from __future__ import annotations

import atexit
import importlib.util
import random
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import native_io
from lightning_recover.checkpoint.engine import EngineHandle

pytestmark = pytest.mark.timeout(300)

THREADS = 8


@contextmanager
def _switching_often() -> Iterator[None]:
    """The interpreter switches threads every microsecond (a check-then-act race shows up in most trials)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _together(fn, n: int = THREADS) -> list:
    """``fn()`` in ``n`` threads released at the same moment; their results (or the first error raised)."""
    barrier = threading.Barrier(n)
    out: list = [None] * n
    errors: list = []

    def run(k: int) -> None:
        try:
            barrier.wait(timeout=60)
            out[k] = fn()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]
    return out


def _fresh_async_io():
    """A new copy of ``async_io``, as a process has it right after import: nothing computed or cached yet."""
    spec = importlib.util.find_spec("lightning_recover.checkpoint.file.async_io")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    atexit.unregister(mod._drain_at_exit)  # this copy never has savers; the imported module keeps its own
    return mod


def test_crc32c_combine_from_a_cold_start_in_many_threads_matches_the_sequential_results():
    rng = random.Random(7)
    data = rng.randbytes(12_000_000)
    # lengths from one byte to the 12 MB chunk of the failure seen in CI, each with an arbitrary first CRC
    # (every 32-bit value is the CRC-32C of some data): the truth is the chained CRC of ``data[:n]`` after it
    cases = [(rng.getrandbits(32), n) for n in (1, 7, 4096, 65_537, 1 << 20, 3_000_001, 12_000_000)]
    truth = [native_io.crc32c(memoryview(data)[:n], c1) for c1, n in cases]
    crc2s = [native_io.crc32c(memoryview(data)[:n]) for _, n in cases]
    sequential = _fresh_async_io()
    assert [sequential.crc32c_combine(c1, c2, n) for (c1, n), c2 in zip(cases, crc2s)] == truth

    with _switching_often():
        for trial in range(20):
            mod = _fresh_async_io()
            got = _together(lambda: [mod.crc32c_combine(c1, c2, n) for (c1, n), c2 in zip(cases, crc2s)])  # noqa: B023
            wrong = [k for k, results in enumerate(got) if results != truth]
            assert not wrong, f"trial {trial}: threads {wrong} combined wrong CRCs: {got[wrong[0]]} != {truth}"
            # and every later combine in that process is still right
            assert [mod.crc32c_combine(c1, c2, n) for (c1, n), c2 in zip(cases, crc2s)] == truth


def test_crc32c_combine_refuses_a_length_no_file_has():
    from lightning_recover.checkpoint.file.async_io import crc32c_combine

    with pytest.raises(ValueError, match="len2"):
        crc32c_combine(0, 0, -1)
    with pytest.raises(ValueError, match="len2"):
        crc32c_combine(0, 0, 1 << 64)
    assert crc32c_combine(5, 9, 0) == 5 ^ 9


def test_engine_handle_creates_one_engine_when_many_threads_ask_first():
    with _switching_often():
        for trial in range(10):
            handle = EngineHandle(engine="portable", block_size=1 << 20, queue_depth=1)
            try:
                got = _together(handle.get)
                assert all(e is got[0] for e in got), f"trial {trial}: {len({id(e) for e in got})} engines made"
                assert handle.get() is got[0]
            finally:
                handle.release()
