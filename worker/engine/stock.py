"""The stock engine: unmodified openvino-genai `LLMPipeline` on the model dir — the baseline.

`LLMPipeline.generate` is one blocking call per request, so it runs in a named thread
(`iq36-stock-generate`), fed one request at a time by `step()`. A streamer sees every token:
it runs the same `worker/detok.py` output logic as the candidate (EOS / stop ids, stop
strings, max_tokens), so both engines emit text identically, and it ends generation with
STOP when the output is finished or CANCEL once the request was aborted. genai's prefill is
one uninterruptible call: an abort is reported at the next `step()` and honoured by genai at
its first streamer callback; the next request starts once `generate` has returned.

Output constraints: json_object / json_schema go to genai's own structured output (xgrammar,
`StructuredOutputConfig(json_schema=...)`). xgrammar silently ignores schema keywords it does not
implement, so admission runs the candidate's schema check (`worker.grammar.build_grammar`) and
both engines reject the same schemas. tool_calls and after_reasoning are refused at `add()`.
genai's JSON grammar allows unbounded whitespace between JSON tokens (the candidate bounds it).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from iq36.profile import Profile
from worker.detok import OutputStream
from worker.engine import check_request
from worker.engine.types import EngineRequest, FinishReason, OutputConstraint, SamplingParams, StepOutput
from worker.tokenizer import ModelTokenizer, read_vocab_size

log = logging.getLogger(__name__)

THREAD_NAME = "iq36-stock-generate"
STEP_WAIT_S = 0.05  # step() blocks at most this long when the thread has produced nothing


def structured_output(constraint: OutputConstraint) -> Any:
    """genai's StructuredOutputConfig for `constraint`, or ValueError naming what it cannot honour."""
    import openvino_genai

    from worker.grammar import build_grammar

    if constraint.kind == "tool_calls":
        raise ValueError("tool_calls output constraints are not supported by the stock engine")
    if constraint.after_reasoning:
        # genai's grammar would apply from the first token: it cannot wait for `</think>`.
        raise ValueError("constraints after reasoning (an open <think> block) are not supported by the stock engine")
    build_grammar(constraint)  # unknown kind, invalid JSON, schema features no engine enforces
    schema = constraint.schema if constraint.kind == "json_schema" else '{"type": "object"}'
    return openvino_genai.StructuredOutputConfig(json_schema=schema)


def generation_config(
    params: SamplingParams, eos_token_ids: tuple[int, ...], constraint: OutputConstraint | None = None
) -> Any:
    """A genai GenerationConfig equal to `params` (and `constraint`), or ValueError naming what
    genai cannot honour.

    Built from a blank config, not the pipeline's: the model's generation_config.json defaults
    (do_sample, temperature, top_k…) are the gateway's business, not the engine's.
    """
    import openvino_genai

    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        # genai moves a logit towards zero (subtracts when >= 0, adds when < 0); OpenAI semantics
        # always subtract. Checked on genai 2026.4: its greedy tokens under frequency_penalty=2
        # match the sign-dependent rule, not OpenAI's. Serving them would change the output.
        raise ValueError(
            "presence_penalty / frequency_penalty are not supported by the stock engine: "
            "openvino-genai applies them with different semantics than OpenAI's"
        )
    cfg = openvino_genai.GenerationConfig()
    cfg.max_new_tokens = params.max_tokens
    cfg.ignore_eos = params.ignore_eos
    if eos_token_ids:
        cfg.eos_token_id = eos_token_ids[0]
    # genai requires eos_token_id among stop_token_ids and lets ignore_eos decide; the streamer
    # enforces the request's stop ids itself (so ignore_eos never disables them).
    cfg.stop_token_ids = set(params.stop_token_ids) | set(eos_token_ids)
    cfg.repetition_penalty = params.repetition_penalty
    if params.temperature == 0.0:
        cfg.do_sample = False
    else:
        cfg.do_sample = True
        cfg.temperature = params.temperature
        cfg.top_p = params.top_p
        if params.top_k > 0:
            cfg.top_k = params.top_k
        cfg.min_p = params.min_p
        # genai's default rng_seed is a constant: no seed must mean fresh entropy, as in the candidate.
        cfg.rng_seed = params.seed if params.seed is not None else secrets.randbits(63)
    if constraint is not None:
        cfg.structured_output_config = structured_output(constraint)
    try:
        cfg.validate()
    except RuntimeError as exc:
        raise ValueError(f"openvino-genai rejects these sampling parameters: {exc}") from None
    return cfg


