"""Watching a job: the monitor's status board, its HTTP server (/metrics read by prometheus_client's own
parser, /status, the page in a real headless chromium), `lightning-recover status`, the event log, the
recover/* scalars in TensorBoard (read by TensorBoard's own event reader), and the package's logging.

Fast: the board fed what a monitor reads from a real TCPStore, the server on port 0, the CLI in-process.
Slow: a job with an injected kill and a rejoin scraped while it runs; on etcd, the page served again by the
other launcher after the one holding the monitor role is SIGKILLed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lightning_recover import cli
from lightning_recover.control_plane import config
from lightning_recover.control_plane.embedded import CoordinatorStore
from lightning_recover.control_plane.etcd_job import DEFAULT_LEASE_TTL, TAKEOVER_BOUND
from lightning_recover.launch.coordinator_process import status_address
from lightning_recover.observe.address import parse_address
from lightning_recover.observe.board import CAUSES, StatusBoard
from lightning_recover.observe.events import EventLog, read_events
from lightning_recover.observe.logs import configure_logging, quiet_lightning_noise
from lightning_recover.observe.page import render_page
from lightning_recover.observe.report import member_report, step_report
from lightning_recover.observe.status_server import StatusServer
from lightning_recover.observe.terminal import format_status
from lightning_recover.protocol.coordinator import init_keys, run_monitor, serve_store
from lightning_recover.protocol.heartbeat import Heartbeat, Progress
from lightning_recover.protocol.messages import ControlStore, JobSecret, Sealer, mark_dead
from lightning_recover.protocol.options import RecoverOptions
from tests import needs
from tests.compare import SLACK, max_relative_difference
from tests.jobs import (
    FABRIC_SCRIPT,
    JobResult,
    join_request,
    kill_group,
    start_job,
    wait_for,
)
from tests.scripts.fabric_train import reference_state


# --------------------------------------------------------------------------- helpers
def metrics_of(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics answer, parsed by prometheus_client: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def chromium_dom(url: str, tmp_path, timeout: float = 120.0) -> str:
    """The DOM of ``url`` after a real headless chromium ran its scripts (``--dump-dom``)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        needs.missing("the status page in a real browser", "chromium is not installed", "chromium")
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",  # the tests run as root, where chromium's sandbox refuses to start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--dump-dom",
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


class _Store:
    """A real coordinator store (TCPStore server on port 0) with the job's keys, as the monitor sees it."""

    def __init__(self, replicas: int) -> None:
        self.secret = JobSecret.generate()
        self.sealer = Sealer(self.secret)
        server = serve_store("127.0.0.1", 0, datetime.timedelta(seconds=10))
        self.store = CoordinatorStore(server)
        init_keys(self.store, self.sealer, replicas)
        self.addr = f"127.0.0.1:{server.port}"


class _Clock:
    """The monitor's passes, a second apart (in the past: heartbeat ages come out positive)."""

    def __init__(self) -> None:
        self.now = time.monotonic() - 1000.0

    def tick(self) -> float:
        self.now += 1.0
        return self.now


def _beat(board: StatusBoard, st: _Store, reports: dict[int, tuple[int, dict]], clock: _Clock) -> None:
    """One monitor pass: replica -> (incarnation, report fields) as heartbeats that moved just now."""
    now = clock.tick()
    hbs = {f"hb/{r}": (r, {"inc": inc, "beat": 1, "phase": "idle", **fields}) for r, (inc, fields) in reports.items()}
    beats = {f"hb/{r}": (inc, 1, now) for r, (inc, _) in reports.items()}
    board.poll(now, st.store, st.sealer, hbs, beats)


