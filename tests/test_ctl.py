"""`iq36 ctl` against a real `iq36 serve` process: status, a killed worker, restart, drain/resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from iq36 import manifest
from tests.conftest import REPO
from tests.helpers import run_cli
from tests.serve_process import ServeProcess


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short on purpose: a unix socket path must fit in 108 bytes, pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="iq36-") as d:
        yield Path(d) / "state"


@pytest.fixture
def serve(tiny_dir: Path, state_dir: Path, tmp_path: Path) -> Iterator[ServeProcess]:
    # A private copy of the profile: restarted workers must match the hash serve started with,
    # so a concurrent edit of profiles/cpu.toml must not reach this test.
    profile = tmp_path / "cpu.toml"
    shutil.copyfile(REPO / "profiles" / "cpu.toml", profile)
    env = {"IQ36_HEARTBEAT_INTERVAL_S": "0.2", "IQ36_RESTART_BACKOFF_INITIAL_S": "0.2"}
    with ServeProcess(state_dir, "--model", str(tiny_dir), "--identity", "metadata", "--port", "0",
                      "--profile", str(profile), env=env) as proc:
        proc.event("worker_ready")
        yield proc
        assert proc.terminate() == 0


def test_status_is_nested_json_on_a_private_socket(serve: ServeProcess, tiny_dir: Path) -> None:
    assert stat.S_IMODE(serve.socket.stat().st_mode) == 0o600
    status = serve.status()
    assert set(status) == {"worker", "restarts", "model", "queue"}
    worker = status["worker"]
    assert {"pid", "generation", "state", "rss_bytes"} <= set(worker)
    assert worker["state"] == "ready" and worker["generation"] == 1 and worker["rss_bytes"] > 0
    assert psutil.Process(worker["pid"]).ppid() == serve.proc.pid
    assert status["restarts"] == {"crash": 0, "hang": 0, "memory_guard": 0, "ops": 0}
    assert status["model"]["fingerprint"] == manifest.read_manifest(tiny_dir)["fingerprint"]
    assert status["queue"] == {"depth": 0}


def test_a_killed_worker_is_replaced_while_serve_stays_up(serve: ServeProcess) -> None:
    old = serve.status()["worker"]["pid"]
    os.kill(old, signal.SIGKILL)
    lost = serve.event("worker_lost")
    assert lost["reason"] == "crash" and "SIGKILL" in lost["detail"]
    ready = serve.event("worker_ready")
    assert ready["generation"] == 2 and ready["pid"] != old
    assert serve.proc.poll() is None  # the front end kept running, same process
    status = serve.status()
    assert status["restarts"]["crash"] == 1
    assert status["worker"]["state"] == "ready" and status["worker"]["pid"] == ready["pid"]


def test_restart_worker(serve: ServeProcess) -> None:
    old = serve.status()["worker"]["pid"]
    proc = serve.ctl("restart-worker")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["worker"]["generation"] == 2
    ready = serve.event("worker_ready")
    assert ready["generation"] == 2 and ready["pid"] != old
    status = serve.status()
    assert status["restarts"]["ops"] == 1 and status["worker"]["state"] == "ready"


def test_drain_and_resume(serve: ServeProcess) -> None:
    proc = serve.ctl("drain")
    assert proc.returncode == 0 and json.loads(proc.stdout)["draining"] is True
    proc = serve.ctl("resume")
    assert proc.returncode == 0 and json.loads(proc.stdout)["draining"] is False


def test_ctl_without_a_service_names_the_socket(tmp_path: Path) -> None:
    path = tmp_path / "nothing.sock"
    proc = run_cli("ctl", "--socket", str(path), "status")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and str(path) in proc.stderr and "iq36 serve" in proc.stderr


def test_ctl_help_names_every_action() -> None:
    proc = run_cli("ctl", "--help")
    assert proc.returncode == 0
    for word in ("status", "restart-worker", "drain", "resume", "--socket", "0600"):
        assert word in proc.stdout


def test_ctl_refuses_an_unknown_action() -> None:
    proc = run_cli("ctl", "reboot")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
