"""The incremental output parser: reasoning, content and tool calls from Qwen3.6 output text."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

from gateway.output_parser import (
    ContentDelta,
    OutputParser,
    ParserEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, OTHER]

WEATHER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
OTHER_CALL = "<tool_call>\n<function=other>\n</function>\n</tool_call>"
FULL_STREAM = (
    "Let me check <tool_call> here.\nFirst step.\n</think>\n\nSome text first.\n\n" + WEATHER_CALL + "\n" + OTHER_CALL
)


def fixed_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(chunks: Iterable[str], **options: Any) -> tuple[OutputParser, list[ParserEvent]]:
    parser = OutputParser(new_call_id=fixed_ids(), **options)
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    events += parser.finish()
    check_consistent(parser, events)
    return parser, events


def check_consistent(parser: OutputParser, events: Sequence[ParserEvent]) -> None:
    """The events add up to the accumulated results; each call's deltas are its valid JSON arguments."""
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == parser.reasoning
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == parser.content
    assert all(e.text for e in events if isinstance(e, ReasoningDelta | ContentDelta))
    for index, call in enumerate(parser.tool_calls):
        mine = [e for e in events if not isinstance(e, ReasoningDelta | ContentDelta) and e.index == index]
        assert isinstance(mine[0], ToolCallStart) and isinstance(mine[-1], ToolCallEnd)
        assert (mine[0].id, mine[0].name) == (call["id"], call["function"]["name"])
        deltas = mine[1:-1]
        assert all(isinstance(e, ToolCallDelta) and e.arguments for e in deltas)
        arguments = "".join(e.arguments for e in deltas if isinstance(e, ToolCallDelta))
        assert arguments == mine[-1].arguments == call["function"]["arguments"]
        assert isinstance(json.loads(arguments), dict)
    assert sum(isinstance(e, ToolCallStart) for e in events) == len(parser.tool_calls)


def final_state(parser: OutputParser) -> tuple[str, str, list[dict[str, Any]]]:
    return parser.reasoning, parser.content, parser.tool_calls


def arguments(parser: OutputParser, index: int = 0) -> Any:
    return json.loads(parser.tool_calls[index]["function"]["arguments"])


def call_with(key: str, value: str, schema: dict[str, Any]) -> tuple[OutputParser, list[ParserEvent]]:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": {key: schema}}}}
    return run(
        [f"<tool_call>\n<function=f>\n<parameter={key}>\n{value}\n</parameter>\n</function>\n</tool_call>"],
        tools=[tool],
    )


def test_text_then_call() -> None:
    parser, events = run(["Some text first.\n\n" + WEATHER_CALL], tools=TOOLS)
    assert parser.content == "Some text first."
    assert parser.tool_calls == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
        }
    ]
    assert events[0] == ContentDelta("Some text first.")
    assert events[1] == ToolCallStart(0, "call_0", "get_weather")
    assert events[-1] == ToolCallEnd(0, '{"city": "Paris", "days": 3}')


def test_two_calls() -> None:
    parser, events = run([WEATHER_CALL + "\n" + OTHER_CALL], tools=TOOLS)
    assert parser.content == ""
    assert [c["id"] for c in parser.tool_calls] == ["call_0", "call_1"]
    assert [c["function"]["name"] for c in parser.tool_calls] == ["get_weather", "other"]
    assert arguments(parser, 1) == {}
    assert [e.index for e in events if isinstance(e, ToolCallEnd)] == [0, 1]


def test_reference_stream() -> None:
    parser, _ = run([FULL_STREAM], tools=TOOLS, starts_in_reasoning=True)
    assert parser.reasoning == "Let me check <tool_call> here.\nFirst step."
    assert parser.content == "Some text first."
    assert [arguments(parser, 0), arguments(parser, 1)] == [{"city": "Paris", "days": 3}, {}]


def test_split_in_two_at_every_index_gives_the_same_result() -> None:
    whole, _ = run([FULL_STREAM], tools=TOOLS, starts_in_reasoning=True)
    for at in range(len(FULL_STREAM) + 1):
        parser, _ = run([FULL_STREAM[:at], FULL_STREAM[at:]], tools=TOOLS, starts_in_reasoning=True)
        assert final_state(parser) == final_state(whole), at


def test_one_character_at_a_time_gives_the_same_result() -> None:
    whole, _ = run([FULL_STREAM], tools=TOOLS, starts_in_reasoning=True)
    parser, events = run(FULL_STREAM, tools=TOOLS, starts_in_reasoning=True)
    assert final_state(parser) == final_state(whole)
    # The string value streamed before its parameter closed: "Paris" came in pieces.
    chunks = [e.arguments for e in events if isinstance(e, ToolCallDelta) and e.index == 0]
    assert "P" in chunks and "s" in chunks


