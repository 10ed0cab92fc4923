"""Several "hosts" on one machine, for multi-host tests: network namespaces behind one bridge.

    with Hosts(["coord", "h0", "h1"]) as hosts:       # root only (skips the test otherwise)
        proc = hosts.popen("h0", [...], log_path)       # runs inside h0 (`ip netns exec`)
        hosts.cut("h0")                                 # symmetric partition: h0's link down
        hosts.heal("h0")
        hosts.isolate("h1", from_hosts=["h0"])          # asymmetric: h1 drops h0's traffic only
        hosts.rejoin("h1")

Each host is a namespace with one veth pair to a bridge in the root namespace; addresses come from a
private /24 that exists only inside these namespaces (the bridge itself has no address, so nothing
the test starts can talk to anything outside them, and nothing outside can reach in). Names carry the
test process's pid and a sequence number, so parallel runs never collide. Everything is deleted on
leaving the ``with`` block, also when the test fails or times out: the processes started in the hosts
(by pid, their whole session), then the namespaces, veths and bridge.

A symmetric partition takes the host's bridge-side link down (no packet in or out). An asymmetric
one adds an nftables table inside the host that drops packets from and to the given peers'
addresses only: the host still reaches every other host (e.g. the control plane) and they it.
``tc netem`` (delay, loss) is not available on this kernel (no sch_netem).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

import pytest

_SEQ = itertools.count()
_TABLE = "lr_partition"  # the nftables table of an asymmetric partition, inside one host


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def skip_unless_possible() -> None:
    """Skip the calling test, saying why, where namespaces cannot be made here."""
    if os.geteuid() != 0:
        pytest.skip("multi-host tests need root (network namespaces, veth pairs, a bridge)")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            pytest.skip(f"multi-host tests need `{tool}` (apt-get install iproute2 nftables)")


class Hosts:
    """Named network-namespace hosts on one bridge; see the module docstring."""

    def __init__(self, names: Sequence[str]) -> None:
        skip_unless_possible()
        seq = next(_SEQ)
        self.tag = f"lr{os.getpid()}x{seq}"  # at most 12 characters: interface names take 15
        # A /24 per harness: only inside these namespaces, so parallel runs may even share one.
        self.subnet = f"10.213.{(os.getpid() * 7 + seq) % 250}"
        self.names = list(names)
        self.addr = {name: f"{self.subnet}.{i + 1}" for i, name in enumerate(self.names)}
        self.netns = {name: f"{self.tag}-{name}" for name in self.names}
        self.iface = {name: f"{self.tag}h{i}" for i, name in enumerate(self.names)}  # inside the host
        self.bridge = f"{self.tag}br"
        self._procs: list[subprocess.Popen] = []
        self._made: list[tuple[str, ...]] = []  # undo commands, run in reverse order

    # ---------------------------------------------------------------- setup and teardown
    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("ip", "link", "del", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        for name in self.names:
            ns, inner, outer = self.netns[name], self.iface[name], self.iface[name] + "b"
            _run("ip", "netns", "add", ns)
            self._made.append(("ip", "netns", "del", ns))
            _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            self._made.append(("ip", "link", "del", outer))  # gone with the namespace too; harmless then
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            self.ip(name, "addr", "add", f"{self.addr[name]}/24", "dev", inner)
            self.ip(name, "link", "set", inner, "up")
            self.ip(name, "link", "set", "lo", "up")  # torchrun --standalone rendezvous on localhost

    def close(self) -> None:
        """End every process started in the hosts, then delete what was made (never raises)."""
        for proc in reversed(self._procs):  # the last started first (replicas before their coordinator)
            _end(proc)
        for name in self.names:  # anything else still inside our namespaces was started by us
            listed = _run("ip", "netns", "pids", self.netns[name], check=False).stdout.split()
            for pid in listed:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for argv in reversed(self._made):
            _run(*argv, check=False)
        self._made.clear()

    def etc_file(self, name: str, filename: str, text: str) -> None:
        """Host ``name``'s own ``/etc/<filename>`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/<filename>``
        over it for what runs there); removed by close()."""
        if not os.path.isdir("/etc/netns"):
            os.mkdir("/etc/netns")
            self._made.append(("rmdir", "/etc/netns"))  # after the host's own (undone in reverse); kept if not empty
        directory = os.path.join("/etc/netns", self.netns[name])
        if not os.path.isdir(directory):
            os.mkdir(directory)
            self._made.append(("rm", "-rf", directory))
        with open(os.path.join(directory, filename), "w") as f:
            f.write(text)

    # ---------------------------------------------------------------- running things in a host
    def ip(self, name: str, *args: str) -> None:
        _run("ip", "-n", self.netns[name], *args)

    def exec_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns[name], *argv]

    def run(self, name: str, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_argv(name, argv), capture_output=True, text=True, timeout=timeout)

    def popen(
        self, name: str, argv: Sequence[str], log_path: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` inside host ``name`` in its own session, output to ``log_path``; ended by close()."""
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                self.exec_argv(name, argv), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._procs.append(proc)
        return proc

    # ---------------------------------------------------------------- partitions
    def cut(self, name: str) -> None:
        """Symmetric partition: host ``name``'s link to the bridge goes down."""
        _run("ip", "link", "set", self.iface[name] + "b", "down")

    def heal(self, name: str) -> None:
        _run("ip", "link", "set", self.iface[name] + "b", "up")

    def isolate(self, name: str, from_hosts: Sequence[str]) -> None:
        """Asymmetric partition: inside ``name``, drop every packet from or to ``from_hosts``' addresses
        (the rest of the network, e.g. the control plane, stays reachable both ways)."""
        peers = ", ".join(self.addr[h] for h in from_hosts)
        rules = (
            f"table inet {_TABLE} {{\n"
            f"  chain in {{ type filter hook input priority 0; policy accept; ip saddr {{ {peers} }} drop; }}\n"
            f"  chain out {{ type filter hook output priority 0; policy accept; ip daddr {{ {peers} }} drop; }}\n"
            "}\n"
        )
        proc = subprocess.run(
            self.exec_argv(name, ["nft", "-f", "-"]), input=rules, capture_output=True, text=True, timeout=30
        )
        if proc.returncode:
            raise RuntimeError(f"nft in {name} failed: {proc.stderr.strip()}")

    def rejoin(self, name: str) -> None:
        """Undo :meth:`isolate`."""
        self.run(name, ["nft", "delete", "table", "inet", _TABLE])

    def reaches(self, name: str, other: str, port: int = 9, timeout: float = 1.0) -> bool:
        """Whether host ``name`` gets an answer (accept or refusal) from ``other`` within ``timeout``."""
        code = (
            "import socket,sys\n"
            f"s=socket.socket();s.settimeout({timeout})\n"
            f"try:\n s.connect(('{self.addr[other]}',{port}))\n"
            "except ConnectionRefusedError: pass\n"
            "except OSError: sys.exit(1)\n"
        )
        return self.run(name, ["python3", "-c", code]).returncode == 0


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM the process's session, SIGKILL it after 5 s (by the leader's pid, which started it)."""
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its children, if any outlived it
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + wait
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is not None:
            break
