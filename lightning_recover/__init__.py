"""lightning-recover: Lightning training that survives dead replicas, and checkpoints at disk speed.

``import lightning_recover`` registers ``strategy="recover"`` with Lightning Fabric (and the
Trainer, where supported).
"""

from __future__ import annotations

from lightning_recover.core import RecoverOptions
from lightning_recover.planner import plan_quotas
from lightning_recover.strategy import RecoverStrategy, Step

__all__ = ["RecoverOptions", "RecoverStrategy", "RecoverTrainerStrategy", "Step", "plan_quotas", "UringCheckpointIO"]
__version__ = "0.1.0"


def _register() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if "recover" not in STRATEGY_REGISTRY:
        RecoverStrategy.register_strategies(STRATEGY_REGISTRY)
    try:
        from lightning.pytorch.strategies import StrategyRegistry
    except ImportError:  # lightning.pytorch is optional for Fabric users
        return
    if "recover" not in StrategyRegistry:
        from lightning_recover.trainer_strategy import RecoverTrainerStrategy

        RecoverTrainerStrategy.register_strategies(StrategyRegistry)


_register()


def __getattr__(name: str):
    if name == "RecoverTrainerStrategy":
        from lightning_recover.trainer_strategy import RecoverTrainerStrategy

        return RecoverTrainerStrategy
    if name == "UringCheckpointIO":
        from lightning_recover.checkpoint import UringCheckpointIO

        return UringCheckpointIO
    raise AttributeError(f"module 'lightning_recover' has no attribute {name!r}")
