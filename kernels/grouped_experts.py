"""Kernel `grouped_experts`: compute the routed experts token-grouped, for prefill chunks.

Why (docs/perf-log.md, "Routed experts, token-grouped"): the exported IR computes the routed
experts densely — every token through every expert (`aten::bmm` on tiled hidden states), then
weighted by the top-k routing matrix and summed — and the CPU plugin turns that block into
`GatherMatmulCompressed`, which reads an expert's weights once per token routed to it. For a
chunk of many tokens it is far cheaper to gather, per expert, the tokens routed to it and run
that expert's three compressed matmuls once on all of them: each expert's weights are then read
once per chunk. For one token (decode) the per-expert blocks cost more than they save, so the
engine uses this rewrite only in its prefill graph (see `worker/engine/candidate.py`).

The rewrite, per MoE block (found from its `ReduceSum` over the expert axis):

    for each expert e:   rows  = NonZero(any(topk_idx == e, axis=1))
                         w_e   = sum(topk_weights * (topk_idx == e), axis=1)[rows]
                         y[rows] += w_e * down_e(silu(gate_e(x[rows])) * up_e(x[rows]))

with `gate_e`, `up_e`, `down_e` that expert's slices of the locked u4 weights, decompressed by
the same Convert → Subtract(zero point) → Multiply(scale) chain as the export (so the plugin
compiles them into compressed matmuls). Nothing depends on the expert count: the loop runs
over the experts the weights hold (256 on the real model). The math is the block's own; only the
order of the floating-point sums differs (~1e-6 relative in f32, `tests/test_grouped_experts.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

NAME = "grouped_experts"


class RewriteError(RuntimeError):
    pass


@dataclasses.dataclass
class _Weight:
    """One projection's stacked u4 weights `[E, rows, groups, group]` and their decompression."""

    packed: np.ndarray  # the u4 constant's bytes
    shape: list[int]
    zero_packed: np.ndarray
    zero_shape: list[int]
    scale: np.ndarray  # [E, rows, groups, 1]
    half: Any  # the element type of the decompression (f16 in the export)
    out_shape: list[int]  # [E, rows, cols]
    out_type: Any  # what the final Convert produces (f32)

    def expert(self, e: int) -> Any:
        import openvino as ov
        from openvino import opset15 as op

        def u4(packed: np.ndarray, shape: list[int]) -> Any:
            per = int(np.prod(shape[1:]))
            if per % 2:
                raise RewriteError("an expert's u4 slice does not start on a byte")
            tensor = ov.Tensor(ov.Type.u4, shape[1:])
            tensor.data.view(np.uint8).reshape(-1)[:] = packed.reshape(shape[0], per // 2)[e]
            return op.constant(tensor)

        w = op.convert(u4(self.packed, self.shape), self.half)
        zp = op.convert(u4(self.zero_packed, self.zero_shape), self.half)
        d = op.multiply(op.subtract(w, zp), op.constant(np.ascontiguousarray(self.scale[e])))
        d = op.reshape(d, op.constant(np.array(self.out_shape[1:], np.int64)), False)
        return op.convert(d, self.out_type)


def _const(node: Any) -> Any:
    if node.get_type_name() != "Constant":
        raise RewriteError(f"expected a Constant, found {node.get_type_name()}")
    return node


def _weight(matmul: Any) -> _Weight:
    """Read the decompression chain feeding a bmm's weight input."""
    import openvino as ov

    conv = matmul.input_value(1).get_node()
    if conv.get_type_name() != "Convert":
        raise RewriteError("the expert weights do not end in a Convert")
    reshape = conv.input_value(0).get_node()
    mul = reshape.input_value(0).get_node()
    if reshape.get_type_name() != "Reshape" or mul.get_type_name() != "Multiply":
        raise RewriteError("the expert weights are not Reshape(Multiply(...))")
    sub, scale = mul.input_value(0).get_node(), _const(mul.input_value(1).get_node())
    if sub.get_type_name() != "Subtract":
        raise RewriteError("the expert weights have no zero point")
    w_conv, z_conv = sub.input_value(0).get_node(), sub.input_value(1).get_node()
    w, z = _const(w_conv.input_value(0).get_node()), _const(z_conv.input_value(0).get_node())
    if w.get_output_element_type(0) != ov.Type.u4 or z.get_output_element_type(0) != ov.Type.u4:
        raise RewriteError("the expert weights are not u4 with a u4 zero point")
    wshape = list(w.get_output_partial_shape(0).to_shape())
    zshape = list(z.get_output_partial_shape(0).to_shape())
    sshape = list(scale.get_output_partial_shape(0).to_shape())
    if zshape[0] != wshape[0] or sshape[0] != wshape[0]:
        raise RewriteError("zero points / scales are not per expert")
    return _Weight(packed=np.asarray(w.get_data()).view(np.uint8), shape=wshape,
                   zero_packed=np.asarray(z.get_data()).view(np.uint8), zero_shape=zshape,
                   scale=np.asarray(scale.get_data()).reshape(sshape), half=w_conv.get_output_element_type(0),
                   out_shape=list(reshape.get_output_partial_shape(0).to_shape()),
                   out_type=conv.get_output_element_type(0))


def _skip(node: Any, types: tuple[str, ...]) -> Any:
    while node.get_type_name() in types:
        node = node.input_value(0).get_node()
    return node


@dataclasses.dataclass
class _Block:
    out: Any  # the ReduceSum over experts: [B, S, H]
    x2d: Any  # hidden states [T, H] (what is tiled over the experts)
    idx: Any  # top-k expert ids [T, k]
    weights: Any  # top-k routing weights [T, k]
    gate: _Weight
    up: _Weight
    down: _Weight


def _block(reduce_sum: Any) -> _Block:
    mul = reduce_sum.input_value(0).get_node()
    if mul.get_type_name() != "Multiply":
        raise RewriteError("not a weighted sum over experts")
    a, b = (mul.input_value(i).get_node() for i in range(2))
    down = _skip(a, ("Reshape",))
    scatter = _skip(b, ("Unsqueeze", "Reshape", "Transpose"))
    if down.get_type_name() != "MatMul" or scatter.get_type_name() != "ScatterElementsUpdate":
        raise RewriteError("not the exported MoE pattern (bmm down, scattered routing)")
    act = down.input_value(0).get_node()
    if act.get_type_name() != "Multiply":
        raise RewriteError("the expert activation is not silu(gate) * up")
    p, q = (act.input_value(i).get_node() for i in range(2))
    swish, up = (p, q) if p.get_type_name() == "Swish" else (q, p)
    gate = swish.input_value(0).get_node()
    if swish.get_type_name() != "Swish" or gate.get_type_name() != "MatMul" or up.get_type_name() != "MatMul":
        raise RewriteError("the expert activation is not silu(gate) * up")
    tile = _skip(gate.input_value(0).get_node(), ("Reshape",))
    if tile.get_type_name() != "Tile":
        raise RewriteError("the experts' input is not the tiled hidden states")
    for mm in (gate, up, down):
        attrs = mm.get_attributes()
        if attrs.get("transpose_a") or not attrs.get("transpose_b"):
            raise RewriteError("unexpected bmm layout")
    return _Block(out=reduce_sum, x2d=tile.input_value(0), idx=scatter.input_value(1), weights=scatter.input_value(2),
                  gate=_weight(gate), up=_weight(up), down=_weight(down))


def _blocks(model: Any) -> list[_Block]:
    found = []
    for node in model.get_ordered_ops():
        if node.get_type_name() != "ReduceSum":
            continue
        mul = node.input_value(0).get_node()
        if mul.get_type_name() != "Multiply":
            continue
        try:
            found.append(_block(node))
        except RewriteError:
            continue
    return found


def _grouped(block: _Block) -> Any:
    import openvino as ov
    from openvino import opset15 as op

    x, experts = block.x2d, block.gate.shape[0]
    idx = op.convert(block.idx, ov.Type.i64)
    weights = op.convert(block.weights, block.x2d.get_element_type())
    y = op.broadcast(op.convert(op.constant(np.float32(0)), x.get_element_type()), op.shape_of(x))
    for e in range(experts):
        hit = op.equal(idx, op.constant(np.int64(e)))
        w_e = op.reduce_sum(op.multiply(op.convert(hit, block.x2d.get_element_type()), weights), op.constant(1), False)
        rows = op.transpose(op.non_zero(op.reduce_logical_or(hit, op.constant(1), False), ov.Type.i64),
                            op.constant(np.array([1, 0], np.int64)))
        xs = op.gather_nd(x, rows)
        g = op.matmul(xs, block.gate.expert(e), False, True)
        u = op.matmul(xs, block.up.expert(e), False, True)
        d = op.matmul(op.multiply(op.swish(g), u), block.down.expert(e), False, True)
        d = op.multiply(d, op.unsqueeze(op.gather_nd(w_e, rows), op.constant(1)))
        y = op.scatter_nd_update(y, rows, d, reduction="sum")
    shape = op.shape_of(block.x2d.get_node().input_value(0))  # the [B, S, H] the block's output has
    return op.reshape(y, shape, False)


def apply(model: Any) -> Any:
    """Rewrite every routed-experts block of `model` (before compile) in place; returns it."""
    blocks = _blocks(model)
    if not blocks:
        raise RewriteError("no routed-experts block of the exported pattern was found")
    for block in blocks:
        grouped = _grouped(block)
        grouped.set_friendly_name(f"{block.out.get_friendly_name()}/{NAME}")
        block.out.output(0).replace(grouped.output(0))
    model.validate_nodes_and_infer_types()
    return model
