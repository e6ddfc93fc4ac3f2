"""Benchmark (not a test): host time of decoding text in the decode loop, by detokenizer.

    .venv/bin/python -m tests.bench_detok --model dev-bench --rounds 6 --tokens 100

`ModelTokenizer.decode` joins the detokenizer IR's vocabulary bytes itself (`IrVocabulary`) and
leaves what that cannot decode exactly to openvino-genai's detokenizer. Two parts:

- per call: `decode` of `IncrementalDetokenizer`-sized windows (WINDOW + 2 tokens) of a long
  encoded text, the IR vocabulary against genai (min of `--calls` timed passes; the share of
  windows the fast path took);
- in the engine: one warm candidate engine, greedy requests of `--tokens` tokens after a
  `--lengths` prompt (fresh `filler`, cold), the two ways alternating over `--rounds`; per token,
  the time of a request's decode steps outside the model's `infer` (sampling, detokenizing, the
  engine's bookkeeping). Session 43 on the Zen 4 EPYC: 0.59 -> 0.18 ms a token on `dev-bench`
  (docs/perf-log.md).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from tests.helpers import bench_args, bench_parser, bench_rounds


def main() -> int:
    p = bench_parser(__doc__, "256")
    bench_rounds(p, 6, "requests per way", 100, "tokens generated per request")
    p.add_argument("--calls", type=int, default=5, help="timed passes over the windows (default: 5)")
    args, lengths = bench_args(p, one_length=True)

    from iq36.cli import resolve_model
    from iq36.gate.prompts import build
    from iq36.gate.session import time_request
    from iq36.profile import load
    from worker.detok import WINDOW
    from worker.engine.candidate import CandidateEngine
    from worker.tokenizer import ModelTokenizer

    model_dir = resolve_model(args.model)
    tokenizer = ModelTokenizer(model_dir)
    vocab = tokenizer._vocab
    if vocab is None:
        print(f"{model_dir}: the detokenizer is not the graph IrVocabulary reads; genai decodes everything")
        return 1
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    text = build(encode, 4096, "filler", salt="detok:text").ids
    windows = [list(text[i:i + WINDOW + 2]) for i in range(0, len(text) - WINDOW - 2, 7)]
    taken = sum(vocab.decode(w, True) is not None for w in windows)
    genai = lambda ids, skip: str(tokenizer._tok.decode(ids, skip_special_tokens=skip))  # noqa: E731
    for name, decode in (("ir vocabulary", tokenizer.decode), ("genai", genai)):
        best = float("inf")
        for _ in range(args.calls):
            t = time.perf_counter()
            for w in windows:
                decode(w, True)
            best = min(best, (time.perf_counter() - t) / len(windows))
        print(f"per call ({WINDOW + 2} tokens), {name}: {best * 1e6:.1f} us")
    print(f"fast path taken for {taken} of {len(windows)} windows of the text")

    engine = CandidateEngine(model_dir, load(args.profile), tokenizer)
    infer = engine._infer
    spent: list[float] = []

    def timed(ids: np.ndarray, past: int) -> Any:
        t = time.perf_counter()
        out = infer(ids, past)
        spent.append(time.perf_counter() - t)
        return out

    engine._infer = timed  # type: ignore[method-assign]
    outside: dict[str, list[float]] = {}
    try:
        time_request(engine, "warm", build(encode, lengths[0], "filler", salt="detok:warm").ids, 4)
        for r in range(args.rounds):
            for way in (("ir", "genai") if r % 2 == 0 else ("genai", "ir")):
                tokenizer._vocab = vocab if way == "ir" else None
                spent.clear()
                ids = build(encode, lengths[0], "filler", salt=f"detok:{way}:{r}").ids
                tpot = time_request(engine, f"{way}-{r}", ids, args.tokens)["tpot_s"]
                steps = len(tpot) - 1  # intervals after the first decode step (the handoff's)
                outside.setdefault(way, []).append((sum(tpot[1:]) - sum(spent[-steps:])) / steps)
    finally:
        tokenizer._vocab = vocab
        engine._infer = infer  # type: ignore[method-assign]
        engine.close()
    for way, v in outside.items():
        print(f"engine, {way}: outside infer {statistics.median(v) * 1e3:.3f} ms a token (median of {len(v)}: "
              + " ".join(f"{x * 1e3:.2f}" for x in v) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
