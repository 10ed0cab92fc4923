"""The message layer between the protocol and the coordinator's store: typed and authenticated.

Every read and write of the control plane goes through :class:`ControlStore`. The store server
(a TCPStore) accepts any client that reaches its port, so nothing read from it is trusted:

* **Authenticated**: every value carries an HMAC-SHA256 over (key, sequence, payload) under the
  job's secret (:class:`JobSecret`, made by the launcher). A value that fails verification is never
  acted on: registers (decisions, memberships) are taken back by the first legitimate writer,
  death notices and heartbeats that fail are dropped and logged, and any other forged value stops
  the replica with :class:`ForgedMessageError`. Binding the MAC to the key stops replays of a
  genuine value under another key (an old step's ``commit`` cannot decide a new step).
* **Fresh**: a key that is rewritten over time (a heartbeat with its progress) carries its writer's
  sequence (:func:`sequence`: incarnation, then a counter) under the MAC, and its readers keep a
  :class:`Freshness`: a value below the newest sequence already accepted is an old genuine value
  written back (a replay), dropped and logged, never counted as liveness. Registers that only grow
  (``dead/{r}``, ``gen/latest``) are read as the largest value seen so far; every other key is
  written once, under a name unique to its (step, generation, replica), so writing its value back
  changes nothing. A deleted or overwritten value is waited for only up to its documented bound.
* **Typed**: objects exchanged between replicas (metrics, barrier, broadcast) are encoded as JSON
  with tagged tensors (dtype, shape, raw bytes); nothing received is ever unpickled.
* **Failures named**: a store failure or timeout raises :class:`CoordinatorLostError`; the client
  timeout is bounded (``store_timeout``) so a frozen coordinator is noticed, never waited on forever.

Counters (``add``) cannot carry a MAC; they are used only as hints whose forgery costs at most a
spurious wake-up (``events``) or a refused start (``inc/{r}``), never a wrong step.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import stat
import sys
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_recover import env
from lightning_recover.control_plane.connect import connect
from lightning_recover.control_plane.embedded import peek
from lightning_recover.errors import (
    COORDINATOR_LOST_HINT,
    CoordinatorLostError,
    ForgedMessageError,
    MembershipChanged,
    RecoverError,
    ReplicaExcludedError,
)
from lightning_recover.protocol.backend import ControlPlane

log = logging.getLogger(__name__)

_MAC_BYTES = 32
_SEQ_BYTES = 8
_TAG = b"\x00lr2"  # separates payload from sequence and MAC; versions the sealing
_REGISTER_TAKEBACKS = 16  # forged register values a legitimate writer replaces before giving up
_CONNECT_TIMEOUT = 5.0  # seconds a replica waits for an unreachable coordinator before saying so


# ---------------------------------------------------------------------------- the job's secret


class JobSecret:
    """The per-job key of the control plane's MACs (32 random bytes by default)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the job secret must be at least 16 bytes")
        self.key = key

    @classmethod
    def generate(cls) -> JobSecret:
        return cls(secrets.token_bytes(32))

    def hex(self) -> str:
        return self.key.hex()

    def write_file(self, directory: str) -> str:
        """Write the secret to a new 0600 file in ``directory``; return its path."""
        path = os.path.join(directory, "job.secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.hex())
        return path

    @classmethod
    def from_file(cls, path: str) -> JobSecret:
        st = os.stat(path)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise RecoverError(
                f"the secret file {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}). "
                f"HINT: chmod 600 {path}"
            )
        with open(path) as f:
            return cls._parse(f.read().strip(), f"the secret file {path}")

    @classmethod
    def from_env(cls) -> JobSecret:
        """The secret a launcher handed to this process (file path or hex value)."""
        if os.environ.get(env.SECRET_FILE):
            return cls.from_file(os.environ[env.SECRET_FILE])
        if os.environ.get(env.SECRET):
            return cls._parse(os.environ[env.SECRET], env.SECRET)
        raise RecoverError(
            f"no job secret: control messages are authenticated and this process has no key. HINT: start "
            f"replicas with `lightning-recover run`/`torchrun` or `fabric.launch()` (they make one), or for "
            f"hand-started multi-host jobs give every process and the coordinator the same "
            f"{env.SECRET_FILE}=PATH (a 0600 file of hex) or {env.SECRET}=HEX (e.g. `openssl rand -hex 32`)."
        )

    @classmethod
    def _parse(cls, text: str, where: str) -> JobSecret:
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise RecoverError(f"{where} must hold at least 32 hex digits (e.g. `openssl rand -hex 32`)") from None


def sequence(incarnation: int, count: int) -> int:
    """The sequence of a writer's ``count``-th value in its ``incarnation``: it only grows, also
    across a restart (a new incarnation starts above every value of the previous one)."""
    return (incarnation << 32) | (count & 0xFFFFFFFF)


class Sealer:
    """HMAC sealing of store values under one :class:`JobSecret`.

    Sealed value: ``payload | TAG | sequence (8 bytes) | HMAC(key, sequence, payload)``. Values
    written once carry sequence 0; values rewritten over time carry their writer's :func:`sequence`.
    """

    def __init__(self, secret: JobSecret) -> None:
        self._key = secret.key

    def _mac(self, key: str, seq: bytes, payload: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\x00" + seq + payload, hashlib.sha256).digest()

    def seal(self, key: str, payload: bytes, seq: int = 0) -> bytes:
        stamp = seq.to_bytes(_SEQ_BYTES, "big")
        return payload + _TAG + stamp + self._mac(key, stamp, payload)

    def open(self, key: str, raw: bytes) -> bytes:
        """The payload of a sealed value; raises :class:`ForgedMessageError` if it is not genuine."""
        return self.open_sequenced(key, raw)[1]

    def open_sequenced(self, key: str, raw: bytes) -> tuple[int, bytes]:
        """``(sequence, payload)`` of a sealed value; raises :class:`ForgedMessageError` if it is not genuine."""
        cut = len(raw) - _MAC_BYTES - _SEQ_BYTES - len(_TAG)
        if cut < 0 or raw[cut : cut + len(_TAG)] != _TAG:
            raise ForgedMessageError(f"control-plane value under {key!r} is not sealed ({len(raw)} bytes)")
        stamp = raw[cut + len(_TAG) : cut + len(_TAG) + _SEQ_BYTES]
        payload, mac = raw[:cut], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(key, stamp, payload)):
            raise ForgedMessageError(f"control-plane value under {key!r} failed authentication")
        return int.from_bytes(stamp, "big"), payload


class Freshness:
    """A reader's memory of the newest sequence it accepted under each key.

    A genuine value whose sequence is below that one is an old value written back by someone who
    read it earlier (a replay): :meth:`accept` refuses it and says so (the 1st, 2nd, 4th, 8th...
    replay of a key, so a flood does not flood the log). An equal sequence is the same value read
    again: accepted, but nothing moved.
    """

    def __init__(self, reader: str) -> None:
        self.reader = reader
        self._newest: dict[str, int] = {}
        self.replays: dict[str, int] = {}  # key -> replays dropped (read by tests and logs)

    def accept(self, key: str, seq: int) -> bool:
        if seq >= self._newest.get(key, -1):
            self._newest[key] = seq
            return True
        n = self.replays[key] = self.replays.get(key, 0) + 1
        if n & (n - 1) == 0:
            print(
                f"{self.reader}: dropped a replayed value under {key!r} (sequence {seq:#x} < "
                f"{self._newest[key]:#x}; {n} so far)",
                file=sys.stderr,
                flush=True,
            )
        return False


# ---------------------------------------------------------------------------- typed objects


def encode_object(obj: Any) -> bytes:
    """JSON with tagged tensors, tuples and non-string keys: what replicas may exchange."""
    return json.dumps(_to_json(obj), separators=(",", ":"), allow_nan=True).encode()


def decode_object(raw: bytes) -> Any:
    """Decode what :func:`encode_object` wrote (raises ValueError on anything else)."""
    return _from_json(json.loads(raw.decode()))


def _to_json(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": [str(t.dtype).removeprefix("torch."), list(t.shape), base64.b64encode(data).decode()]}
    if isinstance(obj, (list, tuple)):
        items = [_to_json(x) for x in obj]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _to_json(v) for k, v in obj.items()}
        return {"__dict__": [[_to_json(k), _to_json(v)] for k, v in obj.items()]}
    raise TypeError(
        f"strategy='recover' exchanges values between replicas as typed data (None, bool, int, float, str, "
        f"tensors, lists, tuples and dicts of those), not {type(obj).__name__}. HINT: convert it, e.g. to a "
        "str or a dict, before broadcasting or reducing it."
    )


def _from_json(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_from_json(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, value),) = obj.items()
        if tag == "__tensor__":
            dtype_name, shape, data = value
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise ValueError(f"bad tensor header {dtype_name!r} {shape!r}")
            buf = bytearray(base64.b64decode(data))
            if len(buf) != math.prod(shape) * dtype.itemsize:
                raise ValueError("tensor data does not match its shape")
            flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(shape)
        if tag == "__tuple__":
            return tuple(_from_json(x) for x in value)
        if tag == "__dict__":
            return {_hashable(_from_json(k)): _from_json(v) for k, v in value}
        if tag == "__float__":
            return float(value)
    return {k: _from_json(v) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


# ---------------------------------------------------------------------------- reads and writes of the raw store


def peek_all(store: ControlPlane, keys: Sequence[str]) -> list[Optional[bytes]]:
    """:func:`peek` of every key, never waiting, each answered when a write would be (a TCPStore answers
    in order; on etcd one transaction ordered in the Raft log instead of one compare-and-set per key)."""
    return store.peek_many(list(keys), through_log=True)


def recent_many(store: ControlPlane, keys: Sequence[str]) -> list[bytes]:
    """The values of ``keys``, which must exist, possibly a moment stale: from the process's watched view
    while it is current (no round trip), else one ``multi_get``. For readers polling notices that only grow
    (a launcher's ``declared/*``, ``dead/*``, ``inc/*``), where a read a moment earlier is as good."""
    found = store.cached_many(list(keys))
    return found if found is not None else store.multi_get(list(keys))


def mark_dead(store: ControlPlane, sealer: Sealer, replica: int, incarnation: Optional[int] = None) -> bool:
    """Declare ``replica`` (its current or the given incarnation) dead.

    ``dead/{r}`` only ever grows, so a stale notice for an older incarnation can never mark a
    restarted replica dead. Returns False when that incarnation was already declared dead.
    """
    key = f"dead/{replica}"
    inc = incarnation if incarnation is not None else int(store.add(f"inc/{replica}", 0))
    if inc <= 0:
        return False
    for _ in range(_REGISTER_TAKEBACKS):
        raw = peek(store, key) or b""  # deleted: a notice is written afresh
        current = read_death(sealer, replica, raw)
        if current >= inc:
            return False
        desired = sealer.seal(key, str(inc).encode())
        if store.compare_set(key, raw, desired, bump="events") == desired:
            return True
    raise ForgedMessageError(f"{key} keeps being overwritten by an unauthenticated client")


def _read_incarnation(sealer: Sealer, key: str, raw: bytes, what: str, replica: int) -> int:
    """A sealed incarnation number at ``key``; a forged or malformed value counts as none (0)."""
    try:
        return int(sealer.open(key, raw))
    except (ForgedMessageError, ValueError):
        log.warning("ignored a forged %s for replica %d", what, replica)
        return 0


def read_declared(sealer: Sealer, replica: int, raw: bytes) -> int:
    """The incarnation the coordinator's monitor declared dead in a ``declared/{r}`` value (0: none or forged)."""
    return _read_incarnation(sealer, f"declared/{replica}", raw, "declaration", replica)


def read_death(sealer: Sealer, replica: int, raw: bytes) -> int:
    """The incarnation declared dead in a ``dead/{r}`` value; a forged one counts as none."""
    return _read_incarnation(sealer, f"dead/{replica}", raw, "death notice", replica)


class ControlStore:
    """A replica's (or launcher's) authenticated client of the coordinator."""

    def __init__(
        self, addr: str, replica: int, secret: JobSecret, store: Optional[ControlPlane] = None, timeout: float = 60.0
    ) -> None:
        self.addr = addr
        self.replica = replica
        self.secret = secret
        self.sealer = Sealer(secret)
        self.timeout = timeout
        if store is None:
            # Connecting waits a little longer (a coordinator still starting up); operations do not.
            store = connect(addr, max(timeout, _CONNECT_TIMEOUT), request_timeout=timeout)
            store.set_timeout(datetime.timedelta(seconds=timeout))
        self.raw: ControlPlane = store
        # What this client already read of the keys that are rewritten (see the module docstring).
        self.freshness = Freshness(f"[lightning-recover] replica {replica}")
        self._deaths_seen: dict[int, int] = {}
        self._notices_opened: dict[int, tuple[bytes, int]] = {}  # replica -> the last notice opened, what it said
        self._generation_seen = 0

    def clone(self) -> ControlStore:
        """A second connection (threads must not share one)."""
        return ControlStore(self.addr, self.replica, self.secret, self.call(self.raw.clone), self.timeout)

    def prefixed(self, prefix: str) -> dist.Store:
        """A fresh, sealed connection under ``prefix``, for building process groups over it: the
        group's rendezvous (peer addresses) is authenticated like every other value."""
        return SealedStore(self.call(self.raw.prefixed_clone, prefix), self.sealer, prefix)

    def call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (ReplicaExcludedError, MembershipChanged, ForgedMessageError):
            raise
        except Exception as exc:
            raise CoordinatorLostError(
                f"replica {self.replica} lost the {self.raw.kind} "
                f"at {self.addr} ({type(exc).__name__}: {exc}). "
                "No further step can be agreed safely; this replica stops. " + COORDINATOR_LOST_HINT
            ) from exc

    # ---------------------------------------------------------------- sealed strings
    def get(self, key: str) -> str:
        return self.sealer.open(key, self.call(self.raw.get, key)).decode()

    def set(self, key: str, value: str, seq: int = 0) -> None:
        """Seal and write; ``seq`` is the writer's :func:`sequence` for a key it rewrites over time."""
        self.call(self.raw.set, key, self.sealer.seal(key, value.encode(), seq))

    def get_fresh(self, key: str) -> Optional[tuple[int, str]]:
        """``(sequence, value)`` under a rewritten key if present, genuine and not older than what this
        client already read there; None otherwise (a replayed value is dropped and logged)."""
        raw = self.call(peek, self.raw, key)
        if raw is None:
            return None
        try:
            seq, payload = self.sealer.open_sequenced(key, raw)
        except ForgedMessageError:
            return None
        return (seq, payload.decode()) if self.freshness.accept(key, seq) else None

    def generation(self) -> int:
        """The newest proposed generation (``gen/latest``), never below one this client already read:
        the register only grows, so a smaller genuine value is an old one written back."""
        latest = int(self.get("gen/latest"))
        if latest < self._generation_seen:
            self.freshness.accept("gen/latest", latest)  # logs the replay
            return self._generation_seen
        self._generation_seen = latest
        self.freshness.accept("gen/latest", latest)
        return latest

    def compare_set(
        self,
        key: str,
        expected: Optional[str],
        desired: str,
        also: Optional[dict[str, str]] = None,
        announce: Optional[str] = None,
        if_absent: Optional[dict[str, str]] = None,
    ) -> str:
        """Linearizable register: returns the value now stored (``desired`` if this call won).

        ``expected=None`` means "only if nobody decided yet": a forged value found there is not a
        decision, so it is replaced as if the key were empty. ``also``: sealed values written with it,
        whatever the outcome, and ``if_absent`` where absent; ``announce``: a hint counter bumped once the
        register holds ``desired`` (one transaction where the backend has them: ``ControlPlane.compare_set``).
        """
        expected_raw = b"" if expected is None else self.sealer.seal(key, expected.encode())
        desired_raw = self.sealer.seal(key, desired.encode())
        sealed = [(k, self.sealer.seal(k, v.encode())) for k, v in (also or {}).items()]
        sealed_if_absent = [(k, self.sealer.seal(k, v.encode())) for k, v in (if_absent or {}).items()]
        for _ in range(_REGISTER_TAKEBACKS):
            got = self.call(self.raw.compare_set, key, expected_raw, desired_raw, sealed, announce, sealed_if_absent)
            try:
                return self.sealer.open(key, got).decode()
            except ForgedMessageError:
                if expected is not None:
                    raise
                print(
                    f"[lightning-recover] replica {self.replica}: replaced a forged value under {key!r}",
                    file=sys.stderr,
                    flush=True,
                )
                expected_raw = got
        raise ForgedMessageError(f"{key!r} keeps being overwritten by an unauthenticated client")

    def get_genuine(self, key: str) -> Optional[str]:
        """The value under ``key`` if present and genuine; None if absent or forged (a forged value
        in a register is not a decision: its legitimate writer takes it back)."""
        return self._genuine(key, self.call(peek, self.raw, key))

    def _genuine(self, key: str, raw: Optional[bytes]) -> Optional[str]:
        if raw is None:
            return None
        try:
            return self.sealer.open(key, raw).decode()
        except ForgedMessageError:
            return None

    def multi_get(self, keys: Sequence[str]) -> list[str]:
        raw = self.call(self.raw.multi_get, list(keys))
        return [self.sealer.open(k, v).decode() for k, v in zip(keys, raw)]

    # ---------------------------------------------------------------- reads that may be slightly stale
    # On etcd these are answered by the process's watched view (control_plane/etcd_watch.py) while it is
    # current, else by a read; on the TCPStore they are the plain reads. A stale answer is the store's
    # state a moment ago, never older than one already given: use them only where such a read is as
    # good as a read made a moment earlier (hints, write-once registers, notices that only grow).
    def recent_raw(self, key: str) -> Optional[bytes]:
        hit, raw = self.call(self.raw.cached, key)
        return raw if hit else self.call(peek, self.raw, key)

    def recent_arrival(self, key: str) -> Optional[tuple[bytes, float]]:
        """``(raw value, monotonic time it reached this process)`` from the watched view (etcd, while current);
        None on the TCPStore, while the view is not current or when the key is absent."""
        return self.call(self.raw.cached_arrival, key)

    def recent_genuine(self, key: str) -> Optional[str]:
        """:meth:`get_genuine`, possibly a moment stale."""
        return self._genuine(key, self.recent_raw(key))

    def recent_count(self, key: str) -> int:
        """A counter's value (``add(key, 0)``), possibly a moment stale."""
        hit, raw = self.call(self.raw.cached, key)
        if not hit:
            return self.add(key, 0)
        try:
            return int(raw or b"0")
        except ValueError:
            return -1  # not a number (forged): counts as a change, which the caller checks

    def wait_recent(self, key: str, timeout: float) -> bool:
        """:meth:`wait`; on etcd served by the watched view while it is current (no round trip)."""
        found = self.call(self.raw.cached_wait, key, timeout)
        return found if found is not None else self.wait(key, timeout)

    def wait_changed(self, timeout: float) -> None:
        """Sleep until some key changes (etcd: the watched view moves) or ``timeout`` seconds pass."""
        self.call(self.raw.wait_changed, timeout)

    # ---------------------------------------------------------------- several keys in one round trip

    def report_and_decide(
        self,
        key: Optional[str],
        value: Optional[str],
        expected: dict[str, str],
        register: str,
        decision: str,
        forget_prefix: Optional[str] = None,
        vouch: Optional[tuple[str, str, int]] = None,
    ) -> Optional[str]:
        """Write the sealed ``value`` under ``key`` (None: no report) and, in the same transaction, ``decision``
        into the empty ``register`` if every key of ``expected`` holds its sealed value (etcd only, see
        ``EtcdStore.put_and_decide``; ``forget_prefix``: delete the keys under it in the same request;
        ``vouch``: a record ``(key, payload, sequence)`` written only with the decision, see ``vouches.py``).
        Returns the register's decision now, None while undecided; :class:`ForgedMessageError` if the
        register holds a forged value (the caller takes it back)."""
        sealed = [(k, self.sealer.seal(k, v.encode())) for k, v in expected.items()]
        also = [] if vouch is None else [(vouch[0], self.sealer.seal(vouch[0], vouch[1].encode(), vouch[2]))]
        got = self.call(
            self.raw.put_and_decide,
            key,
            None if key is None or value is None else self.sealer.seal(key, value.encode()),
            sealed,
            register,
            self.sealer.seal(register, decision.encode()),
            forget_prefix,
            also,
        )
        return None if got is None else self.sealer.open(register, got).decode()

    def peek_many(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """Raw values (None: absent) without waiting; one round trip on etcd, one per key on the TCPStore."""
        return self.call(self.raw.peek_many, list(keys))

    def genuine_many(self, keys: Sequence[str]) -> list[Optional[str]]:
        """:meth:`get_genuine` of every key, in one :meth:`peek_many` (one round trip on etcd)."""
        return [self._genuine(k, raw) for k, raw in zip(keys, self.peek_many(keys))]

    def recent_genuine_many(self, keys: Sequence[str]) -> list[Optional[str]]:
        """:meth:`genuine_many`, possibly a moment stale: from the watched view while it is current (no round
        trip), else one read of them all."""
        raws = self.call(self.raw.cached_each, list(keys))
        if raws is None:
            raws = self.peek_many(keys)
        return [self._genuine(k, raw) for k, raw in zip(keys, raws)]

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (cleanup: failures are ignored); one transaction on etcd."""
        try:
            self.raw.delete_many(list(keys))
        except Exception:
            pass  # cleanup only: a lost control plane is noticed elsewhere

    # ---------------------------------------------------------------- unsealed hints and plumbing
    def append_hint(self, key: str, value: str) -> None:
        """Append to an unsealed list that only says where to look (entries are verified there)."""
        self.call(self.raw.append, key, value)

    def add(self, key: str, amount: int) -> int:
        return int(self.call(self.raw.add, key, amount))

    def has(self, key: str) -> bool:
        return bool(self.call(self.raw.check, [key]))

    def has_all(self, keys: Sequence[str]) -> bool:
        return bool(self.call(self.raw.check, list(keys)))

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

    # ---------------------------------------------------------------- deaths
    def mark_dead(self, replica: int, incarnation: Optional[int] = None) -> bool:
        return self.call(mark_dead, self.raw, self.sealer, replica, incarnation)

    def deaths(self, replicas: Sequence[int], recent: bool = False) -> dict[int, int]:
        """``{r: incarnation declared dead}`` (0 = none; forged notices are ignored). ``recent``: may be a
        moment stale (:meth:`recent_raw`; a notice only grows, so a stale one is just an earlier one)."""
        # Non-waiting reads: a deleted notice must not stall the heartbeat thread.
        keys = [f"dead/{r}" for r in replicas]
        cached = self.call(self.raw.cached_each, keys) if recent else None
        raw = [v or b"" for v in (cached if cached is not None else self.peek_many(keys))]
        found = {}
        for r, v in zip(replicas, raw):
            # dead/{r} only grows: a smaller genuine value read later is an old notice written back
            # (a recent read may just be earlier than a direct one: no replay is concluded from it).
            # The same bytes as the last notice opened say the same: a poll of N notices costs no N MACs.
            opened = self._notices_opened.get(r)
            if opened is not None and opened[0] == v:
                declared = opened[1]
            else:
                declared = read_death(self.sealer, r, v)
                self._notices_opened[r] = (v, declared)
            if cached is None:
                self.freshness.accept(f"dead/{r}", declared)  # logs a replay
            found[r] = self._deaths_seen[r] = max(declared, self._deaths_seen.get(r, 0))
        return found

    # ---------------------------------------------------------------- objects
    def put_object(self, key: str, obj: Any) -> None:
        self.call(self.raw.set, key, self.sealer.seal(key, encode_object(obj)))


class SealedStore(dist.Store):
    """A ``dist.Store`` that seals what it writes and verifies what it reads (for gloo's rendezvous)."""

    def __init__(self, inner: dist.Store, sealer: Sealer, prefix: str) -> None:
        super().__init__()
        self._inner: Any = inner  # torch's stubs type a Store's values as str; they are bytes
        self._sealer = sealer
        self._prefix = prefix

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, self._sealer.seal(f"{self._prefix}/{key}", bytes(value)))

    def get(self, key: str) -> bytes:
        return self._sealer.open(f"{self._prefix}/{key}", self._inner.get(key))

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: Any) -> None:
        self._inner.set_timeout(timeout)
