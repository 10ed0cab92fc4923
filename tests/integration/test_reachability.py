"""Partition detection (lightning_recover.protocol.reachability): the authenticated probe on loopback, and the
judge in a real coordinator's monitor with real replicas' heartbeats and probe servers (one whose address
refuses connections: the data network to it is cut; one that never answers: a starved peer, not a partition).
The decision alone: tests/unit/test_partition_verdict.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from unittest.mock import ANY

import pytest

from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.heartbeat import Heartbeat, Progress
from lightning_recover.protocol.messages import ControlStore, JobSecret
from lightning_recover.protocol.probes import CUT, NO_ANSWER, REACHED, ProbeServer, probe
from lightning_recover.protocol.reachability import (
    PartitionJudge,
    ReachabilityResponder,
    data_address,
    exclusion_bound,
    fence_reason,
    probe_timeout_for,
    wait_until_reachable,
)


def test_probe_is_authenticated_and_bounded():
    secret = JobSecret.generate()
    server = ProbeServer("127.0.0.1", secret, replica=3, incarnation=2)
    try:
        assert probe("127.0.0.1", server.port, secret, 3, 2, timeout=2.0) == (REACHED, "")
        for other, why in [
            ((JobSecret.generate(), 3, 2), "another job's key"),
            ((secret, 3, 1), "an older incarnation"),
            ((secret, 4, 2), "another replica"),
        ]:
            outcome, said = probe("127.0.0.1", server.port, *other, timeout=2.0)
            assert (outcome, said.split(", ")[-1]) == (
                CUT,
                f"but not as this job's replica {other[1]} (incarnation {other[2]})",
            ), why
    finally:
        server.close()
    outcome, said = probe("127.0.0.1", server.port, secret, 3, 2, timeout=2.0)
    assert (
        outcome == CUT and said == f"connect to 127.0.0.1:{server.port}: Connection refused"
    ), "nobody listens any more"
    with socket.socket() as silent:  # accepts connections (the kernel does) but never answers: a frozen peer
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        start = time.monotonic()
        outcome, said = probe("127.0.0.1", silent.getsockname()[1], secret, 3, 2, timeout=0.3)
        assert outcome == NO_ANSWER and said.startswith("connected to 127.0.0.1:"), said
        assert time.monotonic() - start < 0.3 + 0.2


# The monitor's heartbeat timeout, which is also its suspect_after (the in-process harness's, tests/inprocess.py:
# heartbeats every 0.05 s); the waits below are bounds derived from it.
HEARTBEAT_TIMEOUT = 0.5
BOUND = exclusion_bound(HEARTBEAT_TIMEOUT, probe_timeout_for(HEARTBEAT_TIMEOUT))


@pytest.fixture
def coordinator():
    secret = JobSecret.generate()
    coord = Coordinator("127.0.0.1", 0, 3, HEARTBEAT_TIMEOUT, secret, hang_timeout=30.0)
    stop = threading.Event()
    thread = threading.Thread(target=coord.monitor, args=(stop,), daemon=True)
    thread.start()
    yield coord, secret
    stop.set()
    thread.join(5)


def _replicas(coord, secret, phase: str):
    """Three connected replicas that heartbeat in ``phase`` and answer probe rounds."""
    out = []
    for r in range(3):
        store = ControlStore(coord.addr, r, secret, timeout=5.0)
        inc = store.add(f"inc/{r}", 1)
        progress = Progress()
        progress.note(phase, 0)
        heartbeat = Heartbeat(store, r, inc, 0.05, progress)
        heartbeat.start()
        out.append((store, inc, heartbeat, ReachabilityResponder(store, r, inc, 0.05)))
    return out


def _close(replicas):
    for _, _, heartbeat, responder in replicas:
        responder.close()
        heartbeat.stop()


def test_judge_fences_the_member_its_peers_cannot_reach(coordinator, monkeypatch):
    """All three wait on each other (phase 'reduce', no progress). Replica 2's probe address refuses
    connections (its data network is cut): 0 and 1 cannot reach it, so it is declared dead within the stated
    bound; 0 and 1 are kept."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    replicas = _replicas(coord, secret, "reduce")
    store = replicas[0][0]
    with socket.socket() as closed:
        _publish_probe_address(store, 2, replicas[2][1], closed, listen=False)
        start = time.monotonic()
        try:
            deadline = start + BOUND + 1.0  # slack: 1 s for a loaded 2-core machine
            while time.monotonic() < deadline and store.deaths([2])[2] == 0:
                time.sleep(0.02)
            took = time.monotonic() - start
            assert store.deaths([0, 1, 2]) == {0: 0, 1: 0, 2: replicas[2][1]}, f"after {took:.2f}s"
            assert took >= HEARTBEAT_TIMEOUT, "not before the group waited suspect_after"
            verdict = json.loads(store.get("reach/1/verdict"))
            refused = f"connect to 127.0.0.1:{closed.getsockname()[1]}: Connection refused"
            evidence = [f"replica 0 -> 2: {refused}", f"replica 1 -> 2: {refused}"]
            assert verdict["keep"] == [0, 1]
            assert verdict["fenced"] == {"2": {"unreachable": [0, 1], "evidence": evidence}}
            reason = fence_reason(store, 2, replicas[2][1])
            assert (
                f"has no two-way connection with replicas [0, 1] over the data network (a network partition: "
                f"{evidence[0]}; {evidence[1]})" in reason
            )
            assert fence_reason(store, 0, replicas[0][1]) is None
            assert store.get("declared/2") == str(replicas[2][1]), "its launcher is told to end it"
        finally:
            _close(replicas)


