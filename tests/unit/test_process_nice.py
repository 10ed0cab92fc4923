"""``set_own_nice``: the coordinator's priority (``LIGHTNING_RECOVER_CONTROL_NICE``), set on a thread of the test."""

from __future__ import annotations

import os
import threading

import pytest

from lightning_recover.launch.process_tree import set_own_nice


def _in_a_thread(text: str) -> tuple[int | None, int | None, str | None]:
    """``set_own_nice(text)`` on a new thread (Linux: a nice value is a thread's): what it returned, the thread's
    nice value after it, and the error it raised."""
    seen: list = [None, None, None]

    def run() -> None:
        try:
            seen[0] = set_own_nice(text)
        except ValueError as exc:
            seen[2] = str(exc)
        seen[1] = os.getpriority(os.PRIO_PROCESS, 0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0], seen[1], seen[2]


def test_a_nice_value_is_set_on_the_calling_thread_only():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert _in_a_thread("7") == (7, 7, None)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="a negative nice value needs root")
def test_root_may_lower_it():
    assert _in_a_thread("-5") == (-5, -5, None)


@pytest.mark.parametrize("text", ["ten", "1.5", "", "-21", "20"])
def test_what_is_not_a_nice_value_is_refused_with_the_range(text):
    returned, _, error = _in_a_thread(text)
    assert returned is None and error is not None
    assert "is not a nice value (an integer from -20 to 19, e.g. -10)" in error, error
