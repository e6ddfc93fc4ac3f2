"""The service around the API, through real server processes: bearer auth on and off and the
bind rule, per-request deadlines (504), the 503s of a draining / restarting / lost worker, and
graceful shutdown on SIGTERM (503 to new requests, running work finishes or is aborted within
the grace period, exit 0)."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from tests.gateway_server import MODEL, GatewayServer, delta_text, free_port, write_profile
from tests.helpers import run_cli

LONG = 4096
CHAT = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="iq36-") as d:  # short: unix socket paths are limited
        yield Path(d)


def _read_content(stream: openai.Stream, n: int) -> None:  # type: ignore[type-arg]
    got = 0
    for chunk in stream:
        if delta_text(chunk):
            got += 1
            if got == n:
                return
    raise AssertionError("the stream ended early")


def test_bearer_keys(tiny_dir: Path, workdir: Path) -> None:
    keys = workdir / "keys"
    keys.write_text("# ops keys\nkey-one\n\nkey-two\n")
    with GatewayServer(workdir / "state", tiny_dir, "--api-key-file", str(keys), api_key="key-two") as srv:
        assert srv.openai().models.list().data[0].id == MODEL  # the second key works too
        assert srv.openai(api_key="key-one").completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError) as exc:
            srv.openai(api_key="key-three").models.list()
        assert exc.value.code == "invalid_api_key" and exc.value.body["type"] == "authentication_error"  # type: ignore[index]
        http = srv.http()
        assert http.get("/health/live").status_code == 200  # probes stay open
        assert http.get("/health/ready").status_code == 200
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer key-one"}).status_code == 200
        assert http.post("/v1/completions", json={}).status_code == 401  # before any validation
        assert "key-one" not in srv.serve.stderr and "key-three" not in srv.serve.stderr
        assert srv.serve.terminate() == 0


def test_without_keys_everything_is_open(tiny_dir: Path, workdir: Path) -> None:
    with GatewayServer(workdir / "state", tiny_dir) as srv:
        assert srv.http().get("/metrics").status_code == 200
        assert srv.openai(api_key="anything").models.list().data[0].id == MODEL
        assert srv.serve.terminate() == 0


def test_a_public_bind_needs_a_key_or_an_explicit_override(tiny_dir: Path, workdir: Path) -> None:
    proc = run_cli("serve", "--model", str(tiny_dir), "--host", "0.0.0.0", "--port", str(free_port()),
                   "--state-dir", str(workdir / "s1"), timeout=120)
    assert proc.returncode == 1 and "without an API key" in proc.stderr and proc.stderr.count("\n") == 1
    with GatewayServer(workdir / "s2", tiny_dir, "--host", "0.0.0.0", "--allow-unauthenticated",
                       wait_ready=False) as srv:
        assert srv.http().get("/health/live").status_code == 200
        assert srv.serve.terminate() == 0


def test_a_request_past_its_deadline_is_aborted_with_504(tiny_dir: Path, workdir: Path) -> None:
    profile = write_profile(workdir, max_output_tokens=LONG)
    with GatewayServer(workdir / "state", tiny_dir, "--profile", str(profile),
                       env={"IQ36_REQUEST_TIMEOUT_S": "2"}) as srv:
        client = srv.openai()
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model=MODEL, prompt="long", max_tokens=LONG, temperature=0)
        assert exc.value.status_code == 504 and exc.value.code == "request_timeout"
        stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=LONG, stream=True,
                                                temperature=0)  # type: ignore[arg-type]
        with stream, pytest.raises(openai.APIError) as err:
            list(stream)
        assert err.value.code == "request_timeout"  # an error frame, then [DONE]
        assert srv.metrics()['iq36_aborted_requests_total{reason="deadline"}'] == 2
        r = client.completions.create(model=MODEL, prompt="short", max_tokens=3)
        assert r.choices[0].finish_reason == "length"


def test_draining_restarting_and_a_lost_worker_are_503s(tiny_dir: Path, workdir: Path) -> None:
    profile = write_profile(workdir, max_output_tokens=LONG)
    # A long restart backoff keeps the service in `restarting` for the whole test.
    with GatewayServer(workdir / "state", tiny_dir, "--profile", str(profile),
                       env={"IQ36_RESTART_BACKOFF_INITIAL_S": "120"}) as srv:
        client = srv.openai()
        assert srv.serve.ctl("drain").returncode == 0
        with pytest.raises(openai.InternalServerError) as exc:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert exc.value.status_code == 503 and exc.value.code == "draining"
        assert int(exc.value.response.headers["retry-after"]) >= 1
        assert srv.http().get("/health/ready").json()["status"] == "draining"
        assert srv.serve.ctl("resume").returncode == 0

        stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=LONG, stream=True,
                                                temperature=0)  # type: ignore[arg-type]
        with stream:
            _read_content(stream, 2)
            os.kill(srv.ready["pid"], signal.SIGKILL)
            with pytest.raises(openai.APIError) as err:
                list(stream)
        assert err.value.code == "worker_lost"
        with pytest.raises(openai.InternalServerError) as exc:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert exc.value.status_code == 503 and exc.value.code == "worker_restarting"
        assert int(exc.value.response.headers["retry-after"]) >= 1
        ready = srv.http().get("/health/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "restarting"
        assert "crash" in ready.json()["reason"]
        assert srv.http().get("/health/live").status_code == 200  # the gateway itself stays up
        assert srv.serve.terminate() == 0


def test_sigterm_lets_a_short_stream_finish_and_exits_0(tiny_dir: Path, workdir: Path) -> None:
    with GatewayServer(workdir / "state", tiny_dir, env={"IQ36_DRAIN_GRACE_S": "60"}) as srv:
        client = srv.openai()
        stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, stream=True,  # type: ignore[arg-type]
                                                stream_options={"include_usage": True})
        with stream:
            _read_content(stream, 2)
            srv.serve.proc.send_signal(signal.SIGTERM)
            rest = list(stream)
        assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] == ["length"]
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 60
        assert srv.serve.proc.wait(timeout=60) == 0
        assert not psutil.pid_exists(srv.ready["pid"]) or psutil.Process(srv.ready["pid"]).status() == "zombie"


def test_sigterm_refuses_new_work_and_aborts_what_outlives_the_grace(tiny_dir: Path, workdir: Path) -> None:
    profile = write_profile(workdir, max_output_tokens=LONG)
    with GatewayServer(workdir / "state", tiny_dir, "--profile", str(profile),
                       env={"IQ36_DRAIN_GRACE_S": "3"}) as srv:
        client = srv.openai()
        http = srv.http()
        stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=LONG, stream=True,
                                                temperature=0)  # type: ignore[arg-type]
        with stream:
            _read_content(stream, 2)
            srv.serve.proc.send_signal(signal.SIGTERM)
            srv.wait_for_log("stopping: draining")
            with pytest.raises(openai.InternalServerError) as exc:
                client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert exc.value.status_code == 503 and exc.value.code == "shutting_down"
            ready = http.get("/health/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "shutting_down"
            with pytest.raises(openai.APIError) as err:
                list(stream)  # ends after the grace period with an error frame
            assert err.value.code == "shutting_down"
        assert srv.serve.proc.wait(timeout=60) == 0


def test_the_stock_engine_serves_and_refuses_what_it_cannot_honour(tiny_dir: Path, workdir: Path) -> None:
    with GatewayServer(workdir / "state", tiny_dir, "--engine", "stock") as srv:
        client = srv.openai()
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 5
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, presence_penalty=0.5)  # type: ignore[arg-type]
        assert exc.value.code == "unsupported_parameter" and exc.value.param == "presence_penalty"  # type: ignore[attr-defined]
        assert srv.openai().models.retrieve(MODEL).model_extra["engine"] == "stock"  # type: ignore[index]
        assert srv.serve.terminate() == 0
