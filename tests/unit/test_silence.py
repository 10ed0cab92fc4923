"""A watcher's own time (``protocol/silence.py``): silence it could not observe is not blamed on the peer."""

from __future__ import annotations

from lightning_recover.protocol.silence import OwnTime


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watcher() -> tuple[OwnTime, Clock]:
    """A watcher whose turns count at most 1 s each, on a clock the test moves."""
    clock = Clock()
    return OwnTime(1.0, clock), clock


def _run(own: OwnTime, clock: Clock, seconds: float, turn: float) -> None:
    """The watcher turns every ``turn`` seconds for ``seconds``."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + turn)
        own.turn()


def test_a_watcher_that_runs_counts_wall_time():
    own, clock = _watcher()
    answered = clock.now
    _run(own, clock, 6.0, 0.01)
    assert abs(own.since(answered) - 6.0) < 1e-6


def test_a_stretch_the_watcher_did_not_run_is_not_counted():
    own, clock = _watcher()
    answered = clock.now
    _run(own, clock, 0.5, 0.01)
    clock.now += 5.0  # stopped: no turn for 5 s
    own.turn()
    assert abs(own.since(answered) - 1.5) < 1e-6  # 0.5 s run, then one turn's 1 s of the 5 s gap


def test_a_stall_before_the_last_answer_does_not_shorten_the_silence_after_it():
    own, clock = _watcher()
    clock.now += 10.0
    own.turn()  # a stall
    answered = clock.now
    _run(own, clock, 3.0, 0.05)
    assert abs(own.since(answered) - 3.0) < 1e-6


def test_a_watcher_always_slow_still_declares_a_silent_peer_lost():
    """Turns 3 s apart (each counted as 1 s): a 5 s bound of own time is passed at the 6th turn (18 s)."""
    own, clock = _watcher()
    answered = clock.now
    turns = 0
    while own.since(answered) <= 5.0:
        clock.now += 3.0
        own.turn()
        turns += 1
    assert turns == 6
