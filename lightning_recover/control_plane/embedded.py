"""The embedded coordinator's side of the control plane's seam: a TCPStore behind :class:`ControlPlane`.

The embedded coordinator (``protocol/coordinator.py``) serves a TCPStore on the launcher's host. Its clients
have no watched view and no multi-key transactions: the ``cached*`` reads miss (the caller reads the store),
:meth:`CoordinatorStore.compare_set` writes what it carries one request at a time, and a heartbeat is
rewritten every period instead of living in a lease.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch.distributed as dist

from lightning_recover import env
from lightning_recover.control_plane.answer_times import MAX_TRY_TIMEOUT, AnswerTimes
from lightning_recover.errors import CoordinatorLostError

#: Seconds :meth:`CoordinatorStore.peek_many` waits at least for a key deleted after it saw it (longer where the
#: coordinator's answers take longer: :class:`~lightning_recover.control_plane.answer_times.AnswerTimes`).
BATCH_READ_TIMEOUT = 0.25


class CoordinatorStore:
    """A TCPStore (a client of the embedded coordinator, or its server's own store) as a :class:`ControlPlane`."""

    kind = "coordinator"
    views = False
    transactions = False
    outsiders_can_write = True

    def __init__(self, store: dist.Store) -> None:
        self.store: Any = store  # torch's stubs of Store lack clone and append, and type values as str
        self._batch_reader: Any = None  # the connection of peek_many's multi_get (made when first needed)
        self._batch_lock = threading.Lock()
        self.answer_times = AnswerTimes()  # how long the coordinator takes to answer (the batch read's timeout)

    # ---------------------------------------------------------------- plain values
    def get(self, key: str) -> bytes:
        return self.store.get(key)

    def set(self, key: str, value: Any) -> None:
        """Write ``value``; applied by the coordinator when this returns. A TCPStore client's ``set`` has no reply
        (it returns once the request is sent), so a reader on another connection, told of the write over another
        channel (a process group), could read before the coordinator took it: the ``check`` after it is answered
        only once the coordinator handled everything this connection sent before."""
        self.store.set(key, value)
        self.store.check([key])

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def append(self, key: str, value: Any) -> None:
        self.store.append(key, value)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check(list(keys))

    def wait(self, keys: Sequence[str], timeout: Optional[datetime.timedelta] = None) -> None:
        if timeout is None:
            self.store.wait(list(keys))
        else:
            self.store.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)

    def num_keys(self) -> int:
        return self.store.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self.store.multi_get(list(keys))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.store.set_timeout(timeout)

    def clone(self) -> CoordinatorStore:
        return CoordinatorStore(self.store.clone())

    def prefixed_clone(self, prefix: str) -> dist.Store:
        return dist.PrefixStore(prefix, self.store.clone())

    def close(self) -> None:
        """Nothing to release: torch closes a TCPStore client's connection when it is collected."""

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
        got = self.store.compare_set(key, expected, desired)
        for k, v in also:
            self.store.set(k, v)
        if also:
            self.store.check([also[-1][0]])  # applied when this returns, as :meth:`set`
        for k, v in if_absent:
            self.store.compare_set(k, b"", v)
        if got == desired and bump is not None:
            self.store.add(bump, 1)
        return got

    def put_and_decide(self, *args: Any, **kwargs: Any) -> Optional[bytes]:
        raise NotImplementedError("the embedded coordinator has no transactions (ControlPlane.transactions)")

    def peek_many(self, keys: Sequence[str], through_log: bool = False) -> list[Optional[bytes]]:
        """Every value, or None where a key is absent, never waiting long; a TCPStore answers in order, each when a
        write would be (so ``through_log`` changes nothing here). Two requests whatever the number of keys while
        they all exist (``check``, then ``multi_get``), else one request per key: a replica's reads of every
        member's death notice, polled through a regroup by every member, cost the coordinator O(N) requests
        each otherwise, O(N^2) a poll for the job.

        ``multi_get`` waits for a missing key, so a key deleted between the two requests would stall it: it runs on
        a connection of its own (replaced after a timeout: its state then is not relied on) whose timeout is
        ``BATCH_READ_TIMEOUT``, or the first try :attr:`answer_times` gives where the coordinator answers slowly.
        After a timeout (the client then still waits for the server's answer to its cancel) the ``check`` tells a
        key gone (the keys are then read one by one, which never waits) from a slow answer (the batch is asked
        again with twice the timeout, up to ``MAX_TRY_TIMEOUT``): N single requests to a coordinator already slow
        would take longer still.
        """
        keys = list(keys)
        timeout = self.answer_times.first_try(BATCH_READ_TIMEOUT)
        while len(keys) > 1 and self._all_present(keys):
            with self._batch_lock:
                if self._batch_reader is None:
                    self._batch_reader = self.store.clone()
                self._batch_reader.set_timeout(datetime.timedelta(seconds=timeout))
                began = time.monotonic()
                try:
                    values = list(self._batch_reader.multi_get(keys))
                except dist.DistStoreError:
                    self._batch_reader = None
                else:
                    self.answer_times.observe(time.monotonic() - began)
                    return values
            if timeout >= MAX_TRY_TIMEOUT:
                break
            timeout = min(MAX_TRY_TIMEOUT, 2 * timeout)
        return [peek(self.store, k) for k in keys]

    def _all_present(self, keys: list[str]) -> bool:
        began = time.monotonic()
        present = self.store.check(keys)
        self.answer_times.observe(time.monotonic() - began)
        return present

    def delete_many(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.store.delete_key(k)

    # ---------------------------------------------------------------- no watched view: every read misses
    def cached(self, key: str) -> tuple[bool, Optional[bytes]]:
        return False, None

    def cached_each(self, keys: Sequence[str]) -> Optional[list[Optional[bytes]]]:
        return None

    def cached_many(self, keys: Sequence[str]) -> Optional[list[bytes]]:
        return None

    def cached_arrival(self, key: str) -> Optional[tuple[bytes, float]]:
        return None

    def cached_wait(self, key: str, timeout: float) -> Optional[bool]:
        return None

    def wait_changed(self, timeout: float) -> None:
        time.sleep(timeout)

    # ---------------------------------------------------------------- one server: no elections, no leases
    def raft_term(self) -> int:
        return 0

    def quiet(self) -> bool:
        return False

    def quiet_beside(self) -> bool:
        return False

    def leased(self, key: str, ttl: int) -> None:
        return None


_ABSENT = b"\x00lr-absent"  # what peek's compare_set expects: never a sealed value


def peek(store: Any, key: str) -> Optional[bytes]:
    """The raw value under ``key``, or None if there is none, in one round trip that never waits (any store with
    TCPStore's ``compare_set``: both backends; on etcd the compare-and-set is ordered in the Raft log).

    A store ``get`` of a missing key blocks until the key appears or the client's timeout ends; a
    key deleted by an outside client between a ``check`` and a ``get`` would stall the reader.
    ``compare_set(key, X, X)`` answers at once: the value, or ``X`` when the key is absent (X is never
    a sealed value, and writing it over itself changes nothing).
    """
    raw = store.compare_set(key, _ABSENT, _ABSENT)
    return None if raw == _ABSENT else raw


_CONNECT_HINT = (
    f"HINT: check {env.COORDINATOR}; start it with the launcher (`lightning-recover run`) or "
    "`lightning-recover coordinator`."
)


def connect_coordinator(addr: str, timeout: float) -> CoordinatorStore:
    """A client of the embedded coordinator at ``host:port``, connected within ``timeout`` seconds."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"coordinator address {addr!r} must be HOST:PORT (set {env.COORDINATOR} or pass --coordinator)"
        )
    try:
        store = within(
            timeout,
            lambda: dist.TCPStore(
                host.strip("[]"),
                int(port),
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout),
            ),
        )
    except Exception as exc:  # torch raises several types (DistNetworkError, RuntimeError)
        raise CoordinatorLostError(
            f"cannot reach the lightning-recover coordinator at {addr} within {timeout:.0f}s: {exc}. {_CONNECT_HINT}"
        ) from exc
    return CoordinatorStore(store)


def within(timeout: float, make: Callable[[], Any]) -> Any:
    """``make()`` or TimeoutError after ``timeout`` seconds, whatever ``make`` does meanwhile.

    torch's TCPStore client does not keep its own timeout on connect: after it runs out it sleeps a
    random back-off and tries again, so an unreachable coordinator would be named only after several
    tries. Here the deadline is ours. A connect still running at the deadline is left to its daemon
    thread: its caller stops with the error.
    """
    done: dict[str, Any] = {}

    def attempt() -> None:
        try:
            done["value"] = make()
        except BaseException as exc:  # handed to the caller's thread
            done["error"] = exc

    worker = threading.Thread(target=attempt, name="lightning-recover-connect", daemon=True)
    worker.start()
    worker.join(timeout)
    if "error" in done:
        raise done["error"]
    if "value" not in done:
        raise TimeoutError(f"no connection within {timeout:.1f}s")
    return done["value"]
