"""The etcd backend's round-trip savers against a real etcd (fast: one-member TLS etcd of this module's own).

* the watched view (``control_plane/etcd_watch.py``): answers in revision order, never older than an
  answer it gave, nothing while it is not current; a silent or lost stream is caught up by one read of a
  single key when nothing changed, and by a re-read of the prefix when something did;
* ``put_and_decide``: a report and the decision in one transaction, exactly one decision among concurrent
  reporters, none from a planted report;
* the sealed ``ControlStore.report_and_decide`` over it: a forged register is a named error.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from lightning_recover.control_plane.embedded import CoordinatorStore
from lightning_recover.control_plane.etcd_client import EtcdClient
from lightning_recover.control_plane.etcd_store import EtcdStore
from lightning_recover.control_plane.etcd_watch import WatchView
from lightning_recover.errors import ForgedMessageError
from lightning_recover.protocol.coordinator import init_keys, run_monitor
from lightning_recover.protocol.heartbeat import Heartbeat, Progress
from lightning_recover.protocol.messages import (
    ControlStore,
    JobSecret,
    Sealer,
    recent_many,
    sequence,
)
from lightning_recover.protocol.vouches import Roster, VouchReader, vouch_record
from tests.compare import SLACK

_count = [0]
#: Slack on time bounds for a loaded 2-core machine (as tests/integration/test_etcd_jobs.py).


def fresh_store(cluster, timeout: float = 5.0) -> EtcdStore:
    _count[0] += 1
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, timeout=timeout)
    # Heartbeats beside the watched keys, as the job's control store keeps them (EtcdSettings.store).
    return EtcdStore(client, f"/watch-test/{_count[0]}/kv/", root=f"/watch-test/{_count[0]}/", apart="hb/")


def write_roster(store: ControlStore, generation: int, incarnations: dict[int, int]) -> None:
    """Generation ``generation``'s closed round, as the members write it: whom its vouches name."""
    for r, inc in incarnations.items():
        store.set(f"g{generation}/join/{r}", json.dumps({"step": 0, "have": [], "inc": inc}))
    store.set(f"g{generation}/members", json.dumps(sorted(incarnations)))


