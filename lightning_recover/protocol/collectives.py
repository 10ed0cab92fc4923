"""Collectives among the replicas alive now: the gradient reduce over a generation's process
group, and small-object exchanges (metrics, barrier, broadcast, writer election) over the store.

Every wait is sliced: between slices the waiter looks for a failure of the generation (a member
declared dead, a newer generation proposed), so a dead or hung peer is noticed within
``polling.wait_slice`` (``SLICE``, longer on the embedded coordinator for a large job) rather than
after a collective timeout. Any failure raises :class:`MembershipChanged`; the caller forms the next
generation.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_recover.errors import ForgedMessageError, MembershipChanged, RecoverError
from lightning_recover.protocol.membership import Membership
from lightning_recover.protocol.messages import decode_object
from lightning_recover.protocol.polling import POLL_MIN, backoff, wait_slice

_TAKEBACKS = 16  # times a member writes its own contribution again before calling it an attack


class SurvivorCollectives:
    """Collectives over the current generation of a :class:`Membership`."""

    def __init__(self, membership: Membership, before_exchange: Callable[[], None] = lambda: None) -> None:
        self.membership = membership
        self._before_exchange = before_exchange  # the replica's Decisions.confirm (a speculative step, settled)
        self._seq: dict[int, int] = {}  # generation -> store collectives issued in it (SPMD order)

    # ------------------------------------------------------------------ tensors, over the process group
    def allreduce(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum ``tensors`` in place across the generation; raise MembershipChanged on any failure."""
        pg = self._pg()
        self.wait(self._start(pg, "all-reduce", lambda t: pg.allreduce([t]), tensors))

    def broadcast(self, tensors: Sequence[torch.Tensor], src_rank: int) -> None:
        """Broadcast ``tensors`` in place from the member of rank ``src_rank``."""
        pg = self._pg()
        opts = dist.BroadcastOptions()
        opts.rootRank = src_rank
        self.wait(self._start(pg, "broadcast", lambda t: pg.broadcast([t], opts), tensors))

    def start_max(self, tensor: torch.Tensor) -> list:
        """Start a MAX all-reduce of ``tensor`` in place across the generation (the exact mode's grid check);
        the caller waits for the works it returns (:meth:`wait`)."""
        pg = self._pg()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        return self._start(pg, "all-reduce (max)", lambda t: pg.allreduce([t], opts), [tensor])

    def _start(self, pg: Any, what: str, start_one: Callable[[torch.Tensor], Any], tensors: Sequence) -> list:
        """Start one operation per tensor; the group learns of each, so that it outlives them if abandoned."""
        works: list = []
        try:
            for t in tensors:
                works.append(start_one(t))
        except Exception as exc:
            raise MembershipChanged(f"{what} could not start: {exc}") from exc
        finally:
            self.membership.operations_started(pg, works)
        return works

    def _pg(self) -> Any:
        pg = self.membership.gen.pg
        if pg is None:
            raise MembershipChanged("no process group for this generation")
        return pg

    def wait(self, works: Sequence[Any]) -> None:
        """Wait for ``works`` in slices; between slices, look for failures of the generation.

        Completion wakes the waiter at once (a future callback sets an event), so the failure-free
        path pays no polling latency; the slice only bounds how late a failure is noticed.
        """
        done = threading.Event()
        remaining = [len(works)]
        lock = threading.Lock()

        def one_done(_fut: Any) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

        for work in works:
            work.get_future().add_done_callback(one_done)
        timeout = self.membership.collective_timeout
        deadline = time.monotonic() + timeout
        # Looking oftener than failure_seen reads the store would only wake this thread for nothing.
        looks = wait_slice(self.membership.size, bool(self.membership.store.raw.views))
        try:
            while not done.wait(looks):
                if self.membership.failure_seen():
                    raise MembershipChanged("a member of the generation failed during a collective")
                if time.monotonic() > deadline:
                    raise MembershipChanged(f"collective did not complete within {timeout}s")
        except BaseException:
            # The operation is still in flight: its group can never be destroyed cleanly (gloo blocks
            # until the op times out, then aborts the process), so it is abandoned now and the
            # process ends without destroying it.
            self.membership.abandon_current()
            raise
        for work in works:
            try:
                work.wait()
            except Exception as exc:
                raise MembershipChanged(f"collective failed: {exc}") from exc

    # ------------------------------------------------------------------ small objects, over the store
    def _contribution_key(self, prefix: str, replica: int, inner: int) -> str:
        # One key per process: with K processes per replica, every one of them contributes, so a decided
        # collective says that each process of each member counted is done with the one before it.
        return f"{prefix}/{replica}" if self.membership.replica_size == 1 else f"{prefix}/{replica}.{inner}"

    def _contribution_keys(self, prefix: str, members: Sequence[int]) -> list[str]:
        return [self._contribution_key(prefix, r, i) for r in members for i in range(self.membership.replica_size)]

    def _agree(self, prefix: str, mine: Any) -> dict[int, Any]:
        """Wait until every process of every live member wrote its contribution under ``prefix``; agree on
        who counts and what each member sent (with K processes per replica: its process 0's value).

        The first member to see every live contribution writes the decision ``{prefix}/set``
        (one sealed record holding the contributions it read as genuine), so every member returns
        the same values even if a contribution is overwritten or deleted after it was counted:
        reading the contributions again after the decision would race with such a write.

        This member's own contribution found deleted or forged is written again (the first
        ``_TAKEBACKS`` times). The wait ends within ``hang_timeout + store_timeout``: a peer that does
        not contribute is declared hung by the coordinator's monitor within ``hang_timeout`` (this
        phase counts as waiting on it), so a contribution still missing after that was deleted or
        forged, or the peers call different collectives: a named error, never a silent spin.
        """
        m = self.membership
        store = m.store
        delay = POLL_MIN
        members = m.gen.members
        bound = m.hang_timeout + m.store_timeout
        deadline = time.monotonic() + bound
        takebacks = 0
        k = m.replica_size
        own = self._contribution_key(prefix, m.replica, m.inner)
        while True:
            agreed = store.get_genuine(f"{prefix}/set")
            if agreed is None:
                m.check_health()
                read = store.genuine_many(self._contribution_keys(prefix, members))
                # a member counts once all its K processes contributed; its value is its process 0's
                sent = {
                    r: read[n * k] for n, r in enumerate(members) if all(v is not None for v in read[n * k : n * k + k])
                }
                own_missing = read[members.index(m.replica) * k + m.inner] is None
                missing = set(members) - set(sent)
                if not missing or not (missing - m.dead(sorted(missing), m.gen.incarnations)):
                    agreed = store.compare_set(f"{prefix}/set", None, json.dumps({str(r): v for r, v in sent.items()}))
            if agreed is not None:
                return {int(r): decode_object(value.encode()) for r, value in json.loads(agreed).items()}
            if own_missing:
                takebacks += 1
                if takebacks > _TAKEBACKS:
                    raise ForgedMessageError(
                        f"replica {m.replica}: its contribution {own} keeps being deleted or "
                        "overwritten by a client without the job's secret"
                    )
                print(
                    f"[lightning-recover] replica {m.replica}: wrote again its contribution {own} "
                    "(deleted or overwritten)",
                    file=sys.stderr,
                    flush=True,
                )
                store.put_object(own, mine)
                continue
            if time.monotonic() > deadline:
                forged = sorted(
                    r for r in missing if any(store.has(key) for key in self._contribution_keys(prefix, [r]))
                )
                if forged:
                    raise ForgedMessageError(
                        f"replica {m.replica}: the contributions of replicas {forged} to {prefix} failed "
                        f"authentication for {bound:.0f}s (forged by a client without the job's secret)"
                    )
                raise RecoverError(
                    f"replica {m.replica}: replicas {sorted(missing)} did not contribute to store collective "
                    f"{prefix} within hang_timeout + store_timeout ({bound:.0f}s) and were not declared dead "
                    "(deleted by a client without the job's secret, or the replicas call different collectives). "
                    "HINT: every replica must call the same barriers, broadcasts and metric reductions in the "
                    "same order."
                )
            delay = backoff(delay)

    def exchange(self, obj: Any) -> dict[int, Any]:
        """Every live member contributes ``obj``; all receive the same ``{replica: obj}``.

        Store collectives are numbered per generation, so a replica that joined a generation
        issues its first one in step with the members.
        """
        self._before_exchange()
        m = self.membership
        m.progress.note("exchange")
        number = m.gen.number
        self._seq[number] = seq = self._seq.get(number, 0) + 1
        for old in [g for g in self._seq if g < number]:
            del self._seq[old]
        prefix = f"x/{number}/{seq}"
        m.store.put_object(self._contribution_key(prefix, m.replica, m.inner), obj)
        values = self._agree(prefix, obj)
        if seq > 1 and m.replica == min(values) and m.inner == 0:
            # Every process of every member counted here contributed to this collective, so it is done
            # reading the previous one (SPMD order); members not counted were declared dead. Its keys can
            # go: one process deletes them, so the store does not grow with every metric, barrier and
            # broadcast.
            previous = f"x/{number}/{seq - 1}"
            m.store.delete_many(self._contribution_keys(previous, m.gen.members) + [f"{previous}/set"])
        m.progress.note("idle")
        return values

    def broadcast_object(self, obj: Any, src_rank: int = 0) -> Any:
        """Broadcast from the member of rank ``src_rank`` among those alive now."""
        values = self.exchange(obj if self.membership.gen.rank == src_rank else None)
        who = sorted(values)
        members = self.membership.gen.members
        src = members[src_rank] if members[src_rank] in values else who[0]
        return values[src]
