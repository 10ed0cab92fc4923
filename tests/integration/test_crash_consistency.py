"""Crash consistency (SIGKILL at random points, ENOSPC), damaged async-written files, safe loading."""

from __future__ import annotations

import argparse
import errno
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lightning_recover.checkpoint import (
    AsyncCheckpointError,
    CheckpointCorruptError,
    CheckpointIncompleteError,
    UnsafeCheckpointError,
    files,
    load,
    read_info,
    save,
    verify_file,
)
from lightning_recover.checkpoint.file.async_io import wait_for_path
from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO, UringCheckpointIO

NAMES = 4  # rotating checkpoint names r0..r3

# One helper imports torch once and forks a writer per round. A writer saves a ~24 MB state with value k to
# r{k % 4}.ckpt again and again (k increasing), sync or async, and prints "done <k>" once save k is durable.
_HELPER = textwrap.dedent("""
    import os, sys, torch
    from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO, UringCheckpointIO
    d = sys.argv[1]

    def say(line):  # one write(2) per line: a writer killed mid-print never leaves half a line before the next
        os.write(1, (line + "\\n").encode())

    def state(k):
        return {"k": k, "w": torch.full((4_000_000,), float(k)), "v": torch.full((1_000_000,), float(k)),
                "small": torch.full((100,), float(k)), "meta": {"k": k}}

    def writer(mode, k):
        io = AsyncUringCheckpointIO(max_pending_bytes=8 << 20) if mode == "async" else UringCheckpointIO()
        st = state(k)
        while True:
            io.save_checkpoint(st, os.path.join(d, f"r{k % 4}.ckpt"))
            if mode == "async":
                io.wait_for_snapshot()
                nxt = state(k + 1)           # training moves on while the flush runs
                io.wait_until_durable()
            else:
                nxt = state(k + 1)
            say(f"done {k}")
            k, st = k + 1, nxt

    say("ready")
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "go":
            pid = os.fork()
            if pid == 0:
                try:
                    writer(cmd[1], int(cmd[2]))
                finally:
                    os._exit(1)
            say(f"pid {pid}")
        elif cmd[0] == "reap":
            os.waitpid(int(cmd[1]), 0)
            say("reaped")
        else:
            break
""")


