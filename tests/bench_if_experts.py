"""Probe (not a test): the routed-experts blocks of the IR wrapped in `If(tokens > 1)`.

    .venv/bin/python -m tests.bench_if_experts --model dev-bench-256 --tokens 512

Issue #7 groundwork for a single graph that serves both phases: each MoE block (router included,
from the flattened hidden states to the sum over experts) moves into both branches of an `If`
on the chunk's token count — the same block twice here, so the question is only what the CPU
plugin makes of it: does it still fuse the branch into `GatherMatmulCompressed` (decode speed),
and does it keep one copy of the expert weights for the two branches (RSS)? Weight
decompression chains (subgraphs with only Constant leaves) go into the bodies with the block, so
the plugin still sees constant, compressed weights. Prints prefill time, median decode time per
token and RSS for `--mode plain` (unmodified) or `--mode if`, one mode per process.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np


def _ancestors(node: Any) -> set[str]:
    seen: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n.get_name() in seen or n.get_type_name() == "Parameter":
            continue
        seen.add(n.get_name())
        stack.extend(n.input_value(i).get_node() for i in range(n.get_input_size()))
    return seen


def _constant_only(node: Any, memo: dict[str, bool]) -> bool:
    """Every leaf under `node` is a Constant (e.g. a weight decompression chain)."""
    key = node.get_name()
    if key not in memo:
        if node.get_type_name() == "Constant":
            memo[key] = True
        elif node.get_input_size() == 0:
            memo[key] = False
        else:
            memo[key] = all(_constant_only(node.input_value(i).get_node(), memo) for i in range(node.get_input_size()))
    return memo[key]


def wrap_blocks(model: Any) -> int:
    """Move every MoE block of `model` into both branches of an If(tokens > 1); how many."""
    import openvino as ov
    from openvino import opset8
    from openvino import opset15 as op

    from kernels import grouped_experts

    memo: dict[str, bool] = {}
    blocks = grouped_experts._blocks(model)
    for block in blocks:
        out, x2d = block.out, block.x2d
        upstream = _ancestors(out)
        inside: dict[str, Any] = {}
        stack = [x2d.get_node()]
        while stack:  # the block: downstream of the hidden states and upstream of the sum
            n = stack.pop()
            for o in n.outputs():
                for target in o.get_target_inputs():
                    m = target.get_node()
                    if m.get_name() in upstream and m.get_name() not in inside:
                        inside[m.get_name()] = m
                        stack.append(m)
        consumers = list(out.output(0).get_target_inputs())
        params: list[Any] = []
        sources: list[Any] = []
        by_source: dict[tuple[str, int], Any] = {}
        for m in list(inside.values()):
            for i in range(m.get_input_size()):
                src = m.input_value(i)
                sn = src.get_node()
                if sn.get_name() in inside or _constant_only(sn, memo):
                    continue
                key = (sn.get_name(), src.get_index())
                if key not in by_source:
                    by_source[key] = op.parameter(src.get_partial_shape(), src.get_element_type())
                    params.append(by_source[key])
                    sources.append(src)
                m.input(i).replace_source_output(by_source[key].output(0))
        else_body = ov.Model([opset8.result(out.output(0))], params, "experts_decode")
        then_body = else_body.clone()
        tokens = op.gather(op.shape_of(x2d), op.constant(0), op.constant(0))
        branch = opset8.if_op(op.greater(tokens, op.constant(np.int64(1))).output(0))
        branch.set_then_body(then_body)
        branch.set_else_body(else_body)
        for src, tp, ep in zip(sources, then_body.get_parameters(), else_body.get_parameters(), strict=True):
            branch.set_input(src, tp, ep)
        result = branch.set_output(then_body.get_results()[0], else_body.get_results()[0])
        for consumer in consumers:
            consumer.replace_source_output(result)
    model.validate_nodes_and_infer_types()
    return len(blocks)


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
    from kernels import last_token_logits
    from worker.reference import stateful_feed

    core = ov.Core()
    model = last_token_logits.apply(core.read_model(resolve_model(args.model) / "openvino_model.xml"))
    wrapped = wrap_blocks(model) if args.mode == "if" else 0
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
