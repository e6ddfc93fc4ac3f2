"""Benchmark (not a test): time to first token of a multi-turn chat with prefix-state reuse vs without.

    .venv/bin/python -m tests.bench_prefix_reuse --model dev-bench --turns 4 --runs 3

The candidate engine in-process. A conversation: turn 1's prompt is an opening of --opening
tokens plus a message of --message tokens; turn k+1's prompt is turn k's prompt, its greedy
answer (--answer tokens) and a new message, as a chat client resends its history. Each turn's
prompt is timed twice, one right after the other: bypassed (`reuse_prefix=False`: a full
prefill, the cache untouched) and with reuse (served from the earlier turns' snapshots); the
reuse run's answer continues the conversation. TTFT = `add()` to the first token; every
request runs until the engine is idle, so a snapshot still due is never charged to the next
request. Each run is a new conversation (its own salt) on an emptied cache, after one untimed
warm-up. Printed: per turn, the median over the runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

Timed = tuple[float, int, list[int]]  # TTFT seconds, cached tokens, generated tokens


def _ttft(engine: Any, request_id: str, prompt: tuple[int, ...], answer: int, reuse: bool) -> Timed:
    """(TTFT seconds, cached tokens, generated tokens) of one greedy request, run to idle."""
    from worker.engine import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
    first: float | None = None
    cached = 0
    tokens: list[int] = []
    t0 = time.perf_counter()
    engine.add(EngineRequest(request_id, prompt, params, reuse_prefix=reuse))
    while engine.has_work():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.error:
                raise RuntimeError(f"{request_id} failed: {out.error}")
            if out.token_ids and first is None:
                first = time.perf_counter()
                cached = out.cached_tokens
            tokens.extend(out.token_ids)
    if first is None:
        raise RuntimeError(f"{request_id} produced no token")
    return first - t0, cached, tokens


def conversation(engine: Any, encode: Any, run: int, args: argparse.Namespace) -> list[dict[str, float]]:
    from iq36.gate.prompts import build

    def text(n: int, salt: str) -> tuple[int, ...]:
        return build(encode, n, "prefill-shape", salt=salt).ids

    prompt = text(args.opening, f"bench-{run}-opening") + text(args.message, f"bench-{run}-turn-0")
    rows = []
    for turn in range(args.turns):
        bypass_s, _, _ = _ttft(engine, f"r{run}-t{turn}-bypass", prompt, args.answer, reuse=False)
        reuse_s, cached, answer = _ttft(engine, f"r{run}-t{turn}-reuse", prompt, args.answer, reuse=True)
        rows.append({"prompt": len(prompt), "cached": cached, "reuse_s": reuse_s, "bypass_s": bypass_s})
        prompt = prompt + tuple(answer) + text(args.message, f"bench-{run}-turn-{turn + 1}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dev-bench")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--opening", type=int, default=1024, help="tokens before the first message")
    p.add_argument("--message", type=int, default=128, help="tokens of each new user message")
    p.add_argument("--answer", type=int, default=32, help="greedy tokens generated per turn")
    args = p.parse_args()

    from iq36.cli import resolve_model
    from iq36.profile import load
    from worker.engine import create
    from worker.tokenizer import ModelTokenizer

    model_dir: Path = resolve_model(args.model)
    profile = load(args.profile)
    tokenizer = ModelTokenizer(model_dir)
    engine = create("candidate", model_dir, profile)
    cache = getattr(engine, "prefix_cache", None)
    if cache is None:
        print(f"profile {args.profile} disables [prefix_cache]: nothing to compare", file=sys.stderr)
        return 2

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    try:
        _ttft(engine, "warm-up", tuple(encode("[warm-up] a short untimed request")), 2, reuse=False)
        runs = []
        for run in range(args.runs):
            cache.clear()
            runs.append(conversation(engine, encode, run, args))
    finally:
        engine.close()

    print(f"model {args.model}, profile {args.profile} (chunk {profile.prefill.chunk_tokens} tokens), "
          f"{args.runs} runs, median TTFT per turn; answer {args.answer} tokens, message {args.message} tokens")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'reuse ms':>10} {'bypass ms':>10} {'speed-up':>9}")
    for turn in range(args.turns):
        rows = [r[turn] for r in runs]
        reuse = statistics.median(r["reuse_s"] for r in rows)
        bypass = statistics.median(r["bypass_s"] for r in rows)
        cached = statistics.median(r["cached"] for r in rows)
        print(f"{turn + 1:>4} {rows[0]['prompt']:>7} {cached:>7.0f} {1000 * reuse:>10.1f} {1000 * bypass:>10.1f} "
              f"{bypass / reuse:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
