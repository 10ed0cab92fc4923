"""The commit rule: one decision per (step, generation) that every member reads identically.

A collective's own success is not enough to apply a step (measured: in 5 of 40 kill trials the
survivors disagreed whether the all-reduce had completed). Each (step, generation) has a register
in the coordinator; the first ``compare_set`` of ``commit`` (written by the member completing the
count of done reports) or ``retry`` (written by any member whose reduce failed) wins, and every
member applies the step only if it reads ``commit`` and is not itself declared dead (fencing: a
replica the others excluded never applies a step of a generation it is no longer in).

Three commit protocols, one picked per replica when it starts (:func:`commit_protocol`); what differs is who
writes ``commit``, after what:

* :class:`BarrierCommit` (replicas of one process, the embedded coordinator): the done reports are on the data
  plane. After its reduce every member joins a barrier over the generation's process group (``StepProtocol``),
  and the generation's leader alone writes ``commit`` once its barrier completed. A barrier completes somewhere
  only if every member entered it, and a member enters it only after its own reduce completed: so a commit
  still means every member holds the reduced gradients. A member whose barrier failed settles ``retry``
  unless the leader's ``commit`` was first, and then applies the step (it entered the barrier, so its reduce
  had completed). The coordinator serves one write and one read per member per step, whatever N is.
* :class:`TransactionCommit` (replicas of one process on etcd): the same barrier; the leader's ``commit`` is one
  transaction (``ControlStore.report_and_decide``) that also vouches for every member, whose heartbeat threads
  then skip their own beats (``vouches.py``), and deletes an old step's keys. The other members are woken by
  the process's watched view, not by polling the register: one write per step for the whole generation.
* :class:`ReportedCommit` (replicas of K > 1 processes: no one process group holds them all): every process
  writes a done report, one sealed key each rather than a counter, so nobody without the job's secret can
  complete the count; the process that completes the count writes ``commit``.

A decision value is bound by its MAC to its (step, generation).

Speculative commit (:class:`TransactionCommit`, not exact mode, no joiner waiting): once its barrier
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

from lightning_recover.errors import ForgedMessageError, RecoverError, ReplicaExcludedError
from lightning_recover.protocol.join_rounds import Generation
from lightning_recover.protocol.membership import Membership
from lightning_recover.protocol.messages import ControlStore
from lightning_recover.protocol.polling import POLL_MIN, backoff, wait_slice
from lightning_recover.protocol.vouches import vouch_record


class Decisions:
    """The commit/retry registers of one replica's :class:`Membership`; the subclass is the commit protocol
    (see the module docstring), picked once by :func:`commit_protocol`."""

    #: the done reports are a barrier over the generation's process group (``StepProtocol._decide``)
    barrier = False
    #: a member applies the step once its barrier completed and confirms the commit later
    speculates = False

    def __init__(self, membership: Membership) -> None:
        if membership.store is None:
            raise RecoverError("a commit protocol is picked once its membership is connected (Membership.connect)")
        self.membership = membership
        self.store: ControlStore = membership.store
        self.admit_next: dict[int, int] = {}  # joiners the last commit admitted (replica -> incarnation)
        self._known: dict[str, str] = {}  # register -> decision this member's report already read back

    @property
    def _generation(self) -> Generation:
        gen = self.membership.gen
        if gen is None:
            raise RecoverError("no step is decided before the first generation formed")
        return gen

    def _key(self, step: int, attempt: int = 0) -> str:
        # attempt > 0: exact mode redoing a committed step on a recentred grid (protocol/exact.py)
        return f"s{step}/g{self._generation.number}" + (f"/a{attempt}" if attempt else "")

    def decide_retry(self, step: int, attempt: int = 0) -> bool:
        """This member's reduce failed: settle the step as ``retry`` unless already decided.

        Returns True only if the step had been committed before: impossible for a member whose reduce
        failed, since a commit needs every member's done report (checked by the caller); where the reports
        are a barrier, the leader's commit may have come first for a member whose barrier failed after its
        reduce completed, which then applies the step.
        """
        return self._read(self.store.compare_set(f"{self._key(step, attempt)}/dec", None, "retry"))

    def retry_with_proposal(self, step: int, attempt: int = 0) -> Optional[dict[str, str]]:
        """The register to settle ``retry`` in the next generation's proposal instead of a write of its own
        (:class:`TransactionCommit`); None where the register must be settled and read first (:meth:`decide_retry`)."""
        return None

    def report_done(self, step: int, attempt: int = 0) -> None:
        """This member's reduce completed (where the reports are a barrier: and the barrier after it).

        Whichever ``compare_set`` lands first, a ``commit`` or some member's ``retry``, is the decision of the
        step, and every member reads that one (:meth:`await_decision`). A commit also names the joiners to
        admit after this step, so that all members admit the same ones.
        """
        raise NotImplementedError(f"{type(self).__name__} is no commit protocol")

    def leader_awaits_commit(self) -> bool:
        """The leader wants every member to wait for its ``commit`` this step (no speculation): a joiner
        waits for admission, and the commit names it, which every member must read."""
        m = self.membership
        return m.rank == 0 and bool(m.pending_joins(recent=True))

    def commit_speculatively(self, step: int) -> bool:
        """Apply the step now and confirm it later (:class:`TransactionCommit` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not speculate")

    def confirm(self) -> None:
        """Settle the step applied speculatively, if any (:class:`TransactionCommit`)."""

    def close(self, settle: bool = True) -> None:
        """Stop what the protocol runs beside the steps (:class:`TransactionCommit`: the leader's writer)."""

    def _commit_value(self) -> str:
        joins = self.membership.pending_joins(recent=True)
        return "commit" + ("" if not joins else ";admit=" + ",".join(f"{r}:{i}" for r, i in sorted(joins.items())))

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
            if self.store.wait_recent(key, wait_slice(m.size, bool(self.store.raw.views))):
                decided = self.store.recent_genuine(key)
                if decided is not None:
                    return self._read(decided)
                delay = backoff(delay)  # a forged value: its legitimate writer will take it back
            if m.failure_seen():
                return self._read(self.store.compare_set(key, None, "retry"))
            if time.monotonic() > deadline:
                what = "failed authentication" if self.store.has(key) else "was deleted or never written"
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
        if self.store.deaths([m.replica], recent=True)[m.replica] >= m.incarnation:
            raise ReplicaExcludedError(
                f"replica {m.replica} was declared dead by the group while its step was being decided; it "
                "applies nothing more and stops here. HINT: raise heartbeat_timeout/hang_timeout if it was only slow."
            )
        _, _, admit = text.partition(";admit=")
        self.admit_next = {int(r): int(i) for r, i in (x.split(":") for x in admit.split(",") if x)}
        return True

    def forget_step(self, step: int, attempts: int = 1) -> None:
        """Delete the decision keys of an old step (called by the leader); ``attempts``: exact-mode redos + 1.
        Keys of a step not forgotten before the job ends go with the job's keys (``forget_job``)."""
        number = self._generation.number
        keys = []
        for g in range(max(0, number - 4), number + 1):
            for a in range(attempts):
                key = f"s{step}/g{g}" + (f"/a{a}" if a else "")
                keys.append(f"{key}/dec")
                keys.extend(f"{key}/done/{me}" for me in self._reporters())
        self.store.delete_many(keys)  # etcd: one transaction; TCPStore: one delete per key

    def _reporters(self) -> list[str]:
        """The names under which the members write done reports (none where the reports are a barrier)."""
        return []


class BarrierCommit(Decisions):
    """Done reports on the data plane, the leader's ``commit`` (replicas of one process, embedded coordinator)."""

    barrier = True

    def report_done(self, step: int, attempt: int = 0) -> None:
        """Every member passed the barrier: the leader decides alone, the others read its decision."""
        m = self.membership
        if m.rank != 0:
            return
        key = f"{self._key(step, attempt)}/dec"
        try:
            self._known[key] = self.store.compare_set(key, None, self._commit_value())
        except ForgedMessageError:
            pass  # forged again after every takeback: await_decision names it by its deadline, never a guess


class ReportedCommit(Decisions):
    """A done report per process; the one completing the count commits (replicas of K > 1 processes)."""

    def report_done(self, step: int, attempt: int = 0) -> None:
        """Write this process's report; the process that sees every member's writes ``commit``."""
        m = self.membership
        key = self._key(step, attempt)
        self.store.set(f"{key}/done/{m.replica}.{m.inner}", str(m.incarnation))
        # Linearizable store: of the processes writing their report, at least the last sees them all.
        reports = [f"{key}/done/{me}" for me in self._reporters()]
        if self.store.has_all(reports):
            try:
                self.store.multi_get(reports)
            except ForgedMessageError:
                return  # a planted report: the member's own (sealed) one overwrites it and completes the count
            self.store.compare_set(f"{key}/dec", None, self._commit_value())

    def _reporters(self) -> list[str]:
        m = self.membership
        return [f"{r}.{i}" for r in self._generation.members for i in range(m.replica_size)]


class TransactionCommit(BarrierCommit):
    """The barrier, then the leader's ``commit`` in one etcd transaction that vouches for every member and
    deletes an old step's keys; speculative where the step allows (replicas of one process on etcd)."""

    speculates = True

    def __init__(self, membership: Membership) -> None:
        super().__init__(membership)
        self._forget: list[int] = []  # old steps whose keys the next decision deletes (see forget_step)
        # Speculative commit: the register of the step applied but not yet confirmed, and the leader's write
        # of it (on a thread of its own, over a connection of its own: threads must not share one).
        self._pending: Optional[tuple[int, str]] = None  # (step, register)
        self._pending_write: Optional[Future] = None
        self._writer: Optional[ThreadPoolExecutor] = None
        self._writer_store: Optional[ControlStore] = None
        self._vouched = (-1, 0)  # (generation, vouches this member wrote as its leader): the vouch's sequence

    def retry_with_proposal(self, step: int, attempt: int = 0) -> Optional[dict[str, str]]:
        """This member failed before its barrier (its reduce): the register to settle ``retry`` where absent,
        ``{register: "retry"}``, written in the next generation's proposal (``Membership.next_generation``)
        instead of a transaction of its own before it: one write fewer on the regroup's critical path. Nobody
        can commit the step or await its decision meanwhile: both follow the barrier, which needs this member."""
        return {f"{self._key(step, attempt)}/dec": "retry"}

    def report_done(self, step: int, attempt: int = 0) -> None:
        """Every member passed the barrier: the leader decides alone, in one transaction."""
        m = self.membership
        if m.rank != 0:
            return
        key = self._key(step, attempt)
        old = next((s for s in self._forget if s != step), None)
        if old is not None:
            self._forget.remove(old)
        try:
            decided = self._decide_in_one_transaction(key, old)
            if decided is not None:
                self._known[f"{key}/dec"] = decided
        except ForgedMessageError:  # a forged value sits in the register: take it back
            self._known[f"{key}/dec"] = self.store.compare_set(f"{key}/dec", None, self._commit_value())

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
                self._writer_store = self.store.clone()
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
                decided = self.store.compare_set(key, None, "commit")
        deadline = time.monotonic() + m.collective_timeout
        while decided is None:
            if self.store.wait_recent(key, wait_slice(m.size, bool(self.store.raw.views))):
                decided = self.store.recent_genuine(key)
            if decided is None and m.failure_seen():
                decided = self.store.compare_set(key, None, "commit")
            if decided is None and time.monotonic() > deadline:
                what = "failed authentication" if self.store.has(key) else "was deleted or never written"
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

    def _decide_in_one_transaction(
        self,
        key: str,
        old: Optional[int],
        store: Optional[ControlStore] = None,
        value: Optional[str] = None,
        vouch: Optional[tuple[str, str, int]] = None,
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
        store = store or self.store
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
        gen = self._generation
        count = self._vouched[1] + 1 if self._vouched[0] == gen.number else 1
        self._vouched = (gen.number, count)
        return vouch_record(gen.number, count)

    def forget_step(self, step: int, attempts: int = 1) -> None:
        """The deletion of every key under ``s{step}/`` rides on this member's next decision: no request of
        its own on the step's path."""
        self._forget.append(step)
        del self._forget[:-8]  # a leader whose reports stopped keeps no growing list


def commit_protocol(membership: Membership) -> Decisions:
    """The commit protocol of a replica (see the module docstring): :class:`ReportedCommit` for replicas of K > 1
    processes, else :class:`TransactionCommit` where the control plane has transactions (etcd), else
    :class:`BarrierCommit`."""
    if membership.replica_size > 1:
        return ReportedCommit(membership)
    if membership.store is not None and membership.store.raw.transactions:
        return TransactionCommit(membership)
    return BarrierCommit(membership)
