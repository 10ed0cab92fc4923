"""Fault injection for tests and demos.

A fault is written ``KIND:replica=R:step=S:phase=P`` (several separated by ``,`` or ``;``), e.g.
``kill:replica=2:step=5:phase=backward``. It is given to the launcher with ``--inject`` or to a
replica through the ``LIGHTNING_RECOVER_INJECT`` environment variable.

Kinds: ``kill`` (SIGKILL of the replica process), ``hang`` (SIGSTOP: the process is frozen, its
heartbeats stop, only the staleness threshold can reveal it), ``stall`` (the main thread blocks
for good while the process and its heartbeat thread live on: a deadlock, revealed only by the
progress it reports), ``raise`` (an exception inside the replica, which then exits with a
traceback), ``notice`` (the process sends itself its preemption notice signal, ``protocol/notice.py``:
it finishes the step and leaves at its commit) and ``pause`` (the main thread waits until the file named by
``LIGHTNING_RECOVER_PAUSE_GATE`` exists, its heartbeat going on: a process made late at an exact point, for
tests that order events across processes; it opens the gate on the event it waits for).

Phases, in the order they happen in a step: ``forward`` (first forward of the step),
``backward`` (first backward), ``reduce`` (just before the gradient all-reduce is issued),
``commit`` (after this replica reported its reduce as done, before the commit is decided),
``optimizer`` (inside the optimizer step, after the commit), and ``recompute`` (when this replica
starts computing microbatches taken over from a failed one: a failure *during* recovery). One
phase outside the step: ``save`` (inside ``fabric.save`` of sharded replicas, after this replica
wrote its part of the checkpoint and before it reported it, while the other replicas may still be
writing or waiting for the reports; ``step`` is the index of the last step run before the save).

A fault fires only in the first incarnation of a replica (a restarted replica does not kill
itself again) unless ``incarnation=K`` says otherwise.

Hooks, for tools built on the injector (the demo records when its faults fire; the in-process
tests act out a "kill" by ending a thread instead of the process):
``FaultInjector.add_listener(fn)`` calls ``fn(fault, wall_time)`` just before a fault acts, and
``FaultInjector(..., act=fn)`` replaces what a fault does (the default, :func:`act_on_process`,
signals or raises in this process).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lightning_recover import env
from lightning_recover.errors import InjectedFault
from lightning_recover.protocol.notice import DEFAULT_NOTICE_SIGNAL, parse_signal

KINDS = ("kill", "hang", "stall", "raise", "notice", "pause")
#: The longest a ``pause`` waits for its gate: a test that never opens it still ends.
PAUSE_LIMIT = 600.0
# "regroup": while this replica builds a generation's process group (at step 0 the job's first one).
PHASES = ("forward", "backward", "reduce", "commit", "optimizer", "recompute", "save", "regroup")


@dataclass(frozen=True)
class Fault:
    kind: str
    replica: int
    step: int
    phase: str
    incarnation: int = 1
    inner: int = 0  # which process of a K-process replica acts (0 with one process per replica)

    def __str__(self) -> str:
        where = f":inner={self.inner}" if self.inner else ""
        return f"{self.kind}:replica={self.replica}{where}:step={self.step}:phase={self.phase}"


def parse_faults(spec: str | None, replicas: int | None = None) -> list[Fault]:
    """Parse a fault list; raises ``ValueError`` naming the bad item and the expected form.

    With ``replicas``, a fault naming a replica outside ``0..replicas-1`` is refused too: it could
    never fire, and a test or demo relying on it would silently run failure-free.
    """
    faults: list[Fault] = []
    if not spec:
        return faults
    for item in spec.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        kind, *fields = item.split(":")
        if kind not in KINDS:
            raise ValueError(
                f"fault {item!r}: kind must be one of {', '.join(KINDS)} (e.g. kill:replica=1:step=3:phase=backward)"
            )
        values: dict[str, str] = {}
        for field in fields:
            key, sep, value = field.partition("=")
            if not sep or key not in ("replica", "step", "phase", "incarnation", "inner"):
                raise ValueError(
                    f"fault {item!r}: bad field {field!r}; expected replica=R, step=S, phase=P"
                    "[, incarnation=K][, inner=I]"
                )
            values[key] = value
        missing = {"replica", "step", "phase"} - values.keys()
        if missing:
            raise ValueError(
                f"fault {item!r}: missing {', '.join(sorted(missing))} (e.g. {kind}:replica=1:step=3:phase=backward)"
            )
        if values["phase"] not in PHASES:
            raise ValueError(f"fault {item!r}: phase must be one of {', '.join(PHASES)}")
        try:
            fault = Fault(
                kind,
                int(values["replica"]),
                int(values["step"]),
                values["phase"],
                int(values.get("incarnation", 1)),
                int(values.get("inner", 0)),
            )
        except ValueError:
            raise ValueError(f"fault {item!r}: replica, step and incarnation must be integers") from None
        if fault.replica < 0 or fault.step < 0 or fault.inner < 0:
            raise ValueError(f"fault {item!r}: replica, step and inner must be >= 0")
        if fault.incarnation < 1:
            raise ValueError(f"fault {item!r}: incarnation must be >= 1 (1 = the first start of the replica)")
        if replicas is not None and fault.replica >= replicas:
            raise ValueError(
                f"fault {item!r}: the job has replicas 0..{replicas - 1}, so replica={fault.replica} "
                f"would never fire. HINT: name a replica below {replicas}."
            )
        faults.append(fault)
    return faults


#: The form of a fault plan, for the HINT of every error about one.
PLAN_HINT = (
    f"HINT: a fault is KIND:replica=R:step=S:phase=P (several joined by ','), KIND one of {'|'.join(KINDS)}, "
    f"P one of {'|'.join(PHASES)}."
)

PAUSE_HINT = f"HINT: set {env.PAUSE_GATE}=PATH; the paused process goes on once PATH exists."


def check_plan(
    spec: str | None, replicas: int | None = None, source: str = "--inject", environ: Mapping[str, str] = os.environ
) -> list[Fault]:
    """:func:`parse_faults`, for a plan a user gave (``source``: where it came from, e.g. the
    ``LIGHTNING_RECOVER_INJECT`` variable): a ``ValueError`` of one line that names the source and ends
    in a HINT. Launchers call it before they start anything (``environ``: the replicas' environment)."""
    try:
        faults = parse_faults(spec, replicas)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(f"{source}: {message}" + ("" if "HINT:" in message else f". {PLAN_HINT}")) from None
    if any(f.kind == "pause" for f in faults) and not environ.get(env.PAUSE_GATE):
        raise ValueError(f"{source}: a pause fault waits for a gate file, and none is named. {PAUSE_HINT}")
    return faults


def announcement(fault: Fault, when: float, terminal: bool) -> str:
    """The line a replica prints as a fault acts. On a terminal: the wall clock, after clearing the line
    (another replica's progress bar may be drawn there). Otherwise (a log, a benchmark's pipe) the epoch time
    that benchmarks read (``at t=``) to time the recovery from the fault on, on a line of its own."""
    if terminal:
        clock = time.strftime("%H:%M:%S", time.localtime(when))
        return f"\r\033[K[lightning-recover] replica {fault.replica}: injecting fault {fault} at {clock}"
    return f"\n[lightning-recover] injecting fault {fault} at t={when:.6f}"  # \n: off a bar drawn with \r


def act_on_process(fault: Fault) -> None:
    """What a fault does by default: SIGKILL or SIGSTOP this process, or raise in it."""
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind == "stall":
        threading.Event().wait()  # never set: the main thread is stuck, the heartbeat thread is not
    elif fault.kind == "notice":
        os.kill(os.getpid(), parse_signal(os.environ.get(env.NOTICE_SIGNAL) or DEFAULT_NOTICE_SIGNAL))
    elif fault.kind == "pause":
        wait_for_gate(os.environ.get(env.PAUSE_GATE, ""))
    else:
        raise InjectedFault(f"injected fault {fault}")


def wait_for_gate(path: str, limit: float = PAUSE_LIMIT) -> None:
    """A ``pause``: wait until the file ``path`` exists (at most ``limit`` seconds, then go on)."""
    if not path:
        raise ValueError(f"a pause fault fired, but no gate file is named. {PAUSE_HINT}")
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class FaultInjector:
    """Fires the faults planned for one replica incarnation at the matching (step, phase)."""

    def __init__(
        self,
        faults: list[Fault],
        replica: int,
        incarnation: int,
        *,
        act: Callable[[Fault], None] = act_on_process,
        inner: int = 0,
    ) -> None:
        self._pending = {
            (f.step, f.phase): f
            for f in faults
            if f.replica == replica and f.incarnation == incarnation and f.inner == inner
        }
        self._act = act
        self._listeners: list[Callable[[Fault, float], None]] = []

    @classmethod
    def from_env(cls, replica: int, incarnation: int, inner: int = 0) -> FaultInjector:
        return cls(parse_faults(os.environ.get(env.INJECT)), replica, incarnation, inner=inner)

    def __bool__(self) -> bool:
        return bool(self._pending)

    @property
    def pending(self) -> list[Fault]:
        return list(self._pending.values())

    def unfired(self) -> list[Fault]:
        """Faults of this incarnation that have not fired. At the end of training a non-empty answer
        means the plan named a step past the run's length (or a phase it never reached): only the
        replica can know, so it checks (see :meth:`check_all_fired`)."""
        return sorted(self._pending.values(), key=lambda f: (f.step, PHASES.index(f.phase)))

    def check_all_fired(self, last_step: int) -> None:
        """Raise ``ValueError`` if a planned fault of this incarnation never fired by ``last_step``."""
        missed = self.unfired()
        if missed:
            raise ValueError(
                f"injected fault(s) {', '.join(map(str, missed))} never fired: the run ended at step {last_step} "
                f"(or never reached the phase). HINT: name a step <= {last_step} and a phase the run goes through."
            )

    def add_listener(self, listener: Callable[[Fault, float], None]) -> None:
        """Call ``listener(fault, wall_time)`` just before each fault of this injector acts."""
        self._listeners.append(listener)

    def maybe_fire(self, step: int, phase: str) -> None:
        fault = self._pending.pop((step, phase), None)
        if fault is None:
            return
        now = time.time()
        for listener in self._listeners:
            listener(fault, now)
        print(announcement(fault, now, sys.stdout.isatty()), flush=True)
        self._act(fault)
