"""An abandoned gloo group with an operation stuck in it: failed at once and destroyed (real processes).

A survivor's operation on a failed generation's group can wait behind data it will never receive;
left alone it ends only at ``collective_timeout`` while gloo's event loop spins on the unread socket.
:meth:`ProcessGroups.abandon` shuts the group's connections down (so the operation fails now) and
destroys the group once its operations ended (its threads go away). And a build given up on (in
process) leaves the process to end with ``os._exit``, whatever stopped the wait for it.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from lightning_recover.errors import ForgedMessageError
from lightning_recover.protocol.process_groups import ProcessGroups
from tests.jobs import gloo_threads, kill_group

COLLECTIVE_TIMEOUT = 60.0  # what the stuck operation would otherwise wait for

MEMBER = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from lightning_recover.protocol.process_groups import ProcessGroups

port, rank, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4]
if scenario == "shutdown-ends-nothing":
    # The case the shutdown cannot help (gloo's loop ignoring the dead connections): the operation
    # then waits out collective_timeout, and only the group's threads' scheduling can be fixed.
    import lightning_recover.protocol.process_groups as process_groups
    process_groups._shut_down = lambda sockets: None
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
groups = ProcessGroups("gloo", collective_timeout=float(sys.argv[3]))

def read_task(t, name):
    try:
        return open(f"/proc/self/task/{t}/{name}").read()
    except (FileNotFoundError, ProcessLookupError):
        return ""  # the thread ended between the listing and the read (the reaper ends gloo's threads)

def gloo_threads():
    names = [read_task(t, "comm").strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)

def gloo_policies():
    found = []
    for t in os.listdir("/proc/self/task"):
        if "gloo" in read_task(t, "comm"):
            stat = read_task(t, "stat")
            if stat:
                found.append(int(stat[stat.rindex(")") + 2 :].split()[38]))  # field 41: scheduling policy
    return sorted(found)

before = set(os.listdir("/proc/self/task"))
pg = groups.build(dist.PrefixStore("g0", store), 0, rank, 2, lambda: False)
pg.allreduce([torch.ones(4)]).wait()  # both members connected and working
# gloo's threads name themselves once they first run (a starved one later than this point): the group's threads
# are counted once every thread it started has its name.
made = set(os.listdir("/proc/self/task")) - before
unnamed = read_task(str(os.getpid()), "comm")
settle = time.monotonic() + 30
while any(read_task(t, "comm") == unnamed for t in made) and time.monotonic() < settle:
    time.sleep(0.01)
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
while groups.abandoned_alive and time.monotonic() - start < (30 if scenario == "normal" else 3):
    time.sleep(0.05)
ended_after = time.monotonic() - start
abandoned_alive = groups.abandoned_alive
failed = works[0].exception() is not None if works[0].is_completed() else None
policies = gloo_policies()
del works  # the operation holds the group's connections: the last reference outside the reaper
# The reaper drops the group right after it saw the operation end: wait for its threads to go (a group that
# must be kept is looked at for as long as that takes on a quiet machine).
settle = time.monotonic() + (10 if scenario == "normal" else 0.5)
while gloo_threads() and time.monotonic() < settle:
    time.sleep(0.02)
print(json.dumps({
    "stuck": stuck, "ended_after": ended_after, "abandoned_alive": abandoned_alive, "exit_without_destructors": groups.abandoned_work, "operation_failed": failed,
    "gloo_threads_of_group": gloo_threads_of_group, "gloo_threads_after": gloo_threads(),
    "gloo_policies": policies,
}), flush=True)
"""


