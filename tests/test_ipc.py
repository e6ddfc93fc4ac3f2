"""The wire contract: every message round-trips, garbage is refused clearly, versions are checked."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest

from ipc import (
    CONTRACT_VERSION,
    Abort,
    Add,
    ContractMismatch,
    Dead,
    FromWorkerDecoder,
    Outputs,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Shutdown,
    StartupFailed,
    ToWorkerDecoder,
    encode,
)
from ipc.messages import split_error
from ipc.sockets import make_runtime_dir
from worker.engine.types import EngineRequest, FinishReason, SamplingParams, StepOutput

REQUEST = EngineRequest("r1", (1, 2, 3), SamplingParams(max_tokens=7, temperature=0.0, stop=("\n",), seed=3))
TO_WORKER = [Add(request=REQUEST), Add(request=EngineRequest("r2", (5,))), Abort(request_id="r1"),
             Ping(seq=42), Shutdown(), Shutdown(reason="ops")]
FROM_WORKER = [
    Ready(contract_version=CONTRACT_VERSION, generation=3, pid=1234,
          identity={"model": {"fingerprint": "sha256:ab"}, "profile": {"hash": "sha256:cd"}}),
    Outputs(generation=3, outputs=[
        StepOutput("r1", token_ids=[9, 10], text="hé", prompt_tokens=3, completion_tokens=2),
        StepOutput("r1", finished=True, finish_reason=FinishReason.ERROR, error="context_length_exceeded: x"),
    ]),
    Outputs(generation=1),
    Pong(seq=42, generation=3),
    StartupFailed(generation=2, reason="refused to start: config.json differs"),
    Dead(generation=2, reason="RuntimeError: boom"),
]


@pytest.mark.parametrize("msg", TO_WORKER, ids=lambda m: type(m).__name__)
def test_to_worker_round_trip(msg: object) -> None:
    assert ToWorkerDecoder().decode(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize("msg", FROM_WORKER, ids=lambda m: type(m).__name__)
def test_from_worker_round_trip(msg: object) -> None:
    assert FromWorkerDecoder().decode(encode(msg)) == msg  # type: ignore[arg-type]


def test_frames_are_positional_and_tagged() -> None:
    assert msgspec.msgpack.decode(encode(Ping(seq=5))) == ["ping", 5]


def test_a_direction_refuses_the_other_directions_messages() -> None:
    with pytest.raises(ProtocolError, match="bad frame to worker"):
        ToWorkerDecoder().decode(encode(Pong(seq=1, generation=1)))
    with pytest.raises(ProtocolError, match="bad frame from worker"):
        FromWorkerDecoder().decode(encode(Ping(seq=1)))


GARBAGE = [b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode({"a": 1}),
           msgspec.msgpack.encode(["pong", "one", 2]), msgspec.msgpack.encode(["nope"])]


@pytest.mark.parametrize("frame", GARBAGE)
def test_garbage_is_refused_with_a_clear_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match=r"bad frame from worker \(\d+ bytes\): ") as info:
        FromWorkerDecoder().decode(frame)
    assert not isinstance(info.value, ContractMismatch)
    with pytest.raises(ProtocolError, match="bad frame to worker"):
        ToWorkerDecoder().decode(frame)


def test_another_contract_version_is_refused() -> None:
    frame = encode(Ready(contract_version=CONTRACT_VERSION + 1, generation=1, pid=1))
    with pytest.raises(ContractMismatch, match=f"version {CONTRACT_VERSION + 1}.* speaks {CONTRACT_VERSION}"):
        FromWorkerDecoder().decode(frame)


def test_a_ready_frame_that_no_longer_decodes_still_names_the_version() -> None:
    # A future Ready whose later fields changed type: the version is still read and compared.
    frame = msgspec.msgpack.encode(["ready", 99, "generation-as-text", None])
    with pytest.raises(ContractMismatch, match="version 99"):
        FromWorkerDecoder().decode(frame)


def test_appended_fields_of_a_newer_peer_are_ignored() -> None:
    frame = msgspec.msgpack.encode(["pong", 1, 2, "a field added later"])
    assert FromWorkerDecoder().decode(frame) == Pong(seq=1, generation=2)


def test_typed_error_strings_split_into_code_and_message() -> None:
    code, message = split_error("output_limit_exceeded: max_tokens is 900")
    assert (code, message) == ("output_limit_exceeded", "max_tokens is 900")
    assert split_error("RuntimeError boom") == ("internal_error", "RuntimeError boom")


def test_runtime_dir_is_private() -> None:
    path = make_runtime_dir()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert path.stat().st_uid == os.getuid()
    finally:
        path.rmdir()


def test_nothing_but_ipc_imports_zmq() -> None:
    from tests.conftest import REPO

    offenders = [
        str(p.relative_to(REPO)) for d in ("gateway", "worker", "iq36", "kernels")
        for p in (REPO / d).rglob("*.py")
        if "import zmq" in p.read_text() or "from zmq" in p.read_text()
    ]
    assert offenders == []
