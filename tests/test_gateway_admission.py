"""Admission and cancellation through a real server: a client that goes away (streaming or not)
aborts its generation in the worker and the next request is served at once; a full queue answers
429 `queue_full` with Retry-After while every admitted request completes.

One server for the module: queue of 1 behind the running request, output cap 4096 so that an
uncancelled generation would keep the worker busy for minutes (dev-tiny decodes ~40 tokens/s here).
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway_server import MODEL, GatewayServer, delta_text, write_profile

LONG = 4096  # tokens: ~100 s of decoding; a test that waited for it would time out
CHAT = [{"role": "user", "content": "Tell me a long story."}]
ABORTED = 'iq36_aborted_requests_total{reason="client_disconnect"}'


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[GatewayServer]:
    with tempfile.TemporaryDirectory(prefix="iq36-") as d:
        profile = write_profile(Path(d), max_output_tokens=LONG)
        with GatewayServer(Path(d) / "state", tiny_dir, "--profile", str(profile),
                           env={"IQ36_MAX_QUEUE": "1"}) as srv:
            yield srv


def _next_request_is_served_at_once(server: GatewayServer, client: openai.OpenAI) -> None:
    t0 = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="next", max_tokens=5, temperature=0)
    elapsed = time.monotonic() - t0
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 5
    # The aborted request had thousands of tokens left (minutes of work at batch size 1).
    assert elapsed < 20, f"the next request waited {elapsed:.1f}s"
    assert server.serve.status()["worker"]["generation"] == 1  # aborted, not killed


def test_closing_a_stream_aborts_the_generation(server: GatewayServer) -> None:
    client = server.openai()
    aborted = server.metrics().get(ABORTED, 0.0)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=LONG, stream=True,
                                                temperature=0)  # type: ignore[arg-type]
    received = 0
    for chunk in stream:
        if delta_text(chunk):
            received += 1
            if received == 3:
                break
    stream.close()
    server.wait_metric(ABORTED, lambda v: v == aborted + 1)
    server.wait_metric("iq36_running_requests", lambda v: v == 0)
    produced = server.metrics()["iq36_generation_tokens_total"]
    _next_request_is_served_at_once(server, client)
    # Nothing of the aborted request arrived after the abort: only the next request's 5 tokens.
    assert server.metrics()["iq36_generation_tokens_total"] == produced + 5
    assert server.metrics()['iq36_requests_total{endpoint="chat",status="499"}'] >= 1


def test_a_client_leaving_a_non_streaming_request_aborts_it(server: GatewayServer) -> None:
    aborted = server.metrics().get(ABORTED, 0.0)
    body = json.dumps({"model": MODEL, "prompt": "A long one", "max_tokens": LONG, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        server.wait_metric("iq36_generation_tokens_total", lambda v: v > 0)
        server.wait_metric("iq36_running_requests", lambda v: v == 1)
    server.wait_metric(ABORTED, lambda v: v == aborted + 1)
    server.wait_metric("iq36_running_requests", lambda v: v == 0)
    _next_request_is_served_at_once(server, server.openai())


def test_a_full_queue_answers_429_and_every_admitted_request_completes(server: GatewayServer) -> None:
    client = server.openai()
    running = client.completions.create(model=MODEL, prompt="first", max_tokens=120, stream=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-queued") as pool:
        queued = pool.submit(client.completions.create, model=MODEL, prompt="second", max_tokens=10)
        server.wait_metric("iq36_queue_depth", lambda v: v == 1)
        for _ in range(3):
            with pytest.raises(openai.RateLimitError) as exc:
                client.completions.create(model=MODEL, prompt="third", max_tokens=5)
            assert exc.value.code == "queue_full" and exc.value.body["type"] == "rate_limit_error"  # type: ignore[index]
            assert int(exc.value.response.headers["retry-after"]) >= 1
        with running:
            chunks = list(running)
        assert chunks[-1].choices[0].finish_reason == "length"
        second = queued.result(timeout=120)
    assert second.choices[0].finish_reason == "length" and second.usage is not None
    assert second.usage.completion_tokens == 10
    assert server.metrics()['iq36_errors_total{code="queue_full"}'] >= 3
    # Room again once they are done.
    assert client.completions.create(model=MODEL, prompt="after", max_tokens=2).choices[0].finish_reason == "length"
