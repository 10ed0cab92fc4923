"""Who is dead as of a given time: the monitor's judgement of what it read, with no store and no clock.

:func:`~lightning_recover.protocol.coordinator.run_monitor` reads the heartbeats (and the newest vouch) from
the control plane, opens and checks them, and hands what it accepted to a :class:`Ledger`; the ledger says
which processes to declare dead at ``now``. Everything here is a function of what it was told, so the rules are
tested as tables (tests/unit/test_monitor_verdicts.py):

* **missed heartbeats**: a process whose ``(incarnation, beat)`` has not moved for ``timeout`` seconds;
* **a lease expired**: a heartbeat that says it lives in a lease (etcd) and whose key is gone;
* **hung**: a process whose progress count has not moved for ``hang_timeout`` seconds while another replica
  waits on it (in a waiting phase; a dead incarnation waits on nobody), and which is not waiting itself;
* **gone unread**: a member of the newest vouched generation whose heartbeat key this monitor never read and
  that stays absent for ``timeout`` (a leased beat whose lease expired before a new monitor looked).

A commit's vouch counts as a beat and progress of every member it names; time the control plane stalled
(a late read, a leader election) is forgiven: nobody could beat meanwhile.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

#: phases in which a replica waits on its peers
WAITING = ("reduce", "decide", "regroup", "exchange")


@dataclass(frozen=True)
class Verdict:
    """A process to declare dead: its replica, the incarnation, why (for the log) and the cause's name."""

    replica: int
    incarnation: int
    why: str
    cause: str  # "kill" (missed heartbeats, lease, gone) or "hang"