def until(condition, timeout: float = 5.0, what: object = None) -> None:
    """Wait for ``condition()`` (polled every 5 ms); ``what`` is shown if it does not come within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not met in time: {what}"
        time.sleep(0.005)


def test_view_follows_writes_in_order_and_never_goes_back(etcd1):
    store = fresh_store(etcd1)
    store.set("before", b"0")  # present before the view starts: comes from its first read
    until(lambda: store.cached("before") == (True, b"0"))
    view = store.view
    clone = store.clone()
    assert clone.view is view  # one view per process, shared by the store's clones

    seen: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            hit, value = clone.cached("counter")
            if hit and value is not None:
                seen.append(int(value))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(1, 31):  # each put is a Raft write with an fsync: 30 of them show the order
            store.set("counter", str(i).encode())
        store.delete_key("before")
        until(lambda: store.cached("counter") == (True, b"30") and store.cached("before") == (True, None))
    finally:
        stop.set()
        t.join(5)
    assert seen and seen == sorted(seen), "the view answered an older value after a newer one"
    assert view.revision >= int(store.client.range(b"/none")["header"]["revision"]) - 1
    assert view.resyncs == 1  # a live stream needs no re-read


def test_view_waits_wake_on_the_write(etcd1):
    store = fresh_store(etcd1)
    until(lambda: store.view.healthy)
    threading.Timer(0.2, lambda: store.clone().set("late", b"x")).start()
    start = time.monotonic()
    assert store.cached_wait("late", 5.0) is True
    assert 0.15 < time.monotonic() - start < 2.0
    assert store.cached_wait("never", 0.1) is False
    # EtcdStore.wait is served by the running view too (no watch connection of its own)
    store.wait(["late"])
    assert store.watches == 0


def test_a_proposal_its_join_and_its_hint_are_one_transaction(etcd1):
    """``ControlPlane.compare_set`` with ``also`` and ``bump`` (a regroup's proposal with the proposer's join payload and the ``events``
    bump; a death notice with its bump): one round trip on etcd while the view holds the counter, and the
    counter moves by exactly one for the call that set the register, whatever the view's guess was."""
    store = fresh_store(etcd1)
    store.set("gen", b"1")
    store.add("events", 3)
    until(lambda: store.cached("events") == (True, b"3"))
    before = store.client.requests
    assert store.compare_set("gen", b"1", b"2", also=[("g2/join/0", b"p0")], bump="events") == b"2"
    assert store.client.requests == before + 1
    assert (store.get("gen"), store.get("g2/join/0"), store.add("events", 0)) == (b"2", b"p0", 4)
    # Another replica finds the register set: its join is written, the hint is not bumped again.
    assert store.clone().compare_set("gen", b"1", b"2", also=[("g2/join/1", b"p1")], bump="events") == b"2"
    assert (store.get("g2/join/1"), store.add("events", 0)) == (b"p1", 4)
    # A guess the counter moved past (written through a store with a view of its own): still one increment.
    other = EtcdStore(EtcdClient(etcd1.endpoints, **etcd1.tls_files), store.prefix.decode(), root=store.root.decode())
    other.add("events", 10)
    assert store.compare_set("gen", b"2", b"3", bump="events") == b"3"
    assert store.add("events", 0) == 15
    # No current view (closed): the bump is an add after the transaction.
    store.view.close()
    assert store.compare_set("gen", b"3", b"4", bump="events") == b"4"
    assert store.add("events", 0) == 16
    # The TCPStore: the same answers, one request each; every caller finding ``desired`` bumps.
    tcp = CoordinatorStore(
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    )
    tcp.set("gen", b"1")
    assert tcp.compare_set("gen", b"1", b"2", also=[("g2/join/0", b"p0")], bump="events") == b"2"
    assert tcp.compare_set("gen", b"1", b"2", also=[("g2/join/1", b"p1")], bump="events") == b"2"
    assert tcp.compare_set("gen", b"7", b"8", bump="events") == b"2"
    assert (tcp.get("g2/join/1"), tcp.add("events", 0)) == (b"p1", 2)
    # ``if_absent``: written where the key is absent only, on both stores.
    for either in (store, tcp):
        assert either.compare_set("reg", b"", b"a", if_absent=[("m", b"first")]) == b"a"
        assert either.compare_set("reg", b"", b"b", if_absent=[("m", b"second")]) == b"a"
        assert either.get("m") == b"first"


def test_heartbeats_reach_only_a_view_that_reads_them(etcd1):
    """The family kept apart (``apart="hb/"``: heartbeats) lives beside the watched keys: the view of the job's
    keys, which every process runs, receives none of its writes and answers nothing about it (a key it does
    not watch is not absent); a process that reads it (the monitor) starts a view of its own, which serves it."""
    store = fresh_store(etcd1)
    store.set("a", b"1")
    until(lambda: store.cached("a") == (True, b"1"))
    job_view = store.view
    events = job_view.events
    for beat in range(5):
        store.clone().set("hb/0", b"%d" % beat)  # a replica's heartbeat thread writes on a clone
    store.set("b", b"2")
    until(lambda: store.cached("b") == (True, b"2"))
    assert job_view.events == events + 1  # "b" only
    assert store.client.get(store.root + b"hb/0")[0] == b"4"  # where it lives: beside kv/
    assert job_view.lookup(store.root + b"hb/0") == (False, None)  # not watched, so not "absent" either
    assert store.get("hb/0") == b"4"
    until(lambda: store.cached_many(["hb/0"]) == [b"4"])  # the monitor's read: a view of their own
    store.set("hb/0", b"5")
    until(lambda: store.cached_each(["a", "hb/0", "missing"]) == [b"1", b"5", None])  # one lookup, both views
    assert store.cached_many(["a", "missing"]) is None
    assert job_view.events == events + 1
    began = time.monotonic()
    store.close()  # both views' threads end now, not after their streams' silence limits (1 s, 10 s)
    assert time.monotonic() - began < 0.5 + SLACK


