"""The etcd control plane against the embedded coordinator, paired in one session (docs/control_plane.md, "Targets").

    python -m benchmarks.etcd_control_plane --json benchmarks/results/etcd32_targets.json

On a fresh local 3-member TLS etcd (``LocalEtcdCluster``, its default election timeout), with 4 replicas of
the TinyGPT job of ``bench overhead`` (``lightning_recover.bench.fabric_gpt``):

* **overhead**: failure-free median step time, embedded vs etcd, runs alternated; the median of the
  paired ratios (target <= 1.03).
* **kill**: a replica SIGKILLed mid-step -> the last survivor's next commit (as ``bench recovery``),
  embedded and etcd alternated (target on etcd: median <= 0.3 s).
* **leader**: the etcd leader SIGKILLed during training: the longest gap between two commits of any
  replica around the kill, against the usual step (target: <= election timeout + 0.5 s), and no step
  lost or applied twice (every replica's committed steps are 0..S-1 once each).
* **failover**: the reference for **leader**: a bare client writing in a loop through a follower, the
  leader SIGKILLed: the longest gap between two of its puts (etcd's election plus the client's retry,
  nothing of the job).
* **cost**: what each kind of request costs the members in CPU, one kind at a time on the idle cluster
  (``benchmarks/etcd_request_cost.py``).
* **steady**: the control plane's cost per step in steady state: etcd's counters and the members' CPU over
  one job of ``4 x --steps`` steps minus one of ``--steps`` steps, per step (start-up and shutdown cancel
  out); the idle members' CPU over the same time is given beside it.
* **load**: etcd's own counters (``/metrics``) over a failure-free run: raft proposals (writes), reads,
  watch events per step per replica, heartbeats (counted from etcd's history); and the projection to 2,000
  replicas against the write rate this cluster sustains (measured here too). Heartbeats reach the monitor's
  view alone; every other write reaches every process's view, so those events grow with the square of the
  replicas when each replica's writes are counted (``projection_2000``: the whole job, start-up included,
  as if every step cost that). With **steady**, ``projection_2000_steady`` projects a running job instead:
  heartbeats grow with the replicas, a step's other writes (the commit, its cleanup, ticks) do not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.etcd_request_cost import measure_costs
from lightning_recover.bench.etcd_metrics import LEADER_CHANGES, METRICS, members_cpu_seconds, metrics, write_capacity
from lightning_recover.bench.recovery import next_commit_after
from lightning_recover.control_plane.etcd_client import EtcdClient, prefix_end, unb64
from lightning_recover.control_plane.etcd_cluster import DEFAULT_ELECTION_MS, LocalEtcdCluster

_APPLIED_BY_ALL = {
    "etcd_server_proposals_committed_total",
    "etcd_mvcc_put_total",
    "etcd_mvcc_txn_total",
    "etcd_mvcc_delete_total",
}
_KILL_TIME = re.compile(r"injecting fault (\S+) at t=([0-9.]+)")
_STEP_KEY = re.compile(rb"(\d+)/")  # a step's keys: s{step}/g{generation}/...


def _start(args: list[str], out: str, env_extra: dict[str, str], inject: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    env.pop("LIGHTNING_RECOVER_INJECT", None)
    if inject:
        env["LIGHTNING_RECOVER_INJECT"] = inject
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_recover.bench.fabric_gpt", "--out", out, *args]
    log = open(os.path.join(out, "job.log"), "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, out: str, timeout: float = 600) -> str:
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    log = open(os.path.join(out, "job.log")).read()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark job failed ({proc.returncode}):\n{log[-3000:]}")
    return log


def _records(out: str) -> dict[str, list[dict]]:
    return {n[:-5]: json.load(open(os.path.join(out, n))) for n in os.listdir(out) if n.endswith(".json")}


#: the TinyGPT size of the jobs (``--layers``/``--width``: a longer step, same control-plane traffic per step)
MODEL = {"layers": 2, "width": 128}


def _job_args(replicas: int, steps: int) -> list[str]:
    return ["--strategy", "recover", "--replicas", str(replicas), "--steps", str(steps)] + [
        "--microbatches",
        str(2 * replicas),
        *("--layers", str(MODEL["layers"]), "--width", str(MODEL["width"])),
    ]


def step_median(out: str, warmup: int) -> float:
    recs = list(_records(out).values())[0]
    return statistics.median(r["seconds"] for r in recs if r["step"] >= warmup)


def step_parts(out: str, warmup: int) -> dict[str, float]:
    """Medians over every replica's steps after ``warmup``: a replica's CPU per step (all its threads: the
    client's share of the control plane shows here) and its time deciding the step after its reduce (the
    report and the wait for the decision: the control plane's share of the critical path)."""
    recs = [r for rs in _records(out).values() for r in rs if r["step"] >= warmup]
    return {k: statistics.median(r[k] for r in recs) for k in ("cpu_seconds", "decide_seconds")}


def measure(args: argparse.Namespace) -> dict:
    work = args.dir or tempfile.mkdtemp(prefix="lr-etcd32-")
    result: dict = {"replicas": args.replicas, "steps": args.steps, "model": dict(MODEL)}
    with LocalEtcdCluster(os.path.join(work, "etcd"), election_ms=args.election_ms) as cluster:
        etcd_env = cluster.environment()
        result["election_timeout_s"] = args.election_ms / 1000
        modes = {"embedded": {}, "etcd": etcd_env}
        parts = set(args.parts.split(","))
        if "cost" in parts:  # first, on the idle cluster: nothing else may use the cores meanwhile
            result["request_cost"] = measure_costs(cluster)
            print(f"  request cost: {result['request_cost']}", flush=True)
        # --- overhead and load (failure-free runs, alternated)
        times: dict[str, list[float]] = {m: [] for m in modes}
        parts_of_step: dict[str, list[dict]] = {m: [] for m in modes}
        load = []
        for rep in range(args.repeat if "overhead" in parts else 0):
            for mode in list(modes)[rep % 2 :] + list(modes)[: rep % 2]:
                out = os.path.join(work, f"free-{mode}{rep}")
                before = metrics(cluster) if mode == "etcd" else None
                first = revision(cluster) + 1 if mode == "etcd" else 0
                cpu, began = members_cpu_seconds(cluster), time.monotonic()
                _finish(_start(_job_args(args.replicas, args.steps), out, modes[mode]), out)
                # the members' CPU over the whole job, start-up included (embedded runs: the idle cluster's)
                cores = (members_cpu_seconds(cluster) - cpu) / (time.monotonic() - began)
                parts_of_step[mode].append({"members_cores": cores})
                if before is not None:
                    after = metrics(cluster)
                    per = args.steps * args.replicas
                    # Writes are applied by every member (counted 3 times); reads and watch events only by
                    # the member that served them. Read-only transactions (check, multi_get) are served
                    # locally, so the txn count divided by 3 is approximate.
                    load.append({k: (after[k] - before[k]) / per / (3 if k in _APPLIED_BY_ALL else 1) for k in METRICS})
                    # elections during a failure-free run are spurious (a member missed the leader's beats)
                    load[-1]["leader_changes_in_run"] = after[LEADER_CHANGES] - before[LEADER_CHANGES]
                    load[-1]["etcd_cores"] = cores
                    load[-1]["heartbeats"] = heartbeat_writes(cluster, first, revision(cluster)) / per
                times[mode].append(step_median(out, 3))
                parts_of_step[mode][-1].update(step_parts(out, 3))
                print(
                    f"  {mode:8s} run {rep}: median step {times[mode][-1] * 1e3:.1f} ms, "
                    f"deciding {parts_of_step[mode][-1]['decide_seconds'] * 1e3:.1f} ms, "
                    f"replica CPU {parts_of_step[mode][-1]['cpu_seconds'] * 1e3:.1f} ms",
                    flush=True,
                )
        if times["etcd"]:
            paired = [e / b for b, e in zip(times["embedded"], times["etcd"])]
            result["overhead"] = {
                "runs": times,
                "paired_ratios": paired,
                "paired_ratio_median": statistics.median(paired),
                # per mode, the mean over runs of each run's median (step_parts), and the members' CPU
                **{
                    name: {m: statistics.mean(p[field] for p in v) for m, v in parts_of_step.items()}
                    for name, field in (
                        ("replica_cpu_s_per_step", "cpu_seconds"),
                        ("members_cores", "members_cores"),
                        ("decide_s_per_step", "decide_seconds"),
                    )
                },
            }
        if "steady" in parts:
            result["steady_state"] = steady_state(cluster, etcd_env, args.replicas, args.steps, work)
            print(f"  steady state: {result['steady_state']}", flush=True)
        # --- kill -> next commit, alternated
        kills: dict[str, list[float]] = {m: [] for m in modes}
        phases = ["reduce", "backward", "forward"]
        for i in range(args.kills if "kill" in parts else 0):
            for mode in list(modes)[i % 2 :] + list(modes)[: i % 2]:
                victim, step, phase = 1 + i % (args.replicas - 1), 2 + i % 3, phases[i % 3]
                out = os.path.join(work, f"kill-{mode}{i}")
                log = _finish(
                    _start(
                        _job_args(args.replicas, step + 3) + ["--heartbeat-timeout", "1.0"],
                        out,
                        modes[mode],
                        inject=f"kill:replica={victim}:step={step}:phase={phase}",
                    ),
                    out,
                )
                fault_at = float(_KILL_TIME.search(log).group(2))
                nxt = [next_commit_after(recs, step, fault_at) for recs in _records(out).values()]
                kills[mode].append(max(nxt) - fault_at)
                print(f"  {mode:8s} kill {i} ({phase}): next commit after {kills[mode][-1]:.3f}s", flush=True)
        if kills["etcd"]:
            result["kill_next_commit_s"] = {m: {"runs": v, "median": statistics.median(v)} for m, v in kills.items()}
        # --- etcd leader SIGKILL during training
        leader_runs = []
        for i in range(args.leader_kills if "leader" in parts else 0):
            out = os.path.join(work, f"leader{i}")
            steps = args.steps + 6
            job = f"bench-leader-{i}-{os.getpid()}"
            proc = _start(_job_args(args.replicas, steps), out, dict(etcd_env, LIGHTNING_RECOVER_JOB=job))
            _wait_for_step(cluster, job, 4, proc)
            leader = cluster.leader()
            killed_at = time.time()
            cluster.kill(leader)
            _finish(proc, out)
            recs = _records(out)
            gaps, usual, lost = [], [], []
            for name, rs in recs.items():
                times_ = sorted(r["committed_at"] for r in rs)
                steps_seen = sorted(r["step"] for r in rs)
                if steps_seen != list(range(steps)):
                    lost.append(name)
                d = [b - a for a, b in zip(times_, times_[1:])]
                usual.append(statistics.median(d))
                gaps.append(max(b - a for a, b in zip(times_, times_[1:]) if b > killed_at))
            run = {
                "killed_leader": f"m{leader}",
                "max_gap_s": max(gaps),
                "usual_step_s": statistics.median(usual),
                "stall_s": max(gaps) - statistics.median(usual),
                "replicas_with_lost_or_repeated_steps": lost,
            }
            leader_runs.append(run)
            print(f"  leader kill {i}: {run}", flush=True)
            cluster.restart(leader)
        if leader_runs:
            result["leader_kill"] = leader_runs
        failovers = [bare_failover(cluster) for _ in range(args.leader_kills if "failover" in parts else 0)]
        if failovers:
            result["bare_client_failover_s"] = {"runs": failovers, "median": statistics.median(failovers)}
            print(f"  bare client failover: {[round(x, 3) for x in failovers]}", flush=True)
        if not load:
            return result
        # --- load and its projection
        mean_load = {k: statistics.mean(x[k] for x in load) for k in (*METRICS, "heartbeats")}
        capacity = write_capacity(cluster)
        step_s = statistics.median(times["etcd"])
        writes_per_s_per_replica = mean_load["etcd_server_proposals_committed_total"] / step_s
        result["load_per_step_per_replica"] = mean_load
        result["spurious_leader_changes"] = [x["leader_changes_in_run"] for x in load]
        result["etcd_members_cores"] = [x["etcd_cores"] for x in load]
        result["write_capacity_puts_per_s"] = capacity
        # Watch events: every process's watched view (control_plane/etcd_watch.py) receives every write
        # under the job's keys, so those events grow with the number of replicas: the measured rate per
        # replica, times 2000 / replicas. Heartbeats live beside those keys and reach the monitor's view
        # alone (control_plane/etcd_store.py, ``apart``): one event per beat at any size.
        beats_per_s_per_replica = mean_load["heartbeats"] / step_s
        shared_per_s_per_replica = mean_load["etcd_debugging_mvcc_events_total"] / step_s - beats_per_s_per_replica
        result["projection_2000"] = {
            "writes_per_s": 2000 * writes_per_s_per_replica,
            "capacity_fraction": 2000 * writes_per_s_per_replica / capacity,
            "step_s_assumed": step_s,
            "heartbeats_per_s": 2000 * beats_per_s_per_replica,
            # (the monitor reads etcd only when its watched view shows a replica late: none while all beat,
            # coordinator.run_monitor; its views' events are in the measured rate)
            "watch_events_per_s": 2000 * (shared_per_s_per_replica * 2000 / args.replicas + beats_per_s_per_replica),
        }
        if "steady_state" in result:  # the same without start-up: what a running job costs
            result["projection_2000_steady"] = project_steady(result["steady_state"], args.replicas, capacity)
    return result


def steady_state(cluster: LocalEtcdCluster, env: dict[str, str], replicas: int, steps: int, work: str) -> dict:
    """Per step of the whole job (all replicas), in steady state: a job of ``4 x steps`` steps minus one of
    ``steps`` steps. Writes are counted once (every member applies them), reads and watch events as served."""
    runs, beats = [], []
    for n in (steps, 4 * steps):
        out = os.path.join(work, f"steady{n}")
        before, cpu, began = metrics(cluster), members_cpu_seconds(cluster), time.monotonic()
        first = revision(cluster) + 1
        _finish(_start(_job_args(replicas, n), out, env), out)
        after = metrics(cluster)
        runs.append((after, before, members_cpu_seconds(cluster) - cpu, time.monotonic() - began, step_median(out, 3)))
        beats.append(heartbeat_writes(cluster, first, revision(cluster)))
    (short_after, short_before, short_cpu, short_s, _), (long_after, long_before, long_cpu, long_s, step_s) = runs
    extra_steps, extra_s = 3 * steps, long_s - short_s
    per_step = {
        k: ((long_after[k] - long_before[k]) - (short_after[k] - short_before[k]))
        / extra_steps
        / (3 if k in _APPLIED_BY_ALL else 1)
        for k in METRICS
    }
    idle = cluster_idle_cores(cluster)
    return {
        "per_step_of_the_job": per_step,
        "members_cpu_s_per_step": (long_cpu - short_cpu) / extra_steps,
        "idle_members_cpu_s_per_step": idle * extra_s / extra_steps,
        "heartbeats_per_step_of_the_job": (beats[1] - beats[0]) / extra_steps,
        "step_s": step_s,
    }


def project_steady(steady: dict, replicas: int, capacity: float, n: int = 2000) -> dict:
    """etcd's load at ``n`` replicas in steady state, from the per-step figures of the whole job (``steady_state``):
    each replica's heartbeats (written beside the job's keys, received by the monitor's view alone) grow with
    ``n``; the other writes of a step (the leader's commit and its cleanup, the monitor's ticks) do not, and
    every process's view receives each of them: ``n`` replicas' and at most as many launchers' (2 n)."""
    step_s = steady["step_s"]
    beats = steady["heartbeats_per_step_of_the_job"]
    beats_per_s = beats / replicas / step_s * n
    shared_per_s = (steady["per_step_of_the_job"]["etcd_server_proposals_committed_total"] - beats) / step_s
    return {
        "writes_per_s": beats_per_s + shared_per_s,
        "capacity_fraction": (beats_per_s + shared_per_s) / capacity,
        "heartbeats_per_s": beats_per_s,
        "watch_events_per_s": beats_per_s + shared_per_s * 2 * n,
        "step_s_assumed": step_s,
    }


def revision(cluster: LocalEtcdCluster) -> int:
    """The cluster's current revision (every write moves it by one)."""
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, allow_insecure=not cluster.tls)
    try:
        return int(client.range(b"/", count_only=True)["header"]["revision"])
    finally:
        client.close()


