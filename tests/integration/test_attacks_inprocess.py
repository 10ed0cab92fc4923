"""Attacks on the control plane by a client without the job's secret, against the in-process harness.

An outsider connects to the coordinator's store like any client on loopback and replays old genuine
values, overwrites or deletes values after they were written, or floods the store. What must hold
(docs/security.md): a replayed value is dropped and logged, never counted as liveness; every wait
ends within its documented bound, in recovery or a named error; no replica applies a wrong step.

Timing asserts use the documented bound plus ``SLACK`` seconds: the slack covers recovery after the
declaration (a regroup, measured 0.05-0.3 s) and scheduling on this 2-core machine shared with
other jobs.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from lightning_recover.control_plane.connect import connect
from lightning_recover.errors import ForgedMessageError, RecoverError
from lightning_recover.protocol import Fault
from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.messages import ControlStore, JobSecret, sequence
from lightning_recover.protocol.replica_world import declared_dead, left_key
from lightning_recover.protocol.state_transfer import check_digest, digest, pack, record_refused, sealed_record, unpack
from tests.compare import SLACK, max_relative_difference
from tests.inprocess import HEARTBEAT_TIMEOUT, RUN_TIMEOUT, TOL, Cluster, reference

pytestmark = pytest.mark.timeout(90)


def _until(predicate, timeout: float = RUN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


@contextlib.contextmanager
def _deleting_over_and_over(addr: str, key: str) -> Iterator[list[int]]:
    """An outsider (a client without the secret) deleting ``key`` every 0.5 ms while the block runs;
    yields ``[times it deleted something]``."""
    stop = threading.Event()
    deleted = [0]

    def delete() -> None:
        store = connect(addr)
        while not stop.is_set():
            deleted[0] += bool(store.delete_key(key))
            time.sleep(0.0005)

    attacker = threading.Thread(target=delete, name="test-outsider", daemon=True)
    attacker.start()
    try:
        yield deleted
    finally:
        stop.set()
        attacker.join(timeout=5)


def _no_wrong_step(cluster: Cluster) -> None:
    """Whatever happened, every replica's parameters are those of the steps it applied."""
    refs = reference(cluster.M, cluster.steps)
    for slot in cluster.slots:
        assert slot.applied == list(range(len(slot.applied))), slot.describe()
        assert max_relative_difference(slot.state, refs[len(slot.applied)]) <= TOL, slot.describe()


def _finished_equal_to_reference(cluster: Cluster, survivors: list[int]) -> None:
    assert cluster.survivors() == survivors, cluster.report()
    final = reference(cluster.M, cluster.steps)[-1]
    for r in survivors:
        assert max_relative_difference(cluster.slot(r).state, final) <= TOL, cluster.slot(r).describe()


class HeartbeatAttacker(threading.Thread):
    """Records the genuine values of ``hb/{replica}`` while the replica is healthy; once ``go`` is set,
    attacks the key until stopped: ``replay`` writes two recorded values back in turn (their beat
    and progress counts differ, so each write looks like a moving heartbeat), ``delete`` deletes it,
    ``forge`` writes garbage over it."""

    def __init__(self, addr: str, replica: int, how: str, every: float = 0.002) -> None:
        super().__init__(name="test-outsider", daemon=True)
        self.every = every
        self.store = connect(addr)
        self.key, self.how = f"hb/{replica}", how
        self.go, self.stop = threading.Event(), threading.Event()
        self.recorded: list[bytes] = []
        self.writes = 0

    def run(self) -> None:
        while not self.go.is_set() and not self.stop.is_set():
            raw = self.store.get(self.key)
            if raw not in self.recorded[-1:]:
                self.recorded = (self.recorded + [raw])[-2:]
            time.sleep(0.005)
        while not self.stop.is_set():
            if self.how == "replay":
                self.store.set(self.key, self.recorded[self.writes % 2])
            elif self.how == "delete":
                self.store.delete_key(self.key)
            else:
                self.store.set(self.key, b'{"inc": 1, "beat": 999999}')
            self.writes += 1
            time.sleep(self.every)


