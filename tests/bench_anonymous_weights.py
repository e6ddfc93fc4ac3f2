"""Benchmark (not a test): decode steps with the weights in the process's own memory or mapped.

    .venv/bin/python -m tests.bench_anonymous_weights --model dev-bench --lengths 1024 --tokens 401

Two candidate engines in one process, the profile's own (`anonymous_weights`: the IR's constants
read from the process's copy of the weights file, on transparent huge pages where the kernel
allows) and the same with the switch off (the constants where the plugin maps the file,
`resident_weights` keeping its pages in), each prefilled with the same prompt, then fed the same
random tokens, their decode steps interleaved one for one (the order alternating), so the
machine's drift hits both alike.
Prints the median step of each every 100 pairs and over all, the paired ratio (copy / mapping)
and how many steps the copy took less time; checks the two engines' logits are the same bits.
`--no-huge` makes the copy on 4 KB pages (madvise(MADV_HUGEPAGE) refused). Session 47 on the Zen 4
EPYC: a decode step 3-4% shorter with the copy (docs/perf-log.md).
"""

from __future__ import annotations

import time

import numpy as np

from tests.helpers import bench_args, bench_parser, bench_rounds


def main() -> int:
    p = bench_parser(__doc__, "1024")
    bench_rounds(p, 1, "runs of --tokens interleaved steps", 401, "decode steps per engine and run")
    p.add_argument("--no-huge", action="store_true", help="the copy on 4 KB pages")
    args, lengths = bench_args(p, one_length=True)

    import msgspec

    from iq36.cli import resolve_model
    from iq36.gate.prompts import build
    from iq36.profile import load
    from worker import resident
    from worker.engine.candidate import ANONYMOUS_WEIGHTS, CandidateEngine
    from worker.tokenizer import ModelTokenizer

    if args.no_huge:
        resident.MADV_HUGEPAGE = -1  # refused by madvise: the copy stays on 4 KB pages
    model_dir = resolve_model(args.model)
    tokenizer = ModelTokenizer(model_dir)
    base = load(args.profile)
    engines = {way: CandidateEngine(model_dir, msgspec.structs.replace(
        base, kernels={**base.kernels, ANONYMOUS_WEIGHTS: way == "copy"}), tokenizer) for way in ("mapped", "copy")}
    if ANONYMOUS_WEIGHTS not in engines["copy"].kernels:
        print("the copy was not made (see the log); nothing to compare")
        return 1
    prompt = list(build(lambda t: tokenizer.encode(t, add_special_tokens=False), lengths[0], "filler",
                        salt="anonymous-weights").ids)
    for run in range(args.rounds):
        # random forced tokens: each step routes to other experts, as generated text does (one
        # token repeated keeps routing to the same experts, whose weights then partly stay in L3)
        forced = [int(i) for i in np.random.default_rng(run).integers(1000, 30000, args.tokens)]
        steps = {way: engine.forced_logits(prompt, forced) for way, engine in engines.items()}
        last = {way: next(gen) for way, gen in steps.items()}  # the prefills
        spent: dict[str, list[float]] = {way: [] for way in engines}
        for i in range(args.tokens - 1):
            for way in (("mapped", "copy") if i % 2 == 0 else ("copy", "mapped")):
                t = time.perf_counter()
                last[way] = next(steps[way])
                spent[way].append(time.perf_counter() - t)
            if not np.array_equal(last["mapped"], last["copy"]):
                print(f"run {run} step {i}: the logits differ")
                return 1
            if (i + 1) % 100 == 0:
                a, b = (np.array(spent[w][-100:]) for w in ("mapped", "copy"))
                print(f"run {run} steps {i - 98}-{i + 1}: mapped {np.median(a) * 1e3:.2f} ms, copy "
                      f"{np.median(b) * 1e3:.2f} ms, paired {np.median(b / a):.3f}", flush=True)
        a, b = (np.array(spent[w]) for w in ("mapped", "copy"))
        print(f"run {run}: mapped {np.median(a) * 1e3:.2f} ms, copy {np.median(b) * 1e3:.2f} ms a step, paired "
              f"{np.median(b / a):.3f}, the copy faster in {int((b < a).sum())} of {a.size}; logits the same",
              flush=True)
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
