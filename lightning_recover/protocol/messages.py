"""The message layer between the protocol and the coordinator's store.

Every read and write of the control plane goes through :class:`ControlStore`: it turns store
failures into :class:`CoordinatorLostError` (no step can be agreed without the coordinator) and it
is the one place where values are encoded and decoded, so what a replica accepts from the network
is decided here and nowhere else.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from lightning_recover import env
from lightning_recover.errors import CoordinatorLostError, MembershipChanged, ReplicaExcludedError


def connect(addr: str, timeout: float = 60.0) -> dist.TCPStore:
    """Connect a raw client to the coordinator at ``host:port``."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator address {addr!r} must be HOST:PORT (set {env.COORDINATOR} or pass --coordinator)")
    try:
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # torch raises several types (DistNetworkError, RuntimeError)
        raise CoordinatorLostError(
            f"cannot reach the lightning-recover coordinator at {addr}: {exc}. "
            "HINT: start it with the launcher (`lightning-recover run`) or `lightning-recover coordinator`."
        ) from exc


def mark_dead(store: dist.Store, replica: int, incarnation: int | None = None) -> bool:
    """Declare ``replica`` (its current or the given incarnation) dead.

    ``dead/{r}`` only ever grows, so a stale notice for an older incarnation can never mark a
    restarted replica dead. Returns False when that incarnation was already declared dead.
    """
    inc = incarnation if incarnation is not None else int(store.add(f"inc/{replica}", 0))
    while True:
        current = store.get(f"dead/{replica}").decode()
        if int(current) >= inc or inc <= 0:
            return False
        if store.compare_set(f"dead/{replica}", current, str(inc)).decode() == str(inc):
            store.add("events", 1)
            return True


def encode_object(obj: Any) -> bytes:
    """Encode a small object contributed to a store collective."""
    return pickle.dumps(obj)


def decode_object(raw: bytes) -> Any:
    """Decode what :func:`encode_object` wrote."""
    return pickle.loads(raw)


class ControlStore:
    """A replica's client of the coordinator: typed access, failures named."""

    def __init__(self, addr: str, replica: int, store: dist.Store | None = None) -> None:
        self.addr = addr
        self.replica = replica
        self.raw = store if store is not None else connect(addr)

    def clone(self) -> ControlStore:
        """A second connection (threads must not share one)."""
        return ControlStore(self.addr, self.replica, self.call(self.raw.clone))

    def prefixed(self, prefix: str) -> dist.Store:
        """A fresh connection under ``prefix``, for building process groups over it."""
        return dist.PrefixStore(prefix, self.call(self.raw.clone))

    def call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (ReplicaExcludedError, MembershipChanged):
            raise
        except Exception as exc:
            raise CoordinatorLostError(
                f"replica {self.replica} lost the coordinator at {self.addr} ({type(exc).__name__}: {exc}). "
                "No further step can be agreed safely; this replica stops. "
                "HINT: restart the job from its last checkpoint."
            ) from exc

    # ---------------------------------------------------------------- strings and counters
    def get(self, key: str) -> str:
        return self.call(self.raw.get, key).decode()

    def set(self, key: str, value: str) -> None:
        self.call(self.raw.set, key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """Linearizable register: returns the value now stored (``desired`` if this call won)."""
        return self.call(self.raw.compare_set, key, expected, desired).decode()

    def add(self, key: str, amount: int) -> int:
        return int(self.call(self.raw.add, key, amount))

    def has(self, key: str) -> bool:
        return bool(self.call(self.raw.check, [key]))

    def multi_get(self, keys: Sequence[str]) -> list[str]:
        return [v.decode() for v in self.call(self.raw.multi_get, list(keys))]

    def append(self, key: str, value: str) -> None:
        self.call(self.raw.append, key, value)

    def wait(self, key: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``key``; True once it exists."""
        try:
            self.raw.wait([key], datetime.timedelta(seconds=timeout))
            return True
        except Exception:
            return self.has(key)  # the slice elapsed, or the store failed (then this raises)

    def delete(self, key: str) -> None:
        try:
            self.raw.delete_key(key)
        except Exception:
            pass  # cleanup only: a missing key or a lost coordinator is noticed elsewhere

    def mark_dead(self, replica: int, incarnation: int | None = None) -> bool:
        return self.call(mark_dead, self.raw, replica, incarnation)

    # ---------------------------------------------------------------- objects
    def put_object(self, key: str, obj: Any) -> None:
        self.call(self.raw.set, key, encode_object(obj))

    def get_objects(self, keys: Sequence[str]) -> list[Any]:
        return [decode_object(v) for v in self.call(self.raw.multi_get, list(keys))]
