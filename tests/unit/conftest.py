"""The unit tier: logic only. A test here that starts a process fails at once, naming what it started (its
place is tests/integration); tests/unit/test_layout.py also keeps subprocess and time.sleep out of its sources."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test started a process ({args[:1]!r}...): it belongs in tests/integration")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    monkeypatch.setattr(os, "posix_spawnp", refuse)
