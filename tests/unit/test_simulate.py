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


def test_growth_exponent_of_a_power_law_flat_and_zero_figures():
    ns = [16, 64, 256, 512]
    assert sim.growth_exponent(ns, [3 * n**0.5 for n in ns]) == pytest.approx(0.5)
    assert sim.growth_exponent(ns, [2 * n for n in ns]) == pytest.approx(1.0)
    assert sim.growth_exponent(ns, [7.0] * 4) == pytest.approx(0.0)
    assert sim.growth_exponent(ns, [0.0] * 4) == 0.0  # never happened: does not grow
    assert sim.growth_exponent([16], [1.0]) is None  # one point fits nothing
    assert sim.power_law_at(ns, [3 * n**0.5 for n in ns], 16384) == pytest.approx(3 * 16384**0.5)


def _scale_run(backend: str, n: int, decide: float, kill_to_commit: float, compute: float = 1.0) -> dict:
    return {
        "backend": backend,
        "replicas": n,
        "decide_s": decide,
        "kill_next_commit_s": kill_to_commit,
        "compute_s": compute,
    }


def test_control_costs_from_a_scale_result_take_the_backend_with_most_sizes():
    runs = [
        _scale_run("embedded", 16, 0.01, 1.5),
        _scale_run("embedded", 64, 0.04, 3.0),
        _scale_run("etcd", 16, 0.02, 1.2),
        {"backend": "etcd", "replicas": 64, "decide_s": None, "kill_next_commit_s": None, "compute_s": 1.0},
    ]
    backend, costs = sim.control_costs_from_scale(runs)
    assert backend == "embedded"
    assert costs["decide_points"] == ((16, 0.01), (64, 0.04))
    # the harness's kill -> next commit includes one recomputed microbatch, which the model counts itself
    assert costs["recovery_points"] == ((16, 0.5), (64, 2.0))
    with pytest.raises(ValueError, match="no run with both decide_s and kill_next_commit_s"):
        sim.control_costs_from_scale(runs[3:])


def test_measured_control_costs_follow_the_jobs_size():
    """Recovery and the time to decide a step, measured at 16 and 64 replicas (doubling with 4x the replicas:
    N^0.5), are projected to the simulated size; a failure-free run trains step / (step + decide) of its time."""
    p = _p(gpus=8 * 1024, gpus_per_replica=8, step_s=10.0, hours=1.0, mtbf_gpu_hours=1e12)
    measured = replace(p, decide_points=((16, 0.1), (64, 0.2)), recovery_points=((16, 2.0), (64, 4.0)))
    assert measured.decide_at_size == pytest.approx(0.1 * (1024 / 16) ** 0.5)
    assert measured.recovery_at_size == pytest.approx(2.0 * (1024 / 16) ** 0.5)
    assert p.decide_at_size == 0.0 and p.recovery_at_size == p.recovery_s  # not measured: the constants
    assert sim.simulate("recover", p, []).efficiency == pytest.approx(1.0)
    assert sim.simulate("recover", measured, []).efficiency == pytest.approx(10.0 / (10.0 + 0.8))
    assert sim.simulate("checkpoint", measured, []).efficiency == sim.simulate("checkpoint", p, []).efficiency
    one = replace(measured, decide_points=((64, 0.3),))
    assert one.decide_at_size == 0.3, "one measured size: its value, not a fit"
