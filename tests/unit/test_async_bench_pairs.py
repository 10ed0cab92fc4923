"""The async benchmark's comparison with fio: each save against fio's in the same repetition."""

from __future__ import annotations

from lightning_recover.bench.async_checkpoint import step_ratios_vs


def _rec(rep: int, method: str, ratio: float) -> dict:
    return {"rep": rep, "method": method, "step_ratio": ratio}


def test_each_repetition_is_divided_by_the_reference_of_the_same_repetition_in_repetition_order():
    records = [
        _rec(1, "fio-write", 1.25),
        _rec(0, "uring-async", 1.2),
        _rec(1, "uring-async", 1.0),
        _rec(0, "fio-write", 1.5),
    ]
    assert step_ratios_vs(records, "uring-async", "fio-write") == [1.2 / 1.5, 1.0 / 1.25]


def test_a_repetition_without_both_methods_is_left_out():
    records = [_rec(0, "uring-async", 1.2), _rec(1, "uring-async", 1.1), _rec(1, "fio-write", 1.1)]
    assert step_ratios_vs(records, "uring-async", "fio-write") == [1.0]
    assert step_ratios_vs(records, "uring-async-paced", "fio-write") == []
