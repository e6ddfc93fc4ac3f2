"""Tools, reasoning, structured outputs and prefix reuse through a real `iq36 serve` on dev-tiny,
with the official `openai` SDK (issue #5's acceptance).

The model has random weights: it never closes a `<think>` block on its own and never calls a
tool unless forced, so forced calls and structured outputs run with thinking off, and every
schema is bounded (maxLength, minimum/maximum, enums, maxItems) so a grammar must terminate.
The profile is the f32 reference mode, where greedy output with and without prefix reuse must
be identical.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.gateway_server import MODEL, GatewayServer
from tests.helpers import WEATHER_SCHEMA

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                            "parameters": WEATHER_SCHEMA}}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
               "required": ["zone"], "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]
MARKUP = ("<tool_call>", "</tool_call>", "<function=", "<parameter=", "<think>", "</think>")


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[GatewayServer]:
    with tempfile.TemporaryDirectory(prefix="iq36-") as d:  # short: unix socket paths are limited
        with GatewayServer(Path(d) / "state", tiny_dir, "--profile", "cpu-f32") as srv:
            yield srv


@pytest.fixture
def client(server: GatewayServer) -> openai.OpenAI:
    return server.openai(timeout=120)


def _no_markup(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


def _check_calls(calls: list[tuple[str, str]], schemas: dict[str, dict[str, Any]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


def test_required_tool_call_arrives_as_tool_calls(client: openai.OpenAI) -> None:
    for seed in (1, 2, 3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type]
                                           parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200,
                                           extra_body=NO_THINK)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        _check_calls([(c.function.name, c.function.arguments) for c in calls], {"get_weather": WEATHER_SCHEMA})
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
        _no_markup(choice.message.content)


def test_parallel_required_calls_are_each_complete(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type]
                                       temperature=1.0, seed=1, max_tokens=400, extra_body=NO_THINK)
    choice = r.choices[0]
    calls = choice.message.tool_calls or []
    assert len({c.id for c in calls}) == len(calls) >= 1
    # The random model keeps choosing "another call" over the end: a call cut off by max_tokens
    # is reported as it came (finish_reason "length"); every finished call is valid.
    done = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    assert choice.finish_reason in ("tool_calls", "length")
    _check_calls([(c.function.name, c.function.arguments) for c in done], {"get_weather": WEATHER_SCHEMA})
    _no_markup(choice.message.content)


def test_required_tool_call_streams_as_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type]
                                            parallel_tool_calls=False, temperature=1.0, seed=7, max_tokens=200,
                                            stream=True, extra_body=NO_THINK)
    calls: dict[int, dict[str, str]] = {}
    content: list[str] = []
    finish = []
    with stream:
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    assert not call["id"], "the id arrives once"
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            if chunk.choices[0].finish_reason:
                finish.append(chunk.choices[0].finish_reason)
    assert finish == ["tool_calls"]
    assert all(c["id"].startswith("call_") for c in calls.values())
    _check_calls([(c["name"], c["arguments"]) for c in calls.values()], {"get_weather": WEATHER_SCHEMA})
    _no_markup("".join(content))


def test_named_tool_choice_calls_that_tool_once_without_parallel_calls(client: openai.OpenAI) -> None:
    for seed in (11, 12):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],  # type: ignore[arg-type]
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=100,
                                           extra_body=NO_THINK)
        calls = r.choices[0].message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name == "get_time"
        _check_calls([(calls[0].function.name, calls[0].function.arguments)], {"get_time": TIME_SCHEMA})


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                                               "maxItems": 3},
                                      "level": {"type": "string", "enum": ["low", "high"]}},
     "required": ["ok", "tags", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
]


def test_json_schema_output_validates_every_time(client: openai.OpenAI) -> None:
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        for seed in (1, 2, 3):
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Fill it in."}],
                                               response_format=fmt, temperature=1.0, seed=seed,  # type: ignore[arg-type]
                                               max_tokens=300, extra_body=NO_THINK)
            assert r.choices[0].finish_reason == "stop", (schema, seed, r.choices[0].message.content)
            jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)


def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please."}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=300,
                                       extra_body=NO_THINK)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    else:  # an unbounded object may run out of tokens; what came is still a JSON prefix, never markup
        assert (r.choices[0].message.content or "").lstrip().startswith("{")


def test_reasoning_cut_off_stays_reasoning(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,  # type: ignore[arg-type]
                                       max_tokens=12)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    extra = choice.message.model_extra or {}
    assert extra.get("reasoning_content")
    assert not choice.message.content and not choice.message.tool_calls
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == 12


def test_reasoning_streams_as_reasoning_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    reasoning, content = [], []
    with stream:
        for chunk in stream:
            if chunk.choices:
                reasoning.append((chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or "")
                content.append(chunk.choices[0].delta.content or "")
    whole = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    assert "".join(reasoning) == (whole.choices[0].message.model_extra or {}).get("reasoning_content")
    assert not "".join(content)


def test_tool_history_renders_through_the_template(client: openai.OpenAI) -> None:
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Paris", "days": 3, "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'}]
    short = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1)  # type: ignore[arg-type]
    long = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=1)  # type: ignore[arg-type]
    assert long.usage is not None and short.usage is not None
    assert long.usage.prompt_tokens > short.usage.prompt_tokens + 20


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_agentic_fields_are_400_naming_the_param(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**body)
    err = exc.value.body
    assert isinstance(err, dict) and err["param"] == param, err


def test_second_turn_reuses_the_first_turns_state(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type]
                                           temperature=0, max_tokens=200, extra_body=NO_THINK)
    calls = first.choices[0].message.tool_calls or []
    assert calls and first.usage is not None
    turn2 = [*ASK,
             {"role": "assistant", "content": None,
              "tool_calls": [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in calls]},
             *[{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]]
    reused = client.chat.completions.create(model=MODEL, messages=turn2, tools=[WEATHER], temperature=0,  # type: ignore[arg-type]
                                            max_tokens=24, extra_body=NO_THINK)
    fresh = client.chat.completions.create(model=MODEL, messages=turn2, tools=[WEATHER], temperature=0,  # type: ignore[arg-type]
                                           max_tokens=24, extra_body={**NO_THINK, "cache_prompt": False})
    assert reused.usage is not None and fresh.usage is not None
    assert reused.usage.prompt_tokens_details is not None and fresh.usage.prompt_tokens_details is not None
    assert reused.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert _said(reused) == _said(fresh)  # f32 reference mode: identical greedy output


def _said(r: Any) -> tuple[Any, ...]:
    """What a chat completion said, without its random call ids."""
    m = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return m.content, (m.model_extra or {}).get("reasoning_content"), calls, r.choices[0].finish_reason
