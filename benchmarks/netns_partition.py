"""The asymmetric-partition scenario of tests/chaos/test_netns.py, run against a given checkout of the
package, for the before/after figures in benchmarks/figures/netns32.md (root; network namespaces).

    python benchmarks/netns_partition.py --package-root /work/main --watch 60 --json before.json
    python benchmarks/netns_partition.py --package-root . --watch 60 --json after.json

Starts the documented multi-host recipe (coordinator host + 3 torchrun replica hosts,
--heartbeat-timeout 2), cuts replica 2's host off from its peers' traffic (nftables inside it; the
coordinator stays reachable) after step 3, and records for ``--watch`` seconds when replica 0
commits steps and when the coordinator declares replica 2 dead.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.hosts import Hosts  # noqa: E402
from tests.test_netns import HEARTBEAT_TIMEOUT, STEPS, M, MultiHostJob, wait_until  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--package-root", required=True, help="checkout whose lightning_recover the job runs")
    parser.add_argument("--watch", type=float, default=60.0)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    root = os.path.abspath(args.package_root)
    commit = subprocess.run(
        ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out = f"/tmp/netns_partition_{os.getpid()}"
    with Hosts(["coord", "h0", "h1", "h2"]) as hosts:
        job = MultiHostJob(hosts, out, replicas=3)
        base_env = job.env
        job.env = lambda **extra: dict(base_env(**extra), PYTHONPATH=root)
        job.start_coordinator()
        script_args = ["--replicas", "3", "--steps", str(STEPS * 100), "--microbatches", str(M), "--dtype", "float64"]
        script_args += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--work", "0.03"]
        for r in range(3):
            job.start_replica(r, script_args, max_restarts=0)
        assert wait_until(lambda: job.applied(0) >= 3, 240), job.dump()
        t_cut = time.monotonic()
        hosts.isolate("h2", ["h0", "h1"])
        commits, declared, last = [], None, job.applied(0)
        while time.monotonic() - t_cut < args.watch:
            now = job.applied(0)
            if now > last:
                commits.append(round(time.monotonic() - t_cut, 3))
                last = now
            if declared is None and re.search(r"replica 2 \(incarnation 1\).*declared dead", job.log("coord")):
                declared = round(time.monotonic() - t_cut, 3)
            time.sleep(0.01)
    result = {
        "package_root": root,
        "commit": commit,
        "watch_s": args.watch,
        "replica2_declared_dead_s": declared,
        "first_commit_after_cut_s": commits[0] if commits else None,
        "commits_in_window": len(commits),
        "coordinator_log": job.log("coord")[-2000:],
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "coordinator_log"}))


if __name__ == "__main__":
    main()
