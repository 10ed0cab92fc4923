"""``bench scale``: the harness's arithmetic (the projection; growth exponents: tests/unit/test_simulate.py), its stand-in data plane
(threads meeting in memory: sums, builds, a killed member; the same served over TCP to clients of other
processes: its frames, a killed member, a cancelled build, a client gone without a goodbye), and small real
runs of 16 replicas on the embedded coordinator and on a real 3-member etcd, each with a kill, in one worker
process and in three (slow)."""

from __future__ import annotations

import math
import socket
import threading

import pytest
import torch

from lightning_recover.bench.scale import ScaleConfig, ScaleRun, fits, project
from lightning_recover.bench.stand_in_data_plane import (
    DataPlaneClient,
    DataPlaneServer,
    PeerClosed,
    StandInDataPlane,
    StandInGroups,
    frame_tensor,
    send_frame,
    tensor_frame,
)
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
    # with watch relays etcd sends the job's keys once per host of 8 replicas, not twice per replica
    relayed = project([dict(r, watch_relays=True) for r in runs], capacity)
    assert relayed["watch_streams_per_replica"] == pytest.approx(1 / 8)
    assert relayed["2000_long"]["watch_events_per_s"] == pytest.approx(3 * 2000 / 8)
    # with rack relays, once per rack of 32 hosts; each rack relay sends its 32 hosts' relays the events of as many
    # streams, against what one core of it delivers (its half)
    tree = project(
        [dict(r, watch_relays=True, rack_relays=2) for r in runs], {**capacity, "rack_relay_events_per_s": 150}
    )
    assert tree["watch_streams_per_replica"] == pytest.approx(1 / 256)
    assert tree["16000_long"]["watch_events_per_s"] == pytest.approx(3 * 16000 / 256)
    assert tree["16000_long"]["rack_relay_events_per_s"] == pytest.approx(3 * 32)
    assert tree["16000_long"]["within_half_capacity"]["rack_relay_events_per_s"] is False  # 96/s > 75/s
    assert "rack_relay_events_per_s" not in relayed["16000_long"]


def test_projection_counts_the_monitors_ticks_per_second_and_none_at_a_short_step():
    """3 events per step per process at a 1 s step, 1.5 of them the monitor's ticks (1.5 a second): at the long
    step each stream receives 1.5 commit events a step and 1.5 ticks a second; at the 0.2 s step a commit reaches
    every view before it is quiet long enough for a tick, so only the commit events, five steps a second."""
    runs = [dict(_run(n, 2.0, 3.0, 1.5), ticks_per_s=1.5, tick_events_per_step_per_process=1.5) for n in (16, 64)]
    capacity = {"writes_per_s": 1000.0, "watch_events_per_s": 100_000.0, "keepalives_per_s": 4000.0}
    out = project(runs, capacity)
    assert out["ticks_per_s_at_long_step"] == pytest.approx(1.5)
    long, short = out["2000_long"], out["2000_short"]
    assert long["watch_events_per_s"] == pytest.approx((1.5 / 1.0 + 1.5) * 2 * 2000)
    assert long["tick_events_per_s"] == pytest.approx(1.5 * 2 * 2000)
    assert short["watch_events_per_s"] == pytest.approx(1.5 / 0.2 * 2 * 2000)
    assert short["tick_events_per_s"] == 0.0
    # runs that did not count ticks are projected as before: every event a per-step one
    assert project([_run(n, 2.0, 3.0, 1.5) for n in (16, 64)], capacity)["ticks_per_s_at_long_step"] is None


def _members(plane, size: int, body, planes=None) -> list:
    """``size`` members (replicas 10, 11, ...) build generation 1 on ``plane`` (or member r on ``planes[r]``)
    and run ``body(rank, group)``: its results, then the errors raised."""
    out: list = [None] * size
    errors: list = []

    def run(rank: int) -> None:
        try:
            mine = planes[rank] if planes is not None else plane
            group = StandInGroups(mine, 10 + rank).build(None, 1, rank, size, lambda: False)
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
    [(_, spread)] = plane.arrival_spreads  # the first member's wait for the last
    assert spread >= 0


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


