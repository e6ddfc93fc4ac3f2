"""The Responses API request (`POST /v1/responses`), as pure functions: the request Struct and
its field policy, and the conversion of Responses shapes to chat's (messages, tools, tool_choice,
text format, reasoning) so one generation path and one `gateway.agentic` policy serve both APIs.
The output side (response object, items, SSE events) is `gateway.responses_output`.

Every field of OpenAI's create-response body is declared; `FIELD_POLICY` says what each one does
here. Unknown fields are 400 `unknown_parameter`; a field that would change the output and that we
cannot honour is 400 `unsupported_parameter` naming it. Shapes follow the `openai` SDK's types
(the tests validate against them).

Chaining: a stored response keeps its conversation as chat messages (`stored_context`); a request
with `previous_response_id` continues from that list. `instructions` are never stored: as OpenAI
documents, they apply to one response and are not carried over to the next.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import msgspec

from gateway.errors import APIError, parameter
from gateway.protocol import decode

_S = TypeVar("_S", bound=msgspec.Struct)


# --- the request -------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_obfuscation: bool | None = None  # no-op: we never pad events


class FormatText(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    pass


class FormatJSONObject(msgspec.Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    pass


class FormatJSONSchema(msgspec.Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True,
                       kw_only=True):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: FormatText | FormatJSONObject | FormatJSONSchema | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # deprecated alias of summary
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    # A string, or a list of input items (checked one by one by `input_messages`: a message's
    # `type` may be omitted, so the items are not a tagged union msgspec could decode).
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    background: bool | None = None
    background_options: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[Any] | None = None
    moderation: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    # Extensions, honoured as on chat completions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


Policy = Literal["honoured", "no-op", "partial", "unsupported"]

# What each field does here. "partial": honoured or a no-op for some values, 400
# `unsupported_parameter` for the others (see `check_policy`); "unsupported": 400 when set.
FIELD_POLICY: dict[str, Policy] = {
    "model": "honoured", "input": "honoured", "instructions": "honoured", "previous_response_id": "honoured",
    "store": "honoured", "metadata": "honoured", "tools": "partial", "tool_choice": "partial",
    "parallel_tool_calls": "honoured", "text": "partial", "reasoning": "partial", "max_output_tokens": "honoured",
    "temperature": "honoured", "top_p": "honoured", "stream": "honoured",
    "top_k": "honoured", "min_p": "honoured", "repetition_penalty": "honoured", "presence_penalty": "honoured",
    "frequency_penalty": "honoured", "seed": "honoured", "chat_template_kwargs": "honoured",
    # Cannot change the output (hints, identifiers, billing, limits on built-in tools we do not have).
    "user": "no-op", "safety_identifier": "no-op", "prompt_cache_key": "no-op", "prompt_cache_retention": "no-op",
    "service_tier": "no-op", "stream_options": "no-op", "max_tool_calls": "no-op", "access_programs": "no-op",
    "image": "no-op",  # image inputs are refused anyway
    "include": "partial", "truncation": "partial", "top_logprobs": "partial", "background": "partial",
    "prompt_cache_options": "partial",
    "background_options": "unsupported", "conversation": "unsupported", "prompt": "unsupported",
    "context_management": "unsupported", "moderation": "unsupported",
}

_INCLUDABLE = {
    "web_search_call.action.sources", "web_search_call.results", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url",
    "message.output_text.logprobs", "reasoning.encrypted_content",
}
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512


def _bad(param: str, message: str) -> APIError:
    return APIError("invalid_request", message, param=param)


def check_policy(req: ResponsesRequest) -> None:
    """400 for a field this server cannot honour (see FIELD_POLICY)."""
    for name, policy in FIELD_POLICY.items():
        value = getattr(req, name)
        if policy == "unsupported" and value is not None and value != []:
            raise parameter(name)
    if req.background:
        raise parameter("background", "background responses are not supported: send the request and wait")
    if req.truncation == "auto":
        raise parameter("truncation", "truncation 'auto' is not supported: this server never drops input "
                        "(an input too long for the context is a 400)")
    if req.top_logprobs:
        raise parameter("top_logprobs", "'top_logprobs' is not supported yet")
    if req.prompt_cache_options and req.prompt_cache_options.get("prewarm"):
        raise parameter("prompt_cache_options.prewarm")
    for i, item in enumerate(req.include or ()):
        if item not in _INCLUDABLE:
            raise _bad(f"include[{i}]", f"unknown includable '{item}'")
        if item == "message.output_text.logprobs":
            raise parameter(f"include[{i}]", "'message.output_text.logprobs' is not supported yet")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise parameter("text.verbosity", "only the default verbosity ('medium') is supported")
    if req.reasoning is not None and req.reasoning.mode not in (None, "standard"):
        raise parameter("reasoning.mode", "only the 'standard' reasoning mode is supported")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    to_chat_tool_choice(req.tool_choice, to_chat_tools(req.tools))  # tools: function tools only
    if req.input is None or req.input == []:
        raise _bad("input", "'input' is required: a string or a non-empty list of input items")
    if req.metadata is not None:
        if len(req.metadata) > _METADATA_PAIRS:
            raise _bad("metadata", f"'metadata' holds at most {_METADATA_PAIRS} pairs")
        for key, value in req.metadata.items():
            if len(key) > _METADATA_KEY or len(value) > _METADATA_VALUE:
                raise _bad("metadata", f"'metadata' keys are at most {_METADATA_KEY} characters and values at "
                           f"most {_METADATA_VALUE}")


def parse_request(body: bytes) -> ResponsesRequest:
    """JSON body -> a request that passed the field policy (400s name the field; never 422)."""
    req: ResponsesRequest = decode(body, ResponsesRequest)
    check_policy(req)
    return req


# --- Responses shapes -> chat shapes -----------------------------------------------------------


class FunctionTool(msgspec.Struct, rename={"async_": "async"}, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None
    allowed_callers: list[str] | None = None
    async_: bool | None = None
    defer_loading: bool | None = None
    output_schema: dict[str, Any] | None = None  # no-op: describes what the caller returns


_AT = re.compile(r" - at `\$([^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")


def _convert(obj: Any, type_: type[_S], where: str) -> _S:
    """A JSON value -> Struct, with 400s naming the path below `where` (as `protocol.decode`)."""
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        at = _AT.search(text)
        path = where + (at.group(1) if at else "")
        unknown = _UNKNOWN.search(text)
        if unknown:
            param = f"{path}.{unknown.group(1)}"
            raise APIError("unknown_parameter", f"unknown parameter: '{param}'", param=param) from None
        raise _bad(path, f"invalid request: {_AT.sub('', text)} (at '{path}')") from None


def _function_tool(raw: Any, where: str) -> FunctionTool:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind != "function":
        raise parameter(f"{where}.type", f"tools of type '{kind}' are not supported: only 'function' tools are")
    tool = _convert(raw, FunctionTool, where)
    if tool.async_:
        raise parameter(f"{where}.async")
    if tool.defer_loading:
        raise parameter(f"{where}.defer_loading", "deferred tools (tool search) are not supported")
    if tool.allowed_callers is not None and set(tool.allowed_callers) != {"direct"}:
        raise parameter(f"{where}.allowed_callers", "only direct tool calls are supported")
    return tool


def to_chat_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> chat's `{"type": "function", "function": {...}}`."""
    if not tools:
        return None
    out = []
    for i, raw in enumerate(tools):
        tool = _function_tool(raw, f"tools[{i}]")
        fn: dict[str, Any] = {"name": tool.name}
        for key in ("description", "parameters", "strict"):
            value = getattr(tool, key)
            if value is not None:
                fn[key] = value
        out.append({"type": "function", "function": fn})
    return out


