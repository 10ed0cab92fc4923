"""A replica's environment, parsed and range-checked where it enters.

Hand-launched replicas (multi-host jobs) set these variables themselves; a bad value used to be
silently misread (id 7 of 3 taken for a restart, id -1 for a lost coordinator, a count differing
from the coordinator's stalled for 60 s). Each bad case is refused here with a HINT instead.

Use: ``e = read_replica_env()`` before connecting, then, once connected,
``check_against_coordinator(store.get("meta/replicas"), e.replicas)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_recover import env
from lightning_recover.control_plane.connect import check_address


@dataclass(frozen=True)
class ReplicaEnv:
    addr: str  # HOST:PORT of the coordinator
    replica: int  # 0 <= replica < replicas; -1 for a standby until it is assigned one
    replicas: int  # >= 1; MAX of ``MIN:MAX``
    standby: int | None = None  # the standby id of a warm standby (env.STANDBY), else None
    min_replicas: int | None = None  # MIN of ``MIN:MAX`` (None: the same as replicas)


def _int(environ: Mapping[str, str], name: str, example: str) -> int:
    raw = environ[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer. HINT: e.g. {name}={example}") from None


def read_replica_env(environ: Mapping[str, str] | None = None) -> ReplicaEnv:
    """The replica variables of ``environ`` (default ``os.environ``), validated; ``ValueError`` if bad."""
    environ = os.environ if environ is None else environ
    standby = None
    if env.STANDBY in environ and env.REPLICA not in environ:
        standby = _int(environ, env.STANDBY, "0")
        if standby < 0:
            raise ValueError(f"{env.STANDBY}={standby} must be >= 0. HINT: the launcher numbers standbys 0, 1, ...")
        environ = dict(environ, **{env.REPLICA: "-1"})  # checked below as the replicas' variables are
    missing = [v for v in env.REPLICA_VARIABLES if not environ.get(v, "").strip()]
    if missing:
        raise ValueError(
            f"replica environment incomplete (missing {', '.join(missing)}). HINT: start replicas with "
            "`lightning-recover run --replicas N -- ...`, or set all of "
            f"{', '.join(env.REPLICA_VARIABLES)} when starting them by hand."
        )
    addr = environ[env.COORDINATOR].strip()
    check_address(addr)
    try:
        least, replicas = env.replica_range(environ[env.REPLICAS])
    except ValueError as exc:
        raise ValueError(
            f"{env.REPLICAS}={environ[env.REPLICAS]!r}: a job has at least one replica; {exc} Set it to the "
            "--replicas the coordinator was started with."
        ) from None
    least = least if least < replicas else None  # a fixed count: no MIN
    replica = _int(environ, env.REPLICA, "0")
    if standby is not None:
        return ReplicaEnv(addr, -1, replicas, standby, least)
    if not 0 <= replica < replicas:
        raise ValueError(
            f"{env.REPLICA}={replica} is out of range for {env.REPLICAS}={replicas}: ids are 0..{replicas - 1}. "
            "HINT: give each process of the job a distinct id in that range (a restart reuses its old id)."
        )
    return ReplicaEnv(addr, replica, replicas, None, least)


def check_against_coordinator(stored: str | bytes | None, replicas: int) -> None:
    """Refuse a replica count that differs from the coordinator's ``meta/replicas``.

    ``stored`` is the value read from the coordinator after connecting (``None`` or empty if the
    coordinator never wrote it: then it is not a lightning-recover coordinator).
    """
    if isinstance(stored, bytes):
        stored = stored.decode(errors="replace")
    if stored is None or not str(stored).strip().isdigit():
        raise ValueError(
            f"the coordinator did not declare its replica count (meta/replicas={stored!r}): it is not a "
            f"lightning-recover coordinator. HINT: check {env.COORDINATOR}; start one with "
            "`lightning-recover coordinator --replicas N`."
        )
    expected = int(stored)
    if expected != replicas:
        raise ValueError(
            f"{env.REPLICAS}={replicas} but the coordinator was started for {expected} replicas. "
            f"HINT: set {env.REPLICAS}={expected} (and ids 0..{expected - 1}), or restart the coordinator "
            f"with --replicas {replicas}."
        )


def check_replica_size_against_coordinator(stored: str | bytes | None, replica_size: int) -> None:
    """Refuse a process whose replica size (K) differs from the coordinator's ``meta/replica_size``:
    a restarted replica must have the same K (and so the same mesh) to take its peers' shards."""
    if isinstance(stored, bytes):
        stored = stored.decode(errors="replace")
    expected = int(stored) if stored is not None and str(stored).strip().isdigit() else 1
    if expected != replica_size:
        raise ValueError(
            f"{env.REPLICA_SIZE}={replica_size} but the coordinator was started for replicas of {expected} "
            f"process(es). HINT: every replica, restarted ones included, must run {expected} processes "
            f"(--nproc-per-replica {expected}); its shards are taken from a peer with the same mesh."
        )
