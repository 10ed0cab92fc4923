"""Exceptions the product raises, each with a message that says what to do."""

from __future__ import annotations


class RecoverError(RuntimeError):
    """Base class of lightning-recover's runtime errors."""


class CoordinatorLostError(RecoverError):
    """The coordinator (the TCPStore server) is gone: no generation or commit can be agreed."""


# What a replica that lost the control plane should say: its own host may be the one cut off (a
# network partition), in which case the job goes on without it; "restart the job" would be wrong then.
COORDINATOR_LOST_HINT = (
    "HINT: if the other replicas still reach the coordinator, they continue without this one, and its launcher "
    "or torchrun agent restarts it to rejoin once its host reaches the coordinator again (check this host's "
    "network); if every replica stopped, the coordinator itself is gone: restart the job from its last checkpoint."
)


class ReplicaExcludedError(RecoverError):
    """This replica was dropped from the group (it was suspected dead) and must not apply steps."""


class MembershipChanged(RecoverError):
    """Internal signal: the current generation failed; a new one must be formed."""


class InjectedFault(RecoverError):
    """Raised inside a replica by ``--inject raise:...`` to emulate a crash."""


class ForgedMessageError(RecoverError):
    """A control-plane value failed authentication: written by someone without the job's secret."""
