"""The Responses API endpoints: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses request is turned into the equivalent chat job (`gateway.responses_request.chat_fields`
and `input_messages`, then `gateway.protocol.chat_job`), so tools, structured output, reasoning
and sampling follow exactly the chat policy; a 400 from that path is renamed to the Responses
parameter (`max_tokens` -> `max_output_tokens`, …). The output goes through the same
`AssistantTurn` parser into `ResponseStreamBuilder`, which yields the typed SSE events and the
final response object.

Stored responses (`store`, default true) live in the SQLite `ResponseStore` under the state dir:
capacity is checked before generating (507), a response belongs to the API key that created it
(another key gets 404 and cannot chain from it), and `previous_response_id` chains a
conversation from the stored context. Only completed and incomplete responses are stored; a
failed or aborted one is not. SQLite calls run in a thread so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway import responses_output as rout
from gateway import responses_request as rreq
from gateway import sse
from gateway.admission import Generation
from gateway.agentic import OutputPlan
from gateway.assistant import AssistantTurn
from gateway.auth import owner
from gateway.errors import APIError
from gateway.handlers import CLIENT_CLOSED, ClientGone, collect, json_response, read_body, until_disconnect
from gateway.logging import current, record_error
from gateway.protocol import Job, chat_job
from gateway.response_store import StoreFull
from worker.engine.types import FinishReason, StepOutput

if TYPE_CHECKING:
    from gateway.app import Service

log = logging.getLogger(__name__)


def _service(request: Request) -> Service:
    return request.app.state.service  # type: ignore[no-any-return]


def _not_found(response_id: str) -> APIError:
    return APIError("response_not_found", f"no response with id '{response_id}'", param="response_id")


async def _previous(service: Service, who: str, req: rreq.ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.previous_response_id is None:
        return None
    stored = await asyncio.to_thread(service.responses.get, req.previous_response_id, who)
    if stored is None:
        raise APIError("response_not_found", f"previous_response_id '{req.previous_response_id}' does not name "
                       "a stored response", param="previous_response_id")
    return stored.context


def _job(req: rreq.ResponsesRequest, previous: list[dict[str, Any]] | None, service: Service) -> Job:
    body = {**rreq.chat_fields(req), "messages": rreq.input_messages(req, previous)}
    try:
        job = chat_job(msgspec.json.encode(body), service.model)
    except APIError as exc:
        exc.param = rreq.responses_param(exc.param)
        raise
    return dataclasses.replace(job, endpoint="responses", include_usage=False)


def _usage(gen: Generation, turn: AssistantTurn) -> dict[str, Any]:
    return rout.usage(gen.prompt_tokens, gen.completion_tokens, cached_tokens=gen.cached_tokens,
                      reasoning_tokens=turn.reasoning_tokens)


async def create_response(request: Request) -> Response:
    service = _service(request)
    body = await read_body(request, service.settings.max_body_bytes)
    req = rreq.parse_request(body)
    who = owner(request.scope)
    previous = await _previous(service, who, req)
    job = _job(req, previous, service)
    store = req.store is not False
    if store:
        try:
            await asyncio.to_thread(service.responses.reserve, who)
        except StoreFull as exc:
            raise APIError("response_store_full", str(exc)) from None
    gen = await service.admission.submit(job)
    meta = rout.ResponseMeta.from_request(req, id_=f"resp_{gen.id}", created_at=gen.created,
                                          temperature=job.params.temperature, top_p=job.params.top_p,
                                          max_output_tokens=job.params.max_tokens)
    ctx = current.get()
    if ctx is not None:
        ctx.fields.update(endpoint="responses", engine_request_id=gen.id)
    saver = _Saver(service, who, req, previous) if store else None
    try:
        if job.stream:
            first = await until_disconnect(request, gen, gen.__anext__())
            events = _events(gen, job.output or OutputPlan(), rout.ResponseStreamBuilder(meta), first, saver)
            return sse.response(events, on_close=gen.close)
        outs = await until_disconnect(request, gen, collect(gen))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    builder = rout.ResponseStreamBuilder(meta)
    turn = AssistantTurn(job.output or OutputPlan())
    for out in outs:
        for ev in turn.push(out):
            builder.feed(ev)
    builder.finish(gen.finish_reason, _usage(gen, turn))
    if saver is not None:
        await saver.save(builder.response)
    return json_response(builder.response)


class _Saver:
    """Stores a finished response with the conversation it continues."""

    def __init__(self, service: Service, who: str, req: rreq.ResponsesRequest,
                 previous: list[dict[str, Any]] | None) -> None:
        self._service, self._who, self._req, self._previous = service, who, req, previous

    async def save(self, response: dict[str, Any]) -> None:
        context = rreq.stored_context(self._req, self._previous, response)
        await asyncio.to_thread(self._service.responses.put, response["id"], self._who, response, context)


async def _events(gen: Generation, output: OutputPlan, builder: rout.ResponseStreamBuilder, first: StepOutput,
                  saver: _Saver | None) -> AsyncGenerator[bytes, None]:
    turn = AssistantTurn(output)

    async def outputs() -> AsyncGenerator[StepOutput, None]:
        yield first
        async for out in gen:
            yield out

    try:
        for ev in builder.start():
            yield rout.sse_event(ev)
        reason: FinishReason | None = None
        async for out in outputs():
            for pev in turn.push(out):
                for ev in builder.feed(pev):
                    yield rout.sse_event(ev)
            if out.finished:
                reason = out.finish_reason
        final = builder.finish(reason, _usage(gen, turn))
        if saver is not None:  # stored before the last event: a client may GET it right after
            try:
                await saver.save(builder.response)
            except Exception:  # the client still gets its response; a lost store write is logged
                log.exception("storing response %s failed", builder.response["id"])
        for ev in final:
            yield rout.sse_event(ev)
    except APIError as exc:
        record_error(exc.code)
        for ev in builder.fail(exc, _usage(gen, turn)):
            yield rout.sse_event(ev)
    finally:
        gen.close()


async def get_response(request: Request) -> Response:
    service = _service(request)
    response_id = request.path_params["response_id"]
    stored = await asyncio.to_thread(service.responses.get, response_id, owner(request.scope))
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored.response)


async def delete_response(request: Request) -> Response:
    service = _service(request)
    response_id = request.path_params["response_id"]
    if not await asyncio.to_thread(service.responses.delete, response_id, owner(request.scope)):
        raise _not_found(response_id)
    return json_response(rout.deleted_object(response_id))
