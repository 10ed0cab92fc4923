"""lightning-recover: Lightning training that survives dead replicas, and checkpoints at disk speed.

``import lightning_recover`` registers ``strategy="recover"`` with Lightning Fabric and the Trainer.
The protocol (``lightning_recover.protocol``) does not need Lightning: without it installed, the
package imports and only the Lightning adapters are missing.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_recover import env
from lightning_recover.protocol.options import RecoverOptions
from lightning_recover.protocol.planner import plan_quotas

__all__ = ["RecoverOptions", "RecoverStrategy", "RecoverTrainerStrategy", "Step", "plan_quotas", "UringCheckpointIO"]
__version__ = "0.1.0"


def _lightning_available() -> bool:
    try:
        import lightning.fabric  # noqa: F401
    except ImportError:
        return False
    return True


def _register() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_recover.lightning.fabric import RecoverStrategy

    if "recover" not in STRATEGY_REGISTRY:
        RecoverStrategy.register_strategies(STRATEGY_REGISTRY)
    try:
        from lightning.pytorch.strategies import StrategyRegistry
    except ImportError:  # lightning.pytorch is optional for Fabric users
        return
    if "recover" not in StrategyRegistry:
        from lightning_recover.lightning.trainer import RecoverTrainerStrategy

        RecoverTrainerStrategy.register_strategies(StrategyRegistry)


if os.environ.get(env.CONTROL_PROCESS) != "1" and _lightning_available():
    _register()


def __getattr__(name: str) -> Any:
    if name in ("RecoverStrategy", "Step"):
        from lightning_recover.lightning import fabric

        return getattr(fabric, name)
    if name == "RecoverTrainerStrategy":
        from lightning_recover.lightning.trainer import RecoverTrainerStrategy

        return RecoverTrainerStrategy
    if name == "UringCheckpointIO":
        from lightning_recover.checkpoint import UringCheckpointIO

        return UringCheckpointIO
    raise AttributeError(f"module 'lightning_recover' has no attribute {name!r}")
