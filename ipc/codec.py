"""One encoder and one typed decoder per direction (msgpack only; no Python-object serialisation).

A frame that does not decode raises `ProtocolError` naming the direction and what was wrong;
a `Ready` frame from a peer speaking another contract version raises `ContractMismatch`, also
when the rest of that frame no longer matches this side's Structs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.messages import CONTRACT_VERSION, FromWorker, Ready, ToWorker


class ProtocolError(Exception):
    """A frame that is not a valid message of this contract."""


class ContractMismatch(ProtocolError):
    """The peer speaks another IPC contract version."""

    def __init__(self, theirs: Any, ours: int = CONTRACT_VERSION) -> None:
        super().__init__(
            f"worker speaks IPC contract version {theirs!r}, this supervisor speaks {ours}: "
            "front end and worker come from different iq36 builds; reinstall so both match"
        )
        self.theirs = theirs
        self.ours = ours


_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: ToWorker | FromWorker) -> bytes:
    return _ENCODER.encode(msg)


class _Decoder:
    def __init__(self, type_: Any, direction: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_)
        self._direction = direction

    def _fail(self, frame: bytes, exc: Exception) -> ProtocolError:
        return ProtocolError(f"bad frame {self._direction} ({len(frame)} bytes): {exc}")


class ToWorkerDecoder(_Decoder):
    def __init__(self) -> None:
        super().__init__(ToWorker, "to worker")

    def decode(self, frame: bytes) -> ToWorker:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self._fail(frame, exc) from None


class FromWorkerDecoder(_Decoder):
    def __init__(self) -> None:
        super().__init__(FromWorker, "from worker")

    def decode(self, frame: bytes) -> FromWorker:
        try:
            msg = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            theirs = _ready_version(frame)
            if theirs is not None and theirs != CONTRACT_VERSION:
                raise ContractMismatch(theirs) from None
            raise self._fail(frame, exc) from None
        if isinstance(msg, Ready) and msg.contract_version != CONTRACT_VERSION:
            raise ContractMismatch(msg.contract_version)
        return msg


def _ready_version(frame: bytes) -> Any:
    """The contract version of something shaped like a Ready frame of any version, else None."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and len(raw) >= 2 and raw[0] == "ready":
        return raw[1]
    return None