class _Lines:
    def __init__(self, proc):
        self.proc = proc
        self.buf = b""

    def _fill(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return False
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            raise AssertionError(f"the helper exited with {self.proc.wait(timeout=30)} (its stderr is above)")
        self.buf += chunk
        return True

    def drain(self) -> list:
        while self._fill(0):
            pass
        *lines, self.buf = self.buf.split(b"\n")
        return [ln.decode() for ln in lines]

    def wait_for(self, prefix: str, sink: list, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for ln in self.drain():
                if ln.startswith(prefix):
                    return ln
                sink.append(ln)
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"no {prefix!r} from the helper in {timeout}s: {_where(self.proc.pid)}; "
                    f"lines {sink[-5:]}, unread {self.buf[-200:]!r}"
                )
            self._fill(0.1)


def _check_dir(d, newest_done, seen=None):
    """Every final name is a complete, verified checkpoint; the newest durable save loads; temps never do.

    ``seen`` caches files already verified (by inode and mtime) so each round reads only what changed.
    """
    seen = {} if seen is None else seen
    for name in os.listdir(d):
        full = os.path.join(d, name)
        st = os.stat(full)
        key = (name, st.st_ino, st.st_mtime_ns, st.st_size)
        if key in seen:
            continue
        seen[key] = True
        if files.is_temp_name(name):
            try:  # a torn file is never taken as complete: it is rejected, or it is complete and verifies
                out = load(full)
            except CheckpointCorruptError:
                continue
            k = out["k"]
        else:
            assert name in {f"r{i}.ckpt" for i in range(NAMES)}, name
            if st.st_size == 0:  # the placeholder of an async save to a new name, killed in flight
                with pytest.raises(CheckpointIncompleteError):
                    load(full)
                continue
            out = load(full)  # verifies every extent
            k = out["k"]
            assert int(name[1]) == k % NAMES
        assert bool((out["w"] == k).all()) and bool((out["v"] == k).all()) and bool((out["small"] == k).all())
        assert out["meta"] == {"k": k}
    if newest_done is not None:
        out = load(os.path.join(d, f"r{newest_done % NAMES}.ckpt"))
        assert out["k"] >= newest_done and out["k"] % NAMES == newest_done % NAMES


EXIT_TIMEOUT = 120.0


def _where(pid: int) -> str:
    """The state, kernel wait channel and kernel stack of each thread of ``pid`` (what blocks its exit)."""

    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as exc:
            return f"({exc.strerror})"

    task = f"/proc/{pid}/task"
    try:
        tids = sorted(os.listdir(task))
    except OSError as exc:
        return f"process {pid}: {exc.strerror}"
    found = []
    for tid in tids:
        stat = read(f"{task}/{tid}/stat")
        state = stat.rsplit(")", 1)[1].split()[0] if ")" in stat else stat  # the field after the command name
        wchan, stack = read(f"{task}/{tid}/wchan"), read(f"{task}/{tid}/stack")
        found.append(f"thread {tid}: state {state}, wchan {wchan}, stack {stack!r}")
    return "; ".join(found)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_at_random_points_sync_and_async(tmp_path):
    rng = random.Random(20240501)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELPER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    lines = _Lines(proc)
    kills = {"sync": 0, "async": 0}
    newest = None
    k = 0
    dead = []
    completed_rounds = 0
    seen: dict = {}
    try:
        lines.wait_for("ready", [], 120)
        rounds = 0
        while rounds < 60:
            mode = "sync" if rounds % 2 == 0 else "async"
            proc.stdin.write(f"go {mode} {k}\n".encode())
            proc.stdin.flush()
            sink: list = []
            pid = int(lines.wait_for("pid", sink).split()[1])
            pidfd = os.pidfd_open(pid)  # a child not yet reaped (at worst a zombie) keeps its pid
            # kill anywhere: before the first save finishes, mid-copy, mid-flush, around fdatasync/rename
            time.sleep(rng.choice([rng.uniform(0.0, 0.05), rng.uniform(0.05, 0.4)]))
            os.kill(pid, signal.SIGKILL)
            # The test sees the writer's exit itself: its pidfd turns readable once every thread of it has exited
            # (a killed process first waits for its in-flight I/O). Only then does the helper, its parent, reap it.
            exited, _, _ = select.select([pidfd], [], [], EXIT_TIMEOUT)
            os.close(pidfd)
            assert exited, f"the killed writer {pid} did not exit in {EXIT_TIMEOUT}s: {_where(pid)}"
            proc.stdin.write(f"reap {pid}\n".encode())
            proc.stdin.flush()
            lines.wait_for("reaped", sink)
            done = [int(ln.split()[1]) for ln in sink if ln.startswith("done")]
            if done:
                newest = max(done)
                completed_rounds += 1
            k = (newest + 1) if newest is not None else k
            # the next writer starts at a higher k than anything the killed one may have written
            k += 50
            kills[mode] += 1
            dead.append(pid)
            _check_dir(str(tmp_path), newest, seen)
            rounds += 1
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdin.close()
        proc.stdout.close()
    assert kills["sync"] >= 25 and kills["async"] >= 25 and sum(kills.values()) >= 50
    assert newest is not None and completed_rounds >= 10  # saves did complete between kills
    # temporaries of killed writers are ignored by loads and removed by the next save in the directory
    save({"k": -1}, tmp_path / "other.ckpt")
    assert not [n for n in os.listdir(tmp_path) if files.is_temp_name(n)]
    print(f"kills {kills}, rounds with completed saves {completed_rounds}, newest durable k={newest}")


# ------------------------------------------------------------------------------------------- ENOSPC


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _big(k):
    return {"k": k, "w": torch.full((3_000_000,), float(k))}  # 12 MB: does not fit in 8 MB


def _small(k):
    return {"k": k, "w": torch.full((500_000,), float(k))}  # 2 MB


@pytest.mark.timeout(60)
def test_enospc_sync(small_fs):
    path = small_fs / "c.ckpt"
    io = UringCheckpointIO()
    io.save_checkpoint(_small(1), path)
    with pytest.raises(OSError) as ei:
        io.save_checkpoint(_big(2), path)
    assert ei.value.errno == errno.ENOSPC and str(small_fs) in str(ei.value)
    assert load(path)["k"] == 1
    assert [n for n in os.listdir(small_fs) if files.is_temp_name(n)] == []
    io.save_checkpoint(_small(3), path)  # space was given back
    assert load(path)["k"] == 3
    io.teardown()


@pytest.mark.timeout(60)
def test_enospc_async_surfaces_at_next_call(small_fs):
    path = small_fs / "c.ckpt"
    io = AsyncUringCheckpointIO(max_pending_bytes=1 << 20)
    io.save_checkpoint(_small(1), path)
    io.wait_until_durable()
    io.save_checkpoint(_big(2), path)  # returns: the failure happens in the background
    assert wait_for_path(path, timeout=30)
    with pytest.raises(AsyncCheckpointError, match="c.ckpt") as ei:
        io.save_checkpoint(_small(3), path)
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC
    assert load(path)["k"] == 1
    assert [n for n in os.listdir(small_fs) if files.is_temp_name(n)] == []
    io.save_checkpoint(_small(4), path)
    io.teardown()
    assert load(path)["k"] == 4


# --------------------------------------------------------------------- damaged async-written files


@pytest.fixture
def async_saved(tmp_path):
    path = tmp_path / "a.ckpt"
    io = AsyncUringCheckpointIO(max_pending_bytes=1 << 20)  # 4 MB storage in 256 KiB chunks
    io.save_checkpoint({"big": torch.arange(1_000_000, dtype=torch.float32), "b": torch.ones(7), "k": 1}, path)
    io.teardown()
    return path


def _rewrite(path, fn):
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(fn(data)))


