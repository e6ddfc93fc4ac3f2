"""Statistics of the paired performance gate (SPEC §5).

Runs come in ABBA blocks (baseline, candidate, candidate, baseline) so slow drifts of a noisy
machine hit both engines alike. Each block gives one ratio candidate/baseline of the medians of
its runs (> 1 = candidate faster). The figure reported is the one-sided 95% lower confidence
bound of the median block ratio, from a seeded percentile bootstrap over blocks: a single lucky
block cannot move a median, so it cannot carry a claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 20_000
CONFIDENCE = 0.95


def block_ratio(
    candidate: Sequence[float], baseline: Sequence[float], higher_is_better: bool = True
) -> float:
    """Ratio of medians for one block; for times (lower is better) it is baseline/candidate."""
    c, b = float(np.median(candidate)), float(np.median(baseline))
    if c <= 0 or b <= 0:
        raise ValueError(f"block medians must be positive, got candidate={c}, baseline={b}")
    return c / b if higher_is_better else b / c


@dataclass(frozen=True)
class Bound:
    median: float  # median of the block ratios
    lcb: float  # one-sided lower confidence bound of that median
    ucb: float  # the matching upper bound (for plots), same confidence
    blocks: int
    spread: float  # robust spread of the block ratios: median absolute deviation, scaled

    def as_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "lcb": self.lcb, "ucb": self.ucb, "blocks": self.blocks,
                "spread": self.spread}


def bootstrap_median(
    ratios: Sequence[float], seed: int = 0, resamples: int = RESAMPLES, confidence: float = CONFIDENCE
) -> Bound:
    """Percentile bootstrap of the median block ratio; deterministic for a seed."""
    values = np.asarray(ratios, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError("need at least one block ratio")
    if not np.all(np.isfinite(values)):
        raise ValueError("block ratios must be finite")
    rng = np.random.Generator(np.random.PCG64(seed))
    picks = rng.integers(0, values.size, size=(resamples, values.size))
    medians = np.median(values[picks], axis=1)
    tail = (1.0 - confidence) * 100.0
    median = float(np.median(values))
    mad = float(np.median(np.abs(values - median)) * 1.4826)
    return Bound(
        median=median,
        lcb=float(np.percentile(medians, tail)),
        ucb=float(np.percentile(medians, 100.0 - tail)),
        blocks=int(values.size),
        spread=mad,
    )


def jitter(step_times: Sequence[float], drop_first: int = 16) -> float:
    """Decode time-per-token P95/P50 of one run, the first tokens dropped (warm-up effects)."""
    times = np.asarray(step_times[drop_first:], dtype=np.float64)
    if times.size < 2:
        return float("nan")
    p50 = float(np.percentile(times, 50))
    return float(np.percentile(times, 95)) / p50 if p50 > 0 else float("nan")
