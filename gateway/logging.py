"""Per-request context and logs: a request id on every log line of a request (an incoming
`X-Request-Id` is honoured and echoed, else one is generated), one access line per request, and
the `requests_total{endpoint,status}` and `errors_total{code}` counts (whoever fails a request
sets `code` on the context; it is counted once, here). Log lines never carry prompt or output text, nor keys
(only method, path, status, durations, token counts).

`RequestContextMiddleware` is pure ASGI; the context is a contextvar, so every log record made
while serving the request — in the handler or in the streaming task — gets `request_id`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics import Metrics

log = logging.getLogger("gateway.access")

# Route label for metrics: a fixed set, never the raw path (bounded cardinality).
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/models": "models",
    "/health/live": "live",
    "/health/ready": "ready",
    "/metrics": "metrics",
    "/openapi.json": "openapi",
}
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclasses.dataclass
class RequestContext:
    request_id: str
    endpoint: str
    status: int | None = None  # overrides the HTTP status in metrics/logs (e.g. 499 on disconnect)
    code: str | None = None  # the error code, if the request failed (counted once, at the end)
    fields: dict[str, object] = dataclasses.field(default_factory=dict)  # extra access-log fields


current: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("iq36_request", default=None)


def endpoint_of(path: str) -> str:
    if path in ENDPOINTS:
        return ENDPOINTS[path]
    return "models" if path.startswith("/v1/models/") else "other"


class RequestIdFilter(logging.Filter):
    """Stamps the current request id on log records (the JSON formatter writes it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = current.get()
        if ctx is not None and not hasattr(record, "request_id"):
            record.request_id = ctx.request_id
        return True


def install_filter() -> None:
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
        rid = incoming if _VALID_ID.match(incoming) else uuid.uuid4().hex
        ctx = RequestContext(rid, endpoint_of(scope["path"]))
        token = current.set(ctx)
        started = time.monotonic()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            final = ctx.status or status
            self.metrics.requests.labels(ctx.endpoint, str(final)).inc()
            if ctx.code is not None:
                self.metrics.errors.labels(ctx.code).inc()
                ctx.fields["code"] = ctx.code
            if ctx.endpoint not in ("live", "ready", "metrics"):  # probes would drown the log
                log.info("%s %s %d", scope["method"], scope["path"], final,
                         extra={"status": final, "duration_s": round(time.monotonic() - started, 4), **ctx.fields})
            current.reset(token)


def record_error(code: str, status: int | None = None) -> None:
    """Mark the current request as failed with `code` (and a status for metrics, if not the HTTP one)."""
    ctx = current.get()
    if ctx is not None:
        ctx.code = code
        if status is not None:
            ctx.status = status
