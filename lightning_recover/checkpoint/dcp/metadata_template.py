"""The bytes of DCP's ``.metadata`` for saves that differ only in their ``storage_meta``.

``DcpSaver`` saves one state layout again and again: the metadata it commits stays the same object from one
save to the next except for ``storage_meta`` (the checkpoint's path and the save's id). Pickling it anew costs
the coordinator 0.09 s per save with 8192 items (2048 tensors per rank at N = 4), as much as the rest of its
per-item work. A template pickles the metadata once, with two sentinel strings in place of those ids, and a
save renders it by putting its own strings where the sentinels were.

Pickle protocol 4 (what ``pickle.dump`` writes by default, and ``FileSystemWriter`` too) writes a string as
one opcode with its length and UTF-8 bytes, and groups opcodes into frames whose header holds their length; no
opcode straddles two frames. Rendering replaces the two opcodes and corrects the length of the frame each is
in. Nothing else refers to a string by position (the memo counts objects, not bytes). A template is checked
when it is built: a rendering with other strings, of another encoded length, unpickles to the metadata with
those strings.
"""

from __future__ import annotations

import dataclasses
import pickle
import secrets

from torch.distributed.checkpoint.metadata import Metadata

from lightning_recover.checkpoint.dcp.writer import sidecar_storage_meta

__all__ = ["MetadataTemplate"]

_PROTO, _FRAME = 0x80, 0x95
_SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8 = 0x8C, 0x58, 0x8D


def _encode_str(s: str) -> bytes:
    """The opcode protocol 4 writes for ``s`` (as the C pickler encodes it)."""
    b = s.encode("utf-8", "surrogatepass")
    if len(b) < 256:
        return bytes((_SHORT_BINUNICODE, len(b))) + b
    if len(b) < 1 << 32:
        return bytes((_BINUNICODE,)) + len(b).to_bytes(4, "little") + b
    return bytes((_BINUNICODE8,)) + len(b).to_bytes(8, "little") + b


def _frame_headers(data: bytes) -> list[int]:
    """Offsets of the frame headers of a protocol-4 pickle that is all frames (no large bytes objects)."""
    if data[:2] != bytes((_PROTO, 4)):
        raise ValueError("not a protocol-4 pickle")
    headers, pos = [], 2
    while pos < len(data):
        if data[pos] != _FRAME:
            raise ValueError(f"unframed data at byte {pos}: the metadata holds something pickled outside frames")
        headers.append(pos)
        pos += 9 + int.from_bytes(data[pos + 1 : pos + 9], "little")
    if pos != len(data):
        raise ValueError("the last frame runs past the end of the pickle")
    return headers


@dataclasses.dataclass(frozen=True)
class _Hole:
    at: int  # where the sentinel's opcode starts
    length: int  # its encoded length
    frame: int  # the header offset of the frame it is in


class MetadataTemplate:
    """``render(checkpoint_id, save_id)``: the bytes of ``pickle.dumps(metadata)`` with that ``storage_meta``.

    ``metadata`` must not change after the template is built (``DcpSaver`` never changes its cached one: it
    replaces it).
    """

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        marks = [f"lightning-recover-{what}-{secrets.token_hex(16)}" for what in ("checkpoint-id", "save-id")]
        self._data = pickle.dumps(self._with_ids(marks[0], marks[1]), protocol=4)
        headers = _frame_headers(self._data)
        self._holes: list[_Hole] = []
        for mark in marks:
            enc = _encode_str(mark)
            at = self._data.find(enc)
            if at < 0 or self._data.find(enc, at + 1) >= 0:
                raise ValueError("the metadata pickles its storage_meta in a way this template does not know")
            frame = max(h for h in headers if h < at)
            self._holes.append(_Hole(at, len(enc), frame))
        if [h.at for h in self._holes] != sorted(h.at for h in self._holes):
            raise ValueError("the metadata pickles save_id before checkpoint_id")
        self._check()

    def _with_ids(self, checkpoint_id: str, save_id: str) -> Metadata:
        return dataclasses.replace(
            self.metadata,
            storage_meta=sidecar_storage_meta(checkpoint_id, save_id),  # our writers' sidecars
        )

    def render(self, checkpoint_id: str, save_id: str) -> bytes:
        encs = [_encode_str(checkpoint_id), _encode_str(save_id)]
        out = bytearray()
        last = 0
        for hole, enc in zip(self._holes, encs):
            out += self._data[last : hole.at]
            out += enc
            last = hole.at + hole.length
        out += self._data[last:]
        for frame in {h.frame for h in self._holes}:
            grown = sum(len(enc) - h.length for h, enc in zip(self._holes, encs) if h.frame == frame)
            pos = frame + sum(len(enc) - h.length for h, enc in zip(self._holes, encs) if h.at < frame)
            length = int.from_bytes(out[pos + 1 : pos + 9], "little") + grown
            out[pos + 1 : pos + 9] = length.to_bytes(8, "little")
        return bytes(out)

    def _check(self) -> None:
        """A rendering with ids of other encoded lengths (one past the one-byte length) unpickles right."""
        ids = ("/" + "p" * 300 + "/ck-é", "s")
        if pickle.loads(self.render(*ids)) != self._with_ids(*ids):
            raise ValueError("a rendering of the metadata template does not unpickle to the metadata")
