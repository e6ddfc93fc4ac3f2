"""Statistics of the gate: deterministic, honest bounds, robust to one lucky block."""

from __future__ import annotations

import numpy as np
import pytest

from iq36.gate.stats import block_ratio, bootstrap_median, jitter


def test_bootstrap_is_deterministic_for_a_seed() -> None:
    ratios = [1.9, 2.1, 2.0, 2.3, 1.8, 2.2, 2.05, 1.95]
    assert bootstrap_median(ratios, seed=7) == bootstrap_median(ratios, seed=7)
    # the seed really drives the resampling (few resamples so the percentiles move)
    assert len({bootstrap_median(ratios, seed=s, resamples=20).lcb for s in range(10)}) > 1


@pytest.mark.parametrize("true_ratio", [0.8, 1.0, 1.5, 2.0])
def test_bound_brackets_a_known_ratio(true_ratio: float) -> None:
    rng = np.random.default_rng(1)
    # synthetic ABBA blocks: each engine's rate has 5% multiplicative noise around a known truth
    ratios = []
    for _ in range(12):
        base = 100.0 * rng.lognormal(0, 0.05, size=2)
        cand = 100.0 * true_ratio * rng.lognormal(0, 0.05, size=2)
        ratios.append(block_ratio(cand, base))
    bound = bootstrap_median(ratios, seed=0)
    assert bound.lcb <= true_ratio <= bound.ucb
    assert bound.lcb > true_ratio * 0.9  # and it is not vacuously wide


def test_one_noisy_block_does_not_pass_a_threshold_by_luck() -> None:
    ratios = [1.02, 0.98, 1.01, 0.99, 1.00, 1.03, 0.97, 3.5]  # one lucky block
    assert np.mean(ratios) > 1.10  # a mean would have claimed it
    assert bootstrap_median(ratios, seed=0).lcb < 1.10


def test_times_invert_so_faster_is_above_one() -> None:
    assert block_ratio([1.0, 1.0], [2.0, 2.0], higher_is_better=False) == pytest.approx(2.0)
    assert block_ratio([50.0, 52.0], [25.0, 26.0]) == pytest.approx(2.0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        bootstrap_median([])
    with pytest.raises(ValueError):
        bootstrap_median([1.0, float("nan")])
    with pytest.raises(ValueError):
        block_ratio([0.0], [1.0])


def test_jitter_drops_warmup_and_reads_tail() -> None:
    steady = [0.01] * 100
    assert jitter([1.0] * 16 + steady) == pytest.approx(1.0)
    spiky = [0.01] * 90 + [0.05] * 10
    assert jitter([0.01] * 16 + spiky) > 1.25


def _runs(engine: str, rates: dict[str, float]) -> list[dict[str, object]]:
    return [{"engine": engine, "session": s, "prefill_tok_s": rate} for s, rate in rates.items()]


def test_near_boundary_pairs_each_session_with_its_own_exact_runs() -> None:
    from iq36.gate.report import near_boundary

    # the machine slowed during session c's near-boundary run only; sessions d and e ran slow throughout
    exact = _runs("candidate", {"a": 1000.0, "b": 1000.0, "c": 1000.0, "d": 700.0, "e": 700.0})
    near = [{**r, "length": 513} for r in _runs("candidate", {"a": 950.0, "b": 950.0, "c": 500.0, "d": 665.0,
                                                              "e": 665.0})]
    exact += _runs("stock", {"f": 400.0, "g": 400.0})
    near += [{**r, "length": 513} for r in _runs("stock", {"f": 300.0, "g": 340.0})]
    (entry,) = near_boundary(near, exact)
    assert entry["length"] == 513
    assert entry["candidate_vs_bucket"] == pytest.approx(665.0 / 1000.0)  # medians of unpaired runs
    assert entry["candidate_vs_bucket_paired"] == pytest.approx(0.95) and entry["candidate_pairs"] == 5
    assert entry["cliff"] is False  # read from the paired ratio
    assert entry["baseline_vs_bucket_paired"] == pytest.approx(0.8) and entry["baseline_pairs"] == 2
    assert entry["baseline_vs_bucket"] == pytest.approx(320.0 / 400.0)


def test_near_boundary_flags_a_cliff_and_falls_back_to_medians_without_pairs() -> None:
    from iq36.gate.report import near_boundary

    exact = _runs("candidate", {"a": 1000.0, "b": 1000.0})
    paired = near_boundary([{**r, "length": 257} for r in _runs("candidate", {"a": 880.0, "b": 890.0})], exact)
    assert paired[0]["candidate_vs_bucket_paired"] == pytest.approx(0.885) and paired[0]["cliff"] is True
    unpaired = near_boundary([{**r, "length": 257} for r in _runs("candidate", {"x": 950.0})], exact)
    assert unpaired[0]["candidate_vs_bucket_paired"] is None and unpaired[0]["candidate_pairs"] == 0
    assert unpaired[0]["candidate_vs_bucket"] == pytest.approx(0.95) and unpaired[0]["cliff"] is False
    assert unpaired[0]["baseline_vs_bucket"] is None and unpaired[0]["baseline_vs_bucket_paired"] is None