def test_many_keys_come_from_the_view_only_while_it_holds_them_all(etcd1):
    """``recent_many`` (a launcher's poll of ``inc/*`` and ``declared/*``): no round trip while the view is
    current and holds every key; a read of etcd when a key is missing from it or the view is not current."""
    store = fresh_store(etcd1)
    store.multi_set(["a", "b"], [b"1", b"2"])
    until(lambda: store.cached_many(["a", "b"]) == [b"1", b"2"])
    assert store.cached_many(["a", "missing"]) is None
    before = store.client.requests
    assert recent_many(store, ["a", "b"]) == [b"1", b"2"]
    assert store.client.requests == before  # answered by the view
    store.view.close()  # a view that is not current answers nothing: etcd is read
    assert store.cached_many(["a"]) is None
    assert recent_many(store, ["b", "a"]) == [b"2", b"1"]
    assert store.client.requests == before + 1


@pytest.mark.slow  # waits out a timeout or a window (1-1.7 s): kept out of `make test-fast`
def test_silent_stream_is_not_trusted_and_is_confirmed_by_one_read(etcd1):
    """A stream with no message for stale_after: the view stops answering, then one read of the range's
    newest key finds nothing changed (no re-read of the prefix), and the view watches on from there."""
    store = fresh_store(etcd1)
    store.set("k", b"1")
    store.set("other", b"x")
    view = WatchView(EtcdClient(etcd1.endpoints, **etcd1.tls_files), store.prefix, stale_after=0.3).start()
    try:
        key = store.prefix + b"k"
        until(lambda: view.lookup(key) == (True, b"1"))
        unhealthy = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and view.confirms < 2:
            hit, value = view.lookup(key)
            if not hit:
                unhealthy.append(time.monotonic())
            else:
                assert value == b"1"
            time.sleep(0.01)
        assert view.confirms >= 2, "a quiet stream must be confirmed after stale_after"
        assert unhealthy, "a stream silent for stale_after must not be trusted"
        assert view.resyncs == 1  # nothing changed: the prefix was read once, at the start
        store.set("k", b"2")
        until(lambda: view.lookup(key) == (True, b"2"))
        assert view.resyncs == 1
    finally:
        view.close()


def test_lost_stream_is_caught_up_and_never_serves_older(etcd1):
    """The member serving the stream dies and comes back: the view says it cannot answer meanwhile, then
    catches up (a confirming read, or a re-read if the write below came first) and goes on."""
    store = fresh_store(etcd1, timeout=15.0)
    store.set("k", b"1")
    view = store.view
    until(lambda: store.cached("k") == (True, b"1"))
    etcd1.kill(0)
    try:
        until(lambda: not view.healthy, timeout=view.stale_after + 2.0)
        assert store.cached("k") == (False, None)
    finally:
        etcd1.restart(0)
    store.set("k", b"2")
    until(lambda: store.cached("k") == (True, b"2"), timeout=10.0)
    assert view.resyncs + view.confirms >= 2


@pytest.mark.slow  # a 3-member cluster of its own, one member killed and restarted
def test_a_change_made_while_the_stream_was_lost_is_read_again(etcd3):
    """The view reaches only member 0; while it is down the others commit a put and a delete in the range.
    Back, member 0 answers the confirming read with a changed range, and the view re-reads the prefix:
    it serves both changes and never the values it held before."""
    store = fresh_store(etcd3, timeout=15.0)
    store.set("k", b"1")
    store.set("gone", b"x")
    view = WatchView(EtcdClient(etcd3.endpoints[:1], **etcd3.tls_files), store.prefix, stale_after=0.3).start()
    try:
        key, gone = store.prefix + b"k", store.prefix + b"gone"
        until(lambda: view.lookup(key) == (True, b"1") and view.lookup(gone) == (True, b"x"))
        etcd3.kill(0)
        try:
            until(lambda: not view.healthy, timeout=view.stale_after + 2.0)
            store.set("k", b"2")
            store.delete_key("gone")
            assert view.lookup(key) == (False, None)
        finally:
            etcd3.restart(0)
        until(lambda: view.lookup(key) == (True, b"2"), timeout=10.0)
        assert view.lookup(gone) == (True, None)
        assert view.resyncs == 2
    finally:
        view.close()


