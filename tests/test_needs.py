"""A missing prerequisite skips locally and fails under CI=true on Linux (fast)."""

import subprocess
import sys
import textwrap

import pytest

from tests import needs

ROOT = __file__.rsplit("/tests/", 1)[0]


def _run_missing(tmp_path, ci: str) -> subprocess.CompletedProcess:
    test = tmp_path / "test_missing.py"
    test.write_text(
        textwrap.dedent(
            """
            from tests import needs

            def test_it():
                needs.missing("the io_uring engine", "it is refused here: seccomp", "liburing")
            """
        )
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT, "CI": ci}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(test)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )


def test_missing_prerequisite_skips_with_what_was_not_tested(tmp_path):
    r = _run_missing(tmp_path, ci="")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 skipped" in r.stdout
    assert (
        "not tested: the io_uring engine, because it is refused here: seccomp. HINT: apt-get install liburing-dev"
        in r.stdout
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CI=true is strict on Linux only")
def test_missing_prerequisite_fails_under_ci(tmp_path):
    r = _run_missing(tmp_path, ci="true")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed" in r.stdout and "CI=true requires liburing" in r.stdout


def test_this_machine_lacks_nothing_ci_needs_or_says_so():
    # Each problem names its fix; under CI the session would not even have started with one.
    for problem in needs.problems():
        assert "HINT: " in problem
    if needs.strict():
        assert needs.problems() == []
