"""The etcd control plane against the faults of a long job on a shared cluster, each made for real: a tiny
``--quota-backend-bytes`` filled by writes (NOSPACE), etcd's "too many requests", a peer trickling its
answer, a member refusing watches, a member serving a certificate of another CA, an expired client
certificate (real etcd members; tests/etcd_faults.py for the faults a member makes only under load)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

from lightning_recover.control_plane import config
from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.control_plane.etcd_cluster import make_certificates
from lightning_recover.control_plane.etcd_compaction import Compactor
from lightning_recover.control_plane.etcd_job import join_job
from lightning_recover.control_plane.etcd_store import EtcdStore
from lightning_recover.protocol.messages import JobSecret, Sealer
from lightning_recover.protocol.reachability import PartitionJudge
from tests.etcd_cluster_fixtures import local_cluster, need_etcd
from tests.etcd_faults import FaultyMember

QUOTA = 1 << 20  # 1 MiB: etcd's NOSPACE within a few hundred writes of the value below
VALUE = os.urandom(4096)


@pytest.fixture
def tiny_quota(tmp_path):
    """A one-member TLS etcd with a 1 MiB space quota and no compaction of its own."""
    need_etcd()
    cluster = local_cluster(str(tmp_path / "etcd"), 1, quota_backend_bytes=QUOTA, auto_compaction=None)
    cluster.start(timeout=20)
    try:
        yield cluster
    finally:
        cluster.stop()


def _client(cluster, endpoints=None, **kw) -> ec.EtcdClient:
    return ec.EtcdClient(endpoints or cluster.endpoints, **cluster.tls_files, **kw)


def _write(client: ec.EtcdClient, total: int) -> int:
    """Write ``total`` bytes as puts of VALUE over 8 keys (each put a new revision the history keeps)."""
    n = 0
    while n * len(VALUE) < total:
        client.put(b"/fill/%d" % (n % 8), VALUE)
        n += 1
    return n


@pytest.mark.timeout(120)
def test_nospace_is_a_named_error_with_the_operators_commands(tiny_quota):
    client = _client(tiny_quota)
    try:
        with pytest.raises(ec.EtcdNoSpace) as raised:
            _write(client, 4 * QUOTA)
        message = str(raised.value)
        assert "database space exceeded" in message and "HINT" in message
        for command in ("etcdctl compact", "etcdctl defrag", "etcdctl alarm disarm"):
            assert command in message
    finally:
        client.close()


@pytest.mark.timeout(300)
def test_compaction_keeps_writes_of_many_quotas_going(tiny_quota):
    """The writes that fill the quota above, four times over, with the job's compactor: ticked here every 32
    writes (its thread ticks every ``period`` seconds) and keeping no history older than the last tick."""
    compactor = Compactor(_client(tiny_quota), period=3600, retain=0.0, say=print)
    client = _client(tiny_quota)
    try:
        written = 0
        while written * len(VALUE) < 4 * QUOTA:
            written += _write(client, 32 * len(VALUE))
            compactor.tick()
        assert compactor.compactions >= 4 * QUOTA // (32 * len(VALUE)) - 1
        assert int(client.status()["dbSize"]) < QUOTA
    finally:
        client.close()
        compactor.stop()


def test_too_many_requests_is_retried_with_backoff(etcd1):
    with FaultyMember(etcd1.endpoints[0], etcd1.tls_files, etcd1.certs["server_cert"], etcd1.certs["server_key"]) as m:
        m.exhausted = 3
        client = _client(etcd1, [m.endpoint])
        try:
            client.put(b"/retried", b"1")  # three answers of code 8 "too many requests", then the put
            assert m.requests == 4 and m.exhausted == 0
            assert client.get(b"/retried")[0] == b"1"
        finally:
            client.close()


def test_a_trickling_member_cannot_stretch_a_call_past_its_deadline(etcd1):
    with FaultyMember(etcd1.endpoints[0], etcd1.tls_files, etcd1.certs["server_cert"], etcd1.certs["server_key"]) as m:
        m.trickle = 0.05  # an answer of ~300 bytes would take ~15 s
        client = _client(etcd1, [m.endpoint], timeout=1.0)
        try:
            started = time.monotonic()
            with pytest.raises(ec.EtcdUnavailable, match="within 1s"):
                client.get(b"/trickled")
            assert time.monotonic() - started < 1.0 + 0.5  # the deadline, plus scheduling on a shared host
        finally:
            client.close()


def test_a_wait_does_not_spin_when_watches_fail_at_once(etcd1):
    with FaultyMember(etcd1.endpoints[0], etcd1.tls_files, etcd1.certs["server_cert"], etcd1.certs["server_key"]) as m:
        m.refuse_watch = True
        store = EtcdStore(_client(etcd1, [m.endpoint]), f"/nospin-{time.monotonic_ns()}/")
        try:
            with pytest.raises(dist.DistStoreError):
                store.wait(["never"], datetime.timedelta(seconds=2))
            # Backoff from 20 ms doubling to 0.5 s: about ten watches in 2 s (without it: hundreds).
            assert 1 <= m.watches_refused <= 15, m.watches_refused
        finally:
            store.close()


@pytest.fixture
def one_member_with_a_foreign_certificate(tmp_path):
    """Three members; member 0 serves its clients a certificate signed by another CA (rotated wrongly)."""
    need_etcd()
    foreign = make_certificates(str(tmp_path / "foreign-pki"), ["127.0.0.1"])
    cluster = local_cluster(str(tmp_path / "etcd"), 3)
    cluster.client_facing_certs = {0: (foreign["server_cert"], foreign["server_key"])}
    cluster.start(timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.slow  # a three-member cluster
@pytest.mark.timeout(180)
def test_a_member_with_a_certificate_of_another_ca_is_failed_over_and_named(one_member_with_a_foreign_certificate):
    cluster = one_member_with_a_foreign_certificate
    bad = cluster.endpoints[0]
    client = _client(cluster)  # member 0 first: every new connection starts there
    try:
        client.put(b"/failover", b"1")
        assert client.get(b"/failover")[0] == b"1"
    finally:
        client.close()
    alone = _client(cluster, [bad])
    try:
        started = time.monotonic()
        with pytest.raises(ec.EtcdCertificateError) as raised:
            alone.get(b"/failover")
        assert time.monotonic() - started < 2.0  # named at once: waiting would not change a certificate
        assert bad in str(raised.value) and "unable to get local issuer certificate" in str(raised.value)
        assert "HINT" in str(raised.value)
    finally:
        alone.close()


def test_an_expired_client_certificate_has_its_own_named_error(etcd1, tmp_path):
    pki = etcd1.certs
    key, csr, cert = (str(tmp_path / n) for n in ("old.key", "old.csr", "old.crt"))
    openssl = ["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    subprocess.run([*openssl, "-subj", "/CN=old", "-keyout", key, "-out", csr], check=True, capture_output=True)
    sign = ["openssl", "x509", "-req", "-in", csr, "-CA", pki["cacert"], "-CAkey", pki["cakey"], "-CAcreateserial"]
    subprocess.run([*sign, "-days", "-1", "-out", cert], check=True, capture_output=True)  # expired yesterday
    os.chmod(key, 0o600)
    with pytest.raises(ec.EtcdClientCertificateExpired, match=f"{cert} expired on .*HINT"):
        ec.EtcdClient(etcd1.endpoints, cacert=pki["cacert"], cert=cert, key=key)
    environ = dict(etcd1.environment(), LIGHTNING_RECOVER_ETCD_CERT=cert, LIGHTNING_RECOVER_ETCD_KEY=key)
    with pytest.raises(ec.EtcdClientCertificateExpired):
        config.with_job(config.parse(etcd1.url, environ=environ), "expired").client()


def test_the_partition_judge_never_waits_on_a_deleted_death_notice(etcd1):
    """On etcd a waiting read of a missing key waits for it (a watch): a ``dead/1`` deleted by someone without
    the secret held the judge, and so the monitor, for the store's timeout. The judge reads without waiting."""
    settings = config.with_job(config.parse(etcd1.url, environ=etcd1.environment()), f"judge-{time.monotonic_ns()}")
    secret = JobSecret.generate()
    join_job(settings, replicas=3, replica_size=1, secret=secret)
    store = settings.store()
    store.set_timeout(datetime.timedelta(seconds=60))
    judge = PartitionJudge(store, Sealer(secret), suspect_after=0.5, probe_timeout=0.5, log=print)
    heartbeats = {f"hb/{r}": (r, {"inc": 1, "count": 5, "phase": "reduce"}) for r in range(3)}
    try:
        store.delete_key("dead/1")
        judge.observe(100.0, heartbeats)  # the group's last progress
        opened: list[float] = []
        done = threading.Thread(target=lambda: opened.append(judge.observe(101.0, heartbeats) is not None))
        done.start()
        done.join(10)  # a round opens in one request or two; blocked, it would wait the store's 60 s
        assert opened == [True], "the judge is still waiting"
        round_ = json.loads(Sealer(secret).open("reach/round", store.get("reach/round")))
        assert round_["round"] == 1 and round_["members"] == {"0": 1, "1": 1, "2": 1}
    finally:
        store.close()


