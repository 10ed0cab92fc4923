"""What the package does in a fresh interpreter: the core imports without Lightning, and the strategy registers
whichever of lightning_recover and Lightning is imported first (each a new process: the integration tier)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # a fresh interpreter importing torch and all of the checkpoint package (~3 s of CPU)
def test_protocol_works_without_lightning():
    """The protocol, the launcher and the checkpoint engine (single files and DCP) are usable without
    Lightning (one interpreter for both checks: each costs a torch import); the Lightning plugin and
    the spread save live in ``lightning_recover.lightning``."""
    code = (
        "import sys, pkgutil, importlib; "
        "sys.modules.update({m: None for m in ('lightning', 'lightning.fabric', 'lightning.pytorch', "
        "'pytorch_lightning')}); "
        "import lightning_recover.protocol, lightning_recover.launch.supervisor, lightning_recover.launch.commands; "
        "from lightning_recover.protocol import Replica, plan_quotas; "
        "import lightning_recover.checkpoint as c; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(c.__path__, c.__name__ + '.')]; "
        "assert not [m for m, v in sys.modules.items() if m.split('.')[0] in ('lightning', 'pytorch_lightning') "
        "and v is not None]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow  # five new interpreters that import Lightning (~8 s of CPU each)
def test_strategy_registers_without_importing_lightning_early():
    """``import lightning_recover`` leaves Lightning unimported (the CLI, the launcher and the
    coordinator never use it: its import costs ~4 s per process), and ``strategy="recover"`` is
    registered whichever is imported first: lightning_recover, Lightning, or one of the adapter modules."""
    check = (
        "from lightning.fabric.strategies import STRATEGY_REGISTRY; "
        "from lightning.pytorch.strategies import StrategyRegistry; "
        "assert 'recover' in STRATEGY_REGISTRY and 'recover' in StrategyRegistry; "
    )
    ours_first = "import sys, lightning_recover.cli; assert 'lightning' not in sys.modules; import lightning; " + check
    lightning_first = "import lightning.pytorch, lightning_recover; " + check
    # An adapter imported before Lightning brings Lightning in itself: the hook finds it half-built, and it
    # registers at the end of its own import.
    strategy_first = "from lightning_recover import RecoverStrategy; " + check
    fabric_module_first = "import lightning_recover.lightning.fabric; " + check
    trainer_module_first = "from lightning_recover.lightning.trainer import RecoverTrainerStrategy; " + check
    for code in (ours_first, lightning_first, strategy_first, fabric_module_first, trainer_module_first):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 0, result.stderr
