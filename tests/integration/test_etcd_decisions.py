"""The speculative commit on etcd (``protocol/decisions.py``), against a real one-member TLS etcd.

Once its barrier completed a member applies the step at once; the leader writes ``commit`` on its writer
thread, and every member *confirms* the step before its next reduce or store collective. These tests drive
the members' ``TransactionCommit`` directly (no process group): the failure-free confirmation, a leader that dies
before writing (a member whose barrier completed writes ``commit`` itself once the generation fails), the
race a death during the barrier allows (a ``retry`` that lands first stops the member that applied the
step, with a named error), a forged register (a named error within collective_timeout), and the leader
asking every member to await its commit while a joiner waits.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from lightning_recover.control_plane.etcd_client import EtcdClient
from lightning_recover.control_plane.etcd_store import EtcdStore
from lightning_recover.errors import ForgedMessageError, ReplicaExcludedError
from lightning_recover.protocol.coordinator import init_keys
from lightning_recover.protocol.decisions import BarrierCommit, ReportedCommit, TransactionCommit
from lightning_recover.protocol.join_requests import JOIN_REQUESTS
from lightning_recover.protocol.join_rounds import Generation
from lightning_recover.protocol.membership import Membership
from lightning_recover.protocol.messages import ControlStore, JobSecret, Sealer

REPLICAS = 3
_count = [0]


def members_of_generation_0(cluster, collective_timeout: float = 10.0) -> list[TransactionCommit]:
    """One ``TransactionCommit`` per member of generation 0 of three replicas (incarnation 1), each on its own etcd
    connection under a fresh job prefix; no heartbeat, no process group."""
    _count[0] += 1
    secret = JobSecret.generate()
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, timeout=5.0)
    raw = EtcdStore(client, f"/decisions-test/{_count[0]}/kv/", root=f"/decisions-test/{_count[0]}/")
    init_keys(raw, Sealer(secret), REPLICAS)
    out = []
    for r in range(REPLICAS):
        m = Membership("etcd://test", r, REPLICAS, secret=secret, collective_timeout=collective_timeout)
        m.attach(ControlStore("etcd://test", r, secret, store=raw.clone()), incarnation=1)
        m.gen = Generation(0, list(range(REPLICAS)), dict.fromkeys(range(REPLICAS), 1), {}, rank=r)
        out.append(TransactionCommit(m))
    return out


def fail_generation(d: TransactionCommit) -> None:
    """What a member forming the next generation writes first: the generation register and the event."""
    store = d.membership.store
    store.compare_set("gen/latest", "0", "1")
    store.add("events", 1)


def register(d: TransactionCommit, step: int) -> str:
    return d.membership.store.get_genuine(f"s{step}/g0/dec")


@pytest.fixture
def decisions(etcd1):
    out = members_of_generation_0(etcd1)
    yield out
    for d in out:
        d.close(settle=False)
        d.membership.store.raw.close()  # its connection, and the watched view its clones share


def test_the_fast_path_applies_at_once_and_confirms_the_leaders_commit(decisions):
    assert all(d.barrier and d.speculates for d in decisions)
    assert [d.commit_speculatively(4) for d in decisions] == [True, True, True]
    for d in decisions:
        d.confirm()
    assert register(decisions[0], 4) == "commit"
    assert decisions[1].decide_retry(4) is True  # a late failure cannot overturn it
    for d in decisions:
        d.confirm()  # nothing pending: returns at once


def test_a_leader_dead_before_writing_leaves_the_commit_to_a_member_whose_barrier_completed(decisions):
    # Members 1 and 2 passed the barrier and applied step 6; the leader died before its writer ran.
    assert decisions[1].commit_speculatively(6) and decisions[2].commit_speculatively(6)
    done = threading.Event()
    confirmed: list[BaseException | None] = []

    def confirm() -> None:
        try:
            decisions[1].confirm()
            confirmed.append(None)
        except BaseException as exc:
            confirmed.append(exc)
        done.set()

    threading.Thread(target=confirm, daemon=True).start()
    assert not done.wait(0.5), "confirmed a step nobody decided"
    fail_generation(decisions[2])  # the survivors notice the leader's death
    assert done.wait(10) and confirmed == [None]
    assert register(decisions[1], 6) == "commit"
    decisions[2].confirm()


def test_a_retry_that_lands_first_stops_the_member_that_applied_the_step(decisions):
    # A member died during the barrier: it completed at member 1 (which applied step 8), failed at member 2,
    # whose retry landed before any commit. Member 1 must not go on: the others redo step 8.
    assert decisions[1].commit_speculatively(8)
    assert decisions[2].decide_retry(8) is False
    with pytest.raises(ReplicaExcludedError, match="settled it 'retry'.*redo the step"):
        decisions[1].confirm()


def test_the_leader_asks_every_member_to_await_its_commit_while_a_joiner_waits(decisions):
    assert not any(d.leader_awaits_commit() for d in decisions)
    store = decisions[0].membership.store
    store.set("join/1", "2")  # replica 1's second incarnation asks to join (JoinRequests.request)
    store.add(JOIN_REQUESTS, 1)
    deadline = time.monotonic() + 5
    while not decisions[0].leader_awaits_commit():  # once the watched view (shared by all four) holds it
        assert time.monotonic() < deadline, "the leader never saw the join request"
        time.sleep(0.01)
    assert [d.leader_awaits_commit() for d in decisions] == [True, False, False]


def test_a_forged_decision_stops_the_member_that_applied_the_step_within_its_bound(etcd1):
    """A value written into the register without the job's secret is no decision: the member that applied the
    step waits for a genuine one for collective_timeout, then stops with a named error (never a guess)."""
    members = members_of_generation_0(etcd1, collective_timeout=0.5)
    try:
        assert members[1].commit_speculatively(3)
        members[1].membership.store.raw.set("s3/g0/dec", b"commit")  # unsealed: a client without the secret
        began = time.monotonic()
        with pytest.raises(ForgedMessageError, match="failed authentication for collective_timeout"):
            members[1].confirm()
        assert time.monotonic() - began < 0.5 + 2.0  # the bound, and this machine's slack
    finally:
        for d in members:
            d.close(settle=False)
            d.membership.store.raw.close()


def test_the_last_join_closes_the_round_in_its_own_transaction(decisions):
    """``JoinRounds.closing_members``: a survivor whose join is the last one the round awaits (as its watched view shows the
    round) writes the member list with its join; while a join or a death is missing from the view, none."""
    memberships = [d.membership for d in decisions]
    expected = {0: 1, 1: 1, 2: 1}
    assert memberships[0].rounds.closing_members(1, expected) is None  # nobody else joined yet
    memberships[1].store.set("g1/join/1", json.dumps({"step": 5, "have": [0], "inc": 1}))
    memberships[2].store.mark_dead(2, 1)

    def closing() -> dict | None:
        deadline = time.monotonic() + 5
        while (found := memberships[0].rounds.closing_members(1, expected)) is None:  # once the view holds both
            assert time.monotonic() < deadline, "the view never showed the join and the death"
            time.sleep(0.01)
        return found

    assert closing() == {"g1/members": "[0, 1]"}
    # Written with the join (only where no list is yet): the others read it, and a second close changes nothing.
    join = {"g1/join/0": json.dumps({"step": 5, "have": [1], "inc": 1})}
    store = memberships[0].store
    assert store.compare_set("gen/latest", "0", "1", also=join, announce="events", if_absent=closing()) == "1"
    assert store.get_genuine("g1/members") == "[0, 1]"
    assert store.compare_set("gen/latest", "0", "1", if_absent={"g1/members": "[0]"}) == "1"
    assert memberships[1].store.get_genuine("g1/members") == "[0, 1]"


class _RoundClosed(Exception):
    """Raised where a member would build the new generation's process group (none in these tests)."""