def test_an_answer_over_the_size_bound_is_refused_by_name(etcd1, monkeypatch):
    monkeypatch.setattr(ec, "MAX_ANSWER_BYTES", 8192)  # the bound, scaled down to a key's worth (VALUE in base64)
    prefix = f"/big-{time.monotonic_ns()}/".encode()
    client = _client(etcd1)
    try:
        for i in range(4):
            client.put(prefix + b"%d" % i, VALUE)
        with pytest.raises(ec.EtcdRequestError, match="over the 8192 bytes this client reads.*HINT"):
            client.range(prefix, ec.prefix_end(prefix))
        assert client.get(prefix + b"0")[0] == VALUE  # one key is below the bound: the client goes on
    finally:
        client.close()


def test_a_cluster_with_authentication_is_named_at_once(tmp_path):
    """etcd's JSON gateway ignores a client certificate's identity once auth is on (docs/control_plane.md):
    the client says so at once instead of waiting out its deadline as for a member that does not answer."""
    need_etcd()
    cluster = local_cluster(str(tmp_path / "etcd"), 1).start(timeout=20)
    try:
        t = cluster.tls_files
        etcdctl = ["etcdctl", "--endpoints", cluster.endpoints[0], "--cacert", t["cacert"], "--cert", t["cert"]]
        etcdctl += ["--key", t["key"]]
        for args in (["user", "add", "root", "--new-user-password", "x"], ["auth", "enable"]):
            subprocess.run([*etcdctl, *args], check=True, capture_output=True, timeout=30)
        client = _client(cluster)
        started = time.monotonic()
        with pytest.raises(ec.EtcdRequestError, match="CommonName.*HINT.*without --auth"):
            client.get(b"/any")
        assert time.monotonic() - started < client.timeout
        client.close()
    finally:
        cluster.stop()


def test_compaction_resumes_at_once_when_the_role_comes_back(etcd1):
    """The monitor role may move more often than ``retain`` (a loaded host missing its lease): the compactor
    notes revisions while the role is away and compacts what is due the moment it is held again."""
    held = [False]
    compactor = Compactor(_client(etcd1), period=3600, retain=1.0, say=print, active=lambda: held[0])
    client = _client(etcd1)
    try:
        revisions = []
        for now in (10.0, 10.5, 11.0, 11.5):  # the role is elsewhere: revisions noted, nothing compacted
            revisions.append(client.put(b"/flap", b"%f" % now))
            assert compactor.tick(now) is None
        held[0] = True
        due = compactor.tick(12.0)  # held again: what was noted by 11.0 is compacted now
        assert due is not None and revisions[2] <= due < revisions[3] + 1 and compactor.compactions == 1
        with pytest.raises(ec.EtcdRequestError, match="compacted"):
            client.range(b"/flap", revision=revisions[0])  # gone from etcd's history
    finally:
        client.close()
        compactor.stop()
