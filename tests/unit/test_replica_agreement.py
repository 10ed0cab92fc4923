"""When the processes of a sharded replica go on in a generation (protocol/replica_agreement.py): the rule as a
table, no store."""

from __future__ import annotations

import pytest

from lightning_recover.protocol.replica_agreement import GO, STOP, WAIT, agreement_outcome


@pytest.mark.parametrize(
    "case, outcomes, outcome",
    [
        ("every process succeeded", ["3:ok", "3:ok"], GO),
        ("a mate not published yet", ["3:ok", None], WAIT),
        ("a mate failed", ["3:ok", "3:failed"], STOP),
        ("a failure ends the wait before the rest published", [None, "3:failed", None], STOP),
        ("an earlier incarnation's outcome is not this one's", ["3:ok", "2:ok"], WAIT),
        ("an earlier incarnation's failure does not stop this one", ["3:ok", "2:failed"], WAIT),
        ("nothing published", [None, None], WAIT),
        ("an unknown outcome is not a success", ["3:ok", "3:maybe"], WAIT),
        ("four processes, all succeeded", ["3:ok"] * 4, GO),
    ],
)
def test_a_replica_goes_on_by_the_rule(case, outcomes, outcome):
    assert agreement_outcome(outcomes, incarnation=3) == outcome, case
