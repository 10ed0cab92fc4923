"""Lazy asynchronous saves: snapshot into a bounded, reused staging buffer while training continues.

How a save proceeds (see ``docs/checkpointing.md`` for the user-facing guarantees):

1. ``submit()`` (the training thread) pickles the non-tensor state (``data.pkl``), plans the archive layout and
   copies *small* storages (< ``eager_bytes``) right away. Large ones are only *referenced* (its ``Snapshot``).
2. The **copier** thread runs the snapshot: it copies the referenced storages, in file order, in chunks, into a
   ring-shaped staging buffer (host memory allocated once and reused; ``staging_bytes`` bounds it). When the ring
   is full it waits for the flusher (back-pressure). When the last chunk is copied the snapshot is complete.
3. The **flusher** thread writes the leading records, eager storages and staged chunks through ``native_io``
   into an unnamed file in the target directory (``O_TMPFILE``; a hidden temporary name where the filesystem has
   no unnamed files), releases ring space as it goes, writes the closing records (integrity record, central
   directory), ``fdatasync``s, links the file to a temporary name, renames that onto the final name and fsyncs
   the directory: the final name appears only
   once the file is durable, and while the save is in flight nothing but the name's placeholder is listed.

Consistency (``snapshot_guard``, shared with the DCP path): every ``optimizer.step()`` waits until all pending
snapshots are complete; anything else that modifies large checkpointed tensors in place before that must call
``wait_for_snapshot()`` first. A lazily copied tensor changed in place before its copy was done fails that save
(``SnapshotRaceError`` as the cause), nothing is committed.

Names in flight: ``submit`` reserves the final name at once with an empty placeholder file when nothing is
there yet (so ``os.path.exists`` -- ModelCheckpoint's ``-vN`` versioning -- sees it as taken); the commit
renames the durable file over it, a failed save removes it. Loaders treat an empty file as
:class:`CheckpointIncompleteError`. A process-wide registry (:func:`wait_for_path`) lets any load of a path
wait for that path's in-flight save.

Errors of the background threads (saves and deferred removals) are kept and raised in the training thread at
the next ``submit``, ``remove``, ``optimizer.step()``, ``wait_for_snapshot``/``wait_until_durable``, load or
``close``; the threads themselves never die of them.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import shutil
import threading
import time
import weakref
from typing import Any, Optional

import torch

from lightning_recover.checkpoint import snapshot_guard
from lightning_recover.checkpoint.engine import huge_page_bytes, open_writer
from lightning_recover.checkpoint.file.spare_files import SpareFiles, writer_over
from lightning_recover.checkpoint.file.state_tensors import storage_as_bytes, tensor_paths
from lightning_recover.checkpoint.file.torch_zip import ALIGN, PlanWriter, ZipPlan, file_meta, plan_archive
from lightning_recover.checkpoint.files import cleanup_stale_temps, commit, temp_path_for, unlink_quiet

log = logging.getLogger(__name__)

__all__ = [
    "AsyncCheckpointError",
    "AsyncSaver",
    "check_flush_rate",
    "crc32c_combine",
    "remove_path",
    "wait_for_path",
]

MiB = 1 << 20


def check_flush_rate(bytes_per_s: Optional[float]) -> Optional[float]:
    """``bytes_per_s`` if it is a usable flush rate (None: unpaced), else a ValueError saying what is expected."""
    if bytes_per_s is not None and not bytes_per_s > 0:
        raise ValueError(
            f"flush_bytes_per_s must be a positive number of bytes per second (or None), not {bytes_per_s}"
        )
    return bytes_per_s


class AsyncCheckpointError(RuntimeError):
    """A background checkpoint save failed; ``path`` is the checkpoint, ``__cause__`` the original error."""

    def __init__(self, message: str, path: Optional[str] = None) -> None:
        super().__init__(message)
        self.path = path


# --------------------------------------------------------------------------- in-flight saves, process-wide

_inflight_lock = threading.Lock()
_inflight: dict[str, list] = {}  # absolute path -> its saves not yet durable (or failed), in submit order


def _register(job: _Job) -> None:
    with _inflight_lock:
        _inflight.setdefault(job.path, []).append(job)


def _unregister(job: _Job) -> None:
    with _inflight_lock:
        jobs = _inflight.get(job.path)
        if jobs is not None and job in jobs:
            jobs.remove(job)
            if not jobs:
                del _inflight[job.path]


def wait_for_path(path: Any, timeout: Optional[float] = None) -> bool:
    """Wait until every in-flight asynchronous save to ``path`` (by any saver in this process) is durable or failed.

    Only that path's saves are waited for. Returns False if ``timeout`` expired first. Errors of those saves
    are raised by their own saver, not here.
    """
    path = os.path.abspath(os.fspath(path))
    with _inflight_lock:
        jobs = list(_inflight.get(path, ()))
    deadline = None if timeout is None else time.monotonic() + timeout
    for job in jobs:
        while not job.done.wait(0.5):
            owner = job.owner()
            if owner is None or not owner.threads_alive():
                raise AsyncCheckpointError(f"the background thread saving {path} is gone; the save is lost", path)
            if deadline is not None and time.monotonic() >= deadline:
                return False
    return True


# ------------------------------------------------------------------------------------ crc32c combine

_POLY = 0x82F63B78  # CRC-32C, reflected
# _byte_ops()[k]: the GF(2) operator appending 2**k zero bytes, for every length a file can have. Built whole on
# first use and published as one immutable tuple: the flushers of several savers (and any thread) combine at the
# same time, and a list filled step by step would let one of them see, or extend, another's half-built list.
_byte_ops_table: Optional[tuple] = None
_byte_ops_lock = threading.Lock()


def _gf2_times(mat: tuple, vec: int) -> int:
    s = 0
    i = 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat: tuple) -> tuple:
    return tuple(_gf2_times(mat, mat[n]) for n in range(32))


def _byte_ops() -> tuple:
    global _byte_ops_table
    table = _byte_ops_table
    if table is None:
        with _byte_ops_lock:
            if _byte_ops_table is None:
                m = (_POLY, *(1 << n for n in range(31)))  # appending one zero bit
                for _ in range(3):  # 1 -> 2 -> 4 -> 8 bits
                    m = _gf2_square(m)
                ops = [m]
                while len(ops) < 64:
                    ops.append(_gf2_square(ops[-1]))
                _byte_ops_table = tuple(ops)
            table = _byte_ops_table
    return table


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)`` (``0 <= len(B) < 2**64``); thread-safe."""
    if not 0 <= len2 < 1 << 64:
        raise ValueError(f"len2 must be in [0, 2**64), not {len2}")
    ops = _byte_ops()
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(ops[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


# ------------------------------------------------------------------------------------------ staging ring


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _host_staging(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory for the ring: pinned where CUDA copies into it; otherwise on huge pages
    (``engine.huge_page_bytes``), since the flusher sends the ring's bytes to the disk uncopied, and not inherited
    by forked children (only the saver's threads, which a child does not have, use the ring)."""
    if torch.cuda.is_available():  # pragma: no cover - no GPU here
        raw = torch.empty(nbytes, dtype=torch.uint8)
        try:
            return raw.pin_memory()
        except RuntimeError:
            return raw
    return huge_page_bytes(nbytes, fork_inherits=False)


class _Ring:
    """FIFO allocator over one host buffer: regions are released in the order they were reserved.

    The buffer and every region start on an ``ALIGN`` (4096) boundary, so the flusher can hand a region to an
    O_DIRECT write as it is (``Writer.write_unstaged``) instead of copying it into the engine's arena.
    """

    def __init__(self) -> None:
        self.buf: Optional[torch.Tensor] = None
        self.capacity = 0
        self._allocs: collections.deque = collections.deque()  # (start, end)
        self._head = 0
        self._cv = threading.Condition()

    def ensure(self, capacity: int) -> None:
        """(Re)allocate to ``capacity`` bytes; only when the ring is idle (called by the copier)."""
        if self.buf is not None and self.capacity >= capacity:
            return
        with self._cv:
            while self._allocs:
                self._cv.wait()
            self.buf = None
            raw = _host_staging(capacity + ALIGN)
            pad = -raw.data_ptr() % ALIGN
            self.buf, self.capacity, self._head = raw[pad : pad + capacity], capacity, 0

    def _fit(self, n: int) -> Optional[int]:
        if not self._allocs:
            return 0 if n <= self.capacity else None
        first, last = self._allocs[0][0], self._allocs[-1]
        if last[0] >= first:  # not wrapped: used region is [first, head)
            if self.capacity - self._head >= n:
                return self._head
            return 0 if first >= n else None
        return self._head if first - self._head >= n else None  # wrapped: free region is [head, first)

    def reserve(self, n: int, cancelled: Any) -> Optional[int]:
        """Start of ``n`` free bytes (waits for releases); None if ``cancelled()`` became true."""
        n = _align_up(n)
        with self._cv:
            while True:
                if cancelled():
                    return None
                at = self._fit(n)
                if at is not None:
                    self._allocs.append((at, at + n))
                    self._head = at + n
                    return at
                self._cv.wait(0.5)

    def release(self) -> None:
        with self._cv:
            self._allocs.popleft()
            if not self._allocs:
                self._head = 0
            self._cv.notify_all()

    def free(self) -> None:
        with self._cv:
            if not self._allocs:
                self.buf, self.capacity, self._head = None, 0, 0

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


# ------------------------------------------------------------------------------------------------- jobs


class _Job:
    def __init__(self, path: str, plan: ZipPlan, eager: list, snap: snapshot_guard.Snapshot) -> None:
        self.path = path
        self.directory = os.path.dirname(path)
        self.plan = plan
        self.eager = eager  # [(storage index, uint8 tensor copy)]
        self.snap = snap  # its items: (storage index, uint8 tensor view of the live storage)
        self.lazy_bytes = sum(_align_up(int(t.numel())) for (_, t), _ in snap.items)  # in the ring, aligned
        self.crcs: dict[int, list] = {}  # storage index -> [(crc, length)] of its chunks, in order
        self.tmp: Optional[str] = None
        self.anon_fd: Optional[int] = None  # the unnamed (O_TMPFILE) file being written, when the filesystem has them
        self.writer: Any = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.t_durable: Optional[float] = None
        self.paced_until: Optional[float] = None  # with a flush rate: when the next chunk may be written
        self.direct = False  # the file was written with O_DIRECT
        self.unstaged_bytes = 0  # storage bytes the engine wrote straight from the ring (no copy into its arena)
        self.placeholder: Optional[tuple] = None  # (st_dev, st_ino) of the empty file this save created
        self.owner: Any = lambda: None

    def fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e

    def pace(self, nbytes: int, bytes_per_s: Optional[float]) -> None:
        """With a flush rate: wait until this job's chunks so far fit it, then count ``nbytes`` more."""
        if bytes_per_s is None or self.error is not None:
            return
        now = time.perf_counter()
        if self.paced_until is not None and self.paced_until > now:
            time.sleep(self.paced_until - now)
            now = self.paced_until
        self.paced_until = now + nbytes / bytes_per_s

    def write_eager(self, below: Optional[int]) -> None:
        """Write the eager (already copied) storages that precede storage ``below`` (all if None).

        The writer takes increasing offsets only, and storages are laid out in index order.
        """
        k = 0
        while k < len(self.eager) and (below is None or self.eager[k][0] < below):
            k += 1
        if not k:
            return
        batch, self.eager = self.eager[:k], self.eager[k:]
        crcs = self.writer.write([(self.plan.storage_record[i].data_offset, t.numpy()) for i, t in batch])
        for (i, _), crc in zip(batch, crcs):
            self.plan.set_crc32c(i, crc)

    def finish(self, spares: Optional[SpareFiles] = None) -> None:
        """Write what is left (eager storages, the tail with every record's CRC-32C), fdatasync, commit (keeping the
        file it replaces in ``spares``, when given)."""
        self.write_eager(below=None)
        for i, parts in self.crcs.items():
            crc = 0
            for c, m in parts:
                crc = crc32c_combine(crc, c, m)
            self.plan.set_crc32c(i, crc)
        self.writer.finish()
        self.unstaged_bytes, self.direct = self.writer.writer.unstaged_bytes, self.writer.writer.direct
        if self.anon_fd is not None:  # the durable unnamed file gets a (temporary) name only now
            self.tmp = temp_path_for(self.path)
            _link_unnamed(self.anon_fd, self.tmp)
            self.close_anon()
        if spares is not None:
            spares.keep_replaced(self.path)
        commit(self.tmp, self.path)

    def close_anon(self) -> None:
        fd, self.anon_fd = self.anon_fd, None
        if fd is not None:
            os.close(fd)

    def discard(self) -> None:
        """A failed save: close and remove the temporary file, give the name back if we reserved it."""
        if self.writer is not None:
            try:
                self.writer.close()
            except BaseException:
                pass
        try:
            self.close_anon()  # an unnamed file just goes away
        except OSError:
            pass
        if self.tmp is not None:
            unlink_quiet(self.tmp)
        _drop_placeholder(self)

    def timings(self) -> dict:
        t_durable, t_submit = self.t_durable or time.perf_counter(), self.snap.t_start
        return {
            "path": self.path,
            "snapshot_s": (self.snap.t_done or t_durable) - t_submit,
            "durable_s": t_durable - t_submit,
            "t_submit": t_submit,
            "t_snapshot": self.snap.t_done,
            "t_durable": self.t_durable,
            "direct": self.direct,
            "unstaged_bytes": self.unstaged_bytes,
            "error": None if self.error is None else repr(self.error),
        }


class _Removal:
    def __init__(self, path: str, after: list) -> None:
        self.path = path
        self.after = after  # jobs that must be durable before the file may go


_STOP = object()


class _SaverThread(threading.Thread):
    """A copier or flusher thread; it exits by itself once every save submitted so far is durable or failed.

    ``stop()`` waits for that. It follows the convention of Lightning's test suite (and others'), which calls
    ``stop()`` on a daemon thread that outlived a test and then expects it gone: saves still in flight complete
    instead of being abandoned, and their errors surface at the plugin's next call.
    """

    def stop(self, timeout: Optional[float] = None) -> None:
        self.join(timeout)


# every live saver, for the exit handler
_savers: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:  # pragma: no cover - runs in a subprocess: test_interpreter_exit_drains_a_save_in_flight
    for s in list(_savers):
        try:
            s.close(raise_errors=False)
        except Exception:
            pass


# ------------------------------------------------------------------------------------------------ saver


class AsyncSaver(snapshot_guard.Snapshotter):
    """Background saver used by ``AsyncUringCheckpointIO`` (one per plugin).

    Args:
        engine: an ``EngineHandle`` (``engine.py``) used only by the flusher.
        staging_bytes: size of the staging ring. None: the lazily copied bytes of the first checkpoint
            (grown when a later one is bigger), so a snapshot never waits for the disk.
        chunk_bytes: copy/write granularity of large storages.
        eager_bytes: storages smaller than this are copied during ``submit`` (cheap; covers buffers updated in
            ``forward`` such as BatchNorm statistics, and AdamW's step counters).
        flush_bytes_per_s: pace the flusher's writes of staged chunks to at most this many bytes per second
            (None: as fast as the disk takes them). Spreads what the write costs the training steps over more
            of them (benchmarks/LOG.md: on this VM the disk's writes take the guests' CPUs, whoever writes).
        spares: files kept from removed or replaced checkpoints (``spare_files.py``): a save writes over the one
            kept in its directory, a removal keeps the file, a commit keeps the file it replaces. None: neither.
    """

    def __init__(
        self,
        engine: Any,
        staging_bytes: Optional[int] = None,
        chunk_bytes: int = 64 * MiB,
        eager_bytes: int = snapshot_guard.EAGER_BYTES,
        flush_bytes_per_s: Optional[float] = None,
        spares: Optional[SpareFiles] = None,
    ) -> None:
        if staging_bytes is not None and staging_bytes < 4096:
            raise ValueError("staging_bytes must be at least 4096")
        super().__init__(eager_bytes)
        self.flush_bytes_per_s = check_flush_rate(flush_bytes_per_s)
        self._engine = engine
        self._spares = spares
        self.staging_bytes = staging_bytes
        self.chunk_bytes = max(4096, int(chunk_bytes))
        self._ring = _Ring()
        self._pid = os.getpid()  # a forked child has a copy of this saver, but none of its threads or saves
        self._copy_q: queue.Queue = queue.Queue()
        self._flush_q: queue.Queue = queue.Queue()
        self._threads: list = []
        self._retiring = False  # the threads were told to exit (idle); the next submit starts new ones
        self._lock = threading.Lock()
        self._jobs: list = []  # submitted and not yet done, in order
        self._errors: list = []
        self.history: list = []  # finished jobs' timings: dict(path, snapshot_s, durable_s, bytes, error)

    # ---------------------------------------------------------------- training-thread API

    def submit(self, checkpoint: Any, path: str) -> None:
        self.raise_errors()

        path = os.path.abspath(os.fspath(path))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        zplan = plan_archive(checkpoint, meta=file_meta())
        by_storage: dict[tuple, list] = {}
        for name, t in tensor_paths(checkpoint).values():
            try:
                key = (t.device, t.untyped_storage().data_ptr())
            except Exception:
                continue
            by_storage.setdefault(key, []).append((name, t))
        eager, snap = [], snapshot_guard.Snapshot("io.wait_for_snapshot()", path)
        for i, st in enumerate(zplan.storages):
            n = zplan.storage_record[i].nbytes
            if n == 0:
                continue
            u8 = storage_as_bytes(st)
            if snapshot_guard.is_lazy(n, self.eager_bytes):
                snap.add((i, u8), by_storage.get((st.device, st.data_ptr()), ()))
            else:
                eager.append((i, u8.to("cpu", copy=True)))
        job = _Job(path, zplan, eager, snap)
        job.owner = weakref.ref(self)
        _savers.add(self)
        job.placeholder = _reserve_name(path)  # the name is taken from now on (ModelCheckpoint's -vN)
        _register(job)
        with self._lock:  # with the lock: the threads cannot retire between starting and the put
            self._start()
            self._jobs.append(job)
            self._last = job.snap
            self._copy_q.put(job)
        snapshot_guard.track(self)  # now that the job shows as pending: the next optimizer step waits for it

    def remove(self, path: str) -> None:
        """Remove ``path`` (a directory recursively) once every save submitted so far is durable (kept if one of
        them failed)."""
        self.raise_errors()
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            pending = [j for j in self._jobs if not j.done.is_set()]
            if pending:  # queued before the threads can retire (they retire when no job is left)
                self._copy_q.put(_Removal(path, pending))
                return
        self._remove_now(path)

    def _remove_now(self, path: str) -> None:
        if self._spares is None or not self._spares.keep_removed(path):
            remove_path(path)

    def snapshot_pending(self) -> bool:
        return bool(self._errors) or super().snapshot_pending()

    def wait_for_snapshot(self) -> float:
        """Block until every submitted save has copied its tensors; returns the seconds waited."""
        waited = super().wait_for_snapshot()
        self.raise_errors()
        return waited

    def wait_until_durable(self) -> float:
        """Block until every submitted save is durable (or failed); raises a background error."""
        t0 = time.perf_counter()
        self._join(self._copy_q)
        self._join(self._flush_q)
        self.raise_errors()
        return time.perf_counter() - t0

    def pending(self) -> int:
        with self._lock:
            return sum(1 for j in self._jobs if not j.done.is_set())

    def raise_errors(self) -> None:
        with self._lock:
            errs, self._errors = self._errors, []
        if errs:
            item, e = errs[0]
            more = f" (and {len(errs) - 1} more failures)" if len(errs) > 1 else ""
            if isinstance(item, _Removal):
                msg = f"asynchronous removal of checkpoint {item.path} failed: {type(e).__name__}: {e}{more}"
            else:
                msg = (
                    f"asynchronous checkpoint save to {item.path} failed: {type(e).__name__}: {e}{more}; "
                    "the previous checkpoint under that name (if any) is unchanged"
                )
            raise AsyncCheckpointError(msg, item.path) from e

    def threads_alive(self) -> bool:
        """False when a background thread died (or in a forked child, which has none of them); retiring (idle)
        threads are expected to exit."""
        if os.getpid() != self._pid:
            return False
        return self._retiring or all(t.is_alive() for t in self._threads)

    def _check_alive(self) -> None:
        if not self.threads_alive():
            raise AsyncCheckpointError("a background checkpoint thread died; pending saves are lost")

    def _join(self, q: queue.Queue) -> None:
        """``q.join()`` that raises instead of waiting forever if a background thread is gone."""
        with q.all_tasks_done:
            while q.unfinished_tasks:
                self._check_alive()
                q.all_tasks_done.wait(0.5)

    def close(self, raise_errors: bool = True) -> None:
        """Wait for durability of everything submitted, stop the threads and free the staging memory.

        In a forked child (its exit handler) there is nothing to wait for: the saves and threads are the parent's.
        """
        if os.getpid() != self._pid:
            _savers.discard(self)
            snapshot_guard.untrack(self)
            return
        if self._threads:
            self._join(self._copy_q)
            self._join(self._flush_q)
            self._copy_q.put(_STOP)
            for t in self._threads:
                t.join()
            self._threads = []
            self._copy_q = queue.Queue()
            self._flush_q = queue.Queue()
        self._ring.free()
        self._engine.release()
        _savers.discard(self)
        snapshot_guard.untrack(self)
        if raise_errors:
            self.raise_errors()

    # ---------------------------------------------------------------- threads

    def _start(self) -> None:
        """Start the copier and flusher (called with ``self._lock`` held).

        They exit when no save is left (``_end``), so an idle saver holds no threads (Lightning's tests and
        users' thread checks see none after the last save is durable); a retiring pair keeps its own queues.
        """
        if self._threads and not self._retiring:
            return
        if self._retiring:
            self._copy_q, self._flush_q = queue.Queue(), queue.Queue()
            self._retiring = False
        cq, fq = self._copy_q, self._flush_q
        self._threads = [
            _SaverThread(target=self._copier, args=(cq, fq), name="lr-ckpt-copier", daemon=True),
            _SaverThread(target=self._flusher, args=(fq,), name="lr-ckpt-flusher", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _copier(self, cq: queue.Queue, fq: queue.Queue) -> None:
        while True:
            job = cq.get()
            try:
                if job is _STOP:
                    fq.put(_STOP)
                    return
                if isinstance(job, _Removal):
                    fq.put(job)
                    continue
                self._snapshot(job, fq)
            finally:
                cq.task_done()

    def _snapshot(self, job: _Job, fq: queue.Queue) -> None:
        """Run ``job``'s snapshot: each lazy storage chunk by chunk into the ring, each chunk to the flusher."""
        fq.put(("begin", job))
        need = max(ALIGN, job.lazy_bytes if self.staging_bytes is None else self.staging_bytes)

        def copy(item: tuple) -> Optional[bool]:
            i, src = item
            self._ring.ensure(need)  # waits for the ring to drain and allocates only for a bigger save's first storage
            # aligned chunks keep every chunk's file offset aligned (storages start on ALIGN boundaries)
            chunk = min(self.chunk_bytes, max(ALIGN, self._ring.capacity // 4)) // ALIGN * ALIGN
            n = int(src.numel())
            for off in range(0, n, chunk):
                m = min(chunk, n - off)
                at = self._ring.reserve(m, lambda: job.error is not None)
                if at is None:
                    return False  # the flusher failed the save
                assert self._ring.buf is not None
                crc = _copy_chunk(self._ring.buf[at : at + m], src[off : off + m])
                fq.put(("chunk", job, i, off, at, m, crc))
            return None

        job.snap.run(copy)
        if job.snap.error is not None:
            job.fail(job.snap.error)
        fq.put(("end", job))

    def _flusher(self, fq: queue.Queue) -> None:
        while True:
            item = fq.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, _Removal):
                    try:
                        self._do_removal(item)
                    except BaseException as e:  # kept for the training thread; the flusher goes on
                        log.error("asynchronous removal of checkpoint %s failed: %r", item.path, e)
                        with self._lock:
                            self._errors.append((item, e))
                    continue
                kind, job = item[0], item[1]
                if kind == "chunk":
                    try:
                        if job.error is None:
                            _, _, i, off, at, m, crc = item
                            job.pace(m, self.flush_bytes_per_s)
                            job.write_eager(below=i)
                            start = job.plan.storage_record[i].data_offset
                            crc = job.writer.write_unstaged(start + off, self._ring.buf[at : at + m].numpy(), crc)
                            job.crcs.setdefault(i, []).append((int(crc), m))
                    except BaseException as e:
                        job.fail(e)
                        self._ring.wake()
                    finally:
                        self._ring.release()
                elif kind == "begin":
                    self._begin(job)
                else:
                    self._end(job)
            except BaseException as e:  # pragma: no cover - defensive: the flusher must never die
                log.exception("checkpoint flusher: unexpected error")
                if isinstance(item, tuple) and isinstance(item[1], _Job):
                    item[1].fail(e)
                    if item[0] == "end" and not item[1].done.is_set():
                        with self._lock:
                            self._errors.append((item[1], e))
                            if item[1] in self._jobs:
                                self._jobs.remove(item[1])
                        _unregister(item[1])
                        item[1].done.set()
            finally:
                fq.task_done()

    def _begin(self, job: _Job) -> None:
        try:
            cleanup_stale_temps(job.directory)
            raw = _open_kept_writer(self._engine.get(), job, self._spares)
            if raw is None:
                raw = _open_unnamed_writer(self._engine.get(), job)
            if raw is None:
                job.tmp = temp_path_for(job.path)
                raw = open_writer(self._engine.get(), job.tmp, job.plan.size_estimate())
            job.writer = PlanWriter(job.plan, raw)
        except BaseException as e:
            job.fail(e)

    def _end(self, job: _Job) -> None:
        try:
            if job.error is None:
                job.finish(self._spares)
        except BaseException as e:
            job.fail(e)
        if job.error is not None:
            job.discard()
            log.error("asynchronous checkpoint save to %s failed: %r", job.path, job.error)
            with self._lock:
                self._errors.append((job, job.error))
        job.writer = None
        job.t_durable = time.perf_counter()
        del self.history[:-99]
        self.history.append(job.timings())
        job.plan = None  # type: ignore[assignment]
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)
            if not self._jobs and not self._retiring:
                # idle: the threads exit (after any removal still queued); the next submit starts new ones
                self._retiring = True
                self._copy_q.put(_STOP)
        _unregister(job)
        job.done.set()

    def _do_removal(self, r: _Removal) -> None:
        failed = [j for j in r.after if j.error is not None]
        if failed:
            log.warning("not removing checkpoint %s: the newer save to %s failed", r.path, failed[0].path)
            return
        self._remove_now(r.path)


def _copy_chunk(dst: torch.Tensor, src: torch.Tensor) -> Optional[int]:
    """Copy a chunk of a live storage into the ring; returns its CRC-32C when it came for free.

    Host memory is copied by ``native_io.copy_crc32c``: one core, without the interpreter lock, the checksum folded
    into the copy (torch's copy would take every intra-op thread from the training step, and the checksum would
    cost a second pass). Device memory is copied by torch; the flusher then computes the CRC.
    """
    if src.device.type != "cpu":  # pragma: no cover - no GPU here
        dst.copy_(src)
        return None
    import native_io

    return native_io.copy_crc32c(dst.numpy(), src.numpy())


def _open_kept_writer(engine: Any, job: _Job, spares: Optional[SpareFiles]) -> Any:
    """A writer over the file ``spares`` keeps in ``job.directory`` (under its temporary name), or None."""
    spare = spares.take(job.directory) if spares is not None else None
    if spare is None:
        return None
    job.tmp = spare[0]
    return writer_over(engine, spare)


def _open_unnamed_writer(engine: Any, job: _Job) -> Any:
    """A writer on a new unnamed file in ``job.directory`` (``O_TMPFILE``), or None where there are none.

    While a save is in flight its data then has no name in the directory (only the placeholder is listed, e.g. by
    ModelCheckpoint or a user's ``os.listdir``), and a crash before the commit leaves nothing behind. The commit links
    the durable file to a temporary name and renames that onto the final one (``_Job.finish``).
    """
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        fd = os.open(job.directory, flag | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    except OSError:  # EOPNOTSUPP / EISDIR / EINVAL: the filesystem has no unnamed files
        return None
    try:
        # reopened through /proc (for O_DIRECT): a file that exists, reached through the fd's magic link
        raw = open_writer(engine, f"/proc/self/fd/{fd}", job.plan.size_estimate(), existing=True)
    except OSError:
        os.close(fd)
        return None
    job.anon_fd = fd
    return raw


def _link_unnamed(fd: int, path: str) -> None:
    """Give the unnamed file open as ``fd`` the name ``path``: ``linkat(AT_FDCWD, "/proc/self/fd/N", dir, name,
    AT_SYMLINK_FOLLOW)`` (``os.link`` makes that call only when given a directory fd; plain ``link(2)`` would link
    the /proc symlink itself and fail with EXDEV)."""
    d = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=d, follow_symlinks=True)
    finally:
        os.close(d)


def remove_path(path: str) -> None:
    """Remove a checkpoint file, or a checkpoint directory recursively; a missing path is not an error."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        return
    log.debug("Removed checkpoint: %s", path)


def _reserve_name(path: str) -> Optional[tuple]:
    """Create an empty placeholder at ``path`` if nothing is there; its (st_dev, st_ino), or None."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return (st.st_dev, st.st_ino)


def _drop_placeholder(job: _Job) -> None:
    """Remove the placeholder ``job`` created if it is still there and still empty (its save failed)."""
    if job.placeholder is None:
        return
    try:
        st = os.lstat(job.path)
        if (st.st_dev, st.st_ino) == job.placeholder and st.st_size == 0:
            os.unlink(job.path)
    except OSError:
        pass