# --------------------------------------------------------------------------- the board (fast)
def test_board_follows_a_kill_a_rejoin_and_a_hang(tmp_path):
    st = _Store(3)
    events = EventLog(str(tmp_path / "events.jsonl"))
    board = StatusBoard(3, events=events)
    now = _Clock()
    start = {r: (1, member_report(0, 6)) for r in range(3)}
    _beat(board, st, start, now)
    assert board.snapshot()["live_replicas"] == 3
    # The launcher saw replica 1 exit (killed): it writes dead/1; the board reads it on its next pass.
    assert mark_dead(st.store, st.sealer, 1, 1)
    _beat(board, st, start, now)
    snap = board.snapshot()
    assert snap["live_replicas"] == 2 and snap["table"][1]["state"] == "exited"
    # The survivors report the recovery of step 2 in generation 1: counted once, cause kill.
    recovered = {r: (1, step_report({}, 1, 2, 3, 6, (1, 0.25, 1))) for r in (0, 2)}
    _beat(board, st, recovered, now)
    _beat(board, st, recovered, now)  # the same report again: not counted twice
    # Replica 1 restarted (incarnation 2): joining until it is a member, then live.
    _beat(board, st, {**recovered, 1: (2, {})}, now)
    assert board.snapshot()["live_replicas"] == 2 and board.snapshot()["table"][1]["state"] == "joining"
    rejoined = {**recovered, 1: (2, member_report(2, 6))}
    _beat(board, st, rejoined, now)
    snap = board.snapshot()
    assert snap["live_replicas"] == 3 and [row["state"] for row in snap["table"]] == ["live"] * 3
    # The monitor declares replica 2 hung: the next recovery is labelled hang.
    board.declared(2, 1, "hang", "made no progress")
    assert mark_dead(st.store, st.sealer, 2, 1)
    _beat(board, st, {0: (1, step_report(rejoined[0][1], 3, 7, 3, 6, (1, 0.5, 1))), 1: rejoined[1]}, now)
    snap = board.snapshot()
    assert snap["table"][2]["state"] == "dead (hang)" and snap["live_replicas"] == 2
    assert snap["recoveries"] == {"kill": 1, "hang": 1, "partition": 0, "notice": 0}
    assert snap["recomputed_microbatches"]["kill"] == 2 and snap["recomputed_microbatches"]["hang"] == 1
    assert snap["committed_step"] == 7 and snap["generation"] == 3
    m = metrics_of(board.render_metrics().decode())
    assert m[("lightning_recover_live_replicas", ())] == 2
    assert m[("lightning_recover_recoveries_total", (("cause", "kill"),))] == 1
    assert m[("lightning_recover_recoveries_total", (("cause", "hang"),))] == 1
    assert all(("lightning_recover_recoveries_total", (("cause", c),)) in m for c in CAUSES)
    assert m[("lightning_recover_recovery_seconds_count", ())] == 2
    assert m[("lightning_recover_recovery_seconds_sum", ())] == pytest.approx(0.75)
    assert m[("lightning_recover_recomputed_microbatches_total", (("cause", "kill"),))] == 2
    assert m[("lightning_recover_heartbeat_age_seconds", (("replica", "0"),))] >= 0
    events.close()
    kinds = [e["kind"] for e in read_events(str(tmp_path / "events.jsonl"))]
    assert kinds == ["monitor", "start", "start", "start", "exit", "recovery", "start", "join", "death", "recovery"]
    assert all({"time", "generation", "kind"} <= set(e) for e in read_events(str(tmp_path / "events.jsonl")))


