"""The partition probe's wire (lightning_recover.protocol.probes) on loopback: a server answers many probes at once
from its one thread, a prober keeps a bounded number in flight, each with its own timeout, and one out of file
descriptors waits for its probes in flight instead of reporting a cut. The authentication and the outcomes of a
single probe: tests/integration/test_reachability.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from lightning_recover.protocol.messages import JobSecret
from lightning_recover.protocol.probes import NO_ANSWER, REACHED, ProbeServer, Target, answer, probe_all


def test_a_server_answers_many_probes_at_once_from_one_thread():
    """300 connections open at once, more than a handler thread per connection allowed (64): each gets the
    server's answer to its own nonce, and the server runs no thread but its own."""
    secret = JobSecret.generate()
    before = set(threading.enumerate())  # (earlier tests of this process may leave threads of their own)
    server = ProbeServer("127.0.0.1", secret, replica=7, incarnation=3)
    conns = []
    try:
        conns = [socket.create_connection(("127.0.0.1", server.port), timeout=10.0) for _ in range(300)]
        nonces = [os.urandom(16) for _ in conns]
        for conn, nonce in zip(conns, nonces):
            conn.sendall(b"LRP1" + nonce)
        for conn, nonce in zip(conns, nonces):
            got = b""
            while len(got) < 32:
                chunk = conn.recv(32 - len(got))
                assert chunk, "the server closed a connection unanswered"
                got += chunk
            assert got == answer(secret.key, nonce, 7, 3)
        started = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("lr-probe")]
        assert started == ["lr-probe-server-7"]
    finally:
        for conn in conns:
            conn.close()
        server.close()


def test_probes_in_flight_are_bounded_and_each_has_its_own_timeout():
    """Six peers that accept connections but never answer (frozen), three probes at a time with a 0.3 s timeout:
    two waves, so no sooner than 0.6 s; each outcome is "no answer" (no evidence of a partition)."""
    secret = JobSecret.generate()
    silent = [socket.socket() for _ in range(6)]
    try:
        for s in silent:
            s.bind(("127.0.0.1", 0))
            s.listen(8)
        targets = [Target(r, "127.0.0.1", s.getsockname()[1], 1) for r, s in enumerate(silent)]
        start = time.monotonic()
        outcomes = probe_all(targets, secret, timeout=0.3, in_flight=3)
        took = time.monotonic() - start
    finally:
        for s in silent:
            s.close()
    assert sorted(outcomes) == list(range(6))
    assert all(o == NO_ANSWER and why.endswith("no answer (timed out)") for o, why in outcomes.values()), outcomes
    assert 0.6 <= took < 0.6 + 1.0, took  # 1 s of slack for a loaded 2-core machine


_PROBER = """
import json, resource, sys
from lightning_recover.protocol.messages import JobSecret
from lightning_recover.protocol.probes import Target, probe_all
import os
spare = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
targets = [Target(*t) for t in json.loads(sys.argv[3])]
print(json.dumps(probe_all(targets, JobSecret(bytes.fromhex(sys.argv[1])), timeout=5.0)))
"""


def test_a_prober_out_of_descriptors_waits_for_its_probes_in_flight():
    """A process with 8 spare file descriptors probes 40 servers (it would open 40 sockets at once): the probes
    that find no descriptor wait for one in flight to end, and every peer is reached, none reported cut."""
    secret = JobSecret.generate()
    servers = [ProbeServer("127.0.0.1", secret, replica=r, incarnation=1) for r in range(40)]
    try:
        targets = [[s.replica, s.host, s.port, 1] for s in servers]
        out = subprocess.run(
            [sys.executable, "-c", _PROBER, secret.hex(), "8", json.dumps(targets)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        for s in servers:
            s.close()
    assert out.returncode == 0, out.stderr
    outcomes = json.loads(out.stdout)
    assert {int(r): o for r, (o, _) in outcomes.items()} == {r: REACHED for r in range(40)}
