"""Asynchronous checkpoint benchmark: how long training is blocked, and how long until the save is durable.

``python -m lightning_recover.bench.async_checkpoint --size-gb 2 --json FILE``

Methods, all on the same GPT-like Lightning-shaped state (``gpt_state.build_checkpoint``):

* ``uring-async``     -- ``AsyncUringCheckpointIO()`` (lazy snapshot into a reused staging buffer)
* ``lightning-async`` -- Lightning's ``AsyncCheckpointIO`` wrapping ``TorchCheckpointIO`` (clones in the caller),
  the inner save followed by an fsync of the file and its directory (so it is measured to durability)
* ``dcp-async``       -- ``torch.distributed.checkpoint.async_save(..., no_dist=True)`` with a
  ``FileSystemWriter`` (which fsyncs its files), followed by an fsync of the directory tree
* ``uring-sync``      -- synchronous ``UringCheckpointIO`` (the reference for "time until durable")

Protocol per save: the save call, then ``--steps`` simulated training steps. A step is a "forward/backward" of
fixed compute (matmuls on separate tensors, calibrated to ``--fwd-s`` seconds) followed by an optimizer step
(``torch.optim.SGD`` over the state's parameters, in place, with preset gradients). For ``uring-async`` the step
first waits for the snapshot (that is what the automatic optimizer-step guard does; timed explicitly here).

* ``blocked_s``: save call + time the steps waited for the snapshot (the training thread's loss),
* ``durable_s``: save call start until the checkpoint is durable (fdatasync'ed and renamed / fsync'ed),
* ``step_s``: mean step time of the steps following the save (a flush running in the background), against
  ``baseline_step_s``: the mean of as many steps with no checkpoint activity right before that save; their ratio
  (``step_ratio``, median over repetitions) is what the flush costs the training (target <= 1.05x).

With ``--restore``, cold restores (page cache dropped) are also measured: this project's plugin (fresh tensors),
``load(into=...)`` into a preallocated state (the in-place resume path), ``torch.load``, safetensors and DCP
(into a preallocated state), reusing the methods of ``lightning_recover.bench.checkpoint``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Optional

import torch

from lightning_recover.bench.checkpoint import drop_caches_supported, fsync_tree, make_cold, touch_pages
from lightning_recover.bench.gpt_state import build_checkpoint, tensor_stats

ALL_METHODS = ["uring-async", "lightning-async", "dcp-async", "uring-sync"]
EXTRA_METHODS = ["uring-async-paced", "fio-write"]  # on request: --methods ... (--flush-mbps for the paced one)
FIO_WRITE_DEPTH = 2  # fio-write's queue depth: the engine's default, 2 writes of 16 MiB in flight as fio's blocks


# ------------------------------------------------------------------------------------ simulated training


class Trainer:
    """Simulated training steps on the checkpoint's own parameters (so the saves race real mutation)."""

    def __init__(self, checkpoint: dict, fwd_s: float, lr: float = 1e-3) -> None:
        self.params = [torch.nn.Parameter(t, requires_grad=True) for t in checkpoint["state_dict"].values()]
        for p in self.params:
            p.grad = torch.full_like(p, 1e-6)
        self.opt = torch.optim.SGD(self.params, lr=lr)
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(768, 768, generator=g)
        self.b = torch.randn(768, 768, generator=g)
        self.n = 1
        self._time_fwd(4)  # warm up
        t = self._time_fwd(20)
        self.n = max(1, round(fwd_s / max(t / 20, 1e-6)))

    def _time_fwd(self, n: int) -> float:
        old, self.n = self.n, n
        t0 = time.perf_counter()
        self.fwd_bwd()
        self.n = old
        return time.perf_counter() - t0

    def fwd_bwd(self) -> None:
        x = self.a
        for _ in range(self.n):
            x = torch.tanh(x @ self.b)
        float(x[0, 0])

    def step(self, guard: Optional[Callable[[], float]] = None) -> tuple[float, float]:
        """One training step; returns (step seconds, seconds waited in ``guard``)."""
        t0 = time.perf_counter()
        self.fwd_bwd()
        waited = guard() if guard is not None else 0.0
        self.opt.step()
        return time.perf_counter() - t0, waited


# ---------------------------------------------------------------------------------------------- methods


