"""Sharded replicas on the Lightning side: options, validation, the parallelize step and the
per-microbatch backward preparation, shared by the Fabric and the Trainer strategies.

``RecoverStrategy(microbatches=M, replica_size=K, parallelize_fn=fn)`` (or ``shard="fsdp"``)
with ``L.Fabric(devices=R*K)``, or ``RecoverTrainerStrategy(...)`` with ``L.Trainer(devices=R*K)``:
R replicas of K processes. ``fn(module, mesh)`` follows Lightning's ``ModelParallelStrategy``
convention; ``mesh`` is the replica's 1-D mesh with dimension ``"shard"`` (the replicate dimension
is lightning-recover's own, fault-tolerant one).

``tensor_parallel=tp`` (tp divides K) makes the mesh 2-D, ``("shard", "tp")`` of shape
``(K // tp, tp)`` -- ModelParallelStrategy's ``("data_parallel", "tensor_parallel")`` under the
names of this package -- and ``fn`` typically calls ``parallelize_module(model, mesh["tp"], plan)``,
then, when ``K // tp > 1``, ``fully_shard(model, mesh=mesh["shard"])``. The replica's *data width*
is ``W = K // tp``: it takes its microbatches in rounds of W, and the tp processes of one data
position compute the same microbatch. (Tested with the Fabric strategy only.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module

from lightning_recover.protocol.replica_world import is_sharded

SHARD_MODES = ("fsdp",)


@dataclass
class ShardingConfig:
    """How each replica shards its model over its K processes."""

    replica_size: int = 1
    parallelize_fn: Optional[Callable[[Module, Any], Module]] = None
    shard: Optional[str] = None
    tensor_parallel: int = 1

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ShardingConfig:
        """Take ``replica_size``, ``parallelize_fn``, ``shard`` and ``tensor_parallel`` out of a strategy's
        keyword arguments."""
        return cls(
            options.pop("replica_size", 1),
            options.pop("parallelize_fn", None),
            options.pop("shard", None),
            tensor_parallel=options.pop("tensor_parallel", 1),
        )

    def __post_init__(self) -> None:
        if not isinstance(self.replica_size, int) or self.replica_size < 1:
            raise ValueError(f"replica_size must be a positive integer, got {self.replica_size!r}")
        tp = self.tensor_parallel
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {tp!r}")
        if self.replica_size % tp:
            raise ValueError(
                f"tensor_parallel={tp} does not divide replica_size={self.replica_size}: the replica's mesh is "
                f"(replica_size // tp, tp). HINT: use a replica_size that is a multiple of {tp}, e.g. "
                f"replica_size={tp * max(1, self.replica_size // tp)}."
            )
        if tp > 1 and self.parallelize_fn is None:
            raise ValueError(
                f"tensor_parallel={tp} needs parallelize_fn: only you know which layers split over 'tp'. "
                "HINT: parallelize_fn=fn with fn(model, mesh) calling "
                "`parallelize_module(model, mesh['tp'], plan)` (then `fully_shard(model, mesh=mesh['shard'])` "
                "when replica_size > tensor_parallel)."
            )
        if self.shard is not None and self.shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {', '.join(SHARD_MODES)} or None, got {self.shard!r}")
        if self.shard is not None and self.parallelize_fn is not None:
            raise ValueError("give either shard='fsdp' or parallelize_fn, not both")
        if self.replica_size > 1 and self.shard is None and self.parallelize_fn is None:
            raise ValueError(
                f"replica_size={self.replica_size} needs a way to shard the model. HINT: pass shard='fsdp' "
                "(fully_shard every block) or parallelize_fn=fn with fn(model, mesh) -> model."
            )
        if self.replica_size == 1 and (self.shard is not None or self.parallelize_fn is not None):
            raise ValueError(
                "shard/parallelize_fn need replica_size > 1 (processes per replica). "
                "HINT: pass replica_size=K and devices=R*K."
            )

    @property
    def enabled(self) -> bool:
        return self.replica_size > 1

    @property
    def data_width(self) -> int:
        """``W = K // tp``: how many microbatches the replica computes at once (one per data position)."""
        return self.replica_size // self.tensor_parallel

    def validate(self, devices: int, microbatches: Optional[int]) -> int:
        """Check the job shape before any process starts; return the number of replicas."""
        K = self.replica_size
        if devices % K:
            raise ValueError(
                f"devices={devices} is not divisible by replica_size={K}. HINT: devices must be "
                f"replicas x replica_size, e.g. devices={max(1, devices // K) * K} for {max(1, devices // K)} replicas."
            )
        replicas = devices // K
        M = microbatches if microbatches is not None else replicas
        W = self.data_width
        if M < W:
            what = (
                f"replica_size={K}: the processes of one replica take one microbatch each per round"
                if W == K
                else f"the data width replica_size // tensor_parallel = {W}: the replica's {W} data positions "
                "take one microbatch each per round"
            )
            raise ValueError(
                f"microbatches={M} is smaller than {what}. HINT: use microbatches >= {max(W, replicas)}, ideally a "
                f"multiple of {W * replicas}."
            )
        return replicas

    def parallelize(self, module: Module, mesh: Any, shard_root: bool = True) -> Module:
        """Shard ``module`` over the replica's mesh, then check the placements (``_check_placements``).

        ``shard_root=False`` (the Trainer: Lightning calls ``training_step``, not the LightningModule's
        forward, so a root FSDP module's hooks would not run reliably) makes ``shard="fsdp"`` shard the
        module's top-level children instead of the module itself.
        """
        if self.shard == "fsdp":
            module = fsdp_every_block(module, mesh, shard_root=shard_root)
        elif self.parallelize_fn is None:  # __post_init__ refuses replica_size > 1 with neither
            raise RuntimeError("strategy='recover': parallelize called without shard='fsdp' or parallelize_fn")
        else:
            out = self.parallelize_fn(module, mesh)
            module = out if isinstance(out, Module) else module
        self._check_placements(module)
        # FSDP2 averages reduce-scattered gradients over the shard dimension (K processes, or K // tp
        # with a tp dimension); the replica must contribute the *sum* over its microbatches (the
        # protocol divides by M once, at commit), so the strategy scales each loss by the data width
        # (loss_scale). Not set_gradient_divide_factor(1): for float32 it asks for
        # ReduceOp.PREMUL_SUM, which gloo refuses (measured, torch 2.13).
        return module

    def _check_placements(self, module: Module) -> None:
        """Refuse a parallelized model whose gradients would not cover all of the replica's microbatches.

        The processes of one data position compute the same microbatches, different positions
        different ones, and only FSDP (over the "shard" dimension) sums gradients across positions.
        So with a data width W > 1, every parameter must be sharded over "shard"; a plain or
        TP-only parameter would hold only its own position's gradient. With W == 1 (pure tensor
        parallelism, tp == K) all K processes compute the same microbatch, so a parameter left
        plain is *replicated*: every process of the replica computes the same gradient for it (its
        input is the replicated output of the TP layers), and the cross-replica reduce, one group
        per inner position, keeps each copy in step. That is stock TP practice (norms, heads), and
        allowed; only a model with no parameter split at all is refused (K copies of one replica).
        """
        params = list(module.named_parameters())
        if self.tensor_parallel == 1:
            unsharded = [name for name, p in params if not is_sharded(p)]
            if unsharded:
                raise ValueError(
                    f"parallelize_fn left {len(unsharded)} parameters unsharded (e.g. {', '.join(unsharded[:3])}); "
                    "every parameter must be sharded over the replica's mesh. HINT: end with "
                    "`fully_shard(model, mesh=mesh['shard'])`, or use shard='fsdp'."
                )
        elif self.data_width > 1:
            missing = [name for name, p in params if "shard" not in (_dim_names(p) or ())]
            if missing:
                raise ValueError(
                    f"parallelize_fn left {len(missing)} parameters not sharded over the 'shard' dimension (e.g. "
                    f"{', '.join(missing[:3])}); with a data width replica_size // tensor_parallel = "
                    f"{self.data_width} > 1 their gradients would miss the other data positions' microbatches. "
                    "HINT: after parallelize_module(model, mesh['tp'], plan) end with "
                    "`fully_shard(model, mesh=mesh['shard'])`."
                )
        elif not any(is_sharded(p) for _, p in params):
            raise ValueError(
                f"parallelize_fn split no parameter over the 'tp' dimension: the {self.replica_size} processes of "
                "a replica would all compute the same thing. HINT: call "
                "`parallelize_module(model, mesh['tp'], {'fc1': ColwiseParallel(), 'fc2': RowwiseParallel()})`."
            )

    @property
    def loss_scale(self) -> float:
        return float(self.data_width)

    def prepare_backward(self, protocol_replica: Any, loss: Tensor, modules: Iterable[Module]) -> Tensor:
        """The loss to back-propagate for the current microbatch (after ``protocol_replica.before_backward``).

        A zero-contribution slot (sharded replica, short last round) runs backward with the loss
        times 0: it joins FSDP's collectives and adds nothing. Otherwise the loss is scaled by the data
        width K // tp, since FSDP2 averages the reduce-scattered gradients over the "shard" dimension. Reduce-scatter
        happens once per list of microbatches (its last round), like stock ``no_sync``; every
        process of the replica has the same number of rounds.
        """
        if protocol_replica.zero_slot:
            loss = loss * 0
        elif self.enabled:
            loss = loss * self.loss_scale
        if self.enabled:
            sync = protocol_replica.sync_round
            for module in modules:
                for m in module.modules():
                    set_sync = getattr(m, "set_requires_gradient_sync", None)  # FSDP2 modules have it
                    if set_sync is not None:
                        set_sync(sync, recurse=False)
        return loss


