"""Sharded replicas on the Lightning side: options, validation, the parallelize step and the
per-microbatch backward preparation, shared by the Fabric and the Trainer strategies.

``RecoverStrategy(microbatches=M, replica_size=K, parallelize_fn=fn)`` (or ``shard="fsdp"``)
with ``L.Fabric(devices=R*K)``, or ``RecoverTrainerStrategy(...)`` with ``L.Trainer(devices=R*K)``:
R replicas of K processes. ``fn(module, mesh)`` follows Lightning's ``ModelParallelStrategy``
convention; ``mesh`` is the replica's 1-D mesh with dimension ``"shard"`` (the replicate dimension
is lightning-recover's own, fault-tolerant one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module

from lightning_recover.protocol.sharding import is_sharded

SHARD_MODES = ("fsdp",)


@dataclass
class ShardingConfig:
    """How each replica shards its model over its K processes."""

    replica_size: int = 1
    parallelize_fn: Optional[Callable[[Module, Any], Module]] = None
    shard: Optional[str] = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ShardingConfig:
        """Take ``replica_size``, ``parallelize_fn`` and ``shard`` out of a strategy's keyword arguments."""
        return cls(options.pop("replica_size", 1), options.pop("parallelize_fn", None), options.pop("shard", None))

    def __post_init__(self) -> None:
        if not isinstance(self.replica_size, int) or self.replica_size < 1:
            raise ValueError(f"replica_size must be a positive integer, got {self.replica_size!r}")
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
        if M < K:
            raise ValueError(
                f"microbatches={M} is smaller than replica_size={K}: the processes of one replica take one "
                f"microbatch each per round. HINT: use microbatches >= {max(K, replicas)}, ideally a multiple of "
                f"{K * replicas}."
            )
        return replicas

    def parallelize(self, module: Module, mesh: Any, shard_root: bool = True) -> Module:
        """Shard ``module`` over the replica's mesh; every parameter must end up sharded.

        ``shard_root=False`` (the Trainer: Lightning calls ``training_step``, not the LightningModule's
        forward, so a root FSDP module's hooks would not run reliably) makes ``shard="fsdp"`` shard the
        module's top-level children instead of the module itself.
        """
        if self.shard == "fsdp":
            module = fsdp_every_block(module, mesh, shard_root=shard_root)
        else:
            out = self.parallelize_fn(module, mesh)
            module = out if isinstance(out, Module) else module
        unsharded = [name for name, p in module.named_parameters() if not is_sharded(p)]
        if unsharded:
            raise ValueError(
                f"parallelize_fn left {len(unsharded)} parameters unsharded (e.g. {', '.join(unsharded[:3])}); "
                "every parameter must be sharded over the replica's mesh. HINT: end with "
                "`fully_shard(model, mesh=mesh['shard'])`, or use shard='fsdp'."
            )
        # FSDP2 averages reduce-scattered gradients over the K processes; the replica must contribute
        # the *sum* over its microbatches (the protocol divides by M once, at commit), so the strategy
        # scales each loss by K (loss_scale). Not set_gradient_divide_factor(1): for float32 it asks for
        # ReduceOp.PREMUL_SUM, which gloo refuses (measured, torch 2.13).
        return module

    @property
    def loss_scale(self) -> float:
        return float(self.replica_size)

    def prepare_backward(self, core: Any, loss: Tensor, modules: Iterable[Module]) -> Tensor:
        """The loss to back-propagate for the current microbatch (after ``core.before_backward``).

        A zero-contribution slot (sharded replica, short last round) runs backward with the loss
        times 0: it joins FSDP's collectives and adds nothing. Otherwise the loss is scaled by K,
        since FSDP2 averages the reduce-scattered gradients over the K processes. Reduce-scatter
        happens once per list of microbatches (its last round), like stock ``no_sync``; every
        process of the replica has the same number of rounds.
        """
        if core.zero_slot:
            loss = loss * 0
        elif self.enabled:
            loss = loss * self.loss_scale
        if self.enabled:
            sync = core.sync_round
            for module in modules:
                for m in module.modules():
                    if hasattr(m, "set_requires_gradient_sync"):
                        m.set_requires_gradient_sync(sync, recurse=False)
        return loss


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
