"""Splits the model's output text into reasoning, content and tool calls, incrementally.

`OutputParser` owns the Qwen3.6 output format. Feed it the output as str deltas (a delta may split
any markup anywhere); it returns the events below, and `finish()` flushes what it held back.

    <think>\\nreasoning\\n</think>\\n\\ncontent
    <tool_call>\\n<function=NAME>\\n<parameter=K>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>

Reasoning. With `starts_in_reasoning` (the prompt ended with "<think>\\n") the output begins inside
reasoning; otherwise a "<think>" at the very start of the output (after whitespace) opens it. One
"\\n" after a model-emitted "<think>" and one before "</think>" are stripped. Markup inside
reasoning is reasoning text. Output that ends inside reasoning is all reasoning (nothing is lost).

Content. Leading whitespace of the content (and after "</think>" or a call) is dropped; a stray
"</think>" in content is markup and is dropped. Any suffix that could still become markup is held
back until decided; with tools, trailing whitespace is also held back and is dropped right before a
"<tool_call>". Without tools, call markup is ordinary content.

Tool calls. ToolCallStart once "<function=NAME>" is complete, then the arguments as one JSON object
text in ToolCallDelta chunks, then ToolCallEnd with the whole text (always valid JSON). Each value
takes the JSON type its tool's schema declares (`type`, a list of types, anyOf/oneOf/allOf, or the
types of `enum`/`const` values); when "string" is among them, or nothing is known (unknown tool or
parameter), the value is a JSON string streamed as it arrives. Other values are emitted when their
parameter closes; a value that does not convert becomes the JSON string of its raw text.
Choices for malformed markup (it never raises):
- "<tool_call>" not followed by "<function=NAME>" is replayed as content, whitespace included.
- A missing "</parameter>" is closed by the next "<parameter=", "</function>" or "</tool_call>";
  a missing "</function>" by "</tool_call>"; a missing "</tool_call>" by any other text.
- Text between parameters that is not markup is dropped (it has no place in a JSON object).
- A repeated parameter name is ignored: the first value wins (streamed keys cannot be taken back).
- Output that ends inside a call ends the call: the open value and object are closed (a partial
  closing tag is dropped), ToolCallEnd is emitted and the call is kept, so the client still gets
  valid JSON arguments (and finish_reason "length" tells it the call may be incomplete).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # 0, 1, … in order of appearance
    id: str  # "call_…"
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    arguments: str  # the next chunk of the call's JSON arguments text


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    arguments: str  # the whole JSON arguments text: the concatenation of the call's deltas


ParserEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallDelta | ToolCallEnd

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_CALL_OPEN = "<tool_call>"
_CALL_CLOSE = "</tool_call>"
_FUNCTION_OPEN = "<function="
_FUNCTION_CLOSE = "</function>"
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"
_VALUE_ENDS = (_PARAM_CLOSE, _PARAM_OPEN, _FUNCTION_CLOSE, _CALL_CLOSE)
_FUNCTION_RE = re.compile(r"\s*<function=([A-Za-z0-9_.:-]+)>")
_NAME_PART_RE = re.compile(r"[A-Za-z0-9_.:-]*")
_PARAM_RE = re.compile(r"<parameter=([^<>\n]+)>")
_KEY_PART_RE = re.compile(r"[^<>\n]*")
_NON_STRING_TYPES = frozenset({"null", "boolean", "integer", "number", "object", "array"})
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id: "call_" and 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class _State(enum.Enum):
    REASONING = enum.auto()
    CONTENT = enum.auto()
    CALL_OPEN = enum.auto()  # after <tool_call>: waiting for <function=NAME>
    IN_CALL = enum.auto()  # between parameters
    IN_VALUE = enum.auto()  # inside <parameter=K>
    AFTER_FUNCTION = enum.auto()  # after </function>: waiting for </tool_call>


class OutputParser:
    """Incremental parser for one request's output; see the module docstring for the format.

    `feed(text)` returns the events the new text completes; `finish()` ends the output and returns
    the rest. `reasoning`, `content` and `tool_calls` (OpenAI chat shape) accumulate as it goes.
    """

    def __init__(
        self,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        starts_in_reasoning: bool = False,
        new_call_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._properties_by_tool = _tool_properties(tools)
        self._parse_calls = bool(tools)
        self._new_call_id = new_call_id
        self._steps: dict[_State, Callable[[bool], bool]] = {
            _State.REASONING: self._step_reasoning,
            _State.CONTENT: self._step_content,
            _State.CALL_OPEN: self._step_call_open,
            _State.IN_CALL: self._step_in_call,
            _State.IN_VALUE: self._step_in_value,
            _State.AFTER_FUNCTION: self._step_after_function,
        }
        self._state = _State.REASONING if starts_in_reasoning else _State.CONTENT
        self._buf = ""  # text received but not yet decided
        self._events: list[ParserEvent] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self._finished = False
        self._may_open_think = not starts_in_reasoning  # nothing but whitespace seen yet
        self._strip_newline = False  # one "\n" right after a model-emitted <think>
        self._lstrip = True  # drop whitespace before content
        self._held_markup = ""  # "<tool_call>" and the whitespace before it, replayed if malformed
        # The open call and parameter.
        self._properties: Mapping[str, Any] = {}
        self._keys: set[str] = set()
        self._skip_value = False
        self._value_start = False
        self._value_types: frozenset[str] = frozenset()
        self._value_is_string = True
        self._value: list[str] = []

    @property
    def in_reasoning(self) -> bool:
        """The parser is inside a <think> block right now."""
        return self._state is _State.REASONING

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        return "".join(self._content)

    def feed(self, text: str) -> list[ParserEvent]:
        """Parse the next delta of output; returns the events it completes (maybe none)."""
        if self._finished:
            raise RuntimeError("OutputParser.feed() after finish()")
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[ParserEvent]:
        """End of output: flush everything held back and close an open call. Idempotent."""
        if self._finished:
            return []
        self._finished = True
        return self._run(final=True)

    def _run(self, final: bool) -> list[ParserEvent]:
        while self._steps[self._state](final):
            pass
        if final and self._state in (_State.IN_CALL, _State.IN_VALUE, _State.AFTER_FUNCTION):
            self._end_call()
        events, self._events = self._events, []
        return events

    # Each step consumes what it can of the buffer; it returns True when another step may progress.

    def _step_reasoning(self, final: bool) -> bool:
        buf = self._buf
        if self._strip_newline:
            if not buf:
                return False
            self._strip_newline = False
            self._buf = buf.removeprefix("\n")
            return True
        end = buf.find(_THINK_CLOSE)
        if end >= 0:
            self._emit_reasoning(buf[:end].removesuffix("\n"))
            self._buf = buf[end + len(_THINK_CLOSE) :]
            self._state, self._lstrip = _State.CONTENT, True
            return True
        safe = len(buf)
        if not final:
            safe -= _partial_len(buf, _THINK_CLOSE)
            if safe and buf[safe - 1] == "\n":  # may be the "\n" before </think>
                safe -= 1
        self._emit_reasoning(buf[:safe])
        self._buf = buf[safe:]
        return False

    def _step_content(self, final: bool) -> bool:
        if self._lstrip:
            buf = self._buf = self._buf.lstrip()
            if not buf:
                return False
            if self._may_open_think:
                if buf.startswith(_THINK_OPEN):
                    self._buf = buf[len(_THINK_OPEN) :]
                    self._state, self._strip_newline, self._may_open_think = _State.REASONING, True, False
                    return True
                if _THINK_OPEN.startswith(buf) and not final:
                    return False
                self._may_open_think = False
            self._lstrip = False
        buf = self._buf
        markers = (_CALL_OPEN, _THINK_CLOSE) if self._parse_calls else (_THINK_CLOSE,)
        found = [(at, marker) for marker in markers if (at := buf.find(marker)) >= 0]
        if found:
            at, marker = min(found)
            text = buf[:at]
            self._buf = buf[at + len(marker) :]
            if marker == _THINK_CLOSE:
                self._emit_content(text)
                return True
            kept = text.rstrip()
            self._emit_content(kept)
            self._held_markup = text[len(kept) :] + marker
            self._state = _State.CALL_OPEN
            return True
        safe = len(buf)
        if not final:
            safe -= max(_partial_len(buf, marker) for marker in markers)
            if self._parse_calls:
                safe = len(buf[:safe].rstrip())
        self._emit_content(buf[:safe])
        self._buf = buf[safe:]
        return False

    def _step_call_open(self, final: bool) -> bool:
        buf = self._buf
        match = _FUNCTION_RE.match(buf)
        if match:
            self._buf = buf[match.end() :]
            self._start_call(match.group(1))
            return True
        rest = buf.lstrip()
        if not final and (
            _FUNCTION_OPEN.startswith(rest)
            or (rest.startswith(_FUNCTION_OPEN) and _NAME_PART_RE.fullmatch(rest, len(_FUNCTION_OPEN)))
        ):
            return False
        self._emit_content(self._held_markup)  # not a call after all: the markup is text
        self._held_markup = ""
        self._state = _State.CONTENT
        return True

    def _step_in_call(self, final: bool) -> bool:
        buf = self._buf = self._buf.lstrip()
        if not buf:
            return False
        if buf.startswith(_FUNCTION_CLOSE):
            self._buf = buf[len(_FUNCTION_CLOSE) :]
            self._state = _State.AFTER_FUNCTION
            return True
        if buf.startswith(_CALL_CLOSE):
            self._buf = buf[len(_CALL_CLOSE) :]
            self._end_call()
            return True
        match = _PARAM_RE.match(buf)
        if match:
            self._buf = buf[match.end() :]
            self._open_value(match.group(1).strip())
            return True
        if not final and (
            any(tag.startswith(buf) for tag in (_FUNCTION_CLOSE, _CALL_CLOSE, _PARAM_OPEN))
            or (buf.startswith(_PARAM_OPEN) and _KEY_PART_RE.fullmatch(buf, len(_PARAM_OPEN)))
        ):
            return False
        cut = buf.find("<", 1)  # stray text between parameters: dropped up to the next tag
        self._buf = buf[cut:] if cut > 0 else ""
        return True

    def _step_in_value(self, final: bool) -> bool:
        buf = self._buf
        if self._value_start:
            if not buf:
                return False
            self._value_start = False
            self._buf = buf.removeprefix("\n")
            return True
        ends = [at for end in _VALUE_ENDS if (at := buf.find(end)) >= 0]
        if ends or final:
            # Cut off mid-value: a partial closing tag is markup, not value.
            at = min(ends, default=len(buf) - max(_partial_len(buf, end) for end in _VALUE_ENDS))
            self._take_value(buf[:at].removesuffix("\n"))
            rest = buf[at:]
            self._buf = rest.removeprefix(_PARAM_CLOSE)  # the lenient ends stay for the next step
            self._close_value()
            return True
        safe = len(buf) - max(_partial_len(buf, end) for end in _VALUE_ENDS)
        if safe and buf[safe - 1] == "\n":  # may be the "\n" before </parameter>
            safe -= 1
        self._take_value(buf[:safe])
        self._buf = buf[safe:]
        return False

    def _step_after_function(self, final: bool) -> bool:
        rest = self._buf = self._buf.lstrip()
        if rest.startswith(_CALL_CLOSE):
            self._buf = rest[len(_CALL_CLOSE) :]
        elif _CALL_CLOSE.startswith(rest):
            if not final:
                return False
            self._buf = ""  # cut off inside the closing tag
        self._end_call()
        return True

    def _start_call(self, name: str) -> None:
        self._held_markup = ""
        call_id = self._new_call_id()
        self.tool_calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        self._events.append(ToolCallStart(len(self.tool_calls) - 1, call_id, name))
        self._properties = self._properties_by_tool.get(name, {})
        self._keys = set()
        self._state = _State.IN_CALL

    def _open_value(self, key: str) -> None:
        self._state, self._value_start, self._value = _State.IN_VALUE, True, []
        self._skip_value = key in self._keys
        if self._skip_value:
            return
        self._value_types = _schema_types(self._properties.get(key))
        self._value_is_string = "string" in self._value_types or not self._value_types & _NON_STRING_TYPES
        opening = ", " if self._keys else "{"
        self._keys.add(key)
        self._emit_arguments(opening + json.dumps(key, ensure_ascii=False) + (': "' if self._value_is_string else ": "))

    def _take_value(self, text: str) -> None:
        if self._skip_value or not text:
            return
        if self._value_is_string:
            self._emit_arguments(json.dumps(text, ensure_ascii=False)[1:-1])  # escaping is per character
        else:
            self._value.append(text)

    def _close_value(self) -> None:
        self._state = _State.IN_CALL
        if self._skip_value:
            return
        if self._value_is_string:
            self._emit_arguments('"')
        else:
            self._emit_arguments(_to_json("".join(self._value), self._value_types))

    def _end_call(self) -> None:
        if self._state is _State.IN_VALUE:
            self._close_value()
        self._emit_arguments("}" if self._keys else "{}")
        index = len(self.tool_calls) - 1
        self._events.append(ToolCallEnd(index, self.tool_calls[index]["function"]["arguments"]))
        self._state, self._lstrip = _State.CONTENT, True

    def _emit_reasoning(self, text: str) -> None:
        if text:
            self._reasoning.append(text)
            last = self._events[-1] if self._events else None
            if isinstance(last, ReasoningDelta):
                self._events[-1] = ReasoningDelta(last.text + text)
            else:
                self._events.append(ReasoningDelta(text))

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            last = self._events[-1] if self._events else None
            if isinstance(last, ContentDelta):
                self._events[-1] = ContentDelta(last.text + text)
            else:
                self._events.append(ContentDelta(text))

    def _emit_arguments(self, text: str) -> None:
        index = len(self.tool_calls) - 1
        self.tool_calls[index]["function"]["arguments"] += text
        last = self._events[-1] if self._events else None
        if isinstance(last, ToolCallDelta) and last.index == index:
            self._events[-1] = ToolCallDelta(index, last.arguments + text)
        else:
            self._events.append(ToolCallDelta(index, text))


def _partial_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _tool_properties(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Tool name -> its parameters' `properties` schema map, from an OpenAI chat tools list."""
    by_name: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        by_name[function["name"]] = properties if isinstance(properties, Mapping) else {}
    return by_name


