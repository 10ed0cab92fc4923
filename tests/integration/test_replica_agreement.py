"""The processes of a sharded replica go on in a generation together (protocol/replica_agreement.py), over a real
embedded coordinator: each process a thread with its own connection."""

from __future__ import annotations

import threading

import pytest

from lightning_recover.errors import MembershipChanged, RecoverError, ReplicaExcludedError
from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.messages import ControlStore, JobSecret
from lightning_recover.protocol.replica_agreement import ReplicaAgreement

K = 3
INCARNATION = 2


@pytest.fixture
def processes():
    """The K processes of replica 0, each with its own connection to one coordinator."""
    secret = JobSecret.generate()
    coordinator = Coordinator("127.0.0.1", 0, 2, 1.0, secret)
    stores = [ControlStore(coordinator.addr, 0, secret) for _ in range(K)]

    def process(inner: int, timeout: float = 30.0, check_health=lambda: None) -> ReplicaAgreement:
        return ReplicaAgreement(stores[inner], 0, INCARNATION, inner, K, check_health, timeout)

    yield process
    stores.clear()
    del coordinator  # the last reference to the server store: stops it


def _settle_all(agreements, number, outcomes):
    """Each process settles its outcome on a thread of its own; what each one's settle returned or raised."""
    results: list = [None] * len(agreements)

    def run(i):
        try:
            agreements[i].settle(number, "built", outcomes[i])
            results[i] = "returned"
        except Exception as exc:  # reported to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(agreements))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a settle did not end"
    return results


def test_every_process_goes_on_once_all_succeeded(processes):
    agreements = [processes(i) for i in range(K)]
    assert _settle_all(agreements, 1, [True] * K) == ["returned"] * K


def test_one_process_failing_sends_every_process_to_the_next_generation(processes):
    """The failing process returns at once (it raises its own failure); its mates, whose part succeeded, raise
    MembershipChanged: none of them computes in the generation without it."""
    agreements = [processes(i) for i in range(K)]
    results = _settle_all(agreements, 4, [True, False, True])
    assert results[1] == "returned"
    for i in (0, 2):
        assert isinstance(results[i], MembershipChanged) and "replica 0 failed at built in generation 4" in str(
            results[i]
        ), results[i]


def test_an_earlier_incarnations_or_a_forged_outcome_is_not_a_mates(processes):
    agreements = [processes(i) for i in range(K)]
    store = agreements[0].store
    store.set("g5/agree/built/0.1", f"{INCARNATION - 1}:ok")  # the replica's earlier incarnation
    store.raw.set("g5/agree/built/0.2", b"2:ok")  # no seal: written by a client without the secret
    with pytest.raises(RecoverError, match="published no outcome of built in generation 5 within 0.5s"):
        processes(0, timeout=0.5).settle(5, "built", True)
    assert _settle_all(agreements[1:], 5, [True, True]) == ["returned"] * 2  # their own outcomes complete it


def test_a_mate_that_never_publishes_ends_the_wait_within_the_timeout(processes):
    with pytest.raises(RecoverError, match="published no outcome of state in generation 2 within 0.5s"):
        processes(0, timeout=0.5).settle(2, "state", True)


def test_this_replica_declared_dead_ends_the_wait(processes):
    """A mate that died or hangs gets the replica declared dead: the wait ends with the exclusion, not a guess."""

    def excluded():
        raise ReplicaExcludedError("replica 0 was declared dead")

    with pytest.raises(ReplicaExcludedError):
        processes(0, check_health=excluded).settle(3, "built", True)
