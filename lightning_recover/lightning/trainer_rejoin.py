"""A restarted replica rejoining a ``trainer.fit``: the live state travels as a Lightning checkpoint.

Members take the Trainer's full checkpoint at the step boundary (:func:`checkpoint_for_joiner`);
the joiner pre-loads it into Lightning's checkpoint connector (:func:`adopt_checkpoint`), which
then restores modules, callbacks, optimizers, schedulers and loop progress exactly like
``fit(ckpt_path=...)``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn

from lightning_recover.errors import RecoverError


def checkpoint_for_joiner(module: Any) -> dict[str, Any]:
    """Members (at the start of step s, inside ``run_step``, before any microbatch of s ran): the
    Trainer's full checkpoint at that step boundary, handed to a rejoining replica."""
    if module is None or module._trainer is None or module.trainer.state.fn != TrainerFn.FITTING:
        raise RecoverError("a replica can only be admitted while the Trainer is fitting")
    trainer = module.trainer
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    # Taken inside the step: the epoch loop has started the step's batch but not run it, which
    # Lightning restores like a checkpoint saved mid-batch. Only the logging step differs: the
    # loop already counted step s as stepped, and restoring from mid-batch counts it once more.
    # The joiner built its module and datamodule from the same script: their hyper-parameters (of
    # any type, which the weights-only loader on the joiner would refuse) are not handed over.
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):
        checkpoint.pop(key, None)
    epoch_loop = checkpoint["loops"]["fit_loop"]["epoch_loop.state_dict"]
    epoch_loop["_batches_that_stepped"] = epoch_loop.get("_batches_that_stepped", 0) - 1
    return {"checkpoint": checkpoint, "logger_versions": [logger.version for logger in trainer.loggers]}


def check_rejoin_inside_fit(trainer: Any, replica: int) -> None:
    """A restarted replica can only rejoin a running fit: its first Trainer call must be ``fit``."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        fn = getattr(getattr(trainer, "state", None), "fn", None)
        raise RuntimeError(
            f"replica {replica} was restarted while the job runs and must rejoin inside `trainer.fit`, but its "
            f"first Trainer call is {getattr(fn, 'value', fn)!r}. HINT: call trainer.fit(...) first in the "
            "training script (evaluate after fit), or use restarts=0."
        )


def adopt_checkpoint(trainer: Any, received: dict[str, Any], step: int, replica: int) -> dict[str, Any]:
    """Make the peer's checkpoint the one this fit restores from; returns it."""
    checkpoint = received.get("checkpoint")
    if checkpoint is None or checkpoint.get("global_step") != step:
        got = None if checkpoint is None else checkpoint.get("global_step")
        raise RecoverError(f"replica {replica} received a state for step {got} but the group resumes at step {step}")
    for logger, version in zip(trainer.loggers, received.get("logger_versions", [])):
        if "_version" in vars(logger):
            logger._version = version  # the run's log directory, whoever writes it later
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint
    return checkpoint
