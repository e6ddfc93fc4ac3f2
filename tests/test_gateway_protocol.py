"""The request field policy and error table in-process (no server): what each OpenAI shape turns
into, which defaults apply, and which 400 each bad request gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.errors import CODES, APIError, from_worker_error
from gateway.model import ModelInfo, SamplingDefaults
from gateway.protocol import chat_job, completion_job
from ipc import Add, PromptSpec, ToWorkerDecoder, encode
from iq36.profile import load
from worker.engine.types import EngineRequest


def _model(model_dir: Path, engine: str = "candidate") -> ModelInfo:
    return ModelInfo(id="m", model_dir=model_dir, engine=engine, profile=load("cpu"),
                     defaults=SamplingDefaults.read(model_dir))


def _chat(info: ModelInfo, **fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return chat_job(json.dumps(body).encode(), info)


def _error(call: Any) -> APIError:
    with pytest.raises(APIError) as exc:
        call()
    return exc.value


def test_defaults_come_from_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    job = _chat(_model(tmp_path))
    p = job.params
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 0.95, 512)
    p = _chat(_model(tmp_path), temperature=0, top_p=0.5, max_completion_tokens=7, seed=3, stop="x").params
    assert (p.temperature, p.top_p, p.max_tokens, p.seed, p.stop) == (0, 0.5, 7, 3, ("x",))


def test_without_generation_config_openai_defaults_apply(tmp_path: Path) -> None:
    p = _chat(_model(tmp_path)).params
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert _chat(_model(tmp_path)).params.temperature == 0.0


def test_chat_messages_go_to_the_worker_as_text(tmp_path: Path) -> None:
    job = _chat(_model(tmp_path), messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        chat_template_kwargs={"enable_thinking": False}, stream=True, stream_options={"include_usage": True})
    assert job.prompt is not None and job.prompt.messages == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert job.prompt.template_kwargs == {"enable_thinking": False}
    assert job.stream and job.include_usage


@pytest.mark.parametrize(("prompt", "text", "ids"), [
    ("hello", "hello", ()), (["hello"], "hello", ()), ([1, 2, 3], None, (1, 2, 3)), ([[4, 5]], None, (4, 5))])
def test_completion_prompt_forms(tmp_path: Path, prompt: Any, text: str | None, ids: tuple[int, ...]) -> None:
    job = completion_job(json.dumps({"model": "m", "prompt": prompt}).encode(), _model(tmp_path))
    assert (job.prompt.text if job.prompt else None) == text and job.prompt_ids == ids


@pytest.mark.parametrize(("fields", "code", "param"), [
    ({"max_token": 3}, "unknown_parameter", "max_token"),
    ({"max_tokens": "3"}, "invalid_request", "max_tokens"),
    ({"max_tokens": 513}, "output_limit_exceeded", "max_tokens"),
    ({"max_tokens": 0}, "invalid_request", "max_tokens"),
    ({"n": 3}, "unsupported_parameter", "n"),
    ({"top_p": 0}, "invalid_request", "top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_request", "stop"),
    ({"stream_options": {"include_usage": True}}, "invalid_request", "stream_options"),
    ({"model": "other"}, "model_not_found", "model"),
    ({"messages": []}, "invalid_request", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_request", "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "unsupported_content_type", "messages[0].content[0]"),
    ({"tool_choice": "required"}, "invalid_request", "tool_choice"),  # no tools to call
    ({"reasoning_effort": "huge"}, "invalid_request", "reasoning_effort"),
])
def test_bad_chat_requests(tmp_path: Path, fields: dict[str, Any], code: str, param: str) -> None:
    err = _error(lambda: _chat(_model(tmp_path), **fields))
    assert (err.code, err.param) == (code, param)
    assert err.status == CODES[code][0] and err.status != 422


def test_bad_completion_requests(tmp_path: Path) -> None:
    model = _model(tmp_path)
    for body, code, param in [({"prompt": ["a", "b"]}, "unsupported_parameter", "prompt"),
                              ({"prompt": ""}, "invalid_request", "prompt"),
                              ({"prompt": [1, "a"]}, "invalid_request", "prompt"),
                              ({"prompt": "x", "echo": True}, "unsupported_parameter", "echo"),
                              ({"prompt": "x", "suffix": "y"}, "unsupported_parameter", "suffix"),
                              ({}, "invalid_request", None)]:
        err = _error(lambda b=body: completion_job(json.dumps({"model": "m", **b}).encode(), model))
        assert (err.code, err.param) == (code, param), body


def test_the_stock_engine_refuses_penalties_up_front(tmp_path: Path) -> None:
    err = _error(lambda: _chat(_model(tmp_path, engine="stock"), frequency_penalty=0.5))
    assert (err.code, err.param) == ("unsupported_parameter", "frequency_penalty")
    assert _chat(_model(tmp_path, engine="stock"), frequency_penalty=0).params.frequency_penalty == 0


def test_worker_errors_keep_their_code() -> None:
    err = from_worker_error("context_length_exceeded: the prompt has 300 tokens, more than the maximum of 200")
    assert (err.status, err.code, err.type) == (400, "context_length_exceeded", "invalid_request_error")
    assert from_worker_error("RuntimeError: boom").code == "internal_error"
    assert APIError("made_up", "x").code == "internal_error"  # the code set stays closed


class OldAdd(msgspec.Struct, array_like=True, tag="add"):
    """`Add` as contract 1 first shipped it, before the appended fields."""

    request: EngineRequest


def test_the_wire_carries_prompts_and_stays_compatible() -> None:
    request = EngineRequest("r1", ())
    msg = Add(request=request, prompt=PromptSpec(messages=[{"role": "user", "content": "hi"}],
                                                  template_kwargs={"enable_thinking": False}), ack=True)
    assert ToWorkerDecoder().decode(encode(msg)) == msg

    # An older worker reads a new frame (trailing fields ignored); a new one reads an old frame.
    assert msgspec.msgpack.decode(encode(msg), type=OldAdd).request == request
    old = ToWorkerDecoder().decode(msgspec.msgpack.encode(OldAdd(request=request)))
    assert old == Add(request=request) and old.prompt is None and not old.ack
