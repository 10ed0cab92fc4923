"""A local etcd cluster with TLS client certificates: ``lightning-recover etcd up/down --dir D``.

For tests, the docs and trying the etcd control plane out on one machine. ``up`` makes a CA and
certificates with ``openssl`` (server certificate with SANs for every member address, a client
certificate for client-cert auth, peer traffic on TLS too), starts ``members`` etcd processes and
waits until the cluster has a leader; it writes ``D/cluster.json`` (endpoints, pids, the client
cert paths) and prints the environment that points lightning-recover at it. ``down`` ends the
members by the pids in ``cluster.json`` (each checked to be that etcd, by its command line).

Start-up is parameterized by listen address (``hosts``: one per member) and by a command prefix per
member (``wrap``, e.g. ``["ip", "netns", "exec", "hA"]``) so that network-namespace tests can put
each member on its own "host".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_recover import env
from lightning_recover.errors import RecoverError
from lightning_recover.launch.process_tree import stop_process

#: Shorter than etcd's own defaults (100 ms / 1000 ms): a leader's death stalls writes for etcd's election, whose
#: timer fires 1-2x the election timeout after the last beat, so the stall bound "election timeout + 0.5 s" needs
#: a short timeout; this one still held no spurious election in loaded failure-free runs (the measurements:
#: benchmarks/figures/etcdperf.md). etcd needs the election timeout >= 5 x the heartbeat interval.
DEFAULT_HEARTBEAT_MS = 50
DEFAULT_ELECTION_MS = 250
#: etcd keeps every revision until someone compacts; a job's beats and commits would fill its quota (NOSPACE
#: stops every write). Members of `etcd up` compact what is older than this themselves (etcd's periodic mode:
#: it compacts once per retention period); the job's monitor also compacts (``etcd_compaction``).
AUTO_COMPACTION_RETENTION = "1m"
#: Days the certificates of `etcd up` are valid (the CA's included): a local cluster for tests and trials.
CERT_DAYS = 30
_STATE = "cluster.json"


def member_environment(members: int) -> dict[str, str]:
    """A local member's environment: Go's ``GOMAXPROCS`` set to the member's share of this host's cores,
    unless the caller set it. Go gives every process all the cores by default; members sharing a host
    (with the job's processes) then spend CPU on idle runtime threads (measured in
    benchmarks/figures/etcdperf.md)."""
    out = dict(os.environ)
    out.setdefault("GOMAXPROCS", str(max(1, len(os.sched_getaffinity(0)) // members)))
    return out


_LOWEST_PORT = 10000


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (0 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _free_port(host: str) -> int:
    """A port free now, below the kernel's ephemeral range where there is room: a port from that range can be
    taken by any outgoing connection of this host between this check and the member's own bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    candidates = random.sample(range(_LOWEST_PORT, low), min(64, low - _LOWEST_PORT)) if low > _LOWEST_PORT else []
    for port in [*candidates, 0]:
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # taken: the next
            return s.getsockname()[1]
    raise OSError(f"no free port on {host}")


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def make_certificates(directory: str, hosts: Sequence[str]) -> dict[str, str]:
    """A CA, a server/peer certificate for ``hosts`` (SAN IPs) and a client certificate, by openssl.

    Returns the paths: ``cacert``, ``server_cert``, ``server_key``, ``cert``, ``key``.
    """
    if shutil.which("openssl") is None:
        raise RecoverError("openssl is not installed. HINT: apt-get install openssl")
    os.makedirs(directory, exist_ok=True)
    p = {
        k: os.path.join(directory, v)
        for k, v in {
            "cacert": "ca.crt",
            "cakey": "ca.key",
            "server_cert": "server.crt",
            "server_key": "server.key",
            "cert": "client.crt",
            "key": "client.key",
        }.items()
    }
    sans = ",".join(sorted({f"IP:{h}" for h in hosts} | {"IP:127.0.0.1", "DNS:localhost"}))
    ext = os.path.join(directory, "san.cnf")
    with open(ext, "w") as f:
        f.write(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n")
    client_ext = os.path.join(directory, "client.cnf")
    with open(client_ext, "w") as f:
        f.write("extendedKeyUsage=clientAuth\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    days = str(CERT_DAYS)
    old = os.umask(0o077)  # keys readable by this user only
    try:
        run(
            *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", days),
            *("-subj", "/CN=lightning-recover test CA", "-keyout", p["cakey"], "-out", p["cacert"]),
            *("-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"),
        )
        for name, cn, extfile in (("server", "etcd member", ext), ("", "lightning-recover", client_ext)):
            cert, key = (p["server_cert"], p["server_key"]) if name else (p["cert"], p["key"])
            csr = cert + ".csr"
            run(
                *("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"),
                *("-subj", f"/CN={cn}", "-keyout", key, "-out", csr),
            )
            run(
                *("x509", "-req", "-in", csr, "-CA", p["cacert"], "-CAkey", p["cakey"], "-CAcreateserial"),
                *("-days", days, "-out", cert, "-extfile", extfile),
            )
            os.remove(csr)
    finally:
        os.umask(old)
    return p


@dataclass
class Member:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: str
    proc: subprocess.Popen | None = None
    pid: int | None = None

    def client_url(self, tls: bool) -> str:
        return _url("https" if tls else "http", self.host, self.client_port)

    def peer_url(self, tls: bool) -> str:
        return _url("https" if tls else "http", self.host, self.peer_port)

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.client_port}" if ":" in self.host else f"{self.host}:{self.client_port}"


@dataclass
class LocalEtcdCluster:
    """``members`` etcd processes in ``directory`` (one data dir each); :meth:`start` / :meth:`stop`.

    In-process use (tests)::

        with LocalEtcdCluster(tmp_path) as cluster:
            cluster.url   # etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3
            cluster.tls   # {"cacert": ..., "cert": ..., "key": ...}
    """

    directory: str
    members_count: int = 3
    hosts: Sequence[str] = ("127.0.0.1",)
    tls: bool = True
    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS
    election_ms: int = DEFAULT_ELECTION_MS
    wrap: Sequence[Sequence[str]] | None = None  # a command prefix per member (network namespaces)
    etcd: str = "etcd"
    #: etcd's ``--quota-backend-bytes`` (None: etcd's default, 2 GiB); tests reach NOSPACE with a tiny one
    quota_backend_bytes: int | None = None
    #: etcd's periodic ``--auto-compaction-retention`` (None: the members never compact by themselves)
    auto_compaction: str | None = AUTO_COMPACTION_RETENTION
    #: ``{member index: (certificate, key)}`` a member serves to clients instead of the cluster's (tests of
    #: a member whose certificate its clients refuse); peers still use the cluster's
    client_facing_certs: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: the members' nice value (negative: root only), also their session's autogroup's. A production cluster
    #: has cores of its own; members that share their cores with the job and other work stall requests past
    #: the clients' deadline
    nice: int = 0
    #: where the members' data directories (their write-ahead logs) go; None: ``directory``. etcd asks for a
    #: device of its own for its log: every write waits for its fsync
    data_root: str | None = None
    members: list[Member] = field(default_factory=list)
    certs: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = os.path.abspath(str(self.directory))

    # ------------------------------------------------------------------ addresses
    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def url(self) -> str:
        """The control-plane URL lightning-recover takes (``LIGHTNING_RECOVER_CONTROL_PLANE``)."""
        return ("etcd://" if self.tls else "etcd+insecure://") + ",".join(self.endpoints)

    @property
    def tls_files(self) -> dict[str, str]:
        return {k: self.certs[k] for k in ("cacert", "cert", "key")} if self.tls else {}

    def environment(self) -> dict[str, str]:
        """The variables that point lightning-recover at this cluster."""
        out = {env.CONTROL_PLANE: self.url}
        if self.tls:
            out.update({env.ETCD_CACERT: self.certs["cacert"], env.ETCD_CERT: self.certs["cert"]})
            out[env.ETCD_KEY] = self.certs["key"]
        return out

    # ------------------------------------------------------------------ life cycle
    def start(self, timeout: float = 30.0) -> LocalEtcdCluster:
        if shutil.which(self.etcd) is None:
            raise RecoverError(
                f"{self.etcd!r} is not installed. HINT: apt-get install etcd-server (scripts/setup.sh does it)"
            )
        os.makedirs(self.directory, exist_ok=True)
        hosts = list(self.hosts) * self.members_count if len(self.hosts) == 1 else list(self.hosts)
        if len(hosts) != self.members_count:
            raise ValueError(f"hosts: one address, or one per member ({self.members_count}), got {list(self.hosts)}")
        # A data directory remembers its cluster's members and peer ports: a new cluster on it never elects.
        data = [os.path.join(self.data_root or self.directory, f"m{i}.etcd") for i in range(len(hosts))]
        stale = [d for d in data if os.path.exists(d)]
        if stale:
            raise RecoverError(
                f"{stale[0]} holds the data of an earlier cluster, which a new one cannot use. HINT: "
                f"`lightning-recover etcd down --dir {self.directory}` removes it, or use another --dir"
            )
        if self.tls:
            self.certs = make_certificates(os.path.join(self.directory, "pki"), sorted(set(hosts)))
        self.members = [Member(f"m{i}", h, _free_port(h), _free_port(h), data[i]) for i, h in enumerate(hosts)]
        try:
            for i in range(len(self.members)):
                self._spawn(i, "new")
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self._write_state()
        return self

    def _command(self, i: int, state: str) -> list[str]:
        m, tls = self.members[i], self.tls
        initial = ",".join(f"{o.name}={o.peer_url(tls)}" for o in self.members)
        cmd = [
            *(self.wrap[i] if self.wrap else []),
            self.etcd,
            *("--name", m.name, "--data-dir", m.data_dir),
            *("--listen-client-urls", m.client_url(tls), "--advertise-client-urls", m.client_url(tls)),
            *("--listen-peer-urls", m.peer_url(tls), "--initial-advertise-peer-urls", m.peer_url(tls)),
            *("--initial-cluster", initial, "--initial-cluster-state", state),
            *("--initial-cluster-token", "lr-" + os.path.basename(self.directory)),
            *("--heartbeat-interval", str(self.heartbeat_ms), "--election-timeout", str(self.election_ms)),
            *("--log-level", "warn", "--logger", "zap"),
        ]
        if self.quota_backend_bytes:
            cmd += ["--quota-backend-bytes", str(self.quota_backend_bytes)]
        if self.auto_compaction:
            cmd += ["--auto-compaction-mode", "periodic", "--auto-compaction-retention", self.auto_compaction]
        if tls:
            c = self.certs
            cert, key = self.client_facing_certs.get(i, (c["server_cert"], c["server_key"]))
            cmd += ["--cert-file", cert, "--key-file", key]
            cmd += ["--trusted-ca-file", c["cacert"], "--client-cert-auth"]
            cmd += ["--peer-cert-file", c["server_cert"], "--peer-key-file", c["server_key"]]
            cmd += ["--peer-trusted-ca-file", c["cacert"], "--peer-client-cert-auth"]
        return cmd

    def _spawn(self, i: int, state: str) -> None:
        m = self.members[i]
        log = open(os.path.join(self.directory, f"{m.name}.log"), "ab")
        # Its own session: a Ctrl-C in the terminal of `etcd up` must not reach the members.
        command = self._command(i, state)
        m.proc = subprocess.Popen(
            ["nice", "-n", str(self.nice), *command] if self.nice else command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=member_environment(len(self.members)),
        )
        log.close()
        m.pid = m.proc.pid
        if self.nice:
            _set_autogroup_nice(m.pid, self.nice)

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start member ``i`` again (after :meth:`kill`) on its data dir; it rejoins the cluster."""
        self._spawn(i, "existing")
        self._write_state()
        self.wait_ready(timeout)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        m = self.members[i]
        if m.proc is not None and m.proc.poll() is None:
            m.proc.send_signal(sig)
            m.proc.wait(10)

    def freeze(self, i: int, frozen: bool = True) -> None:
        """Stop member ``i`` where it is (SIGSTOP: its connections stay open, nothing answers; this returns once
        all its threads stopped) or let it go on."""
        m = self.members[i]
        if m.proc is not None and m.proc.poll() is None:
            if frozen:
                stop_process(m.proc.pid)
            else:
                m.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 5.0) -> None:
        """End every member this object started (SIGTERM, the leader last; SIGKILL to those still running after
        ``timeout`` seconds in all). See :func:`leader_last`."""
        deadline = time.monotonic() + timeout
        running = [m for m in self.members if m.proc is not None and m.proc.poll() is None]
        for m in running:
            m.proc.send_signal(signal.SIGCONT)  # a frozen member must run to end
        for wave in leader_last([m.endpoint for m in running], self.tls_files):
            for i in wave:
                running[i].proc.terminate()
            for i in wave:
                try:
                    running[i].proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for m in running:
            if m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()

    def __enter__(self) -> LocalEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ status
    def status(self, i: int, timeout: float = 1.0) -> dict | None:
        """``/v3/maintenance/status`` of member ``i`` (None if it does not answer)."""
        return member_status(self.members[i].endpoint, self.tls_files, timeout)

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the current leader (waits up to ``timeout`` for one)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self.members):
                if m.proc is not None and m.proc.poll() is not None:
                    continue
                st = self.status(i)
                if st and st.get("leader") and st["leader"] == st["header"]["member_id"]:
                    return i
            if time.monotonic() > deadline:
                raise TimeoutError(f"no etcd leader within {timeout}s (logs in {self.directory})")
            time.sleep(0.05)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for m in self.members:
            if m.proc is not None and m.proc.poll() is not None:
                raise RecoverError(
                    f"etcd member {m.name} exited ({m.proc.returncode}) at start; see {self.directory}/{m.name}.log"
                )
        # Ready once any member names a leader (the leader itself may be one whose certificate this client
        # refuses: client_facing_certs).
        while not any(int((self.status(i) or {}).get("leader") or 0) for i in range(len(self.members))):
            if time.monotonic() > deadline:
                raise RecoverError(
                    f"no etcd leader within {timeout:g}s. HINT: see the members' logs ({self.directory}/m*.log); a "
                    "member that cannot reach the others (address, firewall) or a slow host delays the election"
                )
            time.sleep(0.05)

    def _write_state(self) -> None:
        state = {
            "url": self.url,
            "tls": self.tls_files,
            "members": [
                {"name": m.name, "pid": m.pid, "endpoint": m.endpoint, "data_dir": m.data_dir} for m in self.members
            ],
        }
        with open(os.path.join(self.directory, _STATE), "w") as f:
            json.dump(state, f, indent=1)


def member_status(endpoint: str, tls_files: dict[str, str], timeout: float = 1.0) -> dict | None:
    """``/v3/maintenance/status`` of the member at ``endpoint`` (None if it does not answer). ``tls_files``:
    ``cacert``, ``cert`` and ``key``, or empty for a plain-text member."""
    from lightning_recover.control_plane.etcd_client import EtcdClient

    client = EtcdClient([endpoint], timeout=timeout, **tls_files, allow_insecure=not tls_files)
    try:
        return client.status()
    except RecoverError:  # down, or a certificate this client refuses (client_facing_certs)
        return None
    finally:
        client.close()


#: How long a member that is being ended may take to say whether it leads.
LEADER_QUERY_TIMEOUT = 0.5


def leader_last(endpoints: list[str], tls_files: dict[str, str]) -> list[list[int]]:
    """The order in which to end these members (indexes into ``endpoints``): the followers together, then the
    member that leads (or any that does not answer, after them).

    A leader that is sent SIGTERM first hands its leadership to a peer, and waits for the handover up to etcd's
    request timeout: with every member ended at once, the peer it picked is gone and the handover never completes.
    Ended last, the leader has no peer left to hand over to, and stops without that wait."""
    return end_order([member_status(endpoint, tls_files, LEADER_QUERY_TIMEOUT) for endpoint in endpoints])


def end_order(statuses: list[dict | None]) -> list[list[int]]:
    """:func:`leader_last` from the members' statuses (None: no answer): those that follow a leader other than
    themselves first, then the rest (a leader, or a member that did not say)."""
    leads = [st is None or int(st.get("leader") or 0) in (0, int(st["header"]["member_id"])) for st in statuses]
    return [[i for i, lead in enumerate(leads) if not lead], [i for i, lead in enumerate(leads) if lead]]


def down(directory: str, timeout: float = 10.0) -> int:
    """End the members recorded in ``directory/cluster.json``, then remove what only that cluster could use
    (:func:`remove_leftovers`); return how many members were running.

    Raises:
        RecoverError: no cluster was started in ``directory`` (or it was brought down already).
    """
    path = os.path.join(os.path.abspath(directory), _STATE)
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise RecoverError(
            f"no cluster in {directory}: nothing to end (never started there, or already down). "
            f"HINT: `lightning-recover etcd up --dir {directory}` starts one"
        ) from None
    except (OSError, ValueError) as exc:
        raise RecoverError(f"cannot read {path}: {exc}. HINT: end its etcd processes by hand, then remove it") from None
    running = []
    for m in state["members"]:
        pid = int(m["pid"])
        try:  # only that etcd: a reused pid must not be signalled
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if m["data_dir"].encode() in cmdline:
            running.append((pid, m["endpoint"]))
    ended = [pid for pid, _ in running]
    deadline = time.monotonic() + timeout
    for wave in leader_last([endpoint for _, endpoint in running], state.get("tls") or {}):
        for i in wave:
            os.kill(ended[i], signal.SIGTERM)
        for i in wave:
            while os.path.exists(f"/proc/{ended[i]}") and time.monotonic() < deadline:
                time.sleep(0.05)
    for pid in ended:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
    for pid in ended:  # a SIGKILLed member is gone once its /proc entry is
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline + 5.0:
            time.sleep(0.05)
    remove_leftovers(directory, [m["data_dir"] for m in state["members"]])
    os.remove(path)
    return len(ended)


def _set_autogroup_nice(pid: int, nice: int) -> None:
    """Give ``pid``'s session ``nice``. With the scheduler's autogroups on (one group per session, the default on
    many kernels), a process's own nice only ranks it within its session: between sessions, such as a member's
    and a job's, each group weighs by the group's nice."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroups (or the process already ended): its own nice is what counts


def remove_leftovers(directory: str, data_dirs: Sequence[str]) -> list[str]:
    """Remove what a cluster that was brought down leaves and nobody can use again: the members' data
    (it names the old members and their peer ports: a new cluster on it never elects a leader) and the
    certificates with their private keys (a new ``up`` makes a new CA; the old keys would only be
    credentials lying around). The logs stay, for a post-mortem. Returns what was removed."""
    removed = []
    for d in [*data_dirs, os.path.join(directory, "pki")]:
        if os.path.isdir(d):
            shutil.rmtree(d)
            removed.append(os.path.relpath(d, directory))
    return removed


# ---------------------------------------------------------------------------- the command line


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("etcd", help="a local 3-member etcd cluster with TLS client certificates (tests, trying it out)")
    kinds = p.add_subparsers(dest="etcd_command", required=True)
    up = kinds.add_parser("up", help="make certificates, start the members, print the environment to use")
    up.add_argument("--dir", required=True, help="directory for certificates, data and logs")
    up.add_argument("--members", type=int, default=3)
    up.add_argument(
        "--host", default="127.0.0.1", help="address the members listen on (one, or comma-separated per member)"
    )
    up.add_argument("--election-timeout-ms", type=int, default=DEFAULT_ELECTION_MS)
    up.add_argument("--heartbeat-ms", type=int, default=DEFAULT_HEARTBEAT_MS)
    up.add_argument(
        "--insecure", action="store_true", help="plain-text http, no certificates (loopback experiments only)"
    )
    up.add_argument(
        "--quota-backend-bytes", type=int, default=None, help="etcd's space quota (default: etcd's own, 2 GiB)"
    )
    up.add_argument(
        "--auto-compaction-retention",
        default=AUTO_COMPACTION_RETENTION,
        help="history the members keep before compacting it (etcd's periodic mode; '' never compacts)",
    )
    up.set_defaults(func=_cmd_up)
    dn = kinds.add_parser("down", help="end the members `etcd up` started in --dir")
    dn.add_argument("--dir", required=True)
    dn.set_defaults(func=_cmd_down)


def _cmd_up(args: argparse.Namespace) -> int:
    try:
        return _up(args)
    except RecoverError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _up(args: argparse.Namespace) -> int:
    if os.path.exists(os.path.join(args.dir, _STATE)):
        print(
            f"a cluster was already started in {args.dir}. HINT: `lightning-recover etcd down --dir {args.dir}`, "
            "or another --dir",
            file=sys.stderr,
        )
        return 2
    cluster = LocalEtcdCluster(
        args.dir,
        args.members,
        hosts=args.host.split(","),
        tls=not args.insecure,
        heartbeat_ms=args.heartbeat_ms,
        election_ms=args.election_timeout_ms,
        quota_backend_bytes=args.quota_backend_bytes,
        auto_compaction=args.auto_compaction_retention or None,
    )
    cluster.start()
    print(f"# etcd cluster of {args.members} members up in {cluster.directory}; leader m{cluster.leader()}")
    for k, v in cluster.environment().items():
        print(f"export {k}={v}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    try:
        n = down(args.dir)
    except RecoverError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"ended {n} etcd member(s) of {args.dir}; removed their data (m*.etcd: it pins the old members' ports, a new "
        "`up` starts afresh) and the certificates with their private keys (pki/: nothing trusts that CA any more); "
        f"kept the logs (m*.log). `rm -r {args.dir}` removes the rest"
    )
    return 0


_ = ssl  # the client module does the TLS
