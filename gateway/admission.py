"""Admission: one running request, a bounded FIFO behind it, a deadline per request.

`AdmissionQueue.submit` fails fast (TGI-style try-acquire): 429 `queue_full` + Retry-After when
the running request and `max_queue` waiting ones are already admitted, 503 `shutting_down` once
shutdown began, the supervisor's own refusals (draining, worker restarting) mapped to 503s. The
FIFO itself is the supervisor's (it dispatches the next request the moment one finishes); this
module bounds it and owns each admitted request's `Generation`: its output stream with the
deadline (504 `request_timeout`, and the generation is aborted), its latency metrics, and its
release. Aborting is idempotent at every layer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from gateway.errors import APIError, from_service_error, from_worker_error
from gateway.metrics import Metrics
from gateway.protocol import Job
from worker.engine.types import EngineRequest, FinishReason, StepOutput
from worker.errors import ServiceError
from worker.settings import ServiceSettings
from worker.supervisor import RequestStream, Supervisor

log = logging.getLogger(__name__)


class Generation:
    """The outputs of one admitted request, as an async iterator that raises `APIError`s."""

    def __init__(self, queue: AdmissionQueue, stream: RequestStream, job: Job, deadline: float | None) -> None:
        self._queue = queue
        self._stream = stream
        self.job = job
        self.id = stream.request_id
        self.created = int(time.time())
        self._deadline = deadline
        self._admitted = time.monotonic()
        self._last: float | None = None  # time of the last output with tokens
        self._abort_code: str | None = None
        self._aborting = False
        self.finished = False
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: FinishReason | None = None

    @property
    def running(self) -> bool:
        return not self.finished and self._stream.queue_wait_s is not None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout_at(self._deadline):
                out = await anext(self._stream)
        except TimeoutError:
            self.abort("deadline", "request_timeout")
            self._release()  # the consumer reads no further
            raise APIError("request_timeout", "the request did not finish within its deadline of "
                           f"{self._queue.settings.request_timeout_s:g}s; it was aborted") from None
        except ServiceError as exc:
            self._release()
            raise from_service_error(exc) from None
        except StopAsyncIteration:
            self._release()
            raise
        self._observe(out)
        if out.finished:
            self._release()
            if out.finish_reason is FinishReason.ERROR:
                raise from_worker_error(out.error or "internal_error: the request failed")
            if out.finish_reason is FinishReason.ABORT:
                code = self._abort_code or "internal_error"
                raise APIError(code, "the request was aborted" + (" (the service is shutting down)"
                                                                   if code == "shutting_down" else ""),
                               retry_after=self._queue.settings.retry_after_s if code == "shutting_down" else None)
        return out

    def abort(self, reason: str, code: str | None = None) -> None:
        """Stop the generation (idempotent). `code` is the error the consumer then sees."""
        if self.finished:
            return
        if not self._aborting:  # count and log the first reason only
            self._aborting = True
            self._abort_code = code
            self._queue.metrics.aborts.labels(reason).inc()
            log.info("aborting the generation: %s", reason)
            self._stream.abort()
        if code is None:
            self._release()  # nobody consumes it any more (client gone)

    def close(self) -> None:
        """The consumer is done: an unfinished generation is aborted (the client went away)."""
        if not self.finished:
            self.abort("client_disconnect")
        self._release()

    def _observe(self, out: StepOutput) -> None:
        m = self._queue.metrics
        now = time.monotonic()
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.token_ids:
            m.generation_tokens.inc(len(out.token_ids))
            if self._last is None:
                m.ttft.labels(self.job.endpoint).observe(now - self._admitted)
                wait = self._stream.queue_wait_s
                if wait is not None:
                    m.queue_wait.observe(wait)
                    prefill_s = now - self._admitted - wait
                    if prefill_s > 0 and self.prompt_tokens:
                        m.prefill_rate.observe(self.prompt_tokens / prefill_s)
            else:
                m.inter_token.observe(now - self._last)
            self._last = now
        if out.finished:
            self.finish_reason = out.finish_reason
            m.e2e.labels(self.job.endpoint).observe(now - self._admitted)
            m.prompt_tokens.inc(self.prompt_tokens)
            m.cached_tokens.inc(self.cached_tokens)

    def _release(self) -> None:
        self.finished = True
        self._queue._release(self)


class AdmissionQueue:
    def __init__(self, supervisor: Supervisor, settings: ServiceSettings, metrics: Metrics) -> None:
        self.supervisor = supervisor
        self.settings = settings
        self.metrics = metrics
        self._live: set[Generation] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        metrics.running.set_function(lambda: sum(1 for g in self._live if g.running))

    @property
    def closed(self) -> bool:
        return self._closed

    def in_flight(self) -> int:
        return len(self._live)

    async def submit(self, job: Job) -> Generation:
        if self._closed:
            raise APIError("shutting_down", "the service is shutting down", retry_after=self.settings.retry_after_s)
        if len(self._live) >= 1 + self.settings.max_queue:
            raise APIError("queue_full", f"the queue is full ({self.settings.max_queue} requests waiting behind "
                           "the running one); retry later", retry_after=self.settings.retry_after_s)
        request = EngineRequest(request_id=uuid.uuid4().hex, prompt_ids=job.prompt_ids, params=job.params,
                                constraint=job.constraint, reuse_prefix=job.reuse_prefix)
        try:
            stream = await self.supervisor.submit(request, job.prompt, ack=True)
        except ServiceError as exc:
            raise from_service_error(exc) from None
        timeout = self.settings.request_timeout_s
        deadline = time.monotonic() + timeout if timeout > 0 else None
        # asyncio.timeout_at uses the loop clock; it is time.monotonic on Linux's default loop.
        gen = Generation(self, stream, job, deadline)
        self._live.add(gen)
        self._idle.clear()
        return gen

    def close(self) -> None:
        """Stop admitting (503 shutting_down); admitted requests continue."""
        self._closed = True

    async def drain(self, grace_s: float) -> int:
        """Wait up to `grace_s` for admitted requests to finish, then abort the rest; how many were aborted."""
        self.close()
        try:
            async with asyncio.timeout(grace_s):
                await self._idle.wait()
            return 0
        except TimeoutError:
            left = list(self._live)
            for gen in left:
                gen.abort("shutdown", "shutting_down")
            return len(left)

    async def wait_idle(self, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            await self._idle.wait()

    def _release(self, gen: Generation) -> None:
        self._live.discard(gen)
        if not self._live:
            self._idle.set()
