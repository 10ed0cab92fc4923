"""A test job's launcher forked by the warm fork server: becomes ``python ARGS...`` as ``jobs.start_job`` starts
one as a new process, in a session of its own (the tests end the job by its process group) with its output in
its log.

Usage (by ``jobs.start_job``, through the fork server): ``python -m tests.forked_job LOG ARGS...``
"""

from __future__ import annotations

import os
import sys

from lightning_recover.launch.fork_server import ChildCommand, run_job


def main() -> None:
    log, *args = sys.argv[1:]
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_APPEND)  # made empty by start_job
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    run_job(ChildCommand([sys.executable, *args], dict(os.environ), os.getcwd()))


if __name__ == "__main__":
    main()