class Ledger:
    """What the monitor knows of every heartbeat key: the newest accepted heartbeat, when its beat and its
    progress last moved, whether the last read found the key, and the incarnations known dead."""

    def __init__(self, timeout: float, hang_timeout: float) -> None:
        self.timeout = timeout
        self.hang_timeout = hang_timeout
        self.heartbeats: dict[str, tuple[int, dict]] = {}  # key -> (replica, its newest fresh, genuine heartbeat)
        self.beats: dict[str, tuple[int, int, float]] = {}  # key -> (incarnation, beat, when it last moved)
        self.progress: dict[str, tuple[int, int, float]] = {}  # key -> (incarnation, count, when it last moved)
        self.present: dict[str, bool] = {}  # key -> whether the last read found it
        self.settled: dict[int, int] = {}  # replica -> the incarnation known dead (dead/{r} only grows)
        self.vouched: dict[int, int] = {}  # the newest vouched generation's replica -> incarnation
        self._absent_since: dict[str, float] = {}  # a member's key this monitor never read -> since when absent

    # ---------------------------------------------------------------- what the monitor tells it
    def found(self, key: str, present: bool) -> None:
        """The last read found ``key`` (or not: a leased beat is gone once its lease expired)."""
        self.present[key] = present

    def heard(self, key: str, replica: int, heartbeat: dict) -> None:
        """A fresh, genuine heartbeat of ``replica`` under ``key`` (judged at the next :meth:`verdicts`)."""
        self.heartbeats[key] = (replica, heartbeat)

    def vouch(self, incarnations: dict[int, int], now: float) -> None:
        """A commit vouches that every member it names (``replica -> incarnation``, replicas of one process)
        beat and progressed at ``now``."""
        self.vouched = incarnations
        for r, inc in incarnations.items():
            key = f"hb/{r}"
            if self.beats.get(key, (None,))[0] == inc:
                self.beats[key] = (*self.beats[key][:2], now)
            if self.progress.get(key, (None,))[0] == inc:
                self.progress[key] = (*self.progress[key][:2], now)

    def forgive(self, seconds: float, until: float = 0.0) -> None:
        """Count ``seconds`` (or everything before ``until``) against nobody: the control plane stalled."""
        self.beats = {k: (i, b, max(t + seconds, until)) for k, (i, b, t) in self.beats.items()}
        self.progress = {k: (i, c, max(t + seconds, until)) for k, (i, c, t) in self.progress.items()}

    def settle(self, replica: int, incarnation: int) -> None:
        """``incarnation`` of ``replica`` is known dead: it is judged no more."""
        self.settled[replica] = max(self.settled.get(replica, 0), incarnation)

    # ---------------------------------------------------------------- the judgement
    def verdicts(self, now: float) -> dict[str, Verdict]:
        """Key -> :class:`Verdict` of every process late or hung as of ``now`` (the module docstring's rules)."""
        out = {}
        # A dead incarnation's last heartbeat may say it waited; nobody waits on behalf of the dead.
        waiting = {
            r
            for r, hb in self.heartbeats.values()
            if hb.get("phase") in WAITING and int(hb.get("inc", 0)) > self.settled.get(r, 0)
        }
        for key, (r, hb) in self.heartbeats.items():
            verdict = self._judge(key, r, hb, waiting, now)
            if verdict is not None:
                out[key] = verdict
        for key, (r, inc, why) in members_gone_unread(
            self.vouched, self.heartbeats, self.present, self.settled, self._absent_since, now, self.timeout
        ):
            out[key] = Verdict(r, inc, why, "kill")
        return out

    def _judge(self, key: str, r: int, hb: dict, waiting: set[int], now: float) -> Verdict | None:
        inc = int(hb.get("inc", 0))
        if inc == 0 or self.settled.get(r, 0) >= inc:
            return None  # not started yet, or already dead
        beat = (inc, int(hb.get("beat", 0)))
        prev = self.beats.get(key)
        if prev is None or prev[:2] != beat:
            self.beats[key] = (*beat, now)
        if hb.get("lease"):  # alive while etcd keeps its key (the lease kept alive), dead once deleted
            if not self.present.get(key, True):
                return Verdict(r, inc, f"its heartbeat's lease expired (no keep-alive for {hb['lease']}s)", "kill")
            self.beats[key] = (*beat, now)
        count = (inc, int(hb.get("count", 0)))
        moved = self.progress.get(key)
        if moved is None or moved[:2] != count or hb.get("phase") in WAITING or not (waiting - {r}):
            self.progress[key] = (*count, now)  # progressing, waiting itself, or nobody waits on it
        if now - self.beats[key][2] > self.timeout:
            last = f"its last beat said phase {hb.get('phase')!r} of step {hb.get('step')}"
            return Verdict(r, inc, f"missed heartbeats for {now - self.beats[key][2]:.2f}s ({last})", "kill")
        if now - self.progress[key][2] > self.hang_timeout:
            return Verdict(
                r,
                inc,
                f"made no progress for {now - self.progress[key][2]:.2f}s in phase {hb.get('phase')!r} of step "
                f"{hb.get('step')} while replicas {sorted(waiting - {r})} waited on it (hung)",
                "hang",
            )
        return None


def members_gone_unread(
    members: dict[int, int],
    read: Collection[str],
    present: dict[str, bool],
    settled: dict[int, int],
    absent_since: dict[str, float],
    now: float,
    timeout: float,
) -> list[tuple[str, tuple[int, int, str]]]:
    """Members of the newest vouched generation (replicas of one process) whose heartbeat key this monitor never
    read and that stays absent for ``timeout``: a leased beat whose lease expired before this monitor (one that
    just took the role) looked. The key-by-key judgement cannot see them: it judges keys it has read.

    Args:
        members: replica -> incarnation, from the newest vouch.
        read: heartbeat keys this monitor has read at least once.
        present: heartbeat key -> whether the last read found it.
        settled: replica -> the incarnation known dead.
        absent_since: key -> when it was first seen absent (updated here).
        now: the monitor's clock.
        timeout: the heartbeat timeout.

    Returns:
        ``(key, (replica, incarnation, why))`` for each member to declare dead.
    """
    out = []
    for r, inc in sorted(members.items()):
        key = f"hb/{r}"
        if key in read or settled.get(r, 0) >= inc or present.get(key, True):
            absent_since.pop(key, None)
            continue
        since = absent_since.setdefault(key, now)
        if now - since > timeout:
            out.append((key, (r, inc, f"its heartbeat key is gone, unread by this monitor, for {now - since:.2f}s")))
    return out
