"""Optimizer steps wait for pending lazy snapshots.

A lazy asynchronous save (``AsyncSaver`` for single files, ``LazySnapshotStager`` for DCP) returns to
the training loop before it has copied the tensors it saves. Parameters and optimizer state change only
in ``optimizer.step()``, so one global ``torch.optim`` step pre-hook makes every step wait until every
tracked snapshot is complete, however the step is called: a bare ``torch.optim.Optimizer``, Lightning's
``LightningOptimizer`` (automatic and manual optimization), Fabric's optimizer wrapper (all end in
``Optimizer.step``, which runs the global pre-hooks). For a step called with a closure (Lightning's
automatic optimization) the wait happens after the closure, i.e. after forward/backward ran concurrently
with the copy, just before the parameters change.

What the hook costs a step when no snapshot is pending: it is registered by the first lazy save, armed by
every lazy save (``track``) and disarmed by the first step that finds nothing pending; a disarmed hook is
one flag test. It is removed when the last tracked source is closed (``untrack``). (It cannot remove
itself: torch iterates over the hooks while it runs.)

A tracked source has ``snapshot_pending() -> bool`` and ``wait_for_snapshot()`` (which also raises the
source's background errors). Sources are held weakly.

The safety net for everything else (an EMA callback, a manual ``p.add_()``): a lazy snapshot records the
version counter of every tensor it copies later (:func:`record_versions`) and compares it once the copy is
done (:func:`changed_tensor`); a tensor changed in place in between makes that save fail with
:class:`SnapshotRaceError`. Changes through ``tensor.data`` bypass the version counter and are not seen.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

__all__ = ["SnapshotRaceError", "changed_tensor", "hook_state", "record_versions", "track", "untrack"]

_sources: weakref.WeakSet = weakref.WeakSet()
_hook_handle: Any = None
_hook_lock = threading.Lock()
_armed = False  # a tracked source may have a pending snapshot: the hook looks (else it returns at once)


class SnapshotRaceError(RuntimeError):
    """A checkpointed tensor changed in place before its lazy snapshot was complete; nothing was saved."""


def tensor_version(t: Any) -> Optional[int]:
    """``t._version``, or None where a tensor has no version counter (inference tensors)."""
    try:
        return int(t._version)
    except Exception:
        return None


def record_versions(tensors: Any) -> list[tuple[str, Any, int]]:
    """``(name, tensor, version)`` for ``(name, tensor)`` pairs, to compare with :func:`changed_tensor` later."""
    out = []
    for name, t in tensors:
        v = tensor_version(t)
        if v is not None:
            out.append((name, t, v))
    return out


def changed_tensor(recorded: list[tuple[str, Any, int]]) -> Optional[tuple[str, int, int]]:
    """The first ``(name, recorded version, current version)`` of a tensor changed in place since, else None."""
    for name, t, v in recorded:
        now = tensor_version(t)
        if now is not None and now != v:
            return name, v, now
    return None


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