def test_frames_carry_only_whitelisted_dtypes_of_the_right_size():
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    header, data = tensor_frame(t)
    assert torch.equal(frame_tensor(header, data), t)
    assert frame_tensor(*tensor_frame(torch.ones(2, dtype=torch.bfloat16))).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not one the data plane carries"):
        frame_tensor({**header, "dtype": "object"}, data)
    with pytest.raises(ValueError, match="do not hold"):
        frame_tensor({**header, "shape": [2, 4]}, data)
    with pytest.raises(ValueError, match="bad shape"):
        frame_tensor({**header, "shape": [-1]}, data)


@pytest.fixture
def served():
    """A served plane and two clients of it (each connection stands for one worker process)."""
    plane = StandInDataPlane()
    server = DataPlaneServer(plane)
    clients = [DataPlaneClient(server.address, timeout=10.0) for _ in range(2)]
    yield plane, server, clients
    for c in clients:
        c.close()
    server.close()


def test_served_plane_builds_and_sums_across_clients(served):
    plane, _, clients = served

    def body(rank: int, group) -> list:
        t = torch.full((3,), float(rank + 1), dtype=torch.float64)
        group.allreduce([t]).wait()
        second = torch.ones(2, dtype=torch.float32)
        group.allreduce([second]).get_future().wait()
        return t.tolist() + second.tolist()

    assert _members(None, 2, body, planes=clients) == [[3.0, 3.0, 3.0, 2.0, 2.0]] * 2
    assert plane.operations == 2


def test_served_kill_fails_the_other_members_operation(served):
    _, _, clients = served
    started = threading.Barrier(2)

    def body(rank: int, group):
        if rank == 1:
            started.wait(5)
            clients[1].kill(11)  # replica 11 (rank 1) dies instead of starting the reduce
            return "killed"
        work = group.allreduce([torch.ones(1)])
        started.wait(5)
        with pytest.raises(PeerClosed, match="replica 11 died"):
            work.wait()
        with pytest.raises(PeerClosed):  # a later operation on the group fails at once too
            group.allreduce([torch.ones(1)]).wait()
        return "failed"

    assert _members(None, 2, body, planes=clients) == ["failed", "killed"]


def test_served_build_is_cancelled_when_its_member_sees_a_failure(served):
    _, _, clients = served
    seen = threading.Event()
    threading.Timer(0.05, seen.set).start()
    with pytest.raises(MembershipChanged, match="failed while it was being built"):
        StandInGroups(clients[0], 0).build(None, 3, 0, 2, seen.is_set)  # the other member never comes


def test_a_worker_gone_without_a_goodbye_fails_its_replicas_groups(served):
    """A connection that closes without the goodbye is a worker process that died: the replicas that built
    over it are killed on the plane, and a malformed frame ends the connection as such."""
    plane, server, clients = served
    host, port = server.address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=10)
    lock = threading.Lock()
    send_frame(raw, lock, {"op": "build", "id": 1, "replica": 20, "number": 5, "rank": 1, "size": 2})
    group = StandInGroups(clients[0], 30).build(None, 5, 0, 2, lambda: False)
    send_frame(raw, lock, {"op": "no such operation", "id": 2})
    with pytest.raises(PeerClosed, match="replica 20 died"):
        group.allreduce([torch.ones(1)]).wait()
    raw.close()


