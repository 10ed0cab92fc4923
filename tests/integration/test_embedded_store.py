"""The embedded coordinator's store behind the seam: batched reads on a real TCPStore."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from lightning_recover.control_plane.embedded import BATCH_READ_TIMEOUT, CoordinatorStore, peek
from lightning_recover.launch.process_tree import stop_process
from lightning_recover.protocol import join_rounds, messages
from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.join_rounds import RoundReads, joined_round
from lightning_recover.protocol.messages import ControlStore, JobSecret, read_death
from tests.compare import SLACK


@pytest.fixture
def server():
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    yield store
    del store


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))


class _DeletesAfterCheck:
    """A real TCPStore client whose first ``check`` is followed, before it returns, by an outside client deleting
    ``victim``: the race ``peek_many`` must survive (everything else goes to the real store)."""

    def __init__(self, inner: dist.TCPStore, outside: dist.TCPStore, victim: str) -> None:
        self.inner, self.outside, self.victim = inner, outside, victim

    def check(self, keys: list[str]) -> bool:
        found = self.inner.check(keys)
        if self.victim:
            self.outside.delete_key(self.victim)
            self.victim = ""
        return found

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_peek_many_reads_every_key_at_once_and_none_where_absent(server):
    client = _client(server)
    keys = [f"hb/{r}" for r in range(300)]
    for r, key in enumerate(keys):
        client.set(key, f"beat {r}".encode())
    store = CoordinatorStore(client)
    assert store.peek_many(keys) == [f"beat {r}".encode() for r in range(300)]
    assert store.peek_many(keys) == [peek(client, k) for k in keys]  # the batch reader is reused
    assert store.peek_many([*keys[:2], "hb/absent"]) == [b"beat 0", b"beat 1", None]


def test_a_key_deleted_between_check_and_read_is_none_within_the_bound(server):
    client, outside = _client(server), _client(server)
    keys = [f"hb/{r}" for r in range(4)]
    for key in keys:
        client.set(key, b"beat")
    store = CoordinatorStore(_DeletesAfterCheck(client, outside, "hb/2"))  # type: ignore[arg-type]
    started = time.monotonic()
    assert store.peek_many(keys) == [b"beat", b"beat", None, b"beat"]
    assert time.monotonic() - started < BATCH_READ_TIMEOUT + SLACK
    client.set("hb/2", b"again")
    assert store.peek_many(keys) == [b"beat", b"beat", b"again", b"beat"]


class _RecordsKeys:
    """A real TCPStore client that lists the key each request names (everything goes to it), its clones (the
    batch reader's connection) into the same list."""

    def __init__(self, inner, keys: list | None = None) -> None:
        self.inner, self.keys = inner, keys if keys is not None else []

    def clone(self) -> _RecordsKeys:
        return _RecordsKeys(self.inner.clone(), self.keys)

    def __getattr__(self, name: str):
        found = getattr(self.inner, name)
        if not callable(found):
            return found

        def recorded(*args, **kwargs):
            if args and isinstance(args[0], str):
                self.keys.append(args[0])
            elif args and isinstance(args[0], list) and name != "check":  # a batch read (a check reads no value)
                self.keys.extend(args[0])
            return found(*args, **kwargs)

        return recorded


def test_a_rounds_polls_read_each_join_once_and_the_list_when_it_grew():
    """Polls of a forming round read the list of who joined only when the round's ``joins`` counter moved, and only
    the joins not read genuine before (a join is never taken back): a round of N costs each member N list reads and
    N payload reads in all, not a read of each per poll. A join forged over one already read is not read again; a
    fresh reader rejects it."""
    secret = JobSecret.generate()
    coordinator = Coordinator("127.0.0.1", 0, 16, 1.0, secret)
    reader, writer = ControlStore(coordinator.addr, 0, secret), ControlStore(coordinator.addr, 1, secret)
    recorder = reader.raw.store = _RecordsKeys(reader.raw.store)
    reads = RoundReads("g1")
    for r in range(16):
        writer.set(f"g1/join/{r}", json.dumps({"step": 0, "inc": 1}))
        writer.append_hint("g1/joined", f"{r},")
        writer.add("g1/joins", 1)  # answered: the set and the append before it on this connection were applied
        for _ in range(3):  # polls
            assert joined_round(reader, "g1", 16, 1, False, reads) == set(range(r + 1))
    payload_reads = [key for key in recorder.keys if key.startswith("g1/join/")]
    assert sorted(payload_reads) == sorted(f"g1/join/{r}" for r in range(16)), "each join read once"
    assert recorder.keys.count("g1/joined") == 16, "the list read once per join, not per poll"
    writer.raw.set("g1/join/3", b"forged")  # an unauthenticated write over a join already read: not read again
    assert writer.has("g1/join/3")
    assert joined_round(reader, "g1", 16, 1, False, reads) == set(range(16))
    afresh = joined_round(reader, "g1", 16, 1, False, RoundReads("g1"))
    assert afresh == set(range(16)) - {3}, "read afresh: not genuine"


def test_a_rounds_polls_read_the_death_notices_again_when_events_moved(monkeypatch):
    """A round's polls read the death notices once and again only when ``events`` moved (every notice bumps it
    after it is written), or when what they read is older than ``DEATHS_REREAD``: a notice whose writer was killed
    between the notice and the bump is seen then, of the replicas the round still awaits."""
    secret = JobSecret.generate()
    coordinator = Coordinator("127.0.0.1", 0, 8, 1.0, secret)
    reader, writer = ControlStore(coordinator.addr, 0, secret), ControlStore(coordinator.addr, 1, secret)
    recorder = reader.raw.store = _RecordsKeys(reader.raw.store)
    monkeypatch.setattr(join_rounds, "DEATHS_REREAD", 1e9)
    reads, replicas, incarnations = RoundReads("g1"), list(range(8)), {r: 1 for r in range(8)}
    for _ in range(3):  # polls
        assert reads.dead(reader, replicas, incarnations) == set()
    assert recorder.keys.count("dead/5") == 1, "the notices read once while events did not move"
    assert writer.mark_dead(5, 1)
    assert reads.dead(reader, replicas, incarnations) == {5}
    assert recorder.keys.count("dead/5") == 2
    writer.raw.set("dead/6", writer.sealer.seal("dead/6", b"1"))  # its writer killed before the bump
    assert writer.has("dead/6")
    assert reads.dead(reader, replicas, incarnations) == {5}
    monkeypatch.setattr(join_rounds, "DEATHS_REREAD", 0.0)
    assert reads.dead(reader, replicas, incarnations) == {5, 6}
    # Past DEATHS_REREAD only the notices of the replicas the round still awaits are read again.
    writer.raw.set("dead/7", writer.sealer.seal("dead/7", b"1"))  # unannounced too
    recorder.keys.clear()
    assert reads.dead(reader, replicas, incarnations, awaited={2}) == {5, 6}
    assert [k for k in recorder.keys if k.startswith("dead/")] == ["dead/2"]
    assert reads.dead(reader, replicas, incarnations, awaited={7}) == {5, 6, 7}


def test_death_notices_are_read_in_two_requests_and_each_opened_once_while_it_does_not_change(monkeypatch):
    """A poll of N death notices (every member polls them through a regroup) costs the coordinator two requests,
    not N, and its reader N MACs only when the notices changed: the same bytes say the same. A notice replaced by
    an older genuine one (a replay) is still opened, and refused."""
    secret = JobSecret.generate()
    coordinator = Coordinator("127.0.0.1", 0, 64, 1.0, secret)
    reader, writer = ControlStore(coordinator.addr, 0, secret), ControlStore(coordinator.addr, 1, secret)
    requests: list[str] = []
    inner = reader.raw.store

    class _CountsRequests:
        def __getattr__(self, name: str):
            requests.append(name)
            return getattr(inner, name)

    reader.raw.store = _CountsRequests()
    opened: list[int] = []
    monkeypatch.setattr(messages, "read_death", lambda sealer, r, raw: opened.append(r) or read_death(sealer, r, raw))
    replicas = list(range(64))
    assert reader.deaths(replicas) == dict.fromkeys(replicas, 0)
    assert len(requests) <= 3 and len(opened) == 64, (requests, len(opened))  # check, the batch reader, multi_get
    requests.clear()
    assert reader.deaths(replicas) == dict.fromkeys(replicas, 0)
    assert requests == ["check"] and len(opened) == 64, "read again: two requests (one on the batch reader), no MAC"
    old = writer.raw.get("dead/7")
    assert writer.mark_dead(7, 1)
    opened.clear()  # the writer opened the notice it replaced
    assert reader.deaths(replicas)[7] == 1 and opened == [7]
    writer.raw.set("dead/7", old)  # the older genuine notice written back
    assert reader.deaths(replicas)[7] == 1 and opened == [7, 7]
    assert reader.freshness.replays == {"dead/7": 1}


@pytest.fixture
def server_process(tmp_path):
    """A TCPStore server in a process of its own (which a test may stop with SIGSTOP); yields (pid, port)."""
    ready = tmp_path / "port"
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import datetime, os, sys, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
            "timeout=datetime.timedelta(seconds=30))\n"
            f"open({str(ready)!r} + '.tmp', 'w').write(str(s.port)); os.rename({str(ready)!r} + '.tmp', {str(ready)!r})\n"
            "time.sleep(120)\n",
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert server.poll() is None and time.monotonic() < deadline, "the store server did not start"
            time.sleep(0.01)
        yield server.pid, int(ready.read_text())
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait(30)


def _client_of(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))


