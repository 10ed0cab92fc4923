"""``lightning-recover bench checkpoint``: durable save and cold load of a GPT-like state.

Methods (all measured on the same Lightning-like checkpoint dict):

* ``uring``       -- this project's :class:`lightning_recover.lightning.checkpoint_io.UringCheckpointIO` (format 2: a
  torch.save archive)
* ``uring+mmap`` / ``torch.save+mmap`` -- saved by uring / torch.save, loaded by ``torch.load(mmap=True)``
* ``lightning``   -- Lightning's ``TorchCheckpointIO``
* ``torch.save``  -- ``torch.save`` / ``torch.load(weights_only=False)``
* ``dcp``         -- ``torch.distributed.checkpoint`` FileSystemWriter/Reader, one process
* ``safetensors`` -- tensors flattened to names, ``save_file`` / ``load_file``; the non-tensor
  skeleton travels as JSON in the safetensors metadata
* ``fio``         -- the device limit: fio O_DIRECT sequential write (end fsync) then read of the
  same number of bytes, 16 MiB blocks, io_uring, at iodepth 1, 2 and 4 (each a fresh file); the
  best depth (highest median GB/s, chosen separately for write and read) is "the device limit"
  used for the ratios, every depth is reported

Durable save: time of the method's save call **plus** an ``fsync`` of every file and directory
it wrote (its checkpoint directory included). Every method gets the same post-sync, also the
ones that sync themselves (for them it costs one flush), so all are measured to the same
durability point; the post-sync's share is reported as ``sync_s``.

Cold load: the page cache is dropped before each load (``sync; echo 3 >
/proc/sys/vm/drop_caches`` when possible, else ``posix_fadvise(DONTNEED)`` on the files), then
the checkpoint is loaded fully into memory; the load time includes a pass touching one byte
of every 4 KiB page of every loaded tensor, so lazily mmap-backed results (safetensors'
default) are charged for actually reading their data. DCP loads into a preallocated state
dict (allocated outside the timing, as a resuming job would have its model already).

Repetitions are interleaved (method order rotated per repetition); medians are reported.

``--paired``: each run of a method (default: uring) is paired with fio runs of the same bytes
next to it, one per queue depth of ``--fio-iodepth`` (default 1,4,16; wall clock less fio's fixed cost,
``end_fsync`` included); a pair's fio time is the best of its depths, so the ratio is against fio at its best
depth on that disk at that moment (depth 1 alone understates a virtio disk). Per method and op the
median of the paired ratios and their spread are reported (:func:`run_pairs`, :func:`summarize_pairs`), and
the same against each depth alone. ``--state gpt|llama|small10k`` picks the state (``gpt_state.build_state``).
GB = 1e9 bytes; throughput = checkpoint tensor payload bytes / seconds (fio: its own bytes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_recover import env
from lightning_recover.bench import fio as fio_mod
from lightning_recover.bench.block_device import BlockDevice, measured, ratio_factors
from lightning_recover.bench.first_touch import first_touch_s, hypervisor_takes_free_pages
from lightning_recover.bench.gpt_state import STATES, build_state, iter_tensors, tensor_stats

ALL_METHODS = [
    "uring",
    "uring-into",
    "uring-recycled",
    "uring+mmap",
    "torch.save+mmap",
    "lightning",
    "torch.save",
    "dcp",
    "safetensors",
    "fio",
]
BASELINE = "uring"
# fio's queue depths in the paired mode: each pair runs fio at all of them and takes the best (fio.DEPTHS)
PAIRED_FIO_IODEPTHS = fio_mod.DEPTHS

# Targets of the issue, for the plugin (uring) against each reference.
# (kind, reference method, minimum ratio uring_gbps / reference_gbps, strict)
TARGETS = [
    ("save", "fio", 0.90, False),
    ("save", "dcp", 2.0, False),
    ("save", "lightning", 6.0, False),
    ("load", "fio", 0.85, False),
    ("load", "torch.save", 1.0, True),
    ("load", "safetensors", 1.0, True),
]


# --------------------------------------------------------------------------------------------
# file-system helpers


def _fsync_path(path: str, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (``root`` included), bottom-up."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                _fsync_path(p)
        _fsync_path(dirpath, directory=True)


def tree_files(root: str) -> list[str]:
    out = []
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(p)
    return out


def drop_caches_supported() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def make_cold(root: str, mode: str) -> None:
    """Evict ``root``'s files from the page cache (``mode`` 'drop_caches' or 'fadvise')."""
    os.sync()
    if mode == "drop_caches":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return
    for p in tree_files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def touch_pages(obj: Any) -> None:
    """Read one byte of every 4 KiB page of every tensor (forces lazily mapped data in)."""
    for _, t in iter_tensors(obj):
        if t.numel() == 0:
            continue
        flat = (
            t.detach().reshape(-1).view(torch.uint8)
            if t.is_contiguous()
            else t.detach().contiguous().reshape(-1).view(torch.uint8)
        )
        flat[::4096].sum()
        flat[-1].item()


# --------------------------------------------------------------------------------------------
# safetensors: flatten the checkpoint to named tensors + a JSON skeleton


