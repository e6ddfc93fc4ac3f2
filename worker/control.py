"""The ops control socket: a local unix socket (mode 0600) speaking JSON lines.

One request per line, `{"cmd": "status" | "restart-worker" | "drain" | "resume"}`, one response
per line, `{"ok": true, "result": {...}}` or `{"ok": false, "error": "..."}`. The server runs in
the front-end process next to the supervisor; `request` is the blocking client `iq36 ctl` uses.
Only the owner can connect (file mode 0600), so there is no other authentication.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

from worker.supervisor import ServiceError, Supervisor

log = logging.getLogger(__name__)

COMMANDS = ("status", "restart-worker", "drain", "resume")
_MAX_LINE = 64 << 10


class ControlError(Exception):
    """The control socket could not be reached or answered with an error."""


class ControlServer:
    def __init__(self, supervisor: Supervisor, path: Path) -> None:
        self._supervisor = supervisor
        self.path = path
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        sock = _bind_private(self.path)
        self._server = await asyncio.start_unix_server(self._serve_client, sock=sock, limit=_MAX_LINE)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._clients):
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        task.set_name("iq36-control-client")
        self._clients.add(task)
        try:
            while line := await reader.readline():
                response = await self._handle(line)
                writer.write(json.dumps(response).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ValueError) as exc:  # ValueError: a line above the limit
            log.warning("control client dropped: %s", exc)
        finally:
            self._clients.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _handle(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
            cmd = request["cmd"]
        except (ValueError, TypeError, KeyError):
            return {"ok": False, "error": 'expected one JSON object per line with a "cmd" key'}
        sup = self._supervisor
        try:
            if cmd == "status":
                result: dict[str, Any] = sup.status()
            elif cmd == "restart-worker":
                await sup.restart_worker("ops")
                result = sup.status()
            elif cmd == "drain":
                result = {"draining": sup.drain(), "queue": {"depth": sup.status()["queue"]["depth"]}}
            elif cmd == "resume":
                result = {"draining": sup.resume()}
            else:
                return {"ok": False, "error": f"unknown command {cmd!r}: one of {', '.join(COMMANDS)}"}
        except (ServiceError, TimeoutError) as exc:
            return {"ok": False, "error": f"{cmd}: {exc or type(exc).__name__}"}
        log.info("control: %s", cmd)
        return {"ok": True, "result": result}


def _bind_private(path: Path) -> socket.socket:
    """Bind a unix socket that is 0600 from its first instant (umask around bind)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ControlError(f"{path} exists and is not a socket")
        if _answers(path):
            raise ControlError(f"another iq36 is already listening on {path}")
        path.unlink()  # stale, from a process that did not clean up
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ControlError(f"cannot bind the control socket {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.setblocking(False)
    return sock


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def request(path: Path, cmd: str, timeout: float = 60.0) -> dict[str, Any]:
    """Send one command; its result, or ControlError with a one-line message naming the path."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"no iq36 control socket at {path} (is `iq36 serve` running?)") from None
        except OSError as exc:
            reason = exc.strerror or exc
            raise ControlError(f"cannot connect to the control socket {path}: {reason}") from None
        try:
            sock.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
            with sock.makefile("rb") as fh:
                line = fh.readline(_MAX_LINE)
        except TimeoutError:
            raise ControlError(f"no answer from {path} within {timeout:g}s") from None
    if not line:
        raise ControlError(f"{path} closed the connection without answering")
    response = json.loads(line)
    if not response.get("ok"):
        raise ControlError(str(response.get("error")))
    return response["result"]
