"""The disk's own counters (``bench/block_device.py``): how a stat line is read, what a measured interval says, and
how a paired ratio against fio splits into the device waiting for us, the device's pace and fio's own gaps. (A real
device read: ``tests/integration/test_bench_checkpoint.py``.)"""

from __future__ import annotations

import math

import pytest

from lightning_recover.bench.block_device import DiskCounters, parse_stat, ratio_factors, usage

# a 17-field line as the kernel writes it (Documentation/block/stat.rst), then the 11 fields of kernels before 4.18
LINE_17 = "  1000  5  40000  300  2000  7  80000  900  0  1200  1500  0  0  0  0  30  40\n"
LINE_11 = "1000 5 40000 300 2000 7 80000 900 0 1200 1500"


def test_a_stat_line_gives_requests_bytes_in_512_byte_sectors_busy_and_queue_time_and_flushes():
    assert parse_stat(LINE_17) == DiskCounters(
        read_requests=1000,
        read_bytes=40000 * 512,
        write_requests=2000,
        write_bytes=80000 * 512,
        busy_ms=1200,
        queue_ms=1500,
        flushes=30,
    )
    assert parse_stat(LINE_11).flushes == 0  # not counted before 5.5
    with pytest.raises(ValueError, match="at least 11 fields, not 3"):
        parse_stat("1 2 3")


def test_an_interval_says_what_the_device_did_in_it():
    before = DiskCounters(10, 1 << 20, 20, 2 << 20, 1000, 5000, 3)
    after = DiskCounters(12, 3 << 20, 28, 34 << 20, 1750, 8000, 4)
    u = usage(before, after, wall_s=1.0)
    assert u["busy_s"] == 0.75 and u["busy_share"] == 0.75
    assert u["mean_in_flight"] == 4.0  # 3000 request-milliseconds over 750 busy ones
    assert (u["read_requests"], u["read_bytes"], u["mean_read_request_bytes"]) == (2, 2 << 20, 1 << 20)
    assert (u["write_requests"], u["write_bytes"], u["mean_write_request_bytes"]) == (8, 32 << 20, 4 << 20)
    assert u["flushes"] == 1
    idle = usage(before, before, wall_s=0.5)
    assert idle["busy_s"] == 0 and idle["mean_read_request_bytes"] is None and idle["mean_in_flight"] is None


def test_a_paired_ratio_is_the_product_of_our_busy_share_the_device_pace_and_fio_time_per_busy():
    # ours: 2 GB in 1.0 s, the device busy 0.8 s of it; fio: 2 GB in 0.9 s, the device busy 0.85 s
    f = ratio_factors(2_000, 1.0, 0.8, 2_000, 0.9, 0.85)
    assert f is not None
    assert f["ratio"] == pytest.approx((2_000 / 1.0) / (2_000 / 0.9))
    assert f["ours_busy_share"] == pytest.approx(0.8)
    assert f["device_pace"] == pytest.approx(0.85 / 0.8)  # the device moved our bytes faster, busy for busy
    assert f["ref_time_per_busy"] == pytest.approx(0.9 / 0.85)
    assert math.prod(f[k] for k in ("ours_busy_share", "device_pace", "ref_time_per_busy")) == pytest.approx(f["ratio"])
    # other bytes on each side: the pace is per byte
    g = ratio_factors(1_000, 1.0, 1.0, 2_000, 1.0, 1.0)
    assert g is not None and g["device_pace"] == pytest.approx(0.5) and g["ratio"] == pytest.approx(0.5)
    # a side the counters never saw busy (a millisecond clock) is not split
    assert ratio_factors(1_000, 1.0, 0.0, 1_000, 1.0, 1.0) is None