@pytest.mark.parametrize("how", ["replay", "delete", "forge"])
def test_a_frozen_replica_is_declared_within_heartbeat_timeout_whatever_its_key_holds(how, capfd):
    """Replica 1 freezes (its heartbeat stops) in step 2 while an outsider replays two of its earlier
    genuine heartbeats in turn (before sequences, this kept it alive for good), deletes its key (a
    waiting read would stall the monitor) or forges it. The monitor still declares it within
    heartbeat_timeout; the survivors apply step 2 without it and end equal to the reference."""
    fault = Fault("hang", 1, 2, "backward")
    with Cluster(3, steps=4, microbatches=6, faults=[fault]) as cluster:
        attacker = HeartbeatAttacker(cluster.coordinator.addr, 1, how)
        attacker.start()
        try:
            cluster.start()
            cluster.wait(cluster.slot(1).blocked.is_set)
            attacker.go.set()
            cluster.join()
        finally:
            attacker.stop.set()
            attacker.join(timeout=5)
    assert attacker.writes > 0 and len(attacker.recorded) == 2
    _finished_equal_to_reference(cluster, [0, 2])
    took = cluster.slot(0).applied_at[2] - cluster.slot(1).fired_at[str(fault)]
    print(f"\n{how}: frozen replica declared and step 2 applied without it {took:.2f}s after it froze")
    assert took <= HEARTBEAT_TIMEOUT + SLACK, took
    if how == "replay":
        assert "[coordinator]: dropped a replayed value under 'hb/1'" in capfd.readouterr().err


@pytest.mark.slow  # waits out a timeout or a window (1-1.7 s): kept out of `make test-fast`
def test_replayed_progress_does_not_hide_a_deadlocked_main_thread(capfd):
    """Replica 1's main thread blocks in step 2 with its heartbeat thread alive (a deadlock): only its
    progress count reveals it. Meanwhile an outsider writes back, in turn, two of its earlier genuine
    heartbeats whose progress counts differ (before sequences, each write looked like progress). The
    live heartbeat's sequence is always ahead: every replayed value is dropped, and the monitor
    declares the replica within hang_timeout. (The replay runs at a tenth of a heartbeat per
    monitor poll: overwriting a live heartbeat faster than it beats gets that replica declared dead
    after heartbeat_timeout instead, a denial of service docs/security.md lists.)"""
    hang_timeout = 1.5  # as in test_a_store_collective_a_peer_never_joins_ends_within_its_bound
    release = threading.Event()
    attackers: list[HeartbeatAttacker] = []

    def deadlock(slot, _fault) -> None:
        attackers[0].go.set()
        slot.blocked.set()
        release.wait(RUN_TIMEOUT)

    fault = Fault("tamper", 1, 2, "backward")
    with Cluster(3, steps=4, microbatches=6, faults=[fault], tamper=deadlock, hang_timeout=hang_timeout) as cluster:
        attackers.append(HeartbeatAttacker(cluster.coordinator.addr, 1, "replay", every=0.1))
        attackers[0].start()
        try:
            cluster.start()
            cluster.wait(lambda: 2 in cluster.slot(0).applied)
        finally:
            attackers[0].stop.set()
            attackers[0].join(timeout=5)
            release.set()
        cluster.join()
    assert attackers[0].writes > 5
    assert "[coordinator]: dropped a replayed value under 'hb/1'" in capfd.readouterr().err
    took = cluster.slot(0).applied_at[2] - cluster.slot(1).fired_at[str(fault)]
    print(f"\ndeadlocked replica declared, step 2 applied without it {took:.2f}s after it blocked")
    assert hang_timeout - 0.2 <= took <= hang_timeout + SLACK, took
    assert cluster.slot(1).applied == [0, 1] and cluster.slot(1).outcome == "excluded", cluster.report()
    _finished_equal_to_reference(cluster, [0, 2])
    _no_wrong_step(cluster)


# ---------------------------------------------------------------------- each sealed key class, replayed
@pytest.fixture
def store_pair():
    """A coordinator (no monitor) and two authenticated clients of it: a writer and a reader."""
    secret = JobSecret.generate()
    coordinator = Coordinator("127.0.0.1", 0, 2, HEARTBEAT_TIMEOUT, secret)
    writer = ControlStore(coordinator.addr, 0, secret)
    reader = ControlStore(coordinator.addr, 1, secret)
    outsider = connect(coordinator.addr)
    yield writer, reader, outsider
    del writer, reader, outsider, coordinator