def _dim_names(param: Any) -> Optional[tuple]:
    mesh = getattr(param, "device_mesh", None)
    return getattr(mesh, "mesh_dim_names", None) if mesh is not None else None


def fsdp_every_block(module: Module, mesh: Any, shard_root: bool = True) -> Module:
    """``shard="fsdp"``: fully_shard each block of the model, then the model itself.

    The blocks are the entries of the first ModuleList found (transformer layers), else the
    top-level children that hold parameters. With ``shard_root=False`` the model itself is not
    sharded; each top-level child still holding unsharded parameters is, instead.
    """
    from torch.distributed.fsdp import fully_shard

    shard_mesh = mesh["shard"]
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    blocks = list(lists[0]) if lists else list(module.children())
    for block in blocks:
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=shard_mesh)
    if shard_root:
        fully_shard(module, mesh=shard_mesh)
        return module
    for child in module.children():
        if any(not is_sharded(p) for p in child.parameters()):
            fully_shard(child, mesh=shard_mesh)
    return module


# ---------------------------------------------------------------------------- rejoin of a sharded replica
# A restarted replica's process at inner position i receives the state of position i of a live
# replica: the *local* shards of parameters and optimizer state (plain tensors, so the weights-only
# loader accepts them), rebuilt into DTensors on the joiner from its own parameters' placements.


