"""Splits the model's output text into reasoning, content and tool calls, incrementally.

(Contract only: the parser itself is being written; the event types below are fixed.)
"""

from __future__ import annotations

import dataclasses


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
