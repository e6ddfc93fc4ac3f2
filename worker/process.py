"""The worker process shell: sockets, signals, heartbeats around one engine.

Run by the supervisor as `python -m worker.process --endpoint … --generation N …`. Two threads:

- the IO thread owns the DEALER socket (zmq sockets are not thread-safe, so nothing else
  touches it). It answers Ping at once — a long OpenVINO call releases the GIL, so a busy
  engine is never mistaken for a hang — forwards Add/Abort/Shutdown to the main thread through
  `inbox`, and sends whatever the main thread puts in `outbox` (woken through a pipe).
- the main thread checks identity, creates the engine, then loops: apply adds/aborts, `step()`
  while there is work, block on `inbox` when idle. An abort is applied between two steps, so it
  stops a generation within one decode step or one prefill chunk.

A request-level failure (prompt too long, bad parameters) is a finished StepOutput with
finish_reason ERROR and a typed error string. A prompt sent as text or chat messages
(`Add.prompt`) is tokenized here, with the engine's tokenizer and the model's chat template,
just before `engine.add`; an accepted request is acknowledged at once (if `Add.ack`) with an
empty output that carries its prompt length. An exception from `step()` kills the worker (its engine state is
unknown) after a Dead frame. Exit codes say why a worker stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import msgspec

from ipc.codec import ProtocolError
from ipc.messages import (
    CONTRACT_VERSION,
    ERROR_CONTEXT_LENGTH,
    ERROR_INVALID_REQUEST,
    ERROR_OUTPUT_LIMIT,
    Abort,
    Add,
    Dead,
    FromWorker,
    Outputs,
    Ping,
    Pong,
    PromptSpec,
    Ready,
    Shutdown,
    StartupFailed,
    ToWorker,
    error_text,
)
from ipc.sockets import WorkerSocket
from worker.engine.types import FinishReason, OutputTooLong, PromptTooLong, StepOutput

log = logging.getLogger("worker.process")  # not __main__: it runs as `python -m`

EXIT_OK = 0
EXIT_REFUSED = 3  # identity / profile check failed: retrying cannot help
EXIT_STARTUP = 4  # the engine could not be created
EXIT_ENGINE_DEAD = 70  # the engine loop raised (EX_SOFTWARE)
EXIT_ORPHANED = 75  # the supervisor vanished and the engine did not stop in time

_ORPHAN_GRACE_S = 10.0
_IDLE_TICK_S = 30.0  # how often an idle worker lets the engine expire idle cache entries

_CLOSE = object()  # outbox sentinel: flush and close the socket


class IOThread(threading.Thread):
    """Owns the socket; see the module docstring."""

    def __init__(self, endpoint: str, generation: int, inbox: queue.SimpleQueue[ToWorker]) -> None:
        super().__init__(name=f"iq36-worker-io-g{generation}", daemon=True)
        self._endpoint = endpoint
        self._generation = generation
        self._inbox = inbox
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._parent = os.getppid()

    # Called from the main thread.
    def send(self, msg: FromWorker) -> None:
        self._outbox.put(msg)
        self._wake()

    def close(self, timeout_s: float = 5.0) -> None:
        self._outbox.put(_CLOSE)
        self._wake()
        self.join(timeout_s)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        # A full pipe already means "wake up"; nothing is lost.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def run(self) -> None:
        sock = WorkerSocket(self._endpoint, self._generation)
        sock.watch_fd(self._wake_r)
        try:
            self._loop(sock)
        except Exception:
            # The supervisor sees the missing Pongs and replaces this worker.
            log.exception("worker IO thread failed")
        finally:
            sock.close()

    def _loop(self, sock: WorkerSocket) -> None:
        orphaned_at: float | None = None
        while True:
            sock.wait(1.0)
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):
                    pass
            while True:
                try:
                    out = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if out is _CLOSE:
                    return
                sock.send(out)
            while True:
                try:
                    msg = sock.recv_nowait()
                except ProtocolError as exc:
                    log.error("dropped a frame: %s", exc)
                    continue
                if msg is None:
                    break
                if isinstance(msg, Ping):
                    sock.send(Pong(seq=msg.seq, generation=self._generation))
                else:
                    self._inbox.put(msg)
            if os.getppid() != self._parent:
                # Our supervisor is gone (its process died without stopping us): exit, never
                # hold the model's memory as an orphan — at the next step boundary, or now if
                # the engine does not get there in time.
                if orphaned_at is None:
                    orphaned_at = time.monotonic()
                    self._inbox.put(Shutdown(reason="supervisor gone"))
                elif time.monotonic() - orphaned_at > _ORPHAN_GRACE_S:
                    os._exit(EXIT_ORPHANED)


def _error_output(request_id: str, code: str, exc: BaseException) -> StepOutput:
    return StepOutput(request_id=request_id, finished=True, finish_reason=FinishReason.ERROR,
                      error=error_text(code, str(exc)))


class EngineLoop:
    """The main thread's loop over an engine (anything with add/abort/step/has_work)."""

    def __init__(self, engine: Any, io: IOThread, inbox: queue.SimpleQueue[ToWorker], generation: int):
        self._engine = engine
        self._io = io
        self._inbox = inbox
        self._generation = generation
        # Requests added and not finished, with their last output (for the counts of an abort).
        self._live: dict[str, StepOutput] = {}

    def run(self) -> int:
        while True:
            msgs = [] if self._engine.has_work() else self._wait()
            while True:
                try:
                    msgs.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            outs: list[StepOutput] = []
            for msg in msgs:
                if isinstance(msg, Shutdown):
                    log.info("shutting down: %s", msg.reason or "requested")
                    return EXIT_OK
                if isinstance(msg, Add):
                    self._add(msg, outs)
                elif isinstance(msg, Abort):
                    self._abort(msg.request_id, outs)
            if self._engine.has_work():
                try:
                    stepped = self._engine.step()
                except Exception as exc:
                    log.exception("engine step failed")
                    self._io.send(Dead(generation=self._generation, reason=f"{type(exc).__name__}: {exc}"))
                    return EXIT_ENGINE_DEAD
                for out in stepped:
                    # Outputs of requests we already finished (e.g. aborted) are dropped.
                    if out.request_id in self._live:
                        outs.append(out)
                        if out.finished:
                            del self._live[out.request_id]
                        else:
                            self._live[out.request_id] = out
            if outs:
                self._io.send(Outputs(generation=self._generation, outputs=outs))

    def _wait(self) -> list[ToWorker]:
        """Block until a message arrives. Meanwhile, every `_IDLE_TICK_S`, let the engine drop
        what it keeps only for a while (the prefix cache's idle snapshots): an idle worker must
        not hold that memory until the next request."""
        while True:
            try:
                return [self._inbox.get(timeout=_IDLE_TICK_S)]
            except queue.Empty:
                cache = getattr(self._engine, "prefix_cache", None)
                if cache is not None:
                    cache.prune()

    def _add(self, msg: Add, outs: list[StepOutput]) -> None:
        rid = msg.request.request_id
        if rid in self._live:
            outs.append(_error_output(rid, ERROR_INVALID_REQUEST, ValueError(f"duplicate request id {rid}")))
            return
        request = msg.request
        if msg.prompt is not None:
            try:
                request = msgspec.structs.replace(request, prompt_ids=tuple(self._tokenize(msg.prompt)))
            except Exception as exc:  # e.g. the chat template rejects the messages
                log.warning("prompt rejected: %s", exc, extra={"request_id": rid})
                outs.append(_error_output(rid, ERROR_INVALID_REQUEST, ValueError(f"the prompt cannot be "
                                                                                 f"tokenized: {exc}")))
                return
        try:
            self._engine.add(request)
        except PromptTooLong as exc:
            outs.append(_error_output(rid, ERROR_CONTEXT_LENGTH, exc))
        except OutputTooLong as exc:
            outs.append(_error_output(rid, ERROR_OUTPUT_LIMIT, exc))
        except ValueError as exc:
            outs.append(_error_output(rid, ERROR_INVALID_REQUEST, exc))
        except Exception as exc:  # request-level failures stay request-level
            log.exception("engine.add failed", extra={"request_id": rid})
            outs.append(_error_output(rid, "internal_error", exc))
        else:
            accepted = StepOutput(request_id=rid, prompt_tokens=len(request.prompt_ids))
            self._live[rid] = accepted
            if msg.ack:
                # No tokens, the prompt's length: the front end then knows the request passed
                # every check and can commit to a 200 stream before the prefill ends.
                outs.append(accepted)

    def _tokenize(self, prompt: PromptSpec) -> list[int]:
        """Text or chat messages -> token ids, with the engine's own tokenizer and template."""
        tokenizer = self._engine.tokenizer
        if prompt.messages is not None:
            text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                                 **prompt.template_kwargs)
            # The rendered template already holds every special token it needs.
            return list(tokenizer.encode(text, add_special_tokens=False))
        return list(tokenizer.encode(prompt.text or ""))

    def _abort(self, rid: str, outs: list[StepOutput]) -> None:
        if rid not in self._live:
            return  # idempotent: unknown or already finished
        self._engine.abort(rid)
        last = self._live.pop(rid)
        # Finish it here rather than waiting for the engine: the abort is then visible to the
        # caller without another step, whatever the engine reports for an aborted request.
        outs.append(StepOutput(request_id=rid, finished=True, finish_reason=FinishReason.ABORT,
                               prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens))


