"""Probe (not a test): how far the unmodified IR moves against itself when only a rounding changes.

    .venv/bin/python -m tests.probe_kld_floor --model dev-bench --tokens 512 --forced 24

The gate's correctness step compares the candidate with stock's distributions at the profile's
precision (max KL(stock || candidate) <= 0.005, top-1 >= 0.99). This probe measures the same
statistics between stock OpenVINO and *itself* under plugin settings that change only where the
math rounds, and against the candidate with each kernel alone: if stock against itself already
exceeds the budget, no engine that rounds anywhere differently from stock can meet it at that
precision on this model. Teacher-forced: a random prompt of `--tokens` ids, then `--forced`
random ids, the distributions at each forced position (as the gate does).

Each variant is a JSON object of CPU properties added to the profile's (`{}` is stock as the gate
runs it), or `kernels:NAME[,NAME]` for the candidate with only those kernels.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

DEFAULT_VARIANTS = [
    '{"INFERENCE_NUM_THREADS": 1}',
    '{"KV_CACHE_PRECISION": "bf16"}',
    '{"DYNAMIC_QUANTIZATION_GROUP_SIZE": 64}',
    '{"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}',
    "kernels:last_token_logits",
    "kernels:last_token_logits,native_conv",
    "kernels:last_token_logits,q16_decode",
]


def _log_softmax(v: np.ndarray) -> np.ndarray:
    v = v - v.max(-1, keepdims=True)
    return v - np.log(np.exp(v).sum(-1, keepdims=True))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dev-bench")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--forced", type=int, default=24)
    p.add_argument("variants", nargs="*", default=DEFAULT_VARIANTS)
    args = p.parse_args()

    import msgspec

    from iq36.cli import resolve_model
    from iq36.profile import load
    from worker.engine.candidate import CandidateEngine
    from worker.reference import ReferenceRunner

    model = resolve_model(args.model)
    profile = load(args.profile)
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(1000, 30000, args.tokens)]
    forced = [int(t) for t in rng.integers(1000, 30000, args.forced)]

    def stock(extra: dict[str, object]) -> np.ndarray:
        runner = ReferenceRunner(model, profile.engine.device, {**profile.engine.properties, **extra})
        return np.stack([np.asarray(x, np.float64) for x in runner.forced_logits(prompt, forced)])

    def candidate(kernels: list[str]) -> np.ndarray:
        chosen = msgspec.structs.replace(profile, kernels={k: k in kernels for k in profile.kernels})
        engine = CandidateEngine(model, chosen)
        try:
            return np.stack([np.asarray(x, np.float64) for x in engine.forced_logits(prompt, forced)])
        finally:
            engine.close()

    base = stock({})
    lp = _log_softmax(base)
    print(f"{args.model}: {args.tokens}-token prompt, {args.forced} forced tokens; against stock at the "
          f"'{args.profile}' profile's properties. Budget: max KLD <= 0.005, top-1 >= 0.99.")
    print(f"{'variant':58s} {'max KLD':>9s} {'median':>9s} {'top-1':>6s}")
    for variant in args.variants:
        if variant.startswith("kernels:"):
            other = candidate(variant.removeprefix("kernels:").split(","))
        else:
            other = stock(json.loads(variant))
        kld = (np.exp(lp) * (lp - _log_softmax(other))).sum(-1)
        top1 = float((base.argmax(-1) == other.argmax(-1)).mean())
        print(f"{variant:58s} {kld.max():9.3g} {np.median(kld):9.3g} {top1:6.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