def _stop_at_build() -> None:
    raise _RoundClosed


def test_a_member_whose_reduce_failed_settles_retry_in_its_proposal(decisions):
    """``TransactionCommit.retry_with_proposal``: a member that failed before its barrier settles the step ``retry`` in
    the next generation's proposal transaction (the register and its join payload carry one etcd revision),
    not in a write of its own before it; where the register is already settled it stays as it is."""
    memberships = [d.membership for d in decisions]
    settle = decisions[1].retry_with_proposal(5)
    assert settle == {"s5/g0/dec": "retry"}
    decisions[2].membership.store.compare_set("s6/g0/dec", None, "retry")  # settled before: left as it is
    failed: list[BaseException] = []

    def regroup(m: Membership, settle: dict | None) -> None:
        m.before_build = _stop_at_build
        try:
            m.next_generation({"step": 5, "have": [m.replica], "attempt": 0}, settle=settle)
        except _RoundClosed:
            pass
        except BaseException as exc:  # reported to the test's thread
            failed.append(exc)

    settles = [None, settle, {"s6/g0/dec": "commit"}]
    threads = [threading.Thread(target=regroup, args=(m, s), daemon=True) for m, s in zip(memberships, settles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not failed and not any(t.is_alive() for t in threads), failed
    store = memberships[0].store
    assert store.get_genuine("g1/members") == "[0, 1, 2]"
    assert (register(decisions[0], 5), register(decisions[0], 6)) == ("retry", "retry")
    raw = store.raw

    def mod_revision(key: str) -> int:
        return int(raw.client.range(raw.prefix + key.encode())["kvs"][0]["mod_revision"])

    assert mod_revision("s5/g0/dec") == mod_revision("g1/join/1")  # one transaction
    # Replicas of K processes and the embedded coordinator settle the register first, and read it: no settle.
    assert ReportedCommit(memberships[1]).retry_with_proposal(5) is None
    assert BarrierCommit(memberships[1]).retry_with_proposal(5) is None