def _encode(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], seen: set[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or not t.is_contiguous() or t.numel() * t.element_size() != t.untyped_storage().nbytes():
            # safetensors refuses tensors sharing storage (tied weights, views): store a private copy
            t = t.contiguous().clone()
        seen.add(ptr)
        tensors[prefix] = t
        return {"t": prefix}
    if isinstance(obj, dict):
        return {
            "d": [
                [_encode_key(k), _encode(v, f"{prefix}/{k}" if prefix else str(k), tensors, seen)]
                for k, v in obj.items()
            ]
        }
    if isinstance(obj, list):
        return {"l": [_encode(v, f"{prefix}/{i}" if prefix else str(i), tensors, seen) for i, v in enumerate(obj)]}
    if isinstance(obj, tuple):
        return {"u": [_encode(v, f"{prefix}/{i}" if prefix else str(i), tensors, seen) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise TypeError(f"safetensors method cannot encode {type(obj).__name__} at {prefix!r}")


def _encode_key(k: Any) -> Any:
    if isinstance(k, (str, int)) and not isinstance(k, bool):
        return k
    raise TypeError(f"unsupported dict key {k!r}")


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    ((tag, val),) = node.items()
    if tag == "t":
        return tensors[val]
    if tag == "d":
        return {k: _decode(v, tensors) for k, v in val}
    if tag == "l":
        return [_decode(v, tensors) for v in val]
    if tag == "u":
        return tuple(_decode(v, tensors) for v in val)
    return val


def safetensors_flatten(checkpoint: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(checkpoint, "", tensors, set())
    return tensors, {"skeleton": json.dumps(skeleton, separators=(",", ":"))}


def safetensors_unflatten(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Any:
    return _decode(json.loads(metadata["skeleton"]), tensors)


# --------------------------------------------------------------------------------------------
# methods


class Method:
    """One way of saving/loading. ``save`` writes under ``workdir`` and returns the target."""

    name = ""

    def setup(self) -> None:  # outside the timings, once
        pass

    def before_save(self, checkpoint: dict[str, Any], workdir: str) -> None:  # outside the timings, every save
        pass

    def save(self, checkpoint: dict[str, Any], workdir: str) -> str:
        raise NotImplementedError

    def prepare_load(self, target: str, reference: dict[str, Any]) -> Any:  # outside timing
        return None

    def load(self, target: str, prepared: Any) -> Any:
        raise NotImplementedError

    def remove(self, target: str) -> None:
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.remove(target)

    def info(self) -> dict[str, Any]:
        return {}


class _CheckpointIOMethod(Method):
    """A method measured through a Lightning CheckpointIO plugin (``make_io`` says which)."""

    def make_io(self) -> Any:
        raise NotImplementedError

    def setup(self) -> None:
        self.io = self.make_io()

    def save(self, checkpoint, workdir):
        target = os.path.join(workdir, "last.ckpt")
        self.io.save_checkpoint(checkpoint, target)
        return target

    def load(self, target, prepared):
        return self.io.load_checkpoint(target)

    def remove(self, target):
        self.io.remove_checkpoint(target)
        super().remove(target)


class UringMethod(_CheckpointIOMethod):
    """The plugin's save to a new file (a file it removes is not kept for the next save: ``uring-recycled`` is)."""

    name = "uring"

    def make_io(self) -> Any:
        from lightning_recover.lightning.checkpoint_io import UringCheckpointIO

        return UringCheckpointIO()

    def remove(self, target):
        super().remove(target)
        self.io.spares.discard()

    def info(self):
        return native_io_info()


class UringRecycledMethod(UringMethod):
    """The plugin's save in a directory where it has just removed the previous checkpoint (``save_top_k``
    rotation): the save writes over that file's blocks (``spare_files.py``). The previous checkpoint is saved and
    removed before the timing; ``--paired`` also times fio writing over a file of its own."""

    name = "uring-recycled"

    def setup(self) -> None:
        from lightning_recover.checkpoint.file.spare_files import SpareFiles, recycling_mode

        super().setup()
        # the plugin with recycling on (opt-in); LIGHTNING_RECOVER_RECYCLE=any also on other filesystems
        self.io.spares = SpareFiles("any" if recycling_mode() == "any" else "on")

    def before_save(self, checkpoint, workdir):
        previous = os.path.join(workdir, "previous.ckpt")
        self.io.save_checkpoint(checkpoint, previous)
        kept = self.io.spares.kept
        self.io.remove_checkpoint(previous)
        if self.io.spares.kept == kept:
            raise RuntimeError(
                f"{workdir}: the removed checkpoint was not kept (not ext4 or XFS: {env.RECYCLE}=any allows any "
                "filesystem); uring-recycled measures nothing here"
            )

    def info(self):
        return native_io_info() | {"recycled_saves": self.io.spares.taken}


class UringIntoMethod(UringMethod):
    """The plugin's resume in place (``restore_into``): the load fills a state of the same layout that exists and
    has been written to before the timing (as a model and optimizer have), instead of allocating new tensors."""

    name = "uring-into"

    def prepare_load(self, target, reference):
        return _written_like(reference)

    def load(self, target, prepared):
        with self.io.restore_into(prepared):
            return self.io.load_checkpoint(target)


def _written_like(obj: Any) -> Any:
    """``alloc_like`` with every tensor's memory written once (zeros), so that its pages are there."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _written_like(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_written_like(v) for v in obj)
    return obj


class LightningMethod(_CheckpointIOMethod):
    name = "lightning"

    def make_io(self) -> Any:
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        return TorchCheckpointIO()

    def info(self):
        import lightning

        return {"lightning": lightning.__version__}


class TorchSaveMethod(Method):
    name = "torch.save"

    def save(self, checkpoint, workdir):
        target = os.path.join(workdir, "last.pt")
        torch.save(checkpoint, target)
        return target

    def load(self, target, prepared):
        return torch.load(target, map_location="cpu", weights_only=False)


def alloc_like(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return type(obj)((k, alloc_like(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [alloc_like(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(alloc_like(v) for v in obj)
    return obj


class DCPMethod(Method):
    name = "dcp"

    def save(self, checkpoint, workdir):
        import torch.distributed.checkpoint as dcp

        target = os.path.join(workdir, "ckpt.dcp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(checkpoint, storage_writer=dcp.FileSystemWriter(target), no_dist=True)
        return target

    def prepare_load(self, target, reference):
        # A resuming job has its model and optimizer allocated already.
        return alloc_like(reference)

    def load(self, target, prepared):
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(prepared, storage_reader=dcp.FileSystemReader(target), no_dist=True)
        return prepared


class SafetensorsMethod(Method):
    name = "safetensors"

    def setup(self) -> None:
        import safetensors  # noqa: F401  (fail early if missing)

    def save(self, checkpoint, workdir):
        from safetensors.torch import save_file

        target = os.path.join(workdir, "model.safetensors")
        tensors, metadata = safetensors_flatten(checkpoint)
        save_file(tensors, target, metadata=metadata)
        return target

    def load(self, target, prepared):
        from safetensors import safe_open
        from safetensors.torch import load_file

        tensors = load_file(target)
        with safe_open(target, framework="pt") as f:
            metadata = f.metadata()
        return safetensors_unflatten(tensors, metadata)

    def info(self):
        import safetensors

        return {"safetensors": safetensors.__version__}


class _MmapLoadMethod(Method):
    """Saved like ``base``, loaded by ``torch.load(mmap=True)``: stock tools reading the file lazily."""

    base: Callable[[], Method] = Method

    def setup(self) -> None:
        self.saver = self.base()
        self.saver.setup()

    def save(self, checkpoint, workdir):
        return self.saver.save(checkpoint, workdir)

    def load(self, target, prepared):
        return torch.load(target, map_location="cpu", weights_only=True, mmap=True)


class UringMmapMethod(_MmapLoadMethod):
    name = "uring+mmap"
    base = UringMethod


class TorchSaveMmapMethod(_MmapLoadMethod):
    name = "torch.save+mmap"
    base = TorchSaveMethod


METHOD_CLASSES: dict[str, Callable[[], Method]] = {
    "uring": UringMethod,
    "uring-into": UringIntoMethod,
    "uring-recycled": UringRecycledMethod,
    "uring+mmap": UringMmapMethod,
    "torch.save+mmap": TorchSaveMmapMethod,
    "lightning": LightningMethod,
    "torch.save": TorchSaveMethod,
    "dcp": DCPMethod,
    "safetensors": SafetensorsMethod,
}


def native_io_info() -> dict[str, Any]:
    try:
        import native_io

        return {"native_io": native_io.info(), "preallocate": env.flag(env.PREALLOCATE)}
    except Exception as e:  # noqa: BLE001 - metadata only
        return {"native_io": f"unavailable: {e}"}


# --------------------------------------------------------------------------------------------
# verification


def verify(reference: dict[str, Any], loaded: Any) -> None:
    """Raise if ``loaded`` does not hold exactly the reference's tensors and scalars."""
    if not isinstance(loaded, dict):
        raise AssertionError(f"loaded a {type(loaded).__name__}, expected dict")
    ref = dict(iter_tensors(reference))
    got = dict(iter_tensors(loaded))
    if ref.keys() != got.keys():
        missing = sorted(ref.keys() - got.keys())[:5]
        extra = sorted(got.keys() - ref.keys())[:5]
        raise AssertionError(f"tensor paths differ: missing {missing}, extra {extra}")
    for k, a in ref.items():
        b = got[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError(f"tensor {k} differs")
    for key in ("epoch", "global_step"):
        if loaded.get(key) != reference[key]:
            raise AssertionError(f"{key}: {loaded.get(key)!r} != {reference[key]!r}")


# --------------------------------------------------------------------------------------------
# the run


def _mountinfo(path: str) -> dict[str, str]:
    path = os.path.realpath(path)
    best = ("", "", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        pass
    return {"device": best[0], "mount": best[1], "fstype": best[2]}


def machine_info(directory: str) -> dict[str, Any]:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_bytes": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dir": os.path.realpath(directory),
        "free_page_reporting": hypervisor_takes_free_pages(),
        **_mountinfo(directory),
    }


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _fmt(x: float | None, spec: str) -> str:
    if x is None or x != x:
        return "n/a"
    return format(x, spec)


def run_benchmark(
    size_gb: float | None,
    repeat: int,
    directory: str | None,
    methods: list[str],
    cache_mode: str = "auto",
    log: Callable[[str], None] = print,
    state: str = "gpt",
    paired: bool = False,
    fio_iodepths: tuple[int, ...] = PAIRED_FIO_IODEPTHS,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the benchmark; returns (records, meta). ``paired``: every run of a method next to a fio run."""
    root = tempfile.mkdtemp(prefix="lr-bench-ckpt-", dir=directory or "/tmp")
    try:
        return _run(size_gb, repeat, root, methods, cache_mode, log, state, paired, fio_iodepths)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _setup_methods(methods: list[str], log: Callable[[str], None]) -> tuple[dict, dict, list]:
    """Instantiate and set up the methods; returns (impls, skipped, runnable)."""
    impls: dict[str, Method] = {}
    skipped: dict[str, str] = {}
    runnable = []
    for m in methods:
        if m == "fio":
            if fio_mod.available():
                runnable.append(m)
            else:
                skipped[m] = "fio not installed"
            continue
        impl = METHOD_CLASSES[m]()
        try:
            impl.setup()
        except Exception as e:  # noqa: BLE001 - reported, the rest still runs
            skipped[m] = f"{type(e).__name__}: {e}"
            continue
        impls[m] = impl
        runnable.append(m)
    for m, why in skipped.items():
        log(f"skipping {m}: {why}")
    return impls, skipped, runnable


def _run(size_gb, repeat, root, methods, cache_mode, log, state="gpt", paired=False, fio_iodepths=PAIRED_FIO_IODEPTHS):
    cache_mode = _resolve_cache_mode(cache_mode)
    checkpoint, desc, stats = _build_logged_state(state, size_gb, log)
    nbytes = stats["bytes"]
    log(f"dir: {root}  cache: {cache_mode}  repeat: {repeat}")
    if paired:
        return _run_paired(checkpoint, stats, desc, repeat, root, methods, cache_mode, log, fio_iodepths)

    impls, skipped, runnable = _setup_methods(methods, log)
    samples, extra, errors = _run_repetitions(checkpoint, nbytes, repeat, root, runnable, impls, cache_mode, log)
    meta = {
        "bytes": nbytes,
        "gb": nbytes / 1e9,
        "size_gb_requested": desc["size_gb_requested"],
        "state_kind": state,
        "description": desc["description"],
        "config": desc["config"],
        "state": stats,
        "repeat": repeat,
        "cache": cache_mode,
        "machine": machine_info(root),
        "engine": native_io_info(),
        "skipped": skipped,
    }
    del checkpoint
    gc.collect()

    if "fio" in runnable and "fio" not in errors and extra["fio"].get("fio_depths"):
        _summarise_fio(samples["fio"], extra["fio"])

    records = []
    for m in runnable:
        rec = _method_record(m, samples[m], extra[m], errors.get(m), nbytes, stats["tensors"], repeat, cache_mode)
        if m != "fio" and m in impls:
            rec.update(impls[m].info())
        rec["meta"] = meta
        records.append(rec)
    _add_baseline_ratios(records)
    meta["targets"] = check_targets(records)
    return records, meta


def _resolve_cache_mode(cache_mode: str) -> str:
    """``auto`` becomes the strongest eviction this process may use; ``drop_caches`` must be possible."""
    if cache_mode == "auto":
        return "drop_caches" if drop_caches_supported() else "fadvise"
    if cache_mode == "drop_caches" and not drop_caches_supported():
        raise SystemExit("cannot write /proc/sys/vm/drop_caches (need root and a writable /proc/sys)")
    return cache_mode


def _build_logged_state(
    state: str, size_gb: float | None, log: Callable[[str], None]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Build the state to save and log its shape; returns (checkpoint, description, tensor stats)."""
    t0 = time.perf_counter()
    checkpoint, desc = build_state(state, size_gb)
    stats = tensor_stats(checkpoint)
    log(
        f"state {state}: {desc['description']}: {stats['tensors']} tensors, {stats['bytes'] / 1e9:.3f} GB; "
        f"{stats['tensors_lt_1mib']} tensors < 1 MiB ({stats['bytes_in_tensors_lt_1mib'] / 1e6:.2f} MB); "
        f"histogram {stats['size_histogram']} (built in {time.perf_counter() - t0:.1f}s)"
    )
    return checkpoint, desc, stats


def _run_repetitions(checkpoint, nbytes, repeat, root, runnable, impls, cache_mode, log) -> tuple[dict, dict, dict]:
    """Run every runnable method ``repeat`` times, the order rotated per repetition; a method that fails is not
    run again. Returns (samples, extra, errors), each by method."""
    samples: dict[str, dict[str, list]] = {
        m: {"save_s": [], "load_s": [], "sync_s": [], "touch_s": [], "file_bytes": [], "files": []} for m in runnable
    }
    extra: dict[str, dict[str, Any]] = {m: {} for m in runnable}
    errors: dict[str, str] = {}
    for rep in range(repeat):
        k = rep % len(runnable) if runnable else 0
        order = runnable[k:] + runnable[:k]
        for m in order:
            if m in errors:
                continue
            workdir = os.path.join(root, f"{m}-{rep}")
            os.mkdir(workdir)
            _fsync_path(root, directory=True)
            try:
                if m == "fio":
                    _run_fio(workdir, nbytes, cache_mode, samples[m], extra[m], rep)
                else:
                    _run_method(impls[m], checkpoint, workdir, cache_mode, samples[m], verify_load=True)
            except Exception as e:  # noqa: BLE001 - reported in the record
                errors[m] = f"{type(e).__name__}: {e}"
                log(f"  {m}: FAILED: {errors[m]}")
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
                gc.collect()
            if m not in errors:
                _log_repetition(m, rep, repeat, samples[m], extra[m], log)
    return samples, extra, errors


def _log_repetition(
    m: str, rep: int, repeat: int, s: dict[str, list], extra: dict[str, Any], log: Callable[[str], None]
) -> None:
    """One line per fio depth, or one for a method's save and load, of the repetition just run."""
    if m == "fio":
        for d, ds in extra["fio_depths"].items():
            log(
                f"  rep {rep + 1}/{repeat} {'fio qd' + str(d):<12} write {ds['save_s_all'][-1]:7.3f}s "
                f"({ds['save_gbps_all'][-1]:.2f} GB/s)          read {ds['load_s_all'][-1]:7.3f}s "
                f"({ds['load_gbps_all'][-1]:.2f} GB/s)"
            )
    elif s["save_s"]:
        log(
            f"  rep {rep + 1}/{repeat} {m:<12} save {s['save_s'][-1]:7.3f}s "
            f"(post-sync {s['sync_s'][-1]:.3f}s)  load {s['load_s'][-1]:7.3f}s"
        )


def _method_record(
    m: str,
    s: dict[str, list],
    extra: dict[str, Any],
    error: str | None,
    nbytes: int,
    tensors: int,
    repeat: int,
    cache_mode: str,
) -> dict[str, Any]:
    """A method's record: the medians of its samples and its GB/s (fio: over the bytes fio moved), then
    ``extra``."""
    rec: dict[str, Any] = {"method": m}
    b = extra.get("io_bytes", nbytes) if m == "fio" else nbytes
    save_s = _median(s["save_s"])
    load_s = _median(s["load_s"])
    rec.update(
        {
            "save_s": save_s if s["save_s"] else None,
            "save_gbps": b / save_s / 1e9 if s["save_s"] else None,
            "load_s": load_s if s["load_s"] else None,
            "load_gbps": b / load_s / 1e9 if s["load_s"] else None,
            "bytes": b,
            "tensors": tensors,
            "repeat": repeat,
            "runs": len(s["save_s"]),
            "cache": cache_mode,
            "save_s_all": s["save_s"],
            "load_s_all": s["load_s"],
            "sync_s_median": _median(s["sync_s"]) if s["sync_s"] else None,
            "touch_s_median": _median(s["touch_s"]) if s["touch_s"] else None,
            "file_bytes": s["file_bytes"][0] if s["file_bytes"] else None,
            "files": s["files"][0] if s["files"] else None,
            "verified": m != "fio" and error is None and bool(s["load_s"]),
            "error": error,
        }
    )
    rec.update(extra)
    return rec


def _add_baseline_ratios(records: list[dict[str, Any]]) -> None:
    """Each record's save and load GB/s over the baseline method's (None without a baseline that saved)."""
    base = next((r for r in records if r["method"] == BASELINE and r["save_gbps"]), None)
    for r in records:
        for kind in ("save", "load"):
            v = r[f"{kind}_gbps"]
            r[f"{kind}_vs_{BASELINE}"] = v / base[f"{kind}_gbps"] if base and v and base[f"{kind}_gbps"] else None


def _run_method(
    impl: Method, checkpoint, workdir, cache_mode, s, verify_load: bool, device: Optional[BlockDevice] = None
) -> None:
    """One durable save and one load of ``impl`` into ``s``'s lists; with ``device``, also what the disk did
    during each (``save_disk``, ``load_disk``: block_device.py)."""
    impl.before_save(checkpoint, workdir)
    os.sync()
    with measured(device) as save_disk:
        t0 = time.perf_counter()
        target = impl.save(checkpoint, workdir)
        t1 = time.perf_counter()
        fsync_tree(workdir)
        t2 = time.perf_counter()
    files = tree_files(workdir)
    file_bytes = sum(os.path.getsize(p) for p in files)

    prepared = impl.prepare_load(target, checkpoint)
    make_cold(workdir, cache_mode)
    with measured(device) as load_disk:
        t3 = time.perf_counter()
        loaded = impl.load(target, prepared)
        t4 = time.perf_counter()
        touch_pages(loaded)
        t5 = time.perf_counter()
    if verify_load:
        verify(checkpoint, loaded)
    del loaded, prepared
    impl.remove(target)

    s["save_s"].append(t2 - t0)
    s["sync_s"].append(t2 - t1)
    s["load_s"].append(t5 - t3)
    s["touch_s"].append(t5 - t4)
    s["file_bytes"].append(file_bytes)
    s["files"].append(len(files))
    if device:
        s.setdefault("save_disk", []).append(save_disk)
        s.setdefault("load_disk", []).append(load_disk)


def _run_fio(workdir, nbytes, cache_mode, s, extra, rep: int = 0) -> None:
    """fio write+read of the same bytes at every depth of ``fio.DEPTHS`` (order rotated per repetition).

    Each depth writes a fresh file (the previous one is removed first, so no depth overwrites
    already-allocated blocks), like every checkpoint method writes a new file.
    """
    path = os.path.join(workdir, "fio.bin")
    depths = list(fio_mod.DEPTHS)
    k = rep % len(depths)
    by = extra.setdefault(
        "fio_depths",
        {d: {"save_s_all": [], "load_s_all": [], "save_gbps_all": [], "load_gbps_all": []} for d in depths},
    )
    for d in depths[k:] + depths[:k]:
        if os.path.exists(path):
            os.remove(path)
            _fsync_path(workdir, directory=True)
        os.sync()
        if cache_mode == "drop_caches":
            make_cold(workdir, cache_mode)
        # hugetlb buffers where reserved (for the deepest depth, so every depth gets the same memory): fio's
        # default malloc'd buffers understate this virtio disk (fio.huge_iomem)
        w, r = fio_mod.run(path, nbytes, iodepth=d, iomem=fio_mod.huge_iomem(max(depths) * fio_mod.BLOCK))
        ds = by[d]
        ds["save_s_all"].append(w["seconds"])
        ds["load_s_all"].append(r["seconds"])
        ds["save_gbps_all"].append(w["gbps"])
        ds["load_gbps_all"].append(r["gbps"])
        s["file_bytes"].append(os.path.getsize(path))
        s["files"].append(1)
        extra.update(
            {
                "io_bytes": w["io_bytes"],
                "fio_engine": w["engine"],
                "fio_version": w["fio_version"],
                "fio_iomem": w["iomem"],
            }
        )
        extra.setdefault("fio_cmds", {})[d] = {"write": w["cmd"], "read": r["cmd"]}
        extra.setdefault("fio_wall_s", []).append({"iodepth": d, "write": w["wall_s"], "read": r["wall_s"]})


def _summarise_fio(s, extra) -> None:
    """Per-depth medians; the best depth (separately for write and read) becomes the fio record's numbers."""
    b = extra["io_bytes"]
    by = extra["fio_depths"]
    for d, ds in by.items():
        ds["save_s"] = _median(ds["save_s_all"])
        ds["load_s"] = _median(ds["load_s_all"])
        ds["save_gbps"] = b / ds["save_s"] / 1e9
        ds["load_gbps"] = b / ds["load_s"] / 1e9
    bw = min(by, key=lambda d: by[d]["save_s"])
    br = min(by, key=lambda d: by[d]["load_s"])
    s["save_s"] = list(by[bw]["save_s_all"])
    s["load_s"] = list(by[br]["load_s_all"])
    s["sync_s"] = [0.0]
    extra["fio_best_write_iodepth"] = bw
    extra["fio_best_read_iodepth"] = br
    extra["fio_write_cmd"] = extra["fio_cmds"][bw]["write"]
    extra["fio_read_cmd"] = extra["fio_cmds"][br]["read"]
    # JSON object keys are strings
    extra["fio_depths"] = {str(d): ds for d, ds in by.items()}
    extra["fio_cmds"] = {str(d): c for d, c in extra["fio_cmds"].items()}


# --------------------------------------------------------------------------------------------
# paired with fio: every run of a method next to a fio run of the same bytes

# (state, kind) -> (minimum paired-ratio median, where the target comes from)
PAIRED_TARGETS = {
    ("llama", "save"): (0.95, "the durable-save target"),
    ("small10k", "save"): (0.85, "the durable-save target"),
    ("gpt", "save"): (0.90, "checkpoint I/O issue"),
    ("llama", "load"): (0.85, "checkpoint I/O issue (load vs fio)"),
    ("small10k", "load"): (0.85, "checkpoint I/O issue (load vs fio)"),
    ("gpt", "load"): (0.85, "checkpoint I/O issue (load vs fio)"),
}


def run_pairs(
    methods: list[str],
    repeat: int,
    run_ours: Callable[[str, int], dict[str, Any]],
    run_fio: Callable[[str, int], dict[str, Any]],
    log: Callable[[str], None] = print,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Run every method ``repeat`` times, each run right next to one fio run; returns (pairs, errors).

    The method order rotates per repetition; inside a pair, ours runs first on even repetitions and fio
    first on odd ones (so a drifting disk does not always favour the same side). ``run_ours(m, rep)``
    returns ``save_s``, ``load_s`` and ``bytes`` (payload), ``run_fio(m, rep)`` returns ``write_s``,
    ``read_s`` and ``bytes`` (what fio moved); other keys are kept. A pair's ratio is ours' GB/s over
    fio's GB/s, each over its own bytes: > 1 means faster than fio.
    """
    pairs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    errors: dict[str, str] = {}
    for rep in range(repeat):
        k = rep % len(methods) if methods else 0
        for m in methods[k:] + methods[:k]:
            if m in errors:
                continue
            first = "ours" if rep % 2 == 0 else "fio"
            try:
                if first == "ours":
                    o = run_ours(m, rep)
                    f = run_fio(m, rep)
                else:
                    f = run_fio(m, rep)
                    o = run_ours(m, rep)
            except Exception as e:  # noqa: BLE001 - reported in the record
                errors[m] = f"{type(e).__name__}: {e}"
                log(f"  {m}: FAILED: {errors[m]}")
                continue
            pair: dict[str, Any] = {"rep": rep, "first": first}
            pair.update(o)
            pair.update({f"fio_{key}": v for key, v in f.items()})
            pair["save_ratio"] = (o["bytes"] / o["save_s"]) / (f["bytes"] / f["write_s"])
            pair["load_ratio"] = (o["bytes"] / o["load_s"]) / (f["bytes"] / f["read_s"])
            pairs[m].append(pair)
            log(
                f"  rep {rep + 1}/{repeat} {m:<10} ({first} first) save {o['save_s']:.3f}s vs fio write "
                f"{f['write_s']:.3f}s = {pair['save_ratio']:.2f}x | load {o['load_s']:.3f}s vs fio read "
                f"{f['read_s']:.3f}s = {pair['load_ratio']:.2f}x"
            )
    return pairs, errors


def summarize_pairs(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per op: the paired ratios, their median and spread, next to each side's median seconds and GB/s."""
    out: dict[str, Any] = {"pairs": len(pairs)}
    if not pairs:
        return out
    for kind, ours_key, fio_key in (("save", "save_s", "fio_write_s"), ("load", "load_s", "fio_read_s")):
        ratios = [p[f"{kind}_ratio"] for p in pairs]
        ours = _median([p[ours_key] for p in pairs])
        fio = _median([p[fio_key] for p in pairs])
        out[kind] = {
            "ratios": ratios,
            "ratio_median": _median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ours_s_all": [p[ours_key] for p in pairs],
            "fio_s_all": [p[fio_key] for p in pairs],
            "ours_s_median": ours,
            "fio_s_median": fio,
            "ours_gbps_median": pairs[0]["bytes"] / ours / 1e9,
            "fio_gbps_median": pairs[0]["fio_bytes"] / fio / 1e9,
            # the ratio of the medians, for comparison with the paired median
            "ratio_of_medians": (pairs[0]["bytes"] / ours) / (pairs[0]["fio_bytes"] / fio),
        }
        by_depth = [p.get("fio_by_depth") for p in pairs]
        if all(by_depth):
            fio_op = "write_s" if kind == "save" else "read_s"
            depths = sorted({int(d) for b in by_depth for d in b})
            per: dict[str, Any] = {}
            for d in depths:
                ratios_d = [
                    (p["bytes"] / p[ours_key]) / (p["fio_bytes"] / p["fio_by_depth"][str(d)][fio_op]) for p in pairs
                ]
                fio_d = _median([p["fio_by_depth"][str(d)][fio_op] for p in pairs])
                per[str(d)] = {
                    "ratios": ratios_d,
                    "ratio_median": _median(ratios_d),
                    "ratio_min": min(ratios_d),
                    "ratio_max": max(ratios_d),
                    "fio_s_median": fio_d,
                    "fio_gbps_median": pairs[0]["fio_bytes"] / fio_d / 1e9,
                }
            out[kind]["by_iodepth"] = per
            # which depth was fio's best in each pair, and the depth with the best median over the run
            out[kind]["fio_best_iodepth_per_pair"] = [
                p[f"fio_{'write' if kind == 'save' else 'read'}_iodepth"] for p in pairs
            ]
            out[kind]["fio_best_median_iodepth"] = int(min(per, key=lambda d: per[d]["fio_s_median"]))
        if kind == "load" and all("fio_first_touch_s" in p for p in pairs):
            # a load into fresh tensors against its floor: the device's read or the first touch of the same bytes
            # of fresh memory, whichever is longer (they can overlap); meaningless for loads into existing tensors
            ft = [
                (p["bytes"] / p[ours_key]) / (p["fio_bytes"] / max(p["fio_read_s"], p["fio_first_touch_s"]))
                for p in pairs
            ]
            out[kind]["vs_read_or_first_touch"] = {
                "ratios": ft,
                "ratio_median": _median(ft),
                "ratio_min": min(ft),
                "ratio_max": max(ft),
                "first_touch_s_all": [p["fio_first_touch_s"] for p in pairs],
                "first_touch_s_median": _median([p["fio_first_touch_s"] for p in pairs]),
            }
        factors = disk_factors(pairs, kind)
        if factors:
            out[kind]["disk_factors"] = factors
        if kind == "save" and all("fio_over_write_s" in p for p in pairs):
            # a save over a kept file against fio writing over a file of its own (wall less start-up; its runtime)
            out[kind]["vs_fio_overwrite"] = {
                key: _ratio_summary([(p["bytes"] / p["save_s"]) / (p["fio_bytes"] / p[f"fio_{src}"]) for p in pairs])
                for key, src in (("wall", "over_write_s"), ("runtime", "over_write_runtime_best_s"))
            }
        runtime_key = f"fio_{'write' if kind == 'save' else 'read'}_runtime_best_s"
        if all(runtime_key in p for p in pairs):
            # the strictest reading: against fio's own runtime at its best depth (what the device moved while
            # fio timed itself; fio's start and its file layout, which the wall clock charges it, left out)
            rr = [(p["bytes"] / p[ours_key]) / (p["fio_bytes"] / p[runtime_key]) for p in pairs]
            out[kind]["vs_fio_runtime"] = {
                "ratios": rr,
                "ratio_median": _median(rr),
                "ratio_min": min(rr),
                "ratio_max": max(rr),
                "fio_gbps_median": pairs[0]["fio_bytes"] / _median([p[runtime_key] for p in pairs]) / 1e9,
            }
    return out


def _ratio_summary(ratios: list[float]) -> dict[str, Any]:
    return {"ratios": ratios, "ratio_median": _median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def disk_factors(pairs: list[dict[str, Any]], kind: str) -> Optional[dict[str, Any]]:
    """Each pair's ratio split into the factors of ``block_device.ratio_factors`` (the disk's counters during our
    run and during the fio run the pair is against; "our bytes" are the checkpoint's payload, as in the ratio), with
    the median and spread of each, and the ratio against fio's busy time instead of its clock (``vs_fio_busy``: the
    first two factors); None unless every pair was measured."""
    ours_key, fio_key = ("save_s", "fio_write_s") if kind == "save" else ("load_s", "fio_read_s")
    disk_key, fio_disk_key = f"{kind}_disk", f"fio_{'write' if kind == 'save' else 'read'}_disk"
    split = []
    for p in pairs:
        ours, theirs = p.get(disk_key) or {}, p.get(fio_disk_key) or {}
        if "busy_s" not in ours or "busy_s" not in theirs:
            return None
        f = ratio_factors(p["bytes"], p[ours_key], ours["busy_s"], p["fio_bytes"], p[fio_key], theirs["busy_s"])
        if f is None:
            return None
        split.append(f)
    out: dict[str, Any] = {}
    for name in ("ours_busy_share", "device_pace", "ref_time_per_busy"):
        xs = [f[name] for f in split]
        out[name] = {"all": xs, "median": _median(xs), "min": min(xs), "max": max(xs)}
    # the ratio against the time the device was busy with fio's bytes, fio's own clock left out
    xs = [f["ours_busy_share"] * f["device_pace"] for f in split]
    out["vs_fio_busy"] = {"all": xs, "median": _median(xs), "min": min(xs), "max": max(xs)}
    out["ours_idle_s_all"] = [p[ours_key] - p[disk_key]["busy_s"] for p in pairs]
    return out


def paired_targets(state: str, summaries: dict[str, dict[str, Any]], method: str = BASELINE) -> list[dict[str, Any]]:
    out = []
    summ = summaries.get(method) or {}
    for kind in ("save", "load"):
        if (state, kind) not in PAIRED_TARGETS:
            continue
        minimum, source = PAIRED_TARGETS[(state, kind)]
        s = summ.get(kind)
        ratio = s["ratio_median"] if s else None
        out.append(
            {
                "what": f"{method} {kind} vs fio (median of paired ratios), state {state}",
                "target": minimum,
                "source": source,
                "ratio": ratio,
                "spread": [s["ratio_min"], s["ratio_max"]] if s else None,
                "met": (ratio >= minimum) if ratio is not None else None,
            }
        )
    return out


def _fio_pair(
    workdir: str,
    nbytes: int,
    iodepth: int,
    startup: float,
    cache_mode: str,
    iomem: Optional[str] = None,
    device: Optional[BlockDevice] = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """fio write (end_fsync) then O_DIRECT read of ``nbytes`` in ``workdir``; seconds by wall clock.

    ``write_s``/``read_s`` = the fio process's wall time less its start-up (``startup``: a one-block fio read),
    never less than fio's own ``runtime``; both raw values are kept. With ``device``, ``write_disk`` and
    ``read_disk`` say what the disk did during each fio process. ``overwrite``: then a second write over the
    file just written (``over_write_s``, ``over_write_runtime_s``, ``over_write_disk``), the reference of a save
    that writes over a kept file.
    """
    path = os.path.join(workdir, "fio.bin")
    if os.path.exists(path):  # a fresh file for every depth: none overwrites already-allocated blocks
        os.remove(path)
        _fsync_path(workdir, directory=True)
    os.sync()
    if cache_mode == "drop_caches":
        make_cold(workdir, cache_mode)
    w, r = fio_mod.run(path, nbytes, iodepth=iodepth, iomem=iomem, device=device)
    over = {}
    if overwrite:
        os.sync()
        o = fio_mod.write(path, nbytes, iodepth=iodepth, iomem=iomem, device=device)
        over = {
            "over_write_s": max(o["wall_s"] - startup, o["seconds"]),
            "over_write_runtime_s": o["seconds"],
            "over_write_disk": o["disk"],
        }
    return over | {
        "write_s": max(w["wall_s"] - startup, w["seconds"]),
        "read_s": max(r["wall_s"] - startup, r["seconds"]),
        "write_wall_s": w["wall_s"],
        "read_wall_s": r["wall_s"],
        "write_runtime_s": w["seconds"],
        "read_runtime_s": r["seconds"],
        "bytes": w["io_bytes"],
        "engine": w["engine"],
        "iomem": w["iomem"],
        "write_cmd": w["cmd"],
        "read_cmd": r["cmd"],
        "iodepth": iodepth,
        "write_disk": w["disk"],
        "read_disk": r["disk"],
    }


def best_of_depths(by_depth: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One pair's fio side from its runs at several depths (``{depth: _fio_pair result}``): the fastest write
    and the fastest read (each may come from another depth), which depth gave each, and every depth's run."""
    bw = min(by_depth, key=lambda d: by_depth[d]["write_s"])
    br = min(by_depth, key=lambda d: by_depth[d]["read_s"])
    out = dict(by_depth[bw])
    out.update(
        {
            "write_s": by_depth[bw]["write_s"],
            "read_s": by_depth[br]["read_s"],
            "write_iodepth": int(bw),
            "read_iodepth": int(br),
            "read_cmd": by_depth[br]["read_cmd"],
            "read_disk": by_depth[br].get("read_disk", {}),
            # fio's own runtime (its transfers and end fsync only: no process start, no file layout), best depth
            "write_runtime_best_s": min(r["write_runtime_s"] for r in by_depth.values()),
            "read_runtime_best_s": min(r["read_runtime_s"] for r in by_depth.values()),
            "by_depth": by_depth,
        }
    )
    if all("over_write_s" in r for r in by_depth.values()):
        out["over_write_s"] = min(r["over_write_s"] for r in by_depth.values())
        out["over_write_runtime_best_s"] = min(r["over_write_runtime_s"] for r in by_depth.values())
    out.pop("iodepth", None)
    return out


def _run_paired(checkpoint, stats, desc, repeat, root, methods, cache_mode, log, fio_iodepths):
    if not fio_mod.available():
        raise SystemExit("--paired needs fio (not installed)")
    methods = [m for m in methods if m != "fio"]
    impls, skipped, runnable = _setup_methods(methods, log)
    nbytes = stats["bytes"]
    depths = [int(d) for d in fio_iodepths]
    # One kind of buffer memory for every depth (huge pages only if they suffice for the deepest), so the
    # depths differ in nothing else.
    iomem = fio_mod.huge_iomem(max(depths) * fio_mod.BLOCK)
    startups = {d: fio_mod.startup_s(root, d, iomem=iomem) for d in depths}
    # the disk's own counters around every run, to say where each ratio goes (block_device.py)
    device = BlockDevice.under(root)
    if device.why_not:
        log(f"the disk's counters are not read: {device.why_not}")
    log(
        f"paired with fio at --iodepth {'/'.join(map(str, depths))} (best per pair) --iomem={iomem or 'malloc'}; "
        "fio start-up (one 16 MiB read, median of 3) at the start: "
        + ", ".join(f"qd{d} {t:.3f}s" for d, t in startups.items())
        + "; each fio run is charged the start-up measured right before it"
    )

    def run_ours(m: str, rep: int) -> dict[str, Any]:
        workdir = os.path.join(root, f"{m}-{rep}")
        os.mkdir(workdir)
        _fsync_path(root, directory=True)
        s: dict[str, list] = {k: [] for k in ("save_s", "load_s", "sync_s", "touch_s", "file_bytes", "files")}
        try:
            _run_method(impls[m], checkpoint, workdir, cache_mode, s, verify_load=True, device=device)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            gc.collect()
        return {k: v[0] for k, v in s.items()} | {"bytes": nbytes}

    def run_fio(m: str, rep: int) -> dict[str, Any]:
        workdir = os.path.join(root, f"fio-{m}-{rep}")
        os.mkdir(workdir)
        _fsync_path(root, directory=True)
        k = rep % len(depths)  # the depths' order rotates per repetition
        by_depth = {}
        try:
            for d in depths[k:] + depths[:k]:
                # fio's start-up varies with the machine's load (0.29-0.73 s in two runs an hour apart here): one
                # measured at the start of the run and subtracted from every wall time moved the save ratio
                # from 1.10x to 0.69x. A one-block read right before each run is charged under the same load.
                startup = fio_mod.startup_s(workdir, d, repeat=1, iomem=iomem)
                overwrite = m == "uring-recycled"  # its reference: fio writing over a file of its own
                by_depth[str(d)] = _fio_pair(workdir, nbytes, d, startup, cache_mode, iomem, device, overwrite) | {
                    "startup_s": startup
                }
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        # the other floor of a load into fresh tensors, beside the device's (first_touch.py)
        return best_of_depths(by_depth) | {"first_touch_s": first_touch_s(nbytes)}

    pairs, errors = run_pairs(runnable, repeat, run_ours, run_fio, log)
    summaries = {m: summarize_pairs(p) for m, p in pairs.items()}
    meta = {
        "mode": "paired",
        "bytes": nbytes,
        "gb": nbytes / 1e9,
        "size_gb_requested": desc["size_gb_requested"],
        "state_kind": desc["state"],
        "description": desc["description"],
        "config": desc["config"],
        "state": stats,
        "repeat": repeat,
        "cache": cache_mode,
        "fio_iodepths": depths,
        "fio_startup_s": {str(d): t for d, t in startups.items()},
        "fio_iomem": iomem or "malloc",
        "block_device": device.name,
        "block_device_unread": device.why_not,
        "machine": machine_info(root),
        "engine": native_io_info(),
        "skipped": skipped,
        "errors": errors,
    }
    meta["targets"] = paired_targets(desc["state"], summaries)
    records = []
    for m in runnable:
        summ = summaries[m]
        rec: dict[str, Any] = {"method": m, "error": errors.get(m), "pairs": pairs[m], "summary": summ}
        if m in impls:
            rec.update(impls[m].info())
        records.append(rec)
    return records, meta


def format_paired(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    head = ("method", "op", "ours s (med)", "fio s (med)", "ours GB/s", "fio GB/s", "paired ratios", "median [min-max]")
    rows = [head]
    for r in records:
        for kind, fio_op in (("save", "write"), ("load", "read")):
            s = (r.get("summary") or {}).get(kind)
            if not s:
                rows.append((r["method"] + (" (FAILED)" if r.get("error") else ""), kind, *(["n/a"] * 6)))
                continue
            rows.append(
                (
                    r["method"],
                    f"{kind} / fio {fio_op}",
                    f"{s['ours_s_median']:.3f}",
                    f"{s['fio_s_median']:.3f}",
                    f"{s['ours_gbps_median']:.2f}",
                    f"{s['fio_gbps_median']:.2f}",
                    " ".join(f"{x:.2f}" for x in s["ratios"]),
                    f"{s['ratio_median']:.2f}x [{s['ratio_min']:.2f}-{s['ratio_max']:.2f}]",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for j, row in enumerate(rows):
        lines.append(
            "| " + " | ".join(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(row)) + " |"
        )
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 1) + (":" if i >= 2 else "-") for i, w in enumerate(widths)) + "|")
    return "\n".join(lines)


def format_paired_depths(records: list[dict[str, Any]]) -> str:
    """The paired ratios against each fio depth alone (the table above is against the best depth per pair)."""
    lines = []
    for r in records:
        for kind in ("save", "load"):
            s = (r.get("summary") or {}).get(kind) or {}
            ft = s.get("vs_read_or_first_touch")
            if ft and r["method"] == BASELINE:  # the fresh-tensor load: its other floor (first_touch.py)
                lines.append(
                    f"  {r['method']} {kind} vs max(fio read, first touch of fresh memory "
                    f"{ft['first_touch_s_median']:.3f} s): {ft['ratio_median']:.2f}x [{ft['ratio_min']:.2f}-"
                    f"{ft['ratio_max']:.2f}]"
                )
            df = s.get("disk_factors")
            if df:
                share, pace, ref, busy = (
                    df[k] for k in ("ours_busy_share", "device_pace", "ref_time_per_busy", "vs_fio_busy")
                )
                lines.append(
                    f"  {r['method']} {kind}, the paired ratio's factors from the disk's counters: busy "
                    f"{share['median']:.0%} [{share['min']:.0%}-{share['max']:.0%}] of our time x our bytes at "
                    f"{pace['median']:.2f}x [{pace['min']:.2f}-{pace['max']:.2f}] fio's pace x fio's time "
                    f"{ref['median']:.2f}x [{ref['min']:.2f}-{ref['max']:.2f}] its busy time; against the device's "
                    f"busy time for fio's bytes {busy['median']:.2f}x [{busy['min']:.2f}-{busy['max']:.2f}]"
                )
            per = s.get("by_iodepth")
            if not per:
                continue
            cells = ", ".join(
                f"qd{d} {v['fio_gbps_median']:.2f} GB/s: {v['ratio_median']:.2f}x [{v['ratio_min']:.2f}-{v['ratio_max']:.2f}]"
                for d, v in per.items()
            )
            lines.append(f"  {r['method']} {kind} vs fio at each depth: {cells}")
            best = s.get("fio_best_median_iodepth")
            if best is not None and str(best) in per:
                # one depth for the whole run: the best per pair is the fastest of three noisy fio runs, which
                # sits below what any one depth gives
                v = per[str(best)]
                lines.append(
                    f"  {r['method']} {kind} vs fio at its best depth over the run (qd{best}, by median): "
                    f"{v['ratio_median']:.2f}x [{v['ratio_min']:.2f}-{v['ratio_max']:.2f}]"
                )
            rt = s.get("vs_fio_runtime")
            if rt:
                lines.append(
                    f"  {r['method']} {kind} vs fio's own runtime at its best depth ({rt['fio_gbps_median']:.2f} GB/s): "
                    f"{rt['ratio_median']:.2f}x [{rt['ratio_min']:.2f}-{rt['ratio_max']:.2f}]"
                )
            ov = s.get("vs_fio_overwrite")
            if ov:
                cells = ", ".join(
                    f"{key} {v['ratio_median']:.2f}x [{v['ratio_min']:.2f}-{v['ratio_max']:.2f}]"
                    for key, v in ov.items()
                )
                lines.append(f"  {r['method']} {kind} vs fio writing over a file of its own (best depth): {cells}")
    return "\n".join(lines)


def format_paired_targets(targets: list[dict[str, Any]]) -> str:
    lines = []
    for t in targets:
        if t["ratio"] is None:
            lines.append(f"  {t['what']}: n/a")
            continue
        lines.append(
            f"  {t['what']}: {t['ratio']:.2f}x [{t['spread'][0]:.2f}-{t['spread'][1]:.2f}] "
            f"(target >= {t['target']:.2f}x, {t['source']}) {'met' if t['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def repetition_ratios(base: dict[str, Any], ref: dict[str, Any], kind: str) -> list[float]:
    """``base``'s GB/s over ``ref``'s, repetition by repetition (the methods of one repetition ran next to each
    other). fio's side of a repetition is its fastest depth in that repetition."""
    ours = base.get(f"{kind}_s_all") or []
    if ref["method"] == "fio" and ref.get("fio_depths"):
        per_depth = [ds[f"{kind}_s_all"] for ds in ref["fio_depths"].values()]
        theirs = [min(xs[i] for xs in per_depth) for i in range(min(len(xs) for xs in per_depth))]
    else:
        theirs = ref.get(f"{kind}_s_all") or []
    return [(base["bytes"] / a) / (ref["bytes"] / b) for a, b in zip(ours, theirs)]


def check_targets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["method"]: r for r in records}
    base = by.get(BASELINE)
    out = []
    for kind, ref, minimum, strict in TARGETS:
        r = by.get(ref)
        if not base or not r or not base.get(f"{kind}_gbps") or not r.get(f"{kind}_gbps"):
            out.append({"what": f"{kind} vs {ref}", "target": minimum, "ratio": None, "met": None})
            continue
        ratio = base[f"{kind}_gbps"] / r[f"{kind}_gbps"]
        met = ratio > minimum if strict else ratio >= minimum
        item = {"what": f"{kind} vs {ref}", "target": minimum, "strict": strict, "ratio": ratio, "met": met}
        paired = repetition_ratios(base, r, kind)
        if paired:
            item.update(
                {
                    "paired_ratios": paired,
                    "paired_median": _median(paired),
                    "paired_min": min(paired),
                    "paired_max": max(paired),
                }
            )
        if ref == "fio" and r.get("fio_depths"):
            best = r.get("fio_best_write_iodepth" if kind == "save" else "fio_best_read_iodepth")
            item["what"] = f"{kind} vs fio (best of iodepth {'/'.join(r['fio_depths'])}: iodepth {best})"
            item["fio_iodepth"] = best
            # the same ratio against every depth, for reference
            item["ratio_by_iodepth"] = {
                d: base[f"{kind}_gbps"] / ds[f"{kind}_gbps"] for d, ds in r["fio_depths"].items()
            }
        out.append(item)
    return out


def format_table(records: list[dict[str, Any]]) -> str:
    head = ("method", "save s", "save GB/s", "vs uring", "load s", "load GB/s", "vs uring")
    rows = [head]
    base = next((r for r in records if r["method"] == BASELINE), None)
    for r in records:
        label = r["method"]
        if r["method"] == "fio" and r.get("fio_best_write_iodepth") is not None:
            label = f"fio (best: qd{r['fio_best_write_iodepth']} w, qd{r['fio_best_read_iodepth']} r)"
        rows.append(
            (
                label + (" (FAILED)" if r.get("error") else ""),
                _fmt(r["save_s"], ".3f"),
                _fmt(r["save_gbps"], ".3f"),
                _fmt(r.get("save_vs_uring"), ".2f") + ("x" if r.get("save_vs_uring") else ""),
                _fmt(r["load_s"], ".3f"),
                _fmt(r["load_gbps"], ".3f"),
                _fmt(r.get("load_vs_uring"), ".2f") + ("x" if r.get("load_vs_uring") else ""),
            )
        )
        for d, ds in (r.get("fio_depths") or {}).items() if r["method"] == "fio" else ():
            sv = ds["save_gbps"] / base["save_gbps"] if base and base.get("save_gbps") else None
            lv = ds["load_gbps"] / base["load_gbps"] if base and base.get("load_gbps") else None
            rows.append(
                (
                    f"  fio qd{d}",
                    _fmt(ds["save_s"], ".3f"),
                    _fmt(ds["save_gbps"], ".3f"),
                    _fmt(sv, ".2f") + ("x" if sv else ""),
                    _fmt(ds["load_s"], ".3f"),
                    _fmt(ds["load_gbps"], ".3f"),
                    _fmt(lv, ".2f") + ("x" if lv else ""),
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for j, row in enumerate(rows):
        lines.append(
            "| " + " | ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)) + " |"
        )
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|")
    return "\n".join(lines)


def format_targets(targets: list[dict[str, Any]]) -> str:
    lines = []
    for t in targets:
        if t["ratio"] is None:
            lines.append(f"  uring {t['what']}: n/a")
            continue
        op = ">" if t.get("strict") else ">="
        paired = (
            f"; paired by repetition {t['paired_median']:.2f}x [{t['paired_min']:.2f}-{t['paired_max']:.2f}]"
            if t.get("paired_ratios")
            else ""
        )
        lines.append(
            f"  uring {t['what']}: {t['ratio']:.2f}x (target {op} {t['target']:.2f}x) "
            f"{'met' if t['met'] else 'MISSED'}{paired}"
        )
    return "\n".join(lines)


def parse_depths(spec: Any) -> tuple[int, ...]:
    """``--fio-iodepth``: a depth or a comma-separated list (default :data:`PAIRED_FIO_IODEPTHS`)."""
    if spec is None or spec == "":
        return tuple(PAIRED_FIO_IODEPTHS)
    depths = tuple(int(x) for x in str(spec).split(",") if x.strip())
    if not depths or min(depths) < 1:
        raise SystemExit(f"--fio-iodepth: positive depths, e.g. 1,4,16 (got {spec!r})")
    return depths


def parse_methods(spec: str | None) -> list[str]:
    if not spec:
        return list(ALL_METHODS)
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    if "uring-v1" in methods:  # format 1 is no longer written (docs/format.md)
        raise SystemExit(
            "method uring-v1 is gone: lightning-recover no longer writes format 1. "
            "HINT: `uring` measures the format it writes (format 2, a torch.save archive)"
        )
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {ALL_METHODS}")
    return list(dict.fromkeys(methods))


def main(args: argparse.Namespace) -> int:
    methods = parse_methods(getattr(args, "methods", None))
    explicit = getattr(args, "methods", None) is not None
    state = getattr(args, "state", None) or "gpt"
    if state not in STATES:
        raise SystemExit(f"unknown state {state!r}; choose from {list(STATES)}")
    size_gb = getattr(args, "size_gb", None)
    size_gb = float(size_gb) if size_gb is not None else None
    repeat = max(1, int(getattr(args, "repeat", 3)))
    paired = bool(getattr(args, "paired", False))
    fio_iodepths = parse_depths(getattr(args, "fio_iodepth", None))
    if paired and not explicit:
        methods = [BASELINE]  # the paired mode's default: the plugin against fio
    # Not a CLI flag: tests set it to "fadvise" to leave the machine's page cache alone.
    cache_mode = getattr(args, "cache", None) or os.environ.get(env.BENCH_CACHE, "auto")
    directory = getattr(args, "dir", None)
    if directory:
        os.makedirs(directory, exist_ok=True)

    records, meta = run_benchmark(
        size_gb, repeat, directory, methods, cache_mode, state=state, paired=paired, fio_iodepths=fio_iodepths
    )
    print()
    if paired:
        print(
            f"checkpoint ({state}): {meta['gb']:.3f} GB in {meta['state']['tensors']} tensors "
            f"({meta['state']['tensors_lt_1mib']} < 1 MiB); {repeat} pairs; cache: {meta['cache']}; "
            f"fio --bs=16M --ioengine=io_uring --direct=1 at --iodepth {'/'.join(map(str, fio_iodepths))}, the best "
            "per pair (--end_fsync=1 for the write), wall clock less fio's start-up; durable save = save + "
            "fsync(files, dirs)"
        )
        print(format_paired(records, meta))
        print(format_paired_depths(records))
        print("targets:")
        print(format_paired_targets(meta["targets"]))
    else:
        print(
            f"checkpoint ({state}): {meta['gb']:.3f} GB in {meta['state']['tensors']} tensors "
            f"({meta['state']['tensors_lt_1mib']} < 1 MiB); medians of {repeat}; cache: {meta['cache']}; "
            f"durable save = save + fsync(files, dirs)"
        )
        print(format_table(records))
        print("targets:")
        print(format_targets(meta["targets"]))
    eng = meta["engine"].get("native_io")
    print(f"engine: {json.dumps(eng) if not isinstance(eng, str) else eng}")
    if meta["skipped"]:
        print(f"skipped: {meta['skipped']}")

    json_path = getattr(args, "json", None)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "records": records} if paired else records, f, indent=2, default=str)
            f.write("\n")
        print(f"wrote {json_path}")

    failed = [r["method"] for r in records if r.get("error")]
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        return 1
    if explicit and meta["skipped"]:
        return 1
    return 0
