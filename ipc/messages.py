"""The messages that cross the worker socket, one tagged union per direction.

Hot-path Structs follow vLLM v1: `array_like=True, omit_defaults=True, gc=False`; the tag is the
first array element. Fields are only ever appended, with defaults, so an older peer decodes a
newer frame (msgspec ignores trailing extra elements); anything else bumps `CONTRACT_VERSION`,
which the worker announces in `Ready` and the supervisor checks before trusting anything else.
Every frame from the worker carries its generation so late output of a replaced worker is
recognisable. Request payloads reuse the engine contract (`worker.engine.types`), which is pure
msgspec and imports no OpenVINO.
"""

from __future__ import annotations

from typing import Any

import msgspec

from worker.engine.types import EngineRequest, StepOutput

# Bump on any change that is not "append a field with a default".
CONTRACT_VERSION = 1


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base: positional, tagged by class name."""


# --- supervisor -> worker ----------------------------------------------------------------------

class PromptSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """A prompt the worker tokenizes (the front end holds no tokenizer): plain `text`, or chat
    `messages` rendered with the model's own chat template (`template_kwargs` become template
    context, e.g. `enable_thinking`). The token ids then replace `EngineRequest.prompt_ids`."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = {}


class Add(_Msg, tag="add"):
    request: EngineRequest
    # Appended in contract 1 (no bump): None = `request.prompt_ids` is the prompt as given.
    prompt: PromptSpec | None = None
    # Appended: answer an accepted add at once with an empty output (no tokens, prompt_tokens
    # set), so the front end knows every check passed before the first token.
    ack: bool = False


class Abort(_Msg, tag="abort"):
    request_id: str


class Ping(_Msg, tag="ping"):
    seq: int


class Shutdown(_Msg, tag="shutdown"):
    reason: str = ""


ToWorker = Add | Abort | Ping | Shutdown


# --- worker -> supervisor ----------------------------------------------------------------------

class Ready(_Msg, tag="ready"):
    # contract_version stays the first field forever: it is read before anything else is trusted.
    contract_version: int
    generation: int
    pid: int
    identity: dict[str, Any] = {}


class Outputs(_Msg, tag="outputs"):
    """Every delta of one engine step, in one envelope."""

    generation: int
    outputs: list[StepOutput] = []


class Pong(_Msg, tag="pong"):
    seq: int
    generation: int


class StartupFailed(_Msg, tag="startup_failed"):
    generation: int
    reason: str


class Dead(_Msg, tag="dead"):
    """The worker's engine loop failed; sent on a lingering socket just before it exits."""

    generation: int
    reason: str


FromWorker = Ready | Outputs | Pong | StartupFailed | Dead


# Typed error strings in StepOutput.error: "<code>: <message>", code from this set. The code is
# the stable error code the gateway maps to an HTTP status (SPEC §4).
ERROR_CONTEXT_LENGTH = "context_length_exceeded"
ERROR_OUTPUT_LIMIT = "output_limit_exceeded"
ERROR_INVALID_REQUEST = "invalid_request"


def error_text(code: str, message: str) -> str:
    return f"{code}: {message}"


def split_error(error: str) -> tuple[str, str]:
    """(code, message) of a typed error string; untyped strings are `internal_error`."""
    code, sep, message = error.partition(": ")
    if sep and code and " " not in code:
        return code, message
    return "internal_error", error
