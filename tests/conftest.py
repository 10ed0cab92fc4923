"""Session hooks shared by the tests."""

from __future__ import annotations

import gc
import os
import sys

import pytest

from tests import needs

#: Real local etcd clusters as fixtures (etcd1, etcd3) for the control plane's tests.
pytest_plugins = ["tests.etcd_cluster_fixtures"]

_status: list[int] = [0]


def pytest_sessionstart(session: pytest.Session) -> None:
    # CI must exercise io_uring and fio: a run without them would pass by skipping (issue #34).
    if needs.strict():
        lacking = needs.problems()
        if lacking:
            pytest.exit("CI=true, and this machine lacks what the suite must test:\n  " + "\n  ".join(lacking), 4)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    # Collecting imports torch, Lightning and DCP: ~390,000 objects that live as long as the run. Each
    # full collection walks them all (~0.25 s here), and the collector ran a dozen while they were
    # imported and again whenever a test allocated enough (~20 times per run, plus every test's own
    # gc.collect()): ~5 s of CPU per run. So no collection while importing; then one, and what is left
    # moves to the permanent generation (gc.freeze, as the launcher's supervisor does, lightning/base.py).
    # Objects made later (every test's) are collected as before: cycles among them, their finalizers,
    # weakrefs and gc.collect() in a test all behave the same; only the imported heap is no longer walked.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return (yield)
    finally:
        if enabled:
            gc.enable()
        gc.collect()
        gc.freeze()


_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append(f"{report.nodeid}: {reason}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Under CI=true a skip that needs.ALLOWED_SKIPS does not list fails the run: a missing etcd, namespace
    # or test build would otherwise pass by testing nothing. (Each xdist worker checks its own tests.)
    if needs.strict():
        refused = needs.disallowed_skips(_skips)
        if refused:
            sys.stderr.write(
                "\nCI=true: these tests were skipped, and tests/needs.py ALLOWED_SKIPS allows none of them:\n"
            )
            sys.stderr.write("".join(f"  {line}\n" for line in refused))
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _status[0] = int(session.exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # The in-process protocol tests leave gloo groups with operations in flight (a survivor's reduce
    # waiting for a thread that "died"). Tearing them down at interpreter exit makes gloo abort the
    # process (exit 134) and hide the real result; a replica process avoids this the same way
    # (Replica._at_exit): everything is reported by now, so leave without destructors.
    inprocess = sys.modules.get("tests.inprocess")
    if inprocess is not None and inprocess.clusters_run():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[0])


@pytest.fixture(autouse=True)
def _restore_deterministic_mode():
    """``Trainer(deterministic=True)`` switches torch's deterministic algorithms on for the whole process;
    later tests (e.g. ``torch.empty`` of bit dtypes, which deterministic mode fills) must not depend on order."""
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != before:
        # only when changed: the setter imports torch._inductor.config (~1.5 s, once per run)
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture(autouse=True)
def _remove_handlers_on_captured_streams():
    """A test that runs the CLI in-process gets the package's stderr handler (``configure_logging``) bound to
    pytest's captured stream, closed once the test ends: a later test's log line would fail to print
    ("I/O operation on closed file") and be lost. The handlers and level are put back as they were."""
    import logging

    from lightning_recover.observe.logs import ROOT

    root = logging.getLogger(ROOT)
    before = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in before[0]]:
        root.removeHandler(handler)
    root.setLevel(before[1])