def test_board_tells_a_leave_on_notice_from_a_notice_with_too_little_grace(tmp_path):
    """Replica 2 gets its notice and leaves at the step boundary: the members' next report names it, the board
    shows a leave and counts no recovery, whichever it reads first, the exit or the report. Replica 1 gets its
    notice but is killed before its boundary: the survivors' recovery is the notice's."""
    st = _Store(3)
    board = StatusBoard(3)
    now = _Clock()
    live = {r: (1, member_report(0, 6)) for r in range(3)}
    _beat(board, st, live, now)
    notified = {**live, 2: (1, {**live[2][1], "notice": "SIGTERM"})}
    _beat(board, st, notified, now)
    assert mark_dead(st.store, st.sealer, 2, 1)  # its clean exit is read before the members' report
    _beat(board, st, notified, now)
    boundary = {r: (1, step_report({}, 1, 3, 3, 6, left=[2])) for r in (0, 1)}
    _beat(board, st, boundary, now)
    snap = board.snapshot()
    assert snap["table"][2]["state"] == "left" and snap["live_replicas"] == 2
    assert [e["what"] for e in snap["events"] if e["kind"] == "leave"] == [
        "replica 2 left on notice (SIGTERM) before generation 1"
    ]
    # Replica 1's notice, then it is killed mid-step (the grace ran out): the recovery is labelled notice.
    _beat(board, st, {0: boundary[0], 1: (1, {**boundary[1][1], "notice": "SIGUSR1"})}, now)
    board.declared(1, 1, "kill", "its process exited")
    assert mark_dead(st.store, st.sealer, 1, 1)
    _beat(board, st, {0: (1, step_report(boundary[0][1], 2, 4, 6, 6, (1, 0.3, 3)))}, now)
    snap = board.snapshot()
    assert snap["recoveries"] == {"kill": 0, "hang": 0, "partition": 0, "notice": 1}
    assert snap["recomputed_microbatches"]["notice"] == 3
    # The other order: the members' report before the leaver's exit; the exit adds nothing.
    st2, board2 = _Store(2), StatusBoard(2)
    _beat(board2, st2, {r: (1, member_report(0, 4)) for r in range(2)}, now)
    _beat(board2, st2, {0: (1, step_report({}, 1, 2, 4, 4, left=[1])), 1: (1, {"notice": "leave request"})}, now)
    assert mark_dead(st2.store, st2.sealer, 1, 1)
    _beat(board2, st2, {0: (1, step_report({}, 1, 3, 4, 4))}, now)
    snap = board2.snapshot()
    assert snap["table"][1]["state"] == "left" and sum(snap["recoveries"].values()) == 0
    assert [e["kind"] for e in snap["events"]].count("exit") == 0


def test_a_monitor_stopped_by_the_jobs_end_still_reads_the_last_heartbeats(tmp_path):
    """The job ends before the monitor's next pass: the members' last heartbeats (one reports a leave at the
    step boundary of its last steps) are read once more when it stops, so the event log has the leave. Stopped
    before its first pass, the monitor's last look is the only read: the leave must come from it."""
    st = _Store(3)
    events = EventLog(str(tmp_path / "events.jsonl"))
    board = StatusBoard(3, events=events)
    leaver = {"inc": 1, "beat": 3, "phase": "idle", **member_report(0, 6), "notice": "SIGTERM"}
    reports = {r: {"inc": 1, "beat": 7, "phase": "idle", **step_report({}, 1, 5, 3, 6, left=[1])} for r in (0, 2)}
    for r, report in {**reports, 1: leaver}.items():
        st.store.set(f"hb/{r}", st.sealer.seal(f"hb/{r}", json.dumps(report).encode(), seq=7))
    assert mark_dead(st.store, st.sealer, 1, 1)  # the launcher saw it exit
    stop = threading.Event()
    stop.set()
    run_monitor(st.store, st.sealer, 3, 5.0, 60.0, stop, board=board)
    events.close()
    leaves = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == "leave"]
    assert [e["replica"] for e in leaves] == [1], leaves
    assert board.snapshot()["table"][1]["state"] == "left"


