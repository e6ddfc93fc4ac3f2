"""OpenAI request shapes (typed msgspec Structs) and the field policy that turns one into a job.

Every field of OpenAI's chat-completions and completions request schemas is declared here, and
each one is either honoured, accepted as a no-op (it cannot change the output: `user`,
`metadata`, `service_tier`, `store`, …) or rejected with 400 `unsupported_parameter` naming it.
Fields no schema declares are 400 `unknown_parameter` (`forbid_unknown_fields`), so a typo like
`max_token` is never silently ignored. Extensions honoured beyond OpenAI (as vLLM accepts them):
`top_k`, `min_p`, `repetition_penalty`, `chat_template_kwargs`, and llama-server's `cache_prompt`
(false bypasses prefix-state reuse). Tools, tool_choice, response_format and reasoning become an
`OutputPlan` (`gateway.agentic`). Nothing here ever answers 422.

Tokenizing and the chat template belong to the worker (this process holds no OpenVINO): a job
carries the prompt as text / messages (`ipc.messages.PromptSpec`), or as token ids when a
completions client sent ids.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

import msgspec

from gateway.agentic import OutputPlan, plan, thinking_enabled
from gateway.errors import APIError, parameter
from gateway.model import ModelInfo
from ipc.messages import PromptSpec
from worker.engine.types import OutputConstraint, SamplingParams

_MAX_STOP = 4  # OpenAI's limit on stop sequences


class _Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields common to both endpoints."""

    model: str
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # no-op
    # Extensions (vLLM-style sampling knobs), honoured.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    cache_prompt: bool | None = None  # llama-server's switch: false bypasses prefix-state reuse


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no-op: we never pad chunks


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    reasoning_content: str | None = None  # extension: earlier reasoning, as vLLM accepts it


class ChatCompletionRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None  # no-op
    service_tier: str | None = None  # no-op: one tier
    store: bool | None = None  # no-op: chat completions are not stored
    prompt_cache_key: str | None = None  # no-op
    prompt_cache_retention: str | None = None  # no-op
    safety_identifier: str | None = None  # no-op
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: Any = None
    tools: list[Any] | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension, e.g. {"enable_thinking": false}


class CompletionRequest(_Request, kw_only=True):
    # A string, or a list of strings / token ids / token-id lists (msgspec unions hold one array
    # type, so the list's items are checked by `_completion_prompt`).
    prompt: str | list[Any]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


@dataclasses.dataclass(frozen=True)
class Job:
    """A validated request: what to generate and how to answer."""

    endpoint: Literal["chat", "completions", "responses"]
    model: str
    params: SamplingParams
    prompt: PromptSpec | None  # text / messages for the worker to tokenize
    prompt_ids: tuple[int, ...]  # used when `prompt` is None
    stream: bool
    include_usage: bool
    output: OutputPlan | None = None  # None: raw text (completions); else how to parse and constrain it
    reuse_prefix: bool = True

    @property
    def constraint(self) -> OutputConstraint | None:
        return None if self.output is None else self.output.constraint


# --- decoding ----------------------------------------------------------------------------------

_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")


