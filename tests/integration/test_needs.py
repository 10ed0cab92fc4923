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


def _run_skipping(tmp_path, reason: str) -> subprocess.CompletedProcess:
    test = tmp_path / "test_skipping.py"
    test.write_text(f"import pytest\n\ndef test_it():\n    pytest.skip({reason!r})\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT, "CI": "true"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider"]
        + ["--rootdir", str(tmp_path), str(test)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CI=true is strict on Linux only")
def test_a_skip_not_allowed_fails_a_ci_run_and_an_allowed_one_does_not(tmp_path):
    refused = _run_skipping(tmp_path, "etcd-server/openssl not installed")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "ALLOWED_SKIPS allows none of them" in refused.stderr
    assert "test_skipping.py::test_it: Skipped: etcd-server/openssl not installed" in refused.stderr
    allowed = _run_skipping(tmp_path, "needs a CUDA GPU with NCCL")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


def test_allowed_skips_are_matched_by_a_part_of_the_reason():
    reasons = ["t1: needs a CUDA GPU with NCCL", "t2: mounting a tmpfs needs root", "t3: no IPv6"]
    assert needs.disallowed_skips(reasons) == ["t2: mounting a tmpfs needs root"]
