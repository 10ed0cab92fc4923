"""The commit rule: one decision per (step, generation) that every member reads identically.

A collective's own success is not enough to apply a step (measured: in 5 of 40 kill trials the
survivors disagreed whether the all-reduce had completed). Each (step, generation) has a register
in the coordinator; the first ``compare_set`` of ``commit`` (written by the member completing the
count of done reports) or ``retry`` (written by any member whose reduce failed) wins, and every
member applies the step only if it reads ``commit``.
"""

from __future__ import annotations

from lightning_recover.protocol.membership import SLICE, Membership


class Decisions:
    """The commit/retry registers of one replica's :class:`Membership`."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.admit_next: dict[int, int] = {}  # joiners the last commit admitted (replica -> incarnation)

    def _key(self, step: int) -> str:
        return f"s{step}/g{self.membership.gen.number}"

    def decide_retry(self, step: int) -> bool:
        """This member's reduce failed: settle the step as ``retry`` unless already decided.

        Returns True only if the step had been committed before (impossible for a member whose
        reduce failed, since a commit needs every member's done report; checked by the caller).
        """
        return self._read(self.membership.store.compare_set(f"{self._key(step)}/dec", "", "retry"))

    def report_done(self, step: int) -> None:
        """This member's reduce completed. The member completing the count writes ``commit``.

        Whichever ``compare_set`` lands first, this ``commit`` or some member's ``retry``, is the
        decision of the step, and every member reads that one (:meth:`await_decision`). A commit
        also names the joiners to admit after this step, so that all members admit the same ones.
        """
        m = self.membership
        key = self._key(step)
        # Every process of every member reports (K per replica when replicas are sharded).
        if m.store.add(f"{key}/done", 1) == m.gen.size * getattr(m, "replica_size", 1):
            joins = m.pending_joins()
            value = "commit" + ("" if not joins else ";admit=" + ",".join(f"{r}:{i}" for r, i in sorted(joins.items())))
            m.store.compare_set(f"{key}/dec", "", value)

    def await_decision(self, step: int) -> bool:
        """Wait for the step's decision; settle it as ``retry`` if the generation fails meanwhile."""
        m = self.membership
        key = f"{self._key(step)}/dec"
        while True:
            if m.store.wait(key, SLICE):  # returns as soon as the decision is written
                return self._read(m.store.get(key))
            if m.failure_seen():
                return self._read(m.store.compare_set(key, "", "retry"))

    def _read(self, text: str) -> bool:
        if not text.startswith("commit"):
            return False
        _, _, admit = text.partition(";admit=")
        self.admit_next = {int(r): int(i) for r, i in (x.split(":") for x in admit.split(",") if x)}
        return True

    def forget_step(self, step: int) -> None:
        """Delete the decision keys of an old step (called by the leader)."""
        number = self.membership.gen.number
        for g in range(max(0, number - 4), number + 1):
            for suffix in ("done", "dec"):
                self.membership.store.delete(f"s{step}/g{g}/{suffix}")