def decode(body: bytes, type_: type[msgspec.Struct]) -> Any:
    """JSON -> Struct, with OpenAI-style 400s (never 422) naming the offending parameter."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        at = _AT.search(text)
        path = at.group(1) if at else ""
        unknown = _UNKNOWN.search(text)
        if unknown:
            param = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
            raise APIError("unknown_parameter", f"unknown parameter: '{param}'", param=param) from None
        message = _AT.sub("", text)
        raise APIError("invalid_request", f"invalid request: {message}" + (f" (at '{path}')" if path else ""),
                       param=path or None) from None
    except msgspec.DecodeError as exc:  # (ValidationError is a DecodeError: it is handled first)
        raise APIError("invalid_request", f"the request body is not valid JSON: {exc}") from None


# --- the field policy ----------------------------------------------------------------------------

def _reject_if(condition: bool, param: str, why: str = "") -> None:
    if condition:
        raise parameter(param, f"'{param}' is not supported by this server{why}")


def _range(value: float | None, param: str, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise APIError("invalid_request", f"'{param}' must be in {interval}, got {value}", param=param)


def _sampling(req: _Request, max_tokens: int | None, model: ModelInfo) -> SamplingParams:
    if req.model != model.id:
        raise APIError("model_not_found", f"the model '{req.model}' does not exist; this server serves "
                       f"'{model.id}'", param="model")
    if req.n is not None and req.n != 1:
        raise parameter("n", f"only n=1 is supported (batch size 1), got n={req.n}")
    _reject_if(bool(req.logit_bias), "logit_bias")
    for name in model.unsupported_params:
        value = getattr(req, name, None)
        _reject_if(value is not None and value != 0, name, f" with the {model.engine} engine")
    _range(req.temperature, "temperature", 0, 2)
    _range(req.top_p, "top_p", 0, 1, lo_open=True)
    _range(req.frequency_penalty, "frequency_penalty", -2, 2)
    _range(req.presence_penalty, "presence_penalty", -2, 2)
    _range(req.min_p, "min_p", 0, 1)
    if req.top_k is not None and req.top_k < 0 and req.top_k != -1:
        raise APIError("invalid_request", f"'top_k' must be >= 0 (0 or -1 disable it), got {req.top_k}",
                       param="top_k")
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise APIError("invalid_request", "'repetition_penalty' must be > 0", param="repetition_penalty")
    if req.seed is not None and req.seed < 0:
        raise APIError("invalid_request", "'seed' must be a non-negative integer", param="seed")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > _MAX_STOP:
        raise APIError("invalid_request", f"'stop' takes at most {_MAX_STOP} sequences", param="stop")
    if any(s == "" for s in stop):
        raise APIError("invalid_request", "'stop' sequences must not be empty", param="stop")
    cap = model.max_output_tokens
    if max_tokens is None:
        max_tokens = cap  # omitted means the cap (SPEC §4)
    elif max_tokens < 1:
        raise APIError("invalid_request", f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
    elif max_tokens > cap:
        raise APIError("output_limit_exceeded", f"max_tokens is {max_tokens}, more than the maximum of {cap} "
                       "output tokens", param="max_tokens")
    d = model.defaults
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=pick(req.temperature, d.temperature),
        top_p=pick(req.top_p, d.top_p),
        top_k=max(0, pick(req.top_k, d.top_k)),
        min_p=pick(req.min_p, d.min_p),
        presence_penalty=pick(req.presence_penalty, 0.0),
        frequency_penalty=pick(req.frequency_penalty, 0.0),
        repetition_penalty=pick(req.repetition_penalty, d.repetition_penalty),
        seed=req.seed,
        stop=stop,
    )


def _stream_flags(req: _Request) -> tuple[bool, bool]:
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise APIError("invalid_request", "'stream_options' is only allowed when 'stream' is true",
                       param="stream_options")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return stream, include_usage


def _tool_call_dict(where: str, call: Any) -> dict[str, Any]:
    """An assistant message's tool call, with its JSON `arguments` parsed for the chat template
    (it renders each argument as a `<parameter=…>` block)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError("invalid_request", f"'{where}' must be a function call with a name", param=where)
    args: Any = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise APIError("invalid_request", f"'{where}.function.arguments' is not valid JSON",
                           param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise APIError("invalid_request", f"'{where}.function.arguments' must be a JSON object",
                       param=f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _message_dict(i: int, m: ChatMessage) -> dict[str, Any]:
    _reject_if(m.audio is not None, f"messages[{i}].audio")
    _reject_if(m.function_call is not None, f"messages[{i}].function_call")
    content: str | None
    if isinstance(m.content, list):
        texts: list[str] = []
        for j, part in enumerate(m.content):
            if part.type in ("image_url", "input_audio", "file", "input_image"):
                raise APIError("unsupported_content_type", f"content parts of type '{part.type}' are not "
                               "supported: this model takes text only", param=f"messages[{i}].content[{j}]")
            if part.type == "text" and part.text is not None:
                texts.append(part.text)
            elif part.type == "refusal" and part.refusal is not None:
                texts.append(part.refusal)
            else:
                raise APIError("invalid_request", f"invalid content part of type '{part.type}'",
                               param=f"messages[{i}].content[{j}]")
        content = "".join(texts)
    else:
        content = m.content
    out: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError("invalid_request", "only assistant messages carry 'tool_calls'",
                           param=f"messages[{i}].tool_calls")
        out["tool_calls"] = [_tool_call_dict(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(m.tool_calls)]
    if m.role == "tool" and not m.tool_call_id:
        raise APIError("invalid_request", "a tool message needs 'tool_call_id'", param=f"messages[{i}].tool_call_id")
    return out


def chat_job(body: bytes, model: ModelInfo) -> Job:
    req: ChatCompletionRequest = decode(body, ChatCompletionRequest)
    if not req.messages:
        raise APIError("invalid_request", "'messages' must hold at least one message", param="messages")
    _reject_if(req.functions is not None, "functions", " (deprecated: use 'tools')")
    _reject_if(req.function_call is not None, "function_call", " (deprecated: use 'tool_choice')")
    _reject_if(req.audio is not None, "audio")
    _reject_if(req.modalities is not None and req.modalities != ["text"], "modalities")
    _reject_if(req.prediction is not None, "prediction")
    if req.reasoning_effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
        raise APIError("invalid_request", f"unknown reasoning_effort '{req.reasoning_effort}'",
                       param="reasoning_effort")
    _reject_if(req.verbosity is not None, "verbosity")
    _reject_if(req.web_search_options is not None, "web_search_options")
    _reject_if(bool(req.logprobs), "logprobs", " yet")
    _reject_if(bool(req.top_logprobs), "top_logprobs", " yet")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling(req, max_tokens, model)
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
    stream, include_usage = _stream_flags(req)
    kwargs = dict(req.chat_template_kwargs or {})
    thinking = thinking_enabled(kwargs, req.reasoning_effort)
    kwargs["enable_thinking"] = thinking
    output = plan(tools=req.tools, tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                  response_format=req.response_format, thinking=thinking)
    if output.template_tools:
        kwargs["tools"] = output.template_tools
    prompt = PromptSpec(messages=messages, template_kwargs=kwargs)
    return Job("chat", req.model, params, prompt, (), stream, include_usage, output=output,
               reuse_prefix=req.cache_prompt is not False)


def completion_job(body: bytes, model: ModelInfo) -> Job:
    req: CompletionRequest = decode(body, CompletionRequest)
    _reject_if(req.best_of is not None and req.best_of != 1, "best_of")
    _reject_if(bool(req.echo), "echo")
    _reject_if(req.logprobs is not None, "logprobs", " yet")
    _reject_if(bool(req.suffix), "suffix")
    params = _sampling(req, req.max_tokens, model)
    prompt, ids = _completion_prompt(req.prompt)
    stream, include_usage = _stream_flags(req)
    return Job("completions", req.model, params, prompt, ids, stream, include_usage,
               reuse_prefix=req.cache_prompt is not False)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompt(p: str | list[Any]) -> tuple[PromptSpec | None, tuple[int, ...]]:
    if isinstance(p, list) and p and (isinstance(p[0], str) or isinstance(p[0], list)):
        if len(p) != 1:
            raise parameter("prompt", "only one prompt per request is supported (batch size 1)")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError("invalid_request", "'prompt' must not be empty", param="prompt")
        return PromptSpec(text=p), ()
    if not _is_ids(p) or not p:
        raise APIError("invalid_request", "'prompt' must be a non-empty string, list of token ids, or a list "
                       "holding one of those", param="prompt")
    return None, tuple(p)