def _verdict(store, number: int) -> dict:
    """Round ``number``'s verdict, once the judge wrote it (within the bound, plus 1 s of slack)."""
    deadline = time.monotonic() + BOUND + 1.0
    while time.monotonic() < deadline and store.get_genuine(f"reach/{number}/verdict") is None:
        time.sleep(0.02)
    return json.loads(store.get(f"reach/{number}/verdict"))


def test_a_peer_that_answers_no_probe_in_time_is_not_fenced(coordinator, monkeypatch):
    """Replica 2's probe server accepts connections but never answers (a peer starved of CPU, or frozen):
    no link is cut, so the round fences nobody (its heartbeat, not the partition judge, decides whether it
    lives)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    replicas = _replicas(coord, secret, "reduce")
    store = replicas[0][0]
    with socket.socket() as silent:
        _publish_probe_address(store, 2, replicas[2][1], silent, listen=True)
        try:
            verdict = _verdict(store, 1)
            assert verdict["keep"] == [0, 1, 2] and verdict["fenced"] == {}
            reports = [json.loads(store.get(f"reach/1/{r}")) for r in (0, 1)]
            assert all(2 not in report["reached"] and report["cut"] == [] for report in reports), reports
            assert store.deaths([0, 1, 2]) == {0: 0, 1: 0, 2: 0}
        finally:
            _close(replicas)


def test_a_member_that_sends_no_report_is_not_fenced(coordinator, monkeypatch):
    """Replica 2's probe server answers but its responder never reports (its thread starved, or the control
    plane slow for it): the others reach it, no link is cut, nobody is fenced."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    replicas = _replicas(coord, secret, "reduce")
    store = replicas[0][0]
    replicas[2][3].close()  # its responder: no more reports
    server = ProbeServer("127.0.0.1", secret, replica=2, incarnation=replicas[2][1])
    store.set("reach/addr/2", json.dumps({"inc": replicas[2][1], "host": "127.0.0.1", "port": server.port}))
    try:
        verdict = _verdict(store, 1)
        assert verdict["keep"] == [0, 1, 2] and verdict["fenced"] == {}
        assert store.get_genuine("reach/1/2") is None, "replica 2 sent no report"
        assert store.deaths([0, 1, 2]) == {0: 0, 1: 0, 2: 0}
    finally:
        server.close()
        _close(replicas)


