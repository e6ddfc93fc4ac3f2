"""The supervisor: owns the worker process and the one request running in it.

Lives in the front-end process (asyncio; the gateway embeds it) and never imports OpenVINO. It
spawns `python -m worker.process`, waits for READY (refusing another IPC contract version),
and watches liveness = process alive (a pidfd sentinel) AND a frame within the heartbeat
deadline, plus the memory guard (worker RSS, system MemAvailable). Whatever ends a worker —
crash, hang, guard trip, ops restart — the running request ends at once with `WorkerLost`, the
worker is killed and reaped, and a new generation is started after a backoff; queued requests
wait for it. Requests arriving meanwhile get `WorkerRestarting` with a retry-after. A worker
that cannot start (identity refused, engine failure, exit or timeout before READY, contract
mismatch) is not retried: the state becomes `failed` with the reason kept, until an ops
`restart-worker`. Frames of an older generation are dropped.

Tasks: `recv` routes worker frames to per-request mailboxes, `send` writes the outbox to the
socket, `lifecycle` runs one worker generation after another, `monitor-gN` pings and polls
memory for generation N. One request runs at a time (batch size 1); the rest wait in a FIFO
whose depth `status()` reports (admission limits are the gateway's). The OS process itself
(spawn, pidfd sentinel, kill, reap) is `worker.child`; the errors callers see are `worker.errors`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ipc.codec import ContractMismatch, ProtocolError
from ipc.messages import (
    Abort,
    Add,
    Dead,
    FromWorker,
    Outputs,
    Ping,
    PromptSpec,
    Ready,
    Shutdown,
    StartupFailed,
    ToWorker,
)
from ipc.sockets import SupervisorSocket
from iq36.manifest import IdentityMode, read_manifest
from iq36.profile import MemoryGuardSection, ProfileError, load
from worker.child import WorkerProcess
from worker.engine.types import EngineRequest, FinishReason, StepOutput
from worker.errors import (
    Draining,
    ServiceError,
    ShuttingDown,
    WorkerFailed,
    WorkerLost,
    WorkerRestarting,
)
from worker.settings import ServiceSettings

__all__ = [
    "Draining",
    "RequestStream",
    "ServiceError",
    "ShuttingDown",
    "Supervisor",
    "WorkerCommand",
    "WorkerFailed",
    "WorkerLost",
    "WorkerRestarting",
    "WorkerSpec",
    "WorkerState",
]

log = logging.getLogger(__name__)

RESTART_REASONS = ("crash", "hang", "memory_guard", "ops")
# Ways a worker ends before READY that retrying cannot fix: state `failed`, no restart loop.
_CANNOT_START = ("startup_failed", "exited", "startup_timeout", "contract")


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


# --- what is supervised ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What the worker runs: model, engine, profile (name or TOML path), identity checks."""

    model_dir: Path
    engine: str
    profile: str
    identity: IdentityMode = IdentityMode.FULL
    expect_profile_hash: str | None = None
    warmup_tokens: int = 0  # the worker's untimed request before READY (ServiceSettings)

    def argv(self, endpoint: str, generation: int, profile_hash: str) -> list[str]:
        # The worker must compute with the profile the service started with: an edit to the
        # hashed part of the file while the service runs is refused at the next restart.
        return [
            sys.executable, "-m", "worker.process", "--endpoint", endpoint,
            "--generation", str(generation), "--model", str(self.model_dir), "--engine", self.engine,
            "--profile", self.profile, "--identity", self.identity.value,
            "--expect-profile-hash", self.expect_profile_hash or profile_hash,
            "--warmup-tokens", str(self.warmup_tokens),
        ]


# Given (endpoint, generation), the command that starts a worker; tests substitute fakes.
WorkerCommand = Callable[[str, int], list[str]]


@dataclasses.dataclass
class _End:
    kind: str  # a RESTART_REASONS entry, a _CANNOT_START entry, or "stop"
    detail: str


@dataclasses.dataclass(eq=False)
class _Pending:
    request: EngineRequest
    mailbox: asyncio.Queue[StepOutput | ServiceError] = dataclasses.field(default_factory=asyncio.Queue)
    abort_sent: bool = False
    prompt: PromptSpec | None = None  # text / chat messages the worker tokenizes
    ack: bool = False  # the worker acknowledges the add with an empty output
    submitted_at: float = dataclasses.field(default_factory=time.monotonic)
    dispatched_at: float | None = None  # when it left the FIFO for the worker (queue wait metric)


