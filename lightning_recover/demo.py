"""``lightning-recover demo``: resilient training of a small GPT with injected failures.

    python -m lightning_recover.cli demo                  # what ``make demo`` runs
    python -m lightning_recover.cli demo --steps 60 --inject "kill:replica=3:step=5:phase=forward"

Trains TinyGPT (byte level) on the Python standard library's own source, a real corpus present on
every machine, with 4 replicas on CPU under ``Fabric(strategy="recover")``. By default two
replicas are lost at different steps: replica 2 is SIGKILLed during its backward pass at step 12,
and replica 0 (the one drawing the progress bar) is frozen with SIGSTOP just before the gradient
all-reduce of step 27, so only the heartbeat threshold can reveal it (another ``--replicas`` or
``--steps`` moves the default plan with them: :func:`default_faults`). The survivors recompute
the lost microbatches inside the same step and keep going; the lowest live replica takes over the
progress bar.

Afterwards the same steps are replayed failure-free in this process (the same model, seed and
microbatches, summed in one process) as the reference, on one core: every microbatch the replicas
shared, so it takes about as long as the training. It is saved as ``OUT/reference-KEY.pt`` and reused
by a later run whose configuration, code and torch are the same (:func:`reference_key`); ``--replicas``,
``--inject`` and the timing options are not part of the key. A summary compares the two: steps,
failures survived, time to recover, recomputed microbatches, final loss and the largest relative
parameter difference, effective throughput.

The demo trains in float64 (``precision="64-true"``) by default. Recovery changes only the order in
which microbatch gradients are summed; in float64 that rounding stays around 1e-15, so the final
parameters match the reference to far better than 1e-5. In float32 (``--precision 32-true``) the same
rounding (~1e-7) is amplified by Adam in parameters whose gradient is mathematically zero (the
attention key bias: softmax ignores a per-query constant), so a few tensors differ by ~1e-2
relative while the losses agree to 4 decimals; that is rounding noise, not a different trajectory. ``OUT/demo.png`` plots loss per step (run and
reference) and live replicas over time; ``OUT/summary.json`` holds the numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any

from lightning_recover import env
from lightning_recover.optional import plotting_available

DEFAULT_INJECT = "kill:replica=2:step=12:phase=backward,hang:replica=0:step=27:phase=reduce"  # 4 replicas, 40 steps


def default_faults(replicas: int, steps: int) -> str:
    """The demo's fault plan when ``--inject`` is not given, fitted to the job: one replica SIGKILLed in its
    backward pass 30 % into the run, and (with 3 replicas or more) replica 0, the one drawing the progress
    bar, hung before the all-reduce two thirds in. One survivor at least; with 1 replica, or too few steps
    to fail in, no fault: there would be nobody left to recover, or nothing to recover into.

    Args:
        replicas: the job's replica count.
        steps: the steps the demo runs.

    Returns:
        The plan in ``--inject``'s form ('' for none).
    """
    kill_step, hang_step = steps * 3 // 10, steps * 27 // 40
    if replicas < 2 or kill_step < 1:
        return ""
    kill = f"kill:replica={min(2, replicas - 1)}:step={kill_step}:phase=backward"
    if replicas < 3 or hang_step <= kill_step:
        return kill
    return f"{kill},hang:replica=0:step={hang_step}:phase=reduce"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=4, help="data-parallel replicas (processes, at least 1)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--microbatches", type=int, default=8, help="M, global microbatches per step")
    p.add_argument("--batch-size", type=int, default=8, help="samples per microbatch")
    p.add_argument("--block-size", type=int, default=64, help="context length in bytes")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--width", type=int, default=128, help="embedding width")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of stdlib source to train on")
    p.add_argument(
        "--inject",
        default=None,
        help="faults, KIND:replica=R:step=S:phase=P[,...] ('' for none); default: one replica killed 30%% into "
        "the run and replica 0 hung at two thirds (with 4 replicas and 40 steps: "
        f"{DEFAULT_INJECT}); with 2 replicas only the kill, with 1 no fault",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=1.5,
        help="seconds without heartbeat before a (hung) replica is declared dead",
    )
    p.add_argument(
        "--out", default="demo_out", help="directory for demo.png, summary.json, logs and the reference it reuses"
    )
    p.add_argument("--no-reference", action="store_true", help="skip the failure-free reference replay")
    p.add_argument("--no-plot", action="store_true", help="do not write demo.png")
    p.add_argument(
        "--precision",
        choices=["64-true", "32-true"],
        default="64-true",
        help="Lightning precision; 64-true (default) makes the comparison with the reference exact "
        "up to summation order (see the module docstring)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model and of the microbatch order")
    p.add_argument(
        "--exact",
        action="store_true",
        help="RecoverStrategy(exact=True): every step bitwise independent of failures and replica count; the "
        "reference replays exact mode in one process, so the final difference is 0",
    )


# ---------------------------------------------------------------------------- the model (shared)


def _build(args: argparse.Namespace):
    from lightning_recover.tiny_gpt import build

    return build(args)


# ---------------------------------------------------------------------------- inside a replica


def _worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_recover import RecoverStrategy

    data, model, optimizer = _build(args)
    strategy = RecoverStrategy(
        microbatches=args.microbatches,
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_interval=None if args.heartbeat_timeout >= 0.5 else args.heartbeat_timeout / 5,
        seed=args.seed,
        exact=args.exact,
    )
    fabric = L.Fabric(strategy=strategy, devices=args.replicas, accelerator="cpu", precision=args.precision)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    protocol_replica = fabric.strategy.protocol_replica
    replica = fabric.strategy.replica
    os.makedirs(args.out, exist_ok=True)

    # Note the wall-clock time of this replica's own injected faults (for "fault -> commit" times).
    def record_fault(fault: Any, when: float) -> None:
        with open(os.path.join(args.out, f"fault-{fault.kind}-r{replica}-s{fault.step}.json"), "w") as f:
            json.dump({"kind": fault.kind, "replica": replica, "step": fault.step, "phase": fault.phase, "t": when}, f)

    protocol_replica.on_fault(record_fault)

    log = open(os.path.join(args.out, f"replica{replica}.jsonl"), "w")
    bar = None
    first_start = None
    for step in fabric.strategy.steps(loader, max_steps=args.steps):
        start = time.perf_counter()
        first_start = first_start or time.time()
        for x, y in step:
            fabric.backward(model.loss(x, y))
        optimizer.step()
        optimizer.zero_grad()
        s = step.stats
        rec = {
            "step": step.index,
            "seconds": time.perf_counter() - start,
            "committed_at": time.time(),
            "loss": s.loss,
            "live": s.live_replicas,
            "generation": s.generation,
            "computed": s.computed,
            "recomputed": s.recomputed,
            "recoveries": s.recoveries,
            "recovery_seconds": s.recovery_seconds,
            "leader": s.leader,
            "events": s.events,
        }
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if s.leader:  # the lowest live replica draws the progress bar
            bar = _progress(bar, step.index, args, replica, first_start)
            for event in s.events:
                if event["kind"] == "regroup":
                    bar.write(
                        f"[demo] step {step.index}: generation {event['generation']} = replicas "
                        f"{event['members']}; {event['lost']} lost microbatches recomputed inside the step "
                        f"(recovery {s.recovery_seconds:.2f}s)"
                    )
            bar.set_postfix_str(
                f"loss={s.loss:.3f}, live={s.live_replicas}/{args.replicas}, gen={s.generation}", refresh=False
            )
            bar.update(1)
    if bar is not None:
        bar.close()
    log.close()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, os.path.join(args.out, f"replica{replica}.pt"))


def _progress(bar: Any, index: int, args: argparse.Namespace, replica: int, first_start: float) -> Any:
    """A Lightning-style tqdm bar, drawn by the lowest live replica (created when it becomes that)."""
    from tqdm import tqdm

    if bar is None:  # first step led by this replica (start, or after the leader was lost)
        if index > 0:
            print(
                f"\n[demo] replica {replica} is now the lowest live replica and draws the progress bar",
                file=sys.stderr,
                flush=True,
            )
        bar = tqdm(
            total=args.steps,
            desc=f"Training (replica {replica})",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0,
            smoothing=0,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
        )
        bar.start_t = first_start  # elapsed and rate count from the first step, as for the old leader
        bar.n = bar.last_print_n = index
    return bar


# ---------------------------------------------------------------------------- the failure-free reference


def reference_run(args: argparse.Namespace, progress: bool = True) -> tuple[list[float], dict]:
    """Replay the same steps without failures in this process: per-step losses and final state.

    Each step sums the gradients of the same ``M`` microbatches (same seeded permutation as the
    replicas read) and divides by ``M``, exactly what a committed step of ``strategy="recover"`` applies.
    """
    import torch

    from lightning_recover.data import MicrobatchSource

    # The replicas' thread count (the launcher starts them with OMP_NUM_THREADS=1): exact mode needs it to be
    # bitwise, and for these small matrices more threads spin more than they compute on a busy machine.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data, model, optimizer = _build(args)
    if args.precision == "64-true":
        model.double()  # in place: the optimizer keeps the same parameters
    source = MicrobatchSource(data, args.batch_size, args.microbatches, shuffle=True, seed=args.seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=args.steps,
            desc="Reference (failure-free, 1 process)",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
        )
    losses = []
    accumulator = None
    if args.exact:  # the replicas' fixed-point step, in one process (protocol/exact.py)
        from lightning_recover.protocol.exact import ExactAccumulator

        accumulator = ExactAccumulator(args.microbatches)
    for s in range(args.steps):
        optimizer.zero_grad()
        total = 0.0
        if accumulator is not None:
            total = _exact_step(accumulator, model, source, s) * args.microbatches
        for j in range(args.microbatches if accumulator is None else 0):
            x, y = source.batch(s, j)
            loss = model.loss(x, y)
            loss.backward()
            total += loss.item()
        for p in model.parameters():
            if p.grad is not None and accumulator is None:
                p.grad /= args.microbatches
        optimizer.step()
        losses.append(total / args.microbatches)
        if bar is not None:
            bar.set_postfix_str(f"loss={losses[-1]:.3f}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


#: What the reference's result depends on besides the arguments: its code and the versions that compute it.
_REFERENCE_SOURCES = ("demo.py", "tiny_gpt.py", "data.py", os.path.join("protocol", "exact.py"))
#: The arguments that change the reference (not --replicas, --inject or --heartbeat-timeout: that is the point).
_REFERENCE_ARGS = (
    "steps",
    "microbatches",
    "batch_size",
    "block_size",
    "layers",
    "width",
    "lr",
    "corpus_bytes",
    "precision",
    "seed",
    "exact",
)


def reference_key(args: argparse.Namespace) -> str:
    """A digest of everything the failure-free reference depends on: the same key, the same losses and state.

    Args:
        args: the demo's arguments (only those in ``_REFERENCE_ARGS`` count).

    Returns:
        16 hex digits.
    """
    import torch

    package = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256(json.dumps({k: getattr(args, k) for k in _REFERENCE_ARGS}, sort_keys=True).encode())
    digest.update(f"{torch.__version__} {sys.version}".encode())  # the corpus is this Python's own source
    for name in _REFERENCE_SOURCES:
        with open(os.path.join(package, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def cached_reference(args: argparse.Namespace, train_seconds: float) -> tuple[list[float], dict]:
    """The failure-free reference: read from ``OUT/reference-KEY.pt`` when an earlier run of the same
    configuration wrote it (:func:`reference_key`), else replayed (:func:`reference_run`) and written there.
    Says which, and what a replay cost against the training it checks.

    Args:
        args: the demo's arguments.
        train_seconds: how long the training took, said beside the replay's time.

    Returns:
        The reference's per-step losses and final state dict.
    """
    import torch

    path = os.path.join(args.out, f"reference-{reference_key(args)}.pt")
    if os.path.exists(path):
        saved = torch.load(path, map_location="cpu", weights_only=True)
        print(
            f"[demo] failure-free reference: reused {path}, replayed by an earlier run of the same configuration "
            "(delete it to replay)",
            flush=True,
        )
        return saved["losses"], saved["state"]
    print(
        f"[demo] failure-free reference: replaying the {args.steps} steps in one process (all "
        f"{args.steps * args.microbatches} microbatches on one core, where the training spread them over "
        f"{args.replicas} replicas)",
        flush=True,
    )
    started = time.perf_counter()
    losses, state = reference_run(args)
    took = time.perf_counter() - started
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save({"losses": losses, "state": state}, tmp)
    os.replace(tmp, path)  # whole or absent: a later run never reads half a reference
    print(
        f"[demo] failure-free reference: {took:.1f}s (the training: {train_seconds:.1f}s); saved as {path}, reused "
        "by the next run of the same configuration",
        flush=True,
    )
    return losses, state


def _exact_step(accumulator, model, source, step: int) -> float:
    from lightning_recover.protocol.exact import exact_step_alone

    def backward(j: int):
        loss = model.loss(*source.batch(step, j))
        loss.backward()
        return loss

    return exact_step_alone(accumulator, [p for p in model.parameters() if p.requires_grad], backward)


def max_relative_difference(state: dict, reference: dict) -> float:
    worst = 0.0
    for key, ref in reference.items():
        diff = (state[key].double() - ref.double()).abs().max().item()
        worst = max(worst, diff / max(ref.double().abs().max().item(), 1e-12))
    return worst


# ---------------------------------------------------------------------------- the parent


def _load_records(out: str) -> dict[int, list[dict]]:
    records = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("replica") and name.endswith(".jsonl"):
            with open(os.path.join(out, name)) as f:
                records[int(name[7:-6])] = [json.loads(line) for line in f if line.strip()]
    return records


def _load_faults(out: str) -> list[dict]:
    faults = []
    for name in os.listdir(out):
        if name.startswith("fault-") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                faults.append(json.load(f))
    return sorted(faults, key=lambda f: f["t"])


def summarize(
    args: argparse.Namespace,
    records: dict[int, list[dict]],
    faults: list[dict],
    events: list[tuple[float, str]],
    ref_losses: list[float] | None,
    ref_diff: float | None,
) -> dict:
    """Merge every replica's per-step records into one view of the run, plus the reference."""
    steps: dict[int, dict] = {}
    for replica, recs in records.items():
        for r in recs:
            st = steps.setdefault(
                r["step"],
                {
                    "step": r["step"],
                    "loss": r["loss"],
                    "live": r["live"],
                    "generation": r["generation"],
                    "recomputed": 0,
                    "recovery_seconds": 0.0,
                    "recovery_seconds_by_replica": {},
                    "committed_at": 0.0,
                    "started_at": 1e300,
                },
            )
            st["recomputed"] += r["recomputed"]
            # Each survivor times its own recovery (the leader prints its time as it happens); the step's
            # recovery_seconds is the slowest survivor's, the one the step waited for.
            st["recovery_seconds"] = max(st["recovery_seconds"], r["recovery_seconds"])
            if r["recovery_seconds"]:
                st["recovery_seconds_by_replica"][int(replica)] = r["recovery_seconds"]
            st["committed_at"] = max(st["committed_at"], r["committed_at"])
            st["started_at"] = min(st["started_at"], r["committed_at"] - r["seconds"])
    rows = [steps[s] for s in sorted(steps)]
    if not rows:
        raise RuntimeError(f"no replica recorded a committed step (see the output above and {args.out})")
    t_start, t_end = rows[0]["started_at"], rows[-1]["committed_at"]
    wall = t_end - t_start
    committed = len(rows) * args.microbatches
    first_fault_step = min((f["step"] for f in faults), default=len(rows))
    clean = [r["committed_at"] - r["started_at"] for r in rows[1:first_fault_step]] or [wall / len(rows)]
    clean_step = statistics.median(clean)
    failures = []
    for f in faults:
        row = steps.get(f["step"])
        after = [r["committed_at"] for r in rows if r["committed_at"] > f["t"]]
        failures.append(
            {
                **f,
                "fault_to_commit_s": (min(after) - f["t"]) if after else None,
                "step_seconds": (row["committed_at"] - row["started_at"]) if row else None,
                "recovery_seconds": row["recovery_seconds"] if row else None,  # the slowest survivor's
                "recovery_seconds_by_replica": row["recovery_seconds_by_replica"] if row else None,
                "recomputed": row["recomputed"] if row else None,
                "live_after": row["live"] if row else None,
            }
        )
    summary = {
        "replicas": args.replicas,
        "steps_committed": len(rows),
        "steps": args.steps,
        "microbatches_per_step": args.microbatches,
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "inject": args.inject,
        "heartbeat_timeout": args.heartbeat_timeout,
        "failures": failures,
        "failures_survived": len(failures) if len(rows) == args.steps else None,
        "recomputed_microbatches": sum(r["recomputed"] for r in rows),
        "final_live_replicas": rows[-1]["live"],
        "train_seconds": wall,
        "effective_microbatches_per_s": committed / wall,
        "effective_tokens_per_s": committed * args.batch_size * args.block_size / wall,
        "failure_free_step_seconds": clean_step,
        "failure_free_microbatches_per_s": args.microbatches / clean_step,
        "final_loss": rows[-1]["loss"],
        "reference_final_loss": ref_losses[-1] if ref_losses else None,
        "max_relative_param_difference": ref_diff,
        "losses": [r["loss"] for r in rows],
        "reference_losses": ref_losses,
        "live_timeline": [(r["committed_at"] - t_start, r["live"]) for r in rows],
        "fault_times": [f["t"] - t_start for f in faults],
        "launcher_events": [(t - t_start, line) for t, line in events],
    }
    return summary


