"""Every environment variable lightning-recover reads or sets, with its meaning, in one place.

The launchers (``lightning-recover run``/``torchrun``, ``fabric.launch()``, the Trainer) set the
replica variables for each process they start; a user sets them only when starting replicas by
hand (multi-host jobs). Modules import the names from here rather than spelling them out.
"""

from __future__ import annotations

import os

#: ``HOST:PORT`` of the coordinator (set by the launcher in every replica).
COORDINATOR = "LIGHTNING_RECOVER_COORDINATOR"
#: Which control plane the job uses: unset or ``embedded`` = the TCPStore coordinator the launcher starts
#: (one host's default); ``etcd://HOST:PORT[,HOST:PORT...]`` = an etcd cluster (v3 API, TLS with client
#: certificates from the three variables below); ``etcd+insecure://...`` = plain-text etcd, accepted on
#: loopback addresses only (experiments). ``--control-plane`` and ``control_plane=`` set the same.
CONTROL_PLANE = "LIGHTNING_RECOVER_CONTROL_PLANE"
#: CA certificate (PEM) that signed the etcd members' certificates (etcdctl's ``--cacert``).
ETCD_CACERT = "LIGHTNING_RECOVER_ETCD_CACERT"
#: Client certificate (PEM) this process presents to etcd (etcdctl's ``--cert``).
ETCD_CERT = "LIGHTNING_RECOVER_ETCD_CERT"
#: Private key of :data:`ETCD_CERT` (etcdctl's ``--key``); keep it 0600.
ETCD_KEY = "LIGHTNING_RECOVER_ETCD_KEY"
#: The job's name on a shared control plane: every key of the job lives under ``/lightning-recover/<JOB>/``
#: in etcd. The launchers of one job (one per host) must be given the same name (``--job``); a
#: single launcher makes a fresh one.
JOB = "LIGHTNING_RECOVER_JOB"
#: This process's replica id, ``0 <= id < REPLICAS`` (set by the launcher per replica).
REPLICA = "LIGHTNING_RECOVER_REPLICA"
#: Set instead of :data:`REPLICA` in a warm standby process (``--standby S``): its standby id, unique in
#: the job. It starts like a replica (imports, model, data), then waits at its connection to the
#: coordinator until the launcher assigns it the id of a replica that died, and goes on as that
#: replica's next incarnation (see :mod:`lightning_recover.protocol.standby`).
STANDBY = "LIGHTNING_RECOVER_STANDBY"
#: Number of replicas of the job (set by the launcher; checked against the coordinator's count): ``N``, or
#: ``MIN:MAX`` for a job that grows (torchrun's ``--nnodes MIN:MAX``): ids are ``0..MAX-1``, training starts
#: once MIN replicas are in, and a replica started later is admitted at a commit while fewer than MAX are live.
REPLICAS = "LIGHTNING_RECOVER_REPLICAS"
#: Path of a 0600 file holding the job's secret (hex) that authenticates every control message;
#: the launchers make one per job. Multi-host jobs give the same file to every process.
SECRET_FILE = "LIGHTNING_RECOVER_SECRET_FILE"
#: The job's secret as hex, where a file is impractical (it is visible to this user's processes).
SECRET = "LIGHTNING_RECOVER_SECRET"
#: Processes per replica, ``K`` (set by the launcher; absent or 1 = one process per replica). With
#: K > 1 the replica shards its model over its K processes (FSDP2) and is still the failure unit.
REPLICA_SIZE = "LIGHTNING_RECOVER_REPLICA_SIZE"
#: This process's position inside its replica, ``0 <= inner < K`` (set by the local launcher). Under
#: one torchrun job per replica it may be absent: torchrun's ``RANK`` (rank within the replica's
#: job, across its nodes) is the inner position then; LOCAL_RANK is not (it restarts per node).
INNER = "LIGHTNING_RECOVER_INNER"
#: Fault plan, e.g. ``kill:replica=2:step=5:phase=backward`` (set by ``--inject``; tests and demos).
INJECT = "LIGHTNING_RECOVER_INJECT"
#: The file a ``pause`` fault waits for: the paused process goes on once it exists (tests that order events
#: across processes open it on the event they wait for).
PAUSE_GATE = "LIGHTNING_RECOVER_PAUSE_GATE"
#: Unix socket of this host's watch relay (``control_plane/watch_relay.py``), set by a launcher on etcd that runs
#: one: the process follows the relay's view of the job's keys instead of opening a watch stream of its own.
WATCH_RELAY = "LIGHTNING_RECOVER_WATCH_RELAY"
#: HOST:PORT of a ``lightning-recover watch-relay`` that a launcher's own relay follows instead of watching etcd
#: (``--watch-upstream``).
WATCH_UPSTREAM = "LIGHTNING_RECOVER_WATCH_UPSTREAM"
#: The rack a launcher's host is in (``--watch-rack``): the launchers of one rack elect one of their relays to watch
#: etcd and serve the others (``control_plane/rack_relay.py``).
WATCH_RACK = "LIGHTNING_RECOVER_WATCH_RACK"
#: The address a launcher serves its rack's relay on where elected (``--watch-rack-address``; default: the address
#: its host reaches etcd from).
WATCH_RACK_ADDRESS = "LIGHTNING_RECOVER_WATCH_RACK_ADDRESS"
#: The job's private temporary directory (0700; it holds the job secret), made by the launcher and removed
#: when the job ends, even after a SIGKILLed launcher (``launch/job_dir.py``). torchrun agents keep their
#: temporaries there.
JOB_DIR = "LIGHTNING_RECOVER_JOB_DIR"
#: ``1``: ``scripts/setup.sh`` goes on without the system packages it cannot install (liburing-dev, fio,
#: etcd); the tests that need them then skip. Refused under ``CI=true``.
ALLOW_MISSING = "LIGHTNING_RECOVER_ALLOW_MISSING"
#: JSON of the demo's arguments, handed by the demo's launcher to its replica processes.
DEMO_ARGS = "LIGHTNING_RECOVER_DEMO_ARGS"
#: ``on`` allocates fresh storages of >= 1 MiB 4096-aligned on checkpoint load so native_io reads
#: them zero-copy (default ``off``: it measured slower in wall time here, see benchmarks/LOG.md).
ALIGNED_ALLOC = "LIGHTNING_RECOVER_ALIGNED_ALLOC"
#: ``off``: loads into fresh tensors leave every page fault to the reader thread, as before
#: ``checkpoint/file/page_populate.py`` (for before/after measurements). Default ``on``: files of large records have
#: their fresh storages' pages populated on a second thread beside the reads.
POPULATE = "LIGHTNING_RECOVER_POPULATE"
#: ``off``: format-2 saves pickle through ``torch.serialization._save`` only, never the fast pickler
#: (``checkpoint/file/torch_zip.py``; for before/after measurements). Default ``on``.
FAST_PICKLER = "LIGHTNING_RECOVER_FAST_PICKLER"
#: Space reserved ahead of checkpoint writes, with the file size set (``checkpoint/reservation.py``). ``on``: the
#: streaming single-file save grows a reservation ahead of its writes, and the DCP writer and the async saver
#: reserve their estimated size at open. Default ``auto`` (and ``off``): none; the writes extend the file. The
#: growing reservation measured faster before the engine's arena moved to huge pages and 20% slower after it
#: (docs/native_io.md, "Preallocation ...").
PREALLOCATE = "LIGHTNING_RECOVER_PREALLOCATE"
#: Whether ``UringCheckpointIO`` keeps the file of a checkpoint it removes (``save_top_k``) or replaces (``last.ckpt``)
#: as the next save's temporary file in that directory, so the save overwrites allocated blocks
#: (``checkpoint/file/spare_files.py``; docs/checkpointing.md, "Recycled files"). ``off`` (default): removed files
#: are unlinked at once; ``on``: kept on ext4 and XFS; ``any``: kept on any local filesystem.
RECYCLE = "LIGHTNING_RECOVER_RECYCLE"
#: Page-cache handling of ``bench checkpoint`` loads: ``auto`` (drop caches when root), ``drop``
#: or ``keep``; the ``--cache`` flag wins.
BENCH_CACHE = "LIGHTNING_RECOVER_BENCH_CACHE"
#: ``software`` forces native_io's portable crc32c instead of SSE4.2 (read by the C extension;
#: used by the tests to check that both implementations agree).
NATIVE_IO_CRC32C = "NATIVE_IO_CRC32C"
#: Build switch of setup.py: any value builds native_io without the io_uring engine.
NATIVE_IO_NO_URING = "NATIVE_IO_NO_URING"
#: Build switch of setup.py: ``1`` (any value but empty or ``0``) also builds the test build
#: ``native_io._native_io_testing`` (the fault injection the tests use); without it a build has none.
#: ``scripts/setup.sh`` sets it; the tests that need the module skip without it (fail under ``CI=true``).
NATIVE_IO_TESTING = "NATIVE_IO_TESTING"
#: Set by the launcher's fork server for itself only: a long dummy value that reserves room in the server's
#: environment area, which each forked replica rewrites with its own environment (``launch/fork_server.py``,
#: ``show_as``); the replicas never see it.
FORK_ROOM = "LIGHTNING_RECOVER_FORK_ROOM"
#: Path of a warm fork server's socket (``lightning-recover fork-server --socket PATH``): the launchers' replicas
#: and standbys are then forked by it, torch and Lightning already imported, instead of by a fork server each
#: job starts (and waits for). Used only where the server runs like the job would: same interpreter, user,
#: namespaces, cgroup and import-time environment (``launch/warm_fork_server.py``); otherwise the job starts its own.
FORK_SERVER = "LIGHTNING_RECOVER_FORK_SERVER"
#: Set by a replica's torchrun agent for its workers: a file a worker that leaves on a notice creates before it
#: exits 0 (torchrun's agent restarts a worker that exits with any other code while it has restarts left); the
#: agent then exits ``EXIT_LEFT_ON_NOTICE`` (``launch/torchrun_agent.py``).
LEFT_MARKER = "LIGHTNING_RECOVER_LEFT_MARKER"
#: ``1`` runs the heaviest manual test, the 2-D (FSDP x TP) replicas of 4 processes (8-12 processes) in
#: ``tests/integration/test_sharded.py``; it is skipped otherwise (read by the tests only).
HEAVY = "LIGHTNING_RECOVER_HEAVY"
#: Set to 1 for replica processes by the launchers: spinning OpenMP threads made a 256 KB gloo
#: all-reduce 20x slower on a 2-core machine.
OMP_NUM_THREADS = "OMP_NUM_THREADS"
#: torch's C++ log level; the launchers set ``ERROR`` for replica processes unless it is set (c10d warns on every
#: timed-out store wait, and the replicas wait in short slices on purpose: ``launch/supervisor.py``).
TORCH_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"

