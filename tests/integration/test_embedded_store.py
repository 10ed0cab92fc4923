"""The embedded coordinator's store behind the seam: batched reads on a real TCPStore."""

from __future__ import annotations

import datetime
import json
import time

import pytest
import torch.distributed as dist

from lightning_recover.control_plane.embedded import BATCH_READ_TIMEOUT, CoordinatorStore, peek
from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.join_rounds import joined_round
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


class _RecordsKeys:
    """A real TCPStore client that lists the key each request names (everything goes to it)."""

    def __init__(self, inner) -> None:
        self.inner, self.keys = inner, []

    def __getattr__(self, name: str):
        found = getattr(self.inner, name)
        if not callable(found):
            return found

        def recorded(*args, **kwargs):
            if args and isinstance(args[0], str):
                self.keys.append(args[0])
            return found(*args, **kwargs)

        return recorded


def test_a_rounds_polls_read_each_join_once():
    """Polls of a forming round read the list of who joined and only the joins not read genuine before (a join is
    never taken back): a round of N costs N payload reads per member in all, not N per poll. A join forged over one
    already read is not read again; a fresh reader rejects it."""
    secret = JobSecret.generate()
    coordinator = Coordinator("127.0.0.1", 0, 16, 1.0, secret)
    reader, writer = ControlStore(coordinator.addr, 0, secret), ControlStore(coordinator.addr, 1, secret)
    recorder = reader.raw.store = _RecordsKeys(reader.raw.store)
    seen: set[int] = set()
    for r in range(16):
        writer.set(f"g1/join/{r}", json.dumps({"step": 0, "inc": 1}))
        writer.append_hint("g1/joined", f"{r},")
        assert writer.has("g1/joined")  # answered after the writes before it (TCPStore does not answer set, append)
        assert joined_round(reader, "g1", 16, 1, False, seen) == set(range(r + 1))
    payload_reads = [key for key in recorder.keys if key.startswith("g1/join/")]
    assert sorted(payload_reads) == sorted(f"g1/join/{r}" for r in range(16)), "each join read once"
    writer.raw.set("g1/join/3", b"forged")  # an unauthenticated write over a join already read: not read again
    assert writer.has("g1/join/3")
    assert joined_round(reader, "g1", 16, 1, False, seen) == set(range(16))
    assert joined_round(reader, "g1", 16, 1, False, set()) == set(range(16)) - {3}, "read afresh: not genuine"