def _print_summary(s: dict, out: str, plot: str | None) -> None:
    line = "=" * 78
    print(line)
    print(
        f"Summary: {s['steps_committed']}/{s['steps']} steps committed, {s['microbatches_per_step']} "
        f"microbatches x {s['batch_size']} samples x {s['block_size']} bytes per step"
    )
    print(
        f"  failures survived     : {len(s['failures'])} "
        f"(replicas live at the end: {s['final_live_replicas']}/{s['replicas']})"
    )
    for f in s["failures"]:
        how = "SIGKILL" if f["kind"] == "kill" else ("SIGSTOP (hung)" if f["kind"] == "hang" else f["kind"])
        ftc = f"{f['fault_to_commit_s']:.2f}s" if f["fault_to_commit_s"] is not None else "n/a"
        print(
            f"    step {f['step']:3d}: replica {f['replica']} {how} in {f['phase']}: the step committed {ftc} after "
            f"the fault (a clean step: {s['failure_free_step_seconds']:.2f}s)"
        )
        if f["recovery_seconds"]:
            each = ", ".join(f"{r} {t:.2f}s" for r, t in sorted(f["recovery_seconds_by_replica"].items()))
            print(f"              recovery {f['recovery_seconds']:.2f}s, the slowest survivor's (replica {each})")
        print(f"              {f['recomputed']} microbatches recomputed, {f['live_after']} replicas live after it")
    print(f"  recomputed microbatches: {s['recomputed_microbatches']} (nothing a survivor had computed was redone)")
    ref = s["reference_final_loss"]
    print(
        f"  final loss            : {s['final_loss']:.4f}   failure-free reference: "
        + (f"{ref:.4f}" if ref is not None else "skipped")
    )
    if s["max_relative_param_difference"] is not None:
        ok = "same trajectory" if s["max_relative_param_difference"] <= 1e-5 else "DIVERGED"
        print(f"  parameters vs reference: max relative difference {s['max_relative_param_difference']:.2e} ({ok})")
    print(
        f"  effective throughput  : {s['effective_microbatches_per_s']:.1f} microbatches/s "
        f"({s['effective_tokens_per_s']:.0f} tokens/s) over {s['train_seconds']:.1f}s of training"
    )
    print(
        f"                          failure-free with {s['replicas']} replicas: "
        f"{s['failure_free_microbatches_per_s']:.1f} microbatches/s"
    )
    print(f"  outputs               : {os.path.join(out, 'summary.json')}" + (f", {plot}" if plot else ""))
    print(line)


