"""Benchmark (not a test): decode tokens/s through HTTP SSE vs the engine in-process.

    .venv/bin/python -m tests.bench_gateway_sse --model dev-bench --tokens 128 --runs 3

In-process: `engine.step()` in a loop, a timestamp per output token. Over HTTP: a real
`iq36 serve` and the official `openai` client streaming /v1/completions with the same prompt
token ids (greedy), a timestamp per received chunk. Decode rate = (tokens - 1) / (last - first),
so prefill and the first token are excluded on both sides; the median of the runs is reported
with the overhead per token. The two are run one after the other, never concurrently (2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPT = [9707, 1879, 11, 419, 374, 264, 1273, 13] * 16  # 128 tokens, the same both ways


def _rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def in_process(model_dir: Path, profile: str, engine_kind: str, tokens: int, runs: int) -> list[float]:
    from iq36.profile import load
    from worker.engine import EngineRequest, SamplingParams, create

    engine = create(engine_kind, model_dir, load(profile))
    rates = []
    try:
        for i in range(runs + 1):  # the first is a warm-up
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            engine.add(EngineRequest(f"bench-{i}", tuple(PROMPT), params, reuse_prefix=False))
            stamps: list[float] = []
            done = False
            while not done:
                for out in engine.step():
                    now = time.perf_counter()
                    stamps += [now] * len(out.token_ids)
                    done = done or out.finished
            if i:
                rates.append(_rate(stamps))
    finally:
        engine.close()
    return rates


def over_http(model_dir: Path, profile: str, engine_kind: str, tokens: int, runs: int) -> list[float]:
    from tests.gateway_server import MODEL, GatewayServer

    with tempfile.TemporaryDirectory(prefix="iq36-") as d:
        with GatewayServer(Path(d) / "state", model_dir, "--profile", profile, "--engine", engine_kind) as srv:
            client = srv.openai(timeout=600)
            rates = []
            for i in range(runs + 1):
                stamps: list[float] = []
                with client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                               stream=True) as stream:
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].text:
                            stamps.append(time.perf_counter())
                if i:
                    rates.append(_rate(stamps))
            srv.serve.terminate()
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dev-bench")
    p.add_argument("--engine", default="candidate", choices=["candidate", "stock"])
    p.add_argument("--profile", default="cpu")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    from iq36.cli import resolve_model

    model_dir = resolve_model(args.model)
    local = in_process(model_dir, args.profile, args.engine, args.tokens, args.runs)
    http = over_http(model_dir, args.profile, args.engine, args.tokens, args.runs)
    a, b = statistics.median(local), statistics.median(http)
    print(json.dumps({"model": args.model, "engine": args.engine, "tokens": args.tokens, "runs": args.runs,
                      "in_process_tok_s": round(a, 2), "http_sse_tok_s": round(b, 2),
                      "overhead_per_token_pct": round(100 * (1 / b - 1 / a) / (1 / a), 2),
                      "in_process_runs": [round(r, 2) for r in local], "http_runs": [round(r, 2) for r in http]}))


if __name__ == "__main__":
    sys.exit(main())
