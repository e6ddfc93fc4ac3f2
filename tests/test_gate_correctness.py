"""The correctness comparison on hand-made distributions."""

from __future__ import annotations

import numpy as np

from iq36.gate.correctness import compare


def _logits(top: int, margin: float, vocab: int = 8) -> np.ndarray:
    x = np.zeros(vocab, dtype=np.float32)
    x[top] = 5.0
    x[(top + 1) % vocab] = 5.0 - margin
    return x


def test_identical_distributions_pass() -> None:
    ref = [_logits(1, 1.0), _logits(2, 1.0)]
    r = compare([1, 2], ref, [x.copy() for x in ref], eps=0.02, exact=False)
    assert r["passed"] and r["greedy_match"] and r["max_kld"] == 0.0 and r["first_divergence"] is None


def test_divergence_at_a_near_tie_is_tolerated_but_reported() -> None:
    ref = [_logits(1, 0.01), _logits(2, 1.0)]
    cand = [_logits(2, 0.0), _logits(2, 1.0)]  # swaps the near-tied pair at position 0
    cand[0][1] = 5.0 - 0.005
    r = compare([1, 2], ref, cand, eps=0.02, exact=False)
    assert r["greedy_match"] and len(r["near_tie_divergences"]) == 1
    assert r["first_divergence"]["position"] == 0 and abs(r["first_divergence"]["margin"] - 0.01) < 1e-6


def test_divergence_at_a_clear_margin_fails() -> None:
    ref = [_logits(1, 1.0)]
    cand = [_logits(3, 1.0)]
    r = compare([1], ref, cand, eps=0.02, exact=False)
    assert not r["greedy_match"] and not r["passed"] and r["hard_divergences"][0]["candidate_token"] == 3


def test_f32_reference_mode_allows_no_divergence() -> None:
    ref = [_logits(1, 0.001)]
    cand = [_logits(2, 0.0)]
    assert not compare([1], ref, cand, eps=0.02, exact=True)["greedy_match"]


def test_kld_budget_fails_even_when_argmax_agrees() -> None:
    ref = [_logits(1, 1.0)]
    cand = [ref[0] * 3.0]  # same argmax, much sharper distribution
    r = compare([1], ref, cand, eps=0.02, exact=False)
    assert r["greedy_match"] and r["top1_agreement"] == 1.0 and r["max_kld"] > 0.005 and not r["passed"]
