"""The screenshot of the status page in docs/howto.md ("Watching a job"), taken from a real job.

A 3-replica job of tests/scripts/fabric_train.py (a coordinator and three replica processes, started by hand)
in which replica 1 is killed at step 3 by its injected fault, started again and rejoins, with a checkpoint at
step 4; once it waits before its last step, headless chromium takes the page (``--screenshot``) and
``lightning-recover status`` prints the terminal view; then the job finishes.
Run from the repository root (Debian's chromium installed; scripts/setup.sh does it)::

    python scripts/status_page_screenshot.py docs/status_page.png
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

STEPS = 16


def _status(url: str) -> dict:
    with urllib.request.urlopen(url + "status", timeout=5) as answer:
        return json.loads(answer.read())


def _wait(what: str, predicate, deadline: float, log: str) -> None:
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within the deadline\n{open(log).read()[-3000:]}"
        time.sleep(0.5)


def main(png: str) -> int:
    """The job is started by hand, as docs/howto.md "Several hosts on one machine" does (a coordinator, then
    one process per replica; replica 1 killed by its injected fault and started again, as a launcher would):
    no start-up bound, so it also works on a machine too loaded for a launcher's."""
    out = tempfile.mkdtemp(prefix="lr-status-shot-")
    gate = os.path.join(out, "gate")
    secret = os.path.join(out, "job.secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(os.urandom(32).hex())
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", LIGHTNING_RECOVER_SECRET_FILE=secret)
    env.pop("LIGHTNING_RECOVER_INJECT", None)
    log = os.path.join(out, "job.log")
    logf = open(log, "w")  # noqa: SIM115 - every process of the job writes here until the end
    coordinator = [sys.executable, "-m", "lightning_recover.cli", "coordinator", "--replicas", "3"]
    coordinator += ["--heartbeat-timeout", "3.0", "--status-address", "127.0.0.1:0"]
    coordinator += ["--event-log", os.path.join(out, "events.jsonl")]
    procs = [subprocess.Popen(coordinator, stdout=logf, stderr=subprocess.STDOUT, env=env)]
    deadline = time.monotonic() + 1800
    try:
        _wait("the coordinator", lambda: re.search(r"STATUS (http://\S+/)", open(log).read()), deadline, log)
        found = re.search(r"LISTENING (\S+) STATUS (http://\S+/)", open(log).read())
        addr, url = found.group(1), found.group(2)
        train = [sys.executable, "tests/scripts/fabric_train.py", out, "--replicas", "3", "--steps", str(STEPS)]
        train += ["--microbatches", "6", "--heartbeat-timeout", "3.0", "--slow-while-degraded", "1.5"]
        train += ["--work", "0.05", "--save-at", "4", "--checkpoint", os.path.join(out, "step4.ckpt")]
        train += ["--hold", f"{STEPS - 1}:{gate}"]

        def replica(r: int, inject: str = "") -> subprocess.Popen:
            extra = {"LIGHTNING_RECOVER_COORDINATOR": addr, "LIGHTNING_RECOVER_REPLICA": str(r)}
            extra["LIGHTNING_RECOVER_REPLICAS"] = "3"
            if inject:
                extra["LIGHTNING_RECOVER_INJECT"] = inject
            return subprocess.Popen(train, stdout=logf, stderr=subprocess.STDOUT, env=dict(env, **extra))

        procs += [replica(0), replica(1, "kill:replica=1:step=3:phase=backward"), replica(2)]
        _wait("replica 1's kill", lambda: procs[2].poll() is not None, deadline, log)
        procs.append(replica(1))  # restarted: it rejoins with the live state
        # The whole story: the kill, the recovery, the rejoin, the job waiting before its last step.
        _wait(
            "the rejoin",
            lambda: (
                lambda s: s["live_replicas"] == 3 and s["recoveries"]["kill"] >= 1 and s["committed_step"] >= STEPS - 2
            )(_status(url)),
            deadline,
            log,
        )
        time.sleep(2.0)  # two more throughput samples at the hold
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        shot = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"]
        shot += [f"--user-data-dir={out}/profile", "--window-size=1000,1020", f"--screenshot={os.path.abspath(png)}"]
        subprocess.run([*shot, url], check=True, capture_output=True, timeout=300)
        subprocess.run([sys.executable, "-m", "lightning_recover.cli", "status", url], check=True)
        open(gate, "w").close()
        for p in procs[1:]:
            p.wait(timeout=600)
    finally:
        open(gate, "w").close()
        for p in procs:
            if p.poll() is None:
                p.terminate() if p is procs[0] else p.kill()
                p.wait()
        logf.close()
    print(f"wrote {png}; the job's log and events: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/status_page.png"))