def test_a_replayed_heartbeat_or_progress_record_is_refused(store_pair, capfd):
    writer, reader, outsider = store_pair
    old = None
    for beat in (1, 2):
        writer.set("hb/0", json.dumps({"inc": 1, "beat": beat, "count": beat}), seq=sequence(1, beat))
        old = old or outsider.get("hb/0")
        assert json.loads(reader.get_fresh("hb/0")[1])["beat"] == beat
    outsider.set("hb/0", old)  # beat 1 written back after beat 2 was read
    assert reader.get_fresh("hb/0") is None
    assert reader.freshness.replays == {"hb/0": 1}
    assert "dropped a replayed value under 'hb/0'" in capfd.readouterr().err
    # A restart's heartbeats are ahead of every beat of the previous incarnation.
    writer.set("hb/0", json.dumps({"inc": 2, "beat": 1}), seq=sequence(2, 1))
    assert json.loads(reader.get_fresh("hb/0")[1])["inc"] == 2


def test_replayed_death_notices_and_generations_never_go_back(store_pair):
    writer, reader, outsider = store_pair
    assert writer.mark_dead(0, 1)
    first = outsider.get("dead/0")
    assert writer.mark_dead(0, 2) and reader.deaths([0]) == {0: 2}
    outsider.set("dead/0", first)  # the notice of incarnation 1 written back
    assert reader.deaths([0]) == {0: 2}
    outsider.delete_key("dead/0")  # deleted: read at once as none, never waited on
    started = time.monotonic()
    assert reader.deaths([0]) == {0: 2} and time.monotonic() - started < 1.0

    gen0 = outsider.get("gen/latest")
    assert writer.compare_set("gen/latest", "0", "1") == "1" and reader.generation() == 1
    outsider.set("gen/latest", gen0)
    assert reader.generation() == 1


def test_a_sharded_replicas_watchdog_reads_death_notices_it_can_trust(store_pair):
    """The watchdog that ends a sharded replica's other processes once the replica is declared dead:
    a deleted or forged notice counts as none (a forged one used to end the watchdog for good, so a
    later genuine death left the mates running), a planted "left" key does not hide a real death,
    and a replica that left cleanly is not ended."""
    writer, reader, outsider = store_pair
    assert not declared_dead(reader, 0, 1)
    outsider.set("dead/0", b"1")  # forged
    assert not declared_dead(reader, 0, 1)
    outsider.delete_key("dead/0")
    started = time.monotonic()
    assert not declared_dead(reader, 0, 1) and time.monotonic() - started < 1.0, "a missing notice is never waited on"
    assert writer.mark_dead(0, 1)
    outsider.set(left_key(0, 1), b"1")  # planted, unsealed
    assert declared_dead(reader, 0, 1)
    writer.set(left_key(0, 1), "1")  # the replica's own clean exit (ReplicaWorld.leave)
    assert not declared_dead(reader, 0, 1)


@pytest.mark.parametrize(
    "key, other",
    [
        ("s3/g0/dec", "s3/g1/dec"),  # a decision: step and generation are in its name
        ("g1/members", "g2/members"),  # a membership
        ("g1/join/0", "g2/join/0"),  # a join payload
        ("x/0/1/0", "x/0/2/0"),  # a store collective's contribution
        ("s3/g0/done/0", "s4/g0/done/0"),  # a done report
        ("g2/state", "g3/state"),  # a rejoin state's digest
    ],
)
def test_values_written_once_cannot_be_replayed_elsewhere(store_pair, key, other):
    """Keys written once are unique to their step, generation and writer: a value written back under
    its own key is the same value; under any other key it fails authentication."""
    writer, reader, outsider = store_pair
    writer.set(key, "value")
    outsider.set(other, outsider.get(key))
    with pytest.raises(ForgedMessageError):
        reader.get(other)
    assert reader.get_genuine(other) is None and reader.get_genuine(key) == "value"


