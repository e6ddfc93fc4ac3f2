"""The correctness gate (SPEC §5): did the candidate change the model's behaviour?

Per case, on the same IR and inference precision:
- stock greedy tokens come from openvino-genai `LLMPipeline` (the stock-tuned configuration);
- full-vocabulary reference distributions come from the unmodified IR on stock OpenVINO
  (`worker.reference.ReferenceRunner`), teacher-forced on stock's tokens;
- the candidate is teacher-forced on the same tokens, so after a divergence the run continues
  on stock's path, and every position gets a candidate distribution to compare.
A greedy divergence is tolerated only where stock's top-1/top-2 logit margin is below `eps`
(a near-tie: two correct engines may order such tokens either way); in f32 reference mode none
is. Top-1 agreement must be >= 0.99 and the maximum over positions of KL(stock||candidate),
in float64, <= 0.005.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from iq36.gate.prompts import build, sentinel_found
from iq36.gate.session import Case, engine_profile
from iq36.profile import load

TOP1_MIN = 0.99
KLD_MAX = 0.005
DEFAULT_EPS = 0.02  # logits; near-tie threshold outside f32 reference mode (docs/gate.md)


class CorrectnessSpec(msgspec.Struct, frozen=True):
    model_dir: str
    profile: str
    cases: list[Case]
    output_tokens: int = 512
    eps: float = DEFAULT_EPS
    exact: bool = False  # f32 reference mode: any divergence fails
    perturb: bool = False  # test-only: corrupt the candidate (kernels/perturb.py) to prove the gate fails


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def compare(stock_tokens: list[int], reference: Iterable[np.ndarray], candidate: Iterable[np.ndarray],
            eps: float, exact: bool) -> dict[str, Any]:
    """Position-by-position comparison of teacher-forced distributions and greedy choices."""
    max_kld, agree, n = 0.0, 0, 0
    divergences: list[dict[str, Any]] = []
    candidate_tokens: list[int] = []
    for i, (token, ref, cand) in enumerate(zip(stock_tokens, reference, candidate, strict=True)):
        lp, lq = _log_softmax(ref), _log_softmax(cand)
        kld = float(np.sum(np.exp(lp) * (lp - lq)))
        max_kld = max(max_kld, kld)
        ref_top = int(np.argmax(ref))
        cand_top = int(np.argmax(cand))
        agree += ref_top == cand_top
        n += 1
        candidate_tokens.append(cand_top)
        if cand_top != token:
            top2 = np.partition(ref.astype(np.float64), -2)[-2:]
            margin = float(top2[1] - top2[0])
            divergences.append({"position": i, "stock_token": token, "candidate_token": cand_top,
                                "margin": margin, "near_tie": (not exact) and margin < eps})
    hard = [d for d in divergences if not d["near_tie"]]
    top1 = agree / n if n else 1.0
    return {
        "positions": n,
        "greedy_match": not hard,
        "first_divergence": divergences[0] if divergences else None,
        "near_tie_divergences": [d for d in divergences if d["near_tie"]],
        "hard_divergences": hard,
        "top1_agreement": top1,
        "max_kld": max_kld,
        "passed": not hard and top1 >= TOP1_MIN and max_kld <= KLD_MAX,
        "candidate_tokens": candidate_tokens,
    }


def _stock_greedy(model_dir: Path, spec: CorrectnessSpec, prompt: tuple[int, ...]) -> list[int]:
    """Greedy tokens from genai (stock-tuned), EOS ignored so every case has the full length."""
    from worker.engine import EngineRequest, SamplingParams, create

    engine = create("stock", model_dir, engine_profile(load(spec.profile), "stock-tuned"))
    tokens: list[int] = []
    try:
        params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True)
        engine.add(EngineRequest("correctness", prompt, params, reuse_prefix=False))  # cold, as SPEC §5 says
        while engine.has_work():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"stock engine failed: {out.error}")
                tokens.extend(out.token_ids)
    finally:
        engine.close()
    return tokens


def run_case(spec: CorrectnessSpec, case: Case) -> dict[str, Any]:
    from worker.engine.candidate import CandidateEngine
    from worker.reference import ReferenceRunner
    from worker.tokenizer import ModelTokenizer

    model_dir = Path(spec.model_dir)
    profile = load(spec.profile)
    tokenizer = ModelTokenizer(model_dir)
    prompt = build(lambda t: tokenizer.encode(t, add_special_tokens=False), case.bucket,
                   case.prompt_class, length=case.length, salt=case.salt)
    stock_tokens = _stock_greedy(model_dir, spec, prompt.ids)
    reference = ReferenceRunner(model_dir, profile.engine.device, dict(profile.engine.properties))
    if spec.perturb:
        profile = msgspec.structs.replace(profile, kernels={**profile.kernels, "perturb_embeddings": True})
    candidate = CandidateEngine(model_dir, profile)
    try:
        result = compare(
            stock_tokens,
            reference.forced_logits(list(prompt.ids), stock_tokens),
            candidate.forced_logits(list(prompt.ids), stock_tokens),
            spec.eps,
            spec.exact,
        )
    finally:
        candidate.close()
    cand_tokens = result.pop("candidate_tokens")
    result["sentinel_stock"] = sentinel_found(tokenizer.decode(stock_tokens), prompt.sentinel_value)
    result["sentinel_candidate"] = sentinel_found(tokenizer.decode(cand_tokens), prompt.sentinel_value)
    if result["sentinel_stock"] != result["sentinel_candidate"]:
        result["passed"] = False
    return {**msgspec.to_builtins(case), "eps": spec.eps, "exact": spec.exact, **result}


def main() -> None:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=CorrectnessSpec)
    for case in spec.cases:
        print(json.dumps(run_case(spec, case)), flush=True)


if __name__ == "__main__":
    main()
