"""The control plane's message layer: sealing, typed encoding, secrets (fast, in-process)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from lightning_recover.errors import ForgedMessageError, RecoverError
from lightning_recover.protocol.messages import JobSecret, Sealer, decode_object, encode_object
from lightning_recover.protocol.state_transfer import load_state


class _Payload:
    """Unpickling this would create a marker file: the proof that received bytes became code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_sealed_value_round_trips_and_is_bound_to_its_key():
    sealer = Sealer(JobSecret.generate())
    raw = sealer.seal("s3/g0/dec", b"commit")
    assert sealer.open("s3/g0/dec", raw) == b"commit"
    with pytest.raises(ForgedMessageError, match="failed authentication"):
        sealer.open("s4/g0/dec", raw)  # a genuine decision replayed under another step


def test_values_without_the_secret_are_refused():
    sealer = Sealer(JobSecret.generate())
    other = Sealer(JobSecret.generate())
    genuine = sealer.seal("k", b"commit")
    altered = genuine[:-1] + bytes([genuine[-1] ^ 1])  # its MAC's last byte changed, whatever it was
    for raw in (b"retry", b"", other.seal("k", b"commit"), altered):
        with pytest.raises(ForgedMessageError):
            sealer.open("k", raw)


def test_typed_encoding_round_trips_what_lightning_exchanges():
    value = {
        "logs": {"loss": [1.5, 2.0, 3.0, 0.5]},
        "kwargs": {"loss": {"reduce_fx": "mean", "batch_size": None}},
        "t": torch.arange(6, dtype=torch.float64).reshape(2, 3),
        "scalar": torch.tensor(2.5),
        "b": torch.tensor([True, False]),
        "tuple": (1, "a"),
        3: "int key",
        "nan": float("nan"),
        "empty": torch.empty(0, 4),
    }
    back = decode_object(encode_object(value))
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.float64
    assert torch.equal(back["b"], value["b"]) and back["empty"].shape == (0, 4)
    assert back["scalar"].shape == () and back["scalar"].item() == 2.5
    assert back["tuple"] == (1, "a") and back[3] == "int key" and back["logs"] == value["logs"]
    assert back["nan"] != back["nan"]


def test_typed_encoding_refuses_arbitrary_objects_with_a_hint():
    with pytest.raises(TypeError, match="HINT"):
        encode_object(object())


def test_decoding_a_pickle_never_runs_it(tmp_path):
    marker = str(tmp_path / "owned")
    with pytest.raises(ValueError):
        decode_object(pickle.dumps(_Payload(marker)))
    assert not os.path.exists(marker)


def test_rejoin_state_is_loaded_weights_only(tmp_path):
    import io

    marker = str(tmp_path / "owned")
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "evil": _Payload(marker)}, buf)
    with pytest.raises(RecoverError, match="weights-only"):
        load_state(buf.getvalue())
    assert not os.path.exists(marker)
    good = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "step": 3}, good)
    assert load_state(good.getvalue())["step"] == 3


def test_secret_file_must_be_private(tmp_path):
    secret = JobSecret.generate()
    path = secret.write_file(str(tmp_path))
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert JobSecret.from_file(path).key == secret.key
    os.chmod(path, 0o644)
    with pytest.raises(RecoverError, match="chmod 600"):
        JobSecret.from_file(path)


def test_missing_secret_says_how_to_provide_one(monkeypatch):
    monkeypatch.delenv("LIGHTNING_RECOVER_SECRET_FILE", raising=False)
    monkeypatch.delenv("LIGHTNING_RECOVER_SECRET", raising=False)
    with pytest.raises(RecoverError, match="HINT"):
        JobSecret.from_env()
