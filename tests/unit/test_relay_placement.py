"""Where a launcher's watch relay gets the job's keys (``launch/host_relay.relay_placement``), how a rack's key is
read (``control_plane/rack_relay.relay_address``; each refusal is one line with its fix), and whose claim a key is
(``etcd_client.in_lease``)."""

from __future__ import annotations

import pytest

from lightning_recover import env
from lightning_recover.control_plane.etcd_client import in_lease
from lightning_recover.control_plane.rack_relay import relay_address, written_address
from lightning_recover.launch.host_relay import RelayPlacement, relay_placement


def test_the_options_win_over_the_environment_and_fill_in_from_it():
    environ = {env.WATCH_RACK: "rack-3", env.WATCH_RACK_ADDRESS: "10.0.3.7"}
    assert relay_placement(None, None, None, etcd=True, environ=environ) == RelayPlacement(
        rack="rack-3", rack_address="10.0.3.7"
    )
    assert relay_placement(None, "rack-4", None, etcd=True, environ=environ).rack == "rack-4"
    placed = relay_placement(None, None, None, etcd=True, environ={env.WATCH_UPSTREAM: "10.0.1.1:7400"})
    assert placed == RelayPlacement(upstream=("10.0.1.1", 7400))
    assert relay_placement(None, None, None, etcd=False, environ={}) == RelayPlacement()  # etcd itself


@pytest.mark.parametrize(
    "upstream, rack, address, etcd, says",
    [
        ("10.0.1.1:7400", None, None, False, "--watch-upstream: a watch relay serves etcd's keys. HINT: use it with"),
        (None, "r1", None, False, "--watch-rack: a watch relay serves etcd's keys. HINT: use it with"),
        ("10.0.1.1:7400", "r1", None, True, "--watch-upstream and --watch-rack both name where"),
        (None, None, "10.0.3.7", True, "--watch-rack-address: the address a rack's relay serves on. HINT: give"),
        (None, "rack 7/a", None, True, "--watch-rack 'rack 7/a': a rack's name is 1-128 letters"),
        ("10.0.1.1", None, None, True, "upstream watch relay '10.0.1.1' is not HOST:PORT. HINT: --watch-upstream"),
    ],
)
def test_a_placement_that_cannot_be_is_refused_with_its_fix(upstream, rack, address, etcd, says):
    with pytest.raises(ValueError) as refused:
        relay_placement(upstream, rack, address, etcd=etcd, environ={})
    assert str(refused.value).startswith(says), refused.value
    assert "\n" not in str(refused.value) and "HINT: " in str(refused.value)


@pytest.mark.parametrize(
    "value, address",
    [(b"10.0.3.7:7400", ("10.0.3.7", 7400)), (b"[fd00::7]:7400", ("fd00::7", 7400)), (b"n7.rack3:1", ("n7.rack3", 1))],
)
def test_a_racks_key_names_an_address_written_as_it_is_read(value, address):
    assert relay_address(value) == address
    assert written_address(address) == value


@pytest.mark.parametrize("value", [b"", b"10.0.3.7", b":7400", b"10.0.3.7:0", b"10.0.3.7:70000", b"a b:1", b"h:1e3"])
def test_a_racks_key_that_names_no_address_is_refused(value):
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        relay_address(value)


@pytest.mark.parametrize(
    "kv, lease, mine",
    [
        ({"key": "a", "lease": "7263831938475"}, 7263831938475, True),  # etcd's JSON gateway writes int64 as text
        ({"key": "a", "lease": "7263831938475"}, 7263831938476, False),
        ({"key": "a"}, 0, False),  # no lease: nobody's claim
        ({"key": "a", "lease": "x"}, 7, False),
    ],
)
def test_a_claim_found_in_its_own_lease_is_its_own(kv, lease, mine):
    assert in_lease(kv, lease) is mine
