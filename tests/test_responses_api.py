"""The Responses API protocol in-process: the field policy, Responses -> chat conversions (input
items, tools, tool_choice, text format) and the output side (response object, SSE event sequence),
checked against the official `openai` SDK's types and its stream accumulator."""

from __future__ import annotations

import json
import typing
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsBase

from gateway.errors import APIError
from gateway.output_parser import ContentDelta, ParserEvent, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from gateway.responses_output import ResponseMeta, ResponseStreamBuilder, deleted_object, sse_event, usage
from gateway.responses_request import (
    FIELD_POLICY,
    ResponsesRequest,
    chat_fields,
    input_messages,
    parse_request,
    responses_param,
    stored_context,
    to_chat_tool_choice,
    to_chat_tools,
)
from worker.engine.types import FinishReason

_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)

_WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}
_TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}, "strict": None}

# Reasoning, then text, then two tool calls: what Qwen3.6 emits for a tool-using turn.
_SCRIPT: list[ParserEvent] = [
    ReasoningDelta("The user wants "), ReasoningDelta("the weather."),
    ContentDelta("Let me "), ContentDelta(""), ContentDelta("check."),
    ToolCallStart(0, "call_a", "get_weather"), ToolCallDelta(0, '{"city": '), ToolCallDelta(0, '"Paris"}'),
    ToolCallEnd(0, '{"city": "Paris"}'),
    ToolCallStart(1, "call_b", "get_time"), ToolCallDelta(1, "{}"), ToolCallEnd(1, "{}"),
]


def _req(**fields: Any) -> ResponsesRequest:
    return parse_request(json.dumps({"model": "m", "input": "hi", **fields}).encode())


def _error(call: typing.Callable[[], object]) -> APIError:
    with pytest.raises(APIError) as exc:
        call()
    return exc.value


# OpenAI's response objects carry `store`, which the SDK's `Response` model does not declare.
_WIRE_ONLY: dict[type[pydantic.BaseModel], set[str]] = {Response: {"store"}}


