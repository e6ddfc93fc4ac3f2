"""The Responses API of a real `iq36 serve` on dev-tiny, through the official `openai` SDK:
stored responses (create, retrieve, chain, delete, survive a restart, belong to their key),
streaming events, forced tool calls and structured output, the store's capacity (507).

As in test_gateway_agentic: random weights, so forced calls and schemas run with thinking off.
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

from tests.gateway_server import MODEL, GatewayServer, write_profile
from tests.helpers import WEATHER_SCHEMA

NO_THINK = {"reasoning": {"effort": "none"}}
KEY_A, KEY_B = "key-alpha", "key-beta"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather forecast",
           "parameters": WEATHER_SCHEMA, "strict": True}


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="iq36-") as d:  # short: unix socket paths are limited
        path = Path(d)
        (path / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
        yield path


@pytest.fixture(scope="module")
def server(tiny_dir: Path, workdir: Path) -> Iterator[GatewayServer]:
    with GatewayServer(workdir / "state", tiny_dir, "--api-key-file", str(workdir / "keys"), api_key=KEY_A) as srv:
        yield srv


@pytest.fixture
def client(server: GatewayServer) -> openai.OpenAI:
    return server.openai(timeout=120)


def test_create_retrieve_chain_delete(server: GatewayServer, client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Hello there.", instructions="Be brief.", max_output_tokens=8,
                                    temperature=0, metadata={"case": "chain"}, extra_body=NO_THINK)
    assert first.id.startswith("resp_") and first.status == "incomplete"
    assert first.incomplete_details is not None and first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text and first.metadata == {"case": "chain"}
    assert first.usage is not None and first.usage.output_tokens == 8
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    # Instructions are not carried over (OpenAI's rule): send them again to keep the same system prompt.
    second = client.responses.create(model=MODEL, input="And again?", previous_response_id=first.id,
                                     instructions="Be brief.", max_output_tokens=8, temperature=0, extra_body=NO_THINK)
    assert second.previous_response_id == first.id
    assert second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 8  # history is in
    # Everything before turn 1's generation header (`<|im_start|>assistant\n<think>\n\n</think>\n\n`,
    # 7 tokens, which the template renders differently for a past turn) is restored, not prefilled.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 7
    deleted = client.responses.delete(second.id)
    assert deleted is None  # the SDK returns None for the deletion object
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.retrieve(second.id)
    assert isinstance(exc.value.body, dict) and exc.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=second.id, max_output_tokens=4)


def test_a_stored_response_belongs_to_its_key(server: GatewayServer, client: openai.OpenAI) -> None:
    mine = client.responses.create(model=MODEL, input="secret", max_output_tokens=4, extra_body=NO_THINK)
    other = server.openai(api_key=KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id


def test_store_false_is_not_retrievable(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=4, extra_body=NO_THINK)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_streaming_events_are_typed_and_numbered(client: openai.OpenAI) -> None:
    stream = client.responses.create(model=MODEL, input="Stream it.", max_output_tokens=12, temperature=0,
                                     stream=True)
    with stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    assert "response.reasoning_text.delta" in types  # thinking on by default: the model is mid-thought
    final = events[-1].response  # type: ignore[union-attr]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == reasoning  # type: ignore[union-attr,index]
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 12


def test_forced_tool_call_through_responses(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                      temperature=1.0, max_output_tokens=200, extra_body={**NO_THINK, "seed": 5})
        if stream:
            with client.responses.stream(**kwargs) as s:
                deltas = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
                response = s.get_final_response()
        else:
            response = client.responses.create(**kwargs)
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and response.status == "completed"
        for call in calls:
            assert call.name == "get_weather" and call.call_id
            jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
        if stream:
            assert deltas == "".join(c.arguments for c in calls)
        assert not any(item.type == "message" for item in response.output)


def test_function_call_output_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    temperature=0, max_output_tokens=200, extra_body=NO_THINK)
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"forecast": "sunny"}'}],
                                     max_output_tokens=6, temperature=0, extra_body=NO_THINK)
    assert second.status in ("completed", "incomplete")
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    for seed in (1, 2):
        r = client.responses.create(model=MODEL, input="Answer in JSON.", temperature=1.0, max_output_tokens=100,
                                    text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                     "strict": True}},
                                    extra_body={**NO_THINK, "seed": seed})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), schema)


def test_unsupported_fields_name_the_responses_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="x", max_output_tokens=100_000)
    assert isinstance(exc.value.body, dict) and exc.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert isinstance(exc.value.body, dict) and exc.value.body["code"] == "unsupported_parameter"


def test_stored_responses_survive_a_restart(tiny_dir: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="iq36-") as d:
        state = Path(d) / "state"
        with GatewayServer(state, tiny_dir) as srv:
            made = srv.openai().responses.create(model=MODEL, input="Remember me.", max_output_tokens=4,
                                                 extra_body=NO_THINK)
            assert srv.serve.terminate() == 0
        with GatewayServer(state, tiny_dir) as srv:
            again = srv.openai().responses.retrieve(made.id)
            assert again.model_dump() == made.model_dump()


def test_a_full_store_is_507_before_generating(tiny_dir: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="iq36-") as d:
        profile = write_profile(Path(d), max_entries=1)
        with GatewayServer(Path(d) / "state", tiny_dir, "--profile", str(profile)) as srv:
            client = srv.openai()
            client.responses.create(model=MODEL, input="one", max_output_tokens=2, extra_body=NO_THINK)
            before = srv.metrics().get("iq36_generation_tokens_total", 0.0)
            with pytest.raises(openai.APIStatusError) as exc:
                client.responses.create(model=MODEL, input="two", max_output_tokens=2, extra_body=NO_THINK)
            assert exc.value.status_code == 507
            assert isinstance(exc.value.body, dict) and exc.value.body["code"] == "response_store_full"
            assert srv.metrics().get("iq36_generation_tokens_total", 0.0) == before  # nothing was generated
            assert client.responses.create(model=MODEL, input="three", store=False, max_output_tokens=2,
                                           extra_body=NO_THINK).status == "incomplete"
