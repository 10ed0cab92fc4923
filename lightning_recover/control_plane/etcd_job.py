"""A launcher's part in a job whose control plane is etcd: the job's keys, its secret, the monitor role.

With etcd there is no coordinator process. Every launcher of the job (one per host, each starting its
own replicas: ``lightning-recover run --control-plane etcd://... --job NAME --local-replicas 0,1``) does:

* **join**: the first launcher to write ``meta/owner`` (a compare-and-set) writes the job's initial
  keys (the same as the embedded coordinator's, :func:`~lightning_recover.protocol.coordinator.init_keys`)
  and then ``meta/ready``; the others wait for ``meta/ready``. A job name already used by a job of
  another shape is refused.
  The job's keys are sealed with its secret, so a launcher with another secret is refused by name: a job
  is its name *and* its secret, and a new job reusing an old name never adopts the old one's state.
* **secret**: never stored in etcd (where every holder of a client certificate of the cluster, another
  job's included, could read it, and so could its data directory, snapshots and backups). Each launcher
  takes the one it is given (``LIGHTNING_RECOVER_SECRET_FILE``: the same 0600 file for every launcher of
  a multi-launcher job), or makes one (a job of one launcher), and hands it to its replicas in a 0600 file.
* **monitor role** (:class:`MonitorRole`): declaring replicas dead on missed heartbeats or hangs is what
  the embedded coordinator's monitor thread does; here it is held by one launcher at a time through an
  etcd election: a key ``monitor`` created in a transaction only if absent (``version == 0``), attached
  to that launcher's lease. Its holder keeps the lease alive; if the holder dies (or loses etcd) the
  lease expires after ``ttl`` seconds, etcd deletes the key, and a waiting candidate's transaction
  succeeds. A holder that cannot renew its lease within ``ttl`` stops monitoring before any other can
  take over (it counts from before it asked for the lease or its last renewal), and every request of its
  monitor is fenced by the lease (``etcd_store.Fence``: a transaction whose compare is "the role's key
  is attached to my lease"), so once etcd has given the role to another, etcd refuses the old holder's
  writes: two monitors never act at once in etcd's order. A monitor thread that ends (any exception) gives
  the role up at once (lease revoked) and its launcher waits ``ttl`` before campaigning again, so another
  launcher takes over. The holder also compacts etcd's history (``etcd_compaction.Compactor``: every
  candidate notes etcd's revisions, so one that takes the role compacts at once, however often it moved).

Takeover bound: ``ttl`` (lease expiry) + ``CAMPAIGN_PERIOD`` + one request; the new holder declares a
replica that died meanwhile after ``heartbeat_timeout`` more (it starts its own clock of every beat).

* **status page** (``status_address``): every launcher binds its address when it starts; the holder of the
  monitor role serves the job there (a fresh board from the moment it took the role), the others answer
  503 naming the holder. The page is back within the takeover bound at the new holder's address.
"""

from __future__ import annotations

import datetime
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Optional

from lightning_recover import env
from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.control_plane.config import EtcdSettings
from lightning_recover.control_plane.etcd_compaction import COMPACT_PERIOD, COMPACT_RETAIN, Compactor
from lightning_recover.control_plane.etcd_store import Fence
from lightning_recover.errors import ForgedMessageError, RecoverError
from lightning_recover.observe.board import StatusBoard
from lightning_recover.observe.events import EventLog
from lightning_recover.observe.status_server import StatusServer
from lightning_recover.protocol import coordinator
from lightning_recover.protocol.messages import JobSecret, Sealer

#: Seconds between a candidate's tries to take the monitor role (and the longest its takeover waits
#: after the holder's lease expired).
CAMPAIGN_PERIOD = 0.1
#: The monitor's lease (whole seconds: etcd's unit; etcd raises anything below ~1.5 x its election
#: timeout to that minimum).
DEFAULT_LEASE_TTL = 2
#: etcd's leader looks for expired leases every 0.5 s (its lessor's run loop), so a lease outlives its TTL by up to
#: this before its keys are deleted.
ETCD_LEASE_EXPIRY_CHECK = 0.5
#: Takeover of the monitor role after the holder's death: the lease's TTL, etcd's expiry check, a candidate's
#: campaign period (plus one request; the tests assert it with their slack).
TAKEOVER_BOUND = DEFAULT_LEASE_TTL + ETCD_LEASE_EXPIRY_CHECK + CAMPAIGN_PERIOD
#: Seconds between the monitor's reads of every heartbeat (at most heartbeat_timeout / 10). Each read
#: is a Raft proposal (EtcdStore.peek_many(through_log=True)) that every member applies; at the
#: embedded coordinator's 20 ms it was about half of the job's proposals (benchmarks/figures/etcdperf.md).
MONITOR_POLL = 0.1


class JobNameTaken(RecoverError):
    """The job's name is in use on etcd by a job with another secret."""


