"""The OpenAI API of a real `iq36 serve` on dev-tiny, through the official `openai` SDK:
models, chat and completions (JSON and SSE), usage, stop strings, seeds, the field policy and
the error table (status + stable code, never 422), request ids, metrics, openapi.json.

One server for the module, with small limits (prompt 200 tokens, output 64) so the limit
errors are cheap to reach.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway_server import MODEL, GatewayServer, delta_text, message_text, write_profile

MAX_PROMPT = 200
MAX_OUTPUT = 64
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[GatewayServer]:
    with tempfile.TemporaryDirectory(prefix="iq36-") as d:  # short: unix socket paths are limited
        profile = write_profile(Path(d), max_prompt_tokens=MAX_PROMPT, max_output_tokens=MAX_OUTPUT)
        with GatewayServer(Path(d) / "state", tiny_dir, "--profile", str(profile)) as srv:
            yield srv


@pytest.fixture
def client(server: GatewayServer) -> openai.OpenAI:
    return server.openai()


def _error(exc: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    body = exc.value.body
    assert isinstance(body, dict), body
    assert set(body) == {"message", "type", "param", "code"}  # the SDK unwraps {"error": …}
    return body


def test_models_list_and_get_carry_the_identity(server: GatewayServer, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    model = client.models.retrieve(MODEL)
    extra = model.model_extra or {}
    assert extra["fingerprint"] == server.ready["model"]["fingerprint"]
    assert extra["profile"]["hash"] == server.ready["profile"]["hash"]
    assert extra["runtime"] == server.ready["runtime"]
    # the candidate's specialised graph (kernels/graph_hash.py), as its worker reported it
    assert extra["graph"] == server.ready["resolved"]["graph"]
    assert len(extra["graph"]) == 16 and int(extra["graph"], 16) >= 0
    assert extra["max_output_tokens"] == MAX_OUTPUT and extra["max_prompt_tokens"] == MAX_PROMPT
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4o")
    assert _error(exc)["code"] == "model_not_found"


def test_chat_completion_with_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and message_text(choice.message)
    assert choice.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 5  # the chat template wraps the message
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_omitted_max_tokens_means_the_cap(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    assert r.usage is not None
    assert r.usage.completion_tokens == MAX_OUTPUT or r.choices[0].finish_reason == "stop"


def test_chat_stream_matches_the_whole_response(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True})
    with stream:
        chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(delta_text(c) for c in chunks)
    assert text == message_text(whole.choices[0].message)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_completions_json_and_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="The capital of", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    stream = client.completions.create(model=MODEL, prompt="The capital of", max_tokens=10, temperature=0,
                                       stream=True)
    with stream:
        chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_completions_take_token_ids(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0)
    ids = client.completions.create(model=MODEL, prompt=[9707, 1879], max_tokens=6, temperature=0)
    assert ids.usage is not None and ids.usage.prompt_tokens == 2
    assert text.usage is not None and ids.choices[0].text == text.choices[0].text  # "Hello world" = 9707, 1879


def test_stop_strings_end_the_output_and_are_never_emitted(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    expected = text[:text.index(stop)]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                       stop=stop, stream=True)
    with stream:
        chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_same_seed_gives_the_same_output(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=1.0,  # type: ignore[arg-type]
                                           top_p=1.0, seed=seed)
        return message_text(r.choices[0].message)

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))  # and the seed matters


def test_unknown_fields_are_refused_never_ignored(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"max_token": 5})  # type: ignore[arg-type]
    assert _error(exc) | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "max_token",
                                             "code": "unknown_parameter"}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x", "colour": 1}])  # type: ignore[list-item]
    assert _error(exc)["code"] == "unknown_parameter" and _error(exc)["param"] == "messages[0].colour"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"n": 2}, "n"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_unsupported_parameters_name_the_param(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **kwargs)  # type: ignore[arg-type]
    assert _error(exc)["code"] == "unsupported_parameter" and _error(exc)["param"] == param


def test_no_op_fields_are_accepted(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, user="u1",  # type: ignore[arg-type]
                                       metadata={"k": "v"}, service_tier="auto", store=False, n=1)
    assert r.choices[0].finish_reason == "length"


def test_limits(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=MAX_OUTPUT + 1)
    err = _error(exc)
    assert err["code"] == "output_limit_exceeded" and err["param"] == "max_tokens"
    assert str(MAX_OUTPUT + 1) in err["message"] and str(MAX_OUTPUT) in err["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=" hello" * (MAX_PROMPT + 50), max_tokens=4)
    err = _error(exc)
    assert err["code"] == "context_length_exceeded"
    assert str(MAX_PROMPT) in err["message"] and "tokens" in err["message"]  # names both numbers
    with pytest.raises(openai.BadRequestError) as exc:  # also when streaming: before the stream starts
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": " hi" * 400}], stream=True)
    assert _error(exc)["code"] == "context_length_exceeded"


def test_image_parts_are_unsupported_content(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [  # type: ignore[list-item]
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert _error(exc)["code"] == "unsupported_content_type"
    r = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[  # text parts are fine
        {"role": "user", "content": [{"type": "text", "text": "hello"}]}])
    assert r.choices[0].finish_reason == "length"


def test_http_level_errors(server: GatewayServer) -> None:
    http = server.http()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    r = http.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    big = json.dumps({**body, "messages": [{"role": "user", "content": "x" * (4 << 20)}]})
    r = http.post("/v1/chat/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": "ten"})  # a type error: 400, never 422
    assert r.status_code == 400 and r.json()["error"] == {
        "message": r.json()["error"]["message"], "type": "invalid_request_error", "param": "max_tokens",
        "code": "invalid_request"}
    r = http.post("/v1/chat/completions", json={**body, "temperature": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_request_ids_are_honoured_or_generated(server: GatewayServer) -> None:
    http = server.http()
    r = http.get("/v1/models", headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    generated = http.get("/v1/models").headers["x-request-id"]
    assert generated and generated != "trace-42"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "secret prompt text", "max_tokens": 2},
                  headers={"X-Request-Id": "trace-43"})
    assert r.status_code == 200
    server.wait_for_log('"request_id": "trace-43"')  # written once the response is sent
    access = [json.loads(line) for line in server.serve.stderr_lines
              if line and '"gateway.access"' in line and "trace-43" in line]
    assert access and access[0]["status"] == 200 and access[0]["completion_tokens"] == 2
    assert "secret prompt text" not in server.serve.stderr


def test_health_and_metrics(server: GatewayServer, client: openai.OpenAI) -> None:
    http = server.http()
    assert http.get("/health/live").json() == {"status": "ok"}
    ready = http.get("/health/ready")
    assert ready.status_code == 200 and ready.json()["model"]["fingerprint"] == server.ready["model"]["fingerprint"]
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    m = server.metrics()
    assert m['iq36_requests_total{endpoint="completions",status="200"}'] >= 1
    assert m["iq36_generation_tokens_total"] >= 3
    assert m["iq36_worker_ready"] == 1 and m["iq36_worker_rss_bytes"] > 0
    assert m['iq36_errors_total{code="unknown_parameter"}'] >= 1
    for family in ("iq36_time_to_first_token_seconds_count", "iq36_inter_token_latency_seconds_count",
                   "iq36_e2e_request_latency_seconds_count", "iq36_queue_wait_seconds_count",
                   "iq36_prefill_tokens_per_second_count"):
        assert any(k.startswith(family) and v > 0 for k, v in m.items()), family
    for name in ("iq36_queue_depth", "iq36_running_requests", 'iq36_worker_restarts_total{reason="crash"}',
                 "iq36_memory_guard_trips_total", "iq36_prompt_tokens_total", "iq36_cached_tokens_total"):
        assert name in m, name


def test_openapi_describes_the_endpoints(server: GatewayServer) -> None:
    doc = server.http().get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in ("/v1/models", "/v1/models/{model_id}", "/v1/completions", "/v1/chat/completions",
                 "/v1/responses", "/v1/responses/{response_id}", "/health/live", "/health/ready", "/metrics"):
        assert path in doc["paths"], path
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in schema["required"] and "max_completion_tokens" in schema["properties"]
    assert "previous_response_id" in doc["components"]["schemas"]["ResponsesRequest"]["properties"]
