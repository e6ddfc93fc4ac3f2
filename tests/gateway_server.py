"""A real `iq36 serve` (worker + HTTP gateway) for the gateway tests, with clients against it.

Wraps `tests.serve_process.ServeProcess`: picks a free port (clients cannot use `--port 0`),
waits for `http_listening` and `worker_ready`, and hands out the official `openai` client and a
plain httpx client (for status codes, headers and raw SSE). Everything is closed on exit.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.serve_process import ServeProcess

MODEL = "dev-tiny"
TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_profile(directory: Path, **limits: int) -> Path:
    """The shipped `cpu` profile with other [limits] (limits are not part of the profile hash)."""
    from iq36.profile import resolve

    text = resolve("cpu").read_text()
    for key, value in limits.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    path = directory / "profile.toml"
    path.write_text(text)
    return path


class GatewayServer:
    def __init__(self, state_dir: Path, model_dir: Path, *args: str, env: dict[str, str] | None = None,
                 api_key: str | None = None, wait_ready: bool = True) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.serve = ServeProcess(state_dir, "--model", str(model_dir), "--served-model-name", MODEL,
                                  "--identity", "metadata", "--port", str(self.port), *args, env=env)
        self._clients: list[Any] = []
        try:
            self.serve.event("http_listening")
            if wait_ready:
                self.ready = self.serve.event("worker_ready")
        except BaseException:
            self.serve.__exit__(None, None, None)
            raise

    def openai(self, api_key: str | None = None, timeout: float = TIMEOUT) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key=api_key or self.api_key or "unused",
                               max_retries=0, timeout=timeout)
        self._clients.append(client)
        return client

    def http(self, timeout: float = TIMEOUT, **kwargs: Any) -> httpx.Client:
        client = httpx.Client(base_url=self.base, timeout=timeout, **kwargs)
        self._clients.append(client)
        return client

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {"name{labels}": value}."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(base_url=self.base, timeout=TIMEOUT) as c:
            text = c.get("/metrics", headers=headers).raise_for_status().text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_metric(self, name: str, predicate: Any, timeout: float = TIMEOUT) -> float:
        """Poll /metrics (bounded) until `predicate(value)` holds; the value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics().get(name, 0.0)
            if predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} = {value} did not reach the expected value in {timeout}s")
            time.sleep(0.05)

    def wait_for_log(self, text: str, timeout: float = TIMEOUT) -> None:
        """Wait (bounded) until the server's stderr holds `text`."""
        deadline = time.monotonic() + timeout
        while text not in self.serve.stderr:
            if time.monotonic() > deadline or self.serve.proc.poll() is not None:
                raise AssertionError(f"{text!r} not logged; stderr:\n{self.serve.stderr}")
            time.sleep(0.05)

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()

    def __enter__(self) -> GatewayServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.serve.__exit__(*exc)


def delta_text(chunk: Any) -> str:
    """What a chat.completion.chunk says: content or reasoning (the dev model thinks by default)."""
    if not chunk.choices:
        return ""
    delta = chunk.choices[0].delta
    return str(delta.content or (delta.model_extra or {}).get("reasoning_content") or "")


def message_text(message: Any) -> str:
    """What a whole chat message says: content or reasoning."""
    return str(message.content or (message.model_extra or {}).get("reasoning_content") or "")
