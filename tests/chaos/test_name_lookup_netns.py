"""A resolver that drops queries, on a namespace host (tests/hosts.py): the reverse lookup torch's TCPStore client
makes on every connection waits for the resolver's timeout, and the launcher says so in one line with the fix
(``launch/name_lookup.py``); with the fix in that host's /etc/hosts the lookup is answered at once. Root only."""

from __future__ import annotations

import os
import sys

import pytest

from tests.hosts import Hosts
from tests.jobs import ROOT

pytestmark = pytest.mark.slow

#: The resolver's timeout on the host (one try of 1 s): what each lookup then costs.
RESOLV = "options timeout:1 attempts:1\n"
PROBE = (
    "from lightning_recover.launch.name_lookup import lookup_seconds, mapped_address\n"
    "address = mapped_address('127.0.0.1')\n"
    "print(address, lookup_seconds(address, 0.3), lookup_seconds(address, 10.0))\n"
)


def _lookups(hosts: Hosts) -> tuple[str, str, float]:
    proc = hosts.run("h0", [sys.executable, "-c", PROBE], timeout=60)
    assert proc.returncode == 0, proc.stderr
    address, first, second = proc.stdout.split()
    return address, first, float(second)


@pytest.mark.timeout(300)
def test_a_dropping_resolver_is_named_by_the_launcher_and_the_hosts_line_fixes_it(tmp_path):
    with Hosts(["h0", "dns"]) as hosts:
        hosts.isolate("dns", ["h0"])  # the host's nameserver: every query to it is dropped
        hosts.etc_file("h0", "resolv.conf", f"nameserver {hosts.addr['dns']}\n{RESOLV}")
        hosts.etc_file("h0", "hosts", "127.0.0.1 localhost\n")
        address, first, second = _lookups(hosts)
        assert address == "::ffff:127.0.0.1"
        assert first == "None" and second >= 0.9, (first, second)  # waited for the resolver's timeout
        log = str(tmp_path / "run.log")
        argv = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "1", "--", sys.executable, "-c", ""]
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        launcher = hosts.popen("h0", argv, log, env)
        launcher.wait(timeout=180)
        text = open(log, errors="replace").read()
        assert "the reverse lookup of ::ffff:127.0.0.1 (127.0.0.1) took" in text, text[-3000:]
        assert "HINT: add '::ffff:127.0.0.1 localhost' to /etc/hosts" in text
        hosts.etc_file("h0", "hosts", "127.0.0.1 localhost\n::ffff:127.0.0.1 localhost\n")
        _, first, second = _lookups(hosts)
        assert first != "None" and second < 0.1, (first, second)  # answered from the file
