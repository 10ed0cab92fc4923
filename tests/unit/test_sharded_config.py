"""Sharded replicas, the fast parts: rounds of K, fault syntax, setup validation with HINTs."""

from __future__ import annotations

import pytest
import torch

from lightning_recover.lightning.sharding_config import ShardingConfig
from lightning_recover.protocol.faults import FaultInjector, parse_faults
from lightning_recover.protocol.step import rounds


def test_rounds_split_ids_and_pad_the_last_round():
    ids = [3, 4, 5, 6, 7]
    assert list(rounds(ids, 0, 2)) == [(3, True), (5, True), (7, True)]
    assert list(rounds(ids, 1, 2)) == [(4, True), (6, True), (7, False)]
    # every id is computed by exactly one process of the replica
    mine = [j for i in range(3) for j, m in rounds(ids, i, 3) if m]
    assert sorted(mine) == ids
    assert list(rounds([1, 2], 0, 1)) == [(1, True), (2, True)]


def test_fault_names_a_process_of_a_replica():
    (fault,) = parse_faults("kill:replica=1:inner=1:step=2:phase=reduce")
    assert fault.inner == 1 and str(fault) == "kill:replica=1:inner=1:step=2:phase=reduce"
    assert FaultInjector([fault], 1, 1, inner=1) and not FaultInjector([fault], 1, 1, inner=0)
    with pytest.raises(ValueError, match="inner"):
        parse_faults("kill:replica=1:inner=-1:step=2:phase=reduce")


def test_setup_validation_hints():
    with pytest.raises(ValueError, match="HINT"):
        ShardingConfig(replica_size=2)  # no way to shard
    config = ShardingConfig(replica_size=2, shard="fsdp")
    with pytest.raises(ValueError, match="not divisible by replica_size=2.*HINT"):
        config.validate(devices=5, microbatches=8)
    with pytest.raises(ValueError, match="microbatches=1 is smaller than replica_size=2.*HINT"):
        config.validate(devices=4, microbatches=1)
    assert config.validate(devices=6, microbatches=8) == 3


def test_parallelize_fn_that_leaves_parameters_unsharded_is_refused():
    config = ShardingConfig(replica_size=2, parallelize_fn=lambda model, mesh: model)
    with pytest.raises(ValueError, match="left 2 parameters unsharded.*HINT"):
        config.parallelize(torch.nn.Linear(2, 2), mesh=None)


def test_a_replica_of_another_size_than_the_coordinators_is_refused():
    from lightning_recover.protocol.replica_env import check_replica_size_against_coordinator

    check_replica_size_against_coordinator("2", 2)
    check_replica_size_against_coordinator(None, 1)  # an older coordinator: replicas of one process
    with pytest.raises(ValueError, match="replicas of 2 process.*HINT.*--nproc-per-replica 2"):
        check_replica_size_against_coordinator(b"2", 1)
