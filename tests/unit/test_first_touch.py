"""The first touch of fresh memory, the other floor of a load into new tensors (bench/first_touch.py)."""

from __future__ import annotations

import pytest

from lightning_recover.bench import first_touch


@pytest.mark.parametrize(
    ("features", "reports"),
    [("0110010100000000", True), ("0110000100000000", False), ("01100", False), ("", False), ("000001\n", True)],
)
def test_free_page_reporting_is_bit_5_of_a_balloons_features(features, reports):
    assert first_touch.balloon_reports_free_pages(features) is reports


def test_a_balloon_that_reports_free_pages_is_found_among_the_devices(tmp_path):
    assert not first_touch.hypervisor_takes_free_pages(str(tmp_path / "absent"))
    for name, features in (("virtio0", "0110000100"), ("virtio3", "0110010100"), ("module", "1111111")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "features").write_text(features + "\n")
    assert first_touch.hypervisor_takes_free_pages(str(tmp_path))
    (tmp_path / "virtio3" / "features").write_text("0110000100\n")
    assert not first_touch.hypervisor_takes_free_pages(str(tmp_path))  # "module" is not a device


def test_first_touch_times_the_mapping_of_fresh_memory():
    assert 0 < first_touch.first_touch_s(8 << 20) < 60
