"""The engine contract: what every engine (stock, candidate) takes and returns.

An engine is pure and single-threaded from the caller's view: `add` queues a request, `abort`
cancels one (idempotent, unknown ids ignored), `step` does one unit of work — one prefill chunk
or one decode step of the running request (the stock engine: whatever its generation thread
produced since the last call) — and returns the outputs of that step. Batch size is 1: requests
run one at a time in FIFO order. No sockets, no signals: the worker's process shell owns those.
"""

from __future__ import annotations

import enum

import msgspec


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the request failed; see StepOutput.error


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_tokens: int = 512
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 => off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # never emitted, even when split across tokens
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class OutputConstraint(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the output must match, enforced by constrained decoding (a grammar over the logits).

    `kind`: "json_object" (any JSON object), "json_schema" (`schema`, JSON text), or
    "tool_calls" (the model's `<tool_call>` markup for `tools` — JSON text of OpenAI function
    tools — whose arguments obey each tool's parameter schema; `tool_name` forces one tool;
    `parallel` allows more than one call). With `after_reasoning` the constraint starts once the
    model closes its `<think>` block (the prompt opened it), so the reasoning stays free.
    """

    kind: str
    schema: str | None = None
    tools: str | None = None
    tool_name: str | None = None
    parallel: bool = True
    after_reasoning: bool = False


class EngineRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    # Appended: constrained decoding (None = free text).
    constraint: OutputConstraint | None = None
    # Appended: False bypasses prefix-state reuse for this request (it neither reads nor fills
    # the cache).
    reuse_prefix: bool = True


class StepOutput(msgspec.Struct):
    request_id: str
    token_ids: list[int] = []  # tokens produced in this step (may be empty, e.g. a prefill chunk)
    text: str = ""  # newly decodable text: valid UTF-8, stop strings withheld
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    error: str | None = None
    # Appended: prompt tokens served from a prefix-state snapshot instead of being prefilled
    # (set on the request's first output that carries tokens, and kept on later ones).
    cached_tokens: int = 0


class PromptTooLong(ValueError):
    """The prompt exceeds the profile's max_prompt_tokens; raised by `add`, never truncated."""


class OutputTooLong(ValueError):
    """max_tokens exceeds the profile's max_output_tokens; raised by `add`."""
