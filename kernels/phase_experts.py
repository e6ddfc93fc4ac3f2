"""Kernel `phase_experts`: one graph, routed experts token-grouped for prefill chunks and
left to the plugin's fused kernel for decode.

Why (docs/perf-log.md, "Routed experts, token-grouped" and "One graph for both phases"): for a
chunk of many tokens it is far cheaper to run each expert once on all the tokens routed to it
than to read every expert's weights once per token, as the plugin's `GatherMatmulCompressed`
does; for one token it is the other way round. `grouped_experts` needs a second compiled model
(and the memory of a second model); this kernel keeps one:

    If(tokens >= MIN_TOKENS)
      then: Loop over the experts present in the chunk (Unique of the top-k ids): gather the
            expert's u4 weights, zero points and scales from the stacked constants at run time,
            decompress them as the export does, run its three matmuls on its tokens only and
            scatter-add the weighted result back;
      else: the exported block, unchanged (the plugin still fuses it inside the branch).

Both branches hold the same constants (measured: the plugin keeps one copy). Nothing depends on
the expert count. Same math as the block, in another summation order (~1e-6 relative in f32,
`tests/test_phase_experts.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

NAME = "phase_experts"
MIN_TOKENS = 16  # below this a chunk takes the fused path (the loop's per-expert cost dominates)


class RewriteError(RuntimeError):
    pass


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
    key = node.get_name()
    if key not in memo:
        if node.get_type_name() == "Constant":
            memo[key] = True
        elif node.get_input_size() == 0:
            memo[key] = False
        else:
            memo[key] = all(_constant_only(node.input_value(i).get_node(), memo) for i in range(node.get_input_size()))
    return memo[key]


def _into_branches(model: Any, out: Any, x2d: Any, memo: dict[str, bool]) -> tuple[Any, Any, Any, list[Any]]:
    """Move the block between `x2d` and `out` (with its constant-only inputs) into a new body
    model and a clone of it. Returns (then_body, else_body, consumers of out, outer sources)."""
    import openvino as ov
    from openvino import opset8
    from openvino import opset15 as op

    upstream = _ancestors(out)
    inside: dict[str, Any] = {}
    stack = [x2d.get_node()]
    while stack:
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
    else_body = ov.Model([opset8.result(out.output(0))], params, "experts_fused")
    then_body = else_body.clone()
    return then_body, else_body, consumers, sources


def _chain(matmul: Any) -> tuple[Any, Any, Any, Any, Any]:
    """The stacked constants of a bmm's weight decompression: (u4 weights, u4 zero points,
    scales, decompression type, output type)."""
    import openvino as ov

    conv = matmul.input_value(1).get_node()
    reshape = conv.input_value(0).get_node()
    mul = reshape.input_value(0).get_node()
    if conv.get_type_name() != "Convert" or reshape.get_type_name() != "Reshape" or mul.get_type_name() != "Multiply":
        raise RewriteError("the expert weights are not Convert(Reshape(Multiply(...)))")
    sub, scale = mul.input_value(0).get_node(), mul.input_value(1).get_node()
    if sub.get_type_name() != "Subtract" or scale.get_type_name() != "Constant":
        raise RewriteError("the expert weights have no zero point / constant scale")
    w_conv, z_conv = sub.input_value(0).get_node(), sub.input_value(1).get_node()
    w, z = w_conv.input_value(0).get_node(), z_conv.input_value(0).get_node()
    for c in (w, z):
        if c.get_type_name() != "Constant" or c.get_output_element_type(0) != ov.Type.u4:
            raise RewriteError("the expert weights are not u4 constants")
    return w, z, scale, w_conv.get_output_element_type(0), conv.get_output_element_type(0)


def _routed_parts(body: Any) -> dict[str, Any]:
    """In a branch body: the sum over experts and what the loop needs from the block."""
    from kernels import grouped_experts

    for node in body.get_ordered_ops():
        if node.get_type_name() != "ReduceSum" or node.input_value(0).get_node().get_type_name() != "Multiply":
            continue
        try:
            grouped_experts._block(node)
        except grouped_experts.RewriteError:
            continue
        mul = node.input_value(0).get_node()
        a, b = (mul.input_value(i).get_node() for i in range(2))
        reshape = a if a.get_type_name() == "Reshape" else b
        down = reshape.input_value(0).get_node()
        act = down.input_value(0).get_node()
        p, q = (act.input_value(i).get_node() for i in range(2))
        swish, up = (p, q) if p.get_type_name() == "Swish" else (q, p)
        gate = swish.input_value(0).get_node()
        other = b if reshape is a else a
        while other.get_type_name() != "ScatterElementsUpdate":
            other = other.input_value(0).get_node()
        tile = gate.input_value(0).get_node()
        while tile.get_type_name() != "Tile":
            tile = tile.input_value(0).get_node()
        return {"sum": node, "target": reshape.input_value(1), "x": tile.input_value(0),
                "idx": other.input_value(1), "weights": other.input_value(2),
                "gate": _chain(gate), "up": _chain(up), "down": _chain(down)}
    raise RewriteError("no routed-experts block in the branch")


def _expert_loop(parts: dict[str, Any]) -> Any:
    """[T, H]: the routed experts computed token-grouped, one Loop iteration per present expert."""
    import openvino as ov
    from openvino import opset15 as op

    x = parts["x"]
    et = x.get_element_type()
    idx = op.convert(parts["idx"], ov.Type.i64)
    weights = op.convert(parts["weights"], et)
    present = op.unique(op.reshape(idx, op.constant(np.array([-1], np.int64)), False), sorted=True).output(0)
    trips = op.gather(op.shape_of(present), op.constant(0), op.constant(0))

    i = op.parameter([], np.int64, name="i")
    b_present = op.parameter([-1], np.int64, name="present")
    b_x = op.parameter(x.get_partial_shape(), et, name="x")
    b_idx = op.parameter(idx.get_output_partial_shape(0), ov.Type.i64, name="idx")
    b_w = op.parameter(weights.get_output_partial_shape(0), et, name="weights")
    b_y = op.parameter(x.get_partial_shape(), et, name="y")
    expert = op.gather(b_present, i, op.constant(0))
    hit = op.equal(b_idx, expert)
    weight = op.reduce_sum(op.multiply(op.convert(hit, et), b_w), op.constant(1), False)
    rows = op.transpose(op.non_zero(op.reduce_logical_or(hit, op.constant(1), False), ov.Type.i64),
                        op.constant(np.array([1, 0], np.int64)))
    xs = op.gather_nd(b_x, rows)
    body_params = [i, b_present, b_x, b_idx, b_w, b_y]
    invariants: list[tuple[Any, Any]] = [(b_present, present), (b_x, x), (b_idx, idx.output(0)),
                                         (b_w, weights.output(0))]

    def projection(name: str) -> Any:
        w, z, s, half, out_type = parts[name]
        # The branch's own constants, used inside the loop body as they are: no copy of the
        # weights (as invariant Loop inputs the plugin would hold another copy of them).
        handles = [op.gather(const, expert, op.constant(0)) for const in (w, z, s)]
        gw, gz, gs = handles
        d = op.multiply(op.subtract(op.convert(gw, half), op.convert(gz, half)), gs)
        shape = w.get_output_partial_shape(0).to_shape()
        d = op.reshape(d, op.constant(np.array([shape[1], shape[2] * shape[3]], np.int64)), False)
        return op.convert(d, out_type)

    gate = op.matmul(xs, projection("gate"), False, True)
    up = op.matmul(xs, projection("up"), False, True)
    down = op.matmul(op.multiply(op.swish(gate), up), projection("down"), False, True)
    scaled = op.multiply(down, op.unsqueeze(op.gather_nd(weight, rows), op.constant(1)))
    y_next = op.scatter_nd_update(b_y, rows, scaled, reduction="sum")
    loop = op.loop(trips, op.constant(True))
    loop.set_function(ov.Model([op.constant(True), y_next], body_params, "expert_loop"))
    loop.set_special_body_ports([0, 0])
    for param, value in invariants:
        loop.set_invariant_input(param, value)
    loop.set_merged_input(b_y, op.broadcast(op.convert(op.constant(np.float32(0)), et), op.shape_of(x)).output(0),
                          y_next.output(0))
    return loop.get_iter_value(y_next.output(0), -1)


def _loop_branch(then_body: Any) -> None:
    """Replace the routed experts of a branch body by the token-grouped loop."""
    from openvino import opset15 as op

    parts = _routed_parts(then_body)
    flat = _expert_loop(parts)
    target = op.slice(parts["target"], np.array([1], np.int64), np.array([np.iinfo(np.int64).max], np.int64),
                      np.array([1], np.int64))
    parts["sum"].output(0).replace(op.reshape(flat, target, False).output(0))
    then_body.validate_nodes_and_infer_types()


def wrap_blocks(model: Any, min_tokens: int, rewrite_then: Callable[[Any], None] | None) -> int:
    """Move every MoE block of `model` into both branches of an `If(tokens >= min_tokens)`,
    rewriting the `then` branch with `rewrite_then` (None: the same block twice, a probe of what
    the plugin makes of the If); how many blocks."""
    from openvino import opset8
    from openvino import opset15 as op

    from kernels import grouped_experts

    blocks = grouped_experts._blocks(model)
    memo: dict[str, bool] = {}
    for block in blocks:
        x2d = block.x2d
        then_body, else_body, consumers, sources = _into_branches(model, block.out, x2d, memo)
        if rewrite_then is not None:
            rewrite_then(then_body)
        tokens = op.gather(op.shape_of(x2d), op.constant(0), op.constant(0))
        branch = opset8.if_op(op.greater_equal(tokens, op.constant(np.int64(min_tokens))).output(0))
        branch.set_friendly_name(f"{block.out.get_friendly_name()}/{NAME}")
        branch.set_then_body(then_body)
        branch.set_else_body(else_body)
        for src, tp, ep in zip(sources, then_body.get_parameters(), else_body.get_parameters(), strict=True):
            branch.set_input(src, tp, ep)
        result = branch.set_output(then_body.get_results()[0], else_body.get_results()[0])
        for consumer in consumers:
            consumer.replace_source_output(result)
    model.validate_nodes_and_infer_types()
    return len(blocks)


def apply(model: Any) -> Any:
    """Rewrite every routed-experts block of `model` (before compile) in place; returns it."""
    if not wrap_blocks(model, MIN_TOKENS, _loop_branch):
        raise RewriteError("no routed-experts block of the exported pattern was found")
    return model
