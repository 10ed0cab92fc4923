"""The commit rule: one decision per (step, generation) that every member reads identically.

A collective's own success is not enough to apply a step (measured: in 5 of 40 kill trials the
survivors disagreed whether the all-reduce had completed). Each (step, generation) has a register
in the coordinator; the first ``compare_set`` of ``commit`` (written by the member completing the
count of done reports) or ``retry`` (written by any member whose reduce failed) wins, and every
member applies the step only if it reads ``commit`` and is not itself declared dead (fencing: a
replica the others excluded never applies a step of a generation it is no longer in).

Done reports are one sealed key per member rather than a counter, so nobody without the job's
secret can complete the count; a decision value is bound by its MAC to its (step, generation).

On etcd (replicas of one process) the done reports move to the data plane: after its reduce every member
joins a barrier over the generation's process group (``StepProtocol``), and only the generation's leader
writes to etcd: ``commit`` in one transaction once its barrier completed (``ControlStore.report_and_decide``,
with no other report to compare). A barrier completes somewhere only if every member entered it, and a
member enters it only after its own reduce completed: so a commit still means every member holds the
reduced gradients. A member whose barrier failed settles ``retry`` unless the leader's ``commit`` was first,
and then applies the step (it entered the barrier, so its reduce had completed). The other members are woken
by the process's watched view, not by polling the register; the same transaction vouches for every member,
whose heartbeat threads then skip their own beats (``vouches.py``). One write per step for the whole
generation, instead of one per member and their beats.
On the TCPStore (and for replicas of K > 1 processes) every member reports: a write, a check of the others'
reports and a ``compare_set``, as before.

Speculative commit (etcd, replicas of one process, not exact mode, no joiner waiting): once its barrier
completed, a member applies the step at once, and the leader's ``commit`` is written off the critical path
(:meth:`commit_speculatively`). The step is *confirmed* (:meth:`confirm`) before this member takes part in
anything that depends on it: its next reduce, a store collective (metrics, barriers, checkpoint election),
the end of the job. By then the leader's ``commit`` is in the watched view, so the failure-free step pays
the barrier only. Why this is safe:

* ``commit`` is right whenever any member's barrier completed (every member then holds the reduce), so any
  such member may write it: the leader at once, or a member that finds the register empty while the
  generation fails (the leader died before writing).
* ``retry`` is written only by a member whose reduce or barrier failed. If a barrier failed at one member
  and completed at another (a member died during the barrier itself), the first ``compare_set`` wins as
  before. A member that applied a step settled ``retry`` learns it at confirmation and stops
  (:class:`ReplicaExcludedError`): it never takes part in another step, collective or checkpoint, and
  the others carry on from the retried step, as after any death.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from lightning_recover.errors import ForgedMessageError, ReplicaExcludedError
from lightning_recover.protocol.membership import POLL_MIN, SLICE, Membership, backoff
from lightning_recover.protocol.vouches import vouch_record


class Decisions:
    """The commit/retry registers of one replica's :class:`Membership`."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.admit_next: dict[int, int] = {}  # joiners the last commit admitted (replica -> incarnation)
        self._known: dict[str, str] = {}  # register -> decision this member's report already read back
        self._forget: list[int] = []  # etcd: old steps whose keys the next report deletes (see forget_step)
        # Speculative commit: the register of the step applied but not yet confirmed, and the leader's write
        # of it (on a thread of its own, over a connection of its own: threads must not share one).
        self._pending: Optional[tuple[int, str]] = None  # (step, register)
        self._pending_write: Optional[Future] = None
        self._writer: Optional[ThreadPoolExecutor] = None
        self._writer_store = None
        self._vouched = (-1, 0)  # (generation, vouches this member wrote as its leader): the vouch's sequence

    def _key(self, step: int, attempt: int = 0) -> str:
        # attempt > 0: exact mode redoing a committed step on a recentred grid (protocol/exact.py)
        return f"s{step}/g{self.membership.gen.number}" + (f"/a{attempt}" if attempt else "")

    def decide_retry(self, step: int, attempt: int = 0) -> bool:
        """This member's reduce failed: settle the step as ``retry`` unless already decided.

        Returns True only if the step had been committed before: impossible for a member whose reduce
        failed, since a commit needs every member's done report (checked by the caller); on etcd, where
        the reports are a barrier, the leader's commit may have come first for a member whose barrier
        failed after its reduce completed, which then applies the step.
        """
        return self._read(self.membership.store.compare_set(f"{self._key(step, attempt)}/dec", None, "retry"))

    def retry_with_proposal(self, step: int, attempt: int = 0) -> Optional[dict[str, str]]:
        """This member failed before its barrier (its reduce, on etcd with reports on the data plane): the
        register to settle ``retry`` where absent, ``{register: "retry"}``, written in the next generation's
        proposal (``Membership.next_generation``) instead of a transaction of its own before it: one write
        fewer on the regroup's critical path. Nobody can commit the step or await its decision meanwhile:
        both follow the barrier, which needs this member. None where the register must be settled and read
        first (:meth:`decide_retry`): the TCPStore, replicas of K processes."""
        if not self.reports_on_data_plane():
            return None
        return {f"{self._key(step, attempt)}/dec": "retry"}

    def report_done(self, step: int, attempt: int = 0) -> None:
        """This member's reduce completed (on etcd: and the barrier after it). The member completing the
        count writes ``commit`` (on etcd: the generation's leader, see the module docstring).

        Whichever ``compare_set`` lands first, this ``commit`` or some member's ``retry``, is the
        decision of the step, and every member reads that one (:meth:`await_decision`). A commit
        also names the joiners to admit after this step, so that all members admit the same ones.
        """
        m = self.membership
        key = self._key(step, attempt)
        # Every process of every member reports (K per replica when replicas are sharded); on etcd the
        # barrier before this was the reports, and only the leader writes.
        if self.reports_on_data_plane():
            if m.rank == 0:  # every member passed the barrier: the leader decides alone
                old = next((s for s in self._forget if s != step), None)
                if old is not None:
                    self._forget.remove(old)
                try:
                    decided = self._decide_in_one_transaction(key, old)
                    if decided is not None:
                        self._known[f"{key}/dec"] = decided
                except ForgedMessageError:  # a forged value sits in the register: take it back
                    self._known[f"{key}/dec"] = m.store.compare_set(f"{key}/dec", None, self._commit_value())
            return
        me = str(m.replica) if m.replica_size == 1 else f"{m.replica}.{m.inner}"
        m.store.set(f"{key}/done/{me}", str(m.incarnation))
        # Linearizable store: of the processes writing their report, at least the last sees them all.
        reports = [
            f"{key}/done/{r}" if m.replica_size == 1 else f"{key}/done/{r}.{i}"
            for r in m.gen.members
            for i in range(m.replica_size)
        ]
        if m.store.has_all(reports):
            try:
                m.store.multi_get(reports)
            except ForgedMessageError:
                return  # a planted report: the member's own (sealed) one overwrites it and completes the count
            joins = m.pending_joins()
            value = "commit" + ("" if not joins else ";admit=" + ",".join(f"{r}:{i}" for r, i in sorted(joins.items())))
            m.store.compare_set(f"{key}/dec", None, value)

    def reports_on_data_plane(self) -> bool:
        """Done reports are a barrier over the process group and the leader alone writes the decision: a store
        with transactions (etcd), replicas of one process (see the module docstring)."""
        m = self.membership
        return m.store.raw.transactions and m.replica_size == 1

    def leader_awaits_commit(self) -> bool:
        """The leader wants every member to wait for its ``commit`` this step (no speculation): a joiner
        waits for admission, and the commit names it, which every member must read."""
        m = self.membership
        return m.rank == 0 and bool(m.pending_joins(recent=True))

    def commit_speculatively(self, step: int) -> bool:
        """This member's barrier completed on the fast path: apply the step now (True), confirm it later.

        The leader writes ``commit`` on its writer thread; the others read it from the watched view when they
        confirm. Fencing as for any commit: a member its view shows declared dead applies nothing."""
        m = self.membership
        key = f"{self._key(step)}/dec"
        self._pending = (step, key)
        if m.rank == 0:
            old = next((s for s in self._forget if s != step), None)
            if old is not None:
                self._forget.remove(old)  # the keys stay for forget_job if this write fails
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"lr-commit-{m.replica}")
                self._writer_store = m.store.clone()
            self._pending_write = self._writer.submit(
                self._decide_in_one_transaction,
                self._key(step),
                old,
                self._writer_store,
                "commit",
                self._next_vouch(),  # made here: the main thread owns the generation
            )
        return self._read("commit")

    def confirm(self) -> None:
        """The step applied speculatively is settled ``commit`` (return) or ``retry`` (stop): see the module
        docstring. Waits for the leader's write, reading the watched view; if the generation fails before it
        lands, this member (whose barrier completed) writes ``commit`` itself."""
        if self._pending is None:
            return
        (step, key), write = self._pending, self._pending_write
        self._pending = self._pending_write = None
        m = self.membership
        decided = None
        if write is not None:  # the leader's own write: its answer
            try:
                decided = write.result()
            except ForgedMessageError:  # a forged value sits in the register: take it back
                decided = m.store.compare_set(key, None, "commit")
        deadline = time.monotonic() + m.collective_timeout
        while decided is None:
            if m.store.wait_recent(key, SLICE):
                decided = m.store.recent_genuine(key)
            if decided is None and m.failure_seen():
                decided = m.store.compare_set(key, None, "commit")
            if decided is None and time.monotonic() > deadline:
                what = "failed authentication" if m.store.has(key) else "was deleted or never written"
                raise ForgedMessageError(
                    f"replica {m.replica}: the decision {key!r} of step {step}, applied after every member's "
                    f"barrier, {what} for collective_timeout ({m.collective_timeout}s) while no member failed (a "
                    "client without the job's secret tampers with the store); this replica stops. "
                    "HINT: keep etcd's client port on a private network with client certificates."
                )
        if not decided.startswith("commit"):
            raise ReplicaExcludedError(
                f"replica {m.replica} applied step {step} once every member's barrier completed, but the "
                f"generation settled it {decided!r} (a member died during the barrier and another's completed); "
                "it stops here, applying nothing more, and the others redo the step. HINT: its launcher "
                "restarts it as a joiner (--restarts), or a standby takes its place."
            )

    def close(self, settle: bool = True) -> None:
        """Confirm the step applied speculatively (``settle``: the job ends normally), then stop the leader's
        writer thread (after the write in flight)."""
        try:
            if settle:
                self.confirm()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    def _commit_value(self) -> str:
        joins = self.membership.pending_joins(recent=True)
        return "commit" + ("" if not joins else ";admit=" + ",".join(f"{r}:{i}" for r, i in sorted(joins.items())))

    def _decide_in_one_transaction(
        self, key: str, old: Optional[int], store=None, value: Optional[str] = None, vouch=None
    ) -> Optional[str]:
        """The leader's ``commit`` in one transaction (etcd), with no report to write or compare (nobody would
        read one, and each is two watch events for every watcher): its barrier completed, so every member
        holds the reduce. The joiners named in the commit come from the
        watched view: one that asked a moment ago is admitted at the next commit instead, and every member
        reads the same list from the register. ``old``: a step whose keys the same request deletes (never
        this step's own); ``store``/``value``: the writer thread's connection and a commit naming no joiner
        (speculation: the members do not read it before they go on); ``vouch``: the record by which the commit
        vouches for every member, made by the main thread for the writer thread. Returns the register's value.
        """
        m = self.membership
        store = store or m.store
        return store.report_and_decide(
            None,
            None,
            {},
            f"{key}/dec",
            value or self._commit_value(),
            forget_prefix=None if old is None else f"s{old}/",
            vouch=vouch or self._next_vouch(),
        )

    def _next_vouch(self) -> tuple[str, str, int]:
        """The record by which this leader's next commit vouches for every member (vouches.py): their
        heartbeat threads skip their own beats."""
        gen = self.membership.gen
        count = self._vouched[1] + 1 if self._vouched[0] == gen.number else 1
        self._vouched = (gen.number, count)
        return vouch_record(gen.number, count)

    def await_decision(self, step: int, attempt: int = 0) -> bool:
        """Wait for the step's decision; settle it as ``retry`` if the generation fails meanwhile.

        Every member's reduce completed before it waits here, so the decision is due at once; a
        register still empty or forged after ``collective_timeout`` was deleted or overwritten by a
        client without the secret: :class:`ForgedMessageError`, never a guess (some member may
        already have applied the value that was taken away).
        """
        m = self.membership
        key = f"{self._key(step, attempt)}/dec"
        known = self._known.pop(key, None)
        if known is not None:  # this member's report read it back (or wrote it)
            return self._read(known)
        self._known.clear()  # an attempt abandoned for a new generation leaves nothing behind
        delay = POLL_MIN
        deadline = time.monotonic() + m.collective_timeout
        while True:
            # Returns as soon as the decision is written (etcd: woken by the process's watched view).
            if m.store.wait_recent(key, SLICE):
                decided = m.store.recent_genuine(key)
                if decided is not None:
                    return self._read(decided)
                delay = backoff(delay)  # a forged value: its legitimate writer will take it back
            if m.failure_seen():
                return self._read(m.store.compare_set(key, None, "retry"))
            if time.monotonic() > deadline:
                what = "failed authentication" if m.store.has(key) else "was deleted or never written"
                raise ForgedMessageError(
                    f"replica {m.replica}: the decision {key!r} of step {step} {what} for collective_timeout "
                    f"({m.collective_timeout}s) after every member's reduce completed (a client without the "
                    "job's secret tampers with the coordinator's store); this replica stops without applying it. "
                    "HINT: keep the coordinator's port on loopback or a private network."
                )

    def _read(self, text: str) -> bool:
        if not text.startswith("commit"):
            return False
        m = self.membership
        # Read after the decision was (the watched view applies events in order, so a recent read that
        # found the decision is at least as new as it).
        if m.store.deaths([m.replica], recent=True)[m.replica] >= m.incarnation:
            raise ReplicaExcludedError(
                f"replica {m.replica} was declared dead by the group while its step was being decided; it "
                "applies nothing more and stops here. HINT: raise heartbeat_timeout/hang_timeout if it was only slow."
            )
        _, _, admit = text.partition(";admit=")
        self.admit_next = {int(r): int(i) for r, i in (x.split(":") for x in admit.split(",") if x)}
        return True

    def forget_step(self, step: int, attempts: int = 1) -> None:
        """Delete the decision keys of an old step (called by the leader); ``attempts``: exact-mode redos + 1.

        On etcd (the leader's decision transaction) the deletion of every key under ``s{step}/`` rides on
        this member's next decision: no request of its own on the step's path. Keys of a step not forgotten
        before the job ends go with the job's keys (``forget_job``)."""
        if self.reports_on_data_plane():
            self._forget.append(step)
            del self._forget[:-8]  # a leader whose reports stopped keeps no growing list
            return
        number = self.membership.gen.number
        keys = []
        for g in range(max(0, number - 4), number + 1):
            for a in range(attempts):
                key = f"s{step}/g{g}" + (f"/a{a}" if a else "")
                keys.append(f"{key}/dec")
                for r in self.membership.gen.members:
                    for i in range(self.membership.replica_size):
                        me = str(r) if self.membership.replica_size == 1 else f"{r}.{i}"
                        keys.append(f"{key}/done/{me}")
        self.membership.store.delete_many(keys)  # etcd: one transaction; TCPStore: one delete per key
