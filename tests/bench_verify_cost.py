"""Benchmark (not a test): what verifying k tokens at once would cost (speculative decoding).

    .venv/bin/python -m tests.bench_verify_cost --model dev-bench --ks 1,2,3,4,6,8

Speculative decoding (prompt lookup, a draft model) feeds the last token and k - 1 drafted ones
in one call and keeps the drafts the model agrees with: greedy output is unchanged, and a step
reads the weights once for up to k tokens. On a mixture of experts it does not read them once:
each of the k positions routes to its own top-k experts, so a call reads the union of their
weights. This prints both sides for the model given:

- measured: one decode step on the engine's decode graph against one call of k tokens on its
  prefill graph (the graph the engine has for several tokens), after a `--context`-token prompt,
  medians over `--steps` calls (the first two of each series untimed) and `--rounds` prompts;
- the byte model (memory-bound, the decode roofline's counts from the IR,
  `iq36.gate.roofline.bytes_per_token`): a call of k tokens reads everything one token reads
  except the routed experts, plus the expected union of k independent top-k draws of E experts,
  E (1 - (1 - top_k / E) ** k) per block; and the acceptance rate a of each drafted token
  (a geometric run: 1 + a + ... + a^(k-1) tokens a call) that a 2x decode would then need, at
  the byte model's cost and at the measured one (null: not even with every draft accepted).

Independent draws are the worst case for the union; adjacent tokens' routing correlates on real
text, which a random-weight dev model cannot show.

`--lookup-tokens N` also generates N greedy tokens for each gate prompt class and replays prompt
lookup over them (the draft: the k - 1 tokens that followed the most recent earlier occurrence of
the last n tokens, n from `--ngram`'s largest down to its smallest; greedy verification accepts
exactly the drafted tokens equal to the greedy continuation), reporting tokens per call and the
share of drafted tokens accepted. On a random-weight model that says nothing about real text;
it says what a gate on these models would credit. docs/perf-log.md session 39 has the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def expected_union(experts: int, top_k: int, k: int) -> float:
    """Expected number of distinct experts k independent top-k draws of `experts` touch."""
    return experts * (1.0 - (1.0 - top_k / experts) ** k)


def tokens_per_call(a: float, k: int) -> float:
    """Expected tokens one verification of k positions yields when each draft is accepted with
    probability a (stopping at the first rejection; the model's own next token always counts)."""
    return float(k) if a >= 1.0 else (1.0 - a**k) / (1.0 - a)


def acceptance_for(speedup: float, bytes_ratio: float, k: int) -> float | None:
    """The smallest acceptance rate giving `speedup` over single-token decode when a call costs
    `bytes_ratio` decode steps (None: unreachable even if every draft is accepted)."""
    need = speedup * bytes_ratio
    if need > k:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_call(mid, k) < need else (lo, mid)
    return hi


def lookup_replay(prompt: list[int], generated: list[int], k: int, ngram: tuple[int, int]) -> dict[str, int]:
    """Prompt lookup with verification calls of k positions replayed over a known greedy output:
    calls made, tokens drafted and drafted tokens accepted."""
    seq = list(prompt) + list(generated)
    pos, calls, drafted, accepted = len(prompt), 0, 0, 0
    lo, hi = ngram
    while pos < len(seq):
        draft: list[int] = []
        for n in range(hi, lo - 1, -1):
            if pos < n + 1:
                continue
            tail = seq[pos - n:pos]
            for start in range(pos - n - 1, -1, -1):  # the most recent earlier occurrence
                if seq[start:start + n] == tail:
                    draft = seq[start + n:min(start + n + k - 1, pos)]
                    break
            if draft:
                break
        ok = 0
        while ok < len(draft) and pos + ok < len(seq) and draft[ok] == seq[pos + ok]:
            ok += 1
        calls += 1
        drafted += len(draft)
        accepted += ok
        pos += ok + 1  # the accepted drafts and the model's own next token
    return {"calls": calls, "tokens": len(generated), "drafted": drafted, "accepted": accepted}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dev-bench", metavar="NAME_OR_DIR")
    p.add_argument("--profile", default="cpu", metavar="NAME_OR_PATH")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the calls (default: 512)")
    p.add_argument("--ks", default="1,2,3,4,6,8", help="tokens per call, comma-separated (default: 1,2,3,4,6,8)")
    p.add_argument("--steps", type=int, default=10, help="calls per series, two of them untimed (default: 10)")
    p.add_argument("--rounds", type=int, default=2, help="prompts, each with every series (default: 2)")
    p.add_argument("--lookup-tokens", type=int, default=0,
                   help="greedy tokens per prompt class to replay prompt lookup over (default: 0, none)")
    p.add_argument("--ngram", default="1,3", help="prompt lookup's n-gram sizes, min,max (default: 1,3)")
    args = p.parse_args()
    ks = [int(v) for v in args.ks.split(",") if v.strip()]
    if args.steps < 3 or any(k < 1 for k in ks):
        p.error("--steps must be >= 3 and every k >= 1")
    ngram = tuple(int(v) for v in args.ngram.split(","))
    if len(ngram) != 2 or not 1 <= ngram[0] <= ngram[1]:
        p.error("--ngram takes min,max with 1 <= min <= max, e.g. 1,3")

    from iq36.cli import resolve_model
    from iq36.gate.prompts import CLASSES, build
    from iq36.gate.roofline import bytes_per_token
    from iq36.profile import load
    from worker.engine.candidate import CandidateEngine
    from worker.reference import stateful_feed
    from worker.tokenizer import ModelTokenizer

    model_dir = resolve_model(args.model)
    cfg = json.loads((model_dir / "config.json").read_text())
    tb = bytes_per_token(model_dir, args.context)
    experts, top_k = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
    routed = tb.experts_all * top_k // experts  # one token's routed-expert bytes
    one = tb.total

    tokenizer = ModelTokenizer(model_dir)
    engine = CandidateEngine(model_dir, load(args.profile), tokenizer)
    if engine._decode_request is None or engine._prefill_request is None:
        p.error("the profile has no separate decode and prefill graphs to compare")
    rng = np.random.default_rng(0)
    vocab = min(engine.vocab_size, 32000)

    def timed(request, ids: np.ndarray, past: int) -> float:
        calls = engine._calls.get(id(request), 0)
        engine._calls[id(request)] = calls + 1
        feed = stateful_feed(ids, past, engine._inputs, calls)
        if engine._kv is not None and request is engine._decode_request:
            from kernels.native_decode_attention import STORE

            feed[STORE] = engine._kv.feed
        t0 = time.perf_counter()
        request.infer(feed)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            prompt = np.asarray(build(lambda t: tokenizer.encode(t, add_special_tokens=False), args.context,
                                      "filler", salt=f"verify:{r}").ids, dtype=np.int64)
            engine._reset_state()
            engine._infer(prompt, 0)
            engine._infer(np.array([int(rng.integers(vocab))]), prompt.size)  # the state moves to decode
            past = prompt.size + 1
            series = []
            for _ in range(args.steps):
                series.append(timed(engine._decode_request, np.array([int(rng.integers(vocab))]), past))
                past += 1
            times.setdefault("decode", []).extend(series[2:])
            for k in ks:
                engine._reset_state()
                engine._infer(prompt, 0)
                past, series = prompt.size, []
                for _ in range(args.steps):
                    series.append(timed(engine._prefill_request, rng.integers(vocab, size=k).astype(np.int64), past))
                    past += k
                times.setdefault(f"prefill_{k}", []).extend(series[2:])
        outputs = {}
        for prompt_class in CLASSES if args.lookup_tokens > 0 else ():
            prompt = build(lambda t: tokenizer.encode(t, add_special_tokens=False), args.context, prompt_class,
                           salt="verify:lookup").ids
            engine._reset_state()
            logits, generated = engine._infer(np.asarray(prompt, dtype=np.int64), 0)[0], []
            while len(generated) < args.lookup_tokens:
                generated.append(int(np.argmax(logits)))
                logits, _ = engine._infer(np.array([generated[-1]], dtype=np.int64), len(prompt) + len(generated) - 1)
            outputs[prompt_class] = (prompt, generated)
    finally:
        engine.close()

    step = float(np.median(times["decode"]))
    print(json.dumps({"model": model_dir.name, "context": args.context, "experts": experts, "top_k": top_k,
                      "bytes_per_token_mb": round(one / 1e6, 1), "routed_mb": round(routed / 1e6, 1),
                      "decode_step_ms": round(1000 * step, 2)}))
    for k in ks:
        call = float(np.median(times[f"prefill_{k}"]))
        union = expected_union(experts, top_k, k)
        ratio = (one - routed + routed * union / top_k) / one
        need = acceptance_for(2.0, ratio, k)
        need_measured = acceptance_for(2.0, call / step, k)
        print(json.dumps({"k": k, "prefill_graph_call_ms": round(1000 * call, 2),
                          "call_over_step": round(call / step, 2), "expected_experts": round(union, 1),
                          "bytes_over_step": round(ratio, 2),
                          "acceptance_for_2x_at_bytes": None if need is None else round(need, 3),
                          "acceptance_for_2x_measured": None if need_measured is None else round(need_measured, 3)}))
    for prompt_class, (prompt, generated) in outputs.items():
        for k in ks:
            if k < 2:
                continue
            r = lookup_replay(prompt, generated, k, ngram)
            print(json.dumps({"lookup": prompt_class, "k": k, "ngram": list(ngram), **r,
                              "tokens_per_call": round(r["tokens"] / r["calls"], 2),
                              "draft_acceptance": round(r["accepted"] / r["drafted"], 3) if r["drafted"] else None,
                              "distinct_generated": len(set(generated))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
