"""The step boundaries where the membership changes on purpose: joiners admitted with the training state of a
member, members leaving on notice (with a final checkpoint when every member leaves).

A joiner (a restarted replica, a standby in a dead replica's place, a newcomer) asks to join; the leader's next
commit admits it, and at the next step boundary the members form the generation that invites it. The lowest
member holding the state then broadcasts it (its digest sealed in the store, ``state_transfer.py``), and the
joiner adopts it; a failure meanwhile forms the next generation and the handoff is tried again. A member told to
leave (a preemption notice, an operator's leave request) leaves at the commit that named it.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

from lightning_recover.errors import MembershipChanged, RecoverError
from lightning_recover.observe.report import note_member
from lightning_recover.protocol import state_transfer
from lightning_recover.protocol.collectives import SurvivorCollectives
from lightning_recover.protocol.exact import ExactAccumulator
from lightning_recover.protocol.membership import Membership
from lightning_recover.protocol.notice import EXIT_LEFT_ON_NOTICE, Notice, leaving_exit_code
from lightning_recover.protocol.step import StepProtocol


class JoinsAndLeaves:
    """One replica's part in the joins and leaves at step boundaries (see the module doc). Owned by its
    :class:`~lightning_recover.protocol.replica.Replica`."""

    def __init__(
        self,
        membership: Membership,
        collectives: SurvivorCollectives,
        protocol: StepProtocol,
        notice: Notice,
        say: Callable[[str], None],
        inner: int = 0,
    ) -> None:
        self.membership = membership
        self.collectives = collectives
        self.protocol = protocol
        self.notice = notice
        self._say = say  # the replica's line on the job's log (Replica.say)
        self.inner = inner
        self.final_checkpoint: Optional[Callable[[int], None]] = None  # see Replica.set_final_checkpoint
        self.get_state: Optional[Callable[[], dict]] = None  # the strategy's state hooks (Replica.set_state_hooks)
        self.set_state: Optional[Callable[[dict], None]] = None
        self.join_timing: dict[str, float] = {}  # a joiner's: when it asked, got the state, the transfer's length
        self.left = False  # this process left the job on a notice: its exit code says so (EXIT_LEFT_ON_NOTICE)

    # ------------------------------------------------------------------ leaving on notice
    @property
    def told_to_leave(self) -> bool:
        """This replica leaves at the step boundary just committed (it got the notice before that step's reduce)."""
        return self.membership.replica in self.protocol.leaving

    def leave_if_told(self, step: int) -> None:
        """After committed step ``step``: if its commit named this replica as leaving, leave the job (after the
        final checkpoint when every member leaves) and exit with ``EXIT_LEFT_ON_NOTICE``."""
        if not self.told_to_leave:
            return
        everyone = set(self.membership.members) <= self.protocol.leaving
        if everyone and self.final_checkpoint is not None:
            self.final_checkpoint(step)
        self._say(
            f"replica {self.membership.replica} left on notice ({self.notice.source}) after step {step}"
            + (
                "; the whole job left" + (", final checkpoint written" if self.final_checkpoint else "")
                if everyone
                else ""
            )
        )
        if self.inner == 0:
            print(
                f"[lightning-recover] replica {self.membership.replica}: left on notice ({self.notice.source}) after "
                f"step {step}, exit code {EXIT_LEFT_ON_NOTICE}",
                file=sys.stderr,
                flush=True,
            )
        self.left = True
        # Its exit must not take the CPU the others train on (hosts shared by replicas): the heap moves to the
        # collector's permanent generation, as the launcher's does, so the interpreter's exit does not collect it.
        gc.freeze()
        raise SystemExit(leaving_exit_code())

    # ------------------------------------------------------------------ rejoin
    def rejoin(self) -> int:
        """A restarted replica: wait to be admitted, receive the state; return the step to run next."""
        try:
            self.membership.wait_for_invitation()
        except MembershipChanged:
            self._next_generation(None, joiner=True)
        step = self._receive_or_send_state(None, joiner=True)
        note_member(self.membership.progress, self.membership.gen.number, self.protocol.M)
        self._say(
            f"replica {self.membership.replica} rejoined at step {step}: generation {self.membership.gen.number}, "
            f"live replicas {self.membership.members}"
        )
        return step

    def admit(self, step: int, leaving: frozenset[int] = frozenset()) -> None:
        """Members: form the generation that includes the admitted joiners, without the members that left on
        notice at the last commit, and hand the joiners the state."""
        invite, self.protocol.decisions.admit_next = self.protocol.decisions.admit_next, {}
        try:
            self.membership.next_generation({"step": step, "have": []}, invite=invite, leaving=leaving)
        except MembershipChanged:
            self._next_generation(step, joiner=False, leaving=leaving)
        if leaving:
            self._say(
                f"step {step}: replica(s) {sorted(leaving)} left on notice; generation {self.membership.gen.number}, "
                f"live replicas {self.membership.members}"
            )
        self._receive_or_send_state(step, joiner=False)

    def _next_generation(self, step: Optional[int], joiner: bool, leaving: frozenset[int] = frozenset()) -> None:
        self.membership.form_next_generation({"step": step, "have": [], "joiner": joiner}, leaving=leaving)

    def _receive_or_send_state(self, step: Optional[int], joiner: bool) -> int:
        """Broadcast the state from the lowest member holding it to the joiners (retried on failure)."""
        while True:
            gen = self.membership.gen
            joiners = {r for r, p in gen.payloads.items() if p.get("joiner")}
            holders = [r for r in gen.members if r not in joiners]
            if not holders:
                raise RecoverError("no live replica holds the training state to hand to the rejoining replicas")
            steps = {gen.payloads[r]["step"] for r in holders}
            if len(steps) != 1:
                raise RecoverError(f"members disagree on the step to resume at: {sorted(steps)}")
            if not joiners:
                return steps.pop()
            try:
                self._broadcast_state(gen.members.index(holders[0]), receive=joiner)
                self.membership.agree("state", succeeded=True)  # a sharded replica's processes go on together
                return steps.pop()
            except MembershipChanged:
                # Also after the agreement raised: a mate failed, so its outcome already decides for every process.
                self.membership.agree("state", succeeded=False)
                self._next_generation(step, joiner=joiner)

    def _broadcast_state(self, src_rank: int, receive: bool) -> None:
        if self.get_state is None or self.set_state is None:
            raise RecoverError("rejoin needs the strategy to register its state hooks (Replica.set_state_hooks)")
        exact = self.protocol.exact  # the exact grid travels with the training state
        mine = joiner_state(self.get_state(), exact) if self.membership.rank == src_rank else None
        began = time.perf_counter()
        received = state_transfer.broadcast_state(self.collectives, self.membership, src_rank, mine, receive)
        if receive:
            self.set_state(adopt_joiner_state(received, exact))
            # When the joiner asked, when its state was in place and how long the transfer took (benchmarks).
            self.join_timing = {
                "asked_at": self.membership.join_requests.requested_at,
                "state_at": time.time(),
                "transfer_s": time.perf_counter() - began,
            }


def joiner_state(training: dict, exact: Optional[ExactAccumulator]) -> dict:
    """What a rejoining replica receives: the strategy's training state and, in exact mode, the
    fixed-point grid (committed history that every member holds alike)."""
    return {"training": training, "exact": exact.state() if exact is not None else None}


def adopt_joiner_state(state: Any, exact: Optional[ExactAccumulator]) -> dict:
    """The training state out of :func:`joiner_state`'s dict; the exact grid taken over."""
    if not isinstance(state, dict) or "training" not in state:
        raise RecoverError("the state handed to this replica is malformed (no training state)")
    if exact is not None:
        if state.get("exact") is None:
            raise RecoverError(
                "this replica runs with exact=True but the replica handing it the state does not. "
                "HINT: give every replica of the job the same exact= option."
            )
        exact.load_state(state["exact"])
    return state["training"]
