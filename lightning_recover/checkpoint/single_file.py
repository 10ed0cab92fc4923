"""One checkpoint, one file: ``save``, ``load``, ``read_info`` and ``verify_file`` through ``native_io``.

``save`` encodes the checkpoint (``format.py``), writes the storages as aligned extents with a
crc32c each, then the index, skeleton and footer, into a temporary file made durable and renamed
onto its final name (``files.py``). ``load`` verifies every extent's checksum before building a
tensor from it. :class:`~lightning_recover.checkpoint.plugin.UringCheckpointIO` plugs this into
Lightning.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

import torch

from lightning_recover import env
from lightning_recover.checkpoint import format as fmt
from lightning_recover.checkpoint.engine import resolve_engine
from lightning_recover.checkpoint.files import cleanup_stale_temps, fsync_dir, temp_path_for, unlink_quiet
from lightning_recover.checkpoint.format import CheckpointCorruptError, UnsafeCheckpointError

log = logging.getLogger(__name__)

__all__ = [
    "save",
    "load",
    "read_info",
    "verify_file",
    "plan",
    "write_tail",
    "CheckpointInfo",
    "CheckpointCorruptError",
    "UnsafeCheckpointError",
]

# storages living on an accelerator are staged to host memory in batches of at most this many bytes
_DEVICE_STAGING_BYTES = 256 << 20


# ------------------------------------------------------------------------------------- save


def _host_bytes(storage: Any) -> Any:
    """A buffer-protocol object over the bytes of a CPU ``UntypedStorage``."""
    return fmt.storage_as_bytes(storage).numpy()


def plan(checkpoint: Any) -> tuple[fmt.EncodedCheckpoint, int]:
    """Encode ``checkpoint`` (skeleton pickled now) and assign file offsets; returns (encoded, data_end)."""
    enc = fmt.encode_checkpoint(checkpoint, meta=fmt.file_meta())
    offsets, data_end = fmt.plan_layout([s.nbytes for s in enc.index.storages])
    for entry, off in zip(enc.index.storages, offsets):
        entry.offset = off
    return enc, data_end


def write_tail(w: Any, enc: fmt.EncodedCheckpoint, data_end: int, file_id: bytes) -> None:
    """Write index, skeleton and footer (extent crcs must be set in ``enc.index``), then close + fdatasync."""
    index_bytes = fmt.encode_index(enc.index)
    index_offset = fmt.align_up(data_end, fmt.SMALL_ALIGN)
    skeleton_offset = index_offset + len(index_bytes)
    meta_crc = fmt.crc32c(enc.skeleton, fmt.crc32c(index_bytes))
    footer = fmt.encode_footer(
        fmt.Footer(
            fmt.FORMAT_VERSION,
            0,
            index_offset,
            len(index_bytes),
            skeleton_offset,
            len(enc.skeleton),
            data_end,
            meta_crc,
            file_id,
        )
    )
    w.write([(index_offset, index_bytes + enc.skeleton + footer)])
    w.close(size=skeleton_offset + len(enc.skeleton) + len(footer))


def save(checkpoint: Any, path: Any, *, engine: Any = None) -> None:
    """Write ``checkpoint`` (any nesting of containers, primitives and tensors) to ``path`` atomically.

    The file is written to a temporary name in the same directory, fdatasync'ed, renamed into place and the
    directory fsync'ed: a crash leaves either the previous file or the new one under ``path``, never a
    partial one. Parent directories are created.
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    enc, data_end = plan(checkpoint)
    cleanup_stale_temps(directory)

    file_id = secrets.token_bytes(16)
    eng, lock = resolve_engine(engine)
    tmp = temp_path_for(path)
    try:
        with lock:
            with eng.open_writer(tmp) as w:
                pending: list = [(0, fmt.encode_header(file_id))]
                pending_ids: list = [None]
                staged = 0

                def flush() -> None:
                    nonlocal pending, pending_ids, staged
                    if pending:
                        crcs = w.write(pending)
                        for i, crc in zip(pending_ids, crcs):
                            if i is not None:
                                enc.index.storages[i].crc32c = int(crc)
                    pending, pending_ids, staged = [], [], 0

                for i, (st, entry) in enumerate(zip(enc.storages, enc.index.storages)):
                    if entry.nbytes == 0:
                        continue
                    if st.device.type != "cpu":
                        if staged + entry.nbytes > _DEVICE_STAGING_BYTES:
                            flush()
                        st = st.cpu()
                        staged += entry.nbytes
                    pending.append((entry.offset, _host_bytes(st)))
                    pending_ids.append(i)
                flush()
                write_tail(w, enc, data_end, file_id)
        os.rename(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise
    fsync_dir(directory)


# ------------------------------------------------------------------------------------- load


class CheckpointInfo:
    """Header, footer, index and skeleton bytes of a checkpoint (no tensor data read)."""

    def __init__(
        self, path: str, size: int, header: fmt.Header, footer: fmt.Footer, index: fmt.Index, skeleton: bytes
    ) -> None:
        self.path, self.size, self.header, self.footer, self.index, self.skeleton = (
            path,
            size,
            header,
            footer,
            index,
            skeleton,
        )


def _open_reader(eng: Any, path: str) -> Any:
    if not os.path.exists(path):
        raise FileNotFoundError(2, f"Checkpoint file not found: {path}", path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, f"Checkpoint path is a directory: {path}", path)
    return eng.open_reader(path)


def _read_info(r: Any, path: str) -> CheckpointInfo:
    size = r.size
    if size < fmt.HEADER_SIZE + fmt.FOOTER_SIZE:
        head = bytearray(min(size, fmt.HEADER_SIZE))
        if size:
            r.read([(0, head)])
        if size >= 8 and bytes(head[:8]) != fmt.HEADER_MAGIC:
            fmt.decode_header(bytes(head) + bytes(64), path)  # raises the "foreign" message
        raise CheckpointCorruptError(f"{path}: file too small ({size} bytes) to be a checkpoint (truncated?)", path)
    head = bytearray(fmt.HEADER_SIZE)
    tail = bytearray(fmt.FOOTER_SIZE)
    r.read([(0, head), (size - fmt.FOOTER_SIZE, tail)])
    header = fmt.decode_header(bytes(head), path)
    footer = fmt.decode_footer(bytes(tail), size, header, path)
    meta = bytearray(footer.index_length + footer.skeleton_length)
    (crc,) = r.read([(footer.index_offset, meta)])
    if crc != footer.meta_crc32c:
        raise CheckpointCorruptError(
            f"{path}: index/skeleton checksum mismatch at offset {footer.index_offset} "
            f"(+{len(meta)} bytes): damaged index or skeleton",
            path,
        )
    index = fmt.decode_index(bytes(meta[: footer.index_length]), header.data_start, footer.data_end, path)
    return CheckpointInfo(path, size, header, footer, index, bytes(meta[footer.index_length :]))


def read_info(path: Any, *, engine: Any = None) -> CheckpointInfo:
    """Validate header/footer/index of ``path`` and return them (tensor data is not read)."""
    path = os.fspath(path)
    eng, lock = resolve_engine(engine)
    with lock:
        r = _open_reader(eng, path)
        try:
            return _read_info(r, path)
        finally:
            r.close()


def verify_file(path: Any, *, engine: Any = None, batch_bytes: int = 256 << 20) -> tuple[CheckpointInfo, list]:
    """Read every extent of ``path`` and return ``(info, damaged extents)`` (bounded memory)."""
    path = os.fspath(path)
    eng, lock = resolve_engine(engine)
    with lock:
        r = _open_reader(eng, path)
        try:
            info = _read_info(r, path)
            bad: list = []
            batch: list = []
            ids: list = []
            total = 0

            def run() -> None:
                nonlocal batch, ids, total
                if batch:
                    bad.extend(fmt.damaged_extents(info.index, r.read(batch), path, ids))
                batch, ids, total = [], [], 0

            for i, s in enumerate(info.index.storages):
                if s.nbytes == 0:
                    continue
                if total and total + s.nbytes > batch_bytes:
                    run()
                batch.append((s.offset, bytearray(s.nbytes)))
                ids.append(i)
                total += s.nbytes
            run()
            return info, bad
        finally:
            r.close()


# Opt-in: fresh storages of at least _ALIGNED_MIN_BYTES allocated 4096-aligned (see _new_storage).
_ALIGNED_MIN_BYTES = 1 << 20
_PAGE = 4096
_ALIGNED_ALLOC = env.flag(env.ALIGNED_ALLOC) == "on"


def _new_storage(nbytes: int) -> torch.UntypedStorage:
    """A fresh CPU storage of exactly ``nbytes`` to read an extent into.

    ``torch.UntypedStorage(n)`` memory sits at 64 mod 4096 (the CPU allocator's alignment is 64), so
    ``native_io``'s reader cannot read it with ``O_DIRECT`` straight into it and stages every byte
    through its arena plus a copy. With ``LIGHTNING_RECOVER_ALIGNED_ALLOC=on`` storages of >= 1 MiB
    are instead carved 4096-aligned out of a torch allocation over-sized by 4096 bytes, so the
    reader's zero-copy path is taken: the storage starts at the aligned address, has ``nbytes()`` ==
    ``nbytes`` and keeps the allocation alive (released with the storage); it cannot grow (``resize_``
    to a larger size raises, as for ``torch.load(mmap=True)`` or safetensors storages).

    Off by default: on the benchmark VM (virtio disk, max_segments 254) the zero-copy reads into
    scattered 4 KiB user pages reach the device as smaller requests than the arena's and measured
    slower in wall time (docs/benchmarks.md, "Checkpoint I/O"), although they save the copy's CPU.
    """
    if nbytes < _ALIGNED_MIN_BYTES or not _ALIGNED_ALLOC:
        return torch.UntypedStorage(nbytes)
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    a = (-raw.data_ptr()) % _PAGE
    return torch.from_numpy(raw[a : a + nbytes].numpy()).untyped_storage()


def _is_contiguous(shape: list, stride: list) -> bool:
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def _into_targets(into: Any) -> dict[str, torch.Tensor]:
    return {p: t for p, t in fmt.tensor_paths(into).values()}


def load(
    path: Any,
    map_location: Any = None,
    *,
    weights_only: bool = True,
    verify: bool = True,
    into: Any = None,
    strict: bool = True,
    engine: Any = None,
) -> Any:
    """Load a checkpoint written by :func:`save`.

    Args:
        path: the checkpoint file.
        map_location: like ``torch.load``: None (the saved devices), a device/str, a dict
            ``{saved: target}`` or a callable ``(storage, location) -> storage``.
        weights_only: True (default) unpickles the skeleton with an allowlist (no arbitrary code runs);
            False allows any pickled object: only for checkpoints you trust.
        verify: compare every extent with its crc32c (raises :class:`CheckpointCorruptError`).
        into: a nested structure like the checkpoint (e.g. ``{"state_dict": model.state_dict()}``); tensors at
            the same paths with the same shape and dtype are filled in place (read straight into them when
            possible) and returned in the result instead of new tensors. With ``strict``, a shape/dtype
            mismatch raises ``ValueError``; otherwise a new tensor is loaded for that path. With ``verify``
            a checksum error is raised after the data has landed in those tensors.
    """
    path = os.fspath(path)
    eng, lock = resolve_engine(engine)
    targets = _into_targets(into) if into is not None else {}
    with lock:
        r = _open_reader(eng, path)
        try:
            info = _read_info(r, path)
            index = info.index
            users = [0] * len(index.storages)
            for t in index.tensors:
                users[t.storage] += 1

            # where each tensor's data goes: direct read into a target, or a fresh storage then copy_
            direct: dict[int, torch.Tensor] = {}  # storage index -> target tensor filled by the read
            copy_into: dict[int, torch.Tensor] = {}  # tensor index -> target tensor to copy_ into
            for ti, t in enumerate(index.tensors):
                dest = targets.get(t.name)
                if dest is None:
                    continue
                dt = fmt.dtype_from_name(t.dtype)
                if list(dest.shape) != list(t.shape) or dest.dtype != dt:
                    if strict:
                        raise ValueError(
                            f"{path}: cannot load {t.name!r} into the given tensor: checkpoint has "
                            f"{dt} {tuple(t.shape)}, target is {dest.dtype} {tuple(dest.shape)}"
                        )
                    continue
                contiguous_whole = (
                    t.storage_offset == 0
                    and t.nbytes > 0
                    and t.nbytes == index.storages[t.storage].nbytes
                    and _is_contiguous(t.shape, t.stride)
                )
                if contiguous_whole and users[t.storage] == 1 and dest.device.type == "cpu" and dest.is_contiguous():
                    direct[t.storage] = dest
                else:
                    copy_into[ti] = dest

            storages: list = []
            segs: list = []
            seg_ids: list = []
            for i, s in enumerate(index.storages):
                if i in direct:
                    d = direct[i]
                    buf = d.detach().reshape(-1).view(torch.uint8)
                    storages.append(d.untyped_storage())
                else:
                    st = _new_storage(s.nbytes)
                    buf = fmt.storage_as_bytes(st)
                    storages.append(st)
                if s.nbytes:
                    segs.append((s.offset, buf.numpy()))
                    seg_ids.append(i)
            crcs = r.read(segs) if segs else []
        finally:
            r.close()
    if verify:
        bad = fmt.damaged_extents(index, crcs, path, seg_ids)
        if bad:
            raise CheckpointCorruptError(fmt.describe_damage(bad, path), path, bad)

    where = fmt.map_location_fn(map_location)
    placed = []
    for i, (s, st) in enumerate(zip(index.storages, storages)):
        placed.append(st if i in direct else fmt.place_storage(st, s.device, where(s.device)))
    tensors = fmt.rebuild_tensors(index, placed, path)
    for ti, t in enumerate(index.tensors):
        if t.storage in direct:
            tensors[ti] = direct[t.storage]
        elif ti in copy_into:
            with torch.no_grad():
                copy_into[ti].copy_(tensors[ti])
            tensors[ti] = copy_into[ti]
    return fmt.decode_skeleton(info.skeleton, tensors, weights_only=weights_only, path=path)


# ----------------------------------------------------------------------------------- plugin
