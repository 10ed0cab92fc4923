"""An abandoned gloo group with an operation stuck in it: failed at once and destroyed (real processes).

A survivor's operation on a failed generation's group can wait behind data it will never receive;
left alone it ends only at ``collective_timeout`` while gloo's event loop spins on the unread socket.
:meth:`ProcessGroups.abandon` shuts the group's connections down (so the operation fails now) and
destroys the group once its operations ended (its threads go away).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from tests.jobs import kill_group

COLLECTIVE_TIMEOUT = 60.0  # what the stuck operation would otherwise wait for

MEMBER = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from lightning_recover.protocol.process_groups import ProcessGroups

port, rank = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
groups = ProcessGroups("gloo", collective_timeout=float(sys.argv[3]))

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)

pg = groups.build(dist.PrefixStore("g0", store), 0, rank, 2, lambda: False)
pg.allreduce([torch.ones(4)]).wait()  # both members connected and working
gloo_threads_of_group = gloo_threads()
store.set(f"connected/{rank}", "1")
if rank == 1:
    time.sleep(120)  # alive, but never starts the next operation: rank 0's stays in flight
works = [pg.allreduce([torch.ones(1 << 16)])]
groups.started(pg, works)
time.sleep(0.5)
stuck = not works[0].is_completed()
start = time.monotonic()
groups.abandon(pg)
del pg
while groups.abandoned_work and time.monotonic() - start < 30:
    time.sleep(0.05)
ended_after = time.monotonic() - start
failed = works[0].exception() is not None if works[0].is_completed() else None
works.clear()  # the operation holds the group's connections: the last reference outside the reaper
time.sleep(0.5)  # the reaper drops the group right after it saw the operation end
print(json.dumps({
    "stuck": stuck, "ended_after": ended_after, "abandoned_work": groups.abandoned_work, "operation_failed": failed,
    "gloo_threads_of_group": gloo_threads_of_group, "gloo_threads_after": gloo_threads(),
}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds the group's sockets through /proc")
def test_abandoned_group_with_a_stuck_operation_is_failed_and_destroyed():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    cmd = [sys.executable, "-c", MEMBER, str(store.port)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen(
            cmd + [str(rank), str(COLLECTIVE_TIMEOUT)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        out, _ = procs[0].communicate(timeout=90)
    finally:
        for proc in procs:
            kill_group(proc)
    assert procs[0].returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["stuck"], "the operation was in flight when the group was abandoned"
    assert result["abandoned_work"] is False, "the operation ended and the group was destroyed"
    assert result["ended_after"] < COLLECTIVE_TIMEOUT / 2, "failed by the shutdown, not by the timeout"
    assert result["operation_failed"] is True
    assert result["gloo_threads_of_group"], result
    assert result["gloo_threads_after"] == [], result
