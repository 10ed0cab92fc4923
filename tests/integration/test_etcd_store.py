"""The etcd-backed ``dist.Store`` against a real etcd: TCPStore's semantics, the sealed ControlStore over it,
gloo rendezvous through it, and the named errors of a lost or misconfigured etcd (fast: one-member etcd)."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from lightning_recover import env
from lightning_recover.control_plane import config
from lightning_recover.control_plane.answer_times import MAX_TRY_TIMEOUT
from lightning_recover.control_plane.embedded import CoordinatorStore
from lightning_recover.control_plane.etcd_client import QUICK_TRIES, EtcdCertificateError, EtcdClient
from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster, member_environment
from lightning_recover.control_plane.etcd_store import EtcdStore
from lightning_recover.errors import CoordinatorLostError, ForgedMessageError, RecoverError
from lightning_recover.protocol.messages import ControlStore, JobSecret, SealedStore, recent_many
from lightning_recover.protocol.rendezvous import RendezvousHost, leaders_store, meeting_place
from tests.etcd_cluster_fixtures import local_cluster, need_etcd

_count = [0]


def fresh_store(cluster: LocalEtcdCluster, timeout: float = 5.0) -> EtcdStore:
    _count[0] += 1
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, timeout=timeout)
    return EtcdStore(client, f"/test/{_count[0]}/kv/", root=f"/test/{_count[0]}/")


def tcp_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))


def test_same_answers_as_tcpstore(etcd1):
    """One sequence of operations on a TCPStore and on the etcd store: the same answers."""
    ops = [
        ("set", "a", b"1"),
        ("get", "a"),
        ("compare_set", "r", b"", b"first"),  # absent, "only if absent": wins
        ("compare_set", "r", b"", b"second"),  # present: answers the stored value
        ("compare_set", "r", b"first", b"third"),  # matches: wins
        ("compare_set", "r", b"nope", b"x"),  # no match
        ("compare_set", "absent", b"expected", b"x"),  # absent, something expected: answers expected
        ("add", "c", 5),
        ("add", "c", -2),
        ("add", "c", 0),
        ("add", "fresh", 0),
        ("get", "fresh"),
        ("check", ["a", "c"]),
        ("check", ["a", "missing"]),
        ("multi_set", ["m1", "m2"], [b"x", b"y"]),
        ("multi_get", ["m1", "m2", "a"]),
        ("append", "ap", b"x"),
        ("append", "ap", b"yz"),
        ("get", "ap"),
        ("delete_key", "a"),
        ("delete_key", "a"),
        ("check", ["a"]),
    ]
    tcp, ours = tcp_store(), fresh_store(etcd1)
    for op, *args in ops:
        expected = getattr(tcp, op)(*args)
        got = getattr(ours, op)(*args)
        assert got == expected, (op, args, got, expected)
    assert ours.num_keys() == 6  # r, c, fresh, m1, m2, ap ("absent" was never created, "a" deleted)


def test_recent_many_on_the_tcpstore_is_one_multi_get():
    tcp = tcp_store()
    tcp.multi_set(["a", "b"], [b"1", b"2"])
    assert recent_many(CoordinatorStore(tcp), ["b", "a"]) == [b"2", b"1"]


def test_local_members_get_their_share_of_the_cores(etcd1):
    """Go's GOMAXPROCS of a local member: the caller's if set, else the host's cores over the members."""
    with open(f"/proc/{etcd1.members[0].proc.pid}/environ", "rb") as f:
        environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    expected = os.environ.get("GOMAXPROCS") or str(max(1, len(os.sched_getaffinity(0)) // 1))
    assert environ[b"GOMAXPROCS"] == expected.encode()
    assert member_environment(3)["GOMAXPROCS"] == os.environ.get(
        "GOMAXPROCS", str(max(1, len(os.sched_getaffinity(0)) // 3))
    )


def test_more_keys_than_one_transaction_holds(etcd1):
    """multi_get/multi_set/check of 300 keys: etcd refuses transactions of more than 128 operations."""
    store = fresh_store(etcd1)
    keys = [f"k{i}" for i in range(300)]
    store.multi_set(keys, [str(i).encode() for i in range(300)])
    assert store.multi_get(keys) == [str(i).encode() for i in range(300)]
    assert store.check(keys) and not store.check(keys + ["absent"])


def test_concurrent_adds_are_counted_once_each(etcd1):
    base = fresh_store(etcd1)
    stores = [base.clone() for _ in range(4)]
    results: list[int] = []

    def run(s: EtcdStore) -> None:
        for _ in range(25):
            results.append(s.add("n", 1))

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert base.add("n", 0) == 100
    assert sorted(results) == list(range(1, 101))  # every add saw a distinct value: none lost, none doubled


class _ReplayingClient(EtcdClient):
    """Sends every transaction twice and answers with the second answer: what the client's failover
    does when a member committed a transaction and died before answering."""

    def request(self, path, body, timeout=None):
        answer = super().request(path, body, timeout)
        if path == "kv/txn":
            answer = super().request(path, body, timeout)
        return answer


def test_add_whose_answer_was_lost_is_not_counted_twice(etcd1):
    store = fresh_store(etcd1)
    replaying = EtcdStore(
        _ReplayingClient(etcd1.endpoints, **etcd1.tls_files), store.prefix.decode(), root=store.root.decode()
    )
    assert replaying.add("k", 3) == 3
    assert replaying.add("k", 4) == 7
    assert store.add("k", 0) == 7
    # compare_set replayed: the retry finds the desired value and says so
    assert replaying.compare_set("reg", b"", b"mine") == b"mine"
    assert store.get("reg") == b"mine"


def test_wait_returns_on_the_write_and_times_out_named(etcd1):
    store = fresh_store(etcd1)
    writer = store.clone()
    threading.Timer(0.3, lambda: writer.set("late", b"v")).start()
    t = time.monotonic()
    assert store.get("late") == b"v"  # get waits for the key as TCPStore's does
    assert 0.25 < time.monotonic() - t < 1.5
    t = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.wait(["never"], datetime.timedelta(seconds=0.5))
    assert 0.45 < time.monotonic() - t < 2.0


def test_sealed_control_store_over_etcd(etcd1):
    secret = JobSecret.generate()
    a = ControlStore("etcd", 0, secret, store=fresh_store(etcd1))
    b = ControlStore("etcd", 1, secret, store=a.raw.clone())
    a.set("hello", "world")
    assert b.get("hello") == "world"
    assert a.compare_set("decision/1", None, "commit") == "commit"
    assert b.compare_set("decision/1", None, "abort") == "commit"  # first writer decides
    a.raw.set("decision/2", b"forged")  # an unsealed value is not a decision: taken back
    assert b.compare_set("decision/2", None, "commit") == "commit"
    assert a.add("inc/0", 1) == 1
    a.set("dead/0", "0")
    a.raw.set("dead/0", a.sealer.seal("dead/0", b"0"))
    assert a.mark_dead(0) is True
    assert b.deaths([0]) == {0: 1}
    assert a.mark_dead(0) is False  # already declared


def two_ranks_sum(rendezvous) -> None:
    """Two ranks (threads) build a gloo group over ``rendezvous(rank)`` and all-reduce: both read 1 + 2."""
    out: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(rendezvous(r), r, 2, datetime.timedelta(seconds=20))
            t = torch.full((4,), float(r + 1))
            pg.allreduce([t]).wait()
            out[r] = t
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert torch.equal(out[0], torch.full((4,), 3.0)) and torch.equal(out[1], out[0])


def test_gloo_rendezvous_through_etcd(etcd1):
    """A two-rank gloo group whose rendezvous goes through the etcd store (under ControlStore.prefixed)."""
    secret = JobSecret.generate()
    base = ControlStore("etcd", 0, secret, store=fresh_store(etcd1))
    two_ranks_sum(lambda r: ControlStore("etcd", r, secret, store=base.raw.clone()).prefixed("gen/1"))


def test_prefix_store_over_etcd_store(etcd1):
    """torch's PrefixStore forwards set/get/add/compare_set/check/wait/multi_get to a Python store, as long as
    the Python object is kept alive by Python (PrefixStore's C++ reference does not keep its Python half):
    hence ``EtcdStore.prefixed_clone`` for ControlStore.prefixed."""
    inner = fresh_store(etcd1)
    p = dist.PrefixStore("pfx", inner)
    p.set("a", b"x")
    assert p.get("a") == b"x"
    assert p.add("n", 2) == 2
    assert p.compare_set("a", b"x", b"y") == b"y"
    assert p.check(["a", "n"]) and not p.check(["b"])
    assert p.multi_get(["a"]) == [b"y"]


@pytest.mark.slow  # starts and kills an etcd of its own, then waits out the client timeout
def test_lost_etcd_is_a_named_error_within_the_bound(tmp_path):
    need_etcd()
    cluster = local_cluster(str(tmp_path / "e"), 1).start(timeout=20)
    try:
        cs = ControlStore(cluster.url, 0, JobSecret.generate(), store=fresh_store(cluster, timeout=1.0))
        cs.set("k", "v")
        cluster.kill(0)
        t = time.monotonic()
        with pytest.raises(CoordinatorLostError, match="EtcdUnavailable"):
            cs.get("k")
        assert time.monotonic() - t < 1.0 + 0.5
    finally:
        cluster.stop()


def test_a_replicas_requests_are_bounded_by_its_store_timeout(etcd1, monkeypatch):
    """A replica's store on etcd gives each request its ``store_timeout`` (as the embedded coordinator's
    operations have it), also on its clones, not the 5 s default: a loaded host answering in 6 s is slow,
    not lost, for a replica whose heartbeat timeout is 10 s."""
    for name, value in {**etcd1.environment(), env.JOB: "bounded"}.items():
        monkeypatch.setenv(name, value)
    cs = ControlStore(etcd1.url, 0, JobSecret.generate(), timeout=21.0)
    launchers = config.connect_store(etcd1.url, 5.0)  # a launcher's or tool's store keeps the default
    try:
        cs.set("k", "v")
        assert cs.raw.client.timeout == 21.0 and cs.clone().raw.client.timeout == 21.0
        assert launchers.client.timeout == config.DEFAULT_REQUEST_TIMEOUT
    finally:
        cs.raw.close()
        launchers.close()


def test_misconfiguration_says_how_to_fix_it(tmp_path, etcd1):
    with pytest.raises(RecoverError, match="loopback only.*HINT"):
        config.parse("etcd+insecure://10.1.2.3:2379", environ={})
    with pytest.raises(RecoverError, match="without --etcd-cacert, --etcd-cert, --etcd-key.*HINT"):
        config.parse("etcd://127.0.0.1:2379", environ={})
    with pytest.raises(RecoverError, match="not understood.*HINT"):
        config.parse("zookeeper://x:1", environ={})
    with pytest.raises(RecoverError, match="not HOST:PORT"):
        config.parse("etcd://127.0.0.1", environ={})
    assert config.parse(None, environ={}) is None and config.parse("embedded", environ={}) is None
    s = config.parse(etcd1.url, environ=etcd1.environment())
    assert s.endpoints == tuple(etcd1.endpoints) and s.cacert == etcd1.tls_files["cacert"]
    with pytest.raises(RecoverError, match="refusing plain-text etcd.*HINT"):
        EtcdClient(etcd1.endpoints)
    # the cluster demands a client certificate: a client without one is refused by name
    bare = EtcdClient(etcd1.endpoints, cacert=etcd1.tls_files["cacert"], timeout=1.0)
    with pytest.raises(EtcdCertificateError, match="refused this client's certificate"):
        bare.put(b"k", b"v")


def test_a_try_waits_briefly_at_first_then_twice_as_long():
    """The client's retry policy (etcd_client's docstring): short tries while a leader election may
    have swallowed a proposal, then doubling ones so a slow but working cluster still answers."""
    client = EtcdClient(["127.0.0.1:1"], allow_insecure=True)
    tries = [client.try_timeout_after(n) for n in range(QUICK_TRIES + 4)]
    assert tries == [0.25] * QUICK_TRIES + [0.5, 1.0, 2.0, MAX_TRY_TIMEOUT]


@pytest.mark.slow  # a three-member etcd of its own
def test_a_member_that_never_answers_costs_one_short_try(tmp_path):
    """A member frozen mid-request (SIGSTOP: it accepts, never answers, like a follower that forwarded
    the proposal to a leader that just died) costs one try of ``try_timeout``, then the next member
    answers (with a 1 s try, as before, every such request stalled 1 s)."""
    need_etcd()
    cluster = local_cluster(str(tmp_path / "e"), 3).start(timeout=30)
    frozen = (cluster.leader() + 1) % 3  # a follower: the other two keep a majority
    client = EtcdClient([cluster.endpoints[(frozen + k) % 3] for k in range(3)], **cluster.tls_files, timeout=5.0)
    try:
        client.put(b"/test/frozen/k", b"0")  # connected to the member about to freeze
        cluster.freeze(frozen)
        started = time.monotonic()
        client.put(b"/test/frozen/k", b"1")
        took = time.monotonic() - started
        assert took <= client.try_timeout + 0.5, took  # + 0.5 s slack: a TLS connect on a loaded 2-core VM
        assert client.get(b"/test/frozen/k")[0] == b"1"
    finally:
        cluster.freeze(frozen, False)
        client.close()
        cluster.stop()


def test_a_generation_meets_at_its_leaders_store(etcd1):
    """On etcd a generation's group meets at the rendezvous store its leader hosts (protocol/rendezvous.py):
    a two-rank gloo group built there writes nothing to etcd; the store is bound to the address given only,
    and reads only sealed values; without an address in the leader's payload the group meets through etcd."""
    secret = JobSecret.generate()
    base = ControlStore("etcd", 0, secret, store=fresh_store(etcd1))
    host = RendezvousHost("127.0.0.1", 20.0)

    def leaders(r: int) -> dist.Store:
        cs = ControlStore("etcd", r, secret, store=base.raw.clone())
        return meeting_place(cs, {"step": 3, "rdv": host.address}, "pg/g1", 20.0)()

    two_ranks_sum(leaders)
    assert base.raw.num_keys() == 0, "the rendezvous wrote to etcd"
    port = int(host.address.rpartition(":")[2])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()  # loopback, but not the address given
    host.store.set("pg/g2/addr", b"planted")  # written without the job's secret
    with pytest.raises(ForgedMessageError):
        leaders_store(base, host.address, "pg/g2", 5.0).get("addr")
    assert isinstance(meeting_place(base, {"step": 3}, "pg/g3", 5.0), SealedStore)