def launcher_secret() -> JobSecret:
    """The secret this launcher was given (``LIGHTNING_RECOVER_SECRET_FILE`` or ``_SECRET``: every launcher of
    a multi-launcher job needs the same), else a new one (a job of one launcher)."""
    if os.environ.get(env.SECRET_FILE) or os.environ.get(env.SECRET):
        return JobSecret.from_env()
    return JobSecret.generate()


def join_job(
    settings: EtcdSettings,
    replicas: int,
    replica_size: int,
    timeout: float = 30.0,
    secret: Optional[JobSecret] = None,
) -> JobSecret:
    """Create the job's keys (first launcher) or wait until they exist (the others).

    Args:
        settings: the job's etcd and name.
        replicas: the job's replica count; replica_size: processes per replica (every launcher the same).
        timeout: seconds to wait for the first launcher's keys.
        secret: the job's secret (default: :func:`launcher_secret`); it is never written to etcd.

    Returns:
        The job's secret.

    Raises:
        JobNameTaken: the name's keys were sealed with another secret (an earlier job's, or another launcher
            was given another secret file).
        RecoverError: the job exists with another shape.
    """
    secret = secret if secret is not None else launcher_secret()
    sealer = Sealer(secret)
    store = settings.store()
    try:
        mine = secrets.token_hex(8).encode()
        if store.compare_set("meta/owner", b"", mine) == mine:
            coordinator.init_keys(store, sealer, replicas, replica_size)
            store.set("meta/ready", b"1")
        else:
            store.wait(["meta/ready"], datetime.timedelta(seconds=timeout))
        try:
            stored = [sealer.open(k, store.get(k)).decode() for k in ("meta/replicas", "meta/replica_size")]
        except ForgedMessageError:
            raise JobNameTaken(
                f"job {settings.job!r} on {settings.url} exists with another secret than this launcher's: a job "
                "of that name ran before (its keys remain), or the launchers of one job were given different "
                f"secrets. HINT: give each new job a new --job name (or delete the old job's keys: `etcdctl del "
                f"--prefix {settings.prefix}`), and every launcher of one job the same {env.SECRET_FILE} "
                "(`openssl rand -hex 32 > job.secret; chmod 600 job.secret`)"
            ) from None
        if stored != [str(replicas), str(replica_size)]:
            raise RecoverError(
                f"job {settings.job!r} on {settings.url} already exists with {stored[0]} replicas of {stored[1]} "
                f"process(es), not {replicas} of {replica_size}. HINT: give every launcher of one job the same "
                "--replicas/--nproc-per-replica, and each new job a new --job name"
            )
        return secret
    finally:
        store.client.close()


