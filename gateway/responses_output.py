"""The Responses API output: the `response` object, its output items (reasoning, message,
function call), usage, and the typed SSE event sequence built from the output parser's events
(`ResponseStreamBuilder`). Shapes follow the `openai` SDK's types (the tests validate against
them). The request side is `gateway.responses_request`.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

import msgspec

from gateway.errors import APIError
from gateway.output_parser import (
    ContentDelta,
    ParserEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from gateway.responses_request import ReasoningConfig, ResponsesRequest, TextConfig
from worker.engine.types import FinishReason

# --- output: the response object and its items -------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage(input_tokens: int, output_tokens: int, *, cached_tokens: int = 0,
          reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses usage object (`cache_write_tokens` is OpenAI billing; we report 0)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


ItemStatus = Literal["in_progress", "completed", "incomplete"]


def reasoning_item(id_: str, text: str | None, status: ItemStatus) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": id_, "summary": [], "content": content, "status": status}


def message_item(id_: str, text: str | None, status: ItemStatus) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {"type": "message", "id": id_, "status": status, "role": "assistant", "content": content}


def function_call_item(id_: str, call_id: str, name: str, arguments: str, status: ItemStatus) -> dict[str, Any]:
    return {"type": "function_call", "id": id_, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _echo_tool(raw: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": raw["name"], "description": raw.get("description"),
            "parameters": raw.get("parameters"), "strict": raw.get("strict")}


class ResponseMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What every snapshot of one response repeats: its id, creation time and the request echo."""

    id: str
    created_at: int
    echo: dict[str, Any]

    @classmethod
    def from_request(cls, req: ResponsesRequest, *, id_: str | None = None, created_at: int | None = None,
                     temperature: float | None = None, top_p: float | None = None,
                     max_output_tokens: int | None = None) -> ResponseMeta:
        """`temperature` / `top_p` / `max_output_tokens`: the effective values, when the caller knows
        them (defaults from the model's generation config, the output cap); else the request's."""
        text = req.text or TextConfig()
        fmt = msgspec.to_builtins(text.format) if text.format is not None else {"type": "text"}
        reasoning = req.reasoning or ReasoningConfig()
        pick = lambda value, given: given if value is None else value  # noqa: E731
        echo = {
            "model": req.model,
            "instructions": req.instructions,
            "metadata": dict(req.metadata or {}),
            "previous_response_id": req.previous_response_id,
            "store": pick(req.store, True),
            "temperature": pick(temperature, req.temperature),
            "top_p": pick(top_p, req.top_p),
            "max_output_tokens": pick(max_output_tokens, req.max_output_tokens),
            "max_tool_calls": req.max_tool_calls,
            "tools": [_echo_tool(t) for t in req.tools or ()],
            "tool_choice": pick(req.tool_choice, "auto"),
            "parallel_tool_calls": pick(req.parallel_tool_calls, True),
            "text": {"format": fmt, "verbosity": text.verbosity or "medium"},
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary or reasoning.generate_summary},
            "truncation": "disabled",
            "top_logprobs": req.top_logprobs or 0,
            "background": False,
            "service_tier": "default",
            "user": req.user,
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
        }
        return cls(id=id_ or new_id("resp"), created_at=int(time.time()) if created_at is None else created_at,
                   echo=echo)


Status = Literal["completed", "incomplete", "failed", "in_progress"]

# APIError code -> the SDK's closed set of `response.error.code`; our stable code goes in `type`.
_ERROR_CODE = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


def response_error(error: APIError) -> dict[str, Any]:
    return {"code": _ERROR_CODE.get(error.status, "server_error"), "message": error.message, "type": error.code,
            "param": error.param}


def response_object(meta: ResponseMeta, *, status: Status, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None = None, error: APIError | None = None,
                    incomplete_reason: str | None = None) -> dict[str, Any]:
    """The `response` object (non-streaming body, and every snapshot a stream carries)."""
    return {
        "id": meta.id,
        "object": "response",
        "created_at": meta.created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": response_error(error) if error is not None else None,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "output": output,
        "usage": usage,
        **meta.echo,
    }


def deleted_object(id_: str) -> dict[str, Any]:
    """The body of `DELETE /v1/responses/{id}`."""
    return {"id": id_, "object": "response.deleted", "deleted": True}


# --- streaming -------------------------------------------------------------------------------------

_ENCODER = msgspec.json.Encoder()


def sse_event(ev: dict[str, Any]) -> bytes:
    """One typed SSE frame: `event: <type>` then `data: <json>`."""
    return b"event: " + ev["type"].encode() + b"\ndata: " + _ENCODER.encode(ev) + b"\n\n"


class _Open:
    """The output item being streamed."""

    __slots__ = ("kind", "index", "id", "parts", "call_id", "name", "tool_index")

    def __init__(self, kind: str, index: int, id_: str, call_id: str = "", name: str = "",
                 tool_index: int = -1) -> None:
        self.kind, self.index, self.id = kind, index, id_
        self.parts: list[str] = []
        self.call_id, self.name, self.tool_index = call_id, name, tool_index


