"""``lightning-recover inspect`` / ``convert`` for a sharded DCP checkpoint directory.

``inspect``: every item (tensor: dtype, global shape, its chunks and where each lies; bytes item:
file and length), every shard file (rank, items, bytes, checksum sidecar), and the CRC-32C of every
extent verified with :func:`verify_dcp_checkpoint`. ``convert``: the whole checkpoint rebuilt in one
process with full tensors (torch's ``dcp_to_torch_save`` logic, read through ``UringStorageReader``,
bytes items with the ``weights_only`` loader) and written as one ``torch.save`` file.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from lightning_recover.checkpoint.dcp import SIDECAR_SUFFIX, read_dcp_metadata, sidecar_name, verify_dcp_checkpoint
from lightning_recover.checkpoint.format import CheckpointCorruptError, UnsafeCheckpointError

_RANK = re.compile(r"^__(\d+)_\d+\.distcp$")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def describe(path: str) -> dict:
    """Items and files of the DCP checkpoint at ``path`` from its ``.metadata`` (no data read).

    Checks that every file the metadata names exists and is long enough for its items (raises
    :class:`CheckpointCorruptError` otherwise).
    """
    md: Metadata = read_dcp_metadata(path)
    where: dict[str, list] = {}
    files: dict[str, dict] = {}
    for idx, info in md.storage_data.items():
        rel = info.relative_path
        where.setdefault(idx.fqn, []).append((tuple(idx.offset) if idx.offset is not None else None, info))
        f = files.setdefault(rel, {"file": rel, "items": 0, "bytes": 0, "end": 0})
        f["items"] += 1
        f["bytes"] += info.length
        f["end"] = max(f["end"], info.offset + info.length)
    for rel, f in sorted(files.items()):
        m = _RANK.match(rel)
        f["rank"] = int(m.group(1)) if m else None
        fpath = os.path.join(path, rel)
        if not os.path.exists(fpath):
            raise CheckpointCorruptError(f"{fpath}: shard file missing; the checkpoint is incomplete", path=fpath)
        f["size"] = os.stat(fpath).st_size
        if f["size"] < f["end"]:
            raise CheckpointCorruptError(
                f"{fpath}: {f['size']} bytes, its items end at {f['end']}: truncated shard", path=fpath
            )
        f["sidecar"] = os.path.exists(os.path.join(path, sidecar_name(rel)))
    items = []
    for fqn, meta in md.state_dict_metadata.items():
        locs = sorted(where.get(fqn, []), key=lambda x: x[0] or ())
        placed = [
            {"file": i.relative_path, "offset": i.offset, "length": i.length, **({"at": list(o)} if o else {})}
            for o, i in locs
        ]
        if isinstance(meta, BytesStorageMetadata):
            items.append({"name": fqn, "kind": "bytes", "bytes": sum(p["length"] for p in placed), "chunks": placed})
            continue
        shapes = {tuple(c.offsets): list(c.sizes) for c in meta.chunks}
        for p in placed:
            p["shape"] = shapes.get(tuple(p.get("at", [0] * len(meta.size))), None)
        items.append(
            {
                "name": fqn,
                "kind": "tensor",
                "dtype": _dtype_name(meta.properties.dtype),
                "shape": list(meta.size),
                "nbytes": math.prod(meta.size) * meta.properties.dtype.itemsize,
                "bytes": sum(p["length"] for p in placed),
                "chunks": placed,
            }
        )
    return {
        "path": path,
        "format": "dcp",
        "items": items,
        "files": [{k: v for k, v in f.items() if k != "end"} for _, f in sorted(files.items())],
        "num_items": len(items),
        "num_tensors": sum(1 for i in items if i["kind"] == "tensor"),
        "stored_bytes": sum(f["bytes"] for f in files.values()),
    }


def inspect_dcp(path: str, verify: bool) -> tuple[dict, int]:
    """(summary, exit code); the codes are those of ``lightning-recover inspect``."""
    from lightning_recover.checkpoint.tools import EXIT_DAMAGED, EXIT_OK, EXIT_UNREADABLE

    try:
        summary = describe(path)
    except (CheckpointCorruptError, UnsafeCheckpointError, OSError) as exc:
        return {"path": path, "format": "dcp", "ok": False, "error": str(exc)}, EXIT_UNREADABLE
    summary.update(verified=False, ok=True, damaged=[])
    if not verify:
        return summary, EXIT_OK
    try:
        result = verify_dcp_checkpoint(path)
    except CheckpointCorruptError as exc:
        summary.update(ok=False, error=str(exc), damaged=exc.damaged)
        return summary, EXIT_DAMAGED if exc.damaged else EXIT_UNREADABLE
    summary["verified"] = result["verified"]
    summary["verified_items"] = result["items"]
    return summary, EXIT_OK


def _shape(shape: list | None) -> str:
    if shape is None:
        return "?"
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def print_dcp(summary: dict, verify: bool, human: Any) -> None:
    path = summary["path"]
    print(f"DCP checkpoint {path}")
    print(
        f"  {len(summary['files'])} shard files, {summary['num_items']} items, {summary['stored_bytes']} bytes stored"
    )
    for f in summary["files"]:
        side = f"checksums in {sidecar_name(f['file'])}" if f["sidecar"] else f"no {SIDECAR_SUFFIX} sidecar"
        rank = f"rank {f['rank']}" if f["rank"] is not None else "rank ?"
        print(f"  {f['file']:<20} {rank:<8} {f['items']:>6} items {f['size']:>14} bytes ({human(f['size'])}), {side}")
    w = min(max([len(i["name"]) for i in summary["items"]] + [4]), 70)
    print(f"\n  {'name':<{w}}  {'dtype':<10} {'shape':<18} {'bytes':>12}  chunks (file: shape of the chunk)")
    for i in summary["items"]:
        where = ", ".join(
            f"{c['file']}" + (f": {_shape(c.get('shape'))}" if i["kind"] == "tensor" else "") for c in i["chunks"]
        )
        dtype = i.get("dtype", "bytes")
        shape = _shape(i["shape"]) if i["kind"] == "tensor" else "-"
        print(f"  {i['name']:<{w}}  {dtype:<10} {shape:<18} {i.get('nbytes', i['bytes']):>12}  {where}")
    if not verify:
        print("\n  data not verified (--no-verify)")
    elif not summary["ok"]:
        print(f"\n  DAMAGED: {summary['error']}")
    elif summary["verified"]:
        print(f"\n  verified the CRC-32C of {summary['verified_items']} items: OK")
    else:
        print("\n  no checksum sidecars (a stock FileSystemWriter checkpoint): files present, data not verifiable")


def convert_dcp(path: str, unsafe: bool) -> Any:
    """The full checkpoint (one process, full tensors), ready for ``torch.save``."""
    from lightning_recover.checkpoint.dcp_state import load_full

    return load_full(path, allow_pickle=unsafe)
