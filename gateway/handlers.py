"""The generation endpoints: `POST /v1/chat/completions` and `POST /v1/completions`, JSON and SSE.

One path for both: read the body (415 unless JSON, 413 above the limit), validate it into a `Job`
(`gateway.protocol`), admit it (`gateway.admission`), then either collect the outputs — racing the
client's disconnect, which aborts the generation — or stream them as SSE chunks, where a
disconnect cancels the stream and its cleanup aborts the generation. A failure after the stream
began is one error frame, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from gateway import responses, sse
from gateway.admission import Generation
from gateway.agentic import OutputPlan
from gateway.assistant import AssistantTurn
from gateway.errors import APIError
from gateway.logging import current, record_error
from gateway.model import ModelInfo
from gateway.protocol import Job, chat_job, completion_job
from worker.engine.types import StepOutput

if TYPE_CHECKING:
    from gateway.app import Service

log = logging.getLogger(__name__)

_T = TypeVar("_T")

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; metrics/logs only


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, headers=headers, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise APIError("unsupported_media_type", f"Content-Type must be application/json, got '{media or 'none'}'")
    too_large = APIError("request_too_large", f"the request body is larger than {limit} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client goes away (the body was read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    pass


async def until_disconnect(request: Request, gen: Generation, work: Coroutine[Any, Any, _T]) -> _T:
    """Run `work` unless the client leaves first: then stop generating now and raise ClientGone."""
    task = asyncio.create_task(work, name=f"iq36-request-{gen.id[:8]}")
    gone = asyncio.create_task(_disconnected(request.receive), name=f"iq36-disconnect-{gen.id[:8]}")
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client left (or we are cancelled)
            task.cancel()
            gen.close()
            ctx = current.get()
            if ctx is not None:
                ctx.status = CLIENT_CLOSED
        await asyncio.gather(gone, task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _generate(request: Request, build: Callable[[bytes, ModelInfo], Job]) -> Response:
    service: Service = request.app.state.service
    body = await read_body(request, service.settings.max_body_bytes)
    job = build(body, service.model)
    gen = await service.admission.submit(job)
    ctx = current.get()
    if ctx is not None:
        # The id the worker logs under (and the response id's suffix), to correlate the two logs.
        ctx.fields.update(endpoint=job.endpoint, engine_request_id=gen.id)
    try:
        if job.stream:
            # Wait for the worker's acknowledgement (after tokenizing and its checks, before the
            # prefill) so a rejected prompt is an HTTP 400, not an error inside a 200 stream.
            first = await until_disconnect(request, gen, gen.__anext__())
            make = _chat_events if job.endpoint == "chat" else _completion_events
            return sse.response(make(gen, service.model, first), on_close=lambda: _stream_closed(gen))
        outs = await until_disconnect(request, gen, collect(gen))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return json_response(_whole(gen, outs, service.model))


async def _chain(first: StepOutput, gen: Generation) -> AsyncGenerator[StepOutput, None]:
    yield first
    async for out in gen:
        yield out


async def collect(gen: Generation) -> list[StepOutput]:
    """Every output of a generation, in order (closed on any exit)."""
    outs: list[StepOutput] = []
    try:
        async for out in gen:
            outs.append(out)
    finally:
        gen.close()
    return outs


def _whole(gen: Generation, outs: list[StepOutput], model: ModelInfo) -> dict[str, Any]:
    _log_done(gen)
    if gen.job.endpoint == "chat":
        turn = AssistantTurn(gen.job.output or OutputPlan())
        for out in outs:
            turn.push(out)
        use = responses.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, turn.reasoning_tokens)
        return responses.chat_completion(f"chatcmpl-{gen.id}", gen.created, gen.job.model, model.fingerprint,
                                         turn.message(), turn.finish_reason(gen.finish_reason), use)
    use = responses.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
    text = "".join(out.text for out in outs)
    return responses.completion(f"cmpl-{gen.id}", gen.created, gen.job.model, model.fingerprint, text,
                                gen.finish_reason, use)


def _log_done(gen: Generation) -> None:
    ctx = current.get()
    if ctx is not None:
        ctx.fields.update(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                          finish_reason=responses.finish_reason(gen.finish_reason))


async def _chat_events(gen: Generation, model: ModelInfo, first: StepOutput) -> AsyncGenerator[bytes, None]:
    id_, job = f"chatcmpl-{gen.id}", gen.job

    def chunk(delta: dict[str, Any] | None, reason: str | None = None, use: dict[str, Any] | None = None) -> bytes:
        return sse.frame(responses.chat_chunk(id_, gen.created, job.model, model.fingerprint, delta, reason, use))

    turn = AssistantTurn(job.output or OutputPlan())
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for out in _chain(first, gen):
            for ev in turn.push(out):
                delta = turn.chat_delta(ev)
                if delta is not None:
                    yield chunk(delta)
            if out.finished:
                yield chunk({}, turn.finish_reason(out.finish_reason))
        if job.include_usage:
            yield chunk(None, use=responses.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens,
                                                  turn.reasoning_tokens))
        _log_done(gen)
        yield sse.DONE
    except APIError as exc:
        record_error(exc.code)
        yield sse.error_frame(exc)
        yield sse.DONE
    finally:
        _stream_closed(gen)


async def _completion_events(gen: Generation, model: ModelInfo,
                             first: StepOutput) -> AsyncGenerator[bytes, None]:
    id_, job = f"cmpl-{gen.id}", gen.job

    def chunk(text: str | None, reason: Any = None, use: dict[str, Any] | None = None) -> bytes:
        return sse.frame(responses.completion(id_, gen.created, job.model, model.fingerprint, text, reason, use))

    try:
        async for out in _chain(first, gen):
            if out.text or out.finished:
                yield chunk(out.text, out.finish_reason if out.finished else None)
        if job.include_usage:
            yield chunk(None, use=responses.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
        _log_done(gen)
        yield sse.DONE
    except APIError as exc:
        record_error(exc.code)
        yield sse.error_frame(exc)
        yield sse.DONE
    finally:
        _stream_closed(gen)


def _stream_closed(gen: Generation) -> None:
    if not gen.finished:  # cancelled mid-stream: the client disconnected
        ctx = current.get()
        if ctx is not None:
            ctx.status = CLIENT_CLOSED
    gen.close()


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat_job)


async def completions(request: Request) -> Response:
    return await _generate(request, completion_job)
