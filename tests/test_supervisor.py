"""The supervisor with a real worker process on dev-tiny: crash, hang, memory guard, ops restart,
drain, abort, a worker that cannot start, and (with a fake worker) contract and generation checks.

The supervisor runs in-process under asyncio, as the gateway will embed it: "the front end keeps
its pid" is this test process. Waits are on supervisor state changes, bounded by timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import psutil
import pytest

from iq36.manifest import IdentityMode
from worker.engine.types import EngineRequest, FinishReason, SamplingParams, StepOutput
from worker.settings import ServiceSettings
from worker.supervisor import (
    Draining,
    RequestStream,
    ShuttingDown,
    Supervisor,
    WorkerCommand,
    WorkerFailed,
    WorkerLost,
    WorkerRestarting,
    WorkerSpec,
)

READY_TIMEOUT = 120.0  # a cold compile on a busy 2-core machine
DEADLINE = 2.0  # heartbeat deadline used here
CPU_PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "cpu.toml"


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def settings(tmp_path: Path, **overrides: Any) -> ServiceSettings:
    values: dict[str, Any] = dict(
        state_dir=tmp_path / "state", heartbeat_interval_s=0.2, heartbeat_deadline_s=DEADLINE,
        startup_timeout_s=READY_TIMEOUT, restart_backoff_initial_s=0.2, memory_poll_interval_s=0.2,
        shutdown_grace_s=5.0,
    )
    values.update(overrides)
    return ServiceSettings.build(env={}, **values)


def test_warmup_tokens_setting_reads_the_environment_and_refuses_negatives() -> None:
    assert ServiceSettings.build(env={}).warmup_tokens == 128
    assert ServiceSettings.build(env={"IQ36_WARMUP_TOKENS": "0"}).warmup_tokens == 0
    with pytest.raises(ValueError, match="warmup_tokens"):
        ServiceSettings.build(env={"IQ36_WARMUP_TOKENS": "-1"})
    one = WorkerSpec(model_dir=Path("m"), engine="candidate", profile="cpu", warmup_tokens=64)
    argv = one.argv("ipc://x", 1, "h")
    assert argv[argv.index("--warmup-tokens") + 1] == "64"


def spec(model_dir: Path, tmp_path: Path, profile: str | None = None,
         identity: IdentityMode = IdentityMode.METADATA) -> WorkerSpec:
    if profile is None:
        # A private copy of `cpu`: a restarted worker must compute with the profile the service
        # started with, so an edit to profiles/cpu.toml while a test runs would be refused.
        copy = tmp_path / "cpu.toml"
        shutil.copyfile(CPU_PROFILE, copy)
        profile = str(copy)
    return WorkerSpec(model_dir=model_dir, engine="candidate", profile=profile, identity=identity)


@contextlib.asynccontextmanager
async def supervised(
    worker_spec: WorkerSpec, tmp_path: Path, command: WorkerCommand | None = None,
    events: list[dict[str, Any]] | None = None, **overrides: Any,
) -> AsyncIterator[Supervisor]:
    sink: Callable[[dict[str, Any]], None] | None = events.append if events is not None else None
    sup = Supervisor(worker_spec, settings(tmp_path, **overrides), worker_command=command, on_event=sink)
    await sup.start()
    try:
        yield sup
    finally:
        await sup.stop()
    assert sup.status()["worker"]["state"] == "stopped"


async def ready(sup: Supervisor, generation: int = 1) -> dict[str, Any]:
    return await sup.wait_until(
        lambda s: s["worker"]["state"] == "ready" and s["worker"]["generation"] == generation, READY_TIMEOUT)


def request(rid: str, max_tokens: int = 512, prompt_len: int = 16) -> EngineRequest:
    # ignore_eos: random weights must not end a "long" generation early.
    return EngineRequest(rid, tuple(range(1000, 1000 + prompt_len)),
                         SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def first_token(stream: RequestStream) -> StepOutput:
    async with asyncio.timeout(60):
        async for out in stream:
            if out.token_ids:
                return out
    raise AssertionError("the request finished before producing a token")


async def finish(stream: RequestStream) -> StepOutput:
    async with asyncio.timeout(60):
        async for out in stream:
            if out.finished:
                return out
    raise AssertionError("the stream ended without a finished output")


async def lost_within(stream: RequestStream, seconds: float) -> WorkerLost:
    t0 = time.monotonic()
    with pytest.raises(WorkerLost) as info:
        async with asyncio.timeout(seconds):
            async for _ in stream:
                pass
    assert time.monotonic() - t0 < seconds
    assert info.value.code == "worker_lost" and info.value.retry_after
    return info.value


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_kill_9_during_generation_ends_the_request_cleanly_and_a_new_worker_serves(
        tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path) as sup:
            status = await ready(sup)
            pid = status["worker"]["pid"]
            stream = await sup.submit(request("long"))
            await first_token(stream)
            os.kill(pid, signal.SIGKILL)
            error = await lost_within(stream, 2.0)
            assert "crash" in str(error)
            with pytest.raises(WorkerRestarting) as info:
                await sup.submit(request("too-early"))
            assert info.value.retry_after
            status = await ready(sup, generation=2)
            assert status["worker"]["pid"] != pid and gone(pid)
            out = await finish(await sup.submit(request("next", max_tokens=4)))
            assert out.finish_reason is FinishReason.LENGTH and out.completion_tokens == 4
            assert sup.status()["restarts"] == {"crash": 1, "hang": 0, "memory_guard": 0, "ops": 0}

    run(body())


def test_a_stopped_worker_is_detected_as_hung_and_replaced(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path) as sup:
            pid = (await ready(sup))["worker"]["pid"]
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            await sup.wait_until(lambda s: s["restarts"]["hang"] == 1, DEADLINE + 5)
            # The last heartbeat may predate the stop by one interval (0.2 s); detection must not
            # take much longer than the deadline.
            assert DEADLINE - 0.3 <= time.monotonic() - t0 < DEADLINE + 2
            status = await ready(sup, generation=2)
            assert gone(pid) and status["worker"]["pid"] != pid
            assert status["restarts"] == {"crash": 0, "hang": 1, "memory_guard": 0, "ops": 0}
            out = await finish(await sup.submit(request("after-hang", max_tokens=2)))
            assert out.finish_reason is FinishReason.LENGTH

    run(body())


def test_memory_guard_trips_and_the_service_recovers_once_relaxed(tiny_dir: Path, tmp_path: Path) -> None:
    # The guard thresholds are re-read from the profile file at every worker start (they are not
    # part of the profile hash), so an operator can relax a guard that keeps tripping without
    # restarting the service; that is how recovery is observed here.
    profile = tmp_path / "guarded.toml"
    cpu = CPU_PROFILE.read_text()
    profile.write_text(cpu.replace("max_worker_rss_bytes = 0", "max_worker_rss_bytes = 1"))
    events: list[dict[str, Any]] = []

    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path, profile=str(profile)), tmp_path, events=events) as sup:
            await sup.wait_until(lambda s: s["restarts"]["memory_guard"] >= 1, READY_TIMEOUT)
            lost = [e for e in events if e["event"] == "worker_lost"]
            assert lost[0]["reason"] == "memory_guard" and "max_worker_rss_bytes 1" in lost[0]["detail"]
            profile.write_text(cpu)
            status = await sup.wait_until(
                lambda s: s["worker"]["state"] == "ready" and s["worker"]["rss_bytes"], READY_TIMEOUT)
            assert status["worker"]["reason"] is None
            assert status["restarts"]["crash"] == status["restarts"]["hang"] == 0
            out = await finish(await sup.submit(request("after-guard", max_tokens=2)))
            assert out.finish_reason is FinishReason.LENGTH

    run(body())


def test_ops_restart_while_idle_and_while_busy(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path) as sup:
            pid1 = (await ready(sup))["worker"]["pid"]
            await sup.restart_worker()
            await ready(sup, generation=2)
            assert gone(pid1)
            stream = await sup.submit(request("busy"))
            await first_token(stream)
            restart = asyncio.create_task(sup.restart_worker(), name="test-restart")
            error = await lost_within(stream, 2.0)
            assert "ops" in str(error)
            await restart
            status = await ready(sup, generation=3)
            assert status["restarts"] == {"crash": 0, "hang": 0, "memory_guard": 0, "ops": 2}
            out = await finish(await sup.submit(request("after-ops", max_tokens=2)))
            assert out.finish_reason is FinishReason.LENGTH

    run(body())


def test_drain_refuses_new_requests_and_resume_admits_again(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path) as sup:
            await ready(sup)
            running = await sup.submit(request("in-flight", max_tokens=8))
            sup.drain()
            with pytest.raises(Draining) as info:
                await sup.submit(request("refused"))
            assert info.value.code == "draining"
            assert (await finish(running)).finish_reason is FinishReason.LENGTH  # drain lets it finish
            sup.resume()
            out = await finish(await sup.submit(request("admitted", max_tokens=2)))
            assert out.finish_reason is FinishReason.LENGTH

    run(body())


def test_abort_stops_the_generation_within_a_step_without_a_restart(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path) as sup:
            status = await ready(sup)
            stream = await sup.submit(request("to-abort"))
            await first_token(stream)
            sup.abort("to-abort")
            sup.abort("to-abort")  # idempotent
            after: list[StepOutput] = []
            async with asyncio.timeout(10):
                async for out in stream:
                    after.append(out)
            final = after[-1]
            assert final.finished and final.finish_reason is FinishReason.ABORT
            # At most the step already running and one frame in flight arrive after the abort.
            assert sum(len(o.token_ids) for o in after) <= 2
            assert final.completion_tokens < 100
            now = sup.status()
            assert now["worker"]["generation"] == 1 and now["worker"]["pid"] == status["worker"]["pid"]
            assert sum(now["restarts"].values()) == 0
            out = await finish(await sup.submit(request("after-abort", max_tokens=2)))
            assert out.finish_reason is FinishReason.LENGTH

    run(body())


def test_abort_during_prefill_stops_within_a_chunk(tiny_dir: Path, tmp_path: Path) -> None:
    # 16,384 prompt tokens in 64-token chunks (the long-context part too): the whole prefill
    # takes seconds (4,096 tokens took under 0.5 s on an AVX-512 machine), one chunk well under
    # 0.1 s.
    profile = tmp_path / "chunked.toml"
    profile.write_text(re.sub(r"(?m)^chunk_tokens = \d+$", "chunk_tokens = 64", CPU_PROFILE.read_text()))

    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path, profile=str(profile)), tmp_path) as sup:
            await ready(sup)
            stream = await sup.submit(request("prefilling", prompt_len=16384))
            # A prefill chunk emits nothing, so there is no event to wait for: give the worker
            # time to be inside the prefill (well short of its whole duration).
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            sup.abort("prefilling")
            outs = [out async for out in stream]
            assert time.monotonic() - t0 < 1.5
            assert [o.finish_reason for o in outs] == [FinishReason.ABORT]
            assert outs[0].completion_tokens == 0 and outs[0].prompt_tokens == 16384
            assert sup.status()["worker"]["generation"] == 1

    run(body())


def test_a_long_engine_call_is_not_taken_for_a_hang(tiny_dir: Path, tmp_path: Path) -> None:
    # One 16,384-token prefill chunk is a single OpenVINO call of a second or more (8,192 tokens
    # took 0.47 s on an AVX-512 machine, 2-3 s on an AVX2 one), several times a 0.25 s heartbeat
    # deadline: the worker's IO thread must keep answering meanwhile. Every prompt of the
    # profile is one chunk (no long-context profile).
    profile = tmp_path / "one-chunk.toml"
    text = re.sub(r"(?m)^(chunk_tokens|from_tokens) = \d+$", r"\1 = 131072", CPU_PROFILE.read_text())
    profile.write_text(text)
    deadline = 0.25

    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path, profile=str(profile)), tmp_path,
                              heartbeat_interval_s=0.05, heartbeat_deadline_s=deadline) as sup:
            await ready(sup)
            t0 = time.monotonic()
            out = await finish(await sup.submit(request("one-long-call", max_tokens=1, prompt_len=16384)))
            assert out.finish_reason is FinishReason.LENGTH
            elapsed = time.monotonic() - t0
            assert elapsed > 2 * deadline, elapsed  # the call really outlasted the deadline
            assert sup.status()["worker"]["generation"] == 1
            assert sum(sup.status()["restarts"].values()) == 0

    run(body())


def test_aborting_a_queued_request_never_runs_it(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path) as sup:
            await ready(sup)
            first = await sup.submit(request("first", max_tokens=16))
            queued = await sup.submit(request("queued"))
            assert sup.status()["queue"]["depth"] == 1
            sup.abort("queued")
            out = await finish(queued)
            assert out.finish_reason is FinishReason.ABORT and out.completion_tokens == 0
            assert sup.status()["queue"]["depth"] == 0
            assert (await finish(first)).finish_reason is FinishReason.LENGTH

    run(body())


def test_a_rejected_request_is_a_request_level_error(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path) as sup:
            await ready(sup)
            out = await finish(await sup.submit(request("too-long-output", max_tokens=100_000)))
            assert out.finish_reason is FinishReason.ERROR
            assert out.error is not None and out.error.startswith("output_limit_exceeded: ")
            assert sup.status()["worker"]["generation"] == 1
            assert sum(sup.status()["restarts"].values()) == 0

    run(body())


def test_a_worker_that_cannot_start_fails_without_a_restart_loop(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IQ36_HOME", str(tmp_path / "home"))  # the copy's hashes stay out of ~/.cache
    copy = tmp_path / "m"
    shutil.copytree(tiny_dir, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("256", "255", 1))
    events: list[dict[str, Any]] = []

    async def body() -> None:
        async with supervised(spec(copy, tmp_path, identity=IdentityMode.FULL), tmp_path, events=events) as sup:
            status = await sup.wait_until(lambda s: s["worker"]["state"] == "failed", READY_TIMEOUT)
            assert "refused to start" in status["worker"]["reason"]
            assert "config.json" in status["worker"]["reason"]
            assert status["worker"]["pid"] is None
            # No restart loop: nothing changes for many backoff periods.
            with pytest.raises(TimeoutError):
                await sup.wait_until(lambda s: s["worker"]["generation"] > 1, 2.0)
            assert sup.status()["worker"]["state"] == "failed"
            assert sum(sup.status()["restarts"].values()) == 0
            with pytest.raises(WorkerFailed, match="config.json"):
                await sup.submit(request("refused"))
            assert [e["event"] for e in events] == ["worker_lost", "worker_failed"]

    run(body())


def test_an_ops_restart_retries_a_failed_worker_once(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IQ36_HOME", str(tmp_path / "home"))
    copy = tmp_path / "m"
    shutil.copytree(tiny_dir, copy)
    config = (copy / "config.json").read_text()
    (copy / "config.json").write_text(config.replace("256", "255", 1))

    async def body() -> None:
        async with supervised(spec(copy, tmp_path, identity=IdentityMode.FULL), tmp_path) as sup:
            await sup.wait_until(lambda s: s["worker"]["state"] == "failed", READY_TIMEOUT)
            (copy / "config.json").write_text(config)  # the operator fixes the model
            await sup.restart_worker()
            status = await ready(sup, generation=2)
            assert status["restarts"]["ops"] == 1 and status["worker"]["reason"] is None

    run(body())


def test_stopping_ends_a_running_request_with_shutting_down(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        sup = Supervisor(spec(tiny_dir, tmp_path), settings(tmp_path))
        await sup.start()
        try:
            pid = (await ready(sup))["worker"]["pid"]
            stream = await sup.submit(request("long"))
            await first_token(stream)
        finally:
            await sup.stop()
        with pytest.raises(ShuttingDown):
            async for _ in stream:
                pass
        with pytest.raises(ShuttingDown):
            await sup.submit(request("late"))
        assert gone(pid) and sup.status()["worker"]["state"] == "stopped"

    run(body())


def fake_worker(mode: str) -> WorkerCommand:
    return lambda endpoint, generation: [sys.executable, "-m", "tests.fake_worker", mode, endpoint,
                                         str(generation)]


def test_a_worker_speaking_another_contract_version_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path, command=fake_worker("contract")) as sup:
            status = await sup.wait_until(lambda s: s["worker"]["state"] == "failed", 60)
            assert "contract version" in status["worker"]["reason"]
            with pytest.raises(TimeoutError):
                await sup.wait_until(lambda s: s["worker"]["generation"] > 1, 1.0)

    run(body())


def test_late_output_of_an_older_generation_is_dropped(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path, command=fake_worker("late")) as sup:
            await ready(sup)
            outs = [out async for out in await sup.submit(request("r"))]
            assert [o.text for o in outs] == ["fresh"]

    run(body())


def test_a_dead_frame_is_a_crash_and_the_worker_is_replaced(tiny_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with supervised(spec(tiny_dir, tmp_path), tmp_path, command=fake_worker("dead")) as sup:
            await ready(sup)
            stream = await sup.submit(request("r"))
            error = await lost_within(stream, 2.0)
            assert "engine exploded" in str(error)
            status = await ready(sup, generation=2)
            assert status["restarts"]["crash"] == 1

    run(body())
