"""The one lazy snapshotter of the single-file (``AsyncSaver``) and DCP (``LazySnapshot``) asynchronous saves.

A lazy save returns before it has copied the tensors it saves. Shared: the split rule (:func:`is_lazy`, default
threshold :data:`EAGER_BYTES`); a save's :class:`Snapshot` (its lazy items copied in submission order by the
saver's thread, each checked for an in-place change once copied); :class:`Snapshotter`, the savers' base
(``snapshot_pending()``, ``wait_for_snapshot()``); the step guard. Each path supplies where the bytes go and the
thread: the file path's copier copies each storage chunk by chunk into its ring for its flusher (that thread also
orders removals and retires when idle); DCP's copies each tensor into staging buffers reused across saves.

Parameters and optimizer state change only in ``optimizer.step()``, so one global ``torch.optim`` step pre-hook
makes every step wait until every tracked snapshot is complete, however the step is called (a bare optimizer,
Lightning's ``LightningOptimizer``, Fabric's wrapper: all end in ``Optimizer.step``). With a closure (Lightning's
automatic optimization) the wait happens after it, i.e. after forward/backward ran concurrently with the copy,
just before the parameters change. The hook is registered by the first lazy save, armed by every lazy save
(``track``), disarmed by the first step that finds nothing pending (then it costs a step one flag test) and
removed when the last tracked source is closed (``untrack``; it cannot remove itself: torch iterates over the
hooks while it runs). Sources are held weakly.

For everything else (an EMA callback, a manual ``p.add_()``): a tensor changed in place between its save and the
end of its copy (its version counter changed) fails that save with :class:`SnapshotRaceError`. Changes through
``tensor.data`` bypass the version counter.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Optional

__all__ = ["EAGER_BYTES", "Snapshot", "SnapshotRaceError", "Snapshotter", "hook_state", "is_lazy", "track", "untrack"]

EAGER_BYTES = 1 << 20  # default eager_bytes: biases, norms, BatchNorm statistics, step counters are copied at once

_sources: weakref.WeakSet = weakref.WeakSet()
_hook_handle: Any = None
_hook_lock = threading.Lock()
_armed = False  # a tracked source may have a pending snapshot: the hook looks (else it returns at once)


class SnapshotRaceError(RuntimeError):
    """A checkpointed tensor changed in place before its lazy snapshot was complete; nothing was saved."""


def is_lazy(nbytes: int, eager_bytes: int) -> bool:
    """The split rule: ``nbytes`` of tensor data are copied by the background snapshot (True), or at once."""
    return nbytes >= eager_bytes


def _version(t: Any) -> Optional[int]:
    """``t._version``, or None where a tensor has no version counter (inference tensors)."""
    try:
        return int(t._version)
    except Exception:
        return None


class Snapshot:
    """One save's lazy snapshot: its items, copied by :meth:`run` in the order they were added."""

    def __init__(self, hint: str, what: Optional[str] = None) -> None:
        self.hint, self.what = hint, what  # for the race error: what to call first, the checkpoint
        self.items: list[tuple[Any, list]] = []  # (the path's item, [(name, tensor, version when added)])
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.t_start = time.perf_counter()
        self.t_done: Optional[float] = None

    def add(self, item: Any, tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy ``item`` later; ``tensors`` (``(name, tensor)``: what it holds) are checked after its copy."""
        self.items.append((item, [(name, t, v) for name, t in tensors if (v := _version(t)) is not None]))

    def run(self, copy: Callable[[Any], Any]) -> None:
        """``copy(item)`` each item in order (returning False: the save was cancelled, stop), check its tensors.

        A tensor changed in place before its copy was done fails the snapshot (:class:`SnapshotRaceError`). Any
        error is kept in ``error``, not raised; at the end the live tensors are let go and ``done`` is set.
        """
        try:
            for item, recorded in self.items:
                if copy(item) is False:
                    return
                for name, t, v0 in recorded:
                    v1 = _version(t)
                    if v1 is not None and v1 != v0:
                        of = f" of {self.what}" if self.what else ""
                        raise SnapshotRaceError(
                            f"{name} was changed in place (version {v0} -> {v1}) before the lazy snapshot{of} was "
                            f"complete, so this checkpoint is not written. HINT: call {self.hint} before changing "
                            "checkpointed tensors outside optimizer.step()"
                        )
        except BaseException as e:  # e.g. MemoryError allocating the staging memory
            self.error = e
        finally:
            self.items = []
            self.t_done = time.perf_counter()
            self.done.set()


class Snapshotter:
    """A lazy saver's ``eager_bytes`` and wait for its last :class:`Snapshot` (set ``_last``, then :func:`track`)."""

    def __init__(self, eager_bytes: int = EAGER_BYTES) -> None:
        self.eager_bytes = int(eager_bytes)
        self._last: Optional[Snapshot] = None

    def snapshot_pending(self) -> bool:
        last = self._last
        return last is not None and not last.done.is_set()

    def wait_for_snapshot(self) -> float:
        """Block until the last snapshot (so every one before it) is complete; returns the seconds waited."""
        t0 = time.perf_counter()
        last = self._last
        if last is not None:
            while not last.done.wait(0.5):
                self._check_alive()
        return time.perf_counter() - t0

    def _check_alive(self) -> None:
        """Raise if the thread that would complete the snapshot is gone (called while waiting)."""


def track(source: Any) -> None:
    """Make every later ``optimizer.step()`` wait for ``source``'s pending snapshot.

    Call it once the new snapshot shows as pending (``source.snapshot_pending()``): that is what keeps the hook
    armed until the snapshot is complete.
    """
    global _hook_handle, _armed
    _sources.add(source)
    with _hook_lock:
        if _hook_handle is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook_handle = register_optimizer_step_pre_hook(_optimizer_pre_hook)
        _armed = True


def untrack(source: Any) -> None:
    """``source`` is closed; with no tracked source left the hook is removed (call it outside ``optimizer.step``)."""
    global _hook_handle, _armed
    _sources.discard(source)
    with _hook_lock:
        if not _sources and _hook_handle is not None:
            _hook_handle.remove()
            _hook_handle = None
            _armed = False


def hook_state() -> str:
    """``"absent"``, ``"disarmed"`` (registered, one flag test per step) or ``"armed"``: for tests and diagnostics."""
    if _hook_handle is None:
        return "absent"
    return "armed" if _armed else "disarmed"


def _disarm_if_idle() -> None:
    global _armed
    with _hook_lock:  # a track() in between (another thread) sees its snapshot pending here, or arms after us
        if not any(s.snapshot_pending() for s in list(_sources)):
            _armed = False


def _optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> Any:
    if not _armed:
        return None
    pending = [s for s in list(_sources) if s.snapshot_pending()]
    if not pending:
        _disarm_if_idle()
        return None

    def wait_all() -> None:
        for s in pending:
            s.wait_for_snapshot()

    closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if closure is None:
        wait_all()
        return None

    def guarded_closure(*a: Any, **kw: Any) -> Any:
        out = closure(*a, **kw)
        wait_all()  # forward/backward ran concurrently with the snapshot; parameters change after this
        return out

    if "closure" in kwargs:
        return args, {**kwargs, "closure": guarded_closure}
    return (args[0], guarded_closure, *args[2:]), kwargs
