"""Probe (not a test): the routed-experts blocks of the IR wrapped in `If(tokens > 1)`.

    .venv/bin/python -m tests.bench_if_experts --model dev-bench-256 --tokens 512

Issue #7 groundwork for a single graph that serves both phases: each MoE block (router included,
from the flattened hidden states to the sum over experts) moves into both branches of an `If`
on the chunk's token count — the same block twice here, so the question is only what the CPU
plugin makes of it: does it still fuse the branch into `GatherMatmulCompressed` (decode speed),
and does it keep one copy of the expert weights for the two branches (RSS)? Weight
decompression chains (subgraphs with only Constant leaves) go into the bodies with the block, so
the plugin still sees constant, compressed weights (`kernels.phase_experts.wrap_blocks`). Prints
prefill time, median decode time per token and RSS for `--mode plain` (unmodified) or
`--mode if`, one mode per process.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dev-bench-256")
    p.add_argument("--mode", choices=["plain", "if"], default="if")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--decode", type=int, default=8)
    args = p.parse_args()

    import openvino as ov
    import psutil

    from iq36.cli import resolve_model
    from kernels import last_token_logits, phase_experts
    from worker.reference import stateful_feed

    core = ov.Core()
    model = last_token_logits.apply(core.read_model(resolve_model(args.model) / "openvino_model.xml"))
    # If(tokens >= 2) with the unchanged block in both branches
    wrapped = phase_experts.wrap_blocks(model, 2, None) if args.mode == "if" else 0
    request = core.compile_model(model, "CPU", {"PERFORMANCE_HINT": "LATENCY"}).create_infer_request()
    names = {port.get_any_name() for port in model.inputs}
    ids = np.arange(100, 100 + args.tokens, dtype=np.int64)
    request.infer(stateful_feed(ids + 3, 0, names))  # warm-up
    request.reset_state()
    t0 = time.perf_counter()
    request.infer(stateful_feed(ids, 0, names))
    prefill = time.perf_counter() - t0
    steps = []
    for k in range(args.decode):
        t0 = time.perf_counter()
        request.infer(stateful_feed(np.array([7 + k], np.int64), args.tokens + k, names))
        steps.append(time.perf_counter() - t0)
    rss = psutil.Process().memory_info().rss / 1e9
    print(f"{args.mode} ({wrapped} blocks wrapped): prefill {args.tokens} tokens {prefill:.2f} s, decode "
          f"{float(np.median(steps)) * 1000:.1f} ms/token, RSS {rss:.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
