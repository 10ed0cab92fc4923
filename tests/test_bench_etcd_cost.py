"""``bench etcd_control_plane --parts cost``: what each etcd request costs the members in CPU
(``lightning_recover.bench.etcd_request_cost``), measured briefly on the one-member etcd (slow; a real
cluster: the numbers are this host's, so only their form is asserted).
"""

from __future__ import annotations

import math

import pytest

from lightning_recover.bench.etcd_request_cost import measure_costs


@pytest.mark.slow  # a real measurement of 8 phases (about 3 s): kept out of `make test-fast`
def test_every_request_kind_is_measured(etcd1):
    costs = measure_costs(etcd1, rate=50, seconds=0.2, watchers=2)
    assert set(costs["ms_per_request"]) == {
        "put",
        "report_txn",
        "linearizable_range",
        "read_through_log",
        "serializable_range",
        "lease_keepalive",
    }
    assert costs["idle_cores"] >= 0
    assert all(math.isfinite(v) for v in costs["ms_per_request"].values())
    assert math.isfinite(costs["ms_per_watch_event"]) and costs["watchers"] == 2
