"""The rejoin state as one flat buffer: round trips of real state dicts, and malformed payloads refused."""

from __future__ import annotations

import collections
import datetime
import io
import os
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from lightning_recover.control_plane.embedded import CoordinatorStore
from lightning_recover.errors import ForgedMessageError, RecoverError
from lightning_recover.protocol.messages import ControlStore, JobSecret
from lightning_recover.protocol.state_transfer import broadcast_state, digest_key, pack, pack_and_seal_digest, unpack
from lightning_recover.tiny_gpt import GPTConfig, TinyGPT


def _trained_state() -> dict:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)).double()
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.95))
    x = torch.randint(0, 256, (2, 16))
    model(x).square().mean().backward()
    optimizer.step()
    return {"modules": [model.state_dict()], "optimizers": [optimizer.state_dict()], "step": 7, "name": "run"}


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_model_and_optimizer_state_round_trip_bit_for_bit():
    state = _trained_state()
    payload, skeleton_len = pack(state)
    received = payload.clone()  # what the joiner's buffer holds after the broadcast
    restored = unpack(received, skeleton_len)
    _assert_same(state, restored)
    assert isinstance(restored["modules"][0], collections.OrderedDict)
    assert restored["optimizers"][0]["param_groups"][0]["betas"] == (0.8, 0.95)
    # The tensors are views of the received buffer: no copy of the state on the joiner.
    weight = next(iter(restored["modules"][0].values()))
    assert weight.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
    # The tensor bytes travel raw: the payload is the tensors plus a small skeleton.
    tensor_bytes = sum(t.numel() * t.element_size() for t in state["modules"][0].values())
    assert payload.numel() - skeleton_len >= tensor_bytes and skeleton_len < tensor_bytes


def test_dtypes_shapes_and_layouts():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "int8": torch.arange(-3, 4, dtype=torch.int8),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 7),
        "transposed": base.t(),  # not contiguous: sent contiguous, values kept
        "slice": base[1:3, 2:5],
        "complex": torch.randn(3, dtype=torch.complex64),
        "sparse": torch.eye(3).to_sparse(),  # not a plain dense tensor: stays in the skeleton
        "nested": {"a": [1, 2.5, None, "x", (torch.ones(2),)]},
    }
    if hasattr(torch, "float8_e4m3fn"):
        state["fp8"] = torch.randn(4).to(torch.float8_e4m3fn)
    payload, skeleton_len = pack(state)
    restored = unpack(payload.clone(), skeleton_len)
    assert restored["sparse"].is_sparse and torch.equal(restored["sparse"].to_dense(), torch.eye(3))
    state["sparse"], restored["sparse"] = None, None
    if "fp8" in state:
        assert torch.equal(state.pop("fp8").view(torch.uint8), restored.pop("fp8").view(torch.uint8))
    _assert_same(state, restored)
    for name in ("bf16", "bool", "int8", "scalar", "complex", "transposed"):
        assert restored[name].data_ptr() % 64 == 0, f"{name} starts on an aligned offset"


def test_malformed_payloads_are_refused_with_a_named_error():
    payload, skeleton_len = pack(_trained_state())
    with pytest.raises(RecoverError, match="malformed"):
        unpack(payload, 0)
    with pytest.raises(RecoverError, match="malformed"):
        unpack(payload, payload.numel() + 1)
    with pytest.raises(RecoverError):
        unpack(payload[: payload.numel() - 10], skeleton_len)  # torn skeleton

    def forged(layout) -> tuple[torch.Tensor, int]:
        head = io.BytesIO()
        torch.save({"state": {"w": {"__lightning_recover_tensor__": 0}}, "layout": layout}, head)
        raw = head.getvalue()
        return torch.cat(
            [torch.zeros(64, dtype=torch.uint8), torch.frombuffer(bytearray(raw), dtype=torch.uint8)]
        ), len(raw)

    for layout in ([("float32", [100], 0)], [("float32", [4], 3)], [("save", [4], 0)], [("float32", [4], -64)]):
        with pytest.raises(RecoverError, match="malformed"):
            unpack(*forged(layout))
    assert torch.equal(unpack(*forged([("float32", [4], 0)]))["w"], torch.zeros(4))


class _NotAllowed:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_skeleton_that_would_run_code_is_refused():
    payload, skeleton_len = pack({"x": torch.ones(2), "evil": _NotAllowed()})
    with pytest.raises(RecoverError, match="weights-only"):
        unpack(payload, skeleton_len)


class _Gloo:
    """The ``collectives`` of broadcast_state on a real two-rank gloo group (each rank a thread)."""

    def __init__(self, store, rank: int) -> None:
        self.pg = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=20))

    def broadcast(self, tensors, src_rank: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src_rank
        for t in tensors:
            self.pg.broadcast([t], opts).wait()


def _member(server, secret: JobSecret, rank: int) -> SimpleNamespace:
    """What broadcast_state needs of a Membership: its generation, position, rank and sealed store."""
    store = ControlStore(f"127.0.0.1:{server.port}", rank, secret, store=CoordinatorStore(server.clone()))
    return SimpleNamespace(gen=SimpleNamespace(number=2), inner=0, replica_size=1, rank=rank, store=store)


def test_rejoin_sizes_altered_on_the_way_are_refused_before_any_allocation():
    """The sender seals the state's digest and sizes; an on-path peer announces 2**40 bytes instead. The joiner
    refuses before it allocates (it would have tried 1 TiB), and takes the genuine announcement."""
    secret = JobSecret.generate()
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=20), wait_for_workers=False)
    state = _trained_state()
    outcome: dict[str, object] = {}

    def sender(forge: bool) -> None:
        membership = _member(server, secret, 0)
        gloo = _Gloo(PrefixStore(f"pg{forge}", server.clone()), 0)
        if not forge:
            broadcast_state(gloo, membership, 0, state, receive=False)
            return
        payload, skeleton_len = pack_and_seal_digest(
            state, membership.store, digest_key(2, 0, 1)
        )  # the genuine record...
        gloo.broadcast([torch.tensor([1 << 40, skeleton_len], dtype=torch.int64)], 0)  # ...other sizes travel

    def joiner(forge: bool) -> None:
        membership = _member(server, secret, 1)
        gloo = _Gloo(PrefixStore(f"pg{forge}", server.clone()), 1)
        try:
            outcome[f"state{forge}"] = broadcast_state(gloo, membership, 0, None, receive=True)
        except BaseException as exc:  # reported by the asserts below
            outcome[f"error{forge}"] = exc

    for forge in (True, False):
        threads = [threading.Thread(target=sender, args=(forge,)), threading.Thread(target=joiner, args=(forge,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    error = outcome.get("errorTrue")
    assert isinstance(error, ForgedMessageError) and "nothing is allocated" in str(error), error
    assert "errorFalse" not in outcome, outcome.get("errorFalse")
    _assert_same(outcome["stateFalse"], state)