def heartbeat_writes(cluster: LocalEtcdCluster, first: int, last: int) -> int:
    """Heartbeats written between revisions ``first`` and ``last`` (both included), from etcd's history: a
    watch from ``first`` replays every write since (read after the run's figures: its events are not in them)."""
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, allow_insecure=not cluster.tls)
    root = b"/lightning-recover/"
    beats = 0
    try:
        for event in client.watch(root, first, timeout=10.0, range_end=prefix_end(root)):
            kv = event.get("kv") or {}
            at = int(kv.get("mod_revision") or 0)
            beats += at <= last and event.get("type", "PUT") == "PUT" and b"/hb/" in unb64(kv.get("key"))
            if at >= last:  # the run's last write (its job's keys deleted): nothing later is the run's
                break
    finally:
        client.close()
    return beats


def cluster_idle_cores(cluster: LocalEtcdCluster, seconds: float = 3.0) -> float:
    """The members' CPU (in cores) while nothing uses the cluster."""
    cpu, began = members_cpu_seconds(cluster), time.monotonic()
    time.sleep(seconds)
    return (members_cpu_seconds(cluster) - cpu) / (time.monotonic() - began)


def bare_failover(cluster: LocalEtcdCluster) -> float:
    """The longest gap between two puts of a client writing in a loop through a follower while the
    leader is SIGKILLed (then restarted)."""
    leader = cluster.leader()
    follower_first = [e for i, e in enumerate(cluster.endpoints) if i != leader] + [cluster.endpoints[leader]]
    client = EtcdClient(follower_first, **cluster.tls_files, allow_insecure=not cluster.tls, timeout=10)
    done: list[float] = []
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            client.put(b"/bench/failover", str(len(done)).encode())
            done.append(time.monotonic())

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.5)
    killed = time.monotonic()
    cluster.kill(leader)
    time.sleep(2.5)
    stop.set()
    writer.join()
    client.close()
    cluster.restart(leader)
    return max(b - a for a, b in zip(done, done[1:]) if b > killed)


