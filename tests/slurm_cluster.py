"""A real Slurm cluster on one machine, for tests: slurmctld and one slurmd per network-namespace node.

    with SlurmCluster(["n0", "n1", "n2"], work_dir) as cluster:   # root, slurm-wlm and munge (skips otherwise)
        job = cluster.sbatch(["--nodes=2", "examples/slurm/recover.sbatch", "python", "train.py"])
        cluster.wait_state(job, {"RUNNING"}, timeout=60)
        cluster.lose_node("n1")                 # every process of n1 SIGKILLed, the node set DOWN
        cluster.wait_state(job, {"COMPLETED"}, timeout=300)
        cluster.revive_node("n1")               # slurmd again: back to IDLE (ReturnToService=2)

The nodes are :class:`tests.hosts.Hosts` (namespaces on a bridge whose addresses exist only inside them),
plus one host ``ctl`` for slurmctld; the test's own Slurm commands (sbatch, squeue, scontrol, scancel)
run inside ``ctl`` too. Every daemon runs in its host's network namespace under ``nsenter --net`` (not
``ip netns exec``, which remounts /sys: slurmd then fails on cgroups), in a UTS namespace of its own
(its hostname is the node's name) and a mount namespace of its own in which this cluster's /etc/hosts
(every host's name and address) and an /etc/resolv.conf without name servers are bound over the
machine's: names resolve without DNS, and a lookup that misses fails at once instead of waiting on a
name server nobody in the namespaces can reach (c10d's reverse lookups otherwise stall connections).
Tasks inherit their slurmd's namespaces, so a task on ``n1`` sees the hostname ``n1`` and only
``n1``'s address.

Authentication is a munged of this cluster's own (its key and seed in ``work_dir``, its socket in a
directory of its own that everyone may search, as munged requires; slurm.conf points at it), so nothing of the machine's Slurm or munge configuration is read or changed.
``SlurmdTimeout`` is low so the controller notices a lost node within seconds; ``ReturnToService=2``
lets a revived node serve again. Everything started is ended on leaving the ``with`` block, also on
failure: the jobs (scancel), the daemons, munged, then the namespaces and the bridge.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence

import pytest

from tests.hosts import Hosts

#: Seconds without an answer from a slurmd before slurmctld marks its node DOWN (Slurm's default is 300).
SLURMD_TIMEOUT = 5
CPUS_PER_NODE = 4  # logical: several jobs may share a node (growth tests place a second job)

_DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
_CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "nsenter", "unshare", "munge")

# Run inside a host: private mounts for the name files, the node's hostname, then the command.
_ENTER = (
    'mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf && hostname "$3" || exit 97; '
    'shift 3; exec "$@"'
)


def skip_unless_possible() -> None:
    """Skip the calling test, saying why, where a Slurm cluster cannot be made here."""
    if os.geteuid() != 0:
        pytest.skip("Slurm tests need root (network namespaces, the daemons)")
    for path in _DAEMONS:
        if not os.access(path, os.X_OK):
            pytest.skip(f"Slurm tests need {path} (apt-get install slurm-wlm munge; scripts/setup.sh does it)")
    for tool in _CLIENTS:
        if shutil.which(tool) is None:
            pytest.skip(f"Slurm tests need `{tool}` (apt-get install slurm-wlm munge util-linux)")


#: Seconds a requeued job waits before Slurm starts it again (the cluster's AuthInfo ``cred_expire``).
CRED_EXPIRE = 10


class SlurmHosts(Hosts):
    """:class:`Hosts` whose commands run under ``nsenter --net`` with the cluster's names and a hostname."""

    def __init__(self, names: Sequence[str], etc_dir: str) -> None:
        super().__init__(names)
        self.etc_dir = etc_dir

    def exec_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        hosts, resolv = os.path.join(self.etc_dir, "hosts"), os.path.join(self.etc_dir, "resolv.conf")
        return [
            "nsenter",
            f"--net=/var/run/netns/{self.netns[name]}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            _ENTER,
            "sh",
            hosts,
            resolv,
            name,
            *argv,
        ]


