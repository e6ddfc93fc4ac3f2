"""Hypercorn, embedded: bind the listening socket ourselves (so a bad address fails before the
worker starts and `--port 0` reports the port it got), then serve the app in this event loop until
the shutdown trigger fires. Hypercorn's own signal handling is off: `worker.main` owns signals.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config
from starlette.applications import Starlette


class BindError(Exception):
    pass


def bind(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket for `host:port`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"cannot resolve the HTTP host {host!r}: {exc.strerror}") from None
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SSE frames leave at once
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def config(sock: socket.socket, graceful_timeout_s: float) -> Config:
    """Hypercorn settings; takes ownership of `sock`."""
    cfg = Config()
    cfg.bind = [f"fd://{sock.detach()}"]
    cfg.accesslog = None  # the gateway writes its own access lines (JSON, with request_id)
    cfg.errorlog = logging.getLogger("hypercorn.error")
    cfg.graceful_timeout = graceful_timeout_s
    cfg.keep_alive_timeout = 75.0  # above common proxy idle timeouts
    cfg.include_server_header = False
    return cfg


async def serve(app: Starlette, cfg: Config, shutdown_trigger: Callable[[], Awaitable[object]]) -> None:
    await hypercorn_serve(app, cfg, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
