"""Server-sent events framing, in one place: `data: <json>\n\n` frames, the `data: [DONE]`
terminator of chat/completions streams, the error frame of a failure after the stream began,
and the streaming response with the headers that keep proxies from buffering it."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import APIError

DONE = b"data: [DONE]\n\n"

_ENCODER = msgspec.json.Encoder()

# no-cache: intermediaries must not store the stream; X-Accel-Buffering: nginx passes it through.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def frame(obj: Any) -> bytes:
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


def error_frame(error: APIError) -> bytes:
    """A failure after the stream began: one error frame (then DONE, by the caller)."""
    return frame(error.body())


class EventStream(StreamingResponse):
    """Starlette races the events against the client's http.disconnect (ASGI spec < 2.4, as
    Hypercorn speaks) and cancels the stream on it. The generator is closed here in any case,
    so its cleanup runs now, not when it is collected; `on_close` runs even if the generator
    never started (a client gone before the first frame), so the generation is always aborted."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=HEADERS)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()


def response(events: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> EventStream:
    return EventStream(events, on_close)