def test_the_reason_of_a_fencing_is_found_after_later_rounds(coordinator):
    """Round 1 fenced replica 2's incarnation 1; round 2 (its next incarnation among the members)
    opened before incarnation 1's main thread asked why it was excluded: it still gets the reason
    (CI once saw the generic 'declared dead' instead, the latest round not naming it)."""
    coord, secret = coordinator
    store = ControlStore(coord.addr, 0, secret, timeout=5.0)
    fenced = {"members": {"0": 1, "1": 1, "2": 1}, "keep": [0, 1], "fenced": {"2": {"unreachable": [0, 1]}}}
    store.set("reach/1/verdict", json.dumps(fenced))
    store.set("reach/2/verdict", json.dumps({"members": {"0": 1, "1": 1, "2": 2}, "keep": [0, 1, 2], "fenced": {}}))
    store.set("reach/round", json.dumps({"round": 2, "members": {"0": 1, "1": 1, "2": 2}}))  # the latest, sealed
    store.add("reach/rounds", 2)
    assert "has no two-way connection with replicas [0, 1]" in fence_reason(store, 2, 1)
    assert fence_reason(store, 2, 1, number=2) is None
    assert fence_reason(store, 2, 2) is None and fence_reason(store, 0, 1) is None


def test_judge_fences_nobody_when_everyone_reaches_everyone(coordinator, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    replicas = _replicas(coord, secret, "regroup")
    store = replicas[0][0]
    try:
        verdict = _verdict(store, 1)
        assert verdict["keep"] == [0, 1, 2] and verdict["fenced"] == {}
        assert store.deaths([0, 1, 2]) == {0: 0, 1: 0, 2: 0}
    finally:
        _close(replicas)


def _publish_probe_address(store, replica: int, incarnation: int, sock: socket.socket, listen: bool) -> None:
    """Publish ``sock``'s address as ``replica``'s probe server: bound only, it refuses connections (the
    data network to the replica is cut); listening, the kernel accepts them but nobody answers (a frozen peer)."""
    sock.bind(("127.0.0.1", 0))
    if listen:
        sock.listen(8)
    address = {"inc": incarnation, "host": "127.0.0.1", "port": sock.getsockname()[1]}
    store.set(f"reach/addr/{replica}", json.dumps(address))


def test_a_bumped_round_counter_makes_no_replica_skip_a_round(coordinator, monkeypatch):
    """A client without the secret keeps bumping the unsealed ``reach/rounds`` while a real partition is
    judged: the responders take the round (and its number) from the sealed record, so the partitioned
    replica is still fenced within the bound."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    replicas = _replicas(coord, secret, "reduce")
    store = replicas[0][0]
    attacker = store.raw.clone()
    stop = threading.Event()

    def bump() -> None:
        while not stop.wait(0.005):
            attacker.add("reach/rounds", 1)

    bumper = threading.Thread(target=bump, name="test-round-bumper", daemon=True)
    with socket.socket() as closed:
        _publish_probe_address(store, 2, replicas[2][1], closed, listen=False)
        bumper.start()
        try:
            deadline = time.monotonic() + BOUND + 1.0
            while time.monotonic() < deadline and store.deaths([2])[2] == 0:
                time.sleep(0.02)
            assert store.deaths([0, 1, 2]) == {0: 0, 1: 0, 2: replicas[2][1]}
            assert "has no two-way connection with replicas [0, 1]" in fence_reason(store, 2, replicas[2][1])
        finally:
            stop.set()
            bumper.join(5)
            _close(replicas)


@pytest.mark.slow  # waits out a timeout or a window (1-1.7 s): kept out of `make test-fast`
def test_no_round_while_a_replica_computes(coordinator, monkeypatch):
    """A slow replica (computing) is not a partition: the others wait on it, nobody is probed."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    replicas = _replicas(coord, secret, "reduce")
    replicas[1][2]._progress.note("compute")  # noqa: SLF001  (the heartbeat reports this progress object)
    store = replicas[0][0]
    try:
        # a round would open (reach/rounds counts it) suspect_after after the group stalled; 1 s of slack over
        # that, as the tests above allow over their bounds
        time.sleep(HEARTBEAT_TIMEOUT + 1.0)
        assert store.add("reach/rounds", 0) == 0
    finally:
        _close(replicas)


@pytest.mark.slow  # waits out a timeout or a window (1-1.7 s): kept out of `make test-fast`
def test_a_restarted_replica_waits_until_it_reaches_the_live_members(coordinator, monkeypatch, capfd):
    """Before asking to rejoin, a restarted replica probes the live members; while one of them does not
    answer (cut off), it waits and says so; once it answers, it goes on."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    replicas = _replicas(coord, secret, "compute")
    store = replicas[0][0]
    genuine = store.get("reach/addr/1")
    joiner = ControlStore(coord.addr, 2, secret, timeout=5.0)
    done = threading.Event()
    try:
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            address = {"inc": replicas[1][1], "host": "127.0.0.1", "port": silent.getsockname()[1]}
            store.set("reach/addr/1", json.dumps(address))
            waiter = threading.Thread(
                target=lambda: (wait_until_reachable(joiner, 2, 3, 0.3, lambda: False), done.set()), daemon=True
            )
            waiter.start()
            # 1 s: three probe timeouts (0.3 s) of the joiner's
            assert not done.wait(1.0), "it must not ask to rejoin while replica 1 does not answer"
            store.set("reach/addr/1", genuine)
            assert done.wait(5.0), "it goes on once every live member answers"
        assert "waits to rejoin until it reaches replicas [1]" in capfd.readouterr().err
    finally:
        _close(replicas)


def test_data_address_follows_gloo_and_says_how_to_fix_a_wrong_interface(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert data_address("10.0.0.1:29600") == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(OSError, match="HINT: name the interface"):
        data_address("10.0.0.1:29600")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    for addr in ("127.0.0.1:29600", "etcd://127.0.0.1:2379,127.0.0.1:2380"):  # an etcd URL: its first member
        socket.inet_aton(data_address(addr))  # an IPv4 address of this host, as gloo would pick it


SAMPLE = 2  # peers each member probes in a sampled round of the judge below
LARGE = SAMPLE + 4  # a group whose first round is a sample


def _judged(coord, secret, count: int = LARGE):
    """``count`` replicas' stores and responders, and a judge with a sample of SAMPLE peers run as the monitor runs
    it: on each pass the replicas' heartbeats, all waiting on their peers (phase ``reduce``) without progress."""
    stores = [ControlStore(coord.addr, r, secret, timeout=5.0) for r in range(count)]
    incs = [store.add(f"inc/{r}", 1) for r, store in enumerate(stores)]
    responders = [ReachabilityResponder(store, r, inc, 0.05) for r, (store, inc) in enumerate(zip(stores, incs))]
    judge = PartitionJudge(stores[0].raw, coord.sealer, HEARTBEAT_TIMEOUT, PROBE_TIMEOUT, sample_peers=SAMPLE)
    beats = {f"hb/{r}": (r, {"inc": inc, "count": 0, "phase": "reduce"}) for r, inc in enumerate(incs)}
    return stores, responders, judge, beats


def _judge_until(judge, beats, done, bound: float) -> float:
    """Pass the judge until ``done()`` (at most ``bound`` plus 1 s of slack after the group started waiting);
    returns the seconds it took."""
    start = time.monotonic()
    judge.observe(start, beats)  # the group starts waiting now
    while not done() and time.monotonic() < start + bound + 1.0:
        judge.observe(time.monotonic(), beats)
        time.sleep(0.01)
    return time.monotonic() - start


PROBE_TIMEOUT = probe_timeout_for(HEARTBEAT_TIMEOUT)


def test_a_large_group_probes_a_sample_then_every_link_once_a_cut_is_found(coordinator, monkeypatch):
    """More members than the judge's sample + 1, the last one's probe address refuses connections: the first round
    probes SAMPLE links per member and finds some of that member's links cut; a round of every link follows at once
    and fences it, within the bound for a group of that size."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    stores, responders, judge, beats = _judged(coord, secret)
    store, cut_off = stores[0], LARGE - 1
    with socket.socket() as closed:
        _publish_probe_address(store, cut_off, 1, closed, listen=False)
        try:
            bound = exclusion_bound(HEARTBEAT_TIMEOUT, PROBE_TIMEOUT, LARGE, SAMPLE)
            took = _judge_until(judge, beats, lambda: store.deaths([cut_off])[cut_off] > 0, bound)
            assert store.deaths([cut_off])[cut_off] == 1, f"after {took:.2f}s"
            first = [json.loads(store.get(f"reach/1/{r}")) for r in range(LARGE - 1)]
            assert all(len(report["reached"]) + len(report["cut"]) == SAMPLE for report in first), first
            assert sum(cut_off in report["cut"] for report in first) == SAMPLE  # its probers, each found it
            assert json.loads(store.get_genuine("reach/round"))["round"] == 2
            assert store.get_genuine("reach/1/verdict") is None, "a sample that found a cut decides nothing"
            verdict = json.loads(store.get("reach/2/verdict"))
            assert verdict["keep"] == list(range(LARGE - 1)) and list(verdict["fenced"]) == [str(cut_off)]
            assert len(json.loads(store.get("reach/2/0"))["reached"]) == LARGE - 2, "every link this time"
        finally:
            for responder in responders:
                responder.close()


def test_a_large_group_that_reaches_itself_probes_only_its_sample(coordinator, monkeypatch):
    """The same group with no link cut (the stall was something else): one round of SAMPLE probes per member, no
    round of every link, nobody fenced."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    stores, responders, judge, beats = _judged(coord, secret)
    store = stores[0]
    try:
        bound = exclusion_bound(HEARTBEAT_TIMEOUT, PROBE_TIMEOUT, LARGE, SAMPLE)
        _judge_until(judge, beats, lambda: store.get_genuine("reach/1/verdict") is not None, bound)
        verdict = json.loads(store.get("reach/1/verdict"))
        assert verdict["keep"] == list(range(LARGE)) and verdict["fenced"] == {}
        reports = [json.loads(store.get(f"reach/1/{r}")) for r in range(LARGE)]
        assert all(len(report["reached"]) == SAMPLE and not report["cut"] for report in reports), reports
        assert json.loads(store.get_genuine("reach/round"))["round"] == 1, "no round of every link"
        assert store.deaths(list(range(LARGE))) == dict.fromkeys(range(LARGE), 0)
    finally:
        for responder in responders:
            responder.close()


def test_a_report_list_overwritten_by_a_client_without_the_secret_hides_no_report(coordinator, monkeypatch):
    """The list of members that reported is unsealed. A client without the secret keeps emptying it while replica 2
    is cut off: the judge reads every member's report once report_within passed, and fences replica 2 within the
    bound all the same."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    coord, secret = coordinator
    stores, responders, judge, beats = _judged(coord, secret, count=3)
    store = stores[0]
    attacker = store.raw.clone()
    stop = threading.Event()

    def empty() -> None:
        while not stop.wait(0.005):
            attacker.set("reach/1/reported", b"")

    emptier = threading.Thread(target=empty, name="test-list-emptier", daemon=True)
    with socket.socket() as closed:
        _publish_probe_address(store, 2, 1, closed, listen=False)
        emptier.start()
        try:
            bound = exclusion_bound(HEARTBEAT_TIMEOUT, PROBE_TIMEOUT, 3, SAMPLE)
            took = _judge_until(judge, beats, lambda: store.deaths([2])[2] > 0, bound)
            assert store.deaths([0, 1, 2]) == {0: 0, 1: 0, 2: 1}, f"after {took:.2f}s"
            assert json.loads(store.get("reach/1/verdict"))["fenced"] == {"2": ANY}
        finally:
            stop.set()
            emptier.join(5)
            for responder in responders:
                responder.close()