# --------------------------------------------------------------------------- the server (fast)
def test_server_serves_metrics_status_and_page_read_only():
    st = _Store(2)
    board = StatusBoard(2)
    _beat(board, st, {r: (1, step_report({}, 0, 4, 3, 6)) for r in range(2)}, _Clock())
    server = StatusServer("127.0.0.1:0", board)
    try:
        code, text = get(server.url + "metrics")
        assert code == 200
        m = metrics_of(text)
        assert m[("lightning_recover_committed_step", ())] == 4 and m[("lightning_recover_replicas", ())] == 2
        code, text = get(server.url + "status")
        status = json.loads(text)
        assert code == 200 and status["live_replicas"] == 2 and len(status["table"]) == 2
        code, text = get(server.url)
        assert code == 200 and '<script type="application/json" id="initial">' in text
        assert not re.search(r'(src|href)="(https?:)?//', text), "no external asset"
        assert get(server.url + "nothing")[0] == 404
        request = urllib.request.Request(server.url + "status", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 501  # read-only
        secret_hex = st.secret.key.hex()
        assert all(secret_hex not in get(server.url + p)[1] for p in ("", "status", "metrics"))
        server.board = None  # this process does not monitor the job now (etcd: another launcher does)
        server.absent = lambda: "launcher B holds the monitor role"
        code, text = get(server.url + "status")
        assert code == 503 and "launcher B holds the monitor role" in text
    finally:
        server.close()


def test_page_escapes_what_it_embeds():
    page = render_page({"x": "</script><script>alert(1)</script>"}).decode()
    assert "</script><script>alert(1)" not in page


def test_status_address_forms_and_errors():
    assert parse_address("9400") == ("127.0.0.1", 9400)
    assert parse_address("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_address("[::1]:9400") == ("::1", 9400)
    for bad in ("host", "host:", "127.0.0.1:99999", ":80x"):
        with pytest.raises(ValueError, match="HINT: --status-address"):
            parse_address(bad)
    with pytest.raises(ValueError, match="HINT: --status-address"):
        RecoverOptions(status_address="localhost:http")  # status_address= of the strategies, before any start
    with pytest.raises(argparse.ArgumentTypeError, match="HINT"):
        status_address("nope:x")  # --status-address of run, torchrun and coordinator


def test_status_command_reads_the_server_and_the_control_plane(tmp_path, capsys):
    st = _Store(2)
    secret_file = st.secret.write_file(str(tmp_path))
    beats = []
    for r in range(2):
        progress = Progress()
        progress.report = member_report(0, 4)
        hb = Heartbeat(ControlStore(st.addr, r, st.secret), r, 1, 0.05, progress)
        hb.start()
        beats.append(hb)
    try:
        assert cli.main(["status", "--coordinator", st.addr, "--secret-file", secret_file, "--sample", "0.3"]) == 0
        text = capsys.readouterr().out
        assert "live replicas 2/2" in text and re.search(r"\n\s+1 \S+\s+1 live", text), text
        board = StatusBoard(2)
        _beat(board, st, {r: (1, member_report(0, 4)) for r in range(2)}, _Clock())
        server = StatusServer("127.0.0.1:0", board)
        try:
            assert cli.main(["status", server.url, "--json"]) == 0
            assert json.loads(capsys.readouterr().out)["live_replicas"] == 2
        finally:
            server.close()
        with pytest.raises(SystemExit, match="no status at .*HINT"):
            cli.main(["status", server.url, "--timeout", "2"])
    finally:
        for hb in beats:
            hb.stop()
    assert "live replicas" in format_status(board.snapshot())


# --------------------------------------------------------------------------- logging (fast)
def test_logging_lines_and_noise_filters(capfd):
    handler = configure_logging("coordinator", "INFO")
    try:
        logging.getLogger("lightning_recover.protocol.coordinator").warning("replica %d declared dead", 2)
        assert "[coordinator] replica 2 declared dead" in capfd.readouterr().err
        with pytest.raises(ValueError, match="HINT"):
            configure_logging(level="LOUD")
    finally:
        logging.getLogger("lightning_recover").removeHandler(handler)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_lightning_noise()
        warnings.warn("The `srun` command is available on your system but is not used. HINT: ...", stacklevel=1)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
        warnings.warn("something a user can act on", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something a user can act on"]
    tip = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert not any(
        f.filter(logging.makeLogRecord({"msg": "💡 Tip: For seamless cloud logging and ..."})) for f in tip.filters
    )


# --------------------------------------------------------------------------- a job, scraped while it runs (slow)
STEPS, M = 12, 6


def _status_url(log: str, pattern: str) -> str | None:
    found = re.search(pattern, open(log).read())
    return found.group(1) if found else None


class _Scraper(threading.Thread):
    """Reads /metrics every 50 ms (parsed by prometheus_client) until stopped; keeps every answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = url, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                code, text = get(self.url + "metrics", timeout=2.0)
            except OSError:
                continue  # the job ended
            if code == 200:
                self.samples.append(metrics_of(text))

    def values(self, name: str, labels: tuple = ()) -> list[float]:
        return [s[(name, labels)] for s in self.samples if (name, labels) in s]


def _changes(values: list[float]) -> list[float]:
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


@pytest.mark.slow
def test_job_with_a_kill_and_a_rejoin_seen_through_its_status_page(tmp_path):
    out, tb = str(tmp_path / "run"), str(tmp_path / "tb")
    gate, asked = os.path.join(out, "page-seen"), os.path.join(out, "rejoin-asked")
    script = [sys.executable, FABRIC_SCRIPT, out, "--replicas", "3", "--steps", str(STEPS), "--microbatches", str(M)]
    script += ["--heartbeat-timeout", "0.5", "--exact", "--tensorboard", tb]
    # Before step 3 the survivors wait until the restarted replica asked to join (step 3's commit admits it);
    # the job stays up until the page was loaded.
    script += ["--hold", f"3:{asked},{STEPS - 1}:{gate}"]
    script += ["--save-at", "4", "--checkpoint", os.path.join(out, "step4.ckpt")]
    cmd = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "3", "--restarts", "1"]
    cmd += ["--heartbeat-timeout", "0.5", "--status-address", "127.0.0.1:0"]
    cmd += ["--event-log", str(tmp_path / "events.jsonl"), "--", *script]
    proc, log = start_job(cmd, out, {"LIGHTNING_RECOVER_INJECT": "kill:replica=1:step=2:phase=backward"})
    scraper = None
    try:
        assert wait_for(lambda: _status_url(log, r"STATUS (http://\S+/)"), 120), open(log).read()[-3000:]
        url = _status_url(log, r"STATUS (http://\S+/)")
        scraper = _Scraper(url)
        scraper.start()

        def asked_to_join() -> bool:
            return join_request(1) in open(log).read() or proc.poll() is not None

        assert wait_for(asked_to_join, 200), open(log).read()[-3000:]
        open(asked, "w").close()

        def recovered_and_rejoined() -> bool:
            live = _changes(scraper.values("lightning_recover_live_replicas"))
            return live[-3:] == [3.0, 2.0, 3.0] and scraper.values(
                "lightning_recover_recoveries_total", (("cause", "kill"),)
            )[-1:] == [1.0]

        assert wait_for(recovered_and_rejoined, 200), (scraper.samples[-1:], open(log).read()[-3000:])
        dom = chromium_dom(url, tmp_path)
        open(gate, "w").close()
        proc.wait(timeout=120)
    finally:
        if scraper is not None:
            scraper.stop.set()
            scraper.join(5)
        open(asked, "w").close()
        open(gate, "w").close()
        kill_group(proc)
    result = JobResult(proc.returncode, open(log).read(), out)
    assert result.returncode == 0, result.output[-4000:]
    noise = ["waitForInput", "The `srun` command is available", "LeafSpec", "💡 Tip"]
    assert not [n for n in noise if n in result.output], result.output[-3000:]  # nothing a user cannot act on
    # Scraped while it ran: live replicas 3 -> 2 -> 3, the recovery counter and histogram moved once.
    live = _changes(scraper.values("lightning_recover_live_replicas"))
    assert live[live.index(3.0) :][:3] == [3.0, 2.0, 3.0], live  # (0 before the replicas' first beats)
    assert _changes(scraper.values("lightning_recover_recoveries_total", (("cause", "kill"),)))[:2] == [0.0, 1.0]
    assert _changes(scraper.values("lightning_recover_recovery_seconds_count"))[:2] == [0.0, 1.0]
    assert scraper.values("lightning_recover_recovery_seconds_sum")[-1] > 0
    assert scraper.values("lightning_recover_recomputed_microbatches_total", (("cause", "kill"),))[-1] == M // 3
    saved = os.path.getsize(os.path.join(out, "step4.ckpt"))
    assert scraper.values("lightning_recover_checkpoint_bytes")[-1] == saved
    assert scraper.values("lightning_recover_checkpoint_seconds")[-1] > 0
    # The page, drawn by its script in a real browser: every replica live, the recovery on the timeline.
    rows = re.findall(r'<tr data-replica="(\d)">(.*?)</tr>', dom)
    assert [r for r, _ in rows] == ["0", "1", "2"] and all(
        '<td class="state-live">live</td>' in c for _, c in rows
    ), dom
    assert re.search(r'<li class="ev-recovery">[^<]*step 2 recovered in generation 1', dom), dom
    assert re.search(r'<li class="ev-join">[^<]*replica 1 rejoined', dom), dom
    assert 'data-kind="recovery"' in dom
    # The event log kept every event with its time and generation.
    events = read_events(str(tmp_path / "events.jsonl"))
    recovery = [e for e in events if e["kind"] == "recovery"]
    assert len(recovery) == 1 and recovery[0]["step"] == 2 and recovery[0]["cause"] == "kill"
    assert [e["replica"] for e in events if e["kind"] == "join"] == [1]
    assert [(e["step"], e["bytes"]) for e in events if e["kind"] == "checkpoint"] == [(4, saved)]
    # The run is the failure-free one, bitwise.
    ref = reference_state(STEPS, M, exact=True)
    states = result.states()
    assert sorted(states) == [0, 1, 2]
    for r, data in states.items():
        assert all(torch.equal(data["state"][k], v) for k, v in ref.items()), f"replica {r} is not bitwise equal"
    # TensorBoard's own reader finds the recover/* scalars at the steps they happened, written once.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = [f for f in os.listdir(os.path.join(tb, "tb", "version_0")) if f.startswith("events.out.tfevents")]
    assert len(files) == 1, files  # the lowest live replica only
    acc = EventAccumulator(os.path.join(tb, "tb", "version_0"))
    acc.Reload()
    live = {e.step: e.value for e in acc.Scalars("recover/live_replicas")}
    expected = {s["step"]: float(s["live_replicas"]) for s in states[0]["stats"]}
    assert live == expected and live[2] == 2.0 and live[STEPS - 1] == 3.0, live
    recoveries = {e.step: e.value for e in acc.Scalars("recover/recoveries")}
    assert {s: v for s, v in recoveries.items() if v} == {2: 1.0}
    recomputed = {e.step: e.value for e in acc.Scalars("recover/recomputed_microbatches")}
    assert {s: v for s, v in recomputed.items() if v} == {2: float(M // 3)}
    assert {e.step for e in acc.Scalars("recover/recovery_seconds") if e.value > 0} == {2}


# --------------------------------------------------------------------------- etcd: the page follows the role (slow)
ETCD_STEPS = 6


def _etcd_launcher(out: str, cluster, job: str, local: str, gate: str) -> list[str]:
    train = [sys.executable, FABRIC_SCRIPT, out, "--replicas", "3", "--heartbeat-timeout", "0.5"]
    train += ["--steps", str(ETCD_STEPS), "--microbatches", "6", "--dtype", "float64", "--metrics", "--work", "0.05"]
    train += ["--hold", f"{ETCD_STEPS - 1}:{gate}"]
    cmd = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "3", "--heartbeat-timeout", "0.5"]
    cmd += ["--control-plane", cluster.url, "--job", job, "--local-replicas", local]
    return cmd + ["--status-address", "127.0.0.1:0", "--", *train]


@pytest.mark.slow
def test_status_page_follows_the_monitor_role_on_etcd(etcd3, tmp_path):
    """Two launchers of one job, each with a status address; the one holding the monitor role serves the job,
    the other answers 503 naming it. SIGKILLed with its replica, the holder's page moves: the other launcher
    serves the job within the takeover bound, and its board sees the death and the recovery."""
    out = str(tmp_path / "run")
    gate = os.path.join(out, "recovery-seen")
    job = f"status-{os.getpid()}-{time.monotonic_ns()}"
    os.makedirs(out)
    # The launchers of one job share its secret (every one must be given the same).
    env = dict(etcd3.environment(), LIGHTNING_RECOVER_SECRET_FILE=JobSecret.generate().write_file(str(tmp_path)))
    page = r"status page: (http://\S+/)"
    a, log_a = start_job(_etcd_launcher(out, etcd3, job, "0", gate), str(tmp_path / "a"), env)
    b = None
    try:
        assert wait_for(lambda: "monitor role taken" in open(log_a).read(), 90), open(log_a).read()[-3000:]
        url_a = _status_url(log_a, page)
        assert get(url_a + "status")[0] == 200
        b, log_b = start_job(_etcd_launcher(out, etcd3, job, "1,2", gate), str(tmp_path / "b"), env)
        assert wait_for(lambda: _status_url(log_b, page), 60), open(log_b).read()[-3000:]
        url_b = _status_url(log_b, page)
        assert wait_for(lambda: os.path.exists(os.path.join(out, "started")), 120), open(log_b).read()[-3000:]
        code, text = get(url_b + "status")
        assert code == 503 and "does not hold the job's monitor role" in text and "launcher" in text, text
        assert json.loads(get(url_a + "status")[1])["live_replicas"] == 3
        settings = config.with_job(config.parse(etcd3.url, environ=etcd3.environment()), job)
        role_key = (settings.prefix + "monitor").encode()
        client = settings.client()
        try:
            held_by = client.get(role_key)[0]
            assert held_by and b"(replicas [0])" in held_by, held_by
            os.kill(a.pid, signal.SIGKILL)  # the launcher; its replica dies with it (parent-death signal)
            killed = time.monotonic()
            # A slow takeover split in parts: when etcd deleted the holder's key (its lease expired), when b's log
            # said it took the role, when b's page served.
            seen: dict[str, float] = {}

            def served() -> bool:
                if "key deleted" not in seen and client.get(role_key)[0] != held_by:
                    seen["key deleted"] = time.monotonic() - killed
                if "role taken" not in seen and "monitor role taken by launcher" in open(log_b).read():
                    seen["role taken"] = time.monotonic() - killed
                return get(url_b + "status")[0] == 200

            assert wait_for(served, DEFAULT_LEASE_TTL + 10, interval=0.05), open(log_b).read()
        finally:
            client.close()
        served_after = time.monotonic() - killed
        assert served_after <= TAKEOVER_BOUND + SLACK, f"served {served_after:.2f} s after the kill; {seen}"

        def recovery_seen() -> bool:
            code, text = get(url_b + "metrics")
            return code == 200 and metrics_of(text)[("lightning_recover_recoveries_total", (("cause", "kill"),))] == 1

        # The survivors recover once the new holder declared replica 0 dead (its bound: heartbeat_timeout after the
        # takeover, more on a starved machine); the job cannot go on without it, so it is waited for as the job is.
        assert wait_for(recovery_seen, 150, interval=0.25), open(log_b).read()[-3000:]
        status = json.loads(get(url_b + "status")[1])
        # dead as this board's monitor declared it, or exited: declared before a takeover of the role
        assert status["live_replicas"] == 2 and status["table"][0]["state"] in ("dead (kill)", "exited"), status
        assert "held by launcher" in status["control_plane"]
        open(gate, "w").close()
        b.wait(timeout=150)
    finally:
        open(gate, "w").close()
        kill_group(a)
        if b is not None:
            kill_group(b)
    result = JobResult(b.returncode, open(log_b).read(), out)
    assert result.returncode == 0, result.output[-4000:]
    ref = reference_state(ETCD_STEPS, 6, dtype="float64")
    states = result.states()
    assert sorted(states) == [1, 2]
    for r, data in states.items():
        assert max_relative_difference(data["state"], ref) <= 1e-9, f"replica {r} diverged"


# --------------------------------------------------------------------------- Lightning's loggers (fast)
def test_recovery_metrics_reach_a_logger_from_rank_zero_only(tmp_path):
    from lightning.fabric.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_recover.lightning.step_logs import log_recovery_metrics
    from lightning_recover.protocol.step import StepStats

    stats = StepStats(step=5, generation=1, live_replicas=2, recoveries=1, recovery_seconds=0.25, recomputed=1)
    stats.events.append({"kind": "regroup", "generation": 1, "members": [0, 2], "lost": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no logger: nothing logged and nothing said
        log_recovery_metrics([], stats, 5, is_global_zero=True)
    silent = TensorBoardLogger(str(tmp_path / "other"), name="tb", version=0)
    log_recovery_metrics([silent], stats, 5, is_global_zero=False)  # not the lowest live replica
    assert not os.path.exists(tmp_path / "other" / "tb" / "version_0")
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    log_recovery_metrics([logger], stats, 5, is_global_zero=True)
    logger.finalize("success")
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    acc.Reload()
    found = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert found == {
        "recover/live_replicas": [(5, 2.0)],
        "recover/generation": [(5, 1.0)],
        "recover/recoveries": [(5, 1.0)],
        "recover/recomputed_microbatches": [(5, 2.0)],  # every survivor's share, from the regroup's count
        "recover/recovery_seconds": [(5, 0.25)],
    }
