"""Tools, tool_choice, structured output and reasoning: from request fields to an `OutputPlan`.

One policy for chat completions and the Responses API (which first converts its own shapes to
chat's). The plan says which tools the chat template renders, whether the output is parsed for
`<tool_call>` markup, whether the prompt opens a `<think>` block (so the output starts inside
reasoning), and which constraint the engine enforces by constrained decoding:

- `tool_choice` "none": tools are not rendered and nothing is parsed as a call (as OpenAI's
  "the model will not call a tool"); "auto": rendered and parsed, free generation;
  "required" / named: rendered, parsed, and the engine's grammar forces one call (or several,
  with `parallel_tool_calls`) whose arguments obey the tool's schema.
- `response_format` json_object / json_schema: enforced by the grammar; cannot be combined with a
  forced tool call (400).
- Thinking is on unless `enable_thinking` is false (Qwen3.6's template then writes an empty
  `<think></think>` into the prompt); with it on, constraints start after `</think>`.

Schema features the grammar engine cannot enforce are refused by the worker when it admits the
request — still a 400 before any token is generated.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.errors import APIError, parameter
from worker.engine.types import OutputConstraint

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    tools: tuple[dict[str, Any], ...] = ()  # chat-shape function tools, as the template renders them
    parse_tools: bool = False
    thinking: bool = True
    constraint: OutputConstraint | None = None
    parallel_tool_calls: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return list(self.tools) if self.tools else None


def _bad(param: str, message: str) -> APIError:
    return APIError("invalid_request", message, param=param)


def check_tools(tools: Sequence[Any], param: str = "tools") -> tuple[dict[str, Any], ...]:
    """Validate chat-shape function tools; returns them as plain dicts."""
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, Mapping):
            raise _bad(where, f"'{where}' must be an object")
        if tool.get("type") != "function":
            raise parameter(f"{where}.type", f"tools of type '{tool.get('type')}' are not supported: only "
                            "'function' tools are")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise _bad(f"{where}.function", f"'{where}.function' must be an object")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            name = sorted(unknown)[0]
            raise APIError("unknown_parameter", f"unknown parameter: '{where}.function.{name}'",
                           param=f"{where}.function.{name}")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise _bad(f"{where}.function.name", "a function name must be 1-64 characters of letters, digits, "
                       "'_', '-', '.' or ':'")
        if name in names:
            raise _bad(f"{where}.function.name", f"the function name '{name}' is declared twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, Mapping) or params.get("type", "object") != "object"):
            raise _bad(f"{where}.function.parameters", "'parameters' must be a JSON Schema of type 'object'")
        out.append({"type": "function", "function": dict(fn)})
    return tuple(out)


def _named_choice(tool_choice: Mapping[str, Any]) -> str | None:
    """The function name of a named choice in chat's shape, or None."""
    if tool_choice.get("type") != "function":
        return None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) else None


def _response_format(fmt: Mapping[str, Any] | None, param: str) -> tuple[str, str | None] | None:
    """(kind, schema JSON) of a chat `response_format`, None for plain text."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise _bad(f"{param}.json_schema", "'json_schema' must be an object with 'name' and 'schema'")
        schema = spec.get("schema")
        if not isinstance(schema, Mapping):
            raise _bad(f"{param}.json_schema.schema", "'schema' must be a JSON Schema object")
        return "json_schema", json.dumps(schema, sort_keys=False)
    raise _bad(f"{param}.type", f"unknown response format type '{kind}': use text, json_object or json_schema")


def plan(
    *,
    tools: Sequence[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    response_format: Mapping[str, Any] | None,
    thinking: bool,
    param_tools: str = "tools",
    param_choice: str = "tool_choice",
    param_format: str = "response_format",
) -> OutputPlan:
    """The output plan of a request, in chat's shapes (the Responses API converts first)."""
    checked = check_tools(tools or (), param_tools)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    choice: str
    named: str | None = None
    if tool_choice is None:
        choice = "auto" if checked else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad(param_choice, f"'{param_choice}' must be none, auto, required or a named function, "
                       f"got '{tool_choice}'")
        choice = tool_choice
    elif isinstance(tool_choice, Mapping) and (named := _named_choice(tool_choice)) is not None:
        choice = "named"
    else:
        raise _bad(param_choice, f"'{param_choice}' must be none, auto, required or "
                   '{"type": "function", "function": {"name": ...}}')
    if choice != "none" and not checked:
        raise _bad(param_choice, f"'{param_choice}' is '{choice}' but the request declares no tools")
    if named is not None and named not in {t["function"]["name"] for t in checked}:
        raise _bad(param_choice, f"'{param_choice}' names the function '{named}', which is not among the tools")
    fmt = _response_format(response_format, param_format)
    forced = choice in ("required", "named")
    if forced and fmt is not None:
        raise _bad(param_format, f"'{param_format}' cannot be combined with a forced tool call "
                   f"('{param_choice}': {choice})")
    constraint: OutputConstraint | None = None
    if forced:
        constraint = OutputConstraint(kind="tool_calls", tools=json.dumps(list(checked)), tool_name=named,
                                      parallel=parallel, after_reasoning=thinking)
    elif fmt is not None:
        constraint = OutputConstraint(kind=fmt[0], schema=fmt[1], after_reasoning=thinking)
    rendered = checked if choice != "none" else ()
    return OutputPlan(tools=rendered, parse_tools=bool(rendered), thinking=thinking, constraint=constraint,
                      parallel_tool_calls=parallel)


def thinking_enabled(template_kwargs: Mapping[str, Any], reasoning_effort: str | None = None) -> bool:
    """Whether the prompt opens a `<think>` block: `enable_thinking` wins, then a reasoning
    effort of "none" turns it off; Qwen3.6 thinks by default."""
    explicit = template_kwargs.get("enable_thinking")
    if explicit is not None:
        return bool(explicit)
    return reasoning_effort != "none"
