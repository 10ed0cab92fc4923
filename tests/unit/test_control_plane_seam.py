"""Both backends of the control plane's seam implement all of it (no process, no store: the classes only)."""

from __future__ import annotations

import inspect

import pytest

from lightning_recover.control_plane.embedded import CoordinatorStore
from lightning_recover.control_plane.etcd_store import EtcdStore
from lightning_recover.protocol.backend import ControlPlane

_ATTRIBUTES = ("kind", "views", "transactions", "outsiders_can_write")


def _methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


@pytest.mark.parametrize("backend", [CoordinatorStore, EtcdStore])
def test_every_operation_of_the_seam_is_implemented_with_its_parameters(backend):
    wanted = _methods(ControlPlane)
    have = _methods(backend)
    missing = sorted(set(wanted) - set(have))
    assert not missing, f"{backend.__name__} lacks {missing}"
    for name, signature in wanted.items():
        if name == "put_and_decide" and backend is CoordinatorStore:
            continue  # refuses every call: the embedded coordinator has no transactions
        theirs = list(have[name].parameters)
        assert theirs[: len(signature.parameters)] == list(signature.parameters), (backend.__name__, name, theirs)
    for attribute in _ATTRIBUTES:
        assert hasattr(backend, attribute), f"{backend.__name__} lacks {attribute}"


def test_the_capabilities_say_what_differs():
    assert (CoordinatorStore.views, CoordinatorStore.transactions, CoordinatorStore.outsiders_can_write) == (
        False,
        False,
        True,
    )
    assert (EtcdStore.views, EtcdStore.transactions, EtcdStore.outsiders_can_write) == (True, True, False)
    assert CoordinatorStore.kind == "coordinator" and EtcdStore.kind == "etcd control plane"
