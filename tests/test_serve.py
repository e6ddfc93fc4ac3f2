"""`iq36 serve` (worker standalone until the split-process core lands): identity at start."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from iq36 import manifest
from iq36.profile import load
from tests.helpers import run_cli


def test_serve_reports_identity_and_stops_cleanly_on_sigterm(tiny_dir: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "iq36.cli", "serve", "--model", str(tiny_dir), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
        env=os.environ.copy(),
    ) as proc:
        try:
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())  # blocks until the worker is ready
            assert ready["event"] == "worker_ready"
            assert ready["model"]["fingerprint"] == manifest.read_manifest(tiny_dir)["fingerprint"]
            assert ready["profile"]["hash"] == load("cpu").hash
            assert ready["resolved"]["INFERENCE_PRECISION_HINT"]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()


def test_serve_refuses_a_tampered_model(tiny_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(tiny_dir, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("256", "255", 1))
    proc = run_cli("serve", "--model", str(copy), "--identity", "full",
                   env={"IQ36_HOME": str(tmp_path / "home")}, timeout=120)
    assert proc.returncode == 1
    assert "refused to start" in proc.stderr and "config.json" in proc.stderr


def test_serve_refuses_an_unpinned_profile(tiny_dir: Path) -> None:
    proc = run_cli("serve", "--model", str(tiny_dir), "--identity", "metadata",
                   "--expect-profile-hash", "sha256:deadbeef", timeout=120)
    assert proc.returncode == 1 and "expected sha256:deadbeef" in proc.stderr
