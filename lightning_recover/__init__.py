"""lightning-recover: Lightning training that survives dead replicas, and checkpoints at disk speed.

``import lightning_recover`` registers ``strategy="recover"`` with Lightning Fabric and the Trainer:
at once when Lightning is already imported, otherwise right after ``import lightning`` completes
(so the CLI, the launcher and the coordinator, which never use Lightning, do not pay its ~4 s
import). The protocol (``lightning_recover.protocol``) does not need Lightning: without it
installed, the package imports and only the Lightning adapters are missing.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys
from typing import Any

from lightning_recover import env, torch_version


def _torch_version() -> str:
    """The version of the torch this process imports, without importing it (seconds that ``lightning-recover
    --help`` and the launcher's parsing do not need): the imported module's, else its distribution's."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a torch without metadata (a source tree on sys.path)
        import torch

        return torch.__version__


# Before anything can load a file or a peer's state with torch's weights_only loader (torch_version.py).
torch_version.check(_torch_version())

__all__ = [
    "AsyncUringCheckpointIO",
    "RecoverOptions",
    "RecoverStrategy",
    "RecoverTrainerStrategy",
    "Step",
    "plan_quotas",
    "UringCheckpointIO",
]
__version__ = "0.1.0"


def _register() -> None:
    """Import the adapters, each of which registers its strategy at the end of its own import. An adapter
    already in ``sys.modules`` registered itself, or is the one importing Lightning right now (half-built:
    importing from it would fail) and registers itself once its import completes."""
    from lightning_recover.observe.logs import quiet_lightning_noise

    quiet_lightning_noise()
    adapters = ["lightning_recover.lightning.fabric"]
    if importlib.util.find_spec("lightning.pytorch") is not None:  # optional for Fabric users
        adapters.append("lightning_recover.lightning.trainer")
    for name in adapters:
        if name not in sys.modules:
            importlib.import_module(name)


class _RegisterAfterLightningImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning`` once, and registers the strategies when its import has completed
    (``lightning/__init__`` imports both Fabric and the Trainer, so both registries exist then)."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (importlib's protocol)
        if name != "lightning":
            return None
        sys.meta_path.remove(self)  # one shot: the search below must not find this finder again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            run_module(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(env.CONTROL_PROCESS) != "1":
    if sys.modules.get("lightning") is not None:
        _register()
    elif "lightning" not in sys.modules:  # None there means "blocked": Lightning is not to be used
        sys.meta_path.insert(0, _RegisterAfterLightningImport())


def __getattr__(name: str) -> Any:
    if name == "RecoverOptions":
        from lightning_recover.protocol.options import RecoverOptions

        return RecoverOptions
    if name == "plan_quotas":
        from lightning_recover.protocol.quotas import plan_quotas

        return plan_quotas
    if name in ("RecoverStrategy", "Step"):
        from lightning_recover.lightning import fabric

        return getattr(fabric, name)
    if name == "RecoverTrainerStrategy":
        from lightning_recover.lightning.trainer import RecoverTrainerStrategy

        return RecoverTrainerStrategy
    if name in ("UringCheckpointIO", "AsyncUringCheckpointIO"):
        from lightning_recover.lightning import checkpoint_io

        return getattr(checkpoint_io, name)
    raise AttributeError(f"module 'lightning_recover' has no attribute {name!r}")
