"""Preemption notices: a replica told to go leaves at a step boundary instead of failing.

Spot and preemptible capacity announces itself (SIGTERM and a grace period under Kubernetes and the
clouds' spot notices, the signal of Slurm's ``--signal=USR1@60``). A replica whose process gets the notice
signal (:data:`DEFAULT_NOTICE_SIGNAL`, or ``notice_signal=``) finishes the step it is in, commits it with the
others and leaves at that step boundary: its leave rides in the step's all-reduce (one slot per member), so
every member whose reduce completed knows the same leavers, and the next step's quotas are planned without
them: nothing is recomputed and nobody waits for a heartbeat timeout. An operator asks the same from outside
with ``lightning-recover leave`` (:func:`request_leave`: the sealed key ``leave/{r}`` naming the incarnation,
which the replica's heartbeat thread reads). A second notice signal, or a kill at the end of the grace
period before the step commits, ends the process as a failure does (recompute, nothing lost).

A replica that left exits with :data:`EXIT_LEFT_ON_NOTICE`; the launchers do not restart it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any, Optional

from lightning_recover.env import LEFT_MARKER
from lightning_recover.protocol.messages import Sealer, peek, read_death

#: Exit code of a replica process (and of a launcher all of whose replicas did so) that left the job on a
#: preemption notice at a step boundary: sysexits.h's EX_TEMPFAIL ("temporary failure, the user is invited to
#: retry"): a requeued job resumes from the last checkpoint. Not a failure: the launcher does not restart it.
EXIT_LEFT_ON_NOTICE = 75
#: The notice signal when none is named: Kubernetes' and the clouds' spot notices send SIGTERM.
DEFAULT_NOTICE_SIGNAL = "SIGTERM"


def leaving_exit_code() -> int:
    """The exit code of a process that leaves on its notice: :data:`EXIT_LEFT_ON_NOTICE`, or under a torchrun
    agent that asked for it (``LIGHTNING_RECOVER_LEFT_MARKER``) 0 after creating the agent's marker file."""
    marker = os.environ.get(LEFT_MARKER)
    if not marker:
        return EXIT_LEFT_ON_NOTICE
    with open(marker, "a"):
        pass
    return 0


def parse_signal(name: Any) -> signal.Signals:
    """``"SIGTERM"``, ``"TERM"``, ``"usr1"``, ``15`` or a :class:`signal.Signals` as a signal; ``ValueError``
    with a HINT for anything else (SIGKILL and SIGSTOP cannot be caught, SIGINT stays Ctrl-C)."""
    if isinstance(name, signal.Signals):
        found = name
    else:
        text = str(name).strip().upper()
        try:
            found = (
                signal.Signals(int(text))
                if text.isdigit()
                else signal.Signals[text if text.startswith("SIG") else "SIG" + text]
            )
        except (KeyError, ValueError):
            raise ValueError(
                f"notice signal {name!r} is not a signal name. HINT: e.g. SIGTERM (the default) or SIGUSR1 (Slurm's "
                "--signal=USR1@60)."
            ) from None
    if found in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
        raise ValueError(
            f"{found.name} cannot be the notice signal (SIGKILL and SIGSTOP cannot be caught; SIGINT is Ctrl-C). "
            "HINT: use SIGTERM or SIGUSR1."
        )
    return found


class Notice:
    """Whether this process was told to leave: by its notice signal or by an operator's leave request.

    The signal handler only sets an event (a handler runs between two bytecodes of the main thread, which may be
    inside a store call: it must not talk to the store itself); the step reads it before its reduce. A second
    signal while the first is pending restores the signal's default action and re-raises it: a process that
    cannot finish its step in the grace period ends as a failure does.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self.source = ""  # what asked: "SIGTERM", "leave request", ...
        self._signal: Optional[signal.Signals] = None
        self._previous: Any = None
        self.before_training: Callable[[], bool] = lambda: False  # True: nothing to finish, leave at once

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, source: str) -> None:
        if not self._event.is_set():
            self.source = source
            self._event.set()

    def install(self, which: Any) -> None:
        """Handle ``which`` (see :func:`parse_signal`) as this process's notice; only in the main thread."""
        self._signal = parse_signal(which)
        if threading.current_thread() is not threading.main_thread():
            return  # replicas as threads (in-process tests): no signals, leave requests only
        previous = signal.signal(self._signal, self._handle)
        if self._previous is None:  # installed again (over a framework's handler): the first one is restored
            self._previous = previous

    def _handle(self, signum: int, _frame: Any) -> None:
        if self._event.is_set() and self.source == signal.Signals(signum).name:
            signal.signal(signum, signal.SIG_DFL)  # a second notice: no more grace
            signal.raise_signal(signum)
            return
        self.set(signal.Signals(signum).name)
        if self.before_training():
            raise SystemExit(leaving_exit_code())

    def uninstall(self) -> None:
        if self._signal is not None and self._previous is not None:
            if threading.current_thread() is threading.main_thread():
                signal.signal(self._signal, self._previous)
            self._previous = None


def leave_key(replica: int) -> str:
    return f"leave/{replica}"


def request_leave(store: Any, sealer: Sealer, replica: int) -> int:
    """Ask replica ``replica`` (its current incarnation) to leave at its next step boundary, as its notice signal
    would: the sealed ``leave/{r}`` (``store``: the control plane's raw store, ``sealer``: the job's). Returns the
    incarnation asked; ``ValueError`` with a HINT when the replica is not running."""
    inc = int(store.add(f"inc/{replica}", 0))
    dead = read_death(sealer, replica, peek(store, f"dead/{replica}") or b"")
    if inc <= 0 or dead >= inc:
        raise ValueError(
            f"replica {replica} is not running (incarnation {inc} {'never started' if inc <= 0 else 'ended'}). "
            "HINT: name a live replica id (the launcher's log lists them)."
        )
    store.set(leave_key(replica), sealer.seal(leave_key(replica), str(inc).encode()))
    return inc


def leave_requested(store: Any, replica: int, incarnation: int) -> bool:
    """True once ``leave/{replica}`` names this incarnation (read from the watched view on etcd)."""
    found = store.recent_genuine(leave_key(replica))
    return found is not None and found.strip().isdigit() and int(found) == incarnation
