"""Every private torch or Lightning name the package uses still exists, with the parameters it is called with
(lightning_recover/upstream_private.py lists them): an upgrade that moves one fails here, by name."""

from __future__ import annotations

import importlib
import inspect

import pytest

from lightning_recover.upstream_private import PRIVATE_NAMES


def _instance(cls: type, tmp_path) -> object:
    if cls.__name__ == "Trainer":
        from lightning.fabric.plugins.environments import LightningEnvironment

        # an explicit cluster environment: no Slurm probe (and its srun warning) on a machine with Slurm
        return cls(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            plugins=[LightningEnvironment()],
        )
    if cls.__name__ == "TensorBoardLogger":
        return cls(save_dir=str(tmp_path))
    raise AssertionError(f"no recipe for an instance of {cls.__name__}: add one here")


def _resolve(dotted: str, tmp_path) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        break
    else:
        raise AssertionError(f"no module of {dotted} imports")
    for name in parts[cut:]:
        if name.endswith("()"):
            obj = _instance(getattr(obj, name[:-2]), tmp_path)
            continue
        assert hasattr(obj, name), f"{dotted}: {obj!r} has no {name} any more"
        obj = getattr(obj, name)
    return obj


@pytest.mark.parametrize("dotted", sorted(PRIVATE_NAMES))
def test_private_upstream_name_is_still_there(dotted, tmp_path):
    obj = _resolve(dotted, tmp_path)
    expected = PRIVATE_NAMES[dotted].parameters
    if expected:
        parameters = inspect.signature(obj).parameters
        missing = [p for p in expected if p not in parameters]
        assert not missing, f"{dotted} no longer takes {missing} (it takes {list(parameters)})"