# ---------------------------------------------------------------------- overwritten and deleted values
@pytest.mark.parametrize("how", ["overwrite", "delete"])
def test_a_contribution_overwritten_or_deleted_after_it_was_written_is_written_again(how, capfd):
    """Every step starts with a barrier (a store collective). In step 1, replica 1 holds back until
    replica 0's contribution is in, an outsider overwrites or deletes it, replica 1 waits until replica
    0 wrote it again, then contributes: the barrier completes at once (before, it waited for good)."""
    took = []
    forged = b'{"forged": true}'

    def before_step(replica: int, step: int) -> None:
        if replica == 1 and step == 1:
            _until(lambda: outsider.check(["x/0/2/0"]))
            if how == "overwrite":
                outsider.set("x/0/2/0", forged)
                _until(lambda: outsider.get("x/0/2/0") != forged)
            else:
                outsider.delete_key("x/0/2/0")
                _until(lambda: outsider.check(["x/0/2/0"]))
        started = time.monotonic()
        cluster.slot(replica).protocol_replica.barrier()
        took.append(time.monotonic() - started)

    with Cluster(2, steps=3, microbatches=4, before_step=before_step) as cluster:
        outsider = connect(cluster.coordinator.addr)
        cluster.start().join()
    _finished_equal_to_reference(cluster, [0, 1])
    assert "replica 0: wrote again its contribution x/0/2/0" in capfd.readouterr().err
    assert max(took) <= SLACK, took


def test_contributions_overwritten_after_the_decision_change_nothing():
    """The decision of a store collective carries the contributions it counted. Replica 1 writes its
    contribution to step 1's barrier, waits for replica 0 to decide, an outsider overwrites both
    contributions, then replica 1 enters the barrier: it takes the values from the decision (before,
    it read the contributions again after the decision and stopped with ForgedMessageError)."""

    def before_step(replica: int, step: int) -> None:
        protocol_replica = cluster.slot(replica).protocol_replica
        if replica == 1 and step == 1:
            protocol_replica.membership.store.put_object("x/0/2/1", None)
            _until(lambda: outsider.check(["x/0/2/set"]))
            for r in (0, 1):
                outsider.set(f"x/0/2/{r}", b'{"forged": true}')
        protocol_replica.barrier()

    with Cluster(2, steps=3, microbatches=4, before_step=before_step) as cluster:
        outsider = connect(cluster.coordinator.addr)
        cluster.start().join()
    _finished_equal_to_reference(cluster, [0, 1])


@pytest.mark.slow  # waits out hang_timeout + store_timeout (6.5 s; store_timeout's floor is 5 s)
def test_a_store_collective_a_peer_never_joins_ends_within_its_bound():
    """Replica 1 calls one barrier more than replica 0 (or its peer's contribution was deleted and the
    peer moved on): both wait, in phases the monitor counts as waiting, so nobody is declared hung.
    The extra barrier ends with a named error within hang_timeout + store_timeout (before, it spun
    for good); replica 0 then recovers without replica 1."""
    hang_timeout = 1.5
    store_timeout = 5.0  # RecoverOptions.store_timeout for heartbeat_timeout 0.5
    marks = {}

    def before_step(replica: int, step: int) -> None:
        protocol_replica = cluster.slot(replica).protocol_replica
        protocol_replica.barrier()
        if replica == 1 and step == 1:
            marks["start"] = time.monotonic()
            try:
                protocol_replica.barrier()  # replica 0 never calls this one
            finally:
                marks["end"] = time.monotonic()

    with Cluster(2, steps=3, microbatches=4, before_step=before_step, hang_timeout=hang_timeout) as cluster:
        cluster.start().join()
    victim = cluster.slot(1)
    assert victim.outcome == "error" and isinstance(victim.error, RecoverError), cluster.report()
    assert "did not contribute to store collective" in str(victim.error) and "HINT" in str(victim.error)
    took = marks["end"] - marks["start"]
    assert hang_timeout + store_timeout - 0.1 <= took <= hang_timeout + store_timeout + SLACK, took
    _finished_equal_to_reference(cluster, [0])
    _no_wrong_step(cluster)


