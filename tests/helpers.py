"""Helpers shared by tests."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run `iq36 ARGS` in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "iq36.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )
