"""Lazy snapshots for ``dcp.async_save``: the training loop is blocked only for the small tensors.

``UringStorageWriter(path, lazy_snapshot=True)`` makes ``stage()`` (what ``dcp.async_save`` calls in
the training thread) return a ``concurrent.futures.Future`` at once: tensors smaller than
``eager_bytes`` (step counters, norms, biases: cheap, and some change in ``forward``) are copied right
away; the large ones are copied by a background thread into a staging state dict that is allocated once
and reused by the next save of the same layout. DCP's upload thread waits for that future, then plans
and writes as usual; ``dcp.async_save`` returns an ``AsyncSaveResponse`` whose ``staging_completion``
is the end of the snapshot and ``upload_completion`` the durable commit.

The snapshotter is the one the single-file saver shares (``snapshot_guard.py``: split rule, background copy in
order with its version-race check, ``wait_for_snapshot``, ``optimizer.step()`` guard); this module supplies the
staging buffers. A race is raised by ``write_data`` on that rank, so DCP fails the save on every rank and nothing
is committed; no rank is left waiting in a collective.
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from lightning_recover.checkpoint.snapshot_guard import EAGER_BYTES, Snapshot, Snapshotter, is_lazy, track, untrack

__all__ = ["LazySnapshot"]


def _leaves(obj: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(obj, (list, tuple)):
        return [leaf for i, v in enumerate(obj) for leaf in _leaves(v, (*path, i))]
    return [(path, obj)]


def _rebuild(obj: Any, values: Any) -> Any:
    """``obj``'s containers with its leaves replaced, in ``_leaves`` order, by ``next(values)``."""
    if isinstance(obj, dict):
        return {k: _rebuild(v, values) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_rebuild(v, values) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuples too
    return next(values)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _describe(v: Any) -> Any:
    if isinstance(v, DTensor):
        loc = v.to_local()
        return ("dtensor", loc.dtype, tuple(loc.shape), v.device_mesh, tuple(v.placements), tuple(v.shape))
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape))
    return None


def _staging_for(v: Any) -> Any:
    """A CPU tensor (or a DTensor around one) with ``v``'s shape, to copy ``v`` into."""
    if isinstance(v, DTensor):
        loc = v.to_local()
        buf = torch.empty(loc.shape, dtype=loc.dtype, device="cpu")
        return DTensor.from_local(buf, v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride())
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="cpu")
    return None


class LazySnapshot(Snapshotter):
    """The staging half of ``UringStorageWriter(lazy_snapshot=True)``: see the module docstring.

    ``lazy=False`` (``UringStorageWriter(cache_staged_state_dict=True)``): every tensor is copied in
    ``stage()``, which returns the staged dict itself, into the same reused buffers (DCP's own cached
    staging pins memory, which fails on a machine without an accelerator).
    """

    def __init__(self, eager_bytes: int = EAGER_BYTES, lazy: bool = True) -> None:
        super().__init__(eager_bytes)
        self.lazy = lazy
        self._lock = threading.Lock()
        self._layout: Any = None
        self._buffers: Optional[list] = None  # staging tensors by leaf, reused while the layout holds
        self._in_use = False  # an upload still reads the buffers
        # Every lazy save's snapshot, in stage() order; the upload of a save takes the oldest in
        # set_up_storage_writer (saves through one writer run one at a time, in order), so an error is
        # always raised by the save it belongs to, never cleared by a later stage().
        self._snaps: collections.deque = collections.deque()
        self._current: Optional[Snapshot] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self.blocked_s = 0.0  # the training thread's time in the last stage()
        self.allocations = 0  # how many times staging buffers were allocated (reuse is observable)

    # -- training thread ---------------------------------------------------------------------------

    def stage(self, state_dict: dict) -> Any:
        self.wait_for_snapshot()
        t0 = time.perf_counter()
        leaves = _leaves(state_dict)
        layout = [_describe(v) for _, v in leaves]
        with self._lock:
            if self._buffers is None or self._in_use or layout != self._layout:
                # a buffer still read by an unfinished upload is never overwritten: take new ones
                self._buffers = [_staging_for(v) for _, v in leaves]
                self._layout = layout
                self.allocations += 1
            self._in_use = True
            buffers = self._buffers
        staged_values = []
        snap = Snapshot("writer.wait_for_snapshot() (or save with lazy_snapshot=False)")
        with torch.no_grad():
            for (path, src), dst in zip(leaves, buffers):
                if dst is None:
                    staged_values.append(copy.deepcopy(src))  # ints, strings, bytes: frozen now
                    continue
                staged_values.append(dst)
                s, d = _local(src), _local(dst)
                if self.lazy and is_lazy(s.numel() * s.element_size(), self.eager_bytes):
                    snap.add((s, d), [(".".join(str(p) for p in path), src)])
                else:
                    d.copy_(s)
        staged = _rebuild(state_dict, iter(staged_values))
        if not self.lazy:
            self.blocked_s = time.perf_counter() - t0
            return staged
        done: Future = Future()
        self._snaps.append(snap)
        self._last = snap
        track(self)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcp-lazy-snapshot")
        self._pool.submit(self._copy, snap, staged, done)
        self.blocked_s = time.perf_counter() - t0
        return done

    # -- background and upload threads -------------------------------------------------------------

    def _copy(self, snap: Snapshot, staged: dict, done: Future) -> None:
        with torch.no_grad():
            snap.run(lambda src_dst: src_dst[1].copy_(src_dst[0]))
        done.set_result(staged)  # an error is kept for write_data: the save fails on every rank together

    def begin_upload(self) -> None:
        """Called at the start of every save's upload (``set_up_storage_writer``): take its snapshot."""
        self._current = self._snaps.popleft() if self.lazy and self._snaps else None

    def check(self) -> None:
        """Called by ``write_data``: raise this save's snapshot error, if any."""
        if self._current is not None and self._current.error is not None:
            raise self._current.error

    def release(self) -> None:
        """The upload no longer reads the staging buffers (called when ``write_data`` returns)."""
        with self._lock:
            self._in_use = False

    def close(self) -> None:
        self.wait_for_snapshot()
        untrack(self)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._buffers = None

    def __getstate__(self) -> dict:
        raise TypeError("a lazy snapshot holds threads and staging memory and is not picklable")