def _no_extras(value: Any, path: str = "$") -> None:
    """The SDK's models accept unknown keys; ours must not send any."""
    if isinstance(value, pydantic.BaseModel):
        extra = set(value.model_extra or ()) - _WIRE_ONLY.get(type(value), set())
        assert not extra, f"{path}: fields the SDK does not declare: {sorted(extra)}"
        for name in type(value).model_fields:
            _no_extras(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_extras(v, f"{path}[{i}]")


def _run(events: list[ParserEvent], reason: FinishReason | None = FinishReason.STOP,
         error: APIError | None = None, **fields: Any) -> tuple[ResponseStreamBuilder, list[dict[str, Any]]]:
    builder = ResponseStreamBuilder(ResponseMeta.from_request(_req(tools=[_WEATHER, _TIME], **fields)))
    out = builder.start()
    for ev in events:
        out += builder.feed(ev)
    use = usage(10, 20, cached_tokens=4, reasoning_tokens=5)
    out += builder.fail(error, use) if error is not None else builder.finish(reason, use)
    return builder, out


def _check_stream(out: list[dict[str, Any]]) -> None:
    """Every event is an SDK event with nothing undeclared; numbering and ids are consistent."""
    assert [ev["sequence_number"] for ev in out] == list(range(len(out)))
    items: dict[int, str] = {}
    for ev in out:
        _no_extras(_EVENT.validate_python(ev))
        if ev["type"] == "response.output_item.added":
            assert ev["output_index"] == len(items), "output items are added in order"
            items[ev["output_index"]] = ev["item"]["id"]
        elif "output_index" in ev:
            item_id = ev["item"]["id"] if "item" in ev else ev["item_id"]
            assert items[ev["output_index"]] == item_id
        if "content_index" in ev:
            assert ev["content_index"] == 0


# --- the stream ----------------------------------------------------------------------------------


def test_a_tool_using_turn_streams_the_full_event_sequence() -> None:
    builder, out = _run(_SCRIPT)
    _check_stream(out)
    item_events = ["response.output_item.added", "response.content_part.added"]
    assert [ev["type"] for ev in out] == [
        "response.created", "response.in_progress",
        *item_events, "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        *item_events, "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []
    assert out[-1]["response"] is builder.response


def test_the_final_response_is_an_sdk_response_with_the_right_output() -> None:
    builder, out = _run(_SCRIPT)
    response = Response.model_validate(builder.response)
    _no_extras(response)
    assert response.status == "completed" and response.error is None and response.incomplete_details is None
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content is not None
    assert response.output[0].content[0].text == "The user wants the weather."
    assert response.output_text == "Let me check."
    calls = [(c.call_id, c.name, c.arguments, c.status) for c in response.output if c.type == "function_call"]
    assert calls == [("call_a", "get_weather", '{"city": "Paris"}', "completed"), ("call_b", "get_time", "{}",
                                                                                    "completed")]
    assert [item.id[:3] for item in response.output] == ["rs_", "msg", "fc_", "fc_"]
    assert response.id.startswith("resp_") and response.id == out[0]["response"]["id"]
    assert response.usage is not None and response.usage.total_tokens == 30
    assert response.usage.output_tokens_details.reasoning_tokens == 5
    assert response.usage.input_tokens_details.cached_tokens == 4
    done = [ev["item"] for ev in out if ev["type"] == "response.output_item.done"]
    assert done == builder.response["output"]


def test_the_sdk_stream_accumulator_rebuilds_the_same_response() -> None:
    builder, out = _run(_SCRIPT)
    body = b"".join(sse_event(ev) for ev in out)
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    with httpx.Client(transport=transport) as http:
        client = openai.OpenAI(api_key="k", base_url="http://test/v1", http_client=http)
        with client.responses.stream(model="m", input="hi") as stream:
            seen = [ev.type for ev in stream]
            final = stream.get_final_response()
    assert seen == [ev["type"] for ev in out]
    assert final.output_text == "Let me check."
    assert final.model_dump(mode="json", exclude_none=True) == Response.model_validate(
        builder.response).model_dump(mode="json", exclude_none=True)


def test_sse_event_frames_the_type_and_the_json() -> None:
    ev = {"type": "response.output_text.delta", "sequence_number": 3, "delta": "é"}
    frame = sse_event(ev)
    assert frame.startswith(b"event: response.output_text.delta\ndata: ") and frame.endswith(b"\n\n")
    assert json.loads(frame.split(b"data: ", 1)[1]) == ev


def test_hitting_max_output_tokens_ends_incomplete() -> None:
    builder, out = _run([ReasoningDelta("hmm"), ContentDelta("It is")], FinishReason.LENGTH)
    _check_stream(out)
    assert out[-1]["type"] == "response.incomplete"
    response = Response.model_validate(builder.response)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in response.output] == ["completed", "incomplete"]
    assert response.output_text == "It is"


def test_a_tool_call_cut_by_the_cap_is_incomplete_with_partial_arguments() -> None:
    builder, out = _run([ToolCallStart(0, "call_a", "get_weather"), ToolCallDelta(0, '{"ci')], FinishReason.LENGTH)
    _check_stream(out)
    item = builder.response["output"][0]
    assert (item["status"], item["arguments"]) == ("incomplete", '{"ci')


def test_a_failure_mid_stream_ends_with_response_failed() -> None:
    lost = APIError("worker_lost", "the worker died", retry_after=5)
    builder, out = _run([ContentDelta("Hel")], error=lost)
    _check_stream(out)
    assert [ev["type"] for ev in out[-3:]] == ["response.content_part.done", "response.output_item.done",
                                               "response.failed"]
    response = Response.model_validate(builder.response)
    assert response.status == "failed" and response.usage is not None
    assert response.error is not None
    assert (response.error.code, response.error.type, response.error.message) == ("server_error", "worker_lost",
                                                                                  "the worker died")
    assert response.output[0].status == "incomplete"


def test_a_failure_before_any_output() -> None:
    builder, out = _run([], error=APIError("context_length_exceeded", "too long", param="input"))
    _check_stream(out)
    assert [ev["type"] for ev in out] == ["response.created", "response.in_progress", "response.failed"]
    error = builder.response["error"]
    assert (error["code"], error["param"]) == ("invalid_prompt", "input")


def test_a_plain_answer_without_start_builds_the_non_streaming_body() -> None:
    builder = ResponseStreamBuilder(ResponseMeta.from_request(_req(), id_="resp_x", created_at=7))
    builder.feed(ContentDelta("Hi!"))
    builder.finish(FinishReason.STOP, usage(1, 2))
    response = Response.model_validate(builder.response)
    assert (response.id, response.created_at, response.output_text) == ("resp_x", 7, "Hi!")
    assert response.completed_at is not None and response.tools == [] and response.tool_choice == "auto"


def test_the_builder_refuses_misuse() -> None:
    builder = ResponseStreamBuilder(ResponseMeta.from_request(_req()))
    builder.start()
    with pytest.raises(ValueError, match="not the open output item"):
        builder.feed(ToolCallDelta(0, "{}"))
    with pytest.raises(ValueError, match="fail"):
        builder.finish(FinishReason.ABORT, None)
    builder.finish(FinishReason.STOP, None)
    with pytest.raises(RuntimeError, match="already finished"):
        builder.feed(ContentDelta("late"))
    with pytest.raises(RuntimeError, match="already finished"):
        builder.fail(APIError("internal_error", "x"))


def test_the_response_echoes_the_request() -> None:
    req = _req(instructions="be brief", metadata={"k": "v"}, store=False, temperature=0.2, max_output_tokens=64,
               previous_response_id="resp_prev", tool_choice={"type": "function", "name": "get_weather"},
               tools=[_WEATHER], parallel_tool_calls=False, user="u",
               text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
               reasoning={"effort": "low", "summary": "auto"})
    builder = ResponseStreamBuilder(ResponseMeta.from_request(req, top_p=0.95))
    builder.finish(FinishReason.STOP, usage(1, 1))
    response = Response.model_validate(builder.response)
    _no_extras(response)
    assert (response.instructions, response.metadata, response.store, response.temperature, response.top_p) == (
        "be brief", {"k": "v"}, False, 0.2, 0.95)
    assert (response.max_output_tokens, response.previous_response_id, response.parallel_tool_calls) == (
        64, "resp_prev", False)
    assert response.tools[0].type == "function" and response.tools[0].name == "get_weather"
    assert response.tool_choice.type == "function"  # type: ignore[union-attr]
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    assert response.reasoning is not None and response.reasoning.effort == "low"


def test_the_deletion_object() -> None:
    assert deleted_object("resp_1") == {"id": "resp_1", "object": "response.deleted", "deleted": True}


# --- input -> chat messages ------------------------------------------------------------------


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert input_messages(_req(instructions="be brief"), None) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_chaining_puts_the_previous_context_between_instructions_and_input() -> None:
    previous = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert input_messages(_req(instructions="sys", input="c"), previous) == [
        {"role": "system", "content": "sys"}, *previous, {"role": "user", "content": "c"}]


def test_message_items_with_and_without_type_and_parts() -> None:
    req = _req(input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]},
    ])
    assert input_messages(req, None) == [{"role": "developer", "content": "rules"}, {"role": "user", "content": "ab"},
                                         {"role": "assistant", "content": "c"}]


