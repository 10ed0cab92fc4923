"""``lightning-recover inspect`` and ``lightning-recover convert``, for a single-file checkpoint and
for a sharded DCP checkpoint directory.

``inspect`` of a DCP directory: every item (tensor: dtype, global shape, its chunks and where each
lies; bytes item: file and length), every shard file (rank, items, bytes, checksum sidecar), and the
CRC-32C of every extent verified with :func:`verify_dcp_checkpoint`. ``convert`` of one: the whole
checkpoint rebuilt in one process with full tensors (torch's ``dcp_to_torch_save`` logic, read
through ``UringStorageReader``, bytes items with the ``weights_only`` loader) and written as one
``torch.save`` file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from lightning_recover.checkpoint.dcp.reader import read_dcp_metadata, verify_dcp_checkpoint
from lightning_recover.checkpoint.dcp.sharded_state import load_full
from lightning_recover.checkpoint.dcp.writer import SIDECAR_SUFFIX, sidecar_name
from lightning_recover.checkpoint.file.record_diagnosis import explain_damaged_records
from lightning_recover.checkpoint.file.single_file import ArchiveInfo, load, read_info, verify_file
from lightning_recover.checkpoint.integrity import CheckpointCorruptError, UnsafeCheckpointError

# exit codes
EXIT_OK = 0
EXIT_DAMAGED = 1  # integrity record and central directory fine, some records fail their checksum
EXIT_UNREADABLE = 2  # not a checkpoint, truncated, damaged end records or integrity record, missing file
EXIT_REFUSED = 3  # convert: the pickled state needs --unsafe-pickle
EXIT_RECORD_WRONG = 4  # every record that fails its checksum holds the data its wrong recorded CRC-32C came from


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


#: Widest name column of inspect's tables; a longer name (a Lightning callback's state key holds the
#: callback's whole configuration) keeps its start and its end, the middle elided (``--json`` has it whole).
NAME_WIDTH = 60


def fit_name(name: str, width: int = NAME_WIDTH) -> str:
    """``name`` if it fits in ``width`` characters, else its start and end around a ``...``.

    Args:
        name: a tensor's or item's name.
        width: the most characters to print.

    Returns:
        A string of at most ``width`` characters.
    """
    if len(name) <= width:
        return name
    tail = (width - 3) // 2
    return name[: width - 3 - tail] + "..." + name[len(name) - tail :]


def _name_width(names: list[str]) -> int:
    return min(max([len(n) for n in names] + [4]), NAME_WIDTH)


def _print_meta_and_tensors(meta: dict, rows: list[dict]) -> None:
    """The ``key=value`` metadata line and the tensor table (name, dtype, shape, bytes, file offset)."""
    if meta:
        print("  " + ", ".join(f"{k}={v}" for k, v in meta.items()))
    w = _name_width([r["name"] for r in rows])
    print(f"\n  {'name':<{w}}  {'dtype':<14} {'shape':<20} {'bytes':>12} {'offset':>12}")
    for r in rows:
        shape = "(" + ", ".join(map(str, r["shape"])) + ("," if len(r["shape"]) == 1 else "") + ")"
        print(f"  {fit_name(r['name']):<{w}}  {r['dtype']:<14} {shape:<20} {r['bytes']:>12} {r['offset']:>12}")


_WHAT = "HINT: give a checkpoint file (.ckpt, .pt) or a sharded (DCP) checkpoint directory"


def _unusable_path(path: str) -> str | None:
    """Why ``path`` cannot be a checkpoint, said once and with a HINT; None where it may be one."""
    if not os.path.exists(path):
        return f"{path}: no such file or directory. {_WHAT}."
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, ".metadata")):
        parent, name = os.path.split(os.path.abspath(path))
        if any(f.startswith(f".{name}.dcp-tmp-") for f in os.listdir(parent)):
            return None  # an unfinished save: inspect_dcp says what that means
        if any(f.endswith(".distcp") for f in os.listdir(path)):
            return None  # DCP shards without their .metadata: inspect_dcp names the damage
        inside = sorted(f for f in os.listdir(path) if f.endswith((".ckpt", ".pt", ".pth")))
        found = (
            f" (checkpoint files in it: {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''})" if inside else ""
        )
        return f"{path} is a directory, not a sharded checkpoint: it has no .metadata{found}. {_WHAT}."
    return None


def _inspect_plain_torch(path: str, as_json: bool) -> int:
    """A plain ``torch.save`` file (no integrity record to verify): its tensors, read with ``weights_only``."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # not loadable without arbitrary unpickling: say so, do not go further
        message = f"{path}: a torch.save file that weights_only cannot load ({exc}). HINT: torch.load it yourself if you trust it"
        print(json.dumps({"path": path, "ok": False, "error": message}) if as_json else f"error: {message}")
        return EXIT_UNREADABLE

    rows: list[dict] = []

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            rows.append(
                {
                    "name": prefix,
                    "dtype": str(obj.dtype).removeprefix("torch."),
                    "shape": list(obj.shape),
                    "bytes": obj.nbytes,
                }
            )
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}" if prefix else str(i), v)

    walk("", state)
    total = sum(r["bytes"] for r in rows)
    if as_json:
        print(json.dumps({"path": path, "format": "torch.save", "ok": True, "verified": False, "tensors": rows}))
        return EXIT_OK
    print(f"torch.save file {path} ({_human(os.path.getsize(path))})")
    w = _name_width([r["name"] for r in rows])
    print(f"\n  {'name':<{w}}  {'dtype':<14} {'shape':<20} {'bytes':>12}")
    for r in rows:
        shape = "(" + ", ".join(map(str, r["shape"])) + ("," if len(r["shape"]) == 1 else "") + ")"
        print(f"  {fit_name(r['name']):<{w}}  {r['dtype']:<14} {shape:<20} {r['bytes']:>12}")
    print(f"\n  {len(rows)} tensors, {total} bytes ({_human(total)})")
    print("  not verified: a plain torch.save file carries no checksums (lightning-recover's own files do)")
    return EXIT_OK


