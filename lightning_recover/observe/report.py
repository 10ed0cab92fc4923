"""What a replica tells the monitor about itself, on its heartbeat: a few short fields beside the beat.

The heartbeat is already read by the monitor on every pass, so the status board costs the replicas no
write of their own. Fields (all optional; a replica that never committed a step sends none of them):

``gen``     the generation this replica last committed a step in
``member``  True once the replica is a member of a generation (a restarted one: once it rejoined)
``done``    the last step this replica committed
``quota``   microbatches it computed in that step (its quota plus any it recomputed)
``m``       microbatches per step (M)
``host``    its host name
``rec``     its last recovery: ``[generation, step, recoveries in that step, seconds, microbatches it recomputed]``
``ckpt``    its last checkpoint save: ``[step, seconds, bytes]``
``left``    on the report of a step that began with replicas leaving on notice: ``[generation, [replicas]]``
``notice``  what told this replica to leave (``"SIGTERM"``, ``"leave request"``), once it was told
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

HOST = socket.gethostname()


def step_report(
    previous: dict[str, Any],
    generation: int,
    step: int,
    computed: int,
    microbatches: int,
    recovery: Optional[tuple[int, float, int]] = None,
    left: Sequence[int] = (),
) -> dict[str, Any]:
    """The fields of a replica that just committed ``step`` in ``generation``; ``recovery`` = (recoveries,
    seconds, recomputed) when the step recovered; ``left``: the replicas that left on notice at its start. The
    last recovery and checkpoint of ``previous`` (the replica's report before) are kept: a board that missed a
    beat still learns them at the next; ``left`` while the generation it formed lasts (a newcomer that takes a
    leaver's id joins in a later one)."""
    out: dict[str, Any] = {
        "gen": generation,
        "member": True,
        "done": step,
        "quota": computed,
        "m": microbatches,
        "host": HOST,
    }
    for kept in ("rec", "ckpt"):
        if kept in previous:
            out[kept] = previous[kept]
    if recovery is not None:
        count, seconds, recomputed = recovery
        out["rec"] = [generation, step, count, round(seconds, 4), recomputed]
    if left:
        out["left"] = [generation, sorted(left)]
    elif isinstance(previous.get("left"), list) and previous["left"][0] == generation:
        out["left"] = previous["left"]
    return out


def note_step(progress: Any, stats: Any, microbatches: int) -> None:
    """Put a replica's committed step (its ``StepStats``) on its heartbeat (``progress.report``); a recovery
    is news (``progress.urgent``: on etcd the next beat is written although a commit vouched for it)."""
    recovery = (stats.recoveries, stats.recovery_seconds, stats.recomputed) if stats.recoveries else None
    left = [r for event in stats.events if event.get("kind") == "boundary-regroup" for r in event.get("left", ())]
    report = step_report(progress.report, stats.generation, stats.step, stats.computed, microbatches, recovery, left)
    progress.report = report
    progress.urgent = progress.urgent or recovery is not None or bool(left)


def note_member(progress: Any, generation: int, microbatches: int) -> None:
    """Put on the heartbeat that the replica became a member of ``generation`` (news, as a recovery is)."""
    progress.report = member_report(generation, microbatches)
    progress.urgent = True


def member_report(generation: int, microbatches: int) -> dict[str, Any]:
    """The fields of a replica that became a member of ``generation`` (formed it, or rejoined into it)."""
    return {"gen": generation, "member": True, "m": microbatches, "host": HOST}


def checkpoint_report(previous: dict[str, Any], step: int, seconds: float, size: int) -> dict[str, Any]:
    """``previous`` with the replica's newest checkpoint save: ``size`` bytes of ``step`` in ``seconds``."""
    return {**previous, "ckpt": [step, round(seconds, 4), int(size)]}


def path_bytes(path: Any) -> int:
    """Bytes of the file at ``path``, or of every file under the directory ``path`` (0 when absent)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(directory, name))
            except OSError:
                pass  # removed meanwhile (a temporary): not part of the checkpoint
    return total


@contextmanager
def noted_checkpoint(progress: Optional[Any], step: int, path: Any) -> Iterator[None]:
    """Time the save inside and put it on the heartbeat (``progress.report``): the seconds the training loop
    was blocked and the bytes at ``path`` when it returned (an asynchronous save may still be writing)."""
    start = time.perf_counter()
    yield
    if progress is not None:
        seconds = time.perf_counter() - start
        progress.report = checkpoint_report(progress.report, step, seconds, path_bytes(path))
        progress.urgent = True
