"""A pytest plugin that records each test's CPU time: where the test tiers spend the machine's cores.

    PYTHONPATH=benchmarks pytest -n 2 --dist loadfile -p pytest_cpu tests/integration
    python benchmarks/pytest_cpu.py     # the summary: per file and the costliest tests

Per test it appends ``{"id", "cpu", "wall"}`` to ``$LR_TEST_CPU_DIR/cpu-<worker pid>.jsonl`` (default
/tmp/lr-test-cpu). ``cpu`` is the worker's own CPU plus that of the children it (or they) waited for during the
test: a daemon that outlives its test (an etcd cluster fixture, a fork server) is counted in the test that reaps
it, so per-test figures of such fixtures' users are rough; the sum over the tier is not.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import resource
import sys
import time

import pytest

DIR = os.environ.get("LR_TEST_CPU_DIR", "/tmp/lr-test-cpu")


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.monotonic()
    yield
    os.makedirs(DIR, exist_ok=True)
    with open(os.path.join(DIR, f"cpu-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"id": item.nodeid, "cpu": _cpu() - cpu, "wall": time.monotonic() - wall}) + "\n")


def summary(rows: list[dict], top: int = 25) -> str:
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        entry = files[row["id"].split("::")[0]]
        entry[0] += row["cpu"]
        entry[1] += row["wall"]
    lines = [f"{len(rows)} tests: {sum(r['cpu'] for r in rows):.0f} s CPU in {sum(r['wall'] for r in rows):.0f} s"]
    lines += [f"{c:7.1f} s CPU {w:7.1f} s  {name}" for name, (c, w) in sorted(files.items(), key=lambda x: -x[1][0])]
    lines += ["", "costliest tests:"]
    lines += [
        f"{r['cpu']:7.1f} s CPU {r['wall']:7.1f} s  {r['id']}" for r in sorted(rows, key=lambda r: -r["cpu"])[:top]
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    found = [json.loads(line) for path in glob.glob(os.path.join(DIR, "cpu-*.jsonl")) for line in open(path)]
    print(summary(found) if found else f"no records in {DIR}", file=sys.stdout)
