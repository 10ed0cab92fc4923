"""The options of ``strategy="recover"``, validated where they enter."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from lightning_recover.env import NOTICE_SIGNAL, replica_range
from lightning_recover.observe.address import parse_address
from lightning_recover.protocol.notice import DEFAULT_NOTICE_SIGNAL, parse_signal

#: The replicas' default heartbeat period on the embedded coordinator; launchers check
#: ``--heartbeat-timeout`` against it.
DEFAULT_HEARTBEAT_INTERVAL = 0.1
#: The default heartbeat period on etcd is ``heartbeat_timeout`` divided by this. There a written beat is a Raft
#: write that each member applies, with CPU the replicas share, so beats are rarer than on the embedded
#: coordinator (the measurements: benchmarks/figures/etcdperf.md); four beats per timeout still tell a live
#: replica from a dead one.
ETCD_BEATS_PER_TIMEOUT = 4


def check_seconds(name: str, value: object) -> float:
    """``value`` as a finite, positive number of seconds, or ``ValueError`` saying how to fix it."""
    # bool is an int, and nan/inf pass `> 0` checks: both would silently disable a timeout.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{name} must be a positive, finite number of seconds, got {value!r}. " f"HINT: e.g. {name}=1.0"
        )
    return float(value)


def check_heartbeat_timeout(timeout: object, interval: float = DEFAULT_HEARTBEAT_INTERVAL) -> float:
    """A heartbeat timeout that can tell a healthy replica from a dead one, or ``ValueError``."""
    timeout = check_seconds("heartbeat_timeout", timeout)
    if timeout <= 2 * interval:
        raise ValueError(
            f"heartbeat_timeout ({timeout}s) must exceed twice heartbeat_interval ({interval}s), or healthy "
            f"replicas would be declared dead. HINT: heartbeat_timeout >= 5 x heartbeat_interval "
            f"(here {5 * interval:g}s) is a safe choice."
        )
    return timeout


def check_standby(standby: Any, restarts: int) -> int:
    """Validate a number of warm standbys (see :mod:`lightning_recover.protocol.standby`)."""
    if isinstance(standby, bool) or not isinstance(standby, int) or standby < 0:
        raise ValueError(f"standby must be an integer >= 0, got {standby!r}")
    if standby and restarts < 1:
        raise ValueError(
            f"standby={standby} with restarts=0: a standby takes a failed replica's place, which counts as one of "
            "its restarts. HINT: give restarts >= 1 (--restarts, torchrun --max-restarts), e.g. the failures to ride through."
        )
    return standby


@dataclass
class RecoverOptions:
    """Options of ``strategy="recover"``; see ``RecoverStrategy`` for their meaning."""

    microbatches: Optional[int] = None
    quota: str = "equal"
    #: None: DEFAULT_HEARTBEAT_INTERVAL on the embedded coordinator, heartbeat_timeout / 4 on etcd
    heartbeat_interval: Optional[float] = None
    heartbeat_timeout: float = 1.0
    hang_timeout: float = 60.0
    join_timeout: float = 60.0
    collective_timeout: float = 60.0
    startup_timeout: float = 300.0
    restarts: int = 0
    standby: int = 0
    seed: int = 0
    #: ``None``/``"embedded"`` (a coordinator process on the launcher's host) or ``"etcd://HOST:PORT,..."``
    #: (TLS files from LIGHTNING_RECOVER_ETCD_*; see docs/control_plane.md). None: LIGHTNING_RECOVER_CONTROL_PLANE.
    control_plane: Optional[str] = None
    #: Bitwise reproducible steps: every step's gradient a function of the parameters and its M
    #: microbatch ids alone, whatever fails (fixed-point reduction, protocol/exact.py).
    exact: bool = False
    #: Serve the job's status page (``/``), ``/status`` and ``/metrics`` (Prometheus) at ``[HOST:]PORT`` from the
    #: monitor (loopback unless a host is given; ``0`` = any free port, said in the log). None: off.
    status_address: Optional[str] = None
    #: Append every event of the job (deaths, recoveries, joins) to this file, one JSON object per line.
    event_log: Optional[str] = None
    #: The signal taken as a preemption notice (protocol/notice.py): the replica finishes its step and leaves.
    #: None: LIGHTNING_RECOVER_NOTICE_SIGNAL, else SIGTERM.
    notice_signal: Optional[str] = None
    #: ``"MIN:MAX"`` (or ``(MIN, MAX)``): a job that starts once MIN replicas are in and admits later ones up to
    #: MAX (``devices`` stays MAX). None: LIGHTNING_RECOVER_REPLICAS, else a fixed count (``devices``).
    replicas: Any = None
    #: Where a whole-job notice (every replica told to leave at the same step) writes a final checkpoint through
    #: the strategy's checkpoint plugin before the replicas exit; the next run of the script resumes from it.
    #: None: Fabric writes none; the Trainer writes Lightning's HPC checkpoint in its ``default_root_dir``.
    notice_checkpoint: Optional[str] = None

    def __post_init__(self) -> None:
        if self.quota not in ("equal", "throughput"):
            raise ValueError(f"quota must be 'equal' or 'throughput', got {self.quota!r}")
        if self.heartbeat_interval is not None:
            check_seconds("heartbeat_interval", self.heartbeat_interval)
        for name in (
            "heartbeat_timeout",
            "hang_timeout",
            "join_timeout",
            "collective_timeout",
            "startup_timeout",
        ):
            check_seconds(name, getattr(self, name))
        check_heartbeat_timeout(self.heartbeat_timeout, self.heartbeat_period(etcd=False))
        if self.hang_timeout <= self.heartbeat_timeout:
            raise ValueError(
                f"hang_timeout ({self.hang_timeout}s) must exceed heartbeat_timeout ({self.heartbeat_timeout}s): it is "
                "how long a replica may make no progress while its peers wait on it (a long microbatch, a checkpoint "
                "write) before it counts as hung. HINT: keep the default 60s or raise it for slow steps or checkpoint writes."
            )
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        if not isinstance(self.restarts, int) or self.restarts < 0:
            raise ValueError(f"restarts must be a non-negative integer, got {self.restarts!r}")
        check_standby(self.standby, self.restarts)
        if not isinstance(self.exact, bool):
            raise ValueError(f"exact must be True or False, got {self.exact!r}")
        if self.status_address is not None:
            parse_address(self.status_address)  # refused here, before any process starts
        if self.notice_signal is not None:
            parse_signal(self.notice_signal)
        if self.replicas is not None:
            self.replica_range()

    def replica_range(self) -> Optional[tuple[int, int]]:
        """``replicas`` as ``(MIN, MAX)`` (None when not given); ``ValueError`` with a HINT if malformed."""
        if self.replicas is None:
            return None
        if isinstance(self.replicas, (tuple, list)) and len(self.replicas) == 2:
            return replica_range(f"{self.replicas[0]}:{self.replicas[1]}")
        return replica_range(str(self.replicas))

    def resolve_notice_signal(self) -> str:
        """The notice signal's name: the option, else LIGHTNING_RECOVER_NOTICE_SIGNAL, else SIGTERM."""
        chosen = self.notice_signal or os.environ.get(NOTICE_SIGNAL) or DEFAULT_NOTICE_SIGNAL
        return parse_signal(chosen).name

    def heartbeat_period(self, etcd: bool) -> float:
        """Seconds between a replica's heartbeats: ``heartbeat_interval`` if given, else the default of the
        control plane (a beat costs a Raft write on etcd, a memory write on the embedded coordinator)."""
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return self.heartbeat_timeout / ETCD_BEATS_PER_TIMEOUT if etcd else DEFAULT_HEARTBEAT_INTERVAL

    @property
    def store_timeout(self) -> float:
        """Longest the coordinator may stay silent (one operation, or the heartbeat's answers) before
        a replica reports ``CoordinatorLostError`` and stops: ``max(5, 2 x heartbeat_timeout + 1)``
        seconds. The 5 s floor keeps a CPU-starved coordinator on a loaded small machine (measured:
        2 s silences while 20 processes start on 2 cores) from ending healthy jobs."""
        return max(5.0, 2 * self.heartbeat_timeout + 1.0)

    def resolve_microbatches(self, replicas: int) -> int:
        M = self.microbatches if self.microbatches is not None else replicas
        if M < replicas:
            raise ValueError(
                f"microbatches={M} is smaller than the number of replicas ({replicas}): some replica would "
                f"have nothing to compute. HINT: use microbatches >= {replicas} (a multiple of it balances best)."
            )
        return M
