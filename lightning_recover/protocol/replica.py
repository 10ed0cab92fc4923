"""The one façade the strategies use: this replica's side of the protocol.

:class:`Replica` owns the replica's :class:`Membership` (generations, joins, heartbeats), its
:class:`SurvivorCollectives`, its commit :class:`Decisions` and the :class:`StepProtocol` (quota,
reduce, in-step recovery) and its :class:`JoinsAndLeaves` (state handed to rejoining replicas, leaving on
notice, at step boundaries); it fires injected faults at the
named phases, and offers the small collectives Lightning needs (metrics, barrier, broadcast) over
the replicas that are alive now. Nothing here imports Lightning.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch

from lightning_recover import env
from lightning_recover.control_plane.connect import is_etcd
from lightning_recover.observe.report import note_member, note_step
from lightning_recover.protocol.collectives import SurvivorCollectives
from lightning_recover.protocol.decisions import Decisions, commit_protocol
from lightning_recover.protocol.exact import check_exact_layout
from lightning_recover.protocol.faults import Fault, FaultInjector
from lightning_recover.protocol.joins_and_leaves import JoinsAndLeaves
from lightning_recover.protocol.membership import Membership
from lightning_recover.protocol.messages import JobSecret
from lightning_recover.protocol.notice import Notice, leaving_exit_code
from lightning_recover.protocol.options import RecoverOptions
from lightning_recover.protocol.replica_env import read_replica_env
from lightning_recover.protocol.step import StepProtocol, StepStats

_uncaught = [False]


def _record_uncaught_exceptions() -> None:
    """Remember whether the replica is exiting because of an uncaught exception (exit status)."""
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        _uncaught[0] = True
        previous(*exc_info)

    if getattr(sys.excepthook, "__name__", "") != "hook":
        sys.excepthook = hook


class Replica:
    """This replica's side of the protocol."""

    def __init__(
        self,
        options: RecoverOptions,
        addr: str,
        replica: int,
        num_replicas: int,
        params: Callable[[], Sequence[torch.nn.Parameter]],
        backend: str = "gloo",
        injector: Optional[FaultInjector] = None,
        secret: Optional[JobSecret] = None,
        inner: int = 0,
        replica_size: int = 1,
        tensor_parallel: int = 1,
        standby: Optional[int] = None,
        min_replicas: Optional[int] = None,
    ) -> None:
        self.options = options
        if min_replicas is None and options.replica_range() is not None:
            min_replicas = options.replica_range()[0]
        self.notice = Notice()  # set by the notice signal or an operator's leave request
        self.M = options.resolve_microbatches(num_replicas)
        self.inner, self.replica_size = inner, replica_size
        if tensor_parallel < 1 or replica_size % tensor_parallel:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} does not divide this replica's {replica_size} processes. "
                "HINT: the processes per replica (replica_size / --nproc-per-replica) must be a multiple of tp."
            )
        self.tensor_parallel = tensor_parallel  # tp processes of the replica per data position
        check_exact_layout(options.exact, replica_size)
        self.membership = Membership(
            addr,
            replica,
            num_replicas,
            heartbeat_interval=options.heartbeat_period(etcd=is_etcd(addr)),
            heartbeat_timeout=options.heartbeat_timeout,
            join_timeout=options.join_timeout,
            collective_timeout=options.collective_timeout,
            startup_timeout=options.startup_timeout,
            store_timeout=options.store_timeout,
            hang_timeout=options.hang_timeout,
            backend=backend,
            secret=secret or JobSecret.from_env(),
            inner=inner,
            replica_size=replica_size,
            standby=standby,
            min_replicas=min_replicas,
            notice=self.notice,
        )
        self.world = None  # the replica's own K-process world (sharding.ReplicaWorld), when K > 1
        self.decisions: Optional[Decisions] = None  # the commit protocol: picked once connected (start)
        # A store collective first confirms a step applied speculatively: what it sees must be settled.
        self.collectives = SurvivorCollectives(self.membership, before_exchange=self._confirm)
        self.protocol = StepProtocol(
            self.membership,
            self.collectives,
            self.M,
            params,
            quota=options.quota,
            inner=inner,
            replica_size=replica_size,
            intra_group=lambda: self.world.group if self.world is not None else None,
            tensor_parallel=tensor_parallel,
            exact=options.exact,
        )
        self.protocol.notice = self.notice
        self.joins_and_leaves = JoinsAndLeaves(
            self.membership, self.collectives, self.protocol, self.notice, self.say, inner=inner
        )
        self._injector = injector  # None: the plan in the environment, for this incarnation
        self._fault_listeners: list[Callable[[Fault, float], None]] = []
        self.step: int = -1
        self.joining = False  # a restarted replica that must rejoin with state from a peer
        self._backward_seen = self._forward_seen = False
        self.history: list[StepStats] = []

    @classmethod
    def from_env(
        cls,
        options: RecoverOptions,
        params: Callable[[], Sequence[torch.nn.Parameter]],
        backend: str = "gloo",
        tensor_parallel: int = 1,
    ) -> Replica:
        found = read_replica_env()  # every variable parsed and range-checked, with a HINT if bad
        return cls(
            options,
            found.addr,
            found.replica,
            found.replicas,
            params,
            backend=backend,
            inner=env.inner_rank(),
            replica_size=env.replica_size(),
            tensor_parallel=tensor_parallel,
            standby=found.standby,
            min_replicas=found.min_replicas,
        )

    # ------------------------------------------------------------------ identity
    @property
    def replica(self) -> int:  # this replica's id, as the strategies' and the membership's replica
        return self.membership.replica

    @property
    def joined(self) -> bool:  # a restarted replica is a member of no generation until it rejoins
        return self.membership.gen is not None

    @property
    def rank(self) -> int:
        """This replica's rank among the live replicas (0 = the lowest live one)."""
        return self.membership.rank

    @property
    def size(self) -> int:
        """The number of live replicas."""
        return self.membership.size

    @property
    def incarnation(self) -> int:
        return self.membership.incarnation

    @property
    def generation(self) -> int:
        return self.membership.gen.number

    @property
    def members(self) -> list[int]:
        return self.membership.members

    @property
    def last_step(self) -> Optional[StepStats]:
        """What happened in the last step this replica ran (None before the first)."""
        return self.protocol.last

    def on_fault(self, listener: Callable[[Fault, float], None]) -> None:
        """Call ``listener(fault, wall_time)`` just before one of this replica's injected faults acts."""
        self._fault_listeners.append(listener)
        if self.protocol.injector is not None:
            self.protocol.injector.add_listener(listener)

    # ------------------------------------------------------------------ lifecycle
    def start(self, exit_hook: bool = True) -> None:
        """Connect, start heartbeating, form generation 0 (or prepare to rejoin).

        ``exit_hook`` registers the end-of-process handler that leaves the group and ends a process
        with an abandoned collective without destroying it (Fabric has no end-of-run hook). An
        embedding that runs replicas inside a longer-lived process (the in-process tests) passes
        False and calls :meth:`close` itself.
        """
        if exit_hook:
            atexit.register(self._at_exit)
            # A notice before the first step has no step to finish: the process leaves at once.
            self.notice.before_training = lambda: self.step < 0
            self.notice.install(self.options.resolve_notice_signal())
        _record_uncaught_exceptions()
        device = "cuda" if self.membership.backend == "nccl" else "cpu"
        standby_world = []

        def build_standby_world() -> None:
            # A sharded standby builds its K-process world (the slow part after imports) before it waits.
            from lightning_recover.protocol.replica_world import ReplicaWorld

            prefix = f"standby{self.membership.standby}"
            standby_world.append(
                ReplicaWorld.build(self.membership, self.replica_size, self.inner, prefix, device, self.tensor_parallel)
            )

        self.membership.connect(before_standby_wait=build_standby_world if self.replica_size > 1 else None)
        self.decisions = self.protocol.decisions = commit_protocol(self.membership)  # the backend is known now
        injector = self._injector or FaultInjector.from_env(
            self.membership.replica, self.membership.incarnation, self.inner
        )
        for listener in self._fault_listeners:
            injector.add_listener(listener)
        self.protocol.injector = injector
        self.membership.before_build = lambda: self.protocol.fire(max(self.step, 0), "regroup")
        self.joining = self.membership.form_initial() is None
        if not self.joining:
            note_member(self.membership.progress, self.membership.gen.number, self.protocol.M)
        if standby_world:
            self.world = standby_world[0]
            self.world.watch()
        elif self.replica_size > 1:
            # A restarted sharded replica builds its own K-process world first (a fresh incarnation's
            # process group), then rejoins: position i receives its shards from position i of a peer.
            from lightning_recover.protocol.replica_world import ReplicaWorld

            self.world = ReplicaWorld.start(
                self.membership, self.replica_size, self.inner, device_type=device, tensor_parallel=self.tensor_parallel
            )

    def _confirm(self) -> None:
        if self.decisions is not None:
            self.decisions.confirm()

    def set_state_hooks(self, get_state: Callable[[], dict], set_state: Callable[[dict], None]) -> None:
        """How to read and overwrite the training state handed to a rejoining replica."""
        self.joins_and_leaves.get_state, self.joins_and_leaves.set_state = get_state, set_state

    # ------------------------------------------------------------------ joins and leaves (joins_and_leaves.py)
    def rejoin(self) -> int:
        """A restarted replica: wait to be admitted, receive the state; return the step to run next."""
        step = self.joins_and_leaves.rejoin()
        self.joining = False
        return step

    @property
    def join_timing(self) -> dict[str, float]:
        """A joiner's: when it asked to join, when its state was in place, how long the transfer took."""
        return self.joins_and_leaves.join_timing

    def set_final_checkpoint(self, write: Callable[[int], None]) -> None:
        """``write(step)`` saves the training state after committed step ``step``; every member calls it
        together (a collective save) when the whole job leaves on notice at that step."""
        self.joins_and_leaves.final_checkpoint = write

    @property
    def told_to_leave(self) -> bool:
        """This replica leaves at the step boundary just committed (it got the notice before that step's reduce)."""
        return self.joins_and_leaves.told_to_leave

    def leave_if_told(self) -> None:
        """At a step boundary: if the last commit named this replica as leaving, leave the job (after the final
        checkpoint when every member leaves) and exit with ``EXIT_LEFT_ON_NOTICE``. Called by the strategies
        right after a step's body and again before the next step."""
        self.joins_and_leaves.leave_if_told(self.step)

    def close(self) -> None:
        try:
            if self.decisions is not None:  # connected
                self.decisions.close(settle=not _uncaught[0])  # a step applied speculatively is confirmed first
        finally:
            if self.world is not None and not _uncaught[0]:
                # A clean exit: the replica-mates' watchdogs must not read it as a death.
                self.world.leave(together=self.joins_and_leaves.left)
            self.membership.close(clean=not _uncaught[0])
        # A planned fault that never fired makes a fault test pass for the wrong reason: say so.
        missed = [f for f in self.protocol.injector.unfired() if f.phase != "recompute"]
        if missed and self.step >= 0:
            print(
                f"[lightning-recover] replica {self.replica}: WARNING: injected fault(s) "
                f"{', '.join(map(str, missed))} never fired (the run ended at step {self.step}). HINT: name a "
                "step and phase the run reaches.",
                file=sys.stderr,
                flush=True,
            )

    def _at_exit(self) -> None:
        self.close()
        self.notice.uninstall()
        if self.membership.abandoned_work:
            # gloo cannot abort an op in flight: destroying a group that has one blocks until the op
            # times out, or aborts the process. The results are written; end without destroying it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1 if _uncaught[0] else leaving_exit_code() if self.joins_and_leaves.left else 0)

    # ------------------------------------------------------------------ steps
    def run_step(self, step: int) -> Iterator[int]:
        self.leave_if_told()
        self.step = step
        self._forward_seen = self._backward_seen = False
        leaving, self.protocol.leaving = self.protocol.leaving, frozenset()
        began = time.perf_counter()
        boundary = bool(self.protocol.decisions.admit_next or leaving)
        if boundary:
            self.joins_and_leaves.admit(step, leaving)
        regrouped = time.perf_counter() - began
        yield from self.protocol.run(step)
        stats = self.protocol.last
        if boundary:  # joiners admitted or leavers gone: the regroup at the step boundary, timed
            stats.events.append({"kind": "boundary-regroup", "seconds": regrouped, "left": sorted(leaving)})
        self.history.append(stats)
        note_step(self.membership.progress, stats, self.protocol.M)  # what the status page shows of this replica
        if stats.recoveries:
            self.say(
                f"step {step}: recovered in {stats.recovery_seconds:.3f}s (replica {self.replica}'s time); "
                f"generation {stats.generation}, {stats.live_replicas} live; replica {self.replica} recomputed "
                f"{stats.recomputed} microbatch{'es' if stats.recomputed != 1 else ''}"
            )

    def seed_microbatch(self, step: int, j: int) -> None:
        """Reseed the RNG so random ops (dropout) do not depend on which replica computes (s, j)."""
        torch.manual_seed(self.options.seed * 1_000_003 + step * self.M + j)

    def fire(self, phase: str) -> None:
        if self.step < 0:
            return
        if phase == "forward":
            if self._forward_seen:
                return
            self._forward_seen = True
        self.protocol.fire(self.step, phase)

    @property
    def zero_slot(self) -> bool:
        """True while the current microbatch is a zero-contribution one (sharded replicas)."""
        return self.protocol.zero_slot

    @property
    def sync_round(self) -> bool:
        """True during the last round of this process's list (sharded replicas reduce-scatter then)."""
        return self.protocol.sync_round

    def before_backward(self, loss: torch.Tensor) -> None:
        if self.step >= 0 and not self.protocol.zero_slot:
            self.protocol.record_loss(loss)
            if not self._backward_seen:
                self._backward_seen = True
                self.protocol.fire(self.step, "backward")

    def say(self, message: str) -> None:
        """One line per event, printed by the lowest live replica only (its process 0)."""
        if self.membership.gen is not None and self.membership.rank == 0 and self.inner == 0:
            print(f"[lightning-recover] {message}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ collectives over live replicas
    def all_reduce(self, tensor: torch.Tensor, reduce_op: Any = "mean") -> torch.Tensor:
        op = str(getattr(reduce_op, "name", reduce_op)).lower()
        values = self.collectives.exchange(tensor.detach().cpu())
        stacked = torch.stack([values[r] for r in sorted(values)])
        if op in ("sum",):
            out = stacked.sum(0)
        elif op in ("mean", "avg"):
            out = stacked.float().mean(0) if not stacked.is_floating_point() else stacked.mean(0)
        elif op == "max":
            out = stacked.max(0).values
        elif op == "min":
            out = stacked.min(0).values
        else:
            raise ValueError(f"reduce_op {reduce_op!r} is not supported by strategy='recover' (sum, mean, max, min)")
        return out.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        values = self.collectives.exchange(tensor.detach().cpu())
        return torch.stack([values[r] for r in sorted(values)]).to(tensor.device)

    def barrier(self) -> None:
        self.collectives.exchange(None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.collectives.broadcast_object(obj, src)

    def exchange(self, obj: Any) -> dict[int, Any]:
        """Every live replica contributes ``obj``; all receive the same ``{replica: obj}``."""
        return self.collectives.exchange(obj)

    def elect_writer(self) -> bool:
        """All live replicas agree on one writer: the lowest replica id among them."""
        return min(self.collectives.exchange(None)) == self.membership.replica
