"""``bench etcd_control_plane --parts cost``: what each etcd request costs the members in CPU, and the floor
that sets for the step ratio on a shared host (``lightning_recover.bench.etcd_request_cost``).

The arithmetic of the floor is checked in-process (fast); the measurement itself runs briefly on the
one-member etcd (slow) (a real cluster: the numbers are this host's, so only their form is asserted).
"""

from __future__ import annotations

import math

import pytest

from lightning_recover.bench.etcd_request_cost import floor, measure_costs


def test_floor_is_idle_plus_one_report_per_replica_per_step():
    costs = {"idle_cores": 0.05, "ms_per_request": {"report_txn": 3.0}}
    f = floor(costs, replicas=4, step_s=0.1, host_cores=2)
    assert f["members_cores"] == pytest.approx(0.05 + 40 * 0.003)  # 4 replicas x 10 steps/s x 3 ms
    assert f["host_fraction"] == pytest.approx(0.17 / 2)
    assert f["implied_step_ratio"] == pytest.approx(1 / (1 - 0.085))
    longer = floor(costs, replicas=4, step_s=1.0, host_cores=2)
    assert longer["implied_step_ratio"] < f["implied_step_ratio"]  # a longer step: fewer reports per second


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
