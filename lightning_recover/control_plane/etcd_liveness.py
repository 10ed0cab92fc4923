"""A replica's heartbeat key on etcd, alive as long as a lease its heartbeat thread keeps alive.

Why: every beat written is a Raft write that every etcd member applies: at 2,000 replicas and a beat every
quarter second of a 1 s heartbeat timeout, several times what a 3-member cluster sustains
(benchmarks/figures/etcdperf.md). A lease keep-alive is not a Raft write: the
leader renews the lease in memory (etcd's lessor; followers forward it), so a replica that only has to say
"alive" costs no write. etcd deletes the key when the lease expires (a revoke: one Raft write per death, not per
beat), and the deletion reaches the monitor's view of the heartbeats: that is the "missed heartbeats" verdict.

* The heartbeat key is written with the lease attached: at the start (one grant and one put per incarnation)
  and afterwards only when the main thread's progress must be told (``heartbeat.Heartbeat``: commits vouch for
  it while steps go on). Its payload names the lease's TTL (``"lease"``), which tells the monitor to judge the
  replica by the key's presence rather than by its beats moving.
* Keep-alives every TTL / 3, on a thread and a connection of their own (:meth:`LeasedKey.start_keeping`): a
  keep-alive must never wait behind a beat's write or the heartbeat thread's reads, which a loaded etcd may
  answer seconds late, or a live replica's lease expires. A replica whose process is frozen (SIGSTOP), whose host died or which
  lost etcd is declared within TTL + etcd's expiry check (every 0.5 s) + the monitor's poll; a process that exits
  is declared at once by its launcher, as before. etcd extends every lease by an election timeout when a new
  leader takes over, so an election does not expire leases (the monitor's stall allowance is not needed here).
* A lease found expired (the keep-alive answers TTL <= 0: the process stalled past it) is granted anew with the
  next beat: the monitor has declared the replica dead by then, and the replica learns it from its death notice.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.errors import RecoverError

#: Seconds before a keep-alive that etcd did not answer (within the client's deadline) is tried again.
_KEEP_RETRY = 0.25


class LeasedKey:
    """One key attached to a lease of its own, on a connection of its own (the heartbeat thread's); its
    keep-alives on another, from a thread of their own once :meth:`start_keeping` was called."""

    def __init__(self, client: ec.EtcdClient, key: bytes, ttl: int) -> None:
        self._client = client
        self.key = key
        self.ttl = ttl
        self._lease: Optional[int] = None
        self._lock = threading.RLock()  # keep_alive without a keeper holds it across _renew
        self.renewed_at = 0.0  # monotonic time of the last grant or keep-alive that etcd answered
        self.keepalives = 0  # keep-alives sent (load figures)
        self._keeper_client: Optional[ec.EtcdClient] = None
        self._keeper: Optional[threading.Thread] = None
        self._stop = threading.Event()
        #: why the keeper thread stopped: an error other than an unanswered call (which it retries)
        self.error: Optional[Exception] = None

    def start_keeping(self) -> None:
        """Keep the lease alive every TTL / 3 from now on, on a thread and a connection of its own."""
        if self._keeper is not None:
            return
        self._keeper_client = self._client.clone()
        self._keeper = threading.Thread(target=self._keep, name="lr-lease-keeper", daemon=True)
        self._keeper.start()

    def _keep(self) -> None:
        while not self._stop.wait(max(0.0, self.renewed_at + self.ttl / 3 - time.monotonic())):
            try:
                if not self.keep_alive():
                    self._stop.wait(self.ttl / 3)  # no lease now: the next put grants one
            except RecoverError:
                self._stop.wait(_KEEP_RETRY)  # unanswered within the client's deadline: again, at once
            except Exception as exc:
                self.error = exc  # an answer it cannot read: the heartbeat thread raises it (named, not silent)
                return

    def put(self, value: bytes) -> None:
        """Write the key attached to the lease (granted first if there is none, or it expired)."""
        with self._lock:
            if self._lease is None:
                self._lease = self._client.lease_grant(self.ttl)
                self.renewed_at = time.monotonic()
            try:
                self._client.put(self.key, value, lease=self._lease)
            except ec.EtcdRequestError:
                # "requested lease not found": it expired meanwhile. A fresh one; the monitor judged the old.
                self._lease = self._client.lease_grant(self.ttl)
                self.renewed_at = time.monotonic()
                self._client.put(self.key, value, lease=self._lease)

    def claim(self, value: bytes) -> Optional[bytes]:
        """Write the key attached to the lease (granted first) only if it does not exist: None when written, else
        what is there (b"" if it went meanwhile). One transaction: of several claims at once, one wins."""
        with self._lock:
            if self._lease is None:
                self._lease = self._client.lease_grant(self.ttl)
                self.renewed_at = time.monotonic()
            answer = self._client.txn(
                [ec.cmp_version(self.key, 0)], [ec.op_put(self.key, value, self._lease)], [ec.op_get(self.key)]
            )
            if ec.created_in(answer, self._lease):
                return None
            lease, self._lease = self._lease, None
        self._client.lease_revoke(lease)  # a lost claim holds nothing
        kv = ec.first_kv(answer["responses"][0])
        return ec.unb64(kv.get("value")) if kv else b""

    def held(self) -> bool:
        """Whether the key is in a lease this one renewed within its TTL."""
        with self._lock:
            return self._lease is not None and time.monotonic() - self.renewed_at < self.ttl

    def keep_alive(self) -> bool:
        """Renew the lease; False when there is none or it had expired (the next :meth:`put` grants a new one).
        From the keeper it does not wait for a put in progress: it has a connection of its own."""
        if self._keeper_client is None:
            with self._lock:  # one connection for both: a put and a keep-alive take turns
                return self._renew(self._client)
        return self._renew(self._keeper_client)

    def _renew(self, client: ec.EtcdClient) -> bool:
        with self._lock:
            lease = self._lease
            self.keepalives += lease is not None
        if lease is None:
            return False
        sent = time.monotonic()
        alive = client.lease_keepalive(lease) > 0
        with self._lock:
            if self._lease != lease:
                return alive  # a put granted a new lease meanwhile: this answer is about the old one
            if alive:
                self.renewed_at = max(self.renewed_at, sent)
            else:
                self._lease = None
            return alive

    def close(self) -> None:
        """Stop the keep-alives, revoke the lease (the key goes at once) and close the connections."""
        self._stop.set()
        if self._keeper is not None and self._keeper_client is not None:
            self._keeper.join(5.0)
            if not self._keeper.is_alive():  # else a keep-alive is still waiting for etcd: its thread ends with it
                self._keeper_client.close()
        with self._lock:
            lease, self._lease = self._lease, None
        try:
            if lease is not None:
                self._client.lease_revoke(lease)
        except RecoverError:
            pass  # etcd unreachable: the lease expires by itself
        finally:
            self._client.close()