class _Job:
    """One request inside the generation thread."""

    def __init__(self, req: EngineRequest, tokenizer: ModelTokenizer) -> None:
        self.req = req
        self.stream = OutputStream(tokenizer.decode, req.params, tokenizer.eos_token_ids)
        self.cfg = generation_config(req.params, tokenizer.eos_token_ids, req.constraint)
        self.aborted = threading.Event()
        self.reported = False  # the final output was handed to the caller
        # Tokens and text of the finishing token(s): sent with the final output, after
        # generate() returns, so the caller knows the thread is free when it sees `finished`.
        self.tail_tokens: list[int] = []
        self.tail_text = ""

    def output(self, tokens: list[int], text: str, error: str | None = None) -> StepOutput:
        return self.stream.step_output(self.req.request_id, len(self.req.prompt_ids), tokens, text, error)


class StockEngine:
    """The `Engine` protocol over openvino-genai's `LLMPipeline`."""

    def __init__(self, model_dir: Path, profile: Profile, tokenizer: ModelTokenizer | None = None) -> None:
        import openvino_genai

        self.profile = profile
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer or ModelTokenizer(self.model_dir)
        self.vocab_size = read_vocab_size(self.model_dir)
        properties: dict[str, Any] = dict(profile.engine.properties)
        if profile.engine.attention_backend:
            properties["ATTENTION_BACKEND"] = profile.engine.attention_backend
        self._pipe = openvino_genai.LLMPipeline(str(self.model_dir), profile.engine.device, **properties)
        self._streamer_base = openvino_genai.StreamerBase
        self._status = openvino_genai.StreamingStatus
        self._waiting: deque[EngineRequest] = deque()
        self._ready: list[StepOutput] = []
        self._current: _Job | None = None  # handed to the thread, generate() not yet returned
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._outbox: queue.Queue[tuple[_Job, StepOutput]] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # -- contract --------------------------------------------------------------------------

    def add(self, req: EngineRequest) -> None:
        check_request(req, self.profile, self.vocab_size)
        generation_config(req.params, self.tokenizer.eos_token_ids, req.constraint)  # what genai cannot honour
        if self._known(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is already queued or running")
        self._waiting.append(req)

    def abort(self, request_id: str) -> None:
        job = self._current
        if job is not None and job.req.request_id == request_id and not job.reported:
            job.aborted.set()  # genai cancels at its next streamer callback
            job.reported = True
            self._ready.append(StepOutput(
                request_id=request_id, finished=True, finish_reason=FinishReason.ABORT,
                prompt_tokens=len(job.req.prompt_ids), completion_tokens=len(job.stream.token_ids),
            ))
            return
        for req in self._waiting:
            if req.request_id == request_id:
                self._waiting.remove(req)
                self._ready.append(StepOutput(request_id=request_id, finished=True,
                                              finish_reason=FinishReason.ABORT,
                                              prompt_tokens=len(req.prompt_ids)))
                return

    def step(self) -> list[StepOutput]:
        outputs, self._ready = self._ready, []
        self._start_next(outputs)
        if self._current is None:
            return outputs
        merged: dict[str, StepOutput] = {}
        try:  # wait only when there is nothing at all to return yet
            item: tuple[_Job, StepOutput] | None = (
                self._outbox.get_nowait() if outputs else self._outbox.get(timeout=STEP_WAIT_S)
            )
        except queue.Empty:
            item = None
        while item is not None:
            job, out = item
            if out.finished and job is self._current:
                self._current = None  # generate() has returned: the thread is free
            if not job.reported:
                job.reported = out.finished
                prev = merged.get(out.request_id)
                if prev is None:
                    merged[out.request_id] = out
                else:  # several tokens since the last step: one output per request
                    prev.token_ids.extend(out.token_ids)
                    prev.text += out.text
                    prev.finished, prev.finish_reason = out.finished, out.finish_reason
                    prev.completion_tokens, prev.error = out.completion_tokens, out.error
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                item = None
        outputs.extend(merged.values())
        self._start_next(outputs)
        return outputs

    def has_work(self) -> bool:
        return bool(self._ready or self._waiting or self._current is not None)

    def close(self) -> None:
        self._waiting.clear()
        if self._current is not None:
            self._current.aborted.set()
        self._inbox.put(None)
        self._thread.join()
        self._pipe = None

    # -- main-thread side ----------------------------------------------------------------------

    def _known(self, request_id: str) -> bool:
        job = self._current
        if job is not None and job.req.request_id == request_id and not job.reported:
            return True
        return any(r.request_id == request_id for r in self._waiting)

    def _start_next(self, outputs: list[StepOutput]) -> None:
        if self._current is not None or not self._waiting:
            return
        req = self._waiting.popleft()
        try:
            job = _Job(req, self.tokenizer)
        except Exception as exc:  # request-level: report, keep serving
            outputs.append(StepOutput(request_id=req.request_id, finished=True,
                                      finish_reason=FinishReason.ERROR, error=str(exc),
                                      prompt_tokens=len(req.prompt_ids)))
            return
        self._current = job
        self._inbox.put(job)

    # -- generation thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            job = self._inbox.get()
            if job is None:
                return
            self._generate(job)

    def _generate(self, job: _Job) -> None:
        import openvino as ov

        streamer = self._make_streamer(job)
        error: str | None = None
        produced: list[int] = []
        try:
            if not job.aborted.is_set():
                ids = ov.Tensor(np.array([job.req.prompt_ids], dtype=np.int64))
                result = self._pipe.generate(ids, job.cfg, streamer)
                produced = [int(t) for t in result.tokens[0]]
        except Exception as exc:
            log.exception("request %s failed", job.req.request_id)
            error = f"{type(exc).__name__}: {exc}"
        if job.aborted.is_set():
            job.stream.finish(FinishReason.ABORT)
        elif error is not None:
            job.stream.finish(FinishReason.ERROR)
        else:
            # Tokens genai generated but did not stream (it may stop on EOS silently).
            for token in produced[len(job.stream.token_ids):]:
                if job.stream.finished:
                    break
                job.tail_tokens.append(token)
                job.tail_text += job.stream.push(token)
            if not job.stream.finished:
                reason = (FinishReason.LENGTH if len(job.stream.token_ids) >= job.req.params.max_tokens
                          else FinishReason.STOP)
                job.tail_text += job.stream.finish(reason)
        self._outbox.put((job, job.output(job.tail_tokens, job.tail_text, error)))

    def _make_streamer(self, job: _Job) -> Any:
        status = self._status
        outbox = self._outbox

        class _Streamer(self._streamer_base):  # type: ignore[name-defined,misc]
            def write(self, token: int | list[int]) -> Any:
                if job.aborted.is_set():
                    return status.CANCEL
                for t in [token] if isinstance(token, int) else token:
                    if job.stream.finished:
                        break
                    text = job.stream.push(int(t))
                    if job.stream.finished:
                        job.tail_tokens.append(int(t))
                        job.tail_text += text
                    else:
                        outbox.put((job, job.output([int(t)], text)))
                return status.STOP if job.stream.finished else status.RUNNING

            def end(self) -> None:
                pass

        return _Streamer()
