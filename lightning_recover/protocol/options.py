"""The options of ``strategy="recover"``, validated where they enter."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class RecoverOptions:
    """Options of ``strategy="recover"``; see ``RecoverStrategy`` for their meaning."""

    microbatches: Optional[int] = None
    quota: str = "equal"
    heartbeat_interval: float = 0.1
    heartbeat_timeout: float = 1.0
    hang_timeout: float = 60.0
    join_timeout: float = 60.0
    collective_timeout: float = 60.0
    startup_timeout: float = 300.0
    restarts: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.quota not in ("equal", "throughput"):
            raise ValueError(f"quota must be 'equal' or 'throughput', got {self.quota!r}")
        for name in ("heartbeat_interval", "heartbeat_timeout", "hang_timeout", "join_timeout",
                     "collective_timeout", "startup_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}s) must exceed twice heartbeat_interval "
                f"({self.heartbeat_interval}s), or healthy replicas would be declared dead. "
                "HINT: heartbeat_timeout >= 5 x heartbeat_interval is a safe choice."
            )
        if self.hang_timeout <= self.heartbeat_timeout:
            raise ValueError(
                f"hang_timeout ({self.hang_timeout}s) must exceed heartbeat_timeout ({self.heartbeat_timeout}s): it is "
                "how long a replica may make no progress while its peers wait on it (a long microbatch, a checkpoint "
                "write) before it counts as hung. HINT: keep the default 60s or raise it for slow steps or checkpoint writes."
            )
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        if not isinstance(self.restarts, int) or self.restarts < 0:
            raise ValueError(f"restarts must be a non-negative integer, got {self.restarts!r}")

    @property
    def store_timeout(self) -> float:
        """Longest the coordinator may stay silent (one operation, or the heartbeat's answers) before
        a replica reports ``CoordinatorLostError`` and stops: ``max(5, 2 x heartbeat_timeout + 1)``
        seconds. The 5 s floor keeps a CPU-starved coordinator on a loaded small machine (measured:
        2 s silences while 20 processes start on 2 cores) from ending healthy jobs."""
        return max(5.0, 2 * self.heartbeat_timeout + 1.0)

    def resolve_microbatches(self, replicas: int) -> int:
        M = self.microbatches if self.microbatches is not None else replicas
        if M < replicas:
            raise ValueError(
                f"microbatches={M} is smaller than the number of replicas ({replicas}): some replica would "
                f"have nothing to compute. HINT: use microbatches >= {replicas} (a multiple of it balances best)."
            )
        return M
