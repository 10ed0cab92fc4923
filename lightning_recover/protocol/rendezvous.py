"""Where a generation's process group meets on etcd: a store its leader hosts.

On etcd, gloo's rendezvous through the control plane costs every member a Raft write plus a watch hop before
the group exists: 35-60 ms of a regroup's critical path on a loaded 2-core host (a scratch trace of kills),
against 10-15 ms on the embedded coordinator's TCPStore. So each replica process of an etcd job (replicas of
one process) hosts a small TCPStore of its own, bound only to its data address (the address its gloo traffic
and its partition probes use), and names it in its join payloads; a generation's members meet on the store of
the generation's leader (rank 0).

* **No new point of failure.** The store lives and dies with the leader's process, whose death fails the
  generation anyway (gloo's full mesh needs every member); the next generation meets at its own leader's.
  A member that cannot reach it fails the build like any unreachable member (ProcessGroups.build).
* **Nothing forged or stale.** Values are sealed like every control value (``SealedStore``): a client without
  the job's secret can make a build fail, never join a group under a forged address. Keys carry the
  generation (``pg/g{G}``), and a seal binds its key, so no value of an older group counts for a newer one.
* The embedded coordinator's jobs meet on the coordinator, as before (one host; the store is already there).
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from typing import Optional

import torch.distributed as dist

from lightning_recover.protocol.coordinator import serve_store
from lightning_recover.protocol.messages import ControlStore, SealedStore
from lightning_recover.protocol.reachability import data_address

#: the join payload's field naming the process's rendezvous store ("host:port")
FIELD = "rdv"


class RendezvousHost:
    """This process's rendezvous store: a TCPStore server bound to ``host`` only, on a free port."""

    def __init__(self, host: str, timeout: float) -> None:
        self.store = serve_store(host, 0, datetime.timedelta(seconds=timeout), what="the rendezvous store")
        self.address = f"{host}:{self.store.port}"


def host_rendezvous(store: ControlStore, replica: int, timeout: float) -> Optional[RendezvousHost]:
    """This replica's rendezvous store on its data address; None (said on stderr: its groups then meet
    through etcd, as before) where it cannot bind one."""
    try:
        return RendezvousHost(data_address(store.addr), timeout)
    except (OSError, ValueError, RuntimeError) as exc:
        print(
            f"[lightning-recover] replica {replica}: no rendezvous store of its own ({exc}); "
            "its generations' groups meet through etcd",
            file=sys.stderr,
            flush=True,
        )
        return None


def meeting_place(
    store: ControlStore, leader_payload: dict, prefix: str, timeout: float
) -> dist.Store | Callable[[], dist.Store]:
    """Where a generation's group meets, under ``prefix``: the rendezvous store its leader named in its join
    payload (connected on the build thread), else the control plane (every member reads the same payloads,
    so all choose the same place)."""
    address = leader_payload.get(FIELD)
    if isinstance(address, str) and ":" in address:
        return lambda: leaders_store(store, address, prefix, timeout)
    return store.prefixed(prefix)


def leaders_store(store: ControlStore, address: str, prefix: str, timeout: float) -> dist.Store:
    """A sealed client of the rendezvous store at ``address`` (a leader's), under ``prefix``. Connecting
    waits for it up to ``timeout``: call it where a member's death can interrupt the wait (a build thread)."""
    host, _, port = address.rpartition(":")
    client = dist.TCPStore(
        host.strip("[]"),
        int(port),
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        use_libuv=True,
    )
    return SealedStore(dist.PrefixStore(prefix, client), store.sealer, prefix)