def to_chat_tool_choice(tool_choice: str | dict[str, Any] | None,
                        tools: list[dict[str, Any]] | None) -> tuple[Any, list[dict[str, Any]] | None]:
    """Responses tool_choice -> (chat tool_choice, chat tools). `allowed_tools` narrows the tools
    to the listed functions with its mode ("auto" | "required")."""
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice, tools  # none | auto | required; other strings are refused by the chat policy
    kind = tool_choice.get("type")
    if kind == "function":
        name = tool_choice.get("name")
        if not isinstance(name, str) or set(tool_choice) != {"type", "name"}:
            raise _bad("tool_choice", "a named tool_choice is {\"type\": \"function\", \"name\": ...}")
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        mode, allowed = tool_choice.get("mode"), tool_choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list) or not allowed:
            raise _bad("tool_choice", "allowed_tools takes 'mode' (auto | required) and a non-empty 'tools' list")
        names: set[str] = set()
        for i, ref in enumerate(allowed):
            if not isinstance(ref, dict) or ref.get("type") != "function" or not isinstance(ref.get("name"), str):
                raise parameter(f"tool_choice.tools[{i}]", "allowed_tools may list function tools only")
            names.add(ref["name"])
        kept = [t for t in tools or () if t["function"]["name"] in names]
        missing = names - {t["function"]["name"] for t in kept}
        if missing:
            raise _bad("tool_choice.tools", f"allowed_tools names '{sorted(missing)[0]}', which is not among the tools")
        return mode, kept
    raise parameter("tool_choice", f"tool_choice of type '{kind}' is not supported: use none, auto, required, "
                    "a function or allowed_tools")


