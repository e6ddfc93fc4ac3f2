"""The engines behind the worker: the `Engine` protocol, `create`, and request admission checks.

Both engines (`stock`: unmodified openvino-genai `LLMPipeline`; `candidate`: our own loop over
`openvino.Core`) implement the same contract (see `types`), take the same profile and check
requests the same way, so an A/B differs only in the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from iq36.profile import Profile
from worker.engine.types import (
    EngineRequest,
    FinishReason,
    OutputTooLong,
    PromptTooLong,
    SamplingParams,
    StepOutput,
)

__all__ = [
    "KINDS",
    "Engine",
    "EngineRequest",
    "FinishReason",
    "OutputTooLong",
    "PromptTooLong",
    "SamplingParams",
    "StepOutput",
    "check_request",
    "create",
]

KINDS = ("candidate", "stock")


@runtime_checkable
class Engine(Protocol):
    def add(self, req: EngineRequest) -> None:
        """Queue a request (FIFO). Raises PromptTooLong / OutputTooLong / ValueError up front."""

    def abort(self, request_id: str) -> None:
        """Cancel a queued or running request; its final output says ABORT. Unknown ids: no-op."""

    def step(self) -> list[StepOutput]:
        """One unit of work; the outputs it produced (possibly none)."""

    def has_work(self) -> bool:
        """True while a request is queued or running or an output is still to be returned."""

    def close(self) -> None:
        """Release the model and stop any thread the engine owns."""


def check_request(req: EngineRequest, profile: Profile, vocab_size: int | None = None) -> None:
    """Admission checks shared by both engines: nothing is generated for a rejected request."""
    n = len(req.prompt_ids)
    if n == 0:
        raise ValueError("the prompt is empty: at least one token is required")
    limit = profile.limits.max_prompt_tokens
    if n > limit:
        raise PromptTooLong(
            f"the prompt has {n} tokens, more than the maximum of {limit} input tokens"
        )
    p = req.params
    if p.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
    cap = profile.limits.max_output_tokens
    if p.max_tokens > cap:
        raise OutputTooLong(f"max_tokens is {p.max_tokens}, more than the maximum of {cap} output tokens")
    if vocab_size is not None:
        bad = next((t for t in req.prompt_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
        bad = next((t for t in p.stop_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop token id {bad} is outside the vocabulary [0, {vocab_size})")
    from worker.sampling import validate_params  # lazy: worker.sampling imports this package

    validate_params(p)


def create(kind: str, model_dir: Path, profile: Profile) -> Engine:
    """Build the engine named `kind` on `model_dir` with `profile` (compiles the model)."""
    if kind == "candidate":
        from worker.engine.candidate import CandidateEngine

        return CandidateEngine(model_dir, profile)
    if kind == "stock":
        from worker.engine.stock import StockEngine

        return StockEngine(model_dir, profile)
    raise ValueError(f"unknown engine {kind!r}: valid engines are {', '.join(KINDS)}")
