"""The fault-tolerant data-parallel protocol, with no import of Lightning.

Modules, one concept each: ``messages`` (the typed, checked access to the coordinator's store),
``coordinator`` (the server and its heartbeat monitor), ``membership`` (generations, joins,
heartbeats), ``collectives`` (survivor all-reduce, broadcast, store exchanges), ``decisions`` (the
commit/retry rule), ``planner`` (quotas), ``step`` (one step with in-step recovery), ``faults``
(fault injection), ``options`` and ``replica`` (the façade the strategies use).
"""

from lightning_recover.protocol.faults import Fault, FaultInjector, parse_faults
from lightning_recover.protocol.options import RecoverOptions
from lightning_recover.protocol.quotas import plan_quotas
from lightning_recover.protocol.replica import Replica
from lightning_recover.protocol.step import StepStats

__all__ = ["Fault", "FaultInjector", "RecoverOptions", "Replica", "StepStats", "parse_faults", "plan_quotas"]