def to_chat_response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` -> chat's `response_format` (None for plain text)."""
    fmt = text.format if text is not None else None
    if isinstance(fmt, FormatJSONObject):
        return {"type": "json_object"}
    if isinstance(fmt, FormatJSONSchema):
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema}
        if fmt.description is not None:
            spec["description"] = fmt.description
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": spec}
    return None


def chat_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The equivalent chat-completions request, without `messages` (see `input_messages`).
    Reasoning effort "none" turns thinking off unless `chat_template_kwargs` says otherwise; other
    efforts leave Qwen3.6's thinking on (it has no budget control)."""
    tools = to_chat_tools(req.tools)
    tool_choice, tools = to_chat_tool_choice(req.tool_choice, tools)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort == "none":
        kwargs.setdefault("enable_thinking", False)
    out: dict[str, Any] = {"model": req.model, "stream": bool(req.stream)}
    candidates = {
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty, "seed": req.seed,
        "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": to_chat_response_format(req.text), "chat_template_kwargs": kwargs or None,
    }
    out.update((k, v) for k, v in candidates.items() if v is not None)
    return out


_CHAT_PARAMS = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                ("response_format.json_schema", "text.format"), ("response_format", "text.format"))


def responses_param(param: str | None) -> str | None:
    """The Responses name of a parameter a chat-side 400 named (e.g. max_tokens -> max_output_tokens,
    tools[0].function.name -> tools[0].name)."""
    if param is None:
        return None
    for chat, ours in _CHAT_PARAMS:
        if param == chat or param.startswith(chat + "."):
            return ours + param[len(chat):]
    return re.sub(r"^(tools\[\d+\])\.function\b", r"\1", param)


# --- input items -> chat messages -----------------------------------------------------------------


class MessageItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Any]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(msgspec.Struct, rename={"async_": "async"}, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    async_: bool | None = None
    caller: Any = None
    namespace: str | None = None


class FunctionCallOutputItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Any]
    id: str | None = None
    status: str | None = None
    caller: Any = None
    name: str | None = None
    namespace: str | None = None


class TextPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["input_text", "output_text", "reasoning_text", "summary_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: Any = None


class RefusalPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["refusal"]
    refusal: str


class ReasoningItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["reasoning"]
    summary: list[TextPart] = []
    content: list[TextPart] | None = None
    id: str | None = None
    encrypted_content: str | None = None  # not ours to read: only `content` is replayed
    status: str | None = None


_MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url", "file")
_TEXT_PARTS = ("input_text", "output_text")


def _parts_text(content: str | list[Any], where: str, allowed: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, raw in enumerate(content):
        at = f"{where}[{j}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind in _MEDIA_PARTS:
            raise APIError("unsupported_content_type", f"content parts of type '{kind}' are not supported: this "
                           "model takes text only", param=at)
        if kind == "refusal" and "refusal" in allowed:
            texts.append(_convert(raw, RefusalPart, at).refusal)
        elif kind in allowed:
            texts.append(_convert(raw, TextPart, at).text)
        else:
            raise _bad(f"{at}.type", f"content parts of type '{kind}' are not valid here")
    return "".join(texts)


def _items_to_messages(items: Sequence[Any], param: str) -> list[dict[str, Any]]:
    """Responses items -> chat messages. Function calls join the assistant message before them (a
    turn the model generated as text + calls renders back as that turn); a reasoning item becomes
    the `reasoning_content` of the assistant message that follows it, is dropped before any other
    item, and stands as its own assistant message at the end."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    joinable = False  # the last message is an assistant turn that a function call may join

    def assistant(content: str) -> dict[str, Any]:
        nonlocal reasoning
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        reasoning = None
        messages.append(msg)
        return msg

    for i, raw in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(raw, dict):
            raise _bad(where, f"'{where}' must be an object")
        kind = raw.get("type", "message")
        if kind == "message":
            item = _convert(raw, MessageItem, where)
            text = _parts_text(item.content, f"{where}.content", _TEXT_PARTS + ("refusal",))
            if item.role == "assistant":
                assistant(text)
                joinable = True
            else:
                messages.append({"role": item.role, "content": text})
                reasoning, joinable = None, False
        elif kind == "function_call":
            call = _convert(raw, FunctionCallItem, where)
            entry = {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                          "arguments": call.arguments}}
            target = messages[-1] if joinable and reasoning is None else assistant("")
            target.setdefault("tool_calls", []).append(entry)
            joinable = True
        elif kind == "function_call_output":
            out = _convert(raw, FunctionCallOutputItem, where)
            text = _parts_text(out.output, f"{where}.output", ("input_text",))
            messages.append({"role": "tool", "tool_call_id": out.call_id, "content": text})
            reasoning, joinable = None, False
        elif kind == "reasoning":
            item_r = _convert(raw, ReasoningItem, where)
            text = "".join(p.text for p in item_r.content or ())
            reasoning = (reasoning or "") + text if text else reasoning
            joinable = False
        elif kind == "item_reference":
            raise parameter(where, "item references are not supported: send the item itself, or chain with "
                            "previous_response_id")
        else:
            raise parameter(f"{where}.type", f"input items of type '{kind}' are not supported")
    if reasoning:
        assistant("")
    return messages


def convert_input(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own `input` as chat messages (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    return _items_to_messages(req.input or [], "input")


def input_messages(req: ResponsesRequest, previous_context: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The chat messages the model sees: `instructions` as the leading system message, then the
    chained conversation (if any), then this request's input."""
    lead = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return lead + list(previous_context or ()) + convert_input(req)


def stored_context(req: ResponsesRequest, previous_context: list[dict[str, Any]] | None,
                   response: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation to store with `response` for later chaining: the chained conversation, this
    input and this response's output — without `instructions`."""
    return list(previous_context or ()) + convert_input(req) + _items_to_messages(response["output"], "output")