def test_string_value_streams_before_parameter_closes() -> None:
    parser = OutputParser(tools=TOOLS, new_call_id=fixed_ids())
    events = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert events == [ToolCallStart(0, "call_0", "get_weather"), ToolCallDelta(0, '{"city": "Par')]
    assert parser.feed("is\n") == [ToolCallDelta(0, "is")]  # the "\n" may start "\n</parameter>"
    assert parser.feed("</parameter>\n") == [ToolCallDelta(0, '"')]


def test_emoji_and_chinese_in_text_and_values() -> None:
    stream = (
        "天气如何？🌧\n<tool_call>\n<function=get_weather>\n<parameter=city>\n北京 🏙\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    for chunks in ([stream], list(stream)):
        parser, _ = run(chunks, tools=TOOLS)
        assert parser.content == "天气如何？🌧"
        assert arguments(parser) == {"city": "北京 🏙"}
        assert "北京" in parser.tool_calls[0]["function"]["arguments"]  # not \u-escaped


def test_special_characters_in_string_value_are_escaped() -> None:
    parser, _ = call_with("code", 'say "hi"\\n\n\tend', {"type": "string"})
    assert arguments(parser) == {"code": 'say "hi"\\n\n\tend'}


def test_malformed_call_is_kept_as_content() -> None:
    stream = "Hi\n<tool_call>\nnot a function</tool_call> bye"
    for chunks in ([stream], list(stream)):
        parser, events = run(chunks, tools=TOOLS)
        assert parser.content == stream
        assert parser.tool_calls == []
        assert not any(isinstance(e, ToolCallStart) for e in events)


def test_parsing_continues_after_a_malformed_call() -> None:
    parser, _ = run(["<tool_call><function=bad name>\n" + OTHER_CALL], tools=TOOLS)
    assert parser.content == "<tool_call><function=bad name>"
    assert [c["function"]["name"] for c in parser.tool_calls] == ["other"]


def test_incomplete_markup_at_the_end_is_content() -> None:
    parser, _ = run(["Done. <tool_ca"], tools=TOOLS)
    assert parser.content == "Done. <tool_ca"


def test_cut_off_in_reasoning_is_all_reasoning() -> None:
    stream = "Thinking about it\n<tool_call>\n<function=other>\n</think"
    for chunks in ([stream], list(stream)):
        parser, _ = run(chunks, tools=TOOLS, starts_in_reasoning=True)
        assert parser.reasoning == stream
        assert parser.content == ""
        assert parser.tool_calls == []
        assert parser.in_reasoning


def test_tool_call_markup_inside_think_is_reasoning() -> None:
    parser, _ = run([WEATHER_CALL + "\n</think>\n\nNo call."], tools=TOOLS, starts_in_reasoning=True)
    assert parser.reasoning == WEATHER_CALL
    assert parser.content == "No call."
    assert parser.tool_calls == []


def test_in_reasoning_follows_the_think_block() -> None:
    parser = OutputParser(starts_in_reasoning=True)
    assert parser.in_reasoning
    parser.feed("step\n</thi")
    assert parser.in_reasoning
    parser.feed("nk>\n\nAnswer")
    assert not parser.in_reasoning


def test_thinking_disabled_output_is_content() -> None:
    parser, events = run(["The answer", " is 4.\n"])
    assert parser.reasoning == ""
    assert parser.content == "The answer is 4.\n"
    assert events == [ContentDelta("The answer"), ContentDelta(" is 4.\n")]


def test_model_emitted_think_opens_reasoning() -> None:
    stream = "\n<think>\nstep one\n</think>\n\nThe answer"
    for chunks in ([stream], list(stream)):
        parser, _ = run(chunks)
        assert (parser.reasoning, parser.content) == ("step one", "The answer")


def test_think_after_content_is_content() -> None:
    parser, _ = run(["Text <think>x"])
    assert parser.content == "Text <think>x"


def test_stray_think_close_in_content_is_dropped() -> None:
    parser, _ = run(["Answer</think> more"])
    assert parser.content == "Answer more"


def test_no_tools_leaves_call_markup_as_content() -> None:
    for tools in (None, []):
        parser, _ = run(["Text\n\n" + WEATHER_CALL], tools=tools)
        assert parser.content == "Text\n\n" + WEATHER_CALL
        assert parser.tool_calls == []


def test_text_after_the_last_call_is_content() -> None:
    parser, _ = run([OTHER_CALL + "\n\nAfter."], tools=TOOLS)
    assert parser.content == "After."
    assert len(parser.tool_calls) == 1


@pytest.mark.parametrize(
    ("schema", "value", "expected"),
    [
        ({"type": "string"}, "3", "3"),
        ({"type": "integer"}, "3", 3),
        ({"type": "integer"}, "3.0", 3),
        ({"type": "number"}, "2.5", 2.5),
        ({"type": "number"}, "7", 7),
        ({"type": "boolean"}, "True", True),
        ({"type": "boolean"}, "false", False),
        ({"type": "null"}, "null", None),
        ({"type": "string", "enum": ["c", "f"]}, "c", "c"),
        ({"enum": [1, 2]}, "2", 2),
        ({"type": "object"}, '{"a": [1, "x"]}', {"a": [1, "x"]}),
        ({"type": "array"}, "[1, 2]", [1, 2]),
        ({"type": ["integer", "null"]}, "null", None),
        ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", True),
        ({"type": ["string", "integer"]}, "5", "5"),
        ({}, "5", "5"),
    ],
    ids=lambda v: json.dumps(v) if not isinstance(v, str) else v,
)
def test_value_takes_the_schema_type(schema: dict[str, Any], value: str, expected: Any) -> None:
    parser, _ = call_with("k", value, schema)
    assert arguments(parser) == {"k": expected}
    assert type(arguments(parser)["k"]) is type(expected)


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        ({"type": "integer"}, "abc"),
        ({"type": "number"}, "NaN"),
        ({"type": "boolean"}, "yes"),
        ({"type": "object"}, "[1]"),
        ({"type": "array"}, "[1,"),
        ({"type": "object"}, '{"a": NaN}'),
    ],
    ids=lambda v: json.dumps(v) if not isinstance(v, str) else v,
)
def test_failed_conversion_falls_back_to_the_raw_string(schema: dict[str, Any], value: str) -> None:
    parser, _ = call_with("k", value, schema)
    assert arguments(parser) == {"k": value}


