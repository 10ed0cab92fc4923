"""The job's private temporary directory, removed when the job ends, even by a SIGKILL.

It holds the job secret (``job.secret``, 0600) and the temporaries of the job's torchrun agents. The
launcher removes it when it returns; should the launcher be killed outright (SIGKILL, OOM), a janitor it
started -- a tiny ``sh`` in a session of its own, which waits for end-of-file on a pipe only the launcher
holds -- outlives it and removes the directory: the pipe closes when the launcher's process ends,
however it ends.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile

#: What the janitor runs: wait until the launcher's end of the pipe closes, then remove the directory ($0).
_JANITOR = 'cat >/dev/null; rm -rf -- "$0"'


class JobDir:
    """``JobDir.create()``: a fresh ``/tmp/lightning-recover-*`` directory (0700) and its janitor."""

    def __init__(self, path: str, janitor: subprocess.Popen | None) -> None:
        self.path = path
        self._janitor = janitor

    @classmethod
    def create(cls) -> JobDir:
        path = tempfile.mkdtemp(prefix="lightning-recover-")
        try:
            # A session of its own: Ctrl-C to the job's process group must not end it before it cleans up.
            # The pipe's write end is not inherited by anything the launcher starts (close_fds, PEP 446).
            janitor = subprocess.Popen(
                ["sh", "-c", _JANITOR, path],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:  # no sh: the launcher still removes the directory whenever it returns
            janitor = None
        return cls(path, janitor)

    def remove(self) -> None:
        """Remove the directory now and let the janitor go (it finds nothing left to remove)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._janitor is not None:
            self._janitor.stdin.close()
            try:
                self._janitor.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - `cat` ends at once on end-of-file
                self._janitor.kill()
                self._janitor.wait()
