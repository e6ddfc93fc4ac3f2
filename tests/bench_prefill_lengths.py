"""Benchmark (not a test): prefill time per op type at nearby prompt lengths, one warm engine.

    .venv/bin/python -m tests.bench_prefill_lengths --model dev-bench --lengths 256,257,288,320,321

Where a prefill's time steps with the length rather than growing with it: each length gets
one untimed warm-up prefill (the plugin sizes its buffers per shape), then `--runs` timed
ones of fresh `filler` prompts (cold: the state is reset, nothing is reused), with PERF_COUNT
on. Prints, per length, the median wall time of the prefill call and the median time of each
op type; with two or more lengths, the per-op fit t = F + b n through the first and last
(`F` is only a fixed cost if the lengths between lie on the line). Session 12 found the CPU
plugin's compressed matmuls stepping at every multiple of 64 rows with it (docs/perf-log.md).
"""

from __future__ import annotations

import json
import time

import numpy as np

from tests.helpers import bench_lengths, bench_parser


def main() -> int:
    p = bench_parser(__doc__, "256,257")
    p.add_argument("--runs", type=int, default=3, help="timed prefills per length (default: 3)")
    p.add_argument("--top", type=int, default=6, help="op types listed per length (default: 6)")
    args = p.parse_args()
    lengths = bench_lengths(args)

    import msgspec

    from iq36.cli import resolve_model
    from iq36.gate.prompts import build
    from iq36.profile import load
    from worker.engine.candidate import CandidateEngine
    from worker.tokenizer import ModelTokenizer

    model_dir = resolve_model(args.model)
    base = load(args.profile)
    engine_section = msgspec.structs.replace(base.engine, properties={**base.engine.properties, "PERF_COUNT": True})
    profile = msgspec.structs.replace(base, engine=engine_section)
    tokenizer = ModelTokenizer(model_dir)
    engine = CandidateEngine(model_dir, profile, tokenizer)
    results: dict[int, tuple[float, dict[str, float]]] = {}
    try:
        for n in lengths:
            walls, tables = [], []
            for run in range(args.runs + 1):
                prompt = build(lambda t: tokenizer.encode(t, add_special_tokens=False), n, "filler",
                               salt=f"lengths:{n}:{run}").ids
                before = engine.op_profile()
                engine._reset_state()
                t0 = time.perf_counter()
                engine._infer(np.asarray(prompt, dtype=np.int64), 0)
                wall = time.perf_counter() - t0
                after = engine.op_profile()
                if run:  # run 0 warms this length up
                    walls.append(wall)
                    tables.append({op: t - before.get(op, 0.0) for op, t in after.items()})
            ops = {op: float(np.median([t.get(op, 0.0) for t in tables])) for op in tables[0]}
            results[n] = (float(np.median(walls)), ops)
            ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:args.top]
            print(json.dumps({"length": n, "wall_ms": round(1000 * results[n][0], 1),
                              "ops_ms": {op: round(1000 * t, 1) for op, t in ranked}}), flush=True)
    finally:
        engine.close()
    if len(lengths) > 1:
        a, b = lengths[0], lengths[-1]
        rows = [("wall", results[a][0], results[b][0])]
        rows += [(op, results[a][1].get(op, 0.0), results[b][1].get(op, 0.0))
                 for op in sorted(results[b][1], key=lambda o: -results[b][1][o])[:args.top]]
        for op, ta, tb in rows:
            slope = (tb - ta) / (b - a)
            print(json.dumps({"fit": op, "from": [a, b], "F_ms": round(1000 * (ta - slope * a), 1),
                              "b_ms_per_token": round(1000 * slope, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
