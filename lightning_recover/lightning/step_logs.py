"""``self.log`` inside ``training_step`` under the Trainer strategy: captured per microbatch,
logged once per step with the value aggregated over all ``M`` microbatches of all replicas, plus
the fault metrics of the step (``recover/loss``, ``recover/live_replicas``, ...); under Fabric the
same fault metrics go to the loggers given to ``steps()`` (:func:`log_recovery_metrics`).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_recover.protocol.step import StepStats


class StepLogCapture:
    """Collects ``self.log`` calls of the module during one step; logs the aggregate once at the end."""

    _REDUCE = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "amax": "max", "min": "min", "amin": "min"}

    def __init__(self, module: Any) -> None:
        self.module = module
        self.original = module.log
        self._signature = inspect.signature(self.original)
        self.values: dict[str, list[float]] = {}  # name -> [sum, count, max, min]
        self.kwargs: dict[str, dict[str, Any]] = {}
        self.skip = False  # True while a sharded replica runs a zero-contribution slot (a repeated microbatch)

    def __enter__(self) -> StepLogCapture:
        self.module.log = self._log
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.module.__dict__.get("log") == self._log:
            del self.module.log

    def merge_in_replica(self, group: Any) -> None:
        """A sharded replica: combine the captures of its K processes (each computed other microbatches),
        so that every process of the replica holds the replica's values. A collective inside the replica."""
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (self.values, self.kwargs), group=group)
        values: dict[str, list[float]] = {}
        kwargs: dict[str, dict[str, Any]] = {}
        for part_values, part_kwargs in parts:
            kwargs.update(part_kwargs)
            for name, (total, count, high, low) in part_values.items():
                entry = values.get(name)
                if entry is None:
                    values[name] = [total, count, high, low]
                else:
                    entry[0] += total
                    entry[1] += count
                    entry[2] = max(entry[2], high)
                    entry[3] = min(entry[3], low)
        self.values, self.kwargs = values, kwargs

    def _log(self, *args: Any, **kwargs: Any) -> None:
        if self.skip:
            return None
        bound = self._signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        name, value = arguments.pop("name"), arguments.pop("value")
        if isinstance(value, Tensor):
            if value.numel() != 1:
                return self.original(*args, **kwargs)  # let Lightning raise its own error
            number = float(value.detach().float().cpu())
        elif isinstance(value, numbers.Number):
            # typeshed's Number has no __float__ (complex): such a value fails here as in float() anywhere
            number = float(value)  # type: ignore[arg-type]
        else:  # a torchmetrics Metric (or anything else): Lightning handles it per call
            return self.original(*args, **kwargs)
        fx = arguments.get("reduce_fx", "mean")
        fx_name = fx if isinstance(fx, str) else getattr(fx, "__name__", "")
        if fx_name not in self._REDUCE:
            raise ValueError(
                f"self.log({name!r}, reduce_fx={fx!r}) inside training_step is not supported by "
                "strategy='recover'. HINT: use reduce_fx='mean', 'sum', 'max' or 'min'."
            )
        arguments["reduce_fx"] = self._REDUCE[fx_name]
        entry = self.values.get(name)
        if entry is None:
            self.values[name] = [number, 1.0, number, number]
        else:
            entry[0] += number
            entry[1] += 1
            entry[2] = max(entry[2], number)
            entry[3] = min(entry[3], number)
        self.kwargs[name] = arguments
        return None


def log_step(
    capture: StepLogCapture,
    stats: StepStats,
    exchange: Callable[[Any], dict[int, Any]],
    batch_size: int,
    has_logger: bool = True,
) -> None:
    """Log the step's captured values, aggregated over all replicas, and the fault metrics (to the
    logger where the Trainer has one: otherwise Lightning warns once per metric that none is configured)."""
    local = {
        "logs": capture.values,
        "kwargs": capture.kwargs,
        "recomputed": stats.recomputed,
        "recoveries": stats.recoveries,
        "recovery_seconds": stats.recovery_seconds,
    }
    gathered = list(exchange(local).values())
    log = capture.original
    names: dict[str, dict[str, Any]] = {}
    for item in gathered:
        for name, kw in item["kwargs"].items():
            names.setdefault(name, kw)
    for name in sorted(names):
        entries = [item["logs"][name] for item in gathered if name in item["logs"]]
        kw = dict(names[name])
        fx = kw["reduce_fx"]
        if fx == "sum":
            value = sum(e[0] for e in entries)
        elif fx == "max":
            value = max(e[2] for e in entries)
        elif fx == "min":
            value = min(e[3] for e in entries)
        else:
            value = sum(e[0] for e in entries) / sum(e[1] for e in entries)
        kw["sync_dist"] = False  # already the value over all replicas
        if kw.get("batch_size") is None:
            kw["batch_size"] = batch_size
        log(name, torch.tensor(value, dtype=torch.float32), **kw)
    metrics = {
        "recover/loss": stats.loss if stats.loss is not None else float("nan"),
        "recover/live_replicas": stats.live_replicas,
        "recover/generation": stats.generation,
        "recover/recoveries": max(item["recoveries"] for item in gathered),
        "recover/recomputed_microbatches": sum(item["recomputed"] for item in gathered),
        "recover/recovery_seconds": max(item["recovery_seconds"] for item in gathered),
    }
    for name, value in metrics.items():
        log(
            name,
            float(value),
            on_step=True,
            on_epoch=False,
            logger=has_logger,
            batch_size=batch_size,
            prog_bar=name in ("recover/loss", "recover/live_replicas"),
        )


def recovery_metrics(stats: StepStats) -> dict[str, float]:
    """The fault metrics of a committed step as this replica saw it: the same on every live replica (the
    microbatches recomputed are those the step's regroups re-planned, whoever computed them)."""
    lost = sum(int(event.get("lost", 0)) for event in stats.events if event.get("kind") == "regroup")
    return {
        "recover/live_replicas": float(stats.live_replicas),
        "recover/generation": float(stats.generation),
        "recover/recoveries": float(stats.recoveries),
        "recover/recomputed_microbatches": float(lost),
        "recover/recovery_seconds": float(stats.recovery_seconds),
    }


def log_recovery_metrics(loggers: Sequence[Any], stats: StepStats, step: int, is_global_zero: bool) -> None:
    """Fabric: log the step's fault metrics at ``step`` to ``loggers`` (Lightning loggers: TensorBoard, CSV,
    W&B, ...), from the lowest live replica only; nothing, and no warning, without a logger."""
    if not loggers or not is_global_zero:
        return
    metrics = recovery_metrics(stats)
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


def share_logger_versions(trainer: Any, is_global_zero: bool, broadcast: Callable[[Any], Any]) -> None:
    """Whichever replica is the lowest live one writes the logs: all must agree on the directory."""
    for logger in trainer.loggers:
        if "_version" in vars(logger) and logger._version is None:
            version = logger.version if is_global_zero else None
            logger._version = broadcast(version)