def _run_members(scenario: str) -> dict:
    """Rank 0 and rank 1 of a gloo group; rank 0's result (rank 1 is ended by pid)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    cmd = [sys.executable, "-c", MEMBER, str(store.port)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen(
            cmd + [str(rank), str(COLLECTIVE_TIMEOUT), scenario],
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
    return json.loads(out.strip().splitlines()[-1])


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds the group's sockets through /proc")


@pytest.mark.slow
@needs_proc
def test_abandoned_group_with_a_stuck_operation_is_failed_and_destroyed():
    result = _run_members("normal")
    assert result["stuck"], "the operation was in flight when the group was abandoned"
    assert result["abandoned_alive"] == 0, "the operation ended and the group was destroyed"
    assert result["exit_without_destructors"] is True, "a process that abandoned a group still ends with os._exit"
    assert result["ended_after"] < COLLECTIVE_TIMEOUT / 2, "failed by the shutdown, not by the timeout"
    assert result["operation_failed"] is True
    assert result["gloo_threads_of_group"], result
    assert result["gloo_threads_after"] == [], result


@pytest.mark.slow
@needs_proc
def test_a_group_whose_operation_cannot_be_failed_gets_idle_threads():
    result = _run_members("shutdown-ends-nothing")
    assert result["stuck"] and result["abandoned_alive"] == 1, result  # it waits out collective_timeout
    assert result["gloo_threads_after"] == result["gloo_threads_of_group"], result  # kept, not destroyed
    SCHED_IDLE = 5
    assert result["gloo_policies"] == [SCHED_IDLE] * len(result["gloo_threads_of_group"]), result


def test_a_failure_check_that_raises_during_a_build_still_ends_the_process_without_destructors():
    """The check run while a group is built can raise (a forged control value, a named error): the
    build still waits in gloo's connect, so the process must end with os._exit as after a failed
    member; destroying the waiting build at interpreter exit aborted a replica (SIGABRT)."""
    # Rank 1 never comes: the build waits until the timeout (0.5 s), then its thread ends.
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=0.5)
    )
    groups = ProcessGroups("gloo", collective_timeout=0.5)

    def forged() -> bool:
        raise ForgedMessageError("control-plane value under 'gen/latest' is not sealed (1 bytes)")

    with pytest.raises(ForgedMessageError):
        groups.build(dist.PrefixStore("g0", store), 0, 0, 2, forged)
    assert groups.abandoned_work
    # This process (pytest) does not end with os._exit: let the build fail at the store's timeout first.
    for thread in threading.enumerate():
        if thread.name == "lr-build-g0":
            thread.join(timeout=30)
            assert not thread.is_alive()


def _two_members(server: dist.TCPStore, groups: list[ProcessGroups], then=lambda rank, pg: None) -> dict:
    """Generation 0's group of two members, each built (and given to ``then``) on a thread of this process, which
    meet at ``server``: rank -> group, for the members that got that far within a minute."""
    built: dict[int, object] = {}

    def member(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        pg = groups[rank].build(dist.PrefixStore("g0", store), 0, rank, 2, lambda: False)
        then(rank, pg)
        built[rank] = pg

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return built


def test_a_released_group_ends_its_gloo_threads_while_the_interpreter_runs():
    """A clean exit releases the current group (``ProcessGroups.release``) and drops it: its destructor joins
    gloo's threads there and then, so none is left to touch the interpreter while it finalizes. Two members in
    threads of this process, one real allreduce."""
    import torch

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    before = gloo_threads()
    groups = [ProcessGroups("gloo", collective_timeout=30.0) for _ in range(2)]

    def reduce(rank: int, pg) -> None:
        works = [pg.allreduce([torch.ones(4)])]
        groups[rank].started(pg, works)
        # gloo runs a group's operations on several worker threads: a later operation can complete before an
        # earlier one is marked completed, so wait on the recorded one itself.
        works[0].wait()

    built = _two_members(server, groups, reduce)
    assert sorted(built) == [0, 1], "both members built the group and reduced"
    assert gloo_threads() - before, "gloo runs threads for the groups"
    for rank in range(2):
        assert groups[rank].release(built.pop(rank)), "a group whose operations completed is released"
        # the last references went with built.pop: the destructors ran there
    assert gloo_threads() - before == set(), "no gloo thread outlives its released group"


def test_a_group_kept_at_a_clean_exit_ends_the_process_without_destructors():
    """A clean exit whose group still has an operation in flight cannot release it (destroying it would wait for
    the operation); the interpreter's exit would destroy it and abort the process (SIGABRT, a replica leaving on a
    notice under load): ``abandoned_work`` then says to end with ``os._exit``. Two members in threads of this
    process; member 1 joins the operation only after member 0's release was refused."""
    import torch

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    groups = [ProcessGroups("gloo", collective_timeout=30.0) for _ in range(2)]
    built = _two_members(server, groups)
    assert sorted(built) == [0, 1], "both members built the group"
    works = [built[0].allreduce([torch.ones(4)])]  # member 1 has not joined it: in flight
    groups[0].started(built[0], works)
    assert not groups[0].release(built[0]), "a group with an operation in flight is kept"
    assert groups[0].abandoned_work and not groups[1].abandoned_work
    built[1].allreduce([torch.ones(4)]).wait()  # member 1 joins: the operation ends, the threads can go
    works[0].wait()
    assert groups[0].release(built.pop(0)) and groups[1].release(built.pop(1))