@pytest.mark.slow  # waits out collective_timeout (5 s), twice
@pytest.mark.parametrize("how", ["overwrite", "delete"])
def test_a_decision_taken_away_after_a_member_applied_it_ends_in_a_named_error(how):
    """Step 1 is decided 'commit' by replica 0 (the leader, which applies it: it wrote the decision); before
    replica 1 reads it, an outsider overwrites or deletes the register. Replica 1 must neither guess nor wait
    for good: within collective_timeout it stops with ForgedMessageError (its decision deadline). Or replica
    0's reduce of step 2 (waiting on replica 1, with the same timeout) fails first; replica 1 then settles
    step 1 as 'retry' (a forged value is no decision) and both meet in generation 1 with different open steps.
    Whoever reads that generation's payloads stops with RecoverError at the check that members agree on
    the open step: both, or replica 0 alone, when its stop ends generation 1 before replica 1 read it;
    replica 1 then forms generation 2 alone, redoes step 1 whole and finishes equal to the reference.
    Whatever the order, no replica applies a wrong step."""
    collective_timeout = 5.0
    tampered = []

    def take_away(slot, _fault) -> None:
        _until(lambda: 1 in cluster.slot(0).applied)
        if how == "overwrite":
            outsider.set("s1/g0/dec", b"commit")
        else:
            outsider.delete_key("s1/g0/dec")
        tampered.append(time.monotonic())

    with Cluster(
        2,
        steps=4,
        microbatches=4,
        faults=[Fault("tamper", 1, 1, "commit")],
        tamper=take_away,
        collective_timeout=collective_timeout,
    ) as cluster:
        outsider = connect(cluster.coordinator.addr)
        cluster.start()
        cluster.wait(cluster.slot(0).finished.is_set)
        stopped = time.monotonic()
        cluster.join()
    victim, other = cluster.slot(1), cluster.slot(0)
    disagree = "disagree on the open step and attempt: [(1, 0), (2, 0)]"
    if victim.outcome == "done":  # replica 0 stopped at the check; replica 1 redid step 1 alone
        assert other.outcome == "error" and disagree in str(other.error), cluster.report()
        _finished_equal_to_reference(cluster, [1])
        _no_wrong_step(cluster)
        return
    assert victim.outcome == "error" and victim.applied == [0], cluster.report()
    if isinstance(victim.error, ForgedMessageError):
        assert ("failed authentication" if how == "overwrite" else "was deleted") in str(victim.error)
        _finished_equal_to_reference(cluster, [0])
    else:
        assert disagree in str(victim.error), cluster.report()
    assert stopped - tampered[0] <= collective_timeout + SLACK
    _no_wrong_step(cluster)


def test_a_member_list_deleted_while_the_group_forms_is_written_again():
    """An outsider deletes generation 0's member list over and over while 3 replicas form it: a
    replica that finds it missing writes the same list again (nobody died), and the job trains to
    the end equal to the reference."""
    with Cluster(3, steps=3, microbatches=6) as cluster:
        with _deleting_over_and_over(cluster.coordinator.addr, "g0/members") as deleted:
            cluster.start()
            cluster.wait(lambda: all(0 in cluster.slot(r).applied for r in range(3)))
        cluster.join()
    assert deleted[0] >= 1
    _finished_equal_to_reference(cluster, [0, 1, 2])