def plot(summary: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    losses = summary["losses"]
    if summary["reference_losses"]:
        ax1.plot(
            range(len(summary["reference_losses"])),
            summary["reference_losses"],
            "-",
            color="0.6",
            lw=3,
            label="failure-free reference",
        )
    ax1.plot(range(len(losses)), losses, "o", ms=3.5, color="C0", label="with failures (strategy='recover')")
    for f in summary["failures"]:
        ax1.axvline(f["step"], color="C3", ls="--", lw=1)
        ax1.annotate(
            f"{f['kind']} replica {f['replica']}",
            (f["step"], max(losses)),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="C3",
        )
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss (bytes, cross-entropy)")
    ax1.set_title("TinyGPT on the Python stdlib source: loss per step")
    ax1.legend()
    end = summary["live_timeline"][-1][0] if summary["live_timeline"] else 0.0
    times, live = [0.0], [summary["replicas"]]
    for t, f in zip(summary["fault_times"], summary["failures"]):  # a replica is gone from its fault on
        times.append(t)
        live.append(f["live_after"] if f["live_after"] is not None else live[-1] - 1)
    times.append(end)
    live.append(live[-1])
    ax2.step(times, live, where="post", color="C3", label="live replicas")
    ax2.set_ylim(0, summary["replicas"] + 0.5)
    ax2.set_yticks(range(summary["replicas"] + 1))
    ax2.set_xlabel("seconds since the first step started (dashed: injected faults)")
    ax2.set_ylabel("live replicas", color="C3")
    for t in summary["fault_times"]:
        ax2.axvline(t, color="C3", ls="--", lw=1)
    ax3 = ax2.twinx()
    ax3.plot(
        [0.0] + [t for t, _ in summary["live_timeline"]],
        range(len(summary["live_timeline"]) + 1),
        ".-",
        color="C0",
        ms=3,
        label="committed steps",
    )
    ax3.set_ylabel("committed steps", color="C0")
    ax2.set_title("live replicas and progress over time")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def check_shape(args: argparse.Namespace) -> None:
    """The job's shape, refused in one line with a HINT before anything starts.

    Raises:
        SystemExit: with the message, when a count is out of range.
    """
    if args.replicas < 1:
        raise SystemExit(
            f"lightning-recover demo: --replicas must be at least 1, got {args.replicas}. HINT: e.g. --replicas 4"
        )
    if args.steps < 1:
        raise SystemExit(f"lightning-recover demo: --steps must be at least 1, got {args.steps}. HINT: e.g. --steps 40")
    if args.microbatches < args.replicas:
        raise SystemExit(
            f"lightning-recover demo: --microbatches ({args.microbatches}) is smaller than --replicas "
            f"({args.replicas}): some replica would have nothing to compute. HINT: pass --microbatches "
            f"{args.replicas} or more"
        )


def main(args: argparse.Namespace) -> int:
    check_shape(args)  # before the imports below (torch): a wrong count is refused at once
    from lightning_recover.launch import supervisor
    from lightning_recover.protocol.faults import check_plan

    if args.inject is None:  # the plan the user did not write fits the job's shape
        args.inject = default_faults(args.replicas, args.steps)
    try:  # a bad schedule fails here, in one line, before anything starts
        faults = check_plan(args.inject, args.replicas)
    except ValueError as exc:
        raise SystemExit(f"lightning-recover demo: {exc}") from None
    for f in faults:
        if f.step >= args.steps:
            raise SystemExit(
                f"lightning-recover demo: fault {f} names step {f.step}, but the demo runs steps 0..{args.steps - 1}. "
                f"HINT: name a step below {args.steps}, or pass --steps {f.step + 1} or more."
            )
    if len({f.replica for f in faults}) >= args.replicas:
        raise SystemExit(
            "lightning-recover demo: the schedule kills every replica. HINT: leave at least one replica without a fault."
        )
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):
        if name.startswith(("replica", "fault-")):
            os.remove(os.path.join(args.out, name))

    from lightning_recover.tiny_gpt import GPTConfig, TinyGPT, param_count

    n_params = param_count(TinyGPT(GPTConfig(block_size=args.block_size, n_layer=args.layers, n_embd=args.width)))
    print(
        f"[demo] TinyGPT ({n_params / 1e6:.2f}M parameters) on {args.corpus_bytes / 1e6:.1f} MB of the Python "
        f"standard library's source; {args.replicas} replicas on CPU, {args.steps} steps of "
        f"{args.microbatches} microbatches",
        flush=True,
    )
    print(
        f"[demo] injected faults: {', '.join(map(str, faults)) or 'none'} (heartbeat timeout "
        f"{args.heartbeat_timeout}s)",
        flush=True,
    )
    print(
        "[demo] starting the replicas (each imports torch and Lightning: this takes a while on a small machine)",
        flush=True,
    )
    events: list[tuple[float, str]] = []

    def on_event(line: str) -> None:
        events.append((time.time(), line))
        print(f"[lightning-recover] {line}", file=sys.stderr, flush=True)

    worker_args = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    train_started = time.monotonic()
    try:
        code = supervisor.supervise(
            [sys.executable, "-m", "lightning_recover.demo"],
            args.replicas,
            heartbeat_timeout=args.heartbeat_timeout,
            inject=args.inject or None,
            extra_env={env.DEMO_ARGS: json.dumps(worker_args)},
            on_event=on_event,
        )
    except TimeoutError as exc:  # the coordinator's start (it imports torch) outlasted its bound: nothing trained
        raise SystemExit(
            f"lightning-recover demo: {exc}. HINT: the machine is too busy to start the job's processes in time; "
            "run it again when it is quieter"
        ) from None
    records = _load_records(args.out)
    if code != 0 or not records:
        print(
            f"[demo] the resilient run failed (exit code {code}); logs above, partial records in {args.out}",
            file=sys.stderr,
        )
        return 1
    ref_losses = ref_diff = None
    if not args.no_reference:
        import torch

        ref_losses, ref_state = cached_reference(args, time.monotonic() - train_started)
        finals = sorted(f for f in os.listdir(args.out) if f.startswith("replica") and f.endswith(".pt"))
        if finals:
            ref_diff = max(max_relative_difference(torch.load(os.path.join(args.out, f)), ref_state) for f in finals)
    summary = summarize(args, records, _load_faults(args.out), events, ref_losses, ref_diff)
    draw = not args.no_plot and plotting_available("the picture (demo.png)")
    png = plot(summary, os.path.join(args.out, "demo.png")) if draw else None
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    _print_summary(summary, args.out, png)
    if ref_diff is not None and ref_diff > 1e-5:
        return 1
    return 0


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-recover demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    if env.DEMO_ARGS in os.environ and env.in_replica():
        _worker(argparse.Namespace(**json.loads(os.environ[env.DEMO_ARGS])))
    else:
        sys.exit(cli())