class _FsyncTorchIO:
    """TorchCheckpointIO + fsync of file and directory; records when the save became durable."""

    def __new__(cls):  # build lazily so importing this module does not import lightning.pytorch
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        class FsyncTorchIO(TorchCheckpointIO):
            t_done: Optional[float] = None

            def save_checkpoint(self, checkpoint, path, storage_options=None):
                super().save_checkpoint(checkpoint, path, storage_options)
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                fd = os.open(os.path.dirname(path), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self.t_done = time.perf_counter()

        return FsyncTorchIO()


def run_one(method: str, checkpoint: dict, trainer: Trainer, workdir: str, steps: int, state: dict) -> dict:
    """One save with ``method`` followed by ``steps`` training steps; returns the measurements."""
    os.makedirs(workdir, exist_ok=True)
    guard = None
    cpu0, steal0 = process_cpu_s(), steal_s()
    finish: Callable[[], float]
    if method in ("uring-async", "uring-async-paced"):
        from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO

        rate = state["flush_bytes_per_s"] if method == "uring-async-paced" else None
        io = state.setdefault(method, AsyncUringCheckpointIO(flush_bytes_per_s=rate))
        target = os.path.join(workdir, "last.ckpt")
        t0 = time.perf_counter()
        io.save_checkpoint(checkpoint, target)
        t_call = time.perf_counter() - t0
        guard = io.wait_for_snapshot

        def finish() -> float:
            io.wait_until_durable()
            return io.history[-1]["t_durable"] - t0
    elif method == "fio-write":
        # the device's own cost to the steps: fio writes the checkpoint's bytes (O_DIRECT, 16 MiB blocks, fsync
        # at the end) in another process, using next to no CPU, while the same steps run
        from lightning_recover.bench import fio

        target = os.path.join(workdir, "fio.bin")
        # on huge pages where reserved, as the saver's ring is: from plain pages fio's requests are split smaller
        iomem = state.setdefault("fio_iomem", fio.huge_iomem(FIO_WRITE_DEPTH * fio.BLOCK))
        t0 = time.perf_counter()
        proc = fio.start_write(target, state["payload_bytes"], FIO_WRITE_DEPTH, iomem)
        t_call = time.perf_counter() - t0

        def finish() -> float:
            fio.wait(proc)
            return time.perf_counter() - t0
    elif method == "uring-sync":
        from lightning_recover.lightning.checkpoint_io import UringCheckpointIO

        io = state.setdefault("uring-sync", UringCheckpointIO())
        target = os.path.join(workdir, "last.ckpt")
        t0 = time.perf_counter()
        io.save_checkpoint(checkpoint, target)
        t_call = time.perf_counter() - t0

        def finish() -> float:
            return t_call
    elif method == "lightning-async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        inner = _FsyncTorchIO()
        io = AsyncCheckpointIO(inner)
        target = os.path.join(workdir, "last.ckpt")
        t0 = time.perf_counter()
        io.save_checkpoint(checkpoint, target)
        t_call = time.perf_counter() - t0

        def finish() -> float:
            io.teardown()
            return inner.t_done - t0
    elif method == "dcp-async":
        import torch.distributed.checkpoint as dcp

        target = os.path.join(workdir, "ckpt.dcp")
        done: dict = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            fut = dcp.async_save(checkpoint, storage_writer=dcp.FileSystemWriter(target), no_dist=True)
            t_call = time.perf_counter() - t0
        fut.add_done_callback(lambda f: done.setdefault("t", time.perf_counter()))

        def finish() -> float:
            fut.result()
            t_fut = done.get("t") or time.perf_counter()
            ts = time.perf_counter()
            fsync_tree(target)
            return (t_fut - t0) + (time.perf_counter() - ts)
    else:
        raise ValueError(f"unknown method {method!r}")

    step_times, waits = [], []
    for _ in range(steps):
        s, w = trainer.step(guard)
        step_times.append(s)
        waits.append(w)
    durable = finish()
    cpu_s = process_cpu_s() - cpu0
    steal = steal_s() - steal0
    return {
        "method": method,
        "call_s": t_call,
        "wait_s": sum(waits),
        "blocked_s": t_call + sum(waits),
        "durable_s": durable,
        "step_s": statistics.mean(step_times) if step_times else 0.0,
        "step_times": step_times,
        "cpu_s": cpu_s,
        "steal_s": steal,
    }


def steal_s() -> float:
    """CPU seconds the hypervisor has taken from this machine's CPUs so far (``/proc/stat`` steal, all CPUs), or
    NaN where there is no such figure. On a VM, the host's work for the guest's disk writes shows up here."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def process_cpu_s() -> float:
    """CPU seconds of this process so far, all threads, user + system (the kernel's I/O work included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ----------------------------------------------------------------------------------------------- restore


def run_restore(checkpoint: dict, root: str, repeat: int) -> list:
    from lightning_recover.bench.checkpoint import DCPMethod, SafetensorsMethod, TorchSaveMethod, UringMethod
    from lightning_recover.checkpoint import load

    class UringInto(UringMethod):
        name = "uring-into"

        def prepare_load(self, target, reference):
            from lightning_recover.bench.checkpoint import alloc_like

            return alloc_like(reference)

        def load(self, target, prepared):
            return load(target, map_location="cpu", into=prepared)

    payload = tensor_stats(checkpoint)["bytes"]
    mode = "drop_caches" if drop_caches_supported() else "fadvise"
    out = []
    for cls in (UringMethod, UringInto, TorchSaveMethod, SafetensorsMethod, DCPMethod):
        impl = cls()
        try:
            impl.setup()
        except Exception as e:  # e.g. safetensors missing
            out.append({"method": cls.name, "error": repr(e)})
            continue
        wd = os.path.join(root, "restore-" + cls.name.replace(".", "_"))
        os.makedirs(wd, exist_ok=True)
        target = impl.save(checkpoint, wd)
        times = []
        for _ in range(repeat):
            prepared = impl.prepare_load(target, checkpoint)
            make_cold(wd, mode)
            t0 = time.perf_counter()
            loaded = impl.load(target, prepared)
            touch_pages(loaded)
            times.append(time.perf_counter() - t0)
            del loaded, prepared
            gc.collect()
        impl.remove(target)
        shutil.rmtree(wd, ignore_errors=True)
        med = statistics.median(times)
        out.append({"method": cls.name, "load_s": med, "gbps": payload / med / 1e9, "runs": times, "cache_mode": mode})
    return out


# -------------------------------------------------------------------------------------------------- main


def run(
    size_gb: float,
    root: str,
    methods: list,
    repeat: int,
    steps: int,
    fwd_s: float,
    restore: bool,
    log: Callable[[str], None] = print,
    flush_mbps: float = 100.0,
) -> dict:
    checkpoint, cfg = build_checkpoint(size_gb)
    stats = tensor_stats(checkpoint)
    log(f"state: {stats['bytes'] / 1e9:.2f} GB in {stats['tensors']} tensors ({cfg})")
    trainer = Trainer(checkpoint, fwd_s)
    baseline = _baseline_step_s(trainer, steps)
    log(f"baseline step (no checkpoint activity): {baseline:.3f} s (fwd/bwd x{trainer.n} matmuls)")
    state: dict = {"flush_bytes_per_s": flush_mbps * 1e6, "payload_bytes": stats["bytes"]}
    records = []
    for m in methods:  # one untimed save per method: first-use costs (staging allocation, thread pools, ...)
        run_one(m, checkpoint, trainer, os.path.join(root, m), 0, state)
        shutil.rmtree(os.path.join(root, m), ignore_errors=True)
    if "fio-write" in methods:
        log(f"fio-write: --iodepth={FIO_WRITE_DEPTH} --iomem={state.get('fio_iomem') or 'malloc'}")
    for r in range(repeat):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for m in order:
            records.append(_run_against_baseline(m, r, checkpoint, trainer, root, steps, state, log))
    for io in state.values():
        if hasattr(io, "teardown"):
            io.teardown()
    summary = _summarize(records, methods)
    result = {
        "size_gb": size_gb,
        "payload_bytes": stats["bytes"],
        "tensors": stats["tensors"],
        "config": str(cfg),
        "fwd_s": fwd_s,
        "steps": steps,
        "repeat": repeat,
        "baseline_step_s": baseline,
        "summary": summary,
        "targets": _targets(summary, steps),
        "records": records,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dir": root,
            "load_avg": os.getloadavg(),
            "fio_write_iodepth": FIO_WRITE_DEPTH,
            "fio_write_iomem": (state.get("fio_iomem") or "malloc") if "fio-write" in methods else None,
        },
    }
    if restore:
        result["restore"] = run_restore(checkpoint, root, repeat)
    return result


def _baseline_step_s(trainer: Trainer, steps: int) -> float:
    """The median step time with no checkpoint activity, after two warm-up steps (first touches of gradients,
    allocator)."""
    for _ in range(2):
        trainer.step()
    return statistics.median([trainer.step()[0] for _ in range(max(3, steps))])


def _run_against_baseline(
    m: str,
    rep: int,
    checkpoint: dict,
    trainer: Trainer,
    root: str,
    steps: int,
    state: dict,
    log: Callable[[str], None],
) -> dict:
    """One measured save with ``m`` (``run_one``), paired with as many steps without checkpoint activity run
    right before it; returns its record with the step and CPU ratios to those steps."""
    wd = os.path.join(root, m)
    os.sync()
    gc.collect()
    # the same steps with no checkpoint activity, right before the save: the pair's baseline (the
    # machine's load drifts between repetitions, so one baseline at the start would not do)
    cpu0, steal0 = process_cpu_s(), steal_s()
    before = [trainer.step()[0] for _ in range(max(1, steps))]
    baseline_cpu, rec_steal = process_cpu_s() - cpu0, steal_s() - steal0
    rec = run_one(m, checkpoint, trainer, wd, steps, state)
    rec["rep"] = rep
    rec["baseline_step_s"] = statistics.mean(before)
    rec["step_ratio"] = rec["step_s"] / rec["baseline_step_s"] if steps else 0.0
    # the step the save was called in (the snapshot copy lands there) and the steps after it (the flush)
    rec["first_step_ratio"] = rec["step_times"][0] / rec["baseline_step_s"] if steps else 0.0
    rec["later_step_ratio"] = statistics.mean(rec["step_times"][1:]) / rec["baseline_step_s"] if steps > 1 else 0.0
    # CPU the save cost the process: from the save call until durable, less the same number of steps
    # without checkpoint activity (the baseline steps just before)
    rec["save_cpu_s"] = rec["cpu_s"] - baseline_cpu
    rec["baseline_steal_s"] = rec_steal  # CPU time the hypervisor took during the steps before
    log(
        f"  rep {rep} {m:16s} blocked {rec['blocked_s']:.3f} s (call {rec['call_s']:.3f} + wait "
        f"{rec['wait_s']:.3f})  durable {rec['durable_s']:.2f} s  step {rec['step_s']:.3f} s "
        f"(x{rec['step_ratio']:.2f}: first x{rec['first_step_ratio']:.2f}, later x{rec['later_step_ratio']:.2f})"
        f"  save CPU {rec['save_cpu_s']:.2f} s  steal {rec['steal_s']:.2f} s (before: {rec_steal:.2f} s)"
    )
    shutil.rmtree(wd, ignore_errors=True)
    return rec


def _summarize(records: list, methods: list) -> dict:
    """Per method, the median over its repetitions of each measurement, and every repetition's step ratio."""
    summary = {}
    for m in methods:
        rs = [x for x in records if x["method"] == m]
        summary[m] = {
            k: statistics.median([x[k] for x in rs])
            for k in (
                "blocked_s",
                "call_s",
                "wait_s",
                "durable_s",
                "step_s",
                "baseline_step_s",
                "step_ratio",
                "first_step_ratio",
                "later_step_ratio",
                "save_cpu_s",
            )
        }
        summary[m]["step_ratios"] = [x["step_ratio"] for x in rs]
        if "fio-write" in methods and m != "fio-write":
            quotients = step_ratios_vs(records, m, "fio-write")
            summary[m]["step_ratios_vs_fio"] = quotients
            summary[m]["step_ratio_vs_fio"] = statistics.median(quotients) if quotients else float("nan")
    return summary


def step_ratios_vs(records: list, method: str, reference: str) -> list:
    """Per repetition, ``method``'s step ratio over ``reference``'s in the same repetition (the methods alternate
    within a repetition, so each quotient compares saves made close together in time), in repetition order."""
    by_rep: dict = {}
    for x in records:
        by_rep.setdefault(x["rep"], {})[x["method"]] = x["step_ratio"]
    return [r[method] / r[reference] for _, r in sorted(by_rep.items()) if method in r and reference in r]


def _targets(summary: dict, steps: int) -> dict:
    """``uring-async`` against the targets: time blocked, the steps during its flush, and time until durable
    against ``uring-sync``'s (empty without a ``uring-async`` run)."""
    sync = summary.get("uring-sync", {}).get("durable_s")
    ours = summary.get("uring-async", {})
    targets = {}
    if ours:
        targets["blocked_le_0.1s"] = ours["blocked_s"] <= 0.1
        if steps:
            targets["step_during_flush_le_1.05x"] = ours["step_ratio"] <= 1.05
            if "step_ratio_vs_fio" in ours:  # the flush costs the step no more than fio writing the same bytes
                targets["step_during_flush_le_fio"] = ours["step_ratio_vs_fio"] <= 1.0
        if sync:
            targets["durable_ratio_vs_sync"] = ours["durable_s"] / sync
            targets["durable_within_1.2x_sync"] = ours["durable_s"] <= 1.2 * sync
    return targets


def format_table(res: dict) -> str:
    lines = [
        "| method | blocked per save (s) | of which waiting at step (s) | durable after (s) | "
        "step after the save (s) | step just before (s) | paired step ratio, median [min-max] | "
        "first step | later steps | save CPU (s) | step ratio / fio's, per rep |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, s in res["summary"].items():
        ratios = s.get("step_ratios") or [0.0]
        vs = s.get("step_ratios_vs_fio")
        vs_fio = f"{s['step_ratio_vs_fio']:.2f} [{min(vs):.2f}-{max(vs):.2f}]" if vs else "-"
        lines.append(
            f"| {m} | {s['blocked_s']:.3f} | {s['wait_s']:.3f} | {s['durable_s']:.2f} | {s['step_s']:.3f} | "
            f"{s['baseline_step_s']:.3f} | {s['step_ratio']:.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] | "
            f"{s['first_step_ratio']:.2f}x | {s['later_step_ratio']:.2f}x | {s['save_cpu_s']:.2f} | {vs_fio} |"
        )
    lines.append(
        f"| (no checkpoint, at the start) | - | - | - | {res['baseline_step_s']:.3f} | - | - | - | - | - | - |"
    )
    if res.get("restore"):
        lines += ["", "| cold restore | seconds | GB/s |", "|---|---|---|"]
        for r in res["restore"]:
            if "error" in r:
                lines.append(f"| {r['method']} | {r['error']} | |")
            else:
                lines.append(f"| {r['method']} | {r['load_s']:.2f} | {r['gbps']:.2f} |")
    return "\n".join(lines)


def build_parser(p: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(
        prog="python -m lightning_recover.bench.async_checkpoint", description=__doc__.split("\n")[0]
    )
    p.add_argument("--size-gb", type=float, default=2.0, help="state size (params + AdamW moments), GB")
    p.add_argument("--dir", default=None, help="directory for the checkpoints (default: a temp dir in /var/tmp)")
    p.add_argument("--methods", default=",".join(ALL_METHODS), help=f"comma list of {ALL_METHODS + EXTRA_METHODS}")
    p.add_argument(
        "--flush-mbps", type=float, default=100.0, help="uring-async-paced: flush_bytes_per_s, in MB/s (1e6 B)"
    )
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="simulated training steps after each save")
    p.add_argument("--fwd-s", type=float, default=0.5, help="compute per simulated forward/backward, seconds")
    p.add_argument("--restore", action="store_true", help="also measure cold restores")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    return p


def main(args: Optional[argparse.Namespace] = None) -> int:
    if args is None:
        args = build_parser().parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ALL_METHODS + EXTRA_METHODS]
    if bad:
        print(f"unknown methods {bad}; choose from {ALL_METHODS + EXTRA_METHODS}", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="lr-async-bench-", dir=args.dir or "/var/tmp")
    try:
        res = run(
            args.size_gb,
            root,
            methods,
            args.repeat,
            args.steps,
            args.fwd_s,
            args.restore,
            log=lambda s: print(s, flush=True),
            flush_mbps=args.flush_mbps,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