#: The signal a replica takes as a preemption notice (``SIGTERM`` by default, e.g. ``SIGUSR1`` for Slurm's
#: ``--signal=USR1@60``; set by ``--notice-signal``, or ``notice_signal=`` of the strategies): the replica
#: finishes its step, commits it with the others and leaves, exiting with ``EXIT_LEFT_ON_NOTICE`` (75,
#: ``protocol/notice.py``), which the launchers do not restart.
NOTICE_SIGNAL = "LIGHTNING_RECOVER_NOTICE_SIGNAL"

#: ``1`` in the coordinator process (set by the launcher that starts it): a control process that never
#: runs Lightning, so ``import lightning_recover`` skips importing Lightning to register the
#: strategies (seconds of start-up before any replica can start).
CONTROL_PROCESS = "LIGHTNING_RECOVER_CONTROL_PROCESS"
#: The nice value of the control plane's processes on a shared host, e.g. ``-10``: the coordinator process and the
#: launcher (the processes it starts go back to the launcher's own). They then answer and renew before the training
#: processes that take every core, which would otherwise starve them past their bounds. A negative value needs root
#: or CAP_SYS_NICE: a launcher refuses one it may not take, with one line. Unset: the launcher's own
#: (``control_plane/priority.py``).
CONTROL_NICE = "LIGHTNING_RECOVER_CONTROL_NICE"

