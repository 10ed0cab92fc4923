"""WritePipeline: one batch written on a second thread, results handed back in order, errors not lost."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_recover.checkpoint.write_pipeline import WritePipeline


def test_batches_are_written_on_another_thread_and_done_in_order_in_the_callers():
    caller = threading.current_thread()
    writers, done = [], []

    def write(batch):
        writers.append(threading.current_thread())
        time.sleep(0.01)
        return [x * 2 for x in batch]

    pipe = WritePipeline(write, lambda batch, result: done.append((batch, result, threading.current_thread())))
    for k in range(5):
        pipe.send([k, k + 1])
    pipe.drain()
    pipe.drain()  # idempotent
    assert [(b, r) for b, r, _ in done] == [([k, k + 1], [2 * k, 2 * k + 2]) for k in range(5)]
    assert all(t is caller for _, _, t in done) and all(t is not caller for t in writers)


def test_the_next_batch_is_laid_out_while_one_is_written():
    started, release = threading.Event(), threading.Event()

    def write(batch):
        started.set()
        assert release.wait(10)
        return batch

    pipe = WritePipeline(write, lambda batch, result: None)
    pipe.send("first")
    assert started.wait(10)  # the caller goes on while "first" is still being written
    release.set()
    pipe.drain()


def test_a_write_error_is_raised_by_the_next_send_and_its_batch_is_not_done():
    done = []

    def write(batch):
        if batch == "bad":
            raise OSError("EIO (injected)")
        return batch

    pipe = WritePipeline(write, lambda batch, result: done.append(batch))
    pipe.send("ok")
    pipe.send("bad")
    with pytest.raises(OSError, match="EIO"):
        pipe.send("after")
    assert done == ["ok"]


def test_abandon_waits_for_the_batch_in_flight_and_drops_it():
    finished, done = [], []

    def write(batch):
        time.sleep(0.05)
        finished.append(batch)

    pipe = WritePipeline(write, lambda batch, result: done.append(batch))
    pipe.send("x")
    pipe.abandon()
    assert finished == ["x"] and done == []
    pipe.drain()  # nothing in flight any more
    assert done == []


def test_every_batch_is_written_by_one_thread_that_lives_until_close():
    # io_uring posts a completion through the task that submitted the transfer: the thread that wrote a batch
    # must outlive the transfers it left in flight (wait=False), so one thread writes them all until close()
    writers = []

    with WritePipeline(lambda batch: writers.append(threading.current_thread()), lambda batch, result: None) as pipe:
        for k in range(4):
            pipe.send(k)
        pipe.drain()
        assert len(writers) == 4 and len(set(writers)) == 1
        assert writers[0].is_alive()  # drained, not closed: the owner's writer may still have transfers in flight
    assert not writers[0].is_alive()
    pipe.close()  # idempotent


def test_close_waits_for_the_batch_in_flight_and_drops_its_outcome():
    done = []

    def write(batch):
        if batch == "bad":
            raise OSError("EIO (injected)")

    pipe = WritePipeline(write, lambda batch, result: done.append(batch))
    pipe.close()  # nothing sent: nothing started
    pipe = WritePipeline(write, lambda batch, result: done.append(batch))
    pipe.send("bad")
    pipe.close()  # the error of a batch nobody drains is the owner's to ignore (it is closing after a failure)
    assert done == []
