"""The candidate's sampler (worker/sampling.py): masks, penalties, greedy, seeds."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine.types import SamplingParams
from worker.sampling import Sampler, candidate_distribution, token_logprob, validate_params

VOCAB = 1000


def _logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=VOCAB).astype(np.float32)


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = _logits()
    before = logits.copy()
    token = Sampler(SamplingParams(temperature=0.0), prompt_ids=[1, 2]).sample(logits)
    assert token == int(np.argmax(before))
    assert np.array_equal(logits, before)


def test_greedy_without_penalties_makes_no_copy() -> None:
    logits = _logits()
    sampler = Sampler(SamplingParams(temperature=0.0), prompt_ids=[1])
    assert sampler.apply_penalties(logits) is logits


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = _logits()
    ids, probs = candidate_distribution(logits, temperature=1.0, top_k=5)
    assert sorted(ids.tolist()) == sorted(np.argsort(logits)[-5:].tolist())
    assert probs.sum() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    ids, probs = candidate_distribution(logits, temperature=1.0, top_p=0.8)
    assert ids.tolist() == [0, 1]  # 0.5 < 0.8, 0.5 + 0.3 reaches it: the crossing token stays
    assert probs.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])


def test_top_p_on_a_large_vocab_matches_a_full_sort() -> None:
    logits = np.random.default_rng(3).normal(scale=3.0, size=50_000).astype(np.float32)
    ids, _ = candidate_distribution(logits, temperature=0.7, top_p=0.9)
    p = np.exp((logits.astype(np.float64) - logits.max()) / 0.7)
    p /= p.sum()
    order = np.argsort(-p)
    n = int(np.count_nonzero(np.cumsum(p[order]) - p[order] < 0.9))
    assert sorted(ids.tolist()) == sorted(order[:n].tolist())


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    logits = np.log(np.array([0.6, 0.3, 0.07, 0.03], dtype=np.float32))
    ids, _ = candidate_distribution(logits, temperature=1.0, min_p=0.1)  # threshold 0.06
    assert ids.tolist() == [0, 1, 2]


def test_temperature_sharpens_the_distribution() -> None:
    logits = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    _, hot = candidate_distribution(logits, temperature=2.0)
    _, cold = candidate_distribution(logits, temperature=0.5)
    assert cold[0] > hot[0]


def test_draws_stay_inside_the_top_k_mask() -> None:
    logits = _logits()
    allowed = set(np.argsort(logits)[-3:].tolist())
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=3, seed=1), prompt_ids=[0])
    assert {sampler.sample(logits) for _ in range(200)} <= allowed


def test_presence_and_frequency_penalties_follow_openai_semantics() -> None:
    logits = np.array([1.0, -1.0, 0.5, 0.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[2])
    for token in (0, 0, 1):
        sampler.accept(token)
    out = sampler.apply_penalties(logits)
    # always subtracted, whatever the sign; the prompt token (2) is not penalised
    assert out.tolist() == pytest.approx([1.0 - 0.5 - 0.5, -1.0 - 0.5 - 0.25, 0.5, 0.0])


def test_repetition_penalty_follows_hf_semantics_over_prompt_and_output() -> None:
    logits = np.array([2.0, -2.0, 1.0, 3.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1])
    sampler.accept(2)
    out = sampler.apply_penalties(logits)
    assert out.tolist() == pytest.approx([1.0, -4.0, 0.5, 3.0])
    assert np.array_equal(logits, np.array([2.0, -2.0, 1.0, 3.0], dtype=np.float32))


def test_penalties_apply_to_greedy() -> None:
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=1.0), prompt_ids=[2])
    sampler.accept(0)
    assert sampler.sample(logits) == 1


def test_greedy_takes_the_callers_argmax_only_when_nothing_changes_the_logits() -> None:
    """`top` (the LM head op's argmax) stands for `np.argmax(logits)`: taken as is for a plain
    greedy draw (a deliberately different id shows it is not recomputed), ignored once a penalty
    or a temperature applies."""
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.0), prompt_ids=[2]).sample(logits, top=2) == 2
    penalised = Sampler(SamplingParams(temperature=0.0, presence_penalty=1.0), prompt_ids=[2])
    assert penalised.sample(logits, top=0) == 0  # no token generated yet: no penalty yet
    penalised.accept(0)
    assert penalised.sample(logits, top=0) == 1
    repeated = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt_ids=[0])
    assert repeated.sample(logits, top=0) == 1
    hot = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=3), prompt_ids=[2])
    assert hot.sample(logits, top=2) == 0


def test_same_seed_gives_the_same_draws() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    logits = _logits()
    a = Sampler(params, [1]).sample
    b = Sampler(params, [1]).sample
    assert [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]


def test_different_seeds_give_different_draws() -> None:
    logits = np.zeros(VOCAB, dtype=np.float32)  # flat: 50 equal draws by chance is ~impossible
    a = Sampler(SamplingParams(temperature=1.0, seed=1), [1]).sample
    b = Sampler(SamplingParams(temperature=1.0, seed=2), [1]).sample
    assert [a(logits) for _ in range(50)] != [b(logits) for _ in range(50)]


def test_no_seed_draws_fresh_entropy() -> None:
    logits = np.zeros(VOCAB, dtype=np.float32)
    a = Sampler(SamplingParams(temperature=1.0), [1]).sample
    b = Sampler(SamplingParams(temperature=1.0), [1]).sample
    assert [a(logits) for _ in range(50)] != [b(logits) for _ in range(50)]


def test_token_logprob_is_log_softmax() -> None:
    logits = _logits()
    x = logits.astype(np.float64)
    want = x[7] - (x.max() + np.log(np.exp(x - x.max()).sum()))
    assert token_logprob(logits, 7) == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.0), ("repetition_penalty", 0.0),
     ("seed", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3.0)],
)
def test_invalid_parameters_are_rejected_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        validate_params(SamplingParams(**{field: value}))
