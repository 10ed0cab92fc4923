"""Warm standbys: processes started ahead of need that take a dead replica's place.

A restarted replica spends seconds (here) to minutes (a real cluster: CUDA and NCCL start-up,
imports, model construction) before it can rejoin. A standby pays that in advance: the launcher
starts it with :data:`~lightning_recover.env.STANDBY` instead of a replica id, it runs the user's
script like a replica up to its connection to the coordinator, and there it waits.

Protocol (all values sealed with the job's secret):

1. Each process ``i`` of the standby (one, or the K of a sharded replica, which first build their
   own K-process world) sets ``standby/{s}/ready/{i}`` and waits for ``standby/{s}/assign`` with
   blocking store waits of one second each (one request per second, served by the coordinator's
   wait list: no polling while the active replicas train).
2. When replica ``r`` dies, the launcher declares its incarnation dead and writes ``r`` to the
   assign key of a ready standby. With none ready (all still starting), ``r`` restarts in place
   as without standbys, and the starting ones stay for the next death.
3. The standby becomes replica ``r``'s next incarnation and goes on exactly as a restarted replica
   does: it asks to join, is admitted at the next commit and receives the live state from a peer.

A standby is never a member of a generation before that, so it counts neither in M nor in the
quotas.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from lightning_recover import env
from lightning_recover.protocol.messages import ControlStore, Sealer

# Seconds of one blocking wait on the coordinator. Long: the wait returns as soon as the key is set,
# fails at once if the coordinator's connection drops, and the standby dies with its launcher; each
# expiry makes torch's store client log two warnings, which 1 s slices made a line pair per second.
WAIT_SLICE = 300.0
FORGED_PAUSE = 1.0  # seconds between reads while the key holds a forged value (it does not wake waits)


def ready_key(standby: int, inner: int) -> str:
    return f"standby/{standby}/ready/{inner}"


def assign_key(standby: int) -> str:
    return f"standby/{standby}/assign"


def assign(store: Any, sealer: Sealer, standby: int, replica: int) -> None:
    """Launcher side: hand replica ``replica``'s place to standby ``standby`` (on a raw store client)."""
    key = assign_key(standby)
    store.set(key, sealer.seal(key, str(replica).encode()))


def is_ready(store: Any, sealer: Sealer, standby: int, processes: int) -> bool:
    """Launcher side: whether all ``processes`` of the standby reached their wait (start-up done)."""
    keys = [ready_key(standby, i) for i in range(processes)]
    if not store.check(keys):
        return False
    try:
        return all(sealer.open(key, raw) == b"1" for key, raw in zip(keys, store.multi_get(keys)))
    except Exception:
        return False  # forged: not a standby of this job


def wait_for_assignment(store: ControlStore, standby: int, replicas: int, inner: int = 0) -> int:
    """Standby side: say this process of the standby is ready, then block until the standby is
    assigned a replica id (all K processes of a sharded standby wait on the same key).

    Also sets :data:`env.REPLICA` in this process: from here on it is that replica (its device slot
    stays the standby's, see :func:`env.device_slot`)."""
    store.set(ready_key(standby, inner), "1")
    who = f"standby {standby}" + (f" process {inner}" if inner else "")
    print(
        f"[lightning-recover] {who} (pid {os.getpid()}): ready, waiting to take a failed replica's place",
        file=sys.stderr,
        flush=True,
    )
    key = assign_key(standby)
    while True:
        if store.wait(key, WAIT_SLICE):
            value = store.get_genuine(key)
            if value is not None and value.isdigit() and int(value) < replicas:
                break
            time.sleep(FORGED_PAUSE)  # a forged value: the wait returns at once, do not spin on it
    replica = int(value)
    os.environ[env.REPLICA] = str(replica)
    return replica