@pytest.mark.slow  # 16 replica threads per backend, each with a kill: about a minute on 2 cores
@pytest.mark.parametrize("backend", ["embedded", "etcd"])
def test_sixteen_replicas_measured_with_a_kill(backend, etcd3, tmp_path):
    # On etcd a 1 s step: the 16 replicas' Raft writes (about a hundred a step) fit the 3 members and this
    # process's TLS clients on 2 cores that also run another test and a CPU hog.
    # On etcd the replicas are 2 worker processes (hosts) of one rack, each with its watch relay: one of the two
    # relays is elected to watch etcd, the other follows it (a launcher's --watch-rack).
    compute, etcd = (1.0, True) if backend == "etcd" else (0.2, False)
    cfg = ScaleConfig(
        16,
        backend,
        compute=compute,
        warmup=1,
        window=3,
        kills=1,
        gap=3,
        heartbeat_timeout=10.0,
        processes=2 if etcd else 1,
        watch_relays=etcd,
        watch_racks=1 if etcd else 0,
    )
    result = ScaleRun(cfg, etcd3 if etcd else None, str(tmp_path)).run()
    assert result["outcomes"] == {"done": 15, "killed": 1}
    (kill,) = result["kills"]
    assert 0 < kill["next_commit_s"] < 30
    assert result["first_step_s"] > 0 and result["decide_s"] > 0 and result["step_s"] >= cfg.compute
    assert 0 < result["commit_s"] <= result["decide_s"]  # the decision less the done barrier
    assert result["operations"] >= 2 * cfg.steps  # the reduce and the done barrier ran on the stand-in
    assert result["arrival_spread_s"] is not None and result["arrival_spread_s"] >= 0
    if backend == "etcd":
        # At least the commit of each step; the window's last one may still be on the leader's writer thread
        # (the decision transaction is asynchronous) when the window closes.
        assert result["etcd_writes_per_step"] * cfg.window >= cfg.window - 1
        assert result["watch_events_per_step_per_process"] >= 1  # the commit reaches every view
        assert result["watch_bytes_per_step_per_process"] > 0
        # etcd sent the job's keys to the rack's elected relay only, and its share is what one view received
        assert result["watch_relays"] and result["watch_racks"] == 1 and result["etcd_watch_streams"] == 1
        assert 0 < result["etcd_watch_bytes_per_step"] <= 2 * result["watch_bytes_per_step_per_process"]
        assert math.isfinite(result["etcd_cpu_s_per_step"])
        assert kill["known_dead_s"] is None  # the monitor role keeps no event log here
    else:
        assert result["watch_bytes_per_step_per_process"] == 0  # no watched views on the embedded coordinator
        # The recovery's timeline: the coordinator knows of the end (its event log) before the commit.
        assert 0 < kill["known_dead_s"] < kill["next_commit_s"], kill
    # Each of the 15 survivors recovered at the kill's step; its regroup is part of its recovery.
    assert kill["regroup_s"]["max"] < kill["next_commit_s"] and kill["after_regroup_s"]["median"] >= 0, kill
    assert kill["failure_seen_s"]["median"] < kill["next_commit_s"], kill
    assert result["control_cpu_s_per_step"] >= 0
    assert result["processes"] == cfg.processes and result["committed_gradients"] == [1.0]


@pytest.mark.slow  # 16 replicas in 3 worker processes, a kill: about half a minute on 2 cores
def test_replicas_in_several_worker_processes_recover_from_a_kill(tmp_path):
    """The replicas spread over 3 processes (every third in each) meet on the served data plane: the kill's
    survivors commit the next step, and every step each replica applied had a gradient counting each of the
    16 microbatches once (checked in the replica; a miscount fails the run)."""
    cfg = ScaleConfig(16, "embedded", compute=0.2, warmup=1, window=3, kills=1, gap=3, processes=3)
    result = ScaleRun(cfg, None, str(tmp_path)).run()
    assert result["processes"] == 3
    assert result["outcomes"] == {"done": 15, "killed": 1}
    (kill,) = result["kills"]
    assert 0 < kill["next_commit_s"] < 30
    assert result["committed_gradients"] == [1.0]
    assert result["operations"] >= 2 * cfg.steps
    assert result["workers_cpu_s_per_step"] > 0 and result["harness_cpu_s_per_step"] >= result["workers_cpu_s_per_step"]
