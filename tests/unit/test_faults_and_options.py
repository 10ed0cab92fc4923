"""Parsing of fault specs and validation of strategy options (pure logic)."""

import pytest

from lightning_recover import env
from lightning_recover.data import MicrobatchSource
from lightning_recover.protocol.faults import Fault, FaultInjector, check_plan, parse_faults, wait_for_gate
from lightning_recover.protocol.options import DEFAULT_HEARTBEAT_INTERVAL, ETCD_BEATS_PER_TIMEOUT, RecoverOptions


def test_parse_several_faults():
    faults = parse_faults(
        "kill:replica=2:step=5:phase=backward; hang:replica=1:step=7:phase=reduce,raise:replica=0:step=1:phase=commit:incarnation=2"
    )
    assert faults == [Fault("kill", 2, 5, "backward"), Fault("hang", 1, 7, "reduce"), Fault("raise", 0, 1, "commit", 2)]
    assert str(faults[0]) == "kill:replica=2:step=5:phase=backward"


def test_save_phase_and_a_save_fault_never_reached_is_reported():
    faults = parse_faults("kill:replica=1:inner=1:step=3:phase=save")
    assert faults == [Fault("kill", 1, 3, "save", inner=1)]
    injector = FaultInjector(faults, replica=1, incarnation=1, act=lambda f: None, inner=1)
    for phase in ("forward", "backward", "reduce", "commit", "optimizer"):
        injector.maybe_fire(3, phase)
    with pytest.raises(ValueError, match=r"phase=save never fired"):
        injector.check_all_fired(last_step=3)  # e.g. no fabric.save after step 3
    injector.maybe_fire(3, "save")
    injector.check_all_fired(last_step=3)


def test_a_pause_needs_its_gate_named_and_goes_on_once_the_gate_exists(tmp_path):
    plan = "pause:replica=1:inner=1:step=1:phase=commit"
    with pytest.raises(
        ValueError, match=rf"^--inject: a pause fault waits for a gate file.*HINT: set {env.PAUSE_GATE}="
    ):
        check_plan(plan, 2, environ={})
    gate = tmp_path / "gate"
    assert check_plan(plan, 2, environ={env.PAUSE_GATE: str(gate)}) == [Fault("pause", 1, 1, "commit", inner=1)]
    with pytest.raises(ValueError, match="no gate file is named"):
        wait_for_gate("")
    gate.touch()
    wait_for_gate(str(gate))  # an open gate: goes on at once (a gate not seen would hold the test to its timeout)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("explode:replica=1:step=1:phase=forward", "kind must be one of"),
        ("kill:replica=1:step=1", "missing phase"),
        ("kill:replica=1:step=1:phase=lunch", "phase must be one of"),
        ("kill:replica=x:step=1:phase=forward", "integers"),
        ("kill:replica=1:when=1:phase=forward", "bad field"),
    ],
)
def test_bad_fault_specs_say_what_is_expected(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_faults(spec)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(quota="fastest"), "quota must be"),
        (dict(heartbeat_timeout=0), "heartbeat_timeout must be a positive"),
        (dict(collective_timeout=-1), "collective_timeout must be a positive"),
        (dict(heartbeat_interval=0.5, heartbeat_timeout=0.6), "must exceed twice"),
        (dict(microbatches=0), "microbatches must be a positive"),
        (dict(restarts=-1), "restarts"),
    ],
)
def test_bad_options_raise_with_hint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecoverOptions(**kwargs)


def test_the_default_heartbeat_period_is_the_control_planes():
    """0.1 s on the embedded coordinator; on etcd a quarter of heartbeat_timeout (each beat is a
    Raft write there); a heartbeat_interval given is used on both."""
    assert RecoverOptions().heartbeat_period(etcd=False) == DEFAULT_HEARTBEAT_INTERVAL == 0.1
    assert RecoverOptions().heartbeat_period(etcd=True) == 1.0 / ETCD_BEATS_PER_TIMEOUT == 0.25
    assert RecoverOptions(heartbeat_timeout=0.6).heartbeat_period(etcd=True) == 0.15
    # Not capped (the monitor's ticks, not the beats, keep the watched views current): fewer beats per second.
    assert RecoverOptions(heartbeat_timeout=4.0).heartbeat_period(etcd=True) == 1.0
    assert RecoverOptions(heartbeat_interval=0.05).heartbeat_period(etcd=True) == 0.05
    with pytest.raises(ValueError, match="heartbeat_interval must be a positive"):
        RecoverOptions(heartbeat_interval=float("nan"))


def test_microbatches_smaller_than_replicas_is_refused_with_hint():
    with pytest.raises(ValueError, match="HINT: use microbatches >= 4"):
        RecoverOptions(microbatches=3).resolve_microbatches(4)
    assert RecoverOptions().resolve_microbatches(4) == 4


def test_microbatch_contents_do_not_depend_on_who_computes_them():
    data = list(range(100))
    a = MicrobatchSource(data, microbatch_size=3, microbatches=4, seed=7, collate_fn=list)
    b = MicrobatchSource(data, microbatch_size=3, microbatches=4, seed=7, collate_fn=list)
    # b sees the ids in another order (as a survivor recomputing a dead replica's share would)
    for step in (0, 1, 8, 9):
        for j in reversed(range(4)):
            assert b.batch(step, j) == a.batch(step, j)
    seen = [i for j in range(4) for i in a.indices(0, j)] + [
        i for s in range(1, 8) for j in range(4) for i in a.indices(s, j)
    ]
    assert len(seen) == len(set(seen)) == 96, "an epoch visits distinct samples"
    assert a.indices(8, 0) != a.indices(0, 0), "a new epoch has a new permutation"


def test_too_small_dataset_is_refused():
    with pytest.raises(ValueError, match="HINT"):
        MicrobatchSource(list(range(10)), microbatch_size=4, microbatches=4)