class MonitorRole:
    """Campaign for the job's monitor role on a thread; while held, run the coordinator's monitor."""

    def __init__(
        self,
        settings: EtcdSettings,
        secret: JobSecret,
        replicas: int,
        heartbeat_timeout: float,
        hang_timeout: float,
        replica_size: int,
        name: str,
        say: Callable[[str], object],
        ttl: int = DEFAULT_LEASE_TTL,
        status_address: Optional[str] = None,
        event_log: Optional[str] = None,
    ) -> None:
        self.settings = settings
        self.sealer = Sealer(secret)
        self.replicas, self.replica_size = replicas, replica_size
        self.heartbeat_timeout, self.hang_timeout = heartbeat_timeout, hang_timeout
        self.name = name
        self.say = say
        self.ttl = ttl
        self.key = (settings.prefix + "monitor").encode()
        self.held = threading.Event()  # set while this launcher holds the role
        self.taken_at: Optional[float] = None
        self.lease = 0  # the lease this launcher holds the role with (0: none)
        self.compaction = (COMPACT_PERIOD, COMPACT_RETAIN)  # the holder's Compactor (period, retain)
        self._gave_up = False  # the role was given up because its monitor thread ended
        self._compactor: Optional[Compactor] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lr-monitor-role", daemon=True)
        self.events = EventLog(event_log) if event_log else None
        self.holder_name = "nobody yet"  # the role's holder as this launcher last read it (the 503 page)
        self.status = StatusServer(status_address, absent=self._absent) if status_address is not None else None
        if self.status is not None:
            say(f"status page: {self.status.url} (served while this launcher holds the monitor role)")

    def _absent(self) -> str:
        return f"this launcher does not hold the job's monitor role; {self.holder_name} does: its status page serves the job"

    def start(self) -> MonitorRole:
        # For the role's whole life, not one holding: it notes revisions all along and compacts while held.
        self._compactor = Compactor(self.settings.client(), *self.compaction, say=self.say, active=self.held.is_set)
        self._compactor.start()
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._compactor is not None:
            self._compactor.stop(timeout)
        if self.status is not None:
            self.status.close()
        if self.events is not None:
            self.events.close()

    def holder(self, client: ec.EtcdClient) -> Optional[str]:
        value, _ = client.get(self.key)
        return value.decode() if value is not None else None

    def _run(self) -> None:
        client = self.settings.client()
        while not self._stop.is_set():
            try:
                # The lease's clock starts before it is asked for: etcd may count from any moment after.
                granted = time.monotonic()
                lease = client.lease_grant(self.ttl)
                answer = client.txn(
                    [ec.cmp_version(self.key, 0)],
                    [ec.op_put(self.key, self.name.encode(), lease)],
                    [ec.op_get(self.key)],
                )
                if not ec.created_in(answer, lease):
                    self._note_holder(answer)
                    client.lease_revoke(lease)
                    self._stop.wait(CAMPAIGN_PERIOD)
                    continue
                self._hold(client, lease, granted)
                if self._gave_up:  # let another launcher take the role before campaigning again
                    self._gave_up = False
                    self._stop.wait(self.ttl + CAMPAIGN_PERIOD)
            except RecoverError as exc:  # etcd unreachable: no role, try again
                if self.held.is_set():
                    self.held.clear()
                self.say(f"monitor role: etcd not reachable ({exc}); retrying")
                self._stop.wait(CAMPAIGN_PERIOD)
        client.close()

    def _note_holder(self, answer: dict) -> None:
        """The holder named in a lost campaign's answer (its ``get`` of the key), for the 503 page."""
        try:
            kv = ec.first_kv(answer["responses"][0])
            self.holder_name = ec.unb64(kv.get("value")).decode() if kv else "nobody"
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            pass  # keep the last name read: the page only says who else monitors

    def _hold(self, client: ec.EtcdClient, lease: int, renewed: float) -> None:
        """Monitor while the lease lives; give the role up (revoke) when stopped."""
        self.taken_at = time.monotonic()
        self.lease = lease
        self.held.set()
        board = StatusBoard(self.replicas, self.replica_size, f"etcd, held by {self.name}", self.events)
        if self.status is not None:
            self.status.board = board  # served from the moment the role is said taken
        self.say(f"monitor role taken by {self.name}")
        lost = threading.Event()
        monitor = threading.Thread(target=self._monitor, args=(lost, board), name="lr-monitor", daemon=True)
        monitor.start()
        # Renew at a third of the TTL; a renewal counts from when it was sent. Give up the role
        # (stop monitoring) once the lease may have expired in etcd's eyes.
        renew_client = client.clone()
        renew_client.timeout = max(0.2, self.ttl / 3)
        try:
            while not self._stop.wait(self.ttl / 3):
                if not monitor.is_alive():  # its monitor ended: a role kept without one declares nobody dead
                    self.say(f"monitor of {self.name} ended: the role is given up for another launcher")
                    self._gave_up = True
                    client.lease_revoke(lease)
                    break
                sent = time.monotonic()
                try:
                    if renew_client.lease_keepalive(lease) > 0:
                        renewed = sent
                except RecoverError:
                    pass
                if time.monotonic() - renewed >= self.ttl:
                    self.say(f"monitor role of {self.name} lost: lease not renewed for {self.ttl}s")
                    break
            else:
                client.lease_revoke(lease)  # handing over at once, not after the TTL
        finally:
            lost.set()
            monitor.join(5.0)
            self.held.clear()
            self.lease = 0
            self.holder_name = "nobody (a new holder is being elected)"
            if self.status is not None:
                self.status.board = None
            renew_client.close()

    def _monitor(self, stop: threading.Event, board: Optional[StatusBoard] = None) -> None:
        store = self.settings.store()
        store.fence = Fence(self.key, self.lease)  # etcd refuses its requests once another holds the role
        try:
            coordinator.run_monitor(
                store,
                self.sealer,
                self.replicas,
                self.heartbeat_timeout,
                self.hang_timeout,
                stop,
                self.replica_size,
                poll_period=MONITOR_POLL,
                board=board,
            )
        except Exception as exc:  # etcd lost, fenced out, or a fault: the lease loop gives the role up
            self.say(f"monitor of {self.name} stopped: {type(exc).__name__}: {exc}")
        finally:
            store.close()  # its connection and its watched view


class EtcdCoordinator:
    """What the launcher holds instead of a coordinator process when the control plane is etcd: the
    address its replicas get (the etcd URL) and this launcher's candidacy for the monitor role."""

    def __init__(self, settings: EtcdSettings, role: MonitorRole) -> None:
        self.settings = settings
        self.role = role
        self.addr = settings.url

    def running(self) -> bool:
        return True  # nothing of this launcher's own can exit; losing etcd shows on the link

    def exited(self) -> Optional[str]:
        return None

    def frozen(self) -> bool:
        return False

    def describe(self) -> str:
        return f"etcd control plane {self.addr}, job {self.settings.job!r}"

    def kill(self) -> None:
        self.role.stop()

    def stop(self, timeout: float = 5.0) -> None:
        self.role.stop(timeout)


def forget_job(settings: EtcdSettings) -> None:
    """Delete every key of the job (at its end, by its only launcher); an unreachable etcd is only said."""
    client = settings.client(timeout=2.0)
    try:
        prefix = settings.prefix.encode()
        client.delete(prefix, ec.prefix_end(prefix))
    except RecoverError:
        pass  # the keys stay until `etcdctl del --prefix`; they name a finished job only
    finally:
        client.close()