class SlurmCluster:
    """slurmctld on host ``ctl`` and a slurmd on each named node; see the module docstring."""

    def __init__(self, nodes: Sequence[str], work_dir: str, partition: str = "lr") -> None:
        skip_unless_possible()
        self.nodes = list(nodes)
        self.dir = os.path.abspath(work_dir)
        self.partition = partition
        os.makedirs(self.dir, exist_ok=True)
        # munged wants every directory above its socket searchable by all (pytest's tmp_path is 0700).
        self.sock_dir = tempfile.mkdtemp(prefix="lr-munge-")
        os.chmod(self.sock_dir, 0o755)
        self.etc = os.path.join(self.dir, "etc")
        self.conf = os.path.join(self.etc, "slurm.conf")
        self.hosts = SlurmHosts(["ctl", *self.nodes], self.etc)
        self._munged: subprocess.Popen | None = None
        self._daemons: dict[str, subprocess.Popen] = {}
        self._jobs: list[str] = []

    # ---------------------------------------------------------------- setup and teardown
    def __enter__(self) -> SlurmCluster:
        try:
            self.hosts.__enter__()
            self._write_files()
            self._start_munged()
            self._start_daemon("ctl", ["slurmctld", "-D", "-i", "-f", self.conf])
            for node in self.nodes:
                self.start_slurmd(node)
            self.wait_nodes(self.nodes, "idle", timeout=60)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel the jobs, end the daemons and munged, delete the hosts (never raises)."""
        if self._jobs and "ctl" in self._daemons and self._daemons["ctl"].poll() is None:
            self.run(["scancel", *self._jobs], check=False)
        self.hosts.close()  # every process in the namespaces (daemons, job steps, tasks), then the network
        if self._munged is not None and self._munged.poll() is None:
            self._munged.send_signal(signal.SIGTERM)
            try:
                self._munged.wait(10)
            except subprocess.TimeoutExpired:
                self._munged.kill()
                self._munged.wait()
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    def _write_files(self) -> None:
        os.makedirs(self.etc, exist_ok=True)
        for sub in ("state", "spool", "log", "munge"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        os.chmod(os.path.join(self.dir, "munge"), 0o700)
        with open(os.path.join(self.etc, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{self.hosts.addr[h]} {h}\n" for h in self.hosts.names)
        with open(os.path.join(self.etc, "resolv.conf"), "w") as f:
            f.write("# no name server: a name not in /etc/hosts fails at once\noptions timeout:1 attempts:1\n")
        key = os.path.join(self.dir, "munge", "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        with open(self.conf, "w") as f:
            f.write(self.slurm_conf())

    def slurm_conf(self) -> str:
        d, ctl = self.dir, self.hosts.addr["ctl"]
        lines = [
            f"ClusterName={self.hosts.tag}",
            f"SlurmctldHost=ctl({ctl})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: how long nodes refuse a finished job's revoked credential, so how long Slurm holds a
            # requeued job before it starts it again (120 s by default; a job started sooner fails at once).
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups: the nodes share one kernel and one cgroup tree.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "PropagateResourceLimits=NONE",
            "SlurmdParameters=config_overrides",  # a node has the CPUs slurm.conf says, whatever the machine has
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            # A requeued job becomes eligible after cred_expire, but only a pass of the main scheduling loop starts
            # it, every 60 s by default (events start other jobs at once).
            "SchedulerParameters=sched_interval=2",
            "ReturnToService=2",
            f"SlurmdTimeout={SLURMD_TIMEOUT}",
            "KillWait=5",
            "MinJobAge=600",  # finished jobs stay visible to `scontrol show job` for the tests' checks
            "InactiveLimit=0",
            "JobRequeue=1",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeAddr={self.hosts.addr[node]} CPUs={CPUS_PER_NODE} State=UNKNOWN")
        nodes = ",".join(self.nodes)
        lines.append(
            f"PartitionName={self.partition} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
        )
        return "\n".join(lines) + "\n"

    @property
    def munge_socket(self) -> str:
        return os.path.join(self.sock_dir, "munge.socket")

    def _start_munged(self) -> None:
        m = os.path.join(self.dir, "munge")
        argv = ["/usr/sbin/munged", "-F", f"--socket={self.munge_socket}", f"--key-file={m}/munge.key"]
        argv += [f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed", f"--log-file={m}/munged.log"]
        with open(os.path.join(self.dir, "log", "munged.out"), "ab") as log:
            self._munged = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.munge_socket):
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.log('munged.out')}")
            time.sleep(0.05)

    def _start_daemon(self, host: str, argv: list[str]) -> None:
        log = os.path.join(self.dir, "log", f"{argv[0]}-{host}.out")
        self._daemons[host] = self.hosts.popen(host, argv, log, self.env())

    def start_slurmd(self, node: str) -> None:
        """Start (or start again) ``node``'s slurmd, in the foreground, as the node's own hostname."""
        self._start_daemon(node, ["slurmd", "-D", "-N", node, "-f", self.conf])

    # ---------------------------------------------------------------- commands
    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, SLURM_CONF=self.conf)
        for name in list(env):
            if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF":
                del env[name]  # a test run from inside a Slurm job must not hand its job to ours
        env.update(extra)
        return env

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 30, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command on host ``ctl``; raise with its output when it fails (``check``)."""
        proc = subprocess.run(
            self.hosts.exec_argv("ctl", argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or self.env(),
        )
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, args: Sequence[str], env: dict[str, str] | None = None) -> str:
        """Submit a batch job (``sbatch --parsable ARGS``) and return its id; it is cancelled by close()."""
        out = self.run(["sbatch", "--parsable", *args], env=env).stdout.strip()
        job = out.split(";")[0]
        if not job.isdigit():
            raise RuntimeError(f"sbatch answered {out!r}")
        self._jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job -o JOB`` as a dict (empty if the controller does not know the job)."""
        proc = self.run(["scontrol", "show", "job", "-o", job], check=False)
        if proc.returncode:
            return {}
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", proc.stdout))

    def state(self, job: str) -> str:
        return self.job(job).get("JobState", "")

    def wait_state(self, job: str, states: set[str], timeout: float) -> str:
        """Poll the job's state until it is one of ``states``; fail with the job's record after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job} is {state or 'unknown'}, not {sorted(states)}, after {timeout}s: "
                    f"{self.job(job)}\n{self.log('slurmctld.log')[-3000:]}"
                )
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        out = self.run(["sinfo", "-N", "-h", "-o", "%N %t"]).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes(self, nodes: Sequence[str], state: str, timeout: float) -> None:
        """Poll sinfo until every node in ``nodes`` is in ``state`` (sinfo's short form: idle, down, alloc...)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                states = self.node_states()
            except RuntimeError:  # the controller is still starting
                states = {}
            if all(states.get(n, "").rstrip("*~#") == state for n in nodes):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"nodes {list(nodes)} not {state} after {timeout}s: {states}\n"
                    f"{self.log('slurmctld.log')[-3000:]}"
                )
            time.sleep(0.2)

    # ---------------------------------------------------------------- faults
    def lose_node(self, node: str) -> None:
        """Node loss: SIGKILL every process in ``node``'s namespace (its slurmd, job steps and tasks), then
        tell the controller it is DOWN (as its SlurmdTimeout would, later)."""
        ns = self.hosts.netns[node]
        for _ in range(3):  # a process being forked as we list may escape one pass
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=lost"])

    def revive_node(self, node: str, timeout: float = 60) -> None:
        """Start ``node``'s slurmd again and wait until the controller has it IDLE."""
        self.start_slurmd(node)
        self.wait_nodes([node], "idle", timeout)

    def log(self, name: str) -> str:
        path = os.path.join(self.dir, "log", name)
        return open(path, errors="replace").read() if os.path.exists(path) else ""
