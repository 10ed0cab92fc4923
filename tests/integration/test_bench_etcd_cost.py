"""``python -m benchmarks.etcd_control_plane --parts cost``: what each etcd request costs the members in CPU
(``benchmarks/etcd_request_cost.py``), measured briefly on the one-member etcd (slow; a real
cluster: the numbers are this host's, so only their form is asserted); and the arithmetic of the
steady-state projection to 2,000 replicas (``project_steady``, fast).
"""

from __future__ import annotations

import math

import pytest

from benchmarks.etcd_control_plane import project_steady
from benchmarks.etcd_request_cost import measure_costs


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


def test_the_steady_projection_grows_only_the_heartbeats_with_the_replicas():
    """``project_steady``: per step of a 4-replica job of 1 s steps, 10 Raft writes of which 8 heartbeats. At
    2,000 replicas each replica still beats 2 a second (4,000 writes/s, one event each: the monitor's view),
    and the step's 2 other writes stay 2 a second, each received by every process (2 x 2,000 views)."""
    steady = {
        "per_step_of_the_job": {"etcd_server_proposals_committed_total": 10.0},
        "heartbeats_per_step_of_the_job": 8.0,
        "step_s": 1.0,
    }
    got = project_steady(steady, replicas=4, capacity=1000.0)
    assert got["heartbeats_per_s"] == 4000.0
    assert got["writes_per_s"] == 4002.0 and got["capacity_fraction"] == 4.002
    assert got["watch_events_per_s"] == 4000.0 + 2.0 * 4000
