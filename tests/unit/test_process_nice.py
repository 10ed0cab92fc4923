"""The control plane's priority (``control_plane/priority.py``): the variable's parsing, and a nice value set on a
thread of the test (on Linux a nice value is a thread's)."""

from __future__ import annotations

import os
import threading

import pytest

from lightning_recover import env
from lightning_recover.control_plane.priority import check_nice_permitted, control_nice, set_thread_nice


def _nice_of_a_thread_that_sets(value: int) -> int:
    seen: list[int] = []

    def run() -> None:
        set_thread_nice(value)
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_a_nice_value_is_set_on_the_calling_thread_only():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert _nice_of_a_thread_that_sets(7) == 7
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="a negative nice value needs root")
def test_root_may_lower_it_and_the_check_changes_no_thread_of_the_caller():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert _nice_of_a_thread_that_sets(-5) == -5
    check_nice_permitted(-5)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


@pytest.mark.parametrize(("text", "value"), [("-10", -10), (" 5 ", 5), ("0", 0), ("-20", -20), ("19", 19), ("", None)])
def test_the_variable_is_read_as_a_nice_value(text, value):
    assert control_nice({env.CONTROL_NICE: text}) == value
    assert control_nice({}) is None


@pytest.mark.parametrize("text", ["ten", "1.5", "-21", "20"])
def test_what_is_not_a_nice_value_is_refused_naming_the_variable_and_the_range(text):
    with pytest.raises(
        ValueError, match=r"LIGHTNING_RECOVER_CONTROL_NICE=.* is not a nice value \(an integer from -20"
    ):
        control_nice({env.CONTROL_NICE: text})
