"""From generated token ids to the text a client may see, shared by both engines.

Three pieces, so the stock and candidate engines emit text identically:

- `IncrementalDetokenizer`: decodes a sliding window of ids (the previous emission's tokens
  plus the new ones), never the whole output, and holds text back while it ends in U+FFFD —
  a byte-level BPE token can carry part of a UTF-8 sequence (an emoji spans several tokens).
- `StopStringMatcher`: withholds any suffix that could be the start of a stop string; on a
  match it cuts the text before the stop string, which is never emitted.
- `OutputStream`: per request, token in ⇒ (text delta, finish reason): EOS / stop token ids,
  stop strings, max_tokens; and the final flush, itself checked for stop strings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from worker.engine.types import FinishReason, SamplingParams, StepOutput

Decode = Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text

REPLACEMENT = "\ufffd"


# Tokens a decode window may span before its start moves up (`IncrementalDetokenizer`).
WINDOW = 16


class IncrementalDetokenizer:
    """Token ids in, valid text deltas out.

    The window is `ids[prefix:]`; `ids[prefix:read]` is text already emitted, decoded again only
    as context (so a partial UTF-8 sequence at its end is completed by later tokens). The
    window's start stays put until it spans WINDOW tokens, so the emitted part's text is the
    previous window's, kept, and a token costs one decode of at most WINDOW + a few tokens (two
    when the start moves): O(1) in the output length. A decode of the model's detokenizer costs
    the same at 1 and at 20 tokens (~39 us on the AVX-512 EPYC): 83 -> 45 us per token against
    starting over at every emission (WINDOW = 1), ~0.2% of a dev-bench decode step. (On the Zen 4
    EPYC genai's decode took ~0.4 ms a token in the decode loop; `ModelTokenizer` now joins the
    detokenizer IR's vocabulary bytes itself where that gives the same text: ~10 us a call.)
    """

    def __init__(self, decode: Decode, skip_special_tokens: bool = True) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._done: str | None = None  # decode(ids[prefix:read]) when known

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (possibly ending in U+FFFD): the output is over."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read >= len(self.ids):
            return ""
        done = self._done
        if done is None:
            done = self._done = self._decode(self.ids[self._prefix:self._read], self._skip)
        text = self._decode(self.ids[self._prefix:], self._skip)
        if not final and (len(text) <= len(done) or text.endswith(REPLACEMENT)):
            return ""  # incomplete character (or nothing new yet): wait for the next token
        if len(self.ids) - self._prefix >= WINDOW:
            self._prefix, self._done = self._read, None  # the next window starts at this emission
        else:
            self._done = text
        self._read = len(self.ids)
        return text[len(done):]


class StopStringMatcher:
    """Text in, text safe to emit out; stop strings never come out, even split across deltas."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Emit-safe part of `held + text`. After a match `matched` is set and the rest is cut."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        hit = -1
        for stop in self.stops:
            at = buf.find(stop)
            if at != -1 and (hit == -1 or at < hit):
                hit, self.matched = at, stop
        if hit != -1:
            self._held = ""
            return buf[:hit]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At finish without a match, the held suffix was never a stop string: emit it."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best


class OutputStream:
    """One request's output side: decides finish by token and produces the visible text."""

    def __init__(self, decode: Decode, params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
        self.params = params
        self._detok = IncrementalDetokenizer(decode, params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self._stop_ids = frozenset(stop_ids)
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        # Prompt tokens the engine restored from a prefix-state snapshot instead of prefilling;
        # reported from the request's first token on (StepOutput.cached_tokens).
        self.cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step_output(self, request_id: str, prompt_tokens: int, tokens: list[int], text: str,
                    error: str | None = None) -> StepOutput:
        """The engine contract's output for this step of the request (shared by both engines)."""
        return StepOutput(
            request_id=request_id,
            token_ids=tokens,
            text=text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(self.token_ids),
            error=error,
            cached_tokens=self.cached_tokens if self.token_ids else 0,
        )

    def push(self, token: int) -> str:
        """Account one generated token; return the text it makes visible. Sets `finish_reason`
        when this token ends the request (the final flush is included in the returned text)."""
        if self.finished:
            raise RuntimeError("token pushed after the output finished")
        self.token_ids.append(token)
        if token in self._stop_ids:
            # The EOS / stop token counts as generated but is not part of the text (vLLM, OpenAI).
            return self.finish(FinishReason.STOP)
        text = self._stops.feed(self._detok.push(token))
        if self._stops.matched is not None:
            self.finish_reason = FinishReason.STOP
            return text
        if len(self.token_ids) >= self.params.max_tokens:
            return text + self.finish(FinishReason.LENGTH)
        return text

    def finish(self, reason: FinishReason) -> str:
        """End the output for `reason` and return the text still held back (STOP / LENGTH). A
        stop string found in that flushed text is cut and turns the reason into STOP."""
        if self.finished:
            return ""
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            self.finish_reason = reason  # held-back text is dropped: the output is cut anyway
            return ""
        text = self._stops.feed(self._detok.flush())
        if self._stops.matched is not None:
            self.finish_reason = FinishReason.STOP
            return text
        self.finish_reason = reason
        return text + self._stops.flush()