def test_function_calls_join_their_assistant_turn_and_outputs_become_tool_messages() -> None:
    req = _req(input=[
        {"role": "user", "content": "weather and time?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "noon"}]},
    ])
    assert input_messages(req, None)[1:] == [
        {"role": "assistant", "content": "Checking.", "reasoning_content": "think", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
    ]


def test_a_function_call_without_a_preceding_assistant_message_opens_one() -> None:
    req = _req(input=[{"role": "user", "content": "x"},
                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}])
    assert input_messages(req, None)[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_reasoning_before_a_non_assistant_item_is_dropped() -> None:
    req = _req(input=[{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
                      {"role": "user", "content": "x"}])
    assert input_messages(req, None) == [{"role": "user", "content": "x"}]


def test_sdk_output_items_round_trip_as_input() -> None:
    builder, _ = _run(_SCRIPT)
    output = Response.model_validate(builder.response).output
    items = [item.model_dump(mode="json", exclude_none=True, by_alias=True) for item in output]
    messages = input_messages(_req(input=items), None)
    assert len(messages) == 1
    assert messages[0]["content"] == "Let me check."
    assert messages[0]["reasoning_content"] == "The user wants the weather."
    assert [c["id"] for c in messages[0]["tool_calls"]] == ["call_a", "call_b"]


def test_the_stored_context_has_the_output_but_not_the_instructions() -> None:
    builder, _ = _run([ReasoningDelta("r"), ContentDelta("answer")])
    req = _req(instructions="sys", input="q")
    previous = [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}]
    assert stored_context(req, previous, builder.response) == [
        *previous, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "answer", "reasoning_content": "r"}]


def test_a_reasoning_only_output_is_kept_as_an_assistant_turn() -> None:
    builder, _ = _run([ReasoningDelta("still thinking")], FinishReason.LENGTH)
    assert stored_context(_req(), None, builder.response)[-1] == {
        "role": "assistant", "content": "", "reasoning_content": "still thinking"}


@pytest.mark.parametrize(("item", "code", "param"), [
    ({"role": "user", "content": [{"type": "input_text", "text": "a"},
                                  {"type": "input_image", "image_url": "http://x/y.png"}]},
     "unsupported_content_type", "input[0].content[1]"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "unsupported_content_type",
     "input[0].content[0]"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "u"}]},
     "unsupported_content_type", "input[0].output[0]"),
    ({"type": "item_reference", "id": "msg_1"}, "unsupported_parameter", "input[0]"),
    ({"type": "web_search_call", "id": "ws", "status": "completed"}, "unsupported_parameter", "input[0].type"),
    ({"role": "user", "content": "x", "colour": "red"}, "unknown_parameter", "input[0].colour"),
    ({"role": "robot", "content": "x"}, "invalid_request", "input[0].role"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "invalid_request", "input[0]"),
    ({"type": "function_call_output", "call_id": "c", "output": 3}, "invalid_request", "input[0].output"),
    ("just a string", "invalid_request", "input[0]"),
])
def test_bad_input_items_are_400s_naming_the_item(item: Any, code: str, param: str) -> None:
    req = _req(input=[item])
    err = _error(lambda: input_messages(req, None))
    assert (err.code, err.param) == (code, param)