def _schema_types(schema: Any) -> frozenset[str]:
    """The JSON types a parameter schema allows; empty when it does not say."""
    if not isinstance(schema, Mapping):
        return frozenset()
    declared = schema.get("type")
    if isinstance(declared, str):
        types = {declared}
    else:
        types = {t for t in declared if isinstance(t, str)} if isinstance(declared, list) else set()
    for keyword in ("anyOf", "oneOf", "allOf"):
        subschemas = schema.get(keyword)
        for subschema in subschemas if isinstance(subschemas, list) else ():
            types |= _schema_types(subschema)
    if not types:
        values = schema.get("enum") if isinstance(schema.get("enum"), list) else []
        if "const" in schema:
            values = [*values, schema["const"]]
        types = {_json_type(value) for value in values}
    return frozenset(types)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {dict: "object", list: "array"}.get(type(value), "string")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _to_json(text: str, types: frozenset[str]) -> str:
    """A non-string parameter value as JSON text of the first type it converts to, else a JSON string."""
    stripped = text.strip()
    lowered = stripped.lower()
    if "null" in types and lowered in ("null", "none"):
        return "null"
    if "boolean" in types and lowered in ("true", "false"):
        return lowered
    if "integer" in types or "number" in types:
        try:
            return json.dumps(int(stripped))
        except ValueError:
            pass
        try:
            number = float(stripped)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            if "number" in types:
                return json.dumps(number)
            if number.is_integer():
                return json.dumps(int(number))
    if "object" in types or "array" in types:
        try:
            value = json.loads(stripped, parse_constant=_reject_constant)
        except ValueError:
            value = None
        if (isinstance(value, dict) and "object" in types) or (isinstance(value, list) and "array" in types):
            return json.dumps(value, ensure_ascii=False)
    return json.dumps(text, ensure_ascii=False)
