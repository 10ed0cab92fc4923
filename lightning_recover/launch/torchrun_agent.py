"""One replica's torchrun agent: ``python -m torch.distributed.run``, tidier and quieter.

``lightning-recover torchrun`` starts this instead of ``torch.distributed.run`` itself, with the same
arguments. Two differences, both about what a user sees:

- the agent's own temporaries (torchelastic's per-run ``/tmp/torchelastic_*`` log directory, left behind
  by every stock run) go to the job's private directory (``LIGHTNING_RECOVER_JOB_DIR``), which the launcher
  removes when the job ends;
- a worker's death is reported once, by the launcher, as an event ("its worker exited; declared dead", or
  "already declared dead" where the coordinator's monitor was first):
  the agent does not add torch elastic's error line and 30-line ``ChildFailedError`` traceback for the same
  death when it gives up (the worker's own output, a traceback included, is still shown).

A worker that leaves on a preemption notice exits 0 after creating the agent's marker file
(``LIGHTNING_RECOVER_LEFT_MARKER``, in the agent's temporaries): torchrun's agent restarts a worker that exits with
any other code while it has restarts left (``--max-restarts``), and cannot be told otherwise. When its workers are
done and the marker exists, the agent exits 75 (``EXIT_LEFT_ON_NOTICE``), which the launcher does not restart.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from lightning_recover import env
from lightning_recover.protocol.notice import EXIT_LEFT_ON_NOTICE


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    tempfile.tempdir = tempfile.mkdtemp(prefix="torchrun-", dir=os.environ.get(env.JOB_DIR) or None)
    marker = os.environ[env.LEFT_MARKER] = os.path.join(tempfile.tempdir, "left-on-notice")  # the workers inherit it
    # "failed (exitcode: -9) local_rank: 0 ...": the launcher reports that death already.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        if codes == {EXIT_LEFT_ON_NOTICE}:
            return EXIT_LEFT_ON_NOTICE  # its workers left on a notice: the launcher does not restart the replica
        return 1  # no restarts left: the replica ends (the launcher has reported its worker's death)
    return EXIT_LEFT_ON_NOTICE if os.path.exists(marker) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