#: What a replica process needs to find its group.
REPLICA_VARIABLES = (COORDINATOR, REPLICA, REPLICAS)
#: What points a process at an etcd control plane (handed on by the launchers with the job's variables).
ETCD_VARIABLES = (CONTROL_PLANE, ETCD_CACERT, ETCD_CERT, ETCD_KEY, JOB)


def in_replica() -> bool:
    """True inside a replica process started by a lightning-recover launcher (a standby included)."""
    return REPLICA in os.environ or STANDBY in os.environ


def device_slot() -> int:
    """Which of the node's accelerators this process uses: replica r's process i takes r*K + i; a
    standby takes a slot after all replicas' (it keeps its device when it takes a replica's place)."""
    if STANDBY in os.environ:  # started as a standby: its slot stays after it takes a replica's place
        base = replica_range(os.environ.get(REPLICAS, "1"))[1] + int(os.environ[STANDBY])
    else:
        base = int(os.environ.get(REPLICA, "0"))
    return base * replica_size() + inner_rank()


def replica_range(text: str) -> tuple[int, int]:
    """``"N"`` -> ``(N, N)``; ``"MIN:MAX"`` -> ``(MIN, MAX)``; ``ValueError`` with a HINT otherwise."""
    low, sep, high = str(text).strip().partition(":")
    try:
        found = (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise ValueError(
            f"replicas {text!r} is not an integer N or a range MIN:MAX. HINT: e.g. 4, or 2:4 to start with 2 "
            "replicas and admit up to 4."
        ) from None
    if not 1 <= found[0] <= found[1]:
        raise ValueError(
            f"replicas {text!r}: a job has at least 1 replica (N, or MIN:MAX with 1 <= MIN <= MAX). HINT: e.g. 4, "
            "or 2:4 to start with 2 replicas and admit up to 4."
        )
    return found


def replica_size() -> int:
    """K, the number of processes of each replica (1 unless the launcher says otherwise)."""
    return int(os.environ.get(REPLICA_SIZE, "1"))


def inner_rank() -> int:
    """This process's position inside its replica (see :data:`INNER`)."""
    if INNER in os.environ:
        return int(os.environ[INNER])
    if replica_size() > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return 0


def flag(name: str, default: str = "off") -> str:
    """The value of an on/off style variable, lower-cased."""
    return os.environ.get(name, default).strip().lower()