class RequestStream:
    """The outputs of one submitted request; raises a ServiceError if the request cannot finish.

    `async with` aborts the request if the consumer leaves before it finished.
    """

    def __init__(self, supervisor: Supervisor, pending: _Pending) -> None:
        self._supervisor = supervisor
        self._pending = pending
        self.finished = False

    @property
    def request_id(self) -> str:
        return self._pending.request.request_id

    @property
    def queue_wait_s(self) -> float | None:
        """Seconds from submit until sent to the worker; None while still queued."""
        p = self._pending
        return None if p.dispatched_at is None else p.dispatched_at - p.submitted_at

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._pending.mailbox.get()
        if isinstance(item, ServiceError):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        self._supervisor.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.finished:
            self.abort()


class Supervisor:
    """See the module docstring. Create, `await start()`, `submit` requests, `await stop()`."""

    def __init__(
        self,
        spec: WorkerSpec,
        settings: ServiceSettings,
        *,
        worker_command: WorkerCommand | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.spec = spec
        self.settings = settings
        # A bad profile is the service's own configuration error: raise (ProfileError) now.
        profile = load(spec.profile)
        self._profile_hash = profile.hash
        self._guard: MemoryGuardSection = profile.memory_guard
        self._command = worker_command or (lambda ep, gen: spec.argv(ep, gen, self._profile_hash))
        self._on_event = on_event
        try:
            self._fingerprint: str | None = read_manifest(spec.model_dir).get("fingerprint")
        except Exception:  # a missing or bad manifest is the worker's to report, with the reason
            self._fingerprint = None
        self._state = WorkerState.STOPPED
        self._reason: str | None = None
        self._generation = 0
        self._restarts: dict[str, int] = dict.fromkeys(RESTART_REASONS, 0)
        self._worker: WorkerProcess[_End] | None = None
        self._queue: collections.deque[_Pending] = collections.deque()
        self._requests: dict[str, _Pending] = {}
        self._running: _Pending | None = None
        self._draining = False
        self._stopping = False
        self._socket: SupervisorSocket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._lifecycle_task: asyncio.Task[None] | None = None
        self._outbox: asyncio.Queue[tuple[int, ToWorker]] | None = None
        self._wakeup: asyncio.Event | None = None  # leaves `failed` / cuts a backoff short
        self._changed: asyncio.Event | None = None  # replaced on every state change

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._socket = SupervisorSocket()
        self._outbox = asyncio.Queue()
        self._wakeup = asyncio.Event()
        self._changed = asyncio.Event()
        self._set_state(WorkerState.STARTING)
        self._tasks = [asyncio.create_task(self._recv_loop(), name="iq36-supervisor-recv"),
                       asyncio.create_task(self._send_loop(), name="iq36-supervisor-send")]
        self._lifecycle_task = asyncio.create_task(self._lifecycle(), name="iq36-supervisor-lifecycle")
        self._tasks.append(self._lifecycle_task)

    async def stop(self) -> None:
        """Stop the worker (Shutdown, then SIGKILL after the grace period) and every task."""
        if self._socket is None:
            return
        self._stopping = True
        assert self._wakeup is not None
        self._wakeup.set()
        if self._worker is not None:
            self._end(self._worker, "stop", "the service is stopping")
        assert self._lifecycle_task is not None
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._lifecycle_task), self.settings.shutdown_grace_s + 10)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._worker is not None:  # lifecycle was cut short: never leave a worker behind
            await self._terminate(self._worker, graceful=False)
            self._worker = None
        self._fail_queued(ShuttingDown("the service is shutting down"))
        self._socket.close()
        self._socket = None
        self._set_state(WorkerState.STOPPED)

    async def restart_worker(self, reason: str = "ops") -> None:
        """Replace the worker now (its running request gets WorkerLost); leaves `failed` too.

        Returns once the new generation has been spawned (not when it is ready).
        """
        if reason not in RESTART_REASONS:
            raise ValueError(f"restart reason must be one of {', '.join(RESTART_REASONS)}")
        if self._stopping or self._socket is None:
            raise ShuttingDown("the service is not running")
        before = self._generation
        w = self._worker
        if w is not None and not w.end.done():
            self._end(w, reason, f"restart requested ({reason})")
        else:
            if self._state is WorkerState.FAILED:
                self._restarts[reason] += 1
            assert self._wakeup is not None
            self._wakeup.set()
        await self.wait_until(lambda s: s["worker"]["generation"] > before,
                              timeout=self.settings.shutdown_grace_s + 10)

    def drain(self) -> bool:
        """Stop admitting new requests; running and queued ones continue."""
        self._draining = True
        self._notify()
        return self._draining

    def resume(self) -> bool:
        self._draining = False
        self._notify()
        return self._draining

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def state(self) -> WorkerState:
        return self._state

    def status(self) -> dict[str, Any]:
        w = self._worker
        return {
            "worker": {
                "pid": w.pid if w is not None and w.alive else None,
                "generation": self._generation,
                "state": self._state.value,
                "rss_bytes": w.rss_bytes() if w is not None else None,
                "reason": self._reason,  # why it is failed / restarting; None when ready
            },
            "restarts": dict(self._restarts),
            "model": {"fingerprint": self._fingerprint},
            "queue": {"depth": len(self._queue)},
        }

    async def wait_until(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        """Wait (event-driven) until `predicate(status())` holds; TimeoutError otherwise."""
        async with asyncio.timeout(timeout):
            while True:
                assert self._changed is not None
                changed = self._changed
                status = self.status()
                if predicate(status):
                    return status
                await changed.wait()

    # --- requests --------------------------------------------------------------------------

    async def submit(self, request: EngineRequest, prompt: PromptSpec | None = None, *,
                     ack: bool = False) -> RequestStream:
        """Admit a request (raises a ServiceError if it cannot be) and return its output stream.

        `prompt`, if given, is tokenized by the worker and replaces `request.prompt_ids`; with
        `ack` the stream's first output is an empty one once the worker accepted the request."""
        self._admit_check()
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already queued or running")
        pending = _Pending(request, prompt=prompt, ack=ack)
        self._requests[request.request_id] = pending
        self._queue.append(pending)
        self._dispatch()
        self._notify()
        return RequestStream(self, pending)

    def abort(self, request_id: str) -> None:
        """Idempotent; unknown ids are ignored. The stream then ends with finish_reason ABORT."""
        pending = self._requests.get(request_id)
        if pending is None:
            return
        if pending in self._queue:
            self._queue.remove(pending)
            del self._requests[request_id]
            pending.mailbox.put_nowait(StepOutput(request_id=request_id, finished=True,
                                                  finish_reason=FinishReason.ABORT))
            self._notify()
        elif pending is self._running and not pending.abort_sent and self._worker is not None:
            pending.abort_sent = True
            self._send(self._worker.generation, Abort(request_id=request_id))

    def _admit_check(self) -> None:
        if self._stopping or self._socket is None:
            raise ShuttingDown("the service is shutting down")
        if self._draining:
            raise Draining("the service is draining: not admitting new requests")
        if self._state is WorkerState.FAILED:
            raise WorkerFailed(f"the worker cannot start: {self._reason}")
        if self._state is not WorkerState.READY:
            raise WorkerRestarting("the worker is restarting", retry_after=self.settings.retry_after_s)

    def _dispatch(self) -> None:
        w = self._worker
        if (self._state is WorkerState.READY and w is not None and not w.end.done()
                and self._running is None and self._queue):
            pending = self._queue.popleft()
            self._running = pending
            pending.dispatched_at = time.monotonic()
            self._send(w.generation, Add(request=pending.request, prompt=pending.prompt,
                                           ack=pending.ack))

    def _finish(self, pending: _Pending) -> None:
        self._requests.pop(pending.request.request_id, None)
        if self._running is pending:
            self._running = None
        self._dispatch()
        self._notify()

    def _fail_queued(self, error: ServiceError) -> None:
        while self._queue:
            pending = self._queue.popleft()
            self._requests.pop(pending.request.request_id, None)
            pending.mailbox.put_nowait(error)

    # --- frames ----------------------------------------------------------------------------

    def _send(self, generation: int, msg: ToWorker) -> None:
        assert self._outbox is not None
        self._outbox.put_nowait((generation, msg))

    async def _send_loop(self) -> None:
        assert self._outbox is not None and self._socket is not None
        while True:
            generation, msg = await self._outbox.get()
            w = self._worker
            if w is None or w.generation != generation:
                continue  # meant for a worker that is gone
            if not await self._socket.send(generation, msg):
                log.debug("worker g%d not connected; dropped %s", generation, type(msg).__name__)

    async def _recv_loop(self) -> None:
        assert self._socket is not None
        while True:
            generation, msg = await self._socket.recv()
            try:
                self._on_frame(generation, msg)
            except Exception:
                log.exception("failed to handle a worker frame")

    def _on_frame(self, generation: int | None, msg: FromWorker | ProtocolError) -> None:
        w = self._worker
        current = w is not None and generation == w.generation and not w.end.done()
        if isinstance(msg, ProtocolError):
            if current and isinstance(msg, ContractMismatch):
                assert w is not None
                self._end(w, "contract", str(msg))
            else:
                log.error("dropped a bad frame from worker g%s: %s", generation, msg)
            return
        if not current or msg.generation != generation:
            log.debug("dropped a late %s frame from worker g%s", type(msg).__name__, generation)
            return
        assert w is not None
        w.last_seen = time.monotonic()
        if isinstance(msg, Outputs):
            for out in msg.outputs:
                pending = self._requests.get(out.request_id)
                if pending is None:
                    continue  # aborted or unknown: dropped
                pending.mailbox.put_nowait(out)
                if out.finished:
                    self._finish(pending)
        elif isinstance(msg, Ready):
            self._on_ready(w, msg)
        elif isinstance(msg, StartupFailed):
            self._end(w, "startup_failed", msg.reason)
        elif isinstance(msg, Dead):
            self._end(w, "crash", f"worker died: {msg.reason}")

    def _on_ready(self, w: WorkerProcess[_End], msg: Ready) -> None:
        w.ready_at = time.monotonic()
        fingerprint = msg.identity.get("model", {}).get("fingerprint")
        if fingerprint:
            self._fingerprint = fingerprint
        self._reason = None
        self._set_state(WorkerState.READY)
        log.info("worker g%d ready (pid %d)", w.generation, msg.pid)
        self._emit({"event": "worker_ready", "generation": w.generation, "pid": msg.pid, **msg.identity})
        self._dispatch()

    # --- worker generations ----------------------------------------------------------------

    def _end(self, w: WorkerProcess[_End], kind: str, detail: str) -> None:
        """The first reason to end a worker wins; its running request fails right now."""
        if w.end.done():
            return
        w.end.set_result(_End(kind, detail))
        if not self._stopping:
            self._set_state(WorkerState.RESTARTING)
        running = self._running
        if running is not None:
            self._running = None
            self._requests.pop(running.request.request_id, None)
            if self._stopping:
                running.mailbox.put_nowait(ShuttingDown("the service is shutting down"))
            else:
                running.mailbox.put_nowait(WorkerLost(
                    f"the worker was lost while running this request ({kind}: {detail})",
                    retry_after=self.settings.retry_after_s))
        self._notify()

    async def _lifecycle(self) -> None:
        assert self._wakeup is not None
        consecutive = 0
        while not self._stopping:
            try:
                w = self._spawn()
            except OSError as exc:  # e.g. no python executable, fd or process limits
                log.exception("cannot spawn the worker")
                await self._failed(self._generation, f"cannot spawn the worker: {exc}")
                continue
            monitor = asyncio.create_task(self._monitor(w), name=f"iq36-supervisor-monitor-g{w.generation}")
            try:
                end = await w.end
            finally:
                monitor.cancel()
                await asyncio.gather(monitor, return_exceptions=True)
            rss = w.rss_bytes()
            await self._terminate(w, graceful=end.kind in ("ops", "stop"))
            self._worker = None
            if self._stopping:
                break
            self._reason = f"{end.kind}: {end.detail}"
            log.warning("worker g%d ended: %s", w.generation, self._reason)
            self._emit({"event": "worker_lost", "generation": w.generation, "pid": w.pid,
                        "reason": end.kind, "detail": end.detail, "rss_bytes": rss})
            if w.ready_at is None and end.kind in _CANNOT_START:
                await self._failed(w.generation, self._reason)
                consecutive = 0
                continue
            self._restarts[end.kind] = self._restarts.get(end.kind, 0) + 1
            if end.kind == "ops":
                consecutive = 0
                continue
            up_for = time.monotonic() - w.ready_at if w.ready_at is not None else 0.0
            consecutive = 1 if up_for >= self.settings.backoff_reset_s else consecutive + 1
            if consecutive > self.settings.max_consecutive_restarts:
                await self._failed(w.generation, f"{consecutive - 1} restarts in a row, none stayed up "
                                   f"{self.settings.backoff_reset_s:g}s; last: {self._reason}")
                consecutive = 0
                continue
            delay = min(self.settings.restart_backoff_initial_s * 2 ** (consecutive - 1),
                        self.settings.restart_backoff_max_s)
            self._emit({"event": "worker_restarting", "generation": w.generation + 1, "delay_s": delay})
            self._wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), delay)

    async def _failed(self, generation: int, reason: str) -> None:
        """State `failed` until an ops restart (or stop) sets the wakeup event."""
        assert self._wakeup is not None
        self._reason = reason
        self._set_state(WorkerState.FAILED)
        self._fail_queued(WorkerFailed(f"the worker cannot start: {reason}"))
        self._emit({"event": "worker_failed", "generation": generation, "reason": reason})
        log.error("worker cannot start, not retrying until `iq36 ctl restart-worker`: %s", reason)
        self._wakeup.clear()
        await self._wakeup.wait()

    def _spawn(self) -> WorkerProcess[_End]:
        assert self._socket is not None
        self._generation += 1
        try:
            self._guard = load(self.spec.profile).memory_guard  # thresholds may be relaxed live
        except ProfileError as exc:
            log.warning("keeping the previous memory guard: %s", exc)
        argv = self._command(self._socket.endpoint, self._generation)
        w: WorkerProcess[_End] = WorkerProcess(self._generation, argv, on_exit=self._on_exit)
        self._worker = w
        if self._state is not WorkerState.RESTARTING:
            self._set_state(WorkerState.STARTING)
        self._notify()
        log.info("spawned worker g%d (pid %d)", w.generation, w.pid)
        return w

    def _on_exit(self, w: WorkerProcess[_End]) -> None:
        detail = f"worker exited ({w.describe_exit()})"
        if w.ready_at is not None:
            self._end(w, "crash", detail)
        else:
            # Let a StartupFailed frame sent just before the exit land first: it says why.
            w.call_later(0.5, lambda: self._end(w, "exited", detail))

    async def _terminate(self, w: WorkerProcess[_End], graceful: bool) -> None:
        if w.alive and graceful and w.ready_at is not None:
            self._send(w.generation, Shutdown(reason="requested by the supervisor"))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(w.exited.wait(), self.settings.shutdown_grace_s)
        w.kill()
        await w.reap()

    async def _monitor(self, w: WorkerProcess[_End]) -> None:
        """Heartbeats, the hang deadline, the startup timeout and the memory guard of one worker."""
        s = self.settings
        seq = 0
        next_memory_check = 0.0
        while not w.end.done():
            await asyncio.sleep(s.heartbeat_interval_s)
            now = time.monotonic()
            seq += 1
            self._send(w.generation, Ping(seq=seq))
            if w.last_seen is not None and now - w.last_seen > s.heartbeat_deadline_s and w.alive:
                self._end(w, "hang", f"no heartbeat for {now - w.last_seen:.1f}s "
                          f"(deadline {s.heartbeat_deadline_s:g}s)")
            elif w.ready_at is None and now - w.spawned_at > s.startup_timeout_s:
                self._end(w, "startup_timeout", f"not ready after {s.startup_timeout_s:g}s")
            elif now >= next_memory_check:
                next_memory_check = now + s.memory_poll_interval_s
                self._check_memory(w)

    def _check_memory(self, w: WorkerProcess[_End]) -> None:
        guard = self._guard
        if guard.max_worker_rss_bytes > 0:
            rss = w.rss_bytes()
            if rss is not None and rss > guard.max_worker_rss_bytes:
                self._end(w, "memory_guard", f"worker RSS {rss} bytes is above max_worker_rss_bytes "
                          f"{guard.max_worker_rss_bytes}")
                return
        if guard.min_available_bytes > 0:
            available = int(psutil.virtual_memory().available)
            if available < guard.min_available_bytes:
                self._end(w, "memory_guard", f"system MemAvailable {available} bytes is below "
                          f"min_available_bytes {guard.min_available_bytes}")

    # --- plumbing --------------------------------------------------------------------------

    def _set_state(self, state: WorkerState) -> None:
        self._state = state
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def _emit(self, event: dict[str, Any]) -> None:
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                log.exception("event callback failed")
