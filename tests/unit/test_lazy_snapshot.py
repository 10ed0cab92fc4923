"""The snapshotter both lazy saves share (``checkpoint/snapshot_guard.py``), without threads: the split rule, one
save's snapshot run in the calling thread (order, race check, cancellation, errors) and the pending/wait state.
The background threads of the two paths are covered by tests/integration (test_async_checkpoint.py, test_dcp.py)."""

from __future__ import annotations

import torch

from lightning_recover.checkpoint.snapshot_guard import EAGER_BYTES, Snapshot, SnapshotRaceError, Snapshotter, is_lazy


def test_the_split_rule_copies_under_eager_bytes_at_once_and_the_rest_later():
    assert EAGER_BYTES == 1 << 20
    assert not is_lazy(EAGER_BYTES - 1, EAGER_BYTES) and is_lazy(EAGER_BYTES, EAGER_BYTES)
    assert is_lazy(0, 0), "eager_bytes=0 sends every tensor through the background copy"


def test_a_snapshot_copies_its_items_in_order_and_lets_them_go():
    a, b = torch.zeros(3), torch.ones(3)
    snap = Snapshot("io.wait_for_snapshot()", "x.ckpt")
    snap.add(("a", a), [("a", a)])
    snap.add(("b", b), [("b", b)])
    copied = []
    assert not snap.done.is_set() and snap.t_done is None
    snap.run(lambda item: copied.append(item[0]))
    assert copied == ["a", "b"] and snap.error is None
    assert snap.done.is_set() and snap.items == [] and snap.t_done is not None and snap.t_done >= snap.t_start


def test_a_tensor_changed_in_place_before_its_copy_is_done_fails_the_snapshot_with_the_callers_hint():
    w, later = torch.zeros(4), torch.zeros(4)
    snap = Snapshot("writer.wait_for_snapshot()", "ck")
    snap.add(0, [("model.w", w)])
    snap.add(1, [("model.later", later)])
    w.add_(1.0)  # e.g. an EMA update outside optimizer.step()
    copied = []
    snap.run(copied.append)
    assert copied == [0], "the race is found once the changed tensor's item is copied; the snapshot stops there"
    assert isinstance(snap.error, SnapshotRaceError) and snap.done.is_set()
    msg = str(snap.error)
    assert "model.w was changed in place (version 0 -> 1) before the lazy snapshot of ck was complete" in msg
    assert "HINT: call writer.wait_for_snapshot() before changing checkpointed tensors outside optimizer.step()" in msg


def test_versions_are_compared_after_each_copy_and_tensors_without_a_version_counter_are_skipped():
    w = torch.zeros(4)
    with torch.inference_mode():
        frozen = torch.zeros(4)  # inference tensors have no version counter
    snap = Snapshot("hint")
    snap.add(0, [("w", w), ("frozen", frozen)])
    snap.run(lambda item: w.zero_())  # changed while its item was being copied
    assert isinstance(snap.error, SnapshotRaceError) and "before the lazy snapshot was complete" in str(snap.error)
    snap = Snapshot("hint")
    snap.add(0, [("frozen", frozen)])
    snap.run(lambda item: None)
    assert snap.error is None


def test_a_cancelled_or_failing_copy_ends_the_snapshot_with_its_error_kept():
    snap = Snapshot("hint")
    for i in range(3):
        snap.add(i, [])
    copied = []
    snap.run(lambda i: copied.append(i) or (False if i == 1 else None))
    assert copied == [0, 1] and snap.error is None and snap.done.is_set()

    def no_memory(item):
        raise MemoryError("staging")

    snap = Snapshot("hint")
    snap.add(0, [])
    snap.run(no_memory)  # never raised in the copying thread: the saver reports it with its save
    assert isinstance(snap.error, MemoryError) and snap.done.is_set()


def test_a_snapshotter_is_pending_until_its_last_snapshot_is_done():
    saver = Snapshotter()
    assert saver.eager_bytes == EAGER_BYTES and Snapshotter(0).eager_bytes == 0
    assert not saver.snapshot_pending() and saver.wait_for_snapshot() >= 0
    saver._last = snap = Snapshot("hint")
    assert saver.snapshot_pending()
    snap.run(lambda item: None)
    assert not saver.snapshot_pending() and saver.wait_for_snapshot() < 1.0
