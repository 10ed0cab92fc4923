"""Exact mode: a step's gradient as a fixed-point sum that no partition or order can change.

Floating-point addition is not associative: in the default mode the reduced gradient depends on
which replica summed which microbatches and on the all-reduce's order, so a recovery, a standby or a
different replica count changes the last bits, and AdamW amplifies them. Exact mode
(``RecoverStrategy(exact=True)``) makes every step's gradient a function of the parameters and the
step's ``M`` microbatch ids alone:

1. Each microbatch's gradient (``param.grad`` right after its backward) is rounded on its own to a
   fixed-point grid, ``q = round(g * 2**k)`` per parameter tensor, and added to a float64
   accumulator. ``q`` is an integer, the accumulator holds integers, and every partial sum stays
   below ``2**53`` in magnitude, so each addition is exact: the sum is the same in any order and
   over any partition (float64 rather than int64 so that the in-place add needs no temporary, and
   gloo and NCCL reduce it natively).
2. The all-reduce sums these integer-valued float64 buffers: exact for the same reason.
3. After the commit, ``grad = sum * 2**-k / M`` (float64, then rounded to the parameter's dtype).

The exponent ``k`` of a tensor is a function of the committed history that every member holds
identically: the previous step's ``A`` (the largest ``|g|`` of any single microbatch of the tensor,
all-reduced with MAX, which is exact) centred in the window ``[LIMIT - 2H, LIMIT]`` bits, where
``LIMIT = 52 - ceil(log2 M)`` keeps a sum of ``M`` terms below ``2**52`` and ``H`` is the headroom.
A step whose own ``A`` leaves that window (a gradient 2**H times larger: the sum could overflow the
exact range; or 2**H times smaller: the grid would be too coarse; or the first step, which has no
history) is *redone*: every member saw the same reduced ``A``, so every member recentres ``k`` the
same way and recomputes all ``M`` microbatches, then reduces again. A redone step's grid is a
function of that step alone.

Accuracy: a term is rounded to within ``2**(e - LIMIT + H + 1)`` of the tensor's largest
microbatch gradient (``2**e``), i.e. about ``2**-40`` of it for M <= 16; the result is then rounded
to float32/bf16 once. benchmarks/figures/exact33.md measures it against a float64 reference.

Memory: one float64 accumulator per process (8 bytes per parameter element, kept between steps)
plus one reduce bucket; the float32 path's full-size flat copy is not needed, since the reduce
stages the accumulator bucket by bucket and the accumulator survives a failed attempt intact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from lightning_recover.errors import RecoverError

#: Integers up to 2**53 are exact in float64; a step's sum is kept within 2**52.
EXACT_BITS = 52
#: Bits of headroom either way: a tensor's gradient may grow or shrink 2**H-fold between two steps
#: before the step is redone with a recentred grid.
HEADROOM_BITS = 8
#: Elements per reduce bucket (float64): the bucket is the only copy of the accumulator the reduce makes.
BUCKET_ELEMENTS = 1 << 20
#: The key under which a checkpoint of an exact-mode job carries its fixed-point grid (a list of small
#: ints). With it a job resumed from the checkpoint, on any replica count, continues bitwise on the
#: failure-free trajectory; without it the first resumed step recalibrates and the last bits differ.
CHECKPOINT_KEY = "lightning_recover_exact_grid"
_NO_EXPONENT = 1e4  # "no grid yet" in the exponent agreement check (any k is far smaller)
# A scalar factor 2**n must stay a normal number of the tensor's dtype (float32/bf16: n in [-126, 127]).
_MAX_POW2_STEP = 100


def mul_pow2_(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t *= 2**n`` in place, in steps whose factor the dtype represents (exact unless under/overflowing)."""
    while n:
        part = max(-_MAX_POW2_STEP, min(_MAX_POW2_STEP, n))
        t.mul_(2.0**part)
        n -= part
    return t