def inspect_main(args: argparse.Namespace) -> int:
    path = args.checkpoint
    verify = not getattr(args, "no_verify", False)
    as_json = getattr(args, "json", False)
    problem = _unusable_path(path)
    if problem is not None:
        if as_json:
            print(json.dumps({"path": path, "ok": False, "error": problem}))
        else:
            print(f"error: {problem}", file=sys.stderr)
        return EXIT_UNREADABLE
    if os.path.isdir(path):  # a sharded (DCP) checkpoint directory
        summary, code = inspect_dcp(path, verify)
        if as_json:
            print(json.dumps(summary))
        elif "items" not in summary:
            print(f"error: {summary['error']}", file=sys.stderr)
        else:
            print_dcp(summary, verify, _human)
        return code
    try:
        if verify:
            info, damaged = verify_file(path)
        else:
            info, damaged = read_info(path), []
    except (CheckpointCorruptError, FileNotFoundError, IsADirectoryError, OSError) as e:
        if "a plain torch.save file" in str(e):  # nothing to verify, but its tensors can be listed
            return _inspect_plain_torch(path, as_json)
        if as_json:
            print(json.dumps({"path": path, "ok": False, "error": str(e)}))
        else:
            print(f"error: {e}", file=sys.stderr)
        return EXIT_UNREADABLE

    if damaged:  # a wrong integrity record over intact data, or damaged data?
        sizes = [r.nbytes for r in info.index.storage_records()]
        for d, why in zip(damaged, explain_damaged_records(path, sizes, damaged)):
            d["record_wrong"] = None if why is None else {"chunk_bytes": why.chunk_bytes, "hypotheses": why.hypotheses}
    return _report_archive(info, damaged, verify, as_json)


_RECORD_WRONG_HINT = (
    "HINT: the data is intact; load it with load(path, verify=False) or torch.load(path, weights_only=True) and "
    "save it again for a correct record (docs/checkpointing.md, 'A wrong integrity record over intact data')"
)


