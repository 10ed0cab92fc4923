"""The watched view's catch-up rule (``etcd_watch.range_unchanged``): after a silent or lost stream, one
key's read (the range's count and its newest ``mod_revision``) must tell a range that changed from one that
did not, whatever was put and deleted meanwhile."""

from __future__ import annotations

import random

import pytest

from lightning_recover.control_plane.etcd_watch import range_unchanged


def _apply(store: dict[bytes, int], ops: list[tuple[str, bytes]], revision: int) -> int:
    """etcd's semantics for the range's ``key -> mod_revision``: every put is a new revision."""
    for op, key in ops:
        if op == "put":
            revision += 1
            store[key] = revision
        elif store.pop(key, None) is not None:
            revision += 1
    return revision


def _answer(store: dict[bytes, int]) -> tuple[int, int]:
    return len(store), max(store.values(), default=0)


CASES = {
    "nothing written": [],
    "a new key": [("put", b"new")],
    "an existing key rewritten": [("put", b"a")],
    "a key deleted": [("delete", b"a")],
    "a new key put and deleted again": [("put", b"new"), ("delete", b"new")],
    "one key deleted, another created": [("delete", b"a"), ("put", b"new")],
    "the newest key deleted, another rewritten": [("delete", b"b"), ("put", b"a")],
    "an existing key rewritten and deleted": [("put", b"a"), ("delete", b"a")],
    "a delete of a key never there": [("delete", b"absent")],
}


@pytest.mark.parametrize("ops", CASES.values(), ids=CASES.keys())
def test_the_answer_is_unchanged_exactly_when_the_range_is(ops):
    held = {b"a": 3, b"b": 7}
    store = dict(held)
    _apply(store, ops, revision=9)
    assert range_unchanged(held, *_answer(store)) == (store == held)


def test_an_empty_range_stays_empty_or_is_seen_to_fill():
    assert range_unchanged({}, 0, 0)
    assert not range_unchanged({}, 1, 12)


def test_random_histories_from_random_views():
    rng = random.Random(20261203)
    keys = [bytes([c]) for c in b"abcdef"]
    for _ in range(2000):
        store: dict[bytes, int] = {}
        revision = _apply(store, [(rng.choice(["put", "put", "delete"]), rng.choice(keys)) for _ in range(8)], 0)
        held = dict(store)
        _apply(store, [(rng.choice(["put", "delete"]), rng.choice(keys)) for _ in range(rng.randrange(4))], revision)
        assert range_unchanged(held, *_answer(store)) == (store == held), (held, store)
