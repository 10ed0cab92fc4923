"""A ``torch.distributed.Store`` on etcd: the control plane's key-value door when it runs on etcd.

:class:`~lightning_recover.protocol.messages.ControlStore` wraps any ``dist.Store`` (the embedded
TCPStore by default); this one keeps every key under the job's prefix in an etcd cluster, so the
sealing, typing and naming of the messages are the same on both backends. It is also what gloo
rendezvous through (a Python ``dist.Store`` works as a c10d store, also under ``dist.PrefixStore``),
so generation process groups need no fixed host.

The TCPStore operations, on etcd's:

* ``set``/``get``/``delete_key``/``num_keys``/``check``/``multi_get``: put, range (linearizable),
  delete-range, count; ``check`` and ``multi_get`` are one transaction of ranges (one round trip).
* ``compare_set``: one transaction (``version == 0`` for "only if absent", else ``value == expected``)
  that returns the value now stored, as TCPStore does. A retry after an unanswered try is safe: if the
  first try was applied, the retry finds the desired value. It may also write other keys and bump a
  counter in the same transaction (a regroup's proposal, its join payload and the ``events`` hint).
* ``add``: a compare-and-swap on the key's ``mod_revision``. Each try also writes a fresh token key in
  the same transaction, and a failed compare reads that token back: a try applied whose answer was lost
  (the member died after committing) is recognised and not counted twice. The token is deleted by the
  store's next ``add``. ``add(key, 0)`` of an existing counter is a plain read (no write).
* ``wait``/``get`` of a missing key: a watch from the revision of the read that found it missing (no
  event can fall between), re-checked by a read at least every ``_WATCH_SLICE`` seconds so a watch on
  a member that stopped answering cannot hold a caller. Once the process's watched view is running
  (below), a wait is served by it instead (no watch connection of its own per wait).

Beyond TCPStore's operations, what the step protocol uses to make about one round trip per step
(docs/control_plane.md, "Round trips per step"):

* a **watched view** (:class:`~lightning_recover.control_plane.etcd_watch.WatchView`): one watch stream per
  process on the job's keys (or, where a launcher runs a :class:`~lightning_recover.control_plane.watch_relay.WatchRelay`,
  one per host that the process's view follows), shared by every clone of the store, started by the first
  :meth:`cached` read; it answers reads that may be slightly stale (hints, write-once registers, notices that only grow)
  from memory, and nothing while it is not known to be current. Keys of the family kept ``apart``
  (heartbeats) live beside the watched ones: no process's view receives their writes (each would receive
  every replica's beat), but a process that reads them from a view (the monitor) starts one of its own;
* :meth:`put_and_decide`: a report and, if it completes a set of expected values, a decision, in one
  transaction; :meth:`peek_many` and :meth:`delete_many`: many keys in one transaction.

Every request fails over between the members within the client's deadline
(:class:`~lightning_recover.control_plane.etcd_client.EtcdClient`); past it
:class:`~lightning_recover.control_plane.etcd_client.EtcdUnavailable` is raised, which ControlStore
turns into ``CoordinatorLostError``: a replica that loses etcd stops within that bound.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch.distributed as dist

from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.control_plane.etcd_liveness import LeasedKey
from lightning_recover.control_plane.etcd_watch import STALE_AFTER, WatchView
from lightning_recover.control_plane.watch_relay import RelayedView
from lightning_recover.errors import RecoverError

_WATCH_SLICE = 1.0  # seconds a watch runs before the keys are read again
#: Seconds of silence the view of the family kept apart (heartbeats) is trusted for. That stream is quiet
#: while commits vouch for every member (no beats, ``protocol/vouches.py``), and a stale answer there only
#: makes a heartbeat look late, which the monitor confirms by a read through the Raft log before it declares
#: anyone (``protocol/coordinator.py``): a silent stream costs confirmations, never a wrong verdict.
_APART_STALE_AFTER = 10.0
_DEFAULT_TIMEOUT = 300.0  # TCPStore's default wait
_MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: a transaction of more operations is refused
#: Keys per transaction of a many-key read, write or delete: a fenced store nests it in a transaction of its own,
#: and etcd counts that nesting operation against the same limit.
_TXN_CHUNK = _MAX_TXN_OPS - 1
_REFILL_AFTER = 0.5  # seconds after a warm clone is taken before the next one opens (a rendezvous is shorter)


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _put(key: bytes, value: Any, if_absent: bool = False) -> dict:
    """A put; ``if_absent``: a nested transaction that puts only where ``key`` is absent."""
    put = ec.op_put(key, _as_bytes(value))
    return {"request_txn": {"compare": [ec.cmp_version(key, 0)], "success": [put]}} if if_absent else put


def _nested_increment(key: bytes, guess: Optional[tuple[bytes, int]]) -> Optional[dict]:
    """A nested transaction adding 1 to the counter ``key`` if it still has the ``mod_revision`` of ``guess``
    (the watched view's ``(value, mod_revision)``); None without a usable guess."""
    if guess is None or not guess[1] or not (guess[0] or b"0").isdigit():
        return None
    then = [ec.op_put(key, str(int(guess[0] or b"0") + 1).encode())]
    return {"request_txn": {"compare": [ec.cmp_mod(key, guess[1])], "success": then, "failure": []}}


class FencedOut(RecoverError):
    """A fenced store's request was refused: the key it is fenced on is no longer held by its lease (the
    monitor role passed to another launcher)."""


class Fence:
    """Every transaction of a store made conditional on ``key`` being attached to ``lease``: the monitor
    role's key and its holder's lease (``etcd_job.MonitorRole``). A monitor that lost the role, even one
    that has not noticed yet (its lease expired while its host stalled), then writes nothing: etcd itself
    refuses each of its writes, so two monitors never act at once in etcd's order of events."""

    def __init__(self, key: bytes, lease: int) -> None:
        self.key, self.lease = key, lease

    def txn(self, client: ec.EtcdClient, compare: list[dict], success: list[dict], failure: Sequence[dict]) -> dict:
        """``client.txn(compare, success, failure)`` nested in one whose compare is the fence; its answer.

        Raises:
            FencedOut: ``key`` is not attached to ``lease`` (nothing was written).
        """
        nested = {"request_txn": {"compare": compare, "success": success, "failure": list(failure)}}
        answer = client.txn([ec.cmp_lease(self.key, self.lease)], [nested], [])
        if not answer.get("succeeded"):
            raise FencedOut(
                f"{self.key.decode(errors='replace')} is no longer held by lease {self.lease:x}: this monitor lost "
                "its role and writes nothing more (another launcher holds it)"
            )
        inner = (answer.get("responses") or [{}])[0].get("response_txn") or {}
        inner["header"] = answer.get("header") or {}
        return inner


class _SharedViews:
    """The watched views of a store and all its clones, each started on first use: one of the job's keys
    (``prefix``), and one of the family kept beside them (``apart``: heartbeats), which only a process that
    reads that family starts (the monitor)."""

    def __init__(
        self, client: ec.EtcdClient, prefix: bytes, apart: Optional[bytes] = None, relay: Optional[str] = None
    ) -> None:
        self._client = client
        self._prefix, self._apart = prefix, apart
        self._relay = relay  # the host's watch relay (its Unix socket), which the job's keys' view follows
        self._lock = threading.Lock()
        self._views: dict[bytes, WatchView] = {}

    @property
    def view(self) -> Optional[WatchView]:
        """The view of the job's keys, if started."""
        return self._views.get(self._prefix)

    @property
    def beside(self) -> Optional[WatchView]:
        """The view of the keys kept apart, if started."""
        return self._views.get(self._apart) if self._apart is not None else None

    def close(self) -> None:
        with self._lock:
            views, self._views = list(self._views.values()), {}
        for view in views:
            view.close()

    def get(self, key: Optional[bytes] = None) -> WatchView:
        """The view holding ``key`` (the job's keys' view when None), started now if it was not."""
        apart = self._apart is not None and key is not None and key.startswith(self._apart)
        prefix = self._apart if apart and self._apart is not None else self._prefix
        with self._lock:
            if prefix not in self._views:
                if apart:
                    view = WatchView(self._client.clone(), prefix, _APART_STALE_AFTER)
                elif self._relay:
                    view = RelayedView(self._relay, self._client.clone(), prefix, STALE_AFTER)
                else:
                    view = WatchView(self._client.clone(), prefix, STALE_AFTER)
                self._views[prefix] = view.start()
            return self._views[prefix]

    def lookup(self, keys: list[bytes], how: Callable[[WatchView, list[bytes]], Optional[list]]) -> Optional[list]:
        """``how(view, its keys)`` for the keys of each view, merged in the order of ``keys``; None if a view
        answered None (not current, or missing a key the caller needs)."""
        by_view: dict[int, tuple[WatchView, list[int]]] = {}
        for i, k in enumerate(keys):
            view = self.get(k)
            by_view.setdefault(id(view), (view, []))[1].append(i)
        out: list = [None] * len(keys)
        for view, where in by_view.values():
            got = how(view, [keys[i] for i in where])
            if got is None:
                return None
            for i, value in zip(where, got):
                out[i] = value
        return out


class _WarmClones:
    """Clones of a client whose connection was opened ahead of need: each generation's process group
    rendezvous on a connection of its own (``EtcdStore.prefixed_clone``), and a TLS handshake (7-12 ms
    measured on a 2-core host) would otherwise sit on the regroup's critical path. The next clone opens
    ``_REFILL_AFTER`` seconds after one is taken, not at once: its handshake would compete for the cores
    with the rendezvous it was taken for."""

    def __init__(self, client: ec.EtcdClient) -> None:
        self._client = client
        self._next: Optional[tuple[ec.EtcdClient, threading.Timer]] = None

    def take(self) -> ec.EtcdClient:
        """The clone opened ahead (or a new one the first time); the next one opens a moment later."""
        if self._next is None:
            client = self._client.clone()
        else:
            client, opening = self._next
            opening.cancel()  # not opened yet (regroups in quick succession): it connects on its first request
            opening.join()
        spare = self._client.clone()
        opening = threading.Timer(_REFILL_AFTER, spare.warm)
        opening.name, opening.daemon = "lr-etcd-warm", True
        opening.start()
        self._next = (spare, opening)
        return client

    def close(self) -> None:
        if self._next is not None:
            spare, opening = self._next
            opening.cancel()
            opening.join()
            spare.close()
            self._next = None


class _ViewReads:
    """The reads an :class:`EtcdStore` answers from the watched views it shares with its clones
    (``_shared``), each key in the view that holds it (``_k``: the key's place in etcd)."""

    _shared: _SharedViews
    client: ec.EtcdClient
    views = True  # ControlPlane.views

    def _k(self, key: str) -> bytes:
        raise NotImplementedError

    @property
    def view(self) -> WatchView:
        """This process's watched view of the job's keys (started by the first call)."""
        return self._shared.get()

    def cached(self, key: str) -> tuple[bool, Optional[bytes]]:
        """``(True, value or None)`` from the watched view while it is current; ``(False, None)`` otherwise
        (then the caller reads etcd). May be slightly stale, never older than an answer it gave before."""
        k = self._k(key)
        return self._shared.get(k).lookup(k)

    def cached_many(self, keys: Sequence[str]) -> Optional[list[bytes]]:
        """Every key's value from the watched view while it is current and holds them all; None otherwise
        (then the caller reads etcd)."""
        return self._shared.lookup([self._k(k) for k in keys], WatchView.lookup_many)

    def cached_each(self, keys: Sequence[str]) -> Optional[list[Optional[bytes]]]:
        """Every key's value (None when absent) from the watched view while it is current; None otherwise."""
        return self._shared.lookup([self._k(k) for k in keys], WatchView.lookup_each)

    def cached_arrival(self, key: str) -> Optional[tuple[bytes, float]]:
        """``(value, monotonic time it reached this process)`` from the watched view while it is current and
        holds the key; None otherwise."""
        k = self._k(key)
        return self._shared.get(k).lookup_arrival(k)

    def raft_term(self) -> int:
        """The highest Raft term in this store's answers and its watched view's stream. It grows with every
        leader election: the monitor forgives heartbeats the election held up (protocol/coordinator.py)."""
        view = self._shared.view
        return max(self.client.raft_term, view.term if view is not None else 0)

    def quiet_beside(self) -> bool:
        """True when the view of the keys kept apart (heartbeats; if started) heard nothing for half of what it
        tolerates: a write there keeps it current while every replica's beat lives in a lease."""
        view = self._shared.beside
        return view is not None and view.quiet_for > view.stale_after / 2

    def quiet(self) -> bool:
        """True when the view of the job's keys (if started) heard nothing for half of what it tolerates: a
        write now keeps every process's view current (``coordinator.run_monitor``)."""
        view = self._shared.view
        return view is not None and view.quiet_for > view.stale_after / 2

    def cached_wait(self, key: str, timeout: float) -> Optional[bool]:
        """Wait up to ``timeout`` seconds for ``key`` to appear in the watched view: True/False; None when
        the view is not current (the caller waits on etcd instead)."""
        k = self._k(key)
        return self._shared.get(k).wait_for([k], timeout)

    def wait_changed(self, timeout: float) -> None:
        """Return when the watched view moves (any key changes), or after ``timeout`` seconds."""
        view = self.view
        if view.healthy:
            view.wait_change(view.revision, timeout)
        else:
            time.sleep(min(timeout, 0.005))


class EtcdStore(_ViewReads, dist.Store):
    """Keys ``prefix + key`` in etcd through ``client``; ``root`` holds the store's own bookkeeping
    (the tokens of ``add``), outside ``prefix`` so that ``num_keys`` counts only the caller's keys, and the
    keys that begin with ``apart`` (``root + key``): beside the watched keys, so that no process's view
    receives them unless it reads them (heartbeats: every replica's beat would reach every process). The
    etcd backend of :class:`~lightning_recover.protocol.backend.ControlPlane`."""

    kind = "etcd control plane"
    transactions = True
    outsiders_can_write = False  # clients authenticate with certificates

    def __init__(
        self,
        client: ec.EtcdClient,
        prefix: str,
        root: Optional[str] = None,
        timeout: float = _DEFAULT_TIMEOUT,
        shared: Optional[_SharedViews] = None,
        apart: Optional[str] = None,
        relay: Optional[str] = None,
    ):
        super().__init__()
        self.client = client
        self.prefix = prefix.encode()
        self.root = (root if root is not None else prefix).encode()
        self._timeout = timeout
        self._last_token: Optional[bytes] = None
        self.watches = 0  # watch streams opened (load figures)
        self.apart = apart
        beside = None if apart is None else self.root + apart.encode()
        self._shared = shared if shared is not None else _SharedViews(client, self.prefix, beside, relay)
        self.write_once = False  # True: every key is written once (see prefixed_clone)
        self._warm = _WarmClones(client)  # for prefixed_clone
        self.fence: Optional[Fence] = None  # set: every write (and read through the log) is fenced by it

    def _k(self, key: str) -> bytes:
        apart = self.apart is not None and key.startswith(self.apart)
        return (self.root if apart else self.prefix) + key.encode()

    # ---------------------------------------------------------------- plumbing
    def clone(self) -> EtcdStore:
        """A store on a connection of its own (threads must not share one); it shares the watched views."""
        root = self.root.decode()
        store = EtcdStore(self.client.clone(), self.prefix.decode(), root, self._timeout, self._shared, self.apart)
        store.fence = self.fence
        return store

    def prefixed_clone(self, prefix: str) -> EtcdStore:
        """A store on a connection of its own whose keys live under ``prefix/`` inside this one's, and inside the
        watched view's, which it shares. Not ``dist.PrefixStore``: over a Python store it loses ``delete_key`` and
        ``num_keys``, and holds the store only on the C++ side, where its Python half is collected."""
        store = EtcdStore(
            self._warm.take(), f"{self.prefix.decode()}{prefix}/", self.root.decode(), self._timeout, self._shared
        )
        # Built for a process group's rendezvous, whose keys (the members' addresses) are written once:
        # a value the watched view holds is the value, so ``get`` takes it from there (no round trip).
        store.write_once = True
        return store

    def close(self) -> None:
        """Close this store's connection and stop the watched view it shares with its clones (if started)."""
        self.client.close()
        self._warm.close()
        self._shared.close()

    def leased(self, key: str, ttl: int) -> LeasedKey:
        """``key`` alive only as long as a lease of ``ttl`` seconds, on a connection of its own (etcd_liveness.py)."""
        return LeasedKey(self.client.clone(), self._k(key), ttl)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def _txn(self, compare: list[dict], success: list[dict], failure: Sequence[dict] = ()) -> dict:
        """A transaction, inside the store's fence if it has one."""
        if self.fence is None:
            return self.client.txn(compare, success, failure)  # type: ignore[arg-type]
        return self.fence.txn(self.client, compare, success, failure)

    # ---------------------------------------------------------------- plain values
    def set(self, key: str, value: Any) -> None:
        if self.fence is None:
            self.client.put(self._k(key), _as_bytes(value))
        else:
            self._txn([], [ec.op_put(self._k(key), _as_bytes(value))])

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        ops = [ec.op_put(self._k(k), _as_bytes(v)) for k, v in zip(keys, values)]
        for at in range(0, len(ops), _TXN_CHUNK):
            self._txn([], ops[at : at + _TXN_CHUNK])

    def get(self, key: str) -> bytes:
        view = self._shared.view
        if self.write_once and view is not None:
            hit, value = view.lookup(self._k(key))
            if value is not None:
                return value
            if hit:  # not there yet: wait for it in the view, then take it from there
                self.wait([key])
                hit, value = view.lookup(self._k(key))
                if value is not None:
                    return value
        value, _ = self.client.get(self._k(key))
        if value is None:
            self.wait([key])
            value, _ = self.client.get(self._k(key))
        return value if value is not None else b""

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        found = self._ranges(keys)
        if any(v is None for v in found[0]):
            self.wait(list(keys))
            found = self._ranges(keys)
        return [v if v is not None else b"" for v in found[0]]

    def _ranges(self, keys: Sequence[str], count_only: bool = False) -> tuple[list[Optional[bytes]], int]:
        """The values (None: absent) of ``keys``, a transaction per ``_TXN_CHUNK``; the first's revision (later: newer)."""
        out: list[Optional[bytes]] = []
        revision = 0
        for at in range(0, max(len(keys), 1), _TXN_CHUNK):
            answer = self.client.txn([], [ec.op_get(self._k(k), count_only) for k in keys[at : at + _TXN_CHUNK]])
            revision = revision or int(answer["header"]["revision"])
            for r in answer.get("responses") or []:
                rng = r.get("response_range") or {}
                if count_only:
                    out.append(b"" if int(rng.get("count", 0)) else None)
                else:
                    kv = ec.first_kv(r)
                    out.append(ec.unb64(kv.get("value")) if kv else None)
        return out, revision

    def peek_many(self, keys: Sequence[str], through_log: bool = False) -> list[Optional[bytes]]:
        """The values of ``keys`` (None: absent) in one transaction per 127 keys; never waits. ``through_log``: the
        transaction carries a write its compare never lets happen, so etcd orders it in the Raft log: answered
        when writes are, blocked while they are (an election), as the monitor's stall allowance needs (a plain
        read, ReadIndex, can be answered while writes still wait: test_etcd_leader_sigkill_mid_training)."""
        if not keys:
            return []
        if not through_log:
            return self._ranges(keys)[0]
        never = self.root + b"\x00never"  # never written: a compare of its value is always false
        out: list[Optional[bytes]] = []
        for at in range(0, len(keys), _TXN_CHUNK):
            answer = self._txn(
                [ec.cmp_value(never, b"x")],
                [ec.op_put(never, b"x")],
                [ec.op_get(self._k(k)) for k in keys[at : at + _TXN_CHUNK]],
            )
            for r in answer.get("responses") or []:
                kv = ec.first_kv(r)
                out.append(ec.unb64(kv.get("value")) if kv else None)
        return out

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` in one transaction per 127 keys (absent keys are no error)."""
        ops = [ec.op_delete(self._k(k)) for k in keys]
        for at in range(0, len(ops), _TXN_CHUNK):
            self._txn([], ops[at : at + _TXN_CHUNK])

    def check(self, keys: Sequence[str]) -> bool:
        return all(v is not None for v in self._ranges(keys, count_only=True)[0])

    def delete_key(self, key: str) -> bool:
        if self.fence is None:
            return self.client.delete(self._k(key)) > 0
        answer = self._txn([], [ec.op_delete(self._k(key))])
        return int(((answer.get("responses") or [{}])[0].get("response_delete_range") or {}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        answer = self.client.range(self.prefix, ec.prefix_end(self.prefix), count_only=True)
        return int(answer.get("count", 0))

    # ---------------------------------------------------------------- registers
    def compare_set(
        self,
        key: str,
        expected: Any,
        desired: Any,
        also: Sequence[tuple[str, Any]] = (),
        bump: Optional[str] = None,
        if_absent: Sequence[tuple[str, Any]] = (),
    ) -> bytes:
        """TCPStore's compare_set in one transaction, writing ``also`` (``if_absent``: where absent) whatever its
        outcome; ``bump``: a counter +1 only if this call set the register (nested on the view's mod_revision)."""
        k, expected, desired = self._k(key), _as_bytes(expected), _as_bytes(desired)
        compare = [ec.cmp_version(k, 0)] if not expected else [ec.cmp_value(k, expected)]
        puts = [_put(self._k(a), v) for a, v in also] + [_put(self._k(a), v, if_absent=True) for a, v in if_absent]
        nested = _nested_increment(self._k(bump), self._guess(self._k(bump))) if bump is not None else None
        success = [ec.op_put(k, desired), *puts] + ([nested] if nested else [])
        answer = self._txn(compare, success, [*puts, ec.op_get(k)])
        responses = answer.get("responses") or []
        if answer.get("succeeded"):
            if bump is not None and not (nested and (responses[-1].get("response_txn") or {}).get("succeeded")):
                self.add(bump, 1)
            return desired
        kv = ec.first_kv(responses[len(puts)] if len(responses) > len(puts) else {})
        if kv is None:  # absent and something was expected: TCPStore answers with the expected value
            return expected
        return ec.unb64(kv.get("value"))

    def put_and_decide(
        self,
        key: Optional[str],
        value: Any,
        expected: Sequence[tuple[str, Any]],
        register: str,
        decision: Any,
        forget_prefix: Optional[str] = None,
        with_decision: Sequence[tuple[str, Any]] = (),
    ) -> Optional[bytes]:
        """Write ``key`` (None: no report) and, in one transaction, ``decision`` into the absent ``register`` if
        every ``(key, value)`` of ``expected`` holds that value; ``forget_prefix``: delete the keys under it;
        ``with_decision``: more ``(key, value)`` written only with the decision (the vouch). Returns the register's
        value now (None: undecided). Of callers whose expectations name each other's keys, exactly one decides;
        a retry after an unanswered try is safe (idempotent write, register written while absent)."""
        if len(expected) + 1 > _TXN_CHUNK:
            raise ValueError(f"put_and_decide compares at most {_TXN_CHUNK - 1} keys, not {len(expected)}")
        reg = self._k(register)
        compare = [ec.cmp_value(self._k(e), _as_bytes(v)) for e, v in expected] + [ec.cmp_version(reg, 0)]
        report = [] if key is None else [ec.op_put(self._k(key), _as_bytes(value))]
        cleanup = []
        if forget_prefix is not None:
            gone = self._k(forget_prefix)
            if reg.startswith(gone) or (key is not None and self._k(key).startswith(gone)):
                raise ValueError(f"put_and_decide would delete its own keys under {forget_prefix!r}")
            cleanup = [ec.op_delete(gone, ec.prefix_end(gone))]
        extra = [ec.op_put(self._k(a), _as_bytes(v)) for a, v in with_decision]
        answer = self._txn(
            compare,
            [*report, ec.op_put(reg, _as_bytes(decision)), *extra, *cleanup],
            [*report, ec.op_get(reg), *cleanup],
        )
        if answer.get("succeeded"):
            return _as_bytes(decision)
        responses = answer.get("responses") or []
        kv = ec.first_kv(responses[len(report)]) if len(responses) > len(report) else None
        return ec.unb64(kv.get("value")) if kv else None

    def add(self, key: str, amount: int) -> int:
        k = self._k(key)
        guess = self._guess(k) if amount else None
        value, mod = (int(guess[0] or b"0"), guess[1]) if guess else self._read_counter(k)
        if amount == 0 and mod:
            return value
        while True:
            token = self.root + b"\x00add/" + secrets.token_hex(8).encode()
            new = value + amount
            compare = [ec.cmp_mod(k, mod)] if mod else [ec.cmp_version(k, 0)]
            success = [ec.op_put(k, str(new).encode()), ec.op_put(token, b"")]
            if self._last_token is not None:
                success.append(ec.op_delete(self._last_token))
            answer = self._txn(compare, success, [ec.op_get(k), ec.op_get(token, count_only=True)])
            if answer.get("succeeded"):
                self._last_token = token
                return new
            responses = answer.get("responses") or [{}, {}]
            if int((responses[1].get("response_range") or {}).get("count", 0)):
                # An earlier try of this very transaction was applied (its answer was lost, the
                # client retried): the counter moved because of us.
                self._last_token = token
                return new
            kv = ec.first_kv(responses[0])
            value, mod = (int(ec.unb64(kv.get("value")) or b"0"), int(kv["mod_revision"])) if kv else (0, 0)

    def _guess(self, k: bytes) -> Optional[tuple[bytes, int]]:
        """The watched view's ``(value, mod_revision)`` of ``k`` if it is running and holds it: the first
        compare of a read-modify-write then needs no read (a stale guess fails the compare, whose answer
        carries the current value for the next try)."""
        view = self._shared.view
        return view.lookup_versioned(k) if view is not None else None

    def _read_counter(self, k: bytes) -> tuple[int, int]:
        answer = self.client.range(k)
        kvs = answer.get("kvs") or []
        if not kvs:
            return 0, 0
        return int(ec.unb64(kvs[0].get("value")) or b"0"), int(kvs[0]["mod_revision"])

    def append(self, key: str, value: Any) -> None:
        """Append to the value (created if absent): hints only (an applied try whose answer was lost may be
        appended twice, which a reader of hints tolerates)."""
        k, value = self._k(key), _as_bytes(value)
        guess = self._guess(k)
        while True:
            if guess is not None:
                old, compare = guess[0], [ec.cmp_mod(k, guess[1])]
            else:
                kvs = self.client.range(k).get("kvs") or []
                old, compare = (
                    (ec.unb64(kvs[0].get("value")), [ec.cmp_mod(k, int(kvs[0]["mod_revision"]))])
                    if kvs
                    else (b"", [ec.cmp_version(k, 0)])
                )
            guess = None
            if self._txn(compare, [ec.op_put(k, old + value)]).get("succeeded"):
                return

    # ---------------------------------------------------------------- waiting
    def wait(self, keys: Sequence[str], timeout: Optional[datetime.timedelta] = None) -> None:
        """Return once every key exists; ``dist.DistStoreError`` after ``timeout`` (default: the store's)."""
        limit = self._timeout if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        keys = list(keys)
        view = self._shared.view  # only once running: a store that never reads through it opens none
        if view is not None and view.healthy:
            # Served by the process's watch stream; an unhealthy view hands the rest of the time to etcd.
            if view.wait_for([self._k(k) for k in keys], limit):
                return
        early = 0  # watches in a row that ended before their slice without an event (refused, cancelled)
        while True:
            present, revision = self._ranges(keys, count_only=True)
            missing = [k for k, v in zip(keys, present) if v is None]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(
                    f"wait timeout after {limit:g}s for keys {missing[:4]} in etcd under {self.prefix.decode()!r}"
                )
            self.watches += 1
            slice_ends = time.monotonic() + min(left, _WATCH_SLICE)
            if self._watch_for_put(self._k(missing[0]), revision + 1, slice_ends - time.monotonic()):
                early = 0
            elif time.monotonic() >= slice_ends:
                early = 0  # a quiet slice: the watch worked
            else:
                # The watch failed at once (a member refusing watches, a compacted start): without a pause
                # this loop would read and re-watch as fast as the member answers.
                early += 1
                time.sleep(min(ec.backoff(early), max(0.0, slice_ends - time.monotonic())))

    def _watch_for_put(self, key: bytes, start_revision: int, timeout: float) -> bool:
        """Watch ``key`` from ``start_revision`` (the revision just read: its creation cannot be missed) for up
        to ``timeout`` seconds; True once a put came."""
        events = self.client.watch(key, start_revision, timeout)
        try:
            return any(event.get("type", "PUT") == "PUT" for event in events)
        finally:
            events.close()  # ends the watch's connection now, not at garbage collection
