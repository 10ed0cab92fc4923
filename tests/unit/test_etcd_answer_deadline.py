"""An etcd answer's deadline (``etcd_client.DeadlineReader``) judged on what the member sent, not on when the reading
thread got to run: on a socket pair, no member needed."""

from __future__ import annotations

import socket
import time

import pytest

from lightning_recover.control_plane.etcd_client import Deadline, DeadlineReader


def _reader(deadline_in: float) -> tuple[DeadlineReader, socket.socket, socket.socket]:
    ours, members = socket.socketpair()
    deadline = Deadline()
    deadline.at = time.monotonic() + deadline_in
    return DeadlineReader(ours, deadline), ours, members


def test_an_answer_already_there_is_read_after_the_deadline_passed():
    # The reading thread did not run until after the deadline; the member had answered meanwhile.
    reader, ours, members = _reader(-1.0)
    try:
        members.sendall(b"HTTP/1.1 200 OK\r\n")
        buf = bytearray(64)
        n = reader.readinto(buf)
        assert bytes(buf[:n]) == b"HTTP/1.1 200 OK\r\n"
        with pytest.raises(TimeoutError, match="did not arrive within the request's deadline"):
            reader.readinto(buf)  # nothing more came: late, at once
    finally:
        ours.close()
        members.close()


def test_an_answer_that_does_not_come_ends_at_the_deadline():
    reader, ours, members = _reader(0.2)
    try:
        with pytest.raises(TimeoutError):
            reader.readinto(bytearray(64))
    finally:
        ours.close()
        members.close()
