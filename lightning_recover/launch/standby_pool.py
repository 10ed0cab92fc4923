"""The launcher's warm standbys: S pre-started processes, one handed out per replica death.

See :mod:`lightning_recover.protocol.standby` for what a standby does. The pool only starts,
reaps, hands out and ends processes; the launcher writes the assignment. Standby ids are never
reused (an assignment key, once written, stays), so a replacement gets the next id. A standby's
processes are ``subprocess.Popen`` objects or, started by the job's fork server,
:class:`~lightning_recover.launch.fork_server.ForkedProcess` objects (the same interface).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from lightning_recover.launch.fork_server import Process
from lightning_recover.launch.process_tree import describe_exit, kill_tree


class StandbyPool:
    """``count`` standbys kept started, within ``budget`` standbys over the whole job.

    A standby is the list of its processes: one, or the K of a sharded replica (a standby one of
    whose processes exited is ended whole: it can no longer take a replica's place). ``spawn(s)``
    returns None for "not now" (the fork server is still importing): the next fill tries again."""

    def __init__(
        self, count: int, spawn: Callable[[int], Optional[list[Process]]], budget: int, say: Callable[[str], None]
    ) -> None:
        self._spawn = spawn
        self._count = count
        self._budget = budget
        self._say = say
        self._next_id = 0
        self.waiting: dict[int, list[Process]] = {}  # standby id -> its processes, not yet assigned

    def fill(self) -> None:
        """Start standbys until ``count`` wait (or the budget is spent)."""
        while len(self.waiting) < self._count and self._next_id < self._budget:
            s = self._next_id
            try:
                procs = self._spawn(s)
            except OSError as exc:
                self._say(f"cannot start standby {s}: {exc}; going on without it")
                self._budget = s  # the command cannot start: do not try again
                return
            if procs is None:
                return
            self._next_id += 1
            self.waiting[s] = procs

    def reap(self) -> None:
        """Forget standbys that exited while waiting (killed, crashed in start-up) and replace them."""
        for s, procs in list(self.waiting.items()):
            codes = [p.poll() for p in procs]
            if any(code is not None for code in codes):
                del self.waiting[s]
                _end(procs)
                code = next(code for code in codes if code is not None)
                self._say(f"standby {s} exited while waiting ({describe_exit(code)})")
        self.fill()

    def take(self, ready: Callable[[list[int]], list[int]]) -> tuple[int, list[Process]] | None:
        """Hand out one standby that finished its start-up (the oldest); None if none has.

        ``ready(ids)`` returns which of ``ids`` reached their wait (read from the coordinator). One
        still starting is not handed out: the replica restarts in place, and the standby stays for
        the next death."""
        alive = [s for s, procs in sorted(self.waiting.items()) if all(p.poll() is None for p in procs)]
        done = ready(alive) if alive else []
        if not done:
            return None
        return done[0], self.waiting.pop(done[0])

    def end(self) -> None:
        """Kill every standby still waiting (the job is over)."""
        for procs in self.waiting.values():
            _end(procs)
        self.waiting.clear()


def _end(procs: list[Process]) -> None:
    for proc in procs:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.wait()
