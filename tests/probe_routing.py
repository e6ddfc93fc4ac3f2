"""Probe (not a test): which routing near-ties the candidate resolves differently from stock.

    .venv/bin/python -m tests.probe_routing --model dev-bench --bucket 1024 --class filler

The gate's correctness step (iq36/gate/correctness.py) teacher-forces the candidate on stock's
greedy tokens and compares its distributions with the unmodified IR's. A mixture-of-experts layer
keeps the top-k of its router's softmax: where the k-th and (k+1)-th experts are a few f32 ulps
apart, two engines that sum in different orders may keep different experts, and that position's
logits (and, through the recurrent state and the KV cache, the next few) move by far more than
the rounding that caused it. This probe runs the gate's prompt the gate's way with every router's
softmax added as a model output, on both sides, and prints each position where the candidate keeps
another expert set in some layer or where KL(reference || candidate) exceeds `--min-kld`: the
KLD, whether the argmax agrees, the reference's smallest k-th/(k+1)-th gap over the layers, and
per swapped layer the reference's and the candidate's gaps.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

OUTPUT = "iq36_probe_router_"


def add_router_outputs(model: Any) -> tuple[list[str], int]:
    """Every Softmax feeding a TopK (a router) as an extra output `OUTPUT<i>`; names and the top-k."""
    names, k = [], 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Softmax":
            continue
        topk = [t.get_node() for t in op.output(0).get_target_inputs() if t.get_node().get_type_name() == "TopK"]
        if not topk:
            continue
        k_node = topk[0].input_value(1).get_node()
        if k_node.get_type_name() != "Constant":
            raise ValueError(f"router {op.get_friendly_name()}: top-k is not a constant")
        k = int(np.asarray(k_node.get_data()).reshape(-1)[0])
        name = f"{OUTPUT}{len(names)}"
        op.output(0).get_tensor().add_names({name})
        model.add_outputs([op.output(0)])
        names.append(name)
    if not names:
        raise ValueError("no router (Softmax -> TopK) in the model")
    return names, k


def routing(request: Any, names: list[str], k: int) -> list[tuple[frozenset[int], float]]:
    """Per router, for the last position fed: the experts kept and the k-th/(k+1)-th gap."""
    out = []
    for name in names:
        p = np.asarray(request.get_tensor(name).data, dtype=np.float64)
        p = p.reshape(-1, p.shape[-1])[-1]
        order = np.argsort(-p, kind="stable")
        out.append((frozenset(order[:k].tolist()), float(p[order[k - 1]] - p[order[k]])))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dev-bench")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--bucket", type=int, default=1024, help="prompt length, as the gate's case")
    p.add_argument("--class", dest="prompt_class", default="filler")
    p.add_argument("--tokens", type=int, default=512, help="stock's greedy tokens (the gate's --correctness-tokens)")
    p.add_argument("--min-kld", type=float, default=1e-4, help="also print positions above this KLD")
    args = p.parse_args()

    import openvino as ov

    import worker.engine.candidate as candidate_module
    from iq36.cli import resolve_model
    from iq36.gate.correctness import CorrectnessSpec, _log_softmax, _stock_greedy
    from iq36.gate.prompts import build
    from iq36.profile import load
    from worker.reference import stateful_feed
    from worker.tokenizer import ModelTokenizer

    model_dir = Path(resolve_model(args.model))
    profile = load(args.profile)
    tokenizer = ModelTokenizer(model_dir)
    prompt = list(build(lambda t: tokenizer.encode(t, add_special_tokens=False), args.bucket, args.prompt_class,
                        length=args.bucket, salt=f"correctness:{args.bucket}:{args.prompt_class}").ids)
    spec = CorrectnessSpec(model_dir=str(model_dir), profile=args.profile, cases=[], output_tokens=args.tokens)
    stock = _stock_greedy(model_dir, spec, tuple(prompt))

    # The reference: the unmodified IR, one call for the prompt, one per forced token.
    core = ov.Core()
    model = core.read_model(model_dir / "openvino_model.xml")
    names, k = add_router_outputs(model)
    request = core.compile_model(model, profile.engine.device, dict(profile.engine.properties)).create_infer_request()
    inputs = {port.get_any_name() for port in model.inputs}
    request.reset_state()
    request.infer(stateful_feed(np.asarray(prompt), 0, inputs))
    reference: list[tuple[np.ndarray, list[tuple[frozenset[int], float]]]] = []
    for i, token in enumerate(stock):
        reference.append((_log_softmax(request.get_tensor("logits").data[0, -1]).astype(np.float32),
                          routing(request, names, k)))
        if i + 1 < len(stock):
            request.infer(stateful_feed(np.asarray([token]), len(prompt) + i, inputs))
    del request

    # The candidate, its specialised graphs (and decode graph) given the same extra outputs.
    plain = candidate_module.specialised_model

    def with_routers(core: Any, model_dir: Path, profile: Any) -> tuple[Any, list[str], Any]:
        model, kernels, decode = plain(core, model_dir, profile)
        for graph in (model, decode):
            if graph is not None and add_router_outputs(graph)[0] != names:
                raise ValueError("the candidate's graph has other routers than the IR")
        return model, kernels, decode

    candidate_module.specialised_model = with_routers
    engine = candidate_module.CandidateEngine(model_dir, profile)
    print(f"{args.model}, {args.bucket}-token '{args.prompt_class}' prompt, {len(stock)} forced tokens, "
          f"{len(names)} routers, top-{k}; positions with a swapped expert set or KLD > {args.min_kld:g}")
    print(f"{'pos':>4s} {'KLD':>9s} {'top1':>4s} {'min ref gap':>11s}  swapped layers (reference gap / candidate gap)")
    swaps = spikes = explained = 0
    try:
        for i, logits in enumerate(engine.forced_logits(prompt, stock)):
            lp, ref_routing = reference[i]
            lq = _log_softmax(logits)
            kld = float(np.sum(np.exp(lp) * (lp - lq)))
            mine = routing(engine._live, names, k)
            swapped = [(n, ref_routing[n][1], mine[n][1]) for n in range(len(names)) if mine[n][0] != ref_routing[n][0]]
            swaps += bool(swapped)
            spikes += kld > args.min_kld
            explained += kld > args.min_kld and bool(swapped)
            if swapped or kld > args.min_kld:
                layers = ", ".join(f"{n}: {r:.1e}/{c:.1e}" for n, r, c in swapped)
                top1 = "ok" if int(np.argmax(lp)) == int(np.argmax(lq)) else "DIFF"
                print(f"{i:4d} {kld:9.2e} {top1:>4s} {min(g for _, g in ref_routing):11.2e}  {layers}", flush=True)
    finally:
        engine.close()
    print(f"positions with a swapped expert set: {swaps}; with KLD > {args.min_kld:g}: {spikes}, "
          f"of which {explained} with a swap at that position")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
