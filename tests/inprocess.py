"""In-process protocol harness: a real coordinator, replicas as threads, faults acted out in threads.

Each replica is a thread driving a :class:`Replica` over its own tiny float64 MLP, exactly as a
strategy would (``fire("forward")``, ``before_backward``, ``fire("optimizer")``). The data of
microbatch (s, j) depends on (s, j) only, so a single-process run that sums the same M microbatches
per step (:func:`reference`) is what every surviving replica must end equal to.

Faults (``FaultInjector(..., act=...)``) are acted out without signals:

- ``kill``: the heartbeat stops, the thread unwinds by a private exception without closing the
  replica, and the harness declares it dead as the launcher would on seeing the process exit;
- ``hang``: the heartbeat stops and the thread blocks until teardown; only the coordinator's
  heartbeat monitor can reveal it;
- ``raise``: :class:`InjectedFault` ends the thread; the replica is closed as the process's atexit
  hook would, and declared dead as the launcher would;
- ``suspect`` (harness-only kind): the replica pauses with its heartbeat running, the harness declares
  it dead (a false suspicion), waits until the others applied the step, then lets it continue;
- ``tamper`` (harness-only kind): the replica thread calls the cluster's ``tamper(slot, fault)`` (an
  outside client acting on the store at that exact point of the protocol), then goes on.

Replicas start with ``Replica.start(exit_hook=False)`` (the process's exit hook may ``os._exit`` the
whole pytest process). One protocol internal is replaced while a :class:`Cluster` is open: the
``Heartbeat`` that ``Membership.connect`` makes, by a subclass that remembers the heartbeat of the thread that made it, so a
"killed" thread can stop its own heartbeat without closing the replica, as a dying process does.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional
from unittest import mock

import torch

from lightning_recover.control_plane.connect import connect
from lightning_recover.errors import InjectedFault, ReplicaExcludedError
from lightning_recover.protocol import Fault, FaultInjector, RecoverOptions, Replica
from lightning_recover.protocol import membership as membership_module
from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.heartbeat import Heartbeat
from lightning_recover.protocol.messages import JobSecret, Sealer, mark_dead

# c10d names each peer with a reverse lookup of ::ffff:127.0.0.1, which /etc/hosts does not answer;
# where DNS drops a query (this sandbox: ~1 lookup in 100) the resolver waits 5 s and a store
# connect or gloo rendezvous stalls that long. One second is glibc's shortest resolver timeout.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

HEARTBEAT_INTERVAL = 0.05
HEARTBEAT_TIMEOUT = 0.5
# Long enough to ride out a stalled TCPStore connect (see RES_OPTIONS above) without a spurious
# gloo rendezvous timeout; abandoned operations never need to time out (see _keep_forever).
COLLECTIVE_TIMEOUT = 15.0
JOIN_TIMEOUT = 20.0
RUN_TIMEOUT = 40.0  # the longest a whole cluster run may take before the harness gives up
TOL = 1e-9

IN_DIM, HIDDEN, BATCH = 4, 8, 4
LR, MOMENTUM = 0.1, 0.9


_clusters_run = [0]


def clusters_run() -> int:
    """How many clusters this process ran (tests/conftest.py then exits without destructors)."""
    return _clusters_run[0]


def _keep_forever(obj: Any) -> None:
    """Never free ``obj``, not even when the interpreter exits.

    A dead thread's process group stays open (no process died to close its sockets), so the
    survivors' abandoned operations on it stay in flight until the collective timeout. Destroying
    a gloo group then blocks until that timeout and, at interpreter exit, gloo aborts the process
    (``terminate called after throwing gloo::IoException``). A replica process avoids both by
    ``os._exit`` (``Replica._at_exit``); so does pytest, once it reported (tests/conftest.py), and
    until then the groups are leaked.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


