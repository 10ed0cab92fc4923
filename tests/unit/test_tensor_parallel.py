"""Tensor parallelism inside a replica, the fast parts: rounds in units of the data width,
validation with HINTs, and which parameter placements a parallelized model may have."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_recover.lightning.sharding_config import ShardingConfig
from lightning_recover.protocol.step import rounds


def _identity(model, mesh):
    return model


def test_tp_processes_of_one_data_position_get_the_same_slots():
    ids = [3, 4, 5, 6, 7]
    K, tp = 4, 2
    W = K // tp
    slots = {inner: list(rounds(ids, inner // tp, W)) for inner in range(K)}
    assert slots[0] == slots[1] == [(3, True), (5, True), (7, True)]
    assert slots[2] == slots[3] == [(4, True), (6, True), (7, False)]  # zero slot in the short last round
    # every id is computed by exactly one data position (by all tp processes of it)
    mine = [j for d in range(W) for j, m in rounds(ids, d, W) if m]
    assert sorted(mine) == ids
    # pure tensor parallelism (tp == K): one data position, every process computes every id
    assert all(list(rounds(ids, inner // 2, 1)) == [(j, True) for j in ids] for inner in range(2))


def test_tensor_parallel_validation_hints():
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide replica_size=4.*HINT"):
        ShardingConfig(replica_size=4, parallelize_fn=_identity, tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel=2 needs parallelize_fn.*HINT.*parallelize_module"):
        ShardingConfig(replica_size=2, shard="fsdp", tensor_parallel=2)
    with pytest.raises(ValueError, match="tensor_parallel must be a positive integer"):
        ShardingConfig(replica_size=2, parallelize_fn=_identity, tensor_parallel=0)
    with pytest.raises(ValueError, match="does not divide replica_size=1"):
        ShardingConfig(replica_size=1, tensor_parallel=2)
    # the microbatch floor is the data width K // tp, not K
    pure = ShardingConfig(replica_size=2, parallelize_fn=_identity, tensor_parallel=2)
    assert pure.data_width == 1 and pure.loss_scale == 1.0
    assert pure.validate(devices=4, microbatches=1) == 2
    two_d = ShardingConfig(replica_size=8, parallelize_fn=_identity, tensor_parallel=2)
    assert two_d.data_width == 4 and two_d.loss_scale == 4.0
    with pytest.raises(ValueError, match="microbatches=3 is smaller than the data width.*= 4.*HINT"):
        two_d.validate(devices=16, microbatches=3)
    assert two_d.validate(devices=16, microbatches=4) == 2
    # tp == 1 keeps the old numbers
    assert ShardingConfig(replica_size=2, shard="fsdp").loss_scale == 2.0


def _fake_dtensor(p: torch.nn.Parameter, dims: tuple[str, ...]) -> None:
    """Give a parameter the attributes the checks read from a DTensor (no process group needed)."""
    p.to_local = lambda: p
    p.placements = ()
    p.device_mesh = SimpleNamespace(mesh_dim_names=dims)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))


def _parallelize(layout: dict[str, tuple[str, ...]]):
    def fn(model, mesh):
        for name, p in model.named_parameters():
            if name.split(".")[0] in layout:
                _fake_dtensor(p, layout[name.split(".")[0]])
        return model

    return fn


def test_pure_tp_allows_replicated_plain_parameters():
    # tp == K: every process computes the same microbatch, so the plain last Linear is replicated
    config = ShardingConfig(
        replica_size=2, tensor_parallel=2, parallelize_fn=_parallelize({"0": ("tp",), "2": ("tp",)})
    )
    config.parallelize(_mlp(), mesh=None)
    # ... but a model with nothing split over tp is K copies of one replica: refused
    config = ShardingConfig(replica_size=2, tensor_parallel=2, parallelize_fn=_identity)
    with pytest.raises(ValueError, match="split no parameter over the 'tp' dimension.*HINT"):
        config.parallelize(_mlp(), mesh=None)


def test_2d_needs_every_parameter_sharded_over_the_shard_dimension():
    # K // tp > 1: a plain or TP-only parameter would only see its own data position's microbatches
    tp_only = _parallelize({"0": ("shard", "tp"), "2": ("tp",), "3": ("shard",)})
    config = ShardingConfig(replica_size=4, tensor_parallel=2, parallelize_fn=tp_only)
    with pytest.raises(ValueError, match="left 2 parameters not sharded over the 'shard' dimension.*2.weight.*HINT"):
        config.parallelize(_mlp(), mesh=None)
    full = _parallelize({"0": ("shard", "tp"), "2": ("shard", "tp"), "3": ("shard",)})
    ShardingConfig(replica_size=4, tensor_parallel=2, parallelize_fn=full).parallelize(_mlp(), mesh=None)


def test_a_replica_whose_size_tp_does_not_divide_is_refused():
    from lightning_recover.protocol.options import RecoverOptions
    from lightning_recover.protocol.replica import Replica

    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide this replica's 4 processes.*HINT"):
        Replica(RecoverOptions(microbatches=4), "127.0.0.1:1", 0, 1, list, replica_size=4, tensor_parallel=3)