def _inspect(path, capsys):
    from lightning_recover.checkpoint.tools import inspect_main

    rc = inspect_main(argparse.Namespace(checkpoint=str(path), no_verify=False, json=False))
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "zero_data", "zero_all", "foreign"])
def test_damaged_async_written_file_rejected_and_inspected(async_saved, tmp_path, damage, capsys):
    path = async_saved
    assert load(path)["k"] == 1
    info = read_info(path)  # format 2: a torch.save archive with an integrity record
    record = next(t["record"] for t in info.tensors if t["name"] == "big")
    st = info.index.records[record]
    offset, nbytes = st.data_offset, st.nbytes
    at = offset + nbytes // 2 + 12345  # inside a later chunk of the chunked (crc-combined) record
    if damage == "truncate":
        _rewrite(path, lambda d: d[: len(d) - 1000])
    elif damage == "bitflip":
        _rewrite(path, lambda d: d.__setitem__(at, d[at] ^ 0x10) or d)
    elif damage == "zero_data":
        _rewrite(path, lambda d: d[:offset] + bytes(nbytes) + d[offset + nbytes :])
    elif damage == "zero_all":
        _rewrite(path, lambda d: bytes(len(d)))
    else:
        path.write_bytes(b"not a checkpoint at all " * 1000)
    with pytest.raises(CheckpointCorruptError) as ei:
        load(path)
    msg = str(ei.value)
    assert str(path) in msg
    rc, out = _inspect(path, capsys)
    if damage in ("bitflip", "zero_data"):
        assert f"offset {offset}" in msg and "big" in msg
        assert rc == 1 and "big" in out and str(offset) in out
    else:
        assert rc == 2 and str(path) in out
        if damage == "foreign":
            assert "not a lightning-recover checkpoint" in msg
        if damage == "zero_all":
            assert "zero-filled" in msg


# ------------------------------------------------------------------------------------------ safe loading