# ---------------------------------------------------------------------- model, data, reference
def make_model(seed: int = 0) -> torch.nn.Module:
    """The MLP every replica starts from; a local generator, so threads never touch the global RNG."""
    model = torch.nn.Sequential(torch.nn.Linear(IN_DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: it has state (handed to a rejoining replica) and, unlike Adam, does not
    # amplify last-bit differences of near-zero gradients, so 1e-9 is a meaningful tolerance.
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def batch(step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch (step, j): a function of (step, j) only, whoever computes it."""
    gen = torch.Generator().manual_seed(100_003 * step + j + 1)
    x = torch.randn(BATCH, IN_DIM, generator=gen, dtype=torch.float64)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def loss_fn(model: torch.nn.Module, step: int, j: int) -> torch.Tensor:
    x, y = batch(step, j)
    dtype = next(model.parameters()).dtype  # float64 by default; float32/bf16 in the exact-mode tests
    return torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_REFERENCE: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}


def reference(microbatches: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Failure-free single-process parameters after 0..steps steps of ``sum_j grad(s, j) / M``."""
    key = (microbatches, steps)
    if key not in _REFERENCE:
        model = make_model()
        optimizer = make_optimizer(model)
        states = [snapshot(model)]
        for s in range(steps):
            for j in range(microbatches):
                loss_fn(model, s, j).backward()
            for p in model.parameters():
                p.grad.div_(microbatches)
            optimizer.step()
            optimizer.zero_grad()
            states.append(snapshot(model))
        _REFERENCE[key] = states
    return _REFERENCE[key]


# ---------------------------------------------------------------------- emulated process death
class _Killed(BaseException):
    """Ends a replica thread as SIGKILL ends a process (BaseException: no protocol handler sees it)."""


class _Hung(BaseException):
    """Ends a hung replica thread at teardown."""


_thread_local = threading.local()


class _TrackedHeartbeat(Heartbeat):
    """A Heartbeat that its own thread can find again, to stop it the way a dying process does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _thread_local.heartbeat = self  # built by Membership.connect, in the replica's own thread


def _halt_heartbeat() -> None:
    heartbeat = getattr(_thread_local, "heartbeat", None)
    if heartbeat is not None:
        heartbeat.stop()


# ---------------------------------------------------------------------- the cluster
@dataclass
class Slot:
    """One replica thread (one incarnation) and what became of it."""

    replica: int
    incarnation: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    protocol_replica: Optional[Replica] = None
    thread: Optional[threading.Thread] = None
    outcome: str = "running"  # done | killed | hung | raised | excluded | error
    error: Optional[BaseException] = None
    trace: str = ""
    applied: list[int] = field(default_factory=list)  # steps whose optimizer update this replica applied
    applied_at: list[float] = field(default_factory=list)  # time.monotonic() of each applied step
    fired_at: dict[str, float] = field(default_factory=dict)  # str(fault) -> time.monotonic() it fired
    rejoined_at: Optional[int] = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    finished: threading.Event = field(default_factory=threading.Event)
    finished_at: float = 0.0  # time.monotonic() when its thread ended
    blocked: threading.Event = field(default_factory=threading.Event)  # hung until teardown

    @property
    def history(self) -> list:
        return self.protocol_replica.history if self.protocol_replica is not None else []

    def describe(self) -> str:
        return f"replica {self.replica} (inc {self.incarnation}): {self.outcome}, applied {self.applied}" + (
            f"\n{self.trace}" if self.trace else ""
        )


class Cluster:
    """A coordinator and replica threads; use as a context manager (teardown is bounded)."""

    def __init__(
        self,
        replicas: int,
        *,
        steps: int,
        microbatches: Optional[int] = None,
        faults: Iterable[Fault] = (),
        quota: str = "equal",
        before_step: Optional[Callable[[int, int], None]] = None,
        tamper: Optional[Callable[[Slot, Fault], None]] = None,
        hang_timeout: float = 60.0,
        collective_timeout: float = COLLECTIVE_TIMEOUT,
        exact: bool = False,
        dtype: torch.dtype = torch.float64,
        optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = make_optimizer,
        loss: Callable[[torch.nn.Module, int, int], torch.Tensor] = loss_fn,
        clip: Optional[float] = None,
    ) -> None:
        self.R = replicas
        self.steps = steps
        self.M = microbatches if microbatches is not None else replicas
        self.faults = list(faults)
        self.quota = quota
        self.before_step = before_step
        self.tamper = tamper
        self.hang_timeout = hang_timeout
        self.collective_timeout = collective_timeout
        self.exact, self.dtype, self.make_optimizer, self.loss, self.clip = exact, dtype, optimizer, loss, clip
        self.slots: list[Slot] = []
        self._progress = threading.Condition()
        self._release = threading.Event()
        self._store_lock = threading.Lock()
        self._stop_monitor = threading.Event()
        self._patches = [mock.patch.object(membership_module, "Heartbeat", _TrackedHeartbeat)]
        self.secret = JobSecret.generate()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Cluster:
        _clusters_run[0] += 1
        for patch in self._patches:
            patch.start()
        self.coordinator = Coordinator(
            "127.0.0.1", 0, self.R, HEARTBEAT_TIMEOUT, self.secret, hang_timeout=self.hang_timeout
        )
        self._monitor = threading.Thread(
            target=self.coordinator.monitor, args=(self._stop_monitor,), name="test-coordinator-monitor", daemon=True
        )
        self._monitor.start()
        self.store = connect(self.coordinator.addr)  # the harness's own client (the "launcher")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release.set()  # hung threads end now
        for slot in self.slots:
            if slot.thread is not None:
                slot.thread.join(timeout=10)
        self._stop_monitor.set()
        self._monitor.join(timeout=5)
        for patch in reversed(self._patches):
            patch.stop()
        for slot in self.slots:
            _keep_forever(slot.protocol_replica)
        stuck = [s.describe() for s in self.slots if s.thread is not None and s.thread.is_alive()]
        # Dropping the last reference to the server store stops the coordinator.
        self.store = None
        self.coordinator = None
        if stuck and exc[0] is None:
            raise AssertionError("replica threads did not end at teardown:\n" + "\n".join(stuck))

    # ------------------------------------------------------------------ control
    def declare_dead(self, replica: int, incarnation: Optional[int] = None) -> bool:
        """What the launcher (or a monitor) does: ``dead/{r}`` = that incarnation."""
        with self._store_lock:
            return mark_dead(self.store, Sealer(self.secret), replica, incarnation)

    def start(self) -> Cluster:
        for r in range(self.R):
            self.spawn(r)
        return self

    def spawn(
        self, replica: int, incarnation: int = 1, seed: int = 0, on_started: Optional[Callable[[Slot], None]] = None
    ) -> Slot:
        """Start a thread for ``replica``; ``incarnation`` must be the one it will get (1, then 2...)."""
        model = make_model(seed).to(self.dtype)
        slot = Slot(replica, incarnation, model, self.make_optimizer(model))
        self.slots.append(slot)
        slot.thread = threading.Thread(
            target=self._run, args=(slot, on_started), name=f"test-replica-{replica}-{incarnation}", daemon=True
        )
        slot.thread.start()
        return slot

    def wait(self, predicate: Callable[[], bool], timeout: float = RUN_TIMEOUT) -> None:
        """Block until ``predicate()`` (re-checked whenever a replica applies a step or ends)."""
        with self._progress:
            if not self._progress.wait_for(predicate, timeout=timeout):
                raise AssertionError("cluster did not reach the expected state:\n" + self.report())

    def join(self, timeout: float = RUN_TIMEOUT) -> list[Slot]:
        """Wait until every replica thread ended or hangs (hung ones end at teardown)."""
        self.wait(lambda: all(s.finished.is_set() or s.blocked.is_set() for s in self.slots), timeout)
        return self.slots

    def slot(self, replica: int) -> Slot:
        """The newest incarnation of ``replica``."""
        return [s for s in self.slots if s.replica == replica][-1]

    def survivors(self) -> list[int]:
        return sorted(s.replica for s in self.slots if s.outcome == "done")

    def report(self) -> str:
        return "\n".join(s.describe() for s in self.slots)

    def _notify(self) -> None:
        with self._progress:
            self._progress.notify_all()

    # ------------------------------------------------------------------ a replica thread
    def _act(self, slot: Slot) -> Callable[[Fault], None]:
        def act(fault: Fault) -> None:
            if fault.kind == "kill":
                _halt_heartbeat()
                raise _Killed(str(fault))
            if fault.kind == "hang":
                _halt_heartbeat()
                slot.blocked.set()
                self._notify()
                self._release.wait(RUN_TIMEOUT)
                raise _Hung(str(fault))
            if fault.kind == "suspect":
                # A false suspicion: declared dead while alive, heartbeat running. Resume only once
                # every other replica has moved past this step without it.
                self.declare_dead(slot.replica, slot.incarnation)
                others = [s for s in self.slots if s.replica != slot.replica]
                self.wait(lambda: all(fault.step in s.applied or s.finished.is_set() for s in others))
                return
            if fault.kind == "tamper" and self.tamper is not None:
                self.tamper(slot, fault)
                return
            raise InjectedFault(f"injected fault {fault}")

        return act

    def _run(self, slot: Slot, on_started: Optional[Callable[[Slot], None]]) -> None:
        model, optimizer = slot.model, slot.optimizer
        options = RecoverOptions(
            microbatches=self.M,
            quota=self.quota,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            join_timeout=JOIN_TIMEOUT,
            collective_timeout=self.collective_timeout,
            hang_timeout=self.hang_timeout,
            startup_timeout=JOIN_TIMEOUT,
            exact=self.exact,
        )
        injector = FaultInjector(self.faults, slot.replica, slot.incarnation, act=self._act(slot))
        injector.add_listener(lambda fault, _wall: slot.fired_at.__setitem__(str(fault), time.monotonic()))
        protocol_replica = slot.protocol_replica = Replica(
            options,
            self.coordinator.addr,
            slot.replica,
            self.R,
            lambda: list(model.parameters()),
            injector=injector,
            secret=self.secret,
        )
        protocol_replica.set_state_hooks(
            lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            lambda state: (model.load_state_dict(state["model"]), optimizer.load_state_dict(state["optimizer"])),
        )
        try:
            protocol_replica.start(exit_hook=False)
            assert protocol_replica.incarnation == slot.incarnation, "spawn() was given the wrong incarnation"
            if on_started is not None:
                on_started(slot)
            first = 0
            if protocol_replica.joining:
                first = slot.rejoined_at = protocol_replica.rejoin()
            for s in range(first, self.steps):
                if self.before_step is not None:
                    self.before_step(slot.replica, s)
                for j in protocol_replica.run_step(s):
                    protocol_replica.fire("forward")
                    loss = self.loss(model, s, j)
                    protocol_replica.before_backward(loss)
                    loss.backward()
                protocol_replica.fire("optimizer")
                if self.clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
                optimizer.step()
                optimizer.zero_grad()
                slot.applied.append(s)
                slot.applied_at.append(time.monotonic())
                self._notify()
            slot.outcome = "done"
            protocol_replica.close()  # what the process's exit hook does
        except _Killed:
            slot.outcome = "killed"
            self.declare_dead(slot.replica, slot.incarnation)  # the launcher saw the process exit
        except _Hung:
            slot.outcome = "hung"
        except BaseException as exc:  # noqa: BLE001 -- a replica process would exit with it
            slot.outcome = (
                "excluded"
                if isinstance(exc, ReplicaExcludedError)
                else "raised"
                if isinstance(exc, InjectedFault)
                else "error"
            )
            slot.error = exc
            slot.trace = traceback.format_exc()
            protocol_replica.close()
            self.declare_dead(slot.replica, slot.incarnation)
        finally:
            slot.state = snapshot(model)
            slot.finished_at = time.monotonic()
            slot.finished.set()
            self._notify()