def _report_archive(info: ArchiveInfo, damaged: list, verify: bool, as_json: bool) -> int:
    """``inspect`` of a format-2 file (a torch.save archive with an integrity record)."""
    record_wrong = bool(damaged) and all(d.get("record_wrong") for d in damaged)
    code = EXIT_RECORD_WRONG if record_wrong else EXIT_DAMAGED if damaged else EXIT_OK
    records = sorted(info.index.records.values(), key=lambda r: r.data_offset)
    summary = {
        "path": info.path,
        "format_version": info.format_version,
        "file_size": info.size,
        "file_id": info.index.file_id,
        "meta": info.index.meta,
        "num_tensors": len(info.tensors),
        "num_records": len(records),
        "tensor_bytes": sum(t["bytes"] for t in info.tensors),
        "storage_bytes": sum(r.nbytes for r in info.index.storage_records()),
        "records": [{"name": r.name, "offset": r.data_offset, "bytes": r.nbytes} for r in records],
        "verified": verify,
        "ok": not damaged,
        "damaged": damaged,
        "record_wrong": record_wrong,
        "tensors": info.tensors,
    }
    if as_json:
        print(json.dumps(summary))
        return code
    print(f"checkpoint {info.path}")
    print(
        f"  format version 2 (torch.save archive laid out for O_DIRECT, CRC-32C integrity record), "
        f"file size {info.size} ({_human(info.size)})"
    )
    _print_meta_and_tensors(info.index.meta, info.tensors)
    print(
        f"\n  {len(info.tensors)} tensors in {len(info.index.storage_records())} storage records, "
        f"{summary['tensor_bytes']} tensor bytes ({_human(summary['tensor_bytes'])})"
    )
    if not verify:
        print("  data not verified (--no-verify)")
        return EXIT_OK
    if not damaged:
        print(f"  verified {len(records)} records and their local headers: OK")
        return EXIT_OK
    for d in damaged:
        crc = (
            f"crc32c {d['actual_crc32c']:#010x} != {d['expected_crc32c']:#010x}"
            if d["expected_crc32c"] is not None
            else "unexpected bytes"
        )
        where = f"record {d['record']} at offset {d['offset']} (+{d['nbytes']} bytes): {crc}"
        tensors = ", ".join(d["tensors"]) or "-"
        why = d.get("record_wrong")
        if why:
            print(
                f"  RECORD WRONG for {where}; tensors: {tensors}: data consistent with a recomputed checksum, "
                f"integrity record wrong (the recorded value is the faulty CRC-32C combine of this data's own "
                f"{why['chunk_bytes']}-byte chunks, as lazy asynchronous saves before the fix wrote it)"
            )
        else:
            print(f"  DAMAGED {d['what']} of {where}; tensors: {tensors}")
    if record_wrong:
        print(
            f"  {len(damaged)} record(s) with a wrong checksum in the integrity record, data intact. {_RECORD_WRONG_HINT}"
        )
    else:
        print(f"  {len(damaged)} damaged record(s)")
    return code


def convert_main(args: argparse.Namespace) -> int:
    import torch

    path, out = args.checkpoint, args.output
    unsafe = getattr(args, "unsafe_pickle", False)
    problem = _unusable_path(path)
    if problem is not None:  # said once, with a HINT, as inspect says it
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_UNREADABLE
    try:
        if os.path.isdir(path):  # a sharded (DCP) checkpoint directory: gathered into full tensors
            ckpt = convert_dcp(path, unsafe)
        else:
            ckpt = load(path, map_location="cpu", weights_only=not unsafe)
    except UnsafeCheckpointError as e:
        print(f"error: {e}\n(use --unsafe-pickle only if you trust this file)", file=sys.stderr)
        return EXIT_REFUSED
    except CheckpointCorruptError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DAMAGED if e.damaged else EXIT_UNREADABLE
    except OSError as e:
        print(f"error: {path}: {e.strerror or e}", file=sys.stderr)
        return EXIT_UNREADABLE
    out = os.path.abspath(out)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.convert-{os.getpid()}")
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        torch.save(ckpt, tmp)
        os.replace(tmp, out)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):  # nothing was written at OUT: say why in one line
            print(
                f"error: cannot write {args.output}: {exc.strerror or exc}. HINT: pick a writable path", file=sys.stderr
            )
            return EXIT_UNREADABLE
        raise
    print(f"wrote {out} (torch.save format)")
    return EXIT_OK


# ---------------------------------------------------------------------------- DCP directories

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
    w = _name_width([i["name"] for i in summary["items"]])
    print(f"\n  {'name':<{w}}  {'dtype':<10} {'shape':<18} {'bytes':>12}  chunks (file: shape of the chunk)")
    for i in summary["items"]:
        where = ", ".join(
            f"{c['file']}" + (f": {_shape(c.get('shape'))}" if i["kind"] == "tensor" else "") for c in i["chunks"]
        )
        dtype = i.get("dtype", "bytes")
        shape = _shape(i["shape"]) if i["kind"] == "tensor" else "-"
        print(f"  {fit_name(i['name']):<{w}}  {dtype:<10} {shape:<18} {i.get('nbytes', i['bytes']):>12}  {where}")
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
    return load_full(path, allow_pickle=unsafe)
