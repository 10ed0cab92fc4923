"""The embedded coordinator's store behind the seam: batched reads on a real TCPStore."""

from __future__ import annotations

import datetime
import json
import time

import pytest
import torch.distributed as dist

from lightning_recover.control_plane.embedded import BATCH_READ_TIMEOUT, CoordinatorStore, peek
from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.membership import joined_round
from lightning_recover.protocol.messages import ControlStore, JobSecret
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
    assert store.peek_many(keys, through_log=True) == [f"beat {r}".encode() for r in range(300)]
    assert store.peek_many(keys, through_log=True) == [peek(client, k) for k in keys]  # the batch reader is reused
    assert store.peek_many([*keys[:2], "hb/absent"], through_log=True) == [b"beat 0", b"beat 1", None]


def test_a_key_deleted_between_check_and_read_is_none_within_the_bound(server):
    client, outside = _client(server), _client(server)
    keys = [f"hb/{r}" for r in range(4)]
    for key in keys:
        client.set(key, b"beat")
    store = CoordinatorStore(_DeletesAfterCheck(client, outside, "hb/2"))  # type: ignore[arg-type]
    started = time.monotonic()
    assert store.peek_many(keys, through_log=True) == [b"beat", b"beat", None, b"beat"]
    assert time.monotonic() - started < BATCH_READ_TIMEOUT + SLACK
    client.set("hb/2", b"again")
    assert store.peek_many(keys, through_log=True) == [b"beat", b"beat", b"again", b"beat"]


class _CountsRequests:
    """A real TCPStore client whose requests are counted, and the keys they name listed in ``keys`` (everything
    goes to it)."""

    def __init__(self, inner, keys: list[str] | None = None) -> None:
        self.inner, self.requests, self.keys = inner, 0, keys if keys is not None else []

    def __getattr__(self, name: str):
        found = getattr(self.inner, name)
        if not callable(found):
            return found

        def counted(*args, **kwargs):
            self.requests += 1
            if args and isinstance(args[0], str):
                self.keys.append(args[0])
            return found(*args, **kwargs)

        return counted


def test_recent_death_reads_cost_one_request_until_a_notice_is_written():
    """A round's poll reads every expected member's death notice: one request (the ``events`` count) while nothing
    changed, every notice again once a notice was written."""
    secret = JobSecret.generate()
    replicas = range(64)
    coordinator = Coordinator("127.0.0.1", 0, len(replicas), 1.0, secret)
    reader, writer = ControlStore(coordinator.addr, 0, secret), ControlStore(coordinator.addr, 1, secret)
    counting = reader.raw.store = _CountsRequests(reader.raw.store)
    assert reader.deaths(replicas, recent=True) == dict.fromkeys(replicas, 0)
    assert counting.requests >= len(replicas)
    counting.requests = 0
    assert reader.deaths(replicas, recent=True) == dict.fromkeys(replicas, 0)
    assert counting.requests == 1, "nothing changed: the count alone"
    assert reader.deaths([5, 7], recent=True) == {5: 0, 7: 0}
    writer.raw.add("inc/5", 1)
    assert writer.mark_dead(5)
    counting.requests = 0
    assert reader.deaths(replicas, recent=True)[5] == 1, "a notice written moves the count: every notice read again"
    assert counting.requests >= len(replicas)
    counting.requests = 0
    assert reader.deaths(replicas, recent=True) == {r: int(r == 5) for r in replicas}
    assert counting.requests == 1


def test_a_rounds_poll_reads_each_join_once():
    """Polls of a forming round read the list of who joined and only the joins not read genuine before: a join is
    never taken back, so a round of N costs N payload reads in all, not N per poll."""
    secret = JobSecret.generate()
    coordinator = Coordinator("127.0.0.1", 0, 16, 1.0, secret)
    reader, writer = ControlStore(coordinator.addr, 0, secret), ControlStore(coordinator.addr, 1, secret)
    reads: list[str] = []
    reader.raw.store = _CountsRequests(reader.raw.store, reads)
    seen: set[str] = set()
    for r in range(16):
        writer.set(f"g1/join/{r}", json.dumps({"step": 0, "inc": 1}))
        writer.append_hint("g1/joined", f"{r},")
        assert joined_round(reader, "g1", 16, 1, False, seen) == set(range(r + 1))
    payload_reads = [key for key in reads if key.startswith("g1/join/")]
    assert sorted(payload_reads) == sorted(f"g1/join/{r}" for r in range(16)), "each join read once"
    writer.raw.set("g1/join/3", b"forged")  # an unauthenticated write over a join already read: not read again
    assert joined_round(reader, "g1", 16, 1, False, seen) == set(range(16))
    fresh: set[str] = set()
    assert joined_round(reader, "g1", 16, 1, False, fresh) == set(range(16)) - {3}, "read afresh: not genuine"
