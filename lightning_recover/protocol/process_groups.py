"""The process group of one generation: built among its members, abandoned when it fails.

A failed generation's group is never reused. gloo cannot abort an operation in flight, and
destroying a group that has one blocks until the operation's timeout (then aborts the process), so
abandoned gloo groups stay referenced until the process ends; NCCL communicators are non-blocking
and aborted off the hot path.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_recover.errors import MembershipChanged

_POLL_MIN = 0.0005
_POLL_MAX = 0.005


def _quiet(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        pass


class ProcessGroups:
    """Builds and abandons the per-generation groups of one replica."""

    def __init__(self, backend: str, collective_timeout: float) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not dist.is_nccl_available():
            raise RuntimeError(
                "backend='nccl' needs a CUDA build of torch with NCCL. HINT: use accelerator='cpu' (gloo)."
            )
        self.backend = backend
        self.collective_timeout = collective_timeout
        self._graveyard: list = []  # abandoned groups and builder threads; dropped with the process

    @property
    def abandoned_work(self) -> bool:
        """True once a group with an operation possibly still in flight was abandoned."""
        return bool(self._graveyard)

    def build(self, store: dist.Store, number: int, rank: int, size: int, failure_seen: Callable[[], bool]) -> Any:
        """Build generation ``number``'s group on a thread; raise MembershipChanged if a member fails meanwhile."""
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["pg"] = self._new(store, rank, size)
            except BaseException as exc:  # reported to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=run, name=f"lr-build-g{number}", daemon=True)
        thread.start()
        delay = _POLL_MIN
        while thread.is_alive():
            if failure_seen():
                self._graveyard.append(thread)
                raise MembershipChanged(f"a member of generation {number} failed while it was being built")
            thread.join(delay)
            delay = min(delay * 2, _POLL_MAX)
        if "error" in result:
            raise MembershipChanged(f"building generation {number} failed: {result['error']}")
        return result["pg"]

    def _new(self, store: dist.Store, rank: int, size: int) -> Any:
        timeout = datetime.timedelta(seconds=self.collective_timeout)
        if self.backend == "nccl":
            # Non-blocking communicators, so that abort() can end an operation stuck on a dead peer.
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.blocking = 0
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def abandon(self, pg: Any) -> None:
        if self.backend == "nccl":
            # NCCL can abort its communicators: do it off the hot path, then drop the group.
            threading.Thread(target=lambda: _quiet(pg.abort), name="lr-nccl-abort", daemon=True).start()
        else:
            # gloo cannot abort an op in flight and destroying its group blocks until the op's
            # timeout: keep the objects referenced and let them die with the process.
            self._graveyard.append(pg)