class ResponseStreamBuilder:
    """Parser events -> the Responses SSE event sequence (dicts with `sequence_number` from 0), and
    the final response object (`response`), which the non-streaming path uses alone.

    Streaming: `start()` (created, in_progress), `feed(ev)` per parser event, then exactly one of
    `finish(reason, usage)` (completed / incomplete) or `fail(error)`. One output item is open at a
    time: a reasoning item, a message, or a function call; an event of another kind closes it."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        self._open: _Open | None = None
        self._final: dict[str, Any] | None = None

    @property
    def response(self) -> dict[str, Any]:
        """The final response after finish/fail; before, an in-progress snapshot."""
        if self._final is not None:
            return self._final
        return response_object(self.meta, status="in_progress", output=list(self._output))

    @property
    def done(self) -> bool:
        return self._final is not None

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, ev: ParserEvent) -> list[dict[str, Any]]:
        if self._final is not None:
            raise RuntimeError("the response is already finished")
        if isinstance(ev, ReasoningDelta | ContentDelta):
            if not ev.text:
                return []
            kind = "reasoning" if isinstance(ev, ReasoningDelta) else "message"
            out = self._ensure(kind)
            cur = self._current()
            cur.parts.append(ev.text)
            loc = {"item_id": cur.id, "output_index": cur.index, "content_index": 0}
            if kind == "reasoning":
                return out + [self._event("response.reasoning_text.delta", **loc, delta=ev.text)]
            return out + [self._event("response.output_text.delta", **loc, delta=ev.text, logprobs=[])]
        if isinstance(ev, ToolCallStart):
            out = self._close("completed")
            self._open = _Open("function_call", len(self._output), new_id("fc"), ev.id, ev.name, ev.index)
            item = function_call_item(self._open.id, ev.id, ev.name, "", "in_progress")
            return out + [self._event("response.output_item.added", output_index=self._open.index, item=item)]
        cur = self._open
        if cur is None or cur.kind != "function_call" or cur.tool_index != ev.index:
            raise ValueError(f"tool call {ev.index} is not the open output item")
        if isinstance(ev, ToolCallDelta):
            if not ev.arguments:
                return []
            cur.parts.append(ev.arguments)
            return [self._event("response.function_call_arguments.delta", item_id=cur.id, output_index=cur.index,
                                delta=ev.arguments)]
        if isinstance(ev, ToolCallEnd):
            cur.parts = [ev.arguments]  # the whole arguments text is authoritative
            return self._close("completed")
        raise TypeError(f"not a parser event: {ev!r}")

    def _current(self) -> _Open:
        if self._open is None:
            raise ValueError("no output item is open")
        return self._open

    def _ensure(self, kind: str) -> list[dict[str, Any]]:
        """Open a reasoning item or a message (closing another open item)."""
        if self._open is not None and self._open.kind == kind:
            return []
        out = self._close("completed")
        cur = self._open = _Open(kind, len(self._output), new_id("rs" if kind == "reasoning" else "msg"))
        if kind == "reasoning":
            item, part = reasoning_item(cur.id, None, "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(cur.id, None, "in_progress"), _output_text("")
        return out + [self._event("response.output_item.added", output_index=cur.index, item=item),
                      self._event("response.content_part.added", item_id=cur.id, output_index=cur.index,
                                  content_index=0, part=part)]

    def _close(self, status: ItemStatus) -> list[dict[str, Any]]:
        cur, self._open = self._open, None
        if cur is None:
            return []
        text = "".join(cur.parts)
        loc = {"item_id": cur.id, "output_index": cur.index}
        if cur.kind == "reasoning":
            item = reasoning_item(cur.id, text, status)
            events = [self._event("response.reasoning_text.done", **loc, content_index=0, text=text),
                      self._event("response.content_part.done", **loc, content_index=0,
                                  part={"type": "reasoning_text", "text": text})]
        elif cur.kind == "message":
            item = message_item(cur.id, text, status)
            events = [self._event("response.output_text.done", **loc, content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", **loc, content_index=0, part=_output_text(text))]
        else:
            item = function_call_item(cur.id, cur.call_id, cur.name, text, status)
            events = [self._event("response.function_call_arguments.done", **loc, arguments=text)]
        self._output.append(item)
        return events + [self._event("response.output_item.done", output_index=cur.index, item=item)]

    def finish(self, reason: FinishReason | None, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        """End normally: `response.completed`, or `response.incomplete` when the output cap was hit
        (reason LENGTH; an item cut short is `incomplete`). Errors and aborts go to `fail`."""
        if self._final is not None:
            raise RuntimeError("the response is already finished")
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            raise ValueError(f"a generation that ended with {reason} fails the response: call fail()")
        incomplete = reason is FinishReason.LENGTH
        out = self._close("incomplete" if incomplete else "completed")
        self._final = response_object(self.meta, status="incomplete" if incomplete else "completed",
                                      output=list(self._output), usage=usage,
                                      incomplete_reason="max_output_tokens" if incomplete else None)
        kind = "response.incomplete" if incomplete else "response.completed"
        return out + [self._event(kind, response=self._final)]

    def fail(self, error: APIError, usage: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """End with `response.failed` carrying the error (an open item is closed `incomplete`)."""
        if self._final is not None:
            raise RuntimeError("the response is already finished")
        out = self._close("incomplete")
        self._final = response_object(self.meta, status="failed", output=list(self._output), usage=usage,
                                      error=error)
        return out + [self._event("response.failed", response=self._final)]
