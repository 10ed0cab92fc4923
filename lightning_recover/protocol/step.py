"""One optimizer step under failures: quota, reduce, commit decision, in-step recovery.

This is the protocol shared by the Fabric and the Trainer strategies. A step is an iterator of
microbatch ids; the caller runs forward/backward for each id it receives, gradients accumulate
locally in ``param.grad`` (a local *sum* over this replica's microbatches), and when the iterator
is exhausted the step has committed: ``param.grad`` holds ``sum_{j<M} grad(s, j) / M`` on every
live replica.

The invariant kept through any failure: each of the ``M`` microbatch ids is counted exactly once
in the committed gradient. Survivors keep what they computed; the ids the dead held are re-planned
over the survivors and computed inside the same step; the reduce is retried in a new generation.

Exact mode (``exact=True``, :mod:`lightning_recover.protocol.exact`): each microbatch's gradient is
moved out of ``param.grad`` into a fixed-point accumulator right after its backward, so the sum is
exact and the committed gradient is bitwise the same whatever the partition. A committed attempt
whose gradients left the grid's range is redone (all ``M`` microbatches, attempt ``a + 1``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lightning_recover.errors import MembershipChanged, RecoverError
from lightning_recover.protocol.collectives import SurvivorCollectives
from lightning_recover.protocol.decisions import Decisions
from lightning_recover.protocol.exact import ExactAccumulator
from lightning_recover.protocol.faults import FaultInjector
from lightning_recover.protocol.membership import Membership
from lightning_recover.protocol.notice import Notice
from lightning_recover.protocol.quotas import held_by_members, plan_quotas, plan_step

_BUCKET_BYTES = 32 << 20


@dataclass
class StepStats:
    """What happened in one step, for logging."""

    step: int
    generation: int = 0
    live_replicas: int = 0
    computed: int = 0  # microbatches this replica computed
    recomputed: int = 0  # of which were taken over from failed replicas
    recoveries: int = 0
    recovery_seconds: float = 0.0
    #: seconds this replica spent deciding the step after its reduce (its report and the wait for the
    #: decision): the control plane's share of the step's critical path
    decide_seconds: float = 0.0
    #: of ``decide_seconds``, those in the done barrier (a one-element all-reduce on the data plane, where the
    #: members' reports are a barrier): what is left is the commit and its delivery through the control plane
    barrier_seconds: float = 0.0
    loss: float | None = None  # mean loss over the M microbatches (when losses were recorded)
    redone: int = 0  # exact mode: attempts redone on a recentred fixed-point grid
    leader: bool = False
    #: members that left on notice at this step's commit (the next step is planned without them)
    left: list[int] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # see StepProtocol: {"kind": "regroup"|"failure", ...}


class StepProtocol:
    """Runs steps of ``M`` microbatches over a replica's membership, collectives and decisions.

    ``StepStats.events`` are structured records: ``{"kind": "failure", "error": str}`` when a
    reduce attempt failed, and ``{"kind": "regroup", "generation": G, "members": [...],
    "lost": n, "seconds": s}`` when the survivors formed a new generation (in ``s`` seconds of this replica's, the
    wait for the members' verdicts included) and re-planned ``n`` microbatches.
    """

    def __init__(
        self,
        membership: Membership,
        collectives: SurvivorCollectives,
        microbatches: int,
        params: Callable[[], Sequence[torch.nn.Parameter]],
        *,
        quota: str = "equal",
        injector: FaultInjector | None = None,
        inner: int = 0,
        replica_size: int = 1,
        intra_group: Callable[[], object] | None = None,
        tensor_parallel: int = 1,
        exact: bool = False,
    ) -> None:
        self.membership = membership
        self.collectives = collectives
        self.decisions: Decisions  # the commit protocol, once the replica connected (Replica.start)
        self.M = microbatches
        self._params = params
        self.quota = quota
        self.injector = injector or FaultInjector([], -1, 0)
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._mb_seconds: list[float] = []
        self._weights: dict[int, float] | None = None
        self._step_loss: float | None = None
        self.last: StepStats | None = None
        # Sharded replicas (K > 1): the replica's ids are taken in rounds of K, process `inner`
        # takes the inner-th of each round; see sharding.rounds. `zero_slot` is True while the
        # caller must run a zero-contribution microbatch (loss * 0) to keep FSDP's collectives.
        self.inner = inner
        self.replica_size = replica_size
        # With a tensor-parallel dimension of tp processes, the replica's data width is K // tp:
        # the tp processes of data position inner // tp all compute the same microbatch.
        self.tensor_parallel = tensor_parallel
        self.data_width = replica_size // tensor_parallel
        self.data_position = inner // tensor_parallel
        self._intra_group = intra_group  # the replica's own process group (sums loss stats)
        self.zero_slot = False
        # True during the last round of a list: only then need FSDP reduce-scatter inside the
        # replica (earlier rounds accumulate unsharded gradients locally, as no_sync does).
        self.sync_round = True
        # Exact mode: the fixed-point accumulator, the microbatch being computed, the step's attempt.
        self.exact = ExactAccumulator(microbatches) if exact else None
        self._current: int | None = None
        self.attempt = 0
        self._deciding = False  # this member's reduce of the attempt completed: it reached _decide
        self._attempts: dict[int, int] = {}  # step -> attempts it took (their decision keys are forgotten)
        # Leaving on notice: this process's notice (read before each reduce), the leave flags the attempt's
        # reduce summed (one slot per member rank), and the members that left at the last commit.
        self.notice: Notice | None = None
        self._leave_flags: list[float] = []
        self.leaving: frozenset[int] = frozenset()

    # -------------------------------------------------------------- hooks from the strategy
    def record_loss(self, loss: torch.Tensor) -> None:
        if self.exact is not None and self._current is not None:
            self.exact.record_loss(self._current, loss)
            return
        value = loss.detach().float().reshape(-1)[:1].sum().cpu()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def fire(self, step: int, phase: str) -> None:
        self.injector.maybe_fire(step, phase)

    # -------------------------------------------------------------- the step
    def run(self, step: int) -> Iterator[int]:
        """Yield the microbatch ids this replica must compute for ``step``; commits at the end."""
        membership = self.membership
        membership.check_health()
        progress = membership.progress
        progress.note("compute", step)
        for p in self._params():
            p.grad = None
        self.attempt = 0
        if self.exact is not None:
            self.exact.begin([p for p in self._params() if p.requires_grad])
        self._loss_sum, self._loss_count = None, 0
        self._step_loss = None
        stats = StepStats(step=step)
        have: list[int] = []
        # Throughput weights apply only if measured for exactly these members (after a join or a
        # death the next step falls back to equal quotas until every member has been measured).
        weights = self._weights if self._weights and set(self._weights) == set(membership.members) else None
        gen = membership.gen
        held = held_by_members(step, gen.payloads)
        ids = plan_step(step, self.M, gen.members, held, weights)[membership.replica]
        if held:  # this generation was formed mid-step by members that hold some of its microbatches
            stats.events.append({"kind": "joined-recovery", "generation": gen.number, "held": len(held)})
        recovering_since: float | None = None
        while True:
            slots = list(rounds(ids, self.data_position, self.data_width))
            for n, (j, mine) in enumerate(slots):
                start = time.perf_counter()
                progress.note("compute")
                self.zero_slot = not mine
                self.sync_round = n == len(slots) - 1
                self._current = j
                yield j
                self._current = None
                if self.exact is not None:
                    self.exact.absorb([p for p in self._params() if p.requires_grad])
                self.zero_slot, self.sync_round = False, True
                self._mb_seconds.append(time.perf_counter() - start)
            # The replica (all K processes) covered all of `ids`; a failure of any one process
            # takes the whole replica out, so a survivor's list is always complete.
            have.extend(ids)
            stats.computed = len(have)
            settle = None  # the register to settle ``retry`` in the proposal (Decisions.retry_with_proposal)
            try:
                committed = self._reduce_and_decide(step, stats)
            except MembershipChanged as exc:
                if not self._deciding:
                    settle = self.decisions.retry_with_proposal(step, attempt=self.attempt)
                if settle is None and self.decisions.decide_retry(step, attempt=self.attempt):
                    # A commit needs every member's done report, and this member's reduce failed:
                    # only a forged or corrupted decision reads "commit" here. Never apply it.
                    raise RecoverError(
                        f"step {step} was decided 'commit' although replica {membership.replica}'s reduce failed; "
                        "the control plane is inconsistent and no further step can be trusted"
                    ) from exc
                committed = False
                stats.events.append({"kind": "failure", "error": str(exc)})
            if committed and self.exact is not None and self.exact.redo:
                # Every member read the same reduced magnitudes: all redo the step on the same new grid.
                ids = self._redo(step, stats)
                have = []
                continue
            if committed:
                self.leaving = frozenset(r for r, flag in zip(membership.members, self._leave_flags) if flag > 0)
                break
            recovering_since = recovering_since or time.perf_counter()
            ids = self._recover(step, have, stats, settle)
            if ids:
                self.fire(step, "recompute")
        membership.progress.note("idle")
        stats.loss = self._step_loss
        if recovering_since is not None:
            stats.recovery_seconds = time.perf_counter() - recovering_since
        stats.generation = membership.gen.number
        stats.live_replicas = membership.size
        stats.leader = membership.rank == 0
        stats.left = sorted(self.leaving)
        if self.leaving:
            stats.events.append({"kind": "leave", "members": stats.left})
        self.last = stats
        self._attempts[step] = self.attempt + 1
        if stats.leader and step >= 2:
            self.decisions.forget_step(step - 2, attempts=self._attempts.pop(step - 2, 1))
        self._attempts.pop(step - 2, None)

    def _redo(self, step: int, stats: StepStats) -> list[int]:
        """Exact mode: start attempt ``a + 1`` of the step on the recentred grid; this replica's new ids."""
        self.attempt += 1
        stats.redone += 1
        stats.events.append({"kind": "exact-redo", "attempt": self.attempt})
        self.exact.begin([p for p in self._params() if p.requires_grad])
        membership = self.membership
        return plan_quotas(step, range(self.M), membership.members)[membership.replica]

    def _recover(self, step: int, have: list[int], stats: StepStats, settle: dict[str, str] | None = None) -> list[int]:
        """Form the next generation (``settle``: registers its proposal writes where absent); return the ids
        of lost microbatches this replica computes."""
        membership = self.membership
        membership.progress.note("regroup")
        began = time.perf_counter()
        while True:
            try:
                gen = membership.next_generation({"step": step, "have": have, "attempt": self.attempt}, settle=settle)
                break
            except MembershipChanged as exc:  # a member died while the generation was built
                stats.events.append({"kind": "failure", "error": str(exc)})
        steps = {(p["step"], p.get("attempt", 0)) for p in gen.payloads.values()}
        if steps != {(step, self.attempt)}:
            raise RecoverError(
                f"members of generation {gen.number} disagree on the open step and attempt: {sorted(steps)}"
            )
        held = held_by_members(step, gen.payloads)
        stats.recoveries += 1
        ids = plan_step(step, self.M, gen.members, held)[membership.replica]
        stats.recomputed += len(ids)
        stats.events.append(
            {
                "kind": "regroup",
                "generation": gen.number,
                "members": list(gen.members),
                "lost": self.M - len(held),
                "seconds": time.perf_counter() - began,
            }
        )
        return ids

    def _reduce_and_decide(self, step: int, stats: StepStats) -> bool:
        # The step before, if applied speculatively, is settled before this member reduces again.
        self._deciding = False  # True once _decide began (this member's reduce completed)
        began = time.perf_counter()
        self.decisions.confirm()
        stats.decide_seconds += time.perf_counter() - began
        if self.exact is not None:
            return self._reduce_and_decide_exact(step, stats)
        membership = self.membership
        params = [p for p in self._params() if p.requires_grad]
        # Reduce a *copy*: an interrupted gloo all-reduce leaves partial sums in its buffer, and
        # the local sum in param.grad must survive a failed attempt intact.
        # Sharded parameters (DTensor): this process reduces its local shard with the processes at
        # the same inner position of the other replicas.
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
        loss = self._loss_sum if self._loss_sum is not None else torch.zeros(1)
        device = grads[0].device if grads else torch.device("cpu")
        # The third element: the leader asks every member to await its commit this step (a joiner waits to be
        # admitted); summed with the gradients, so every member whose reduce completed reads the same answer.
        speculate = self.decisions.speculates
        awaited = float(speculate and self.decisions.leader_awaits_commit())
        # The fourth: the microbatches this replica holds (counted once per replica where the replica's processes
        # sum their statistics first), summed over the members: exactly M, or the step is refused.
        intra = self.replica_size > 1 and self._intra_group is not None
        held = float(stats.computed if self.inner == 0 or not intra else 0)
        head = [float(loss.reshape(()).float()), float(self._loss_count), awaited, held]
        extra = torch.tensor(head + self._own_leave_flag()).to(device)
        if intra:
            # Loss statistics of the whole replica (its data positions computed different microbatches).
            # The tp processes of one data position computed the same microbatches: only the first
            # one contributes, so each microbatch is counted once. A notice to any of its processes
            # makes the whole replica leave.
            import torch.distributed as dist

            if self.inner % self.tensor_parallel:
                extra[:2].zero_()
            dist.all_reduce(extra, group=self._intra_group())
        flat = _flatten_by_dtype(grads, extra)
        self.fire(step, "reduce")
        membership.progress.note("reduce")
        self.collectives.allreduce(_buckets(flat))
        held_by_all = round(flat["extra"][3].item())
        if held_by_all != self.M:
            # Every member whose reduce completed reads the same sum: all refuse the step alike.
            raise RecoverError(
                f"step {step}: the members' reduce holds {held_by_all} microbatches, not M={self.M} (they planned "
                f"the step differently in generation {membership.gen.number}): the step is not applied, since its "
                "gradient would leave the failure-free trajectory"
            )
        if self.quota == "throughput":
            self._publish_speed(step)
        membership.progress.note("decide")
        began = time.perf_counter()
        decided = self._decide(step, device, stats, speculate=speculate and not flat["extra"][2].item())
        stats.decide_seconds += time.perf_counter() - began
        if not decided:
            return False
        _unflatten_into(flat, grads, params, scale=1.0 / self.M)
        loss_sum, count, _, _, *self._leave_flags = flat["extra"].tolist()
        # The mean loss of the step is known only if every microbatch recorded one.
        self._step_loss = loss_sum / self.M if round(count) == self.M else None
        if self.quota == "throughput":
            self._weights = self._read_speeds(step)
        return True

    def _decide(self, step: int, device: torch.device, stats: StepStats, speculate: bool = False) -> bool:
        """After this member's reduce completed: its done report, then the step's decision (True: commit).

        For replicas of one process the reports are a barrier over the generation (``Decisions.barrier``): once it
        completes anywhere, every member entered it after its own reduce, so every member holds the reduced
        gradients and the leader may commit alone. A member whose barrier fails settles ``retry``, unless the
        leader's ``commit`` came first: then it applies the step, whose reduce it holds. ``speculate``: apply
        once the barrier completed and confirm the commit later (``Decisions.commit_speculatively``)."""
        self._deciding = True  # this member may enter the barrier: the register is settled (and read) first
        if self.decisions.barrier:
            entered = time.perf_counter()
            try:
                self.collectives.allreduce([torch.ones(1, device=device)])
            except MembershipChanged:
                if self.decisions.decide_retry(step, attempt=self.attempt):
                    return True
                raise
            finally:
                stats.barrier_seconds += time.perf_counter() - entered
            if speculate:
                self.fire(step, "commit")
                return self.decisions.commit_speculatively(step)
        self.decisions.report_done(step, attempt=self.attempt)
        self.fire(step, "commit")
        return self.decisions.await_decision(step, attempt=self.attempt)

    def _reduce_and_decide_exact(self, step: int, stats: StepStats) -> bool:
        """Exact mode: reduce the fixed-point sums, decide; after a commit, apply or mark a redo."""
        membership = self.membership
        params = [p for p in self._params() if p.requires_grad]
        self.fire(step, "reduce")
        membership.progress.note("reduce")
        self.exact.reduce(self.collectives, params, flags=self._own_leave_flag())
        if self.quota == "throughput":
            self._publish_speed(step)
        membership.progress.note("decide")
        began = time.perf_counter()
        decided = self._decide(step, params[0].device if params else torch.device("cpu"), stats)
        stats.decide_seconds += time.perf_counter() - began
        if not decided:
            return False
        self._leave_flags = self.exact.flags
        results = self.exact.results
        self._step_loss = self.exact.finish(params)
        if not self.exact.redo:
            for p, grad in zip(params, results):
                p.grad = grad
        if self.quota == "throughput":
            self._weights = self._read_speeds(step)
        return True

    def _own_leave_flag(self) -> list[float]:
        """One slot per member rank, 1.0 at this member's if it was told to leave: summed (or maxed) by the
        reduce, every member whose reduce completed reads the same leavers."""
        flags = [0.0] * self.membership.size
        if self.notice is not None and self.notice.is_set():
            flags[self.membership.rank] = 1.0
        return flags

    # -------------------------------------------------------------- throughput quotas
    def _publish_speed(self, step: int) -> None:
        mean = sum(self._mb_seconds) / max(1, len(self._mb_seconds))
        self._mb_seconds.clear()
        m = self.membership
        m.store.set(f"speed/s{step}/{m.replica}", repr(max(mean, 1e-6)))

    def _read_speeds(self, step: int) -> dict[int, float]:
        m = self.membership
        values = m.store.multi_get([f"speed/s{step}/{r}" for r in m.members])
        return {r: 1.0 / float(v) for r, v in zip(m.members, values)}


def rounds(ids: Sequence[int], inner: int, replica_size: int) -> Iterator[tuple[int, bool]]:
    """The slots of process ``inner`` of a replica computing ``ids`` in rounds of ``replica_size``.

    Yields ``(id, mine)``: in round k the process computes ``ids[k*K + inner]`` (mine=True); in a
    short last round a process with nothing left yields the round's first id with mine=False, a
    zero-contribution microbatch that keeps it in step with FSDP's collectives.

    With a tensor-parallel dimension the caller passes the *data* position and width
    (``inner // tp``, ``K // tp``): the tp processes of one data position get the same slots.
    """
    if replica_size == 1:
        for j in ids:
            yield j, True
        return
    for start in range(0, len(ids), replica_size):
        chunk = ids[start : start + replica_size]
        yield (chunk[inner], True) if inner < len(chunk) else (chunk[0], False)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: writes land in it), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _flatten_by_dtype(grads: Sequence[torch.Tensor], extra: torch.Tensor) -> dict:
    """Concatenate gradients into one fresh buffer per dtype (plus the loss statistics)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault(g.dtype, []).append(i)
    flat = {"extra": extra.clone(), "groups": []}
    for dtype, idx in groups.items():
        buf = torch.cat([grads[i].reshape(-1) for i in idx]) if idx else torch.empty(0, dtype=dtype)
        flat["groups"].append((idx, buf))
    return flat


def _buckets(flat: dict) -> list[torch.Tensor]:
    out = [flat["extra"]]
    for _, buf in flat["groups"]:
        per = max(1, _BUCKET_BYTES // max(1, buf.element_size()))
        out.extend(buf.split(per))
    return out


def _unflatten_into(
    flat: dict, grads: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter], scale: float
) -> None:
    for idx, buf in flat["groups"]:
        buf.mul_(scale)
        offset = 0
        for i in idx:
            n = grads[i].numel()
            p = params[i]
            if p.grad is None and hasattr(p, "to_local"):  # sharded, and no gradient reached it
                from torch.distributed.tensor import DTensor

                local = buf[offset : offset + n].view_as(grads[i]).clone()
                p.grad = DTensor.from_local(
                    local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
                )
            elif p.grad is None:
                p.grad = buf[offset : offset + n].view_as(p).clone()
            else:
                _local(p.grad).copy_(buf[offset : offset + n].view_as(grads[i]))
            offset += n