def test_compacted_watch_says_so(etcd1):
    """A watch from a compacted revision answers compact_revision (the view then re-reads everything)."""
    store = fresh_store(etcd1)
    first = store.client.put(store.prefix + b"c", b"1")
    last = store.client.put(store.prefix + b"c", b"2")
    store.client.request("kv/compaction", {"revision": last})
    messages = store.client.watch_messages(store.prefix, store.prefix + b"\xff", first, read_timeout=2.0)
    try:
        msg = next(messages)
        while not (msg.get("canceled") or int(msg.get("compact_revision") or 0)):
            msg = next(messages)
    finally:
        messages.close()
    assert int(msg.get("compact_revision") or 0) >= last


def test_one_transaction_decides_exactly_once_among_concurrent_reporters(etcd1):
    base = fresh_store(etcd1)
    n = 4
    stores = [base.clone() for _ in range(n)]
    for round_ in range(10):
        reports = {f"r{round_}/done/{i}": f"report-{i}".encode() for i in range(n)}
        answers: list = [None] * n
        barrier = threading.Barrier(n)

        def report(i: int) -> None:
            mine = f"r{round_}/done/{i}"
            expected = [(k, v) for k, v in reports.items() if k != mine]
            barrier.wait()
            answers[i] = stores[i].put_and_decide(mine, reports[mine], expected, f"r{round_}/dec", f"by-{i}")

        threads = [threading.Thread(target=report, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        decided = base.get(f"r{round_}/dec")
        winners = [i for i, a in enumerate(answers) if a == f"by-{i}".encode()]
        assert len(winners) == 1 and decided == f"by-{winners[0]}".encode()
        # whoever did not decide read either nothing yet or that same decision
        assert all(a in (None, decided) for a in answers)
        assert base.multi_get(list(reports)) == list(reports.values())  # every report was written


def test_planted_report_completes_nothing(etcd1):
    store = fresh_store(etcd1)
    store.set("done/1", b"planted")  # not the value member 1 writes
    assert store.put_and_decide("done/0", b"zero", [("done/1", b"one")], "dec", b"commit") is None
    assert store.peek_many(["dec"]) == [None]
    # member 1's genuine report completes the count
    assert store.put_and_decide("done/1", b"one", [("done/0", b"zero")], "dec", b"commit") == b"commit"
    # a register already decided is answered, never overwritten
    assert store.put_and_decide("done/0", b"zero", [("done/1", b"one")], "dec", b"other") == b"commit"


def test_sealed_report_and_forged_register(etcd1):
    secret = JobSecret.generate()
    a = ControlStore("etcd://test", 0, secret, store=fresh_store(etcd1))
    b = ControlStore("etcd://test", 1, secret, store=a.raw.clone())
    assert a.raw.transactions and a.raw.views
    assert a.report_and_decide("s1/done/0", "1", {"s1/done/1": "1"}, "s1/dec", "commit") is None
    assert b.report_and_decide("s1/done/1", "1", {"s1/done/0": "1"}, "s1/dec", "commit") == "commit"
    assert a.recent_genuine("s1/dec") in (None, "commit")
    until(lambda: a.recent_genuine("s1/dec") == "commit")
    # A value planted in the register without the secret: never read as a decision.
    a.raw.set("s2/dec", b"commit")
    with pytest.raises(ForgedMessageError):
        a.report_and_decide("s2/done/0", "1", {}, "s2/dec", "commit")
    # the checked path takes the register back (what decisions.report_done falls back to)
    assert a.compare_set("s2/dec", None, "commit") == "commit"
    # A leader deciding alone (its barrier completed) writes the decision and no report; a second try
    # answers the decision already there.
    assert a.report_and_decide(None, None, {}, "s3/dec", "commit") == "commit"
    assert b.report_and_decide(None, None, {}, "s3/dec", "retry") == "commit"
    assert a.raw.num_keys() == len(["s1/done/0", "s1/done/1", "s1/dec", "s2/done/0", "s2/dec", "s3/dec"])


def test_cleanup_rides_on_the_report(etcd1):
    """forget_prefix deletes every key of the old step (all generations and attempts) and nothing else."""
    store = fresh_store(etcd1)
    old = ["s1/g0/dec", "s1/g0/done/0", "s1/g2/a1/dec", "s1/g3/done/1"]
    kept = ["s10/g0/dec", "s12/g0/done/0", "speed/s1/0"]
    store.multi_set(old + kept, [b"x"] * (len(old) + len(kept)))
    assert store.put_and_decide("s3/g0/done/0", b"r", [], "s3/g0/dec", b"commit", forget_prefix="s1/") == b"commit"
    assert store.peek_many(old) == [None] * len(old)
    assert store.peek_many(kept) == [b"x"] * len(kept)
    with pytest.raises(ValueError):
        store.put_and_decide("s3/g0/done/1", b"r", [], "s3/g0/dec", b"commit", forget_prefix="s3/")


def test_a_commit_vouches_for_its_members_and_their_threads_skip_their_beats(etcd1):
    """While commits come more often than the beat period, no member's heartbeat thread writes a beat: each
    commit's vouch names it (vouches.py). A replica the vouch names under another incarnation beats on; once
    the commits stop, every thread beats again within a period. A commit that did not decide (a ``retry``
    landed first) vouches for nobody."""
    secret = JobSecret.generate()
    raw = fresh_store(etcd1)
    leader = ControlStore("etcd://test", 0, secret, store=raw)
    monitor = ControlStore("etcd://test", 9, secret, store=raw.clone())
    period = 0.5  # far above the 30 ms between commits, even when a hogged host slows a transaction tenfold
    beating = [
        Heartbeat(ControlStore("etcd://test", r, secret, store=raw.clone()), r, 1, period, Progress())
        for r in (0, 1, 2)
    ]
    beats: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def read() -> None:
        for r in beats:
            fresh = monitor.get_fresh(f"hb/{r}")  # (sequence, payload); the same value again is accepted
            if fresh is not None and (not beats[r] or fresh[0] != beats[r][-1]):
                beats[r].append(fresh[0])

    for hb in beating:
        hb.start()
    try:
        until(lambda: raw.view.healthy)
        write_roster(leader, 1, {0: 1, 1: 1, 2: 7})  # replica 2 joined generation 1 as another incarnation
        step, first = 0, None
        deadline = time.monotonic() + 60.0
        # A commit every 30 ms, naming replica 2 under another incarnation, until replica 2 has beaten 4 times
        # more: the others' threads write no beat meanwhile.
        while first is None or len(beats[2]) - first[2] < 4:
            assert time.monotonic() < deadline, "replica 2 (another incarnation) must beat on"
            step += 1
            vouch = vouch_record(1, step)
            assert (
                leader.report_and_decide(f"s{step}/done/0", "1", {}, f"s{step}/dec", "commit", vouch=vouch) == "commit"
            )
            read()
            if step == 10:
                first = {r: len(b) for r, b in beats.items()}  # every thread has seen a vouch by now
            time.sleep(0.03)
        read()
        assert beats[0][first[0] :] == [] and beats[1][first[1] :] == [], "a vouched-for thread wrote a beat"
        assert beating[0].vouched_at > 0 and beating[2].vouched_at == 0
        # A retry that landed first: the commit's transaction does not decide and writes no vouch.
        leader.compare_set("s99/dec", None, "retry")
        before = raw.cached("vouch")
        assert (
            leader.report_and_decide("s99/done/0", "1", {}, "s99/dec", "commit", vouch=vouch_record(1, step + 1))
            == "retry"
        )
        assert raw.peek_many(["vouch"]) == [before[1]]
        stopped = len(beats[0])

        def beating_again() -> bool:  # no commits: the threads beat again
            read()
            return len(beats[0]) > stopped and len(beats[1]) > first[1]

        until(beating_again, timeout=3 * period + SLACK)
        assert all(b == sorted(b) for b in beats.values()) and monitor.freshness.replays == {}
    finally:
        for hb in beating:
            hb.stop()


def test_a_vouch_counts_once_and_only_if_genuine():
    """A reader accepts a vouch only with a sequence above the newest it accepted: an old one written back (a
    replay), a forged or a malformed one counts for nobody."""
    secret = JobSecret.generate()
    sealer = Sealer(secret)
    rounds: dict[str, bytes] = {}  # the generations' sealed rounds, as a store holds them
    reads: list[str] = []

    def read(keys):
        reads.extend(keys)
        return [rounds.get(k) for k in keys]

    def roster(generation: int, incarnations: dict[int, int]) -> None:
        for r, inc in incarnations.items():
            key = f"g{generation}/join/{r}"
            rounds[key] = sealer.seal(key, json.dumps({"inc": inc}).encode())
        rounds[f"g{generation}/members"] = sealer.seal(
            f"g{generation}/members", json.dumps(sorted(incarnations)).encode()
        )

    reader = VouchReader(sealer, Roster(sealer, read))

    def sealed(generation: int, count: int) -> bytes:
        key, payload, seq = vouch_record(generation, count)
        return sealer.seal(key, payload.encode(), seq)

    roster(3, {0: 1, 1: 2})
    first, second = sealed(3, 1), sealed(3, 2)
    assert reader.newer(first).incarnations == {0: 1, 1: 2}
    assert reader.newer(first) is None  # the same value read again: nothing new
    before = len(reads)
    assert reader.newer(second).generation == 3
    assert len(reads) == before  # generation 3's round is read once
    assert reader.newer(first) is None  # a replay
    roster(2, {0: 1})
    assert reader.newer(sealed(2, 99)) is None  # an older generation's leader, however many it wrote
    assert reader.newer(sealed(4, 1)) is None  # generation 4's round is not readable yet: counts for nobody
    roster(4, {0: 1})
    assert reader.newer(sealed(4, 1)).incarnations == {0: 1}  # ... and counts once it is
    forged = Sealer(JobSecret.generate())
    key, payload, seq = vouch_record(5, 1)
    roster(5, {0: 1})
    assert reader.newer(forged.seal(key, payload.encode(), seq)) is None
    assert reader.newer(sealer.seal(key, b'{"gen": 6}', seq)) is None  # its sequence names generation 5
    assert reader.newer(sealer.seal(key, b"[1]", seq + 1)) is None  # not well formed
    rounds["g5/join/0"] = forged.seal("g5/join/0", b'{"inc": 1}')
    assert VouchReader(sealer, Roster(sealer, read)).newer(sealer.seal(key, payload.encode(), seq)) is None
    # The same size whatever the generation's size: every view receives it each step.
    assert len(vouch_record(7, 1)[1]) == len(vouch_record(7, 2)[1])


@pytest.mark.slow  # waits out a heartbeat timeout twice over
def test_the_monitor_counts_a_vouch_as_a_beat(etcd1):
    """A replica that writes no beat of its own stays alive while commits vouch for it, and is declared dead
    within the heartbeat timeout plus a poll (and this machine's slack) once they stop; a vouch naming another
    incarnation keeps nobody alive."""
    secret = JobSecret.generate()
    sealer = Sealer(secret)
    raw = fresh_store(etcd1)
    init_keys(raw, sealer, 2)
    leader = ControlStore("etcd://test", 0, secret, store=raw.clone())
    write_roster(leader, 1, {0: 1, 1: 2})  # generation 1: replica 1 joined as incarnation 2
    for r in (0, 1):  # each replica's one beat, at its start
        leader.set(f"hb/{r}", json.dumps({"inc": 1, "beat": 1, "phase": "compute", "count": 1}), seq=sequence(1, 1))
    stop = threading.Event()
    monitor_store = raw.clone()
    timeout, poll = 0.8, 0.05
    monitor = threading.Thread(target=run_monitor, args=(monitor_store, sealer, 2, timeout, 60.0, stop, 1, poll))
    monitor.start()
    deaths = ControlStore("etcd://test", 9, secret, store=raw.clone())
    try:
        step = 0
        deadline = time.monotonic() + 2.5 * timeout
        while time.monotonic() < deadline:  # replica 1 is vouched for under another incarnation
            step += 1
            vouch = vouch_record(1, step)
            assert (
                leader.report_and_decide(f"s{step}/done/0", "1", {}, f"s{step}/dec", "commit", vouch=vouch) == "commit"
            )
            time.sleep(0.1)
        assert deaths.deaths([0, 1]) == {0: 0, 1: 1}
        stopped = time.monotonic()
        until(lambda: deaths.deaths([0, 1])[0] == 1, timeout=timeout + 5)
        assert time.monotonic() - stopped <= timeout + poll + SLACK
    finally:
        stop.set()
        monitor.join(5)
        monitor_store.close()


@pytest.mark.slow  # waits out two heartbeat timeouts (about 4 s): kept out of `make test-fast`
def test_the_monitor_reads_etcd_only_to_confirm_a_late_replica(etcd1):
    """The monitor judges from its watched view: while every replica beats it reads nothing from etcd (its
    only requests are ticks: the beats live beside the job's keys, and with nothing else written it keeps
    every process's view of them current, here another process's, checked all along); when one stops, it
    confirms on a read ordered through the Raft log and declares that one (only) dead within the heartbeat
    timeout plus a poll (and this machine's slack); a replica it knows dead costs no read after that."""
    secret = JobSecret.generate()
    sealer = Sealer(secret)
    raw = fresh_store(etcd1)
    init_keys(raw, sealer, 2)
    computing = Progress()
    stop = threading.Event()

    def compute() -> None:  # progress, not waiting on a peer: no partition probe either
        while not stop.wait(0.02):
            computing.note("compute", 0)

    threading.Thread(target=compute, daemon=True).start()
    beating = [
        Heartbeat(ControlStore("etcd://test", r, secret, store=raw.clone()), r, 1, 0.1, computing) for r in (0, 1)
    ]
    for hb in beating:
        hb.start()
    monitor_store = raw.clone()
    timeout, poll = 0.8, 0.05
    monitor = threading.Thread(target=run_monitor, args=(monitor_store, sealer, 2, timeout, 60.0, stop, 1, poll))
    monitor.start()
    elsewhere = EtcdStore(EtcdClient(etcd1.endpoints, **etcd1.tls_files), raw.prefix.decode(), raw.root.decode())

    def reads() -> int:  # the monitor's requests, less its ticks (one may be on its way: counted, not written)
        return monitor_store.client.requests - int(raw.client.get(raw.prefix + b"tick")[0] or 0)

    try:
        until(lambda: monitor_store.view.healthy and elsewhere.view.healthy)
        time.sleep(3 * poll)  # the first poll that found the view current
        sent, ticks = reads(), raw.client.get(raw.prefix + b"tick")[0]
        heard, resyncs = elsewhere.view.events, elsewhere.view.resyncs
        time.sleep(2 * timeout)
        assert reads() - sent in (0, 1), "the monitor read etcd while every replica beat"
        # The ticks reached the other process's view, which never re-read the prefix (a tick late on a
        # loaded host costs it one confirming read of a single key, not a re-read).
        assert elsewhere.view.events > heard and elsewhere.view.resyncs == resyncs
        assert raw.client.get(raw.prefix + b"tick")[0] != ticks  # it ticked
        assert ControlStore("etcd://test", 9, secret, store=raw.clone()).deaths([0, 1]) == {0: 0, 1: 0}
        beating[1].stop()
        stopped = time.monotonic()
        deaths = ControlStore("etcd://test", 9, secret, store=raw.clone())
        until(lambda: deaths.deaths([0, 1])[1] == 1, timeout=timeout + 5)
        assert time.monotonic() - stopped <= timeout + poll + SLACK
        assert reads() > sent + 1  # the confirming read (and the declaration)
        assert deaths.deaths([0, 1])[0] == 0
        time.sleep(3 * poll)
        settled = reads()
        time.sleep(timeout)  # replica 1 stays dead and silent: judged no more, no read
        assert reads() - settled in (0, 1)
    finally:
        stop.set()
        monitor.join(5)
        for hb in beating:
            hb.stop()
        monitor_store.close()
        elsewhere.close()
