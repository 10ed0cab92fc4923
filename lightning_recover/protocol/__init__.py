"""The fault-tolerant data-parallel protocol, with no import of Lightning.

Modules, one concept each: ``messages`` (the typed, checked access to the coordinator's store),
``coordinator`` (the server and its heartbeat monitor), ``membership`` (generations; its parts
``heartbeat``, ``incarnations``, ``join_rounds``, ``join_requests``), ``collectives`` (survivor all-reduce, broadcast, store exchanges), ``decisions`` (the
commit/retry rule), ``quotas``, ``step`` (one step with in-step recovery), ``faults``
(fault injection), ``options`` and ``replica`` (the façade the strategies use).
"""

from __future__ import annotations

import importlib
from typing import Any

# Where each public name lives: imported on first use, so that a light module of the package (options,
# faults, quotas) does not import torch through this package's import.
_PUBLIC = {
    "Fault": "faults",
    "FaultInjector": "faults",
    "parse_faults": "faults",
    "RecoverOptions": "options",
    "plan_quotas": "quotas",
    "Replica": "replica",
    "StepStats": "step",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lightning_recover.protocol' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightning_recover.protocol.{_PUBLIC[name]}"), name)
