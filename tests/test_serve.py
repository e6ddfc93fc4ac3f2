"""`iq36 serve`: identity at start, a clean SIGTERM, and a worker refused at start (service stays up)."""

from __future__ import annotations

import os
import select
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from iq36 import manifest
from iq36.profile import load
from tests.helpers import run_cli
from tests.serve_process import ServeProcess


@pytest.fixture
def state_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="iq36-") as d:  # short: unix socket paths are limited
        yield Path(d) / "state"


def test_serve_reports_identity_and_stops_cleanly_on_sigterm(tiny_dir: Path, state_dir: Path) -> None:
    with ServeProcess(state_dir, "--model", str(tiny_dir), "--port", "0") as serve:
        ready = serve.event("worker_ready")
        assert ready["model"]["fingerprint"] == manifest.read_manifest(tiny_dir)["fingerprint"]
        assert ready["profile"]["hash"] == load("cpu").hash
        assert ready["engine"] == "candidate" and ready["generation"] == 1
        assert ready["resolved"]["INFERENCE_PRECISION_HINT"]  # what the plugin resolved it to
        assert "last_token_logits" in ready["resolved"]["kernels"]
        assert "iq36: serving" in serve.stderr  # the HTTP gateway is up
        assert "warm-up: 128 prompt tokens" in serve.stderr  # the worker's request before READY
        worker = psutil.Process(ready["pid"])
        assert serve.terminate() == 0
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert not serve.socket.exists()


def test_a_tampered_model_is_refused_and_the_service_stays_up(
        tiny_dir: Path, tmp_path: Path, state_dir: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(tiny_dir, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("256", "255", 1))
    with ServeProcess(state_dir, "--model", str(copy), "--identity", "full", "--port", "0",
                      env={"IQ36_HOME": str(tmp_path / "home")}) as serve:
        failed = serve.event("worker_failed")
        assert "refused to start" in failed["reason"] and "config.json" in failed["reason"]
        assert "refused to start" in serve.stderr and "config.json" in serve.stderr
        assert serve.proc.poll() is None
        status = serve.status()
        assert status["worker"]["state"] == "failed" and "config.json" in status["worker"]["reason"]
        assert status["worker"]["generation"] == 1
        assert serve.terminate() == 0


def test_an_unpinned_profile_is_refused(tiny_dir: Path, state_dir: Path) -> None:
    with ServeProcess(state_dir, "--model", str(tiny_dir), "--identity", "metadata",
                      "--expect-profile-hash", "sha256:deadbeef", "--port", "0") as serve:
        failed = serve.event("worker_failed")
        assert "expected sha256:deadbeef" in failed["reason"]
        assert serve.status()["worker"]["state"] == "failed"
        assert serve.terminate() == 0


def test_an_unknown_profile_is_a_one_line_error(tiny_dir: Path, tmp_path: Path) -> None:
    proc = run_cli("serve", "--model", str(tiny_dir), "--profile", "nope", "--state-dir", str(tmp_path))
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "unknown profile 'nope'" in proc.stderr


def test_a_worker_does_not_outlive_a_killed_serve(tiny_dir: Path, state_dir: Path) -> None:
    with ServeProcess(state_dir, "--model", str(tiny_dir), "--identity", "metadata", "--port", "0") as serve:
        worker = serve.event("worker_ready")["pid"]
        argv = psutil.Process(worker).cmdline()
        runtime_dir = Path(argv[argv.index("--endpoint") + 1].removeprefix("ipc://")).parent
        pidfd = os.pidfd_open(worker)  # readable once the worker exits (it is not our child)
        try:
            serve.proc.kill()
            serve.proc.wait()
            readable, _, _ = select.select([pidfd], [], [], 20.0)
            assert readable, "the orphaned worker is still running"
        finally:
            os.close(pidfd)
            shutil.rmtree(runtime_dir)  # a SIGKILLed serve cannot remove its ipc dir itself