def _wait_for_step(
    cluster: LocalEtcdCluster, job: str, step: int, proc: subprocess.Popen, timeout: float = 300
) -> None:
    """Until the keys of ``step`` (or a later one) are in etcd: the fault lands mid-training. (Not the
    heartbeats: while each step's commit vouches for the replicas, they write none.)"""
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, allow_insecure=not cluster.tls)
    deadline = time.monotonic() + timeout
    prefix = f"/lightning-recover/{job}/kv/s".encode()
    while time.monotonic() < deadline and proc.poll() is None:
        kvs = client.range(prefix, prefix_end(prefix), keys_only=True).get("kvs") or []
        seen = [int(m.group(1)) for kv in kvs if (m := _STEP_KEY.match(unb64(kv["key"])[len(prefix) :]))]
        if seen and max(seen) >= step:
            break
        time.sleep(0.05)
    client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--leader-kills", type=int, default=2)
    p.add_argument("--election-ms", type=int, default=DEFAULT_ELECTION_MS)
    p.add_argument("--layers", type=int, default=MODEL["layers"], help="TinyGPT layers (a longer step)")
    p.add_argument("--width", type=int, default=MODEL["width"], help="TinyGPT width (a longer step)")
    p.add_argument("--dir", default=None)
    p.add_argument(
        "--parts", default="overhead,kill,leader,failover", help="which measurements (load comes with overhead)"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    MODEL.update(layers=args.layers, width=args.width)
    result = measure(args)
    print(json.dumps(result, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
