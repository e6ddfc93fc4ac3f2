"""The one socket factory: every ZeroMQ socket iq36 opens is made and configured here.

Topology: the supervisor binds one ROUTER on `ipc://<private runtime dir>/worker`; each worker
connects one DEALER whose routing identity names its generation (`g<N>`), so frames of a
replaced worker are recognisable even before they are decoded. The runtime dir is created
with mode 0700 (mkdtemp), so no other local user can connect. Nothing else imports zmq.

Options, and why:
- LINGER: the supervisor closes with 0 (a dead worker must never block shutdown); the worker
  with `WORKER_LINGER_MS`, so its last StartupFailed/Dead frame is flushed before it exits.
- SNDHWM/RCVHWM 0 (unbounded): a dropped frame would be a lost token or a request that never
  finishes; batch size 1 bounds the backlog, and the gateway bounds what it admits.
- ROUTER_MANDATORY: sending to a worker that is gone raises instead of vanishing silently.
- MAXMSGSIZE: a 131k-token prompt is ~1 MB of msgpack; anything near 64 MiB is garbage.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import zmq
import zmq.asyncio

from ipc.codec import FromWorkerDecoder, ProtocolError, ToWorkerDecoder, encode
from ipc.messages import FromWorker, ToWorker

WORKER_LINGER_MS = 2000
_MAX_MSG_BYTES = 64 << 20


def identity(generation: int) -> bytes:
    return f"g{generation}".encode()


def _generation_of(ident: bytes) -> int | None:
    if ident[:1] == b"g" and ident[1:].isdigit():
        return int(ident[1:])
    return None


def make_runtime_dir() -> Path:
    """A fresh private (0700) directory for ipc endpoints, under $XDG_RUNTIME_DIR if set."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and not os.access(base, os.W_OK):
        base = None
    return Path(tempfile.mkdtemp(prefix="iq36-", dir=base))


def _common(sock: zmq.Socket, linger_ms: int) -> None:
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG_BYTES)


class SupervisorSocket:
    """Supervisor side (asyncio): receives every worker's frames, sends to one generation."""

    def __init__(self) -> None:
        self.runtime_dir = make_runtime_dir()
        self.endpoint = f"ipc://{self.runtime_dir}/worker"
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        _common(self._sock, linger_ms=0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(self.endpoint)
        self._decoder = FromWorkerDecoder()

    async def recv(self) -> tuple[int | None, FromWorker | ProtocolError]:
        """(generation of the sending socket, message or the reason it did not decode)."""
        frames = await self._sock.recv_multipart()
        gen = _generation_of(frames[0])
        if len(frames) != 2:
            return gen, ProtocolError(f"bad frame from worker: {len(frames) - 1} parts, expected 1")
        try:
            return gen, self._decoder.decode(frames[1])
        except ProtocolError as exc:
            return gen, exc

    async def send(self, generation: int, msg: ToWorker) -> bool:
        """False if that worker is not connected (gone or not yet there)."""
        try:
            await self._sock.send_multipart([identity(generation), encode(msg)])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


class WorkerSocket:
    """Worker side (blocking): owned by the worker's IO thread only (zmq sockets are not thread-safe)."""

    def __init__(self, endpoint: str, generation: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        _common(self._sock, linger_ms=WORKER_LINGER_MS)
        self._sock.setsockopt(zmq.IDENTITY, identity(generation))
        self._sock.connect(endpoint)
        self._decoder = ToWorkerDecoder()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def watch_fd(self, fd: int) -> None:
        """Also wake `wait` when this file descriptor becomes readable (the outbox's wake pipe)."""
        self._poller.register(fd, zmq.POLLIN)

    def wait(self, timeout_s: float) -> None:
        self._poller.poll(int(timeout_s * 1000))

    def send(self, msg: FromWorker) -> None:
        self._sock.send(encode(msg))

    def recv_nowait(self) -> ToWorker | None:
        """The next message if one is waiting; raises ProtocolError on garbage."""
        try:
            frame = self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self._decoder.decode(frame)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.close(linger=WORKER_LINGER_MS)
        self._ctx.term()
