"""The control plane's seam: what the protocol asks of the store its job's keys live in.

Two backends implement :class:`ControlPlane`, and a process picks one once, where it connects
(:func:`lightning_recover.control_plane.connect.connect`):

* :class:`~lightning_recover.control_plane.embedded.CoordinatorStore`: the embedded coordinator, a TCPStore
  server the launcher starts on one host. No watched view, no multi-key transactions.
* :class:`~lightning_recover.control_plane.etcd_store.EtcdStore`: an etcd cluster. Every process keeps a
  watched view of the job's keys; registers, reports and vouches are written in single transactions.

Past that choice the protocol calls this interface only; what differs lives behind it, and the two
capabilities that change *how* a round or a commit is run (not only what a read costs) are named
attributes, read where the round or the commit protocol is chosen: :attr:`ControlPlane.views`,
:attr:`ControlPlane.transactions` and :attr:`ControlPlane.outsiders_can_write`.

Which read to use:

* ``get(key)``: a value that must come; waits until the key exists (up to the store's timeout).
* ``multi_get(keys)``: the same for keys that all exist.
* ``peek_many(keys)``: now, never waiting for a key (None where absent): a key an outside client may have
  deleted must not stall its reader. ``through_log=True``: ordered like a write (a declaration's evidence).
* ``cached(key)``, ``cached_each(keys)``, ``cached_many(keys)``, ``cached_arrival(key)``,
  ``cached_wait(key, t)``: from the process's watched view, a moment stale at most and never older than an
  answer already given; a miss (``(False, None)`` or ``None``) where the backend has no view or it is not
  current, and the caller then reads. Only where a read made a moment earlier is as good (hints, write-once
  registers, notices that only grow).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, Optional, Protocol


class ControlPlane(Protocol):
    """The store of a job's control plane (see the module docstring for its two backends)."""

    #: What a message calls the backend ("coordinator", "etcd control plane").
    kind: str
    #: True where a watched view answers the ``cached*`` reads and wakes :meth:`wait_changed` (etcd).
    views: bool
    #: True where :meth:`put_and_decide` is one transaction and :meth:`compare_set` writes ``also`` and
    #: ``if_absent`` and bumps its counter in the same transaction (etcd).
    transactions: bool
    #: True where any client that reaches the store can write it (the TCPStore has no client authentication):
    #: a sealed value of this process's may be deleted by an outsider and must then be written again.
    outsiders_can_write: bool

    # ---------------------------------------------------------------- plain values (TCPStore's operations)
    def get(self, key: str) -> bytes: ...

    def set(self, key: str, value: Any) -> None: ...

    def add(self, key: str, amount: int) -> int: ...

    def append(self, key: str, value: Any) -> None: ...

    def check(self, keys: Sequence[str]) -> bool: ...

    def wait(self, keys: Sequence[str], timeout: Optional[datetime.timedelta] = None) -> None: ...

    def delete_key(self, key: str) -> bool: ...

    def num_keys(self) -> int: ...

    def multi_get(self, keys: Sequence[str]) -> list[bytes]: ...

    def set_timeout(self, timeout: datetime.timedelta) -> None: ...

    def clone(self) -> ControlPlane:
        """The same store on a connection of its own (threads must not share one)."""
        ...

    def prefixed_clone(self, prefix: str) -> Any:
        """A ``dist.Store`` on a connection of its own whose keys live under ``prefix/``: where a process
        group's rendezvous meets."""
        ...

    def close(self) -> None: ...

    # ---------------------------------------------------------------- registers and several keys at once
    def compare_set(
        self,
        key: str,
        expected: Any,
        desired: Any,
        also: Sequence[tuple[str, Any]] = (),
        bump: Optional[str] = None,
        if_absent: Sequence[tuple[str, Any]] = (),
    ) -> bytes:
        """TCPStore's compare-and-set (returns the value now stored), also writing ``also`` whatever the outcome
        and each of ``if_absent`` where absent, and adding 1 to the counter ``bump`` once the register holds
        ``desired``: one transaction where :attr:`transactions` (only the call that set it bumps), else one
        request each (every caller that finds ``desired`` bumps: it cannot tell)."""
        ...

    def put_and_decide(
        self,
        key: Optional[str],
        value: Any,
        expected: Sequence[tuple[str, bytes]],
        register: str,
        decision: bytes,
        forget_prefix: Optional[str] = None,
        with_decision: Sequence[tuple[str, bytes]] = (),
    ) -> Optional[bytes]:
        """Only where :attr:`transactions`: a report and a conditional decision in one transaction
        (``EtcdStore.put_and_decide``)."""
        ...

    def peek_many(self, keys: Sequence[str], through_log: bool = False) -> list[Optional[bytes]]: ...

    def delete_many(self, keys: Sequence[str]) -> None: ...

    # ---------------------------------------------------------------- the watched view (misses without one)
    def cached(self, key: str) -> tuple[bool, Optional[bytes]]: ...

    def cached_each(self, keys: Sequence[str]) -> Optional[list[Optional[bytes]]]: ...

    def cached_many(self, keys: Sequence[str]) -> Optional[list[bytes]]: ...

    def cached_arrival(self, key: str) -> Optional[tuple[bytes, float]]: ...

    def cached_wait(self, key: str, timeout: float) -> Optional[bool]: ...

    def wait_changed(self, timeout: float) -> None:
        """Return once some key changed (a watched view moved), or after ``timeout`` seconds."""
        ...

    # ---------------------------------------------------------------- what the monitor and the heartbeats ask
    def raft_term(self) -> int:
        """Grows with every leader election of a replicated backend (the monitor forgives the heartbeats an
        election held up); 0 where there is none."""
        ...

    def quiet(self) -> bool:
        """True when the view of the job's keys heard nothing for a while (a write keeps every view current)."""
        ...

    def quiet_beside(self) -> bool:
        """:meth:`quiet` for the keys kept beside the watched ones (the heartbeats)."""
        ...

    def leased(self, key: str, ttl: int) -> Any:
        """``key`` alive only as long as a lease of ``ttl`` seconds (``etcd_liveness.LeasedKey``); None
        where the backend has no leases (a heartbeat is then rewritten every period)."""
        ...
