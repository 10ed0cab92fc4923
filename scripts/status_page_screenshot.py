"""The screenshot of the status page in docs/howto.md ("Watching a job"), taken from a real job.

A 3-replica job of tests/scripts/fabric_train.py in which replica 1 is killed at step 3, restarted and
rejoined, with a checkpoint at step 4; once it waits before its last step, headless chromium takes the page
(``--screenshot``) and ``lightning-recover status`` prints the terminal view; then the job finishes.
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


def main(png: str) -> int:
    out = tempfile.mkdtemp(prefix="lr-status-shot-")
    gate = os.path.join(out, "gate")
    train = [sys.executable, "tests/scripts/fabric_train.py", out, "--replicas", "3", "--steps", str(STEPS)]
    train += ["--microbatches", "6", "--heartbeat-timeout", "0.5", "--slow-while-degraded", "1.5", "--work", "0.05"]
    train += ["--save-at", "4", "--checkpoint", os.path.join(out, "step4.ckpt"), "--hold", f"{STEPS - 1}:{gate}"]
    cmd = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "3", "--restarts", "1"]
    cmd += ["--heartbeat-timeout", "0.5", "--status-address", "127.0.0.1:0"]
    cmd += ["--event-log", os.path.join(out, "events.jsonl"), "--", *train]
    env = dict(os.environ, OMP_NUM_THREADS="1", LIGHTNING_RECOVER_INJECT="kill:replica=1:step=3:phase=backward")
    log = os.path.join(out, "job.log")
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        url = None
        while url is None:
            assert time.monotonic() < deadline and job.poll() is None, open(log).read()[-3000:]
            found = re.search(r"STATUS (http://\S+/)", open(log).read())
            url = found.group(1) if found else None
            time.sleep(0.2)
        while True:  # the whole story: the kill, the recovery, the rejoin, the job waiting before its last step
            assert time.monotonic() < deadline and job.poll() is None, open(log).read()[-3000:]
            s = _status(url)
            if s["live_replicas"] == 3 and s["recoveries"]["kill"] == 1 and s["committed_step"] >= STEPS - 2:
                break
            time.sleep(0.5)
        time.sleep(2.0)  # two more throughput samples at the hold
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        shot = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"]
        shot += [f"--user-data-dir={out}/profile", "--window-size=1000,1020", f"--screenshot={os.path.abspath(png)}"]
        subprocess.run([*shot, url], check=True, capture_output=True, timeout=120)
        subprocess.run([sys.executable, "-m", "lightning_recover.cli", "status", url], check=True)
        open(gate, "w").close()
        job.wait(timeout=300)
    finally:
        open(gate, "w").close()
        if job.poll() is None:
            job.kill()
            job.wait()
    print(f"wrote {png}; the job's log and events: {out}")
    return job.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/status_page.png"))
