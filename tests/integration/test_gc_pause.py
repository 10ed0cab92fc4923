"""The cyclic collector is held off for one DCP save or load, and always comes back."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_recover.checkpoint import UringStorageReader, UringStorageWriter
from lightning_recover.checkpoint.gc_pause import TAIL_S, GcPause
from tests.compare import SLACK

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True)
def collector_on():
    gc.enable()
    yield
    gc.enable()


def _wait_for_the_collector(bound_s: float) -> float:
    """Seconds until the collector is back (fails past ``bound_s`` + 10 s)."""
    t0 = time.monotonic()
    while not gc.isenabled() and time.monotonic() - t0 < bound_s + 10:
        time.sleep(0.02)
    assert gc.isenabled()
    return time.monotonic() - t0


def test_pause_and_resume_are_idempotent():
    p = GcPause()
    p.pause()
    p.pause()
    assert not gc.isenabled() and p.paused
    p.resume()
    assert gc.isenabled() and not p.paused
    p.resume()
    assert gc.isenabled()


def test_a_pause_nobody_resumes_ends_by_itself():
    p = GcPause(max_s=0.2)
    p.pause()
    assert not gc.isenabled()
    deadline = time.monotonic() + 10
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gc.isenabled() and not p.paused


def test_pause_again_restarts_the_countdown_with_its_own_bound():
    p = GcPause(max_s=60)
    p.pause()
    p.pause(0.2)  # a rank's last hook: a short tail instead of the full bound
    deadline = time.monotonic() + 10
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gc.isenabled() and not p.paused


def test_an_application_that_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    p = GcPause()
    p.pause()
    p.resume()
    assert not gc.isenabled()


def test_no_pause_from_a_background_thread():
    p = GcPause()
    t = threading.Thread(target=p.pause)
    t.start()
    t.join(10)
    assert gc.isenabled() and not p.paused


def test_context_manager_pauses_for_its_body_only(tmp_path):
    from lightning_recover.checkpoint.file import single_file

    with GcPause() as p:
        assert p.paused and not gc.isenabled()
    assert gc.isenabled()
    seen = []

    class Probe:
        def __reduce__(self):  # pickled inside single_file.save
            seen.append(gc.isenabled())
            return (dict, ())

    single_file.save({"t": torch.ones(3), "probe": Probe()}, str(tmp_path / "a.ckpt"))
    assert seen and not any(seen) and gc.isenabled()
    seen.clear()

    def map_location(storage, location):  # called inside single_file.load, once per storage
        seen.append(gc.isenabled())
        return storage

    single_file.load(str(tmp_path / "a.ckpt"), map_location=map_location, weights_only=False)
    assert seen and not any(seen) and gc.isenabled()


def test_the_tail_is_bounded_by_max_s():
    p = GcPause(max_s=0.2)
    p.pause()
    p.pause_tail()  # TAIL_S is longer than this pause's own bound
    assert not gc.isenabled()
    # TAIL_S (5 s) ignored would take 5 s: the bound plus the shared slack stays well below it
    assert TAIL_S > 0.2 + SLACK
    assert _wait_for_the_collector(0.2) < 0.2 + SLACK


def test_bad_bound_is_refused():
    with pytest.raises(ValueError, match="positive"):
        GcPause(max_s=0)


class _Recording(UringStorageWriter):
    """Records whether the collector ran while this rank wrote its items."""

    def write_data(self, plan, planner):
        self.enabled_while_writing = gc.isenabled()
        return super().write_data(plan, planner)


class _FailingWrite(UringStorageWriter):
    def _write_file(self, *args):
        raise OSError("disk full (injected)")


class _FailingAfterWrite(UringStorageWriter):
    """As when another rank's write failed: DCP skips finish() on the coordinator."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner)
        raise OSError("disk full (injected)")


def test_dcp_save_and_load_pause_the_collector_and_restore_it(tmp_path):
    state = {"a": torch.arange(10.0), "b": {"c": torch.ones(3, 4)}}
    w = _Recording(str(tmp_path / "ck"), pause_gc=0.3)
    dcp.save(state, storage_writer=w)
    # still paused after the coordinator's finish (DCP's metadata broadcast follows it), back within the bound
    assert w.enabled_while_writing is False and not gc.isenabled()
    assert _wait_for_the_collector(0.3) < 0.3 + 5
    target = {"a": torch.zeros(10), "b": {"c": torch.zeros(3, 4)}}
    dcp.load(target, storage_reader=UringStorageReader(str(tmp_path / "ck")))
    assert gc.isenabled() and torch.equal(target["a"], state["a"])
    dcp.save(state, storage_writer=UringStorageWriter(str(tmp_path / "ck2"), pause_gc=False))
    assert gc.isenabled()


def test_a_failed_save_restores_the_collector(tmp_path):
    """A failure in this rank's write resumes at once; one after it (DCP calls no finish()) within the bound."""
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"a": torch.ones(4)}, storage_writer=_FailingWrite(str(tmp_path / "ck")))
    assert "disk full" in str(ei.value.failures[0])
    assert gc.isenabled()
    with pytest.raises(CheckpointException):
        dcp.save({"a": torch.ones(4)}, storage_writer=_FailingAfterWrite(str(tmp_path / "ck"), pause_gc=0.3))
    _wait_for_the_collector(0.3)
    assert not (tmp_path / "ck").exists()  # nothing committed
