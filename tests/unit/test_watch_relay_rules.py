"""The watch relay's rules: its backlog (``watch_relay.past_backlog``: a follower that stops reading is dropped
once what waits behind the line being sent passes the limit, and a line larger than the limit, a late follower's
snapshot of a big job, is still delivered) and its socket path's length."""

from __future__ import annotations

import pytest

from lightning_recover.control_plane.watch_relay import (
    MAX_SOCKET_PATH,
    RelayPathTooLong,
    WatchRelay,
    batch_mac,
    past_backlog,
    relay_proof,
    relay_session,
)

LIMIT = 100


def _queue(sizes: list[int], limit: int = LIMIT) -> tuple[list[int], bool]:
    """Push lines of ``sizes`` into a queue no thread drains: what it holds, and whether the follower was dropped."""
    queued: list[int] = []
    for size in sizes:
        if past_backlog(sum(queued), queued[0] if queued else None, size, limit):
            return queued, True
        queued.append(size)
    return queued, False


def test_an_empty_queue_takes_a_line_of_any_size():
    assert not past_backlog(0, None, 10 * LIMIT, LIMIT)


def test_a_snapshot_over_the_limit_is_kept_while_changes_follow_it():
    queued, dropped = _queue([10 * LIMIT, 40, 40, 20])
    assert not dropped and queued == [10 * LIMIT, 40, 40, 20]


def test_changes_behind_the_head_past_the_limit_drop_the_follower():
    queued, dropped = _queue([10 * LIMIT, 40, 40, 20, 1])
    assert dropped and queued == [10 * LIMIT, 40, 40, 20]


def test_a_frozen_follower_is_dropped_whatever_the_line_sizes():
    for size in (1, 7, 33, LIMIT, 3 * LIMIT):
        queued, dropped = _queue([size] * (2 * LIMIT + 3))
        assert dropped and sum(queued) - queued[0] <= LIMIT, size


def test_a_socket_path_too_long_to_bind_is_refused_with_a_hint(tmp_path):
    path = str(tmp_path / ("r" * MAX_SOCKET_PATH))
    with pytest.raises(RelayPathTooLong, match=r"over 107 bytes\. HINT: set TMPDIR to a shorter directory"):
        WatchRelay(None, b"job/", path)  # type: ignore[arg-type]  # the path is checked before the client is used
    assert not list(tmp_path.iterdir())


def test_the_two_ends_of_a_tcp_link_prove_different_things():
    """A relay's proof is not a follower's (a reflected answer proves nothing), and each is bound to both nonces,
    the prefix and the job's key."""
    key, prefix, a, b = b"k" * 32, b"/lightning-recover/j/kv/", b"a" * 16, b"b" * 16
    relay = relay_proof(key, b"relay", prefix, a, b)
    assert relay != relay_proof(key, b"follower", prefix, a, b)
    assert relay != relay_proof(key, b"relay", prefix, b, a)
    assert relay != relay_proof(key, b"relay", b"/lightning-recover/other/kv/", a, b)
    assert relay != relay_proof(b"o" * 32, b"relay", prefix, a, b)
    assert relay == relay_proof(key, b"relay", prefix, a, b)


def test_a_relay_over_tcp_needs_the_jobs_secret():
    with pytest.raises(ValueError, match="secret"):
        WatchRelay(None, b"/p/", listen=("127.0.0.1", 0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unix socket"):
        WatchRelay(None, b"/p/")  # type: ignore[arg-type]


def test_a_batch_mac_binds_the_link_the_batch_number_and_every_byte():
    key, prefix = b"k" * 32, b"/lightning-recover/j/kv/"
    link = relay_session(key, prefix, b"f" * 16, b"r" * 16)
    batch = b'{"clock": 1.5}\n{"events":{}}\n'
    mac = batch_mac(link, 3, batch)
    assert mac == batch_mac(link, 3, batch)
    assert mac != batch_mac(link, 4, batch)  # replayed in another place of the link
    assert mac != batch_mac(relay_session(key, prefix, b"f" * 16, b"s" * 16), 3, batch)  # another link
    assert mac != batch_mac(link, 3, batch.replace(b"1.5", b"2.5"))
