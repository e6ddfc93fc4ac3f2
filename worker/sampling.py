"""The candidate engine's sampler: one logits vector in, one token id out (numpy, batch 1).

Order of operations, chosen to match openvino-genai's sampler so that stock and candidate
draw from the same distribution for the same parameters:

1. repetition_penalty (HF semantics) over the prompt and the generated tokens:
   a positive logit is divided by the penalty, a negative one multiplied;
2. presence / frequency penalty (OpenAI semantics) over generated tokens only:
   `logit -= frequency * count + presence * (count > 0)`;
3. temperature == 0 ⇒ argmax (greedy); otherwise
4. top_k (exactly k candidates), temperature, min_p (relative to the top probability),
   top_p (smallest prefix of the sorted distribution whose mass reaches top_p, the crossing
   token included), then a draw from the renormalised remainder.

Randomness: `np.random.Generator(np.random.PCG64(seed))`, one generator per request, so the
same seed and request give the same tokens; no seed ⇒ fresh OS entropy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from worker.engine.types import SamplingParams


def token_logprob(logits: np.ndarray, token: int) -> float:
    """log softmax(logits)[token] of the raw model output (what OpenAI's logprobs report):
    one max and one exp-sum pass, no vocab-sized copy kept."""
    row = np.asarray(logits, dtype=np.float32)
    peak = float(row.max())
    lse = peak + float(np.log(np.exp(row - peak, dtype=np.float64).sum()))
    return float(row[token]) - lse


def validate_params(params: SamplingParams) -> None:
    """Reject parameters no sampler could honour; the message names the parameter."""
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {params.top_k}")
    if not 0.0 <= params.min_p < 1.0:
        # [0, 1) as openvino-genai accepts, so both engines admit the same requests
        raise ValueError(f"min_p must be in [0, 1), got {params.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(params, name) <= 2.0:  # OpenAI's range (genai enforces it too)
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(params, name)}")
    if params.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.seed is not None and params.seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {params.seed}")


class Sampler:
    """Per-request sampling state: the RNG and the token history the penalties need."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        validate_params(params)
        self.params = params
        # PCG64(None) draws fresh entropy from the OS: unseeded requests are not reproducible.
        self._rng = np.random.Generator(np.random.PCG64(params.seed))
        self._counts: dict[int, int] = {}
        self._repeat = params.repetition_penalty != 1.0
        self._additive = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self._seen: set[int] = set(int(t) for t in prompt_ids) if self._repeat else set()
        self._seen_arr: np.ndarray | None = None  # cached array form of _seen

    def accept(self, token: int) -> None:
        """Record a generated token (penalties see it from the next draw on)."""
        self._counts[token] = self._counts.get(token, 0) + 1
        if self._repeat and token not in self._seen:
            self._seen.add(token)
            self._seen_arr = None

    def _penalised(self) -> bool:
        """Whether some penalty changes the logits of the next draw."""
        return self._repeat or (self._additive and bool(self._counts))

    def apply_penalties(self, logits: np.ndarray) -> np.ndarray:
        """The logits after penalties; a copy only when some penalty is active."""
        if not self._penalised():
            return logits
        out = np.array(logits, dtype=np.float32)  # never write into the model's output buffer
        if self._repeat and self._seen:
            if self._seen_arr is None:
                self._seen_arr = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
            idx = self._seen_arr
            vals = out[idx]
            p = np.float32(self.params.repetition_penalty)
            out[idx] = np.where(vals > 0, vals / p, vals * p)
        if self._additive and self._counts:
            idx = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            cnt = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            out[idx] -= (
                np.float32(self.params.frequency_penalty) * cnt + np.float32(self.params.presence_penalty)
            )
        return out

    def sample(self, logits: np.ndarray, top: int | None = None) -> int:
        """Choose the next token from a float32 logits vector of the model's vocabulary size.

        `top`, when the caller has it, is `np.argmax(logits)` computed already (the LM head op
        gives it): a greedy draw that no penalty changes takes it without reading the logits.
        """
        p = self.params
        if p.temperature == 0.0 and top is not None and not self._penalised():
            return top
        row = self.apply_penalties(np.asarray(logits).reshape(-1))
        if p.temperature == 0.0:
            return int(np.argmax(row))
        ids, probs = candidate_distribution(row, p.temperature, p.top_k, p.min_p, p.top_p)
        if ids.size == 1:
            return int(ids[0])
        return int(ids[self._rng.choice(ids.size, p=probs)])


def candidate_distribution(
    logits: np.ndarray, temperature: float, top_k: int = 0, min_p: float = 0.0, top_p: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """The surviving token ids and their renormalised probabilities (float64, sum 1).

    Exposed for tests: the masks of top_k / min_p / top_p are checked on this directly.
    """
    row = np.asarray(logits, dtype=np.float32).reshape(-1)
    vocab = row.size
    if 0 < top_k < vocab:
        # argpartition keeps exactly k ids (genai's heap does too), O(V) rather than a sort.
        ids = np.argpartition(row, vocab - top_k)[vocab - top_k:]
        vals = row[ids].astype(np.float64)
    else:
        ids = np.arange(vocab)
        vals = row.astype(np.float64)
    vals = (vals - vals.max()) / temperature
    probs = np.exp(vals)
    probs /= probs.sum()
    if min_p > 0.0:
        keep = probs >= min_p * probs.max()
        ids, probs = ids[keep], probs[keep]
        probs /= probs.sum()
    if top_p < 1.0 and ids.size > 1:
        # The nucleus usually lies in the top few hundred ids: find a top-m set that already
        # holds top_p of the mass (O(V) partitions) before sorting, instead of sorting the vocab.
        m = 256
        while m < ids.size:
            top = np.argpartition(probs, ids.size - m)[ids.size - m:]
            if probs[top].sum() >= top_p:
                ids, probs = ids[top], probs[top]
                break
            m *= 4
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        before = np.cumsum(sorted_probs) - sorted_probs  # mass strictly before each token
        n_keep = max(1, int(np.count_nonzero(before < top_p)))
        chosen = order[:n_keep]
        ids, probs = ids[chosen], probs[chosen]
        probs /= probs.sum()
    return ids, probs