WARMUP_TEXT = "An untimed request that iq36's worker runs before it reports ready. "


def warm_up(engine: Any, tokens: int) -> None:
    """One greedy request of `tokens` prompt tokens and two generated ones, outside the prefix
    cache: what the device does once, on its first long prefill and first decode steps (the CPU
    plugin converts its compressed weights for its larger matmul kernels then), happens before
    READY instead of in the first user's request. A failure here is a startup failure."""
    from worker.engine import EngineRequest, SamplingParams

    text = tuple(engine.tokenizer.encode(WARMUP_TEXT, add_special_tokens=False))
    ids = (text * (tokens // len(text) + 1))[:tokens]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add(EngineRequest("warm-up", ids, params, reuse_prefix=False))
    while engine.has_work():
        for out in engine.step():
            if out.finished and out.error:
                raise RuntimeError(f"the warm-up request failed: {out.error}")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker.process",
                                description="iq36 worker process (started by the supervisor)")
    p.add_argument("--endpoint", required=True, help="the supervisor's ipc:// endpoint")
    p.add_argument("--generation", type=int, required=True)
    p.add_argument("--model", type=Path, required=True, help="model directory")
    p.add_argument("--engine", required=True)
    p.add_argument("--profile", required=True, help="profile name or TOML path")
    p.add_argument("--identity", choices=["full", "metadata", "off"], default="full")
    p.add_argument("--expect-profile-hash")
    p.add_argument("--warmup-tokens", type=int, default=0,
                   help="prompt tokens of one untimed request before READY (0: none)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from worker.settings import configure_logging

    args = _parse(argv)
    configure_logging()
    inbox: queue.SimpleQueue[ToWorker] = queue.SimpleQueue()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        inbox.put(Shutdown(reason="SIGTERM"))  # SimpleQueue.put is reentrant: safe here

    signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C in a terminal reaches the whole process group; the supervisor decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Start answering pings before the heavy imports, so startup is observably alive.
    io = IOThread(args.endpoint, args.generation, inbox)
    io.start()
    try:
        return _serve(args, io, inbox)
    finally:
        io.close()


def _serve(args: argparse.Namespace, io: IOThread, inbox: queue.SimpleQueue[ToWorker]) -> int:
    from iq36.manifest import IdentityError, IdentityMode
    from iq36.profile import ProfileError, load

    gen = args.generation
    t0 = time.monotonic()
    try:
        profile = load(args.profile)
        from worker.identity import check

        identity = check(args.model, profile, IdentityMode(args.identity), args.expect_profile_hash)
    except (ProfileError, IdentityError, OSError) as exc:
        log.error("refused to start: %s", exc)
        io.send(StartupFailed(generation=gen, reason=f"refused to start: {exc}"))
        return EXIT_REFUSED
    try:
        from worker.engine import create

        engine = create(args.engine, args.model, profile)
    except Exception as exc:
        log.exception("engine %s failed to start", args.engine)
        io.send(StartupFailed(generation=gen,
                              reason=f"engine {args.engine} failed to start: {type(exc).__name__}: {exc}"))
        return EXIT_STARTUP
    try:
        identity["engine"] = args.engine
        if args.warmup_tokens > 0:
            t1 = time.monotonic()
            try:
                warm_up(engine, args.warmup_tokens)
            except Exception as exc:
                log.exception("engine %s failed its warm-up request", args.engine)
                io.send(StartupFailed(generation=gen, reason=f"engine {args.engine} failed its warm-up request: "
                                                             f"{type(exc).__name__}: {exc}"))
                return EXIT_STARTUP
            log.info("warm-up: %d prompt tokens in %.2f s", args.warmup_tokens, time.monotonic() - t1)
        identity["resolved"] = {"startup_s": round(time.monotonic() - t0, 2)}
        # Optional engine hook: what the device resolved to (e.g. inference precision).
        describe = getattr(engine, "describe", None)
        if callable(describe):
            identity["resolved"].update(describe())
        io.send(Ready(contract_version=CONTRACT_VERSION, generation=gen, pid=os.getpid(), identity=identity))
        return EngineLoop(engine, io, inbox, gen).run()
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
