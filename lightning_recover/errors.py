"""Exceptions the product raises, each with a message that says what to do."""

from __future__ import annotations


class RecoverError(RuntimeError):
    """Base class of lightning-recover's runtime errors."""


class CoordinatorLostError(RecoverError):
    """The coordinator (the TCPStore server) is gone: no generation or commit can be agreed."""


class ReplicaExcludedError(RecoverError):
    """This replica was dropped from the group (it was suspected dead) and must not apply steps."""


class MembershipChanged(RecoverError):
    """Internal signal: the current generation failed; a new one must be formed."""


class InjectedFault(RecoverError):
    """Raised inside a replica by ``--inject raise:...`` to emulate a crash."""


class ForgedMessageError(RecoverError):
    """A control-plane value failed authentication: written by someone without the job's secret."""