def ceil_log2(n: int) -> int:
    return max(0, (n - 1).bit_length())


def checkpoint_entries(exact: Optional[ExactAccumulator]) -> dict[str, Any]:
    """What a checkpoint of the job carries besides the user's state: in exact mode the grid."""
    return {} if exact is None else {CHECKPOINT_KEY: exact.state()}


def restore_checkpoint_entries(exact: Optional[ExactAccumulator], checkpoint: Any) -> None:
    """Take :func:`checkpoint_entries` out of a loaded checkpoint (the user's remainder never sees them)."""
    saved = checkpoint.pop(CHECKPOINT_KEY, None) if isinstance(checkpoint, dict) else None
    if saved is not None and exact is not None:
        exact.load_state(saved)


def check_exact_layout(exact: bool, replica_size: int) -> None:
    """Exact mode needs unsharded replicas: refuse K > 1 with the reason and what to do."""
    if exact and replica_size > 1:
        raise ValueError(
            f"exact=True with replica_size={replica_size}: inside a sharded replica FSDP2 reduce-scatters the K "
            "processes' float gradients, a sum whose rounding depends on which microbatches met in a round, so "
            "the step would no longer be independent of the replica count. Making it exact would mean replacing "
            "FSDP2's reduce-scatter with a fixed-point one. HINT: use exact=True with replica_size=1 (one process "
            "per replica), or drop exact=True for sharded replicas."
        )