class _Planted:
    """Unpickling this creates a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_planted_pickle_payload_refused_everywhere(tmp_path, asynchronous, capsys):
    from lightning_recover.checkpoint.tools import convert_main

    marker = tmp_path / "pwned"
    path = tmp_path / "e.ckpt"
    writer = AsyncUringCheckpointIO() if asynchronous else UringCheckpointIO()
    writer.save_checkpoint({"state_dict": {"w": torch.ones(300_000)}, "evil": _Planted(str(marker))}, path)
    writer.teardown()

    with pytest.raises(UnsafeCheckpointError, match="io.open"):
        load(path)
    for io in (UringCheckpointIO(), AsyncUringCheckpointIO()):
        with pytest.raises(UnsafeCheckpointError, match="io.open"):
            io.load_checkpoint(path)  # Lightning passes weights_only=None: the safe default applies
        with pytest.raises(UnsafeCheckpointError):
            io.load_checkpoint(path, weights_only=True)
    out_pt = tmp_path / "out.pt"
    assert convert_main(argparse.Namespace(checkpoint=str(path), output=str(out_pt), unsafe_pickle=False)) == 3
    assert "--unsafe-pickle" in capsys.readouterr().err
    assert not marker.exists() and not out_pt.exists()

    # explicit opt-outs load trusted old checkpoints (and run the pickle)
    out = UringCheckpointIO(weights_only=False).load_checkpoint(path)
    out["evil"].close()
    assert marker.exists()
    marker.unlink()
    out = UringCheckpointIO().load_checkpoint(path, weights_only=False)
    out["evil"].close()
    marker.unlink()
    # convert --unsafe-pickle: a trusted checkpoint with a custom class converts
    trusted = tmp_path / "t.ckpt"
    save({"w": torch.ones(3), "obj": _Trusted(7)}, trusted)
    assert convert_main(argparse.Namespace(checkpoint=str(trusted), output=str(out_pt), unsafe_pickle=False)) == 3
    assert convert_main(argparse.Namespace(checkpoint=str(trusted), output=str(out_pt), unsafe_pickle=True)) == 0
    assert torch.load(out_pt, weights_only=False)["obj"].v == 7


class _Trusted:
    def __init__(self, v):
        self.v = v


def test_fabric_load_refuses_payload(tmp_path):
    from lightning.fabric import Fabric

    marker = tmp_path / "pwned"
    save({"model": {"weight": torch.ones(2, 2)}, "evil": _Planted(str(marker))}, tmp_path / "f.ckpt")
    fabric = Fabric(plugins=[AsyncUringCheckpointIO()], accelerator="cpu", devices=1)
    with pytest.raises(UnsafeCheckpointError):
        fabric.load(tmp_path / "f.ckpt")
    assert not marker.exists()


def test_async_saves_write_the_format_of_synchronous_ones(tmp_path):
    """An async save writes what a synchronous save of the same state writes: a format-2 archive with the
    same tensors (name, dtype, shape) and a valid integrity record, which the verifier and plain
    ``torch.load(weights_only=True)`` both read back equal. (The files are not byte-identical: a record's
    file offset follows the address of the memory it was written from.)"""
    state = {"w": torch.arange(3_000_000, dtype=torch.float32), "b": torch.ones(10), "meta": {"k": 3}}
    sync_io, async_io = UringCheckpointIO(), AsyncUringCheckpointIO()
    try:
        sync_io.save_checkpoint(state, tmp_path / "sync.ckpt")
        async_io.save_checkpoint(state, tmp_path / "async.ckpt")
        async_io.wait_until_durable()
    finally:
        async_io.teardown()
        sync_io.teardown()
    infos = {}
    for name in ("sync", "async"):
        path = tmp_path / f"{name}.ckpt"
        info, damage = verify_file(path)
        assert damage == [], f"{name}: {damage}"
        infos[name] = info
        loaded = torch.load(path, weights_only=True)
        assert (
            loaded["meta"] == {"k": 3} and torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
        )
    assert infos["sync"].format_version == infos["async"].format_version == 2

    def columns(info):
        return sorted((t["name"], t["dtype"], t["shape"]) for t in info.tensors)

    assert columns(infos["sync"]) == columns(infos["async"])
