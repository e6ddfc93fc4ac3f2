"""Benchmark (not a test): the first decode step's cost over the next ones, by context.

    .venv/bin/python -m tests.bench_decode_handoff --model dev-bench --lengths 1024,4096 --rounds 3

The first decode step after a prefill moves the model state from the prefill graph to the decode
graph; with `native_decode_attention` the KV caches go into its store, quantised to u8 rows. Two
ways alternate in one warm engine, `--rounds` requests each per length (fresh `filler` prompts,
cold: nothing reused, greedy, `--tokens` generated): `engine`, the engine as it is (the store
quantises the prefill graph's f32 rows itself, read through views), and `numpy`, the former path
(the caches copied out and quantised by `kernels.native_decode_attention.pack` first; the same
bytes reach the store). Prints per length and way the median first step, the median of the steps
after it, and the median excess of the first. Session 42: 105.6 -> 5.0 ms at 4096 tokens of
`dev-bench` on the Zen 4 EPYC (docs/perf-log.md); the gate's decode rate counts that step.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from tests.helpers import bench_args, bench_parser, bench_rounds


def main() -> int:
    p = bench_parser(__doc__, "1024,4096")
    bench_rounds(p, 3, "requests per length and way", 12, "tokens generated per request")
    args, lengths = bench_args(p)

    import kernels.native_decode_attention as nda
    from iq36.cli import resolve_model
    from iq36.gate.prompts import build
    from iq36.gate.session import time_request
    from iq36.profile import load
    from worker.engine.candidate import CandidateEngine
    from worker.tokenizer import ModelTokenizer

    model_dir = resolve_model(args.model)
    tokenizer = ModelTokenizer(model_dir)
    engine = CandidateEngine(model_dir, load(args.profile), tokenizer)
    if engine._kv is None:
        print(f"profile {args.profile!r} on this machine does not use {nda.NAME}: nothing to compare")
        engine.close()
        return 1
    own = engine._restore

    def former(request: Any, states: dict[str, np.ndarray]) -> None:
        if request is engine._decode_request:
            states = {name: nda.to_state(np.array(a), name, engine._kv.variables) for name, a in states.items()}
        own(request, states)

    ways = {"engine": own, "numpy": former}
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    found: dict[tuple[int, str], list[tuple[float, float]]] = {}
    try:
        time_request(engine, "warm", build(encode, max(lengths), "filler", salt="handoff:warm").ids, 3)
        for r in range(args.rounds):
            for n in lengths:
                for way in (ways if r % 2 == 0 else list(ways)[::-1]):
                    engine._restore = ways[way]  # type: ignore[method-assign]
                    ids = build(encode, n, "filler", salt=f"handoff:{n}:{way}:{r}").ids
                    t = time_request(engine, f"{way}-{n}-{r}", ids, args.tokens)["tpot_s"]
                    found.setdefault((n, way), []).append((t[0], statistics.median(t[1:])))
    finally:
        engine._restore = own  # type: ignore[method-assign]
        engine.close()
    print(f"{'context':>8} {'way':>7} {'first ms':>9} {'next ms':>8} {'excess ms':>10}")
    for (n, way), runs in sorted(found.items()):
        first, rest = (statistics.median(x[i] for x in runs) * 1e3 for i in (0, 1))
        excess = statistics.median(a - b for a, b in runs) * 1e3
        print(f"{n:>8} {way:>7} {first:>9.1f} {rest:>8.2f} {excess:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
