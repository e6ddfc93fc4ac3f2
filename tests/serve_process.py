"""`iq36 serve` as a subprocess for tests: its JSON event lines, its stderr, `iq36 ctl` against it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from tests.helpers import run_cli


class ServeProcess:
    """Starts `iq36 serve ARGS --state-dir STATE`; use as a context manager (always reaped)."""

    def __init__(self, state_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.state_dir = state_dir
        self.socket = state_dir / "control.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "iq36.cli", "serve", "--state-dir", str(state_dir), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            env={**os.environ, **(env or {})},
        )
        self._events: queue.Queue[str | None] = queue.Queue()
        self.stderr_lines: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self._events.put),
                             name="test-serve-stdout", daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr_lines.append),
                             name="test-serve-stderr", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream: IO[str], sink: Any) -> None:
        for line in stream:
            sink(line)
        sink(None)

    @property
    def stderr(self) -> str:
        return "".join(line for line in self.stderr_lines if line)

    def event(self, name: str, timeout: float = 120.0) -> dict[str, Any]:
        """The next event line named `name` (earlier other events are skipped)."""
        while True:
            try:
                line = self._events.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {name} event within {timeout}s; stderr:\n{self.stderr}") from None
            if line is None:
                rc = self.proc.wait()
                raise AssertionError(f"serve exited ({rc}) before {name}; stderr:\n{self.stderr}")
            event = json.loads(line)
            if event.get("event") == name:
                return event

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_cli("ctl", "--socket", str(self.socket), *args, timeout=120)

    def status(self) -> dict[str, Any]:
        proc = self.ctl("status")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for t in self._threads:
            t.join(10)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()
