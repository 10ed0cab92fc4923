"""``bench scale``: the harness's arithmetic (the projection; growth exponents: tests/unit/test_simulate.py), its stand-in data plane
(threads meeting in memory: sums, builds, a killed member), and a small real run of 16 replica threads on
the embedded coordinator and on a real 3-member etcd, each with a kill (slow)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from lightning_recover.bench.scale import ScaleConfig, ScaleRun, fits, project
from lightning_recover.bench.stand_in_data_plane import PeerClosed, StandInDataPlane, StandInGroups
from lightning_recover.errors import MembershipChanged


def _run(n: int, writes: float, events: float, keepalives_per_replica: float, step: float = 1.0) -> dict:
    return {
        "backend": "etcd",
        "replicas": n,
        "step_s": step,
        "etcd_writes_per_step": writes,
        "watch_events_per_step_per_process": events,
        "etcd_keepalives_per_s": keepalives_per_replica * n,
        "decide_s": 0.01,
    }


def test_projection_extends_the_fits_and_compares_with_half_the_capacity():
    """Flat writes (2 per step) and events (3 per step per process), 1.5 keep-alives/s per replica, a 1 s
    step: at 2,000 replicas 2 writes/s at the long step and 10 at the 0.2 s step; 3 x 2 x 2,000 events per
    step; 3,000 keep-alives/s, above half of a 4,000/s capacity."""
    runs = [_run(n, 2.0, 3.0, 1.5) for n in (16, 64, 256)]
    capacity = {"writes_per_s": 1000.0, "watch_events_per_s": 100_000.0, "keepalives_per_s": 4000.0}
    out = project(runs, capacity)
    long, short = out["2000_long"], out["2000_short"]
    assert long["writes_per_s"] == pytest.approx(2.0)
    assert short["writes_per_s"] == pytest.approx(10.0)
    assert long["watch_events_per_s"] == pytest.approx(3 * 2 * 2000)
    assert short["watch_events_per_s"] == pytest.approx(3 * 2 * 2000 / 0.2)
    assert long["keepalives_per_s"] == pytest.approx(3000.0)
    assert long["within_half_capacity"] == {"writes_per_s": True, "watch_events_per_s": True, "keepalives_per_s": False}
    assert short["within_half_capacity"]["watch_events_per_s"] is False  # 60,000/s > 50,000/s
    # a figure that grows linearly is extended as such
    grown = project([_run(n, 0.5 * n, 3.0, 0.0) for n in (16, 64, 256)], capacity)
    assert grown["16000_long"]["writes_per_s"] == pytest.approx(8000.0)
    assert fits(runs)["etcd"]["etcd_writes_per_step"] == pytest.approx(0.0)
    assert "not_projected" in project(runs[:1], capacity)  # one N fits no growth: nothing is projected


def _members(plane: StandInDataPlane, size: int, body) -> list:
    out: list = [None] * size
    errors: list = []

    def run(rank: int) -> None:
        try:
            group = StandInGroups(plane, 10 + rank).build(None, 1, rank, size, lambda: False)
            out[rank] = body(rank, group)
        except BaseException as exc:  # noqa: BLE001 -- asserted by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    return out + errors


def test_stand_in_all_reduce_sums_once_every_member_started_it():
    plane = StandInDataPlane()

    def body(rank: int, group) -> float:
        t = torch.tensor([float(rank + 1)])
        work = group.allreduce([t])
        work.wait()
        return t.item()

    assert _members(plane, 4, body) == [10.0] * 4
    assert plane.operations == 1


def test_a_killed_member_fails_its_groups_operations_at_once():
    plane = StandInDataPlane()
    started = threading.Barrier(3)

    def body(rank: int, group):
        if rank == 2:
            started.wait(5)
            plane.kill(12)  # replica 12 (rank 2) dies instead of starting the reduce
            return "killed"
        work = group.allreduce([torch.ones(1)])
        started.wait(5)
        with pytest.raises(PeerClosed):
            work.wait()
        with pytest.raises(PeerClosed):  # a later operation on the group fails at once too
            group.allreduce([torch.ones(1)]).wait()
        return "failed"

    assert _members(plane, 3, body) == ["failed", "failed", "killed"]


def test_a_build_stops_when_the_control_plane_sees_a_failure():
    plane = StandInDataPlane()
    seen = threading.Event()
    threading.Timer(0.05, seen.set).start()
    with pytest.raises(MembershipChanged, match="failed while it was being built"):
        StandInGroups(plane, 0).build(None, 3, 0, 2, seen.is_set)  # the other member never comes


@pytest.mark.slow  # 16 replica threads per backend, each with a kill: about a minute on 2 cores
@pytest.mark.parametrize("backend", ["embedded", "etcd"])
def test_sixteen_replicas_measured_with_a_kill(backend, etcd3, tmp_path):
    cfg = ScaleConfig(16, backend, compute=0.2, warmup=1, window=3, kills=1, gap=3, heartbeat_timeout=10.0)
    result = ScaleRun(cfg, etcd3 if backend == "etcd" else None, str(tmp_path)).run()
    assert result["outcomes"] == {"done": 15, "killed": 1}
    (kill,) = result["kills"]
    assert 0 < kill["next_commit_s"] < 30
    assert result["first_step_s"] > 0 and result["decide_s"] > 0 and result["step_s"] >= cfg.compute
    assert result["operations"] >= 2 * cfg.steps  # the reduce and the done barrier ran on the stand-in
    if backend == "etcd":
        # At least the commit of each step; the window's last one may still be on the leader's writer thread
        # (the decision transaction is asynchronous) when the window closes.
        assert result["etcd_writes_per_step"] * cfg.window >= cfg.window - 1
        assert result["watch_events_per_step_per_process"] >= 1  # the commit reaches every view
        assert result["watch_bytes_per_step_per_process"] > 0
        assert math.isfinite(result["etcd_cpu_s_per_step"])
    else:
        assert result["watch_bytes_per_step_per_process"] == 0  # no watched views on the embedded coordinator
    assert result["control_cpu_s_per_step"] >= 0
