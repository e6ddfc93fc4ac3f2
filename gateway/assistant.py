"""The assistant turn being generated: the worker's outputs through the output parser.

Shared by chat completions and the Responses API. Wraps `OutputParser` with what both need on
top: counting reasoning tokens (the tokens of a step that began inside `<think>`), honouring
`parallel_tool_calls: false` when the model was free to call (only the first call is kept: a
forced call is already limited to one by the grammar), and the final chat message.
"""

from __future__ import annotations

from typing import Any

from gateway.agentic import OutputPlan
from gateway.output_parser import (
    ContentDelta,
    OutputParser,
    ParserEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from worker.engine.types import FinishReason, StepOutput


class AssistantTurn:
    def __init__(self, plan: OutputPlan) -> None:
        self._parser = OutputParser(tools=list(plan.tools) if plan.parse_tools else None,
                                    starts_in_reasoning=plan.thinking)
        self._single_call = not plan.parallel_tool_calls
        self.reasoning_tokens = 0
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []  # OpenAI chat shape, in order

    def push(self, out: StepOutput) -> list[ParserEvent]:
        """The parser events of one output (all of them flushed when it is the last)."""
        if out.token_ids and self._parser.in_reasoning:
            self.reasoning_tokens += len(out.token_ids)
        events = self._parser.feed(out.text) if out.text else []
        if out.finished:
            events += self._parser.finish()
        kept = [ev for ev in events if self._keep(ev)]
        for ev in kept:
            self._record(ev)
        return kept

    def _keep(self, ev: ParserEvent) -> bool:
        if self._single_call and isinstance(ev, ToolCallStart | ToolCallDelta | ToolCallEnd):
            return ev.index == 0
        return True

    def _record(self, ev: ParserEvent) -> None:
        if isinstance(ev, ReasoningDelta):
            self.reasoning.append(ev.text)
        elif isinstance(ev, ContentDelta):
            self.content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            self.tool_calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
        elif isinstance(ev, ToolCallEnd):
            self.tool_calls[ev.index]["function"]["arguments"] = ev.arguments

    def finish_reason(self, reason: FinishReason | None) -> str | None:
        if reason is FinishReason.STOP and self.tool_calls:
            return "tool_calls"
        if reason is None:
            return None
        return "length" if reason is FinishReason.LENGTH else "stop"

    def message(self) -> dict[str, Any]:
        """The whole assistant message (chat completions' `choices[0].message`)."""
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.tool_calls else None,
                               "refusal": None}
        reasoning = "".join(self.reasoning)
        if reasoning:
            msg["reasoning_content"] = reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    @staticmethod
    def chat_delta(ev: ParserEvent) -> dict[str, Any] | None:
        """The chat.completion.chunk delta of one event (None: nothing to send)."""
        if isinstance(ev, ReasoningDelta):
            return {"reasoning_content": ev.text}
        if isinstance(ev, ContentDelta):
            return {"content": ev.text}
        if isinstance(ev, ToolCallStart):
            return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                    "function": {"name": ev.name, "arguments": ""}}]}
        if isinstance(ev, ToolCallDelta):
            return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.arguments}}]}
        return None
