"""The cluster simulator's pure logic (no processes, fast)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lightning_recover import simulate as sim


def _p(**kw) -> sim.Params:
    return replace(sim.Params(gpus=1024, hours=24.0), **kw)


def test_no_failures_all_equal():
    p = _p()
    results = {a: sim.simulate(a, p, []) for a in sim.APPROACHES}
    assert results["recover"].efficiency == pytest.approx(1.0)
    assert results["drop"].efficiency == pytest.approx(1.0)
    # checkpoint-and-restart still pays for its checkpoints: exactly C per tau of work
    tau, c = p.tau_s, p.checkpoint_s
    assert results["checkpoint"].efficiency == pytest.approx(tau / (tau + c), rel=0.01)
    # ... and with free checkpoints everything is equal
    free = replace(p, checkpoint_s=0.0, checkpoint_interval_s=3600.0)
    assert sim.simulate("checkpoint", free, []).efficiency == pytest.approx(1.0)


def test_young_daly():
    assert sim.young_daly(60.0, 3600.0 * 10) == pytest.approx(math.sqrt(2 * 60 * 36000))
    p = _p(gpus=2048, mtbf_gpu_hours=50_000.0, checkpoint_s=60.0)
    assert p.tau_s == pytest.approx(math.sqrt(2 * 60 * 50_000 * 3600 / 2048))
    assert _p(checkpoint_interval_s=123.0).tau_s == 123.0


def test_deterministic_with_seed():
    p = _p(gpus=8192)
    assert sim.failure_times(p, 7) == sim.failure_times(p, 7)
    assert sim.failure_times(p, 7) != sim.failure_times(p, 8)
    assert sim.sweep(p, [1024, 4096], trials=3, seed=1) == sim.sweep(p, [1024, 4096], trials=3, seed=1)


def test_failure_rate_matches_mtbf():
    p = _p(gpus=16384, hours=500.0)
    n = len(sim.failure_times(p, 0))
    expected = p.hours * 3600 / p.system_mtbf_s
    assert abs(n - expected) < 5 * math.sqrt(expected)


def test_more_failures_checkpoint_loses_more():
    p = _p(gpus=16384, hours=72.0)
    fails = sim.failure_times(p, 3)
    assert len(fails) > 6
    few, many = fails[: len(fails) // 3], fails
    ck_few, ck_many = sim.simulate("checkpoint", p, few), sim.simulate("checkpoint", p, many)
    rec_few, rec_many = sim.simulate("recover", p, few), sim.simulate("recover", p, many)
    assert ck_many.work_s < ck_few.work_s
    assert rec_many.work_s <= rec_few.work_s
    # and checkpoint-and-restart loses far more than in-step recovery
    assert (p.hours * 3600 - ck_many.work_s) > 10 * (p.hours * 3600 - rec_many.work_s)


def test_single_failure_costs():
    p = _p(
        gpus=64,
        gpus_per_replica=8,
        step_s=10.0,
        recovery_s=5.0,
        rejoin_s=100.0,
        restart_s=300.0,
        checkpoint_s=0.0,
        checkpoint_interval_s=1000.0,
        hours=1.0,
    )
    f = [sim.Failure(t=1500.0, replica=3, u=0.5)]
    n = p.replicas  # 8
    rec = sim.simulate("recover", p, f)
    # a pause of 5 s + recompute 0.5 * 10 / 7 s, then 7/8 speed until the replacement is back
    # (100 s after the failure, the pause included)
    pause = 5.0 + 0.5 * 10.0 / 7
    lost = pause + (100.0 - pause) / n
    assert rec.work_s == pytest.approx(3600.0 - lost, abs=1e-6)
    ck = sim.simulate("checkpoint", p, f)
    # checkpoint at 1000 s of work; the failure at 1500 s loses 500 s, then a 300 s restart
    assert ck.work_s == pytest.approx(3600.0 - 500.0 - 300.0, abs=1e-6)
    drop = sim.simulate("drop", p, f)
    # a 5 s pause, the half-done step thrown away (5 s of everybody's work), 7/8 speed until healed
    assert drop.work_s == pytest.approx(3600.0 - 5.0 - 0.5 * 10.0 - (100.0 - 5.0) / n, abs=1e-6)


def test_standby_takes_over_after_takeover_s_and_refills_after_rejoin_s():
    p = _p(gpus=64, gpus_per_replica=8, step_s=10.0, recovery_s=5.0, rejoin_s=100.0, takeover_s=8.0, hours=1.0)
    n = p.replicas  # 8
    pause = 5.0 + 0.5 * 10.0 / 7
    one = [sim.Failure(t=1500.0, replica=3, u=0.5)]
    # the standby is in the dead replica's place 8 s after the failure (the pause included)
    assert sim.simulate("standby", p, one).work_s == pytest.approx(3600.0 - pause - (8.0 - pause) / n, abs=1e-6)
    # a second failure 50 s later finds no standby (the new one is ready 100 s after the first): a rejoin
    two = one + [sim.Failure(t=1550.0, replica=5, u=0.5)]
    lost_two = 2 * pause + (8.0 - pause) / n + (100.0 - pause) / n
    assert sim.simulate("standby", p, two).work_s == pytest.approx(3600.0 - lost_two, abs=1e-6)
    # ... and 150 s later it does
    later = one + [sim.Failure(t=1650.0, replica=5, u=0.5)]
    assert sim.simulate("standby", p, later).work_s == pytest.approx(
        3600.0 - 2 * pause - 2 * (8.0 - pause) / n, abs=1e-6
    )
    # no standby: exactly recover
    none = replace(p, standby=0)
    assert sim.simulate("standby", none, two).work_s == sim.simulate("recover", none, two).work_s


def test_gap_widens_with_scale():
    rows = sim.sweep(sim.Params(hours=48.0), [512, 4096, 16384], trials=5, seed=0)
    gaps = [r["recover"] - r["checkpoint"] for r in rows]
    assert gaps[0] < gaps[1] < gaps[2]


def test_unknown_approach():
    with pytest.raises(ValueError, match="unknown approach"):
        sim.simulate("magic", _p(), [])
