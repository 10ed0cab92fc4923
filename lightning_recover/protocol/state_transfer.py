"""The training state handed to a rejoining replica, as one flat buffer: tensor bytes plus a skeleton.

The state (module and optimizer state dicts, or a sharded replica's local shards) travels as one
``uint8`` tensor broadcast over the generation's group. Its tensors' bytes are laid out back to back
(each at a 64-byte aligned offset) and arrive in the joiner's buffer, where each tensor is a view
of its bytes: no serialisation of tensor data, no intermediate copies (``torch.save`` into memory,
then to ``bytes`` and back, made four copies of the state and took ~40 ms of the critical path of an
admission for a 3.3 MB state here). What is not tensor data (the containers, numbers, strings, and
each tensor's dtype and shape) is a small skeleton written with ``torch.save`` and read with torch's
weights-only unpickler, so nothing received becomes code.

Layout of the payload: ``[tensor bytes | skeleton]``; the skeleton's length travels with the
payload's (see :meth:`Replica._broadcast_state`).

The group's traffic is not authenticated, so the sender also writes the payload's SHA-256
(:func:`digest`) and its sizes to the sealed control plane before the broadcast. Every receiver reads
that record before it allocates anything: sizes that differ from the sealed ones (an on-path peer
asking for a buffer of any size) are refused before the allocation, and a payload whose digest differs
after it (:func:`check_digest`); both raise :class:`ForgedMessageError`. A joiner then stops and its
launcher restarts it if restarts remain; the members are not affected.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from typing import Any, Optional

import torch

from lightning_recover.errors import ForgedMessageError, RecoverError

_ALIGN = 64  # every tensor's bytes start at a multiple of this: a view of any dtype is aligned
_MARK = "__lightning_recover_tensor__"  # a skeleton dict {_MARK: i} stands for the i-th tensor


def _flat_tensor(t: Any) -> bool:
    """A plain dense tensor whose bytes can travel raw (others stay in the skeleton, as torch saves them)."""
    return (
        isinstance(t, torch.Tensor)
        and type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and not t.requires_grad
    )


def pack(state: Any) -> tuple[torch.Tensor, int]:
    """``state`` -> (payload, skeleton length): the tensor bytes, then the skeleton."""
    tensors: list[torch.Tensor] = []
    layout: list[tuple[str, list[int], int]] = []  # dtype, shape, offset of each tensor
    offset = 0

    def visit(obj: Any) -> Any:
        nonlocal offset
        if _flat_tensor(obj):
            tensors.append(obj)
            layout.append((str(obj.dtype).removeprefix("torch."), list(obj.shape), offset))
            offset += -(-obj.numel() * obj.element_size() // _ALIGN) * _ALIGN
            return {_MARK: len(tensors) - 1}
        if isinstance(obj, dict):
            return type(obj)((k, visit(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(visit(v) for v in obj)
        return obj

    skeleton = visit(state)
    buffer = io.BytesIO()
    torch.save({"state": skeleton, "layout": layout}, buffer)
    head = buffer.getbuffer()
    payload = torch.empty(offset + len(head), dtype=torch.uint8)
    for t, (_, _, start) in zip(tensors, layout):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            payload[start : start + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
    payload[offset:] = torch.frombuffer(head, dtype=torch.uint8)
    return payload, len(head)


def digest(payload: torch.Tensor) -> str:
    """The SHA-256 of a packed payload (hex), as the sender states it on the sealed control plane."""
    return hashlib.sha256(payload.numpy()).hexdigest()


def check_digest(payload: torch.Tensor, expected: str | None, key: str) -> None:
    """Refuse a received payload unless its SHA-256 is the one the sender sealed under ``key``."""
    if expected is None:
        raise ForgedMessageError(
            f"the digest of the state handed to this rejoining replica ({key!r}) is missing or forged: the state "
            "is refused. HINT: its launcher restarts it if restarts remain; keep the coordinator's port private."
        )
    if digest(payload) != expected:
        raise ForgedMessageError(
            f"the state handed to this rejoining replica does not match the digest its sender sealed under {key!r} "
            "(altered on the way): the state is refused. HINT: its launcher restarts it if restarts remain; run "
            "multi-host jobs on a private network."
        )


def digest_key(generation: int, inner: int, replica_size: int) -> str:
    """Where the sender of generation ``generation``'s state seals its digest (one per position ``inner`` of a
    sharded replica)."""
    return f"g{generation}/state" + (f"/i{inner}" if replica_size > 1 else "")


def pack_and_seal_digest(state: Any, store: Any, key: str) -> tuple[torch.Tensor, int]:
    """:func:`pack`, then write the payload's digest and sizes under ``key`` of the sealed ``store`` (a
    ``ControlStore``)."""
    payload, skeleton_len = pack(state)
    record = {"sha256": digest(payload), "bytes": payload.numel(), "skeleton": skeleton_len}
    store.set(key, json.dumps(record))
    return payload, skeleton_len


def sealed_record(store: Any, key: str) -> Optional[dict]:
    """The sender's sealed ``{"sha256", "bytes", "skeleton"}`` under ``key`` (None: missing, forged or
    malformed). Written before the broadcast began, so it is there unless deleted or forged."""
    value = store.get_genuine(key)
    try:
        record = json.loads(value) if value is not None else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def record_refused(store: Any, key: str, generation: int, rank: int, src_rank: int) -> ForgedMessageError:
    """The error of a receiver that found no genuine record under ``key`` after the sender's sizes arrived (the
    sender wrote it before): says whether the key is absent or failed authentication, and who was where."""
    what = "failed authentication" if store.has(key) else "is absent from the store"
    return ForgedMessageError(
        f"the digest of the state handed to this rejoining replica ({key!r}) {what} (generation {generation}, this "
        f"member's rank {rank}, the sender's rank {src_rank}): the state is refused. HINT: its launcher restarts it "
        "if restarts remain; keep the coordinator's port private."
    )


def check_sizes(record: dict, sizes: tuple[int, int], key: str) -> None:
    """Refuse broadcast sizes ``(payload bytes, skeleton bytes)`` unless they are the ones the sender sealed
    (``record``; none found is :func:`record_refused`): checked before the receiver allocates its buffer (the sizes
    travel over the unauthenticated group)."""
    if (record.get("bytes"), record.get("skeleton")) != tuple(sizes):
        raise ForgedMessageError(
            f"the state handed to this replica announces {sizes[0]} bytes (skeleton {sizes[1]}), not the "
            f"{record.get('bytes')} (skeleton {record.get('skeleton')}) its sender sealed under {key!r} (altered on "
            "the way): nothing is allocated and the state is refused. HINT: its launcher restarts it if restarts "
            "remain; run multi-host jobs on a private network."
        )


def unpack_checked(
    payload: torch.Tensor, skeleton_len: int, store: Any, key: str, record: Optional[dict] = None
) -> Any:
    """:func:`unpack` a received payload once its digest is the one its sender sealed under ``key`` (``record``,
    as :func:`sealed_record` read it; read now when not given)."""
    record = record if record is not None else sealed_record(store, key)
    check_digest(payload, record.get("sha256") if record else None, key)
    return unpack(payload, skeleton_len)


def unpack(payload: torch.Tensor, skeleton_len: int) -> Any:
    """The state :func:`pack` made; its tensors are views of ``payload`` (which they keep alive)."""
    if not 0 < skeleton_len <= payload.numel():
        raise RecoverError(f"the state handed to this replica is malformed (skeleton of {skeleton_len} bytes)")
    data_end = payload.numel() - skeleton_len
    head = load_state(payload[data_end:].numpy().tobytes())
    try:
        layout, skeleton = head["layout"], head["state"]
        tensors = []
        for dtype_name, shape, start in layout:
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype) or not isinstance(start, int):
                raise ValueError(f"tensor {len(tensors)}: bad dtype or offset")
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            if start < 0 or start % _ALIGN or start + nbytes > data_end:
                raise ValueError(f"tensor {len(tensors)} does not fit the payload")
            tensors.append(payload[start : start + nbytes].view(dtype).view(shape))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise RecoverError(f"the state handed to this replica is malformed: {exc}") from exc

    def restore(obj: Any) -> Any:
        if isinstance(obj, dict):
            if len(obj) == 1 and _MARK in obj:
                return tensors[obj[_MARK]]
            return type(obj)((k, restore(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(restore(v) for v in obj)
        return obj

    return restore(skeleton)


def load_state(raw: bytes) -> Any:
    """A peer's skeleton (or whole state), read with torch's weights-only unpickler: tensors, containers
    and primitives (plus what ``torch.serialization.add_safe_globals`` allows), never arbitrary code."""
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise RecoverError(
            f"the training state handed to this rejoining replica holds a type the weights-only loader refuses "
            f"({exc}). HINT: keep checkpointed state to tensors, containers and primitives, or allow the type "
            "with torch.serialization.add_safe_globals([...]) in the training script."
        ) from exc


def broadcast_state(collectives: Any, membership: Any, src_rank: int, state: Any, receive: bool) -> Any:
    """Hand ``state`` (given on ``src_rank`` only) to the members of ``membership``'s generation over
    ``collectives``: its sizes, then its raw bytes + skeleton. The gloo group is not authenticated, so the
    sender seals the payload's SHA-256 and sizes in the store first; a receiver checks the sizes before it
    allocates and the digest before it unpacks. Returns the state where ``receive`` (a joiner), else None."""
    payload, skeleton_len, record = torch.empty(0, dtype=torch.uint8), 0, None
    store = membership.store
    key = digest_key(membership.gen.number, membership.inner, membership.replica_size)
    if membership.rank == src_rank:
        payload, skeleton_len = pack_and_seal_digest(state, store, key)
    sizes = torch.tensor([payload.numel(), skeleton_len], dtype=torch.int64)
    collectives.broadcast([sizes], src_rank)
    if membership.rank != src_rank:
        record = sealed_record(store, key)
        if record is None:
            raise record_refused(store, key, membership.gen.number, membership.rank, src_rank)
        check_sizes(record, (int(sizes[0]), int(sizes[1])), key)
        payload = torch.empty(int(sizes[0]), dtype=torch.uint8)
    collectives.broadcast([payload], src_rank)
    return unpack_checked(payload, int(sizes[1]), store, key, record) if receive else None
