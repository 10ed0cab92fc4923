"""The launcher's line about a slow reverse lookup (``launch/name_lookup.py``): none when the lookup was quick, else
one line that says what waits on it and the fix, for a lookup that finished late and for one still running."""

from __future__ import annotations

from lightning_recover.launch.name_lookup import SLOW_LOOKUP, slow_lookup_line


def test_a_quick_lookup_says_nothing():
    assert slow_lookup_line("127.0.0.1", "::ffff:127.0.0.1", 0.002) is None
    assert slow_lookup_line("127.0.0.1", "::ffff:127.0.0.1", SLOW_LOOKUP) is None


def test_a_slow_lookup_is_one_line_with_the_fix():
    line = slow_lookup_line("127.0.0.1", "::ffff:127.0.0.1", 5.01)
    assert line is not None and "\n" not in line
    assert "took 5.01s" in line and "every connection" in line
    assert "HINT: add '::ffff:127.0.0.1 localhost' to /etc/hosts" in line


def test_a_lookup_not_done_in_time_is_said_without_waiting_for_it():
    line = slow_lookup_line("10.0.0.5", "::ffff:10.0.0.5", None, within=0.5)
    assert line is not None and "took over 0.5s" in line and "'::ffff:10.0.0.5 <its name>'" in line