def test_non_string_value_is_emitted_when_its_parameter_closes() -> None:
    parser = OutputParser(tools=TOOLS, new_call_id=fixed_ids())
    parser.feed("<tool_call>\n<function=get_weather>\n<parameter=days>\n1")
    assert parser.feed("2\n") == []
    assert parser.feed("</parameter>") == [ToolCallDelta(0, "12")]


def test_unknown_tool_values_are_strings() -> None:
    parser, _ = run(
        ["<tool_call>\n<function=mystery>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"], tools=TOOLS
    )
    assert parser.tool_calls[0]["function"]["name"] == "mystery"
    assert arguments(parser) == {"n": "3"}


def test_missing_closing_tags_are_tolerated() -> None:
    stream = "<tool_call><function=get_weather><parameter=city>Rome<parameter=days>2</tool_call>"
    parser, _ = run([stream], tools=TOOLS)
    assert arguments(parser) == {"city": "Rome", "days": 2}


def test_missing_tool_call_close_ends_the_call() -> None:
    parser, _ = run([OTHER_CALL.removesuffix("</tool_call>") + "After."], tools=TOOLS)
    assert arguments(parser) == {}
    assert parser.content == "After."


def test_stray_text_between_parameters_is_dropped() -> None:
    stream = (
        "<tool_call>\n<function=get_weather>\nnoise\n<parameter=city>\nOslo\n</parameter>\n"
        "more</function>\n</tool_call>"
    )
    parser, _ = run([stream], tools=TOOLS)
    assert arguments(parser) == {"city": "Oslo"}
    assert parser.content == ""


def test_repeated_parameter_keeps_the_first_value() -> None:
    stream = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=city>\nBergen\n</parameter>\n</function>\n</tool_call>"
    )
    parser, _ = run([stream], tools=TOOLS)
    assert parser.tool_calls[0]["function"]["arguments"] == '{"city": "Oslo"}'


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ("<parameter=city>\nLis", {"city": "Lis"}),
        ("<parameter=days>\n4", {"days": 4}),
        ("<parameter=city>\nLisbon\n</param", {"city": "Lisbon"}),
        ("<parameter=city>\nLisbon\n</parameter>\n<param", {"city": "Lisbon"}),
        ("<parameter=city>\nLisbon\n</parameter>\n</function>\n</tool", {"city": "Lisbon"}),
        ("", {}),
    ],
)
def test_end_inside_an_open_call_closes_it(tail: str, expected: dict[str, Any]) -> None:
    stream = "<tool_call>\n<function=get_weather>\n" + tail
    for chunks in ([stream], list(stream)):
        parser, events = run(chunks, tools=TOOLS)
        assert arguments(parser) == expected
        assert isinstance(events[-1], ToolCallEnd)
        assert parser.content == ""


def test_default_call_ids_are_random_and_openai_shaped() -> None:
    first, second = new_call_id(), new_call_id()
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", first)
    assert first != second
    parser = OutputParser(tools=TOOLS)
    parser.feed(OTHER_CALL)
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", parser.tool_calls[0]["id"])


def test_feed_after_finish_is_an_error() -> None:
    parser = OutputParser()
    parser.finish()
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("more")