def local_shards(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its local shard (containers walked)."""
    if is_sharded(obj):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: local_shards(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_shards(v) for v in obj)
    return obj


def load_local_module_state(module: Module, received: dict) -> None:
    """Copy a peer's local shards into this module's (identically sharded) parameters and buffers."""
    own = module.state_dict()
    missing = sorted(set(own) - set(received))
    if missing:
        raise ValueError(f"the state received from the peer lacks {len(missing)} entries, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, tensor in own.items():
            local = tensor.to_local() if is_sharded(tensor) else tensor
            value = received[name]
            if tuple(value.shape) != tuple(local.shape):
                raise ValueError(
                    f"{name}: the peer's shard has shape {tuple(value.shape)}, this process's {tuple(local.shape)}. "
                    "HINT: a restarted replica must use the same replica_size and parallelize_fn as the others."
                )
            local.copy_(value)


def optimizer_state_from_local(optimizer: torch.optim.Optimizer, received: dict) -> dict:
    """A peer's optimizer state dict (local shards) with the per-parameter tensors made DTensors
    again, placed like this optimizer's own parameters, ready for ``optimizer.load_state_dict``."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in received["state"].items():
        p = params[int(index)]
        out = {}
        for key, value in entry.items():
            if is_sharded(p) and torch.is_tensor(value) and value.dim() > 0:
                if tuple(value.shape) != tuple(p.to_local().shape):
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {index}: the peer's shard has shape "
                        f"{tuple(value.shape)}, this process's {tuple(p.to_local().shape)}. HINT: a restarted "
                        "replica must use the same replica_size and parallelize_fn as the others."
                    )
                value = DTensor.from_local(
                    value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            out[key] = value
        state[index] = out
    return {"state": state, "param_groups": received["param_groups"]}
