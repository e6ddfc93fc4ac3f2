"""OpenAI response shapes, one builder per shape: chat.completion, chat.completion.chunk,
text_completion (whole and chunk), usage, the model list. Plain dicts, encoded by msgspec."""

from __future__ import annotations

from typing import Any

from worker.engine.types import FinishReason

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH.get(reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Chat/completions usage; `cached_tokens` = prompt tokens restored from a prefix snapshot."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _envelope(obj: str, id_: str, created: int, model: str, fingerprint: str | None) -> dict[str, Any]:
    return {"id": id_, "object": obj, "created": created, "model": model, "system_fingerprint": fingerprint}


def chat_completion(id_: str, created: int, model: str, fingerprint: str | None, message: dict[str, Any],
                    reason: str | None, use: dict[str, Any]) -> dict[str, Any]:
    return {
        **_envelope("chat.completion", id_, created, model, fingerprint),
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
        "usage": use,
    }


def chat_chunk(id_: str, created: int, model: str, fingerprint: str | None, delta: dict[str, Any] | None,
               reason: str | None = None, use: dict[str, Any] | None = None) -> dict[str, Any]:
    """A role/content/reasoning/tool-call delta, the final finish_reason chunk, or (delta None)
    the usage chunk."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
    out = {**_envelope("chat.completion.chunk", id_, created, model, fingerprint), "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion(id_: str, created: int, model: str, fingerprint: str | None, text: str | None,
               reason: FinishReason | None, use: dict[str, Any] | None) -> dict[str, Any]:
    """A whole text_completion, or a chunk of one (use=None while streaming)."""
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None,
                                        "finish_reason": finish_reason(reason)}]
    out = {**_envelope("text_completion", id_, created, model, fingerprint), "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": cards}