# --- tools, tool_choice, text format ------------------------------------------------------


def test_function_tools_convert_to_chat_shape() -> None:
    assert to_chat_tools([_WEATHER, _TIME]) == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                          "parameters": _WEATHER["parameters"], "strict": True}},
        {"type": "function", "function": {"name": "get_time", "parameters": _TIME["parameters"]}}]
    assert to_chat_tools(None) is None and to_chat_tools([]) is None


@pytest.mark.parametrize(("choice", "expected"), [
    (None, None), ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}}),
])
def test_tool_choice_converts_to_chat_shape(choice: Any, expected: Any) -> None:
    tools = to_chat_tools([_WEATHER, _TIME])
    assert to_chat_tool_choice(choice, tools) == (expected, tools)


def test_allowed_tools_narrows_the_tools() -> None:
    tools = to_chat_tools([_WEATHER, _TIME])
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    mode, kept = to_chat_tool_choice(choice, tools)
    assert mode == "required" and kept is not None and [t["function"]["name"] for t in kept] == ["get_time"]


def test_chat_fields_carry_sampling_tools_format_and_thinking() -> None:
    req = _req(max_output_tokens=100, temperature=0.5, top_k=20, seed=3, tools=[_WEATHER], tool_choice="required",
               parallel_tool_calls=False, reasoning={"effort": "none"},
               text={"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}, "strict": True}})
    assert chat_fields(req) == {
        "model": "m", "stream": False, "max_completion_tokens": 100, "temperature": 0.5, "top_k": 20, "seed": 3,
        "tools": to_chat_tools([_WEATHER]), "tool_choice": "required", "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"},
                                                                   "strict": True}},
        "chat_template_kwargs": {"enable_thinking": False}}


def test_explicit_enable_thinking_wins_over_the_reasoning_effort() -> None:
    req = _req(reasoning={"effort": "none"}, chat_template_kwargs={"enable_thinking": True})
    assert chat_fields(req)["chat_template_kwargs"] == {"enable_thinking": True}
    assert "chat_template_kwargs" not in chat_fields(_req(reasoning={"effort": "high"}))
    assert chat_fields(_req(text={"format": {"type": "json_object"}}))["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(("chat", "ours"), [
    ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"), ("tools[1].function.name", "tools[1].name"),
    ("temperature", "temperature"), (None, None)])
def test_chat_side_params_are_renamed_to_responses_names(chat: str | None, ours: str | None) -> None:
    assert responses_param(chat) == ours


# --- the field policy ----------------------------------------------------------------------------


