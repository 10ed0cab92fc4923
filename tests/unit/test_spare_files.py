"""Which files may be written over by a later save (``spare_files.py``): pure decisions."""

from __future__ import annotations

import os
import stat

import pytest

from lightning_recover.checkpoint.file.spare_files import SpareFiles, recyclable, recycling_mode


def _stat(mode: int, nlink: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 1, 1, nlink, uid, 0, 4096, 0, 0, 0))


def test_only_a_regular_file_of_this_user_with_one_link_is_recyclable():
    me = os.geteuid()
    assert recyclable(_stat(stat.S_IFREG | 0o644, 1, me))
    assert not recyclable(_stat(stat.S_IFREG | 0o644, 2, me))  # another name would see the overwrite
    assert not recyclable(_stat(stat.S_IFREG | 0o644, 1, me + 1))  # another user's file
    assert not recyclable(_stat(stat.S_IFLNK | 0o777, 1, me))
    assert not recyclable(_stat(stat.S_IFDIR | 0o755, 1, me))


def test_the_mode_is_off_by_default_and_a_wrong_one_says_what_is_accepted(monkeypatch):
    monkeypatch.delenv("LIGHTNING_RECOVER_RECYCLE", raising=False)
    assert recycling_mode() == "off"
    monkeypatch.setenv("LIGHTNING_RECOVER_RECYCLE", " On ")
    assert recycling_mode() == "on"
    monkeypatch.setenv("LIGHTNING_RECOVER_RECYCLE", "yes")
    with pytest.raises(ValueError, match="LIGHTNING_RECOVER_RECYCLE must be off, on or any, not 'yes'"):
        recycling_mode()
    with pytest.raises(ValueError, match="mode must be one of"):
        SpareFiles("always")
