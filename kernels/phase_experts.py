"""Kernel `phase_experts`: one graph, routed experts token-grouped for prefill chunks and
left to the plugin's fused kernel for decode.

Why (docs/perf-log.md, "Routed experts, token-grouped" and the `phase_experts` sections): for a
chunk of many tokens it is far cheaper to run each expert once on all the tokens routed to it
than to read every expert's weights once per token, as the plugin's `GatherMatmulCompressed`
does; for one token it is the other way round. `grouped_experts` needs a second compiled model
(and the memory of a second model); this kernel keeps one graph and one copy of the weights:

    n = 1 if tokens >= MIN_TOKENS else tokens
    y = concat(exported_block(rows[:n]),          the plugin-fused block, unchanged
               expert_loop(rows)[n:])             no iteration below MIN_TOKENS

The loop runs over the experts present in the chunk (Unique of the top-k ids): it gathers the
expert's packed u4 bytes, zero points and scales from the block's own constants (a u8 view of
the same buffer, no copy), unpacks and decompresses them as the export does, runs its three
matmuls on its tokens only and scatter-adds the weighted result back. The router stays where it
was; both paths read its top-k ids and weights. There is no `If`: the plugin runs an `If`
body on one thread, which cost decode 1.5-2.5 ms per MoE layer (docs/perf-log.md).

The rewritten model has one more input, `TICK` (u8 `[k]`, contents unused): the caller must
give it a different shape than at its previous inference (`worker.reference.stateful_feed`
alternates k = 1, 2). The CPU plugin re-binds a Loop's body to its outer memory only when the
Loop's input shapes change; when they do not but the outer memory moved (it does as the KV
cache grows), the body reads the old buffers. Equal-shaped prefill chunks then came out wrong
from the 3rd-6th chunk on (the 131,072-token bug, docs/perf-log.md). The loop's continue
condition reads the tick's shape, so the plugin cannot drop it.

Nothing depends on the expert or layer count. Same math as the block, in another summation
order (~1e-6 relative in f32, `tests/test_phase_experts.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kernels.packed import u8_view

NAME = "phase_experts"
MIN_TOKENS = 16  # below this a chunk takes the fused path (the loop's per-expert cost dominates)
TICK = "iq36_tick"  # an extra input whose shape must change at every inference (see above)


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


def _into_branches(model: Any, out: Any, x2d: Any, memo: dict[str, bool],
                   outside: set[str] = frozenset(), seeds: tuple[Any, ...] = ()  # type: ignore[assignment]
                   ) -> tuple[Any, Any, Any, list[Any]]:
    """Move the block between `x2d` and `out` (with its constant-only inputs, but not the nodes
    named in `outside`; the block is what lies downstream of `x2d` or of the `seeds` nodes) into a
    new body model and a clone of it. Returns (then_body, else_body,
    consumers of out, outer sources)."""
    import openvino as ov
    from openvino import opset8
    from openvino import opset15 as op

    upstream = _ancestors(out)
    inside: dict[str, Any] = {}
    stack = [x2d.get_node(), *seeds]
    while stack:
        n = stack.pop()
        for o in n.outputs():
            for target in o.get_target_inputs():
                m = target.get_node()
                if m.get_name() in upstream and m.get_name() not in inside and m.get_name() not in outside:
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


def _packed_view(const: Any) -> Any:
    """A u8 constant `[E, n/2]` over the same bytes as the u4 constant `const` `[E, ...]` (n
    elements per expert, two to a byte, the first in the low nibble). The memory is shared."""
    shape = const.get_output_shape(0)
    per_expert = int(np.prod(shape[1:]))
    if per_expert % 2:
        raise RewriteError("an expert's u4 block does not end on a byte boundary")
    return u8_view(const, (int(shape[0]), per_expert // 2))


def _unpack_u4(rows: Any, const: Any) -> Any:
    """u8 `[n/2]` packed bytes -> u4 values `const.shape[1:]`, as u8."""
    from openvino import opset15 as op

    low = op.bitwise_and(rows, op.constant(np.uint8(0x0F)))
    high = op.bitwise_right_shift(rows, op.constant(np.uint8(4)))
    pairs = op.concat([op.unsqueeze(low, op.constant(-1)), op.unsqueeze(high, op.constant(-1))], -1)
    shape = np.array(list(const.get_output_shape(0))[1:], np.int64)
    return op.reshape(pairs, op.constant(shape), False)


def _expert_loop(parts: dict[str, Any], run: Any = None, tick: Any = None) -> Any:
    """[T, H]: the routed experts computed token-grouped, one Loop iteration per present expert
    (no iteration, zeros, where the boolean `run` is false). `tick`: the `TICK` parameter, read
    by the body's continue condition (see `TICK`)."""
    import openvino as ov
    from openvino import opset15 as op

    x = parts["x"]
    et = x.get_element_type()
    views: dict[str, Any] = {}

    def packed(const: Any) -> Any:
        if const.get_name() not in views:
            views[const.get_name()] = _packed_view(const)
        return views[const.get_name()]
    idx = op.convert(parts["idx"], ov.Type.i64)
    weights = op.convert(parts["weights"], et)
    present = op.unique(op.reshape(idx, op.constant(np.array([-1], np.int64)), False), sorted=True).output(0)
    trips = op.gather(op.shape_of(present), op.constant(0), op.constant(0))
    if run is not None:
        trips = op.select(run, trips, op.constant(np.int64(0)))

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
    go: Any = op.constant(True)
    if tick is not None:  # always true, but the plugin cannot know: the tick's shape is an input
        b_tick = op.parameter([-1], ov.Type.u8, name="tick")
        body_params.append(b_tick)
        invariants.append((b_tick, tick))
        go = op.greater_equal(op.gather(op.shape_of(b_tick), op.constant(0), op.constant(0)),
                              op.constant(np.int64(0)))

    def gathered(name: str) -> tuple[Any, Any]:
        """The expert's decompressed weights `[out, in/2]` for the even and the odd positions
        of each input group (one byte holds an even element in its low nibble and the next odd
        one in its high nibble)."""
        w, z, s, half, out_type = parts[name]
        shape = w.get_output_partial_shape(0).to_shape()  # [E, out, groups, group]
        # The packed bytes, unpacked with float arithmetic (exact on 0..255) that the plugin runs
        # as one fused eltwise chain. (A Gather over the u4 constant itself makes the plugin hold
        # the constant unpacked, +1.7 GB on dev-bench-256; bitwise ops + Concat were 8x slower.)
        b = op.convert(op.gather(packed(w), expert, op.constant(0)), ov.Type.f32)
        b = op.reshape(b, op.constant(np.array([shape[1], shape[2], shape[3] // 2], np.int64)), False)
        high = op.floor(op.multiply(b, op.constant(np.float32(1 / 16))))
        low = op.subtract(b, op.multiply(high, op.constant(np.float32(16))))
        halves = (op.convert(low, half), op.convert(high, half))
        gz = op.convert(op.gather(z, expert, op.constant(0)), half)
        gs = op.gather(s, expert, op.constant(0))
        flat = op.constant(np.array([shape[1], shape[2] * shape[3] // 2], np.int64))
        return tuple(op.convert(op.reshape(op.multiply(op.subtract(h, gz), gs), flat, False), out_type)
                     for h in halves)  # type: ignore[return-value]

    def split(a: Any) -> tuple[Any, Any]:
        """Columns of `a` [n, in] at even and at odd positions, [n, in/2] each (groups are even
        in size, so a pair never straddles two groups)."""
        r = op.reshape(a, op.constant(np.array([0, -1, 2], np.int64)), True)
        return tuple(op.squeeze(op.gather(r, op.constant(np.array([k], np.int64)), op.constant(2)),
                                op.constant(2)) for k in (0, 1))  # type: ignore[return-value]

    def projection(a: Any, name: str) -> Any:
        even, odd = split(a)
        w_even, w_odd = gathered(name)
        return op.add(op.matmul(even, w_even, False, True), op.matmul(odd, w_odd, False, True))

    gate = projection(xs, "gate")
    up = projection(xs, "up")
    down = projection(op.multiply(op.swish(gate), up), "down")
    scaled = op.multiply(down, op.unsqueeze(op.gather_nd(weight, rows), op.constant(1)))
    y_next = op.scatter_nd_update(b_y, rows, scaled, reduction="sum")
    loop = op.loop(trips, op.constant(True))
    loop.set_function(ov.Model([go, y_next], body_params, "expert_loop"))
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
        # The router (top-k ids and weights) stays in the outer graph: the branches get its
        # outputs, so a decode step's If holds only the experts.
        router = _ancestors(block.idx.get_node()) | _ancestors(block.weights.get_node())
        seeds = (block.idx.get_node(), block.weights.get_node())
        then_body, else_body, consumers, sources = _into_branches(model, block.out, x2d, memo, router, seeds)
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


def _native_experts(parts: dict[str, Any], x: Any, idx: Any, weights: Any, skip: Any) -> Any:
    """The native U4Experts op on the block's own constants: rows from `skip` on."""
    from kernels import native as native_ops

    consts = [c.output(0) for name in ("gate", "up", "down") for c in parts[name][:3]]
    return native_ops.factory().create("U4Experts", [x, idx, weights, skip.output(0), *consts]).output(0)


def _gate_block(model: Any, block: Any, memo: dict[str, bool], tick: Any, native: bool | str = False) -> None:
    """Both paths in the outer graph, no `If` (whose body the plugin runs on one thread):

        n = 1 if T >= MIN_TOKENS else T       rows for the exported (plugin-fused) block
        y = concat(fused(rows[:n]), loop(rows)[n:])

    The loop has no iteration below the threshold (decode: the fused block does everything,
    the loop's slice is empty); above it the fused block runs one row and the loop the chunk."""
    from openvino import opset15 as op

    router = _ancestors(block.idx.get_node()) | _ancestors(block.weights.get_node())
    seeds = (block.idx.get_node(), block.weights.get_node())
    _, body, consumers, sources = _into_branches(model, block.out, block.x2d, memo, router, seeds)
    outer = {p.get_name(): src for p, src in zip(body.get_parameters(), sources, strict=True)}
    parts = _routed_parts(body)
    hidden = block.x2d.get_partial_shape()[1].get_length()
    experts = parts["gate"][0].get_output_shape(0)[0]

    def src(param_output: Any) -> Any:
        return outer[param_output.get_node().get_name()]

    x, idx, weights = src(parts["x"]), src(parts["idx"]), src(parts["weights"])
    zero, big = op.constant(np.array([0], np.int64)), op.constant(np.array([np.iinfo(np.int64).max], np.int64))
    one = op.constant(np.array([1], np.int64))
    out_shape = op.slice(src(parts["target"]), one, big, one)

    def connect(y: Any) -> None:
        out = op.reshape(y, out_shape, False)
        out.set_friendly_name(f"{block.out.get_friendly_name()}/{NAME}")
        for consumer in consumers:
            consumer.replace_source_output(out.output(0))

    if native == "all":  # the native op takes every row, decode included; no fused block
        connect(_native_experts(parts, x, idx, weights, zero))
        return
    tokens = op.gather(op.shape_of(x), op.constant(np.array([0], np.int64)), op.constant(0))
    run = op.greater_equal(tokens, op.constant(np.array([MIN_TOKENS], np.int64)))
    n = op.select(run, op.constant(np.array([1], np.int64)), tokens)

    def head(v: Any) -> Any:
        return op.slice(v, zero, n, one, op.constant(np.array([0], np.int64)))

    # the fused block on the first n rows: its row-count-dependent inputs rebuilt for n rows
    scatter = parts["idx"].get_target_inputs().pop().get_node()
    new_src: dict[str, Any] = {
        parts["x"].get_node().get_name(): head(x).output(0),
        parts["idx"].get_node().get_name(): head(idx).output(0),
        parts["weights"].get_node().get_name(): head(weights).output(0),
        scatter.input_value(0).get_node().get_name(): op.broadcast(
            op.convert(op.constant(np.float32(0)), scatter.input_value(0).get_element_type()),
            op.concat([n, op.constant(np.array([experts], np.int64))], 0)).output(0),
    }
    for param in body.get_parameters():
        name = param.get_name()
        if name in new_src:
            continue
        if param.get_element_type().is_integral() and param.get_partial_shape().rank.get_length() == 1:
            rank = param.get_partial_shape()[0].get_length()  # a reshape target [E, B, S(, H)]
            dims = [op.constant(np.array([experts, 1], np.int64)), n]
            if rank == 4:
                dims.append(op.constant(np.array([hidden], np.int64)))
            elif rank != 3:
                raise RewriteError(f"unexpected reshape target of rank {rank} in the experts block")
            new_src[name] = op.concat(dims, 0).output(0)
        else:
            raise RewriteError(f"unexpected input {name} of the experts block")
    for param in body.get_parameters():
        for target in list(param.output(0).get_target_inputs()):
            target.replace_source_output(new_src[param.get_name()])
    fused = op.reshape(body.get_results()[0].input_value(0), op.constant(np.array([-1, hidden], np.int64)), False)

    loop_parts = dict(parts, x=x, idx=idx, weights=weights)
    if native:  # the native op computes rows [n, T) and leaves rows [0, n) at zero
        rest = _native_experts(parts, x, idx, weights, n)
    else:
        rest = _expert_loop(loop_parts, op.squeeze(run, op.constant(0)), tick)
    looped = op.slice(rest, n, big, one, op.constant(np.array([0], np.int64)))
    connect(op.concat([fused, looped], 0))


def apply(model: Any, native: bool | str = False) -> Any:
    """Rewrite every routed-experts block of `model` (before compile) in place; returns it.

    `native`: the rows from n on go to the native `U4Experts` op (kernels/native) instead of the
    Loop; then there is no Loop, and no tick input. `native="all"`: every row, decode included,
    goes to the op (no fused block)."""
    from kernels import grouped_experts

    blocks = grouped_experts._blocks(model)
    if not blocks:
        raise RewriteError("no routed-experts block of the exported pattern was found")
    import openvino as ov
    from openvino import opset15 as op

    tick = None if native else op.parameter([-1], ov.Type.u8, name=TICK)  # the Loop's (see TICK)
    if tick is not None:
        tick.output(0).get_tensor().set_names({TICK})
    memo: dict[str, bool] = {}
    for block in blocks:
        _gate_block(model, block, memo, None if tick is None else tick.output(0), native)
    if tick is not None:
        model.add_parameters([tick])
    model.validate_nodes_and_infer_types()
    return model