def test_a_write_is_applied_by_the_coordinator_when_set_returns(server_process):
    """A TCPStore client's own ``set`` returns before the server took it (no reply); the seam's waits for it. With
    the coordinator stopped (SIGSTOP) the seam's ``set`` cannot return; once it runs again, a reader on another
    connection that is told of the write after ``set`` returned finds the value."""
    pid, port = server_process
    writer, reader = CoordinatorStore(_client_of(port)), _client_of(port)
    stop_process(pid)  # every thread stopped, the store's server thread too
    returned = threading.Event()
    thread = threading.Thread(target=lambda: (writer.set("g2/state", b"digest"), returned.set()), daemon=True)
    thread.start()
    assert not returned.wait(0.5), "set returned while the coordinator was stopped"
    os.kill(pid, signal.SIGCONT)
    assert returned.wait(60), "set did not return once the coordinator ran again"
    assert reader.check(["g2/state"]) and reader.get("g2/state") == b"digest"
    writer.compare_set("reg", b"", b"x", also=[("also/1", b"a"), ("also/2", b"b")])
    assert reader.multi_get(["reg", "also/1", "also/2"]) == [b"x", b"a", b"b"]


class _GoneAndBack:
    """A real TCPStore client around whose first batch read an outside client deletes ``victim`` (after the
    ``check``), and writes it back before the next ``check``: the batch read times out although no key is gone
    for good, as when the coordinator answered late. It and its clones list the requests they carry."""

    def __init__(self, inner: dist.TCPStore, outside: dist.TCPStore, victim: str, requests: list[str]) -> None:
        self.inner, self.outside, self.victim, self.requests = inner, outside, victim, requests

    def check(self, keys: list[str]) -> bool:
        self.requests.append("check")
        if self.requests.count("check") == 2:
            self.outside.set(self.victim, b"back")
        found = self.inner.check(keys)
        if self.requests.count("check") == 1:
            self.outside.delete_key(self.victim)
        return found

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.requests.append("multi_get")
        return self.inner.multi_get(keys)

    def clone(self) -> _GoneAndBack:
        self.requests.append("clone")
        return _GoneAndBack(self.inner.clone(), self.outside, self.victim, self.requests)

    def __getattr__(self, name: str):
        if name != "set_timeout":
            self.requests.append(name)
        return getattr(self.inner, name)


def test_a_batch_read_that_timed_out_is_asked_again_while_every_key_is_there(server):
    """A batch read that timed out while the ``check`` after it finds every key there (a slow coordinator, not a
    key gone) is asked again as a batch, with a longer timeout: N single reads would ask a coordinator already
    slow N times. (A TCPStore client whose ``multi_get`` timed out waits for the server's answer to its cancel
    anyway, so a stopped coordinator cannot stand in for a slow one here.)"""
    client, outside = _client(server), _client(server)
    keys = [f"dead/{r}" for r in range(64)]
    for key in keys:
        client.set(key, b"0")
    requests: list[str] = []
    store = CoordinatorStore(_GoneAndBack(client, outside, "dead/5", requests))  # type: ignore[arg-type]
    assert store.peek_many(keys) == [b"0"] * 5 + [b"back"] + [b"0"] * 58
    assert requests == ["check", "clone", "multi_get", "check", "clone", "multi_get"], requests