def test_a_join_payload_deleted_while_a_generation_forms_is_written_again_or_named(capfd):
    """Replica 2 is killed in step 1; an outsider deletes replica 0's join payload of generation 1 over
    and over while the survivors form it. While the round is open, replica 0 writes its payload
    again; once the member list is out, a survivor that reads a listed payload missing (it was
    taken away: only replicas whose payload is there get listed) stops at once with
    ForgedMessageError naming it. Before, both reads waited for store_timeout and ended misnamed
    CoordinatorLostError. Nobody stalls, nobody applies a wrong step, a finisher equals the reference."""
    with Cluster(3, steps=4, microbatches=6, faults=[Fault("kill", 2, 1, "backward")]) as cluster:
        with _deleting_over_and_over(cluster.coordinator.addr, "g1/join/0") as deleted:
            cluster.start()
            cluster.wait(lambda: all(slot.finished.is_set() for slot in cluster.slots))
        cluster.join()
    assert deleted[0] >= 1
    errors = [slot for slot in cluster.slots if slot.outcome == "error"]
    assert errors or "replica 0: wrote again its join payload g1/join/0" in capfd.readouterr().out, cluster.report()
    for slot in errors:
        assert isinstance(slot.error, ForgedMessageError), cluster.report()
        assert "join payload 'g1/join/0'" in str(slot.error) and "was deleted" in str(slot.error), cluster.report()
        # at once: within the harness's slack of the step it was killed in, not after store_timeout
        assert slot.finished_at - cluster.slot(2).finished_at <= SLACK, cluster.report()
    assert {s.outcome for s in cluster.slots} <= {"error", "done", "killed"}, cluster.report()
    for r in cluster.survivors():
        assert max_relative_difference(cluster.slot(r).state, reference(cluster.M, cluster.steps)[-1]) <= TOL
    _no_wrong_step(cluster)


# ---------------------------------------------------------------------- a flood
def test_a_client_flooding_the_store_costs_memory_not_correctness():
    """An outsider writes 20,000 junk keys of 1 KiB (20 MiB the coordinator now holds: the embedded
    store has no quota) while 3 replicas train with a barrier per step, competing for the store.
    The job ends equal to the reference, within the harness's run bound."""
    stop = threading.Event()
    written = [0]

    def flood() -> None:
        store = connect(cluster.coordinator.addr)
        junk = b"x" * 1024
        for i in range(20_000):
            if stop.is_set():
                return
            store.set(f"junk/{i}", junk)
            written[0] += 1

    def before_step(replica: int, step: int) -> None:
        cluster.slot(replica).protocol_replica.barrier()

    started = time.monotonic()
    with Cluster(3, steps=6, microbatches=6, before_step=before_step) as cluster:
        flooder = threading.Thread(target=flood, name="test-flooder", daemon=True)
        flooder.start()
        try:
            cluster.start().join()
        finally:
            stop.set()
            flooder.join(timeout=30)
    print(f"\nflood: {written[0]} keys written during the run, which took {time.monotonic() - started:.1f}s")
    assert written[0] > 100
    _finished_equal_to_reference(cluster, [0, 1, 2])


# ---------------------------------------------------------------------- rejoin state
def test_rejoin_state_must_match_the_digest_sealed_by_its_sender():
    state = {"w": torch.arange(10, dtype=torch.float64), "step": 3}
    payload, skeleton_len = pack(state)
    expected = digest(payload)
    check_digest(payload, expected, "g2/state")  # what was sent is taken
    assert torch.equal(unpack(payload, skeleton_len)["w"], state["w"])
    altered = payload.clone()
    altered[3] ^= 1  # one bit of one tensor changed on the way
    with pytest.raises(ForgedMessageError, match="does not match the digest"):
        check_digest(altered, expected, "g2/state")
    with pytest.raises(ForgedMessageError, match="missing or forged"):
        check_digest(payload, None, "g2/state")


def test_a_state_digest_not_found_is_named_absent_or_forged(store_pair):
    """A receiver that finds no genuine digest record says which it is (absent, or failed authentication) and
    where it stood: the two have different causes (a deletion or a race; a client without the secret)."""
    writer, reader, outsider = store_pair
    assert sealed_record(reader, "g2/state") is None
    with pytest.raises(
        ForgedMessageError, match=r"'g2/state'\) is absent from the store \(generation 2, this member's rank 1"
    ):
        raise record_refused(reader, "g2/state", 2, 1, 0)
    outsider.set("g2/state", b'{"sha256": "0", "bytes": 1, "skeleton": 1}')  # unsealed
    assert sealed_record(reader, "g2/state") is None
    with pytest.raises(ForgedMessageError, match="failed authentication"):
        raise record_refused(reader, "g2/state", 2, 1, 0)
    writer.set("g2/state", json.dumps({"sha256": "0", "bytes": 1, "skeleton": 1}))
    assert sealed_record(reader, "g2/state") == {"sha256": "0", "bytes": 1, "skeleton": 1}
