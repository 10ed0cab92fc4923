"""A resume's load as a restarted process makes it, against fio reading the same file (issue 51).

A replica that restarts after a failure is a new process: it builds its model (the model's memory written once)
and loads the last checkpoint, cold. Its pages are new to it, and on a VM whose balloon reports free pages to the
host, new to the host too (``bench/first_touch.py``), which a load repeated inside one process (``bench
checkpoint --paired``) never shows: there the memory of the previous load is reused. Each round, in alternating
order, with the page cache dropped before each:

* ``fresh``: a new interpreter loads the file into new tensors (``single_file.load(path)``);
* ``into``: a new interpreter first writes a state of the file's layout (zeros, as a model has its parameters),
  then loads the file into it (``single_file.load(path, into=state)``, what ``restore_into`` does);
* ``fio_qd{1,4,16}``: fio reading the same bytes (O_DIRECT, io_uring, 16 MiB blocks, hugetlb buffers);

each load with the code of this tree and, given ``--before ROOT`` (a checkout of an earlier commit with its
``native_io`` built), with that tree's code too. Only the load is timed (not the interpreter's start nor the
state's writing). The disk's own counters around each load (``bench/block_device.py``) give the share of the load
during which the device was busy and the pace at which it moved the file's bytes meanwhile, against fio's GB/s
over its own runtime. Run with nothing else running and ``sysctl vm.nr_hugepages=140`` for fio's buffers::

    python -m benchmarks.resume_loads --state small10k --rounds 5 --before /tmp/before --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Optional

from benchmarks.scratch_dir import print_rows, run_in_scratch_dir
from lightning_recover.bench import fio
from lightning_recover.bench.block_device import BlockDevice, parse_stat, usage
from lightning_recover.bench.checkpoint import make_cold
from lightning_recover.bench.gpt_state import STATES, build_state
from lightning_recover.checkpoint.file import single_file

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run by each new interpreter: argv = path, "fresh" | "into", the disk's stat file ("" for none); prints the load's
# seconds and the stat file's text before and after it, as one JSON line.
_CHILD = """
import json, sys, time, torch
from lightning_recover.checkpoint.file import single_file
from lightning_recover.checkpoint.file.state_tensors import tensor_paths
path, how, stat = sys.argv[1], sys.argv[2], sys.argv[3]
def disk():
    if not stat:
        return ""
    with open(stat) as f:
        return f.read()
state = None
if how == "into":
    state = torch.load(path, mmap=True, weights_only=True)
    def written(obj):
        if isinstance(obj, torch.Tensor):
            return torch.zeros_like(obj)
        if isinstance(obj, dict):
            return type(obj)((k, written(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(written(v) for v in obj)
        return obj
    state = written(state)
before = disk()
t = time.perf_counter()
out = single_file.load(path) if state is None else single_file.load(path, into=state)
seconds = time.perf_counter() - t
print(json.dumps({"s": seconds, "before": before, "after": disk()}))
"""


def timed_child(root: str, path: str, how: str, device: BlockDevice) -> tuple[float, dict[str, Any]]:
    """The load's seconds in a new interpreter under ``root``, and what the disk did during it (``{}`` unread)."""
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, path, how, device.stat_path or ""],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode:
        raise RuntimeError(f"the {how} load under {root} failed: {out.stderr[-2000:]}")
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    if not doc["before"]:
        return doc["s"], {}
    return doc["s"], usage(parse_stat(doc["before"]), parse_stat(doc["after"]), doc["s"])


def run(state: str, rounds: int, before: Optional[str], directory: str) -> dict[str, Any]:
    ckpt, desc = build_state(state)
    path = os.path.join(directory, f"{state}.ckpt")
    single_file.save(ckpt, path)
    del ckpt
    nbytes = os.path.getsize(path)
    iomem = fio.huge_iomem(16 << 20)
    trees = {"now": HERE} if before is None else {"now": HERE, "before": os.path.abspath(before)}
    cases = [(f"{how}_{tree}", root, how) for tree, root in trees.items() for how in ("fresh", "into")]
    device = BlockDevice.under(directory)
    samples: dict[str, list[float]] = {}
    disks: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):
        order = cases if r % 2 == 0 else cases[::-1]
        for name, root, how in order:
            make_cold(directory, "drop_caches")
            seconds, disk = timed_child(root, path, how, device)
            samples.setdefault(name, []).append(seconds)
            disks.setdefault(name, []).append(disk)
        for depth in fio.DEPTHS:
            make_cold(directory, "drop_caches")
            samples.setdefault(f"fio_qd{depth}", []).append(fio.read(path, nbytes, depth, iomem)["seconds"])
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {v[-1]:.3f}s" for n, v in samples.items()), flush=True)
    med = {n: statistics.median(v) for n, v in samples.items()}
    fio_best = min(m for n, m in med.items() if n.startswith("fio_"))
    summary = {n: {"median_s": m, "min_s": min(samples[n]), "max_s": max(samples[n])} for n, m in med.items()}
    ratios = {f"{n}_vs_fio_best": fio_best / m for n, m in med.items() if not n.startswith("fio_")}
    for name, ds in disks.items():
        if all(d.get("busy_s") for d in ds):  # the device busy for part of the load; the rest of it waited for us
            summary[name]["disk_busy_share_median"] = statistics.median(d["busy_share"] for d in ds)
            summary[name]["disk_gbps_while_busy_median"] = statistics.median(
                d["read_bytes"] / d["busy_s"] / 1e9 for d in ds
            )
    # fio's runtime clocks its transfers alone: its GB/s is the device's pace while busy, for the comparison
    for depth in fio.DEPTHS:
        summary[f"fio_qd{depth}"]["gbps_median"] = nbytes / summary[f"fio_qd{depth}"]["median_s"] / 1e9
    return {
        "state": desc,
        "bytes": nbytes,
        "rounds": rounds,
        "fio_iomem": iomem,
        "trees": trees,
        "samples": samples,
        "disk": disks,
        "block_device": device.name,
        "block_device_unread": device.why_not,
        "summary": summary,
        "ratios": ratios,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", choices=STATES, default="small10k")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", help="a checkout of an earlier commit (native_io built) to load with too")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if not fio.available():
        sys.exit("fio is not installed. HINT: apt-get install fio (scripts/setup.sh does it)")
    result = run_in_scratch_dir(
        "lr-resume-loads-",
        lambda d: run(args.state, args.rounds, args.before, d),
        args.json,
        os.environ.get("LR_BENCH_DIR"),
    )
    print_rows(result["summary"])
    print({k: round(v, 2) for k, v in result["ratios"].items()})


if __name__ == "__main__":
    main()