class ExactAccumulator:
    """One replica's fixed-point gradient accumulator and the grid every member derives alike."""

    def __init__(self, microbatches: int, headroom_bits: int = HEADROOM_BITS) -> None:
        self.M = microbatches
        self.H = headroom_bits
        # One term's |q| <= 2**limit, so the sum of M terms stays <= 2**EXACT_BITS.
        self.limit = EXACT_BITS - ceil_log2(microbatches)
        if self.limit - 2 * self.H < 24:
            raise ValueError(
                f"exact=True with microbatches={microbatches}: too many microbatches for a fixed-point grid finer "
                "than float32's precision. HINT: use microbatches <= 65536."
            )
        self.exponents: Optional[list[Optional[int]]] = None  # per tensor: q = round(g * 2**k); None: no grid yet
        self._shapes: Optional[list[tuple[torch.Size, torch.dtype]]] = None
        self.acc: Optional[torch.Tensor] = None  # flat float64, integer-valued
        self._views: list[torch.Tensor] = []
        self.amax: Optional[torch.Tensor] = None  # per tensor, max |g| over this replica's microbatches
        self.losses: Optional[torch.Tensor] = None  # [M] loss of microbatch j, then [M] how many recorded
        self.redo = False  # the committed attempt must be redone with the recentred grid
        self.redos = 0  # redone attempts in this process's life (for tests and logs)
        self.results: list[torch.Tensor] = []
        self.flags: list[float] = []  # the last reduce's MAX of the members' flags (see reduce)

    # ------------------------------------------------------------------ history handed to a joiner
    def state(self) -> dict[str, Any]:
        return {"exponents": list(self.exponents) if self.exponents is not None else None}

    def load_state(self, state: dict[str, Any]) -> None:
        exponents = state.get("exponents")
        if exponents is not None and not all(k is None or isinstance(k, int) for k in exponents):
            raise RecoverError("the exact-mode grid handed to this replica is malformed")
        self.exponents = list(exponents) if exponents is not None else None

    # ------------------------------------------------------------------ a step's attempt
    def begin(self, params: Sequence[torch.Tensor]) -> None:
        """Zero the accumulator for a new attempt (a step, or a redo of it) over ``params``."""
        shapes = [(p.shape, p.dtype) for p in params]
        for p in params:
            if hasattr(p, "to_local"):
                check_exact_layout(True, 2)  # a DTensor parameter: a sharded replica
        if shapes != self._shapes:
            device = params[0].device if params else torch.device("cpu")
            total = sum(p.numel() for p in params)
            self.acc = torch.zeros(total, dtype=torch.float64, device=device)
            self._views = list(self.acc.split([p.numel() for p in params])) if params else []
            self.amax = torch.zeros(len(params), dtype=torch.float32, device=device)
            self.losses = torch.zeros(2 * self.M, dtype=torch.float64)
            if self._shapes is not None or self.exponents is None or len(self.exponents) != len(params):
                self.exponents = [None] * len(params)
            self._shapes = shapes
        else:
            self.acc.zero_()
            self.amax.zero_()
            self.losses.zero_()
        self.redo = False

    def record_loss(self, j: int, loss: torch.Tensor) -> None:
        """Microbatch ``j``'s loss, in its own slot: the slots' all-reduce adds zeros only, so it is exact."""
        self.losses[j] += float(loss.detach().double().reshape(-1)[:1].sum())
        self.losses[self.M + j] += 1

    def absorb(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Move the microbatch's gradient (``param.grad``) into the accumulator as fixed point."""
        taken: list[tuple[int, torch.Tensor]] = []
        for i, p in enumerate(params):
            if p.grad is not None:
                g, p.grad = p.grad.detach(), None  # the next microbatch's backward starts from nothing
                if g.numel():
                    taken.append((i, g))
        if not taken:
            return
        # The largest |g| of each tensor (one stacked update: per-tensor in-place updates cost 5x more).
        # max is exact and propagates NaN.
        peaks = torch.stack([g.abs().amax().float() for _, g in taken])
        if len(taken) == len(params):
            torch.maximum(self.amax, peaks, out=self.amax)
        else:
            index = torch.tensor([i for i, _ in taken], device=self.amax.device)
            self.amax[index] = torch.maximum(self.amax[index], peaks)
        for i, g in taken:
            k = self.exponents[i]
            if k is not None:  # None: no grid yet, this attempt only measures A and is redone
                # g * 2**k is exact; round() to an integer is exact; float64 += integer below 2**53 is exact.
                self._views[i].add_(mul_pow2_(g, k).round_().reshape(-1))

    # ------------------------------------------------------------------ the reduce
    def reduce(self, collectives: Any, params: Sequence[torch.nn.Parameter], flags: Sequence[float] = ()) -> None:
        """All-reduce this attempt: the grid check (MAX), the loss slots and the fixed-point sums (SUM).

        Leaves ``sum * 2**-k / M`` in ``self.results`` (applied only after a commit); the accumulator
        itself is never written, so a failed attempt can be retried in the next generation.
        ``collectives=None``: a single process with nothing to reduce (:func:`exact_step_alone`).
        ``flags``: small values reduced with MAX beside the grid check, left in ``self.flags`` (the members'
        leave flags, ``StepProtocol``).
        """
        n = len(self.exponents)
        ks = torch.tensor([_NO_EXPONENT if k is None else float(k) for k in self.exponents], dtype=torch.float32)
        threads = float(torch.get_num_threads())
        # MAX of (A, k, -k, threads, -threads): A exactly, and whether every member used the same grid and
        # CPU thread count (max(x) == -max(-x) iff all equal).
        extra = torch.tensor([threads, -threads, *flags], dtype=torch.float32)
        peak = torch.cat([self.amax.cpu(), ks, -ks, extra]).to(self.acc.device)
        works = collectives.start_max(peak) if collectives is not None else []
        self.results = [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in params]  # contiguous
        losses = self.losses.clone().to(self.acc.device)  # a copy: a failed attempt leaves partial sums in it
        if collectives is None:
            self._unstage(0, self.acc.clone())
        elif all(k is None for k in self.exponents):  # a calibration attempt: nothing to sum yet
            collectives.allreduce([losses])
        else:
            first = True
            for start in range(0, self.acc.numel(), BUCKET_ELEMENTS):
                bucket = self.acc[start : start + BUCKET_ELEMENTS].clone()
                collectives.allreduce([losses, bucket] if first else [bucket])
                first = False
                self._unstage(start, bucket)
            if first:
                collectives.allreduce([losses])
        if works:
            collectives.wait(works)
        peak = peak.cpu()
        self._peak = peak[:n]
        ks_max, ks_negmax = peak[n : 2 * n], peak[2 * n : 3 * n]
        if not torch.equal(ks_max, -ks_negmax):
            raise RecoverError(
                "members reduced the step on different fixed-point grids (exact mode); the exact-mode history "
                "diverged, and no further step can be trusted"
            )
        if float(peak[3 * n]) != -float(peak[3 * n + 1]):
            raise RecoverError(
                f"exact=True needs the same CPU thread count on every replica (this one: {int(threads)}, the most: "
                f"{int(peak[3 * n])}): a CPU kernel's rounding can depend on it. HINT: start every replica with the "
                "same OMP_NUM_THREADS (the launcher's default is 1), or call torch.set_num_threads(n) in the script."
            )
        self._losses = losses.cpu()
        self.flags = peak[3 * n + 2 :].tolist()

    def finish(self, params: Sequence[torch.nn.Parameter]) -> Optional[float]:
        """After a commit: recentre the grid; return the step's mean loss, or mark the attempt for a redo."""
        exponents = list(self.exponents)
        redo = False
        for i, A in enumerate(self._peak.tolist()):
            if not math.isfinite(A) or A == 0.0:
                continue  # NaN/inf gradients stay so (below); an all-zero tensor keeps its grid
            e = math.frexp(A)[1]  # A < 2**e
            k = exponents[i]
            if k is None or not (self.limit - 2 * self.H <= e + k <= self.limit):
                redo = True
            exponents[i] = self.limit - self.H - e  # centred: room for 2**H growth and 2**H shrinkage
        self.exponents = exponents
        if redo:
            self.redo = True
            self.redos += 1
            self.results = []
            return None
        for i, (p, out) in enumerate(zip(params, self.results)):
            A = float(self._peak[i])
            if not math.isfinite(A):
                out.fill_(float("nan"))
            elif A == 0.0:
                out.zero_()
        self.results = []
        slots = self._losses.tolist()
        if round(sum(slots[self.M :])) != self.M:
            return None
        return math.fsum(slots[: self.M]) / self.M

    def _unstage(self, start: int, bucket: torch.Tensor) -> None:
        """Write ``sums * 2**-k / M`` of a reduced bucket into the tensors it covers (float64 arithmetic,
        one rounding to the parameter's dtype). Buckets cross tensor boundaries."""
        end = start + bucket.numel()
        offset = 0
        for i, out in enumerate(self.results):
            lo, hi = max(start, offset), min(end, offset + out.numel())
            if lo < hi:
                k = self.exponents[i]
                piece = bucket[lo - start : hi - start]
                target = out.reshape(-1)[lo - offset : hi - offset]
                if k is None:
                    target.zero_()
                else:
                    target.copy_(mul_pow2_(piece, -k).div_(self.M))
            offset += out.numel()


def exact_step_alone(
    accumulator: ExactAccumulator, params: Sequence[torch.nn.Parameter], backward: Callable[[int], torch.Tensor]
) -> Optional[float]:
    """One exact-mode step in a single process: ``backward(j)`` back-propagates microbatch ``j`` and
    returns its loss. Leaves the step's gradient in ``param.grad``, bitwise what any number of
    replicas commit through any failures (the failure-free reference of the tests); returns the mean loss."""
    while True:
        accumulator.begin(params)
        for j in range(accumulator.M):
            accumulator.record_loss(j, backward(j))
            accumulator.absorb(params)
        accumulator.reduce(None, params)
        results = accumulator.results
        loss = accumulator.finish(params)
        if not accumulator.redo:
            for p, grad in zip(params, results):
                p.grad = grad
            return loss
