"""The wire contract between gateway/supervisor and worker: msgspec Structs over ZeroMQ.
Built by issue #3."""

from __future__ import annotations

from ipc.codec import ContractMismatch, FromWorkerDecoder, ProtocolError, ToWorkerDecoder, encode
from ipc.messages import (
    CONTRACT_VERSION,
    Abort,
    Add,
    Dead,
    FromWorker,
    Outputs,
    Ping,
    Pong,
    PromptSpec,
    Ready,
    Shutdown,
    StartupFailed,
    ToWorker,
)
from ipc.sockets import SupervisorSocket, WorkerSocket

__all__ = [
    "CONTRACT_VERSION",
    "Abort",
    "Add",
    "ContractMismatch",
    "Dead",
    "FromWorker",
    "FromWorkerDecoder",
    "Outputs",
    "Ping",
    "Pong",
    "PromptSpec",
    "ProtocolError",
    "Ready",
    "Shutdown",
    "StartupFailed",
    "SupervisorSocket",
    "ToWorker",
    "ToWorkerDecoder",
    "WorkerSocket",
    "encode",
]