def test_every_sdk_field_is_declared_and_has_a_policy() -> None:
    declared = set(ResponsesRequest.__struct_fields__)
    sdk = set(typing.get_type_hints(ResponseCreateParamsBase)) | {"stream"}
    assert sdk <= declared, f"undeclared OpenAI fields: {sorted(sdk - declared)}"
    assert set(FIELD_POLICY) == declared


def test_a_full_sdk_style_request_is_accepted() -> None:
    req = _req(instructions="x", previous_response_id="resp_1", store=True, metadata={"a": "b"}, tools=[_WEATHER],
               tool_choice="auto", parallel_tool_calls=True, text={"format": {"type": "text"}, "verbosity": "medium"},
               reasoning={"effort": "medium", "summary": "auto", "context": "auto"}, max_output_tokens=32,
               max_tool_calls=3, temperature=1, top_p=1, top_logprobs=0, stream=True,
               stream_options={"include_obfuscation": False}, truncation="disabled",
               include=["reasoning.encrypted_content"], user="u", safety_identifier="s", prompt_cache_key="k",
               prompt_cache_retention="24h", prompt_cache_options={"mode": "implicit"}, service_tier="auto",
               background=False, context_management=[], access_programs={"cyber": "standard"},
               image={"context_compression": "auto"}, top_k=20, min_p=0.0, repetition_penalty=1.0,
               presence_penalty=0.0, frequency_penalty=0.0, seed=1, chat_template_kwargs={})
    assert req.stream and req.store


@pytest.mark.parametrize(("fields", "code", "param"), [
    ({"max_output_token": 5}, "unknown_parameter", "max_output_token"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "extra": 1}}}, "unknown_parameter",
     "text.format.extra"),
    ({"background": True}, "unsupported_parameter", "background"),
    ({"conversation": "conv_1"}, "unsupported_parameter", "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "unsupported_parameter", "prompt"),
    ({"context_management": [{"type": "compaction"}]}, "unsupported_parameter", "context_management"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "unsupported_parameter", "moderation"),
    ({"background_options": {"completion_window": "2h"}}, "unsupported_parameter", "background_options"),
    ({"truncation": "auto"}, "unsupported_parameter", "truncation"),
    ({"top_logprobs": 5}, "unsupported_parameter", "top_logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "unsupported_parameter", "include[0]"),
    ({"include": ["everything"]}, "invalid_request", "include[0]"),
    ({"text": {"verbosity": "high"}}, "unsupported_parameter", "text.verbosity"),
    ({"text": {"format": {"type": "xml"}}}, "invalid_request", "text.format.type"),
    ({"reasoning": {"mode": "pro"}}, "unsupported_parameter", "reasoning.mode"),
    ({"reasoning": {"effort": "extreme"}}, "invalid_request", "reasoning.effort"),
    ({"prompt_cache_options": {"prewarm": True}}, "unsupported_parameter", "prompt_cache_options.prewarm"),
    ({"tools": [_WEATHER, {"type": "web_search"}]}, "unsupported_parameter", "tools[1].type"),
    ({"tools": [{**_WEATHER, "defer_loading": True}]}, "unsupported_parameter", "tools[0].defer_loading"),
    ({"tools": [{**_WEATHER, "function": {}}]}, "unknown_parameter", "tools[0].function"),
    ({"tools": [{"type": "function"}]}, "invalid_request", "tools[0]"),
    ({"tool_choice": {"type": "web_search_preview"}}, "unsupported_parameter", "tool_choice"),
    ({"tools": [_WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                           "tools": [{"type": "function", "name": "nope"}]}},
     "invalid_request", "tool_choice.tools"),
    ({"stream_options": {"include_obfuscation": False}}, "invalid_request", "stream_options"),
    ({"input": None}, "invalid_request", "input"),
    ({"input": []}, "invalid_request", "input"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_request", "metadata"),
    ({"metadata": {"k": "v" * 513}}, "invalid_request", "metadata"),
])
def test_policy_rejections_name_the_param(fields: dict[str, Any], code: str, param: str) -> None:
    err = _error(lambda: _req(**fields))
    assert (err.code, err.param, err.status) == (code, param, 400)


def test_a_body_that_is_not_json_is_a_400() -> None:
    err = _error(lambda: parse_request(b"{nope"))
    assert (err.code, err.status) == ("invalid_request", 400)
