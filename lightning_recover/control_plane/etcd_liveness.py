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
* Keep-alives every TTL / 3: a replica whose process is frozen (SIGSTOP), whose host died or which lost etcd is
  declared within TTL + etcd's expiry check (every 0.5 s) + the monitor's poll; a process that exits is
  declared at once by its launcher, as before. etcd extends every lease by an election timeout when a new
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


class LeasedKey:
    """One key attached to a lease of its own, on a connection of its own (the heartbeat thread's)."""

    def __init__(self, client: ec.EtcdClient, key: bytes, ttl: int) -> None:
        self._client = client
        self.key = key
        self.ttl = ttl
        self._lease: Optional[int] = None
        self._lock = threading.Lock()
        self.renewed_at = 0.0  # monotonic time of the last grant or keep-alive that etcd answered
        self.keepalives = 0  # keep-alives sent (load figures)

    @property
    def keepalive_due(self) -> bool:
        return time.monotonic() - self.renewed_at >= self.ttl / 3

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

    def keep_alive(self) -> bool:
        """Renew the lease; False when it had expired (the next :meth:`put` grants a new one)."""
        with self._lock:
            if self._lease is None:
                return False
            sent = time.monotonic()
            self.keepalives += 1
            if self._client.lease_keepalive(self._lease) > 0:
                self.renewed_at = sent
                return True
            self._lease = None
            return False

    def close(self) -> None:
        """Revoke the lease (the key goes at once) and close the connection."""
        with self._lock:
            lease, self._lease = self._lease, None
        try:
            if lease is not None:
                self._client.lease_revoke(lease)
        except RecoverError:
            pass  # etcd unreachable: the lease expires by itself
        finally:
            self._client.close()
