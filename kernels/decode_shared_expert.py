"""Kernel `decode_shared_expert`: the decode graph's shared expert inside the routed experts' op.

Each MoE block adds a shared expert to its routed experts' sum, gated by a one-row projection of
the same input:

    y = experts(x) + sigmoid(x . g) * down(silu(gate(x)) * up(x))

In a decode step the routed experts are one `U4Experts` call (q16_decode's integer products) and
the shared expert four more calls (three `Q16Linear` of 512 x 2048 and the plugin's one-row
`shared_expert_gate`) with the plugin's eltwise nodes around them: on dev-bench 0.97 ms a step
for 12.6 MB of weights, against 0.50 ms a block's routed experts take for 12.6 MB (Zen 4 EPYC,
PERF_COUNT; docs/perf-log.md, session 37). The rewrite hands the shared expert's four matrices to
the block's `U4Experts` (its 12 optional inputs, kernels/native/u4_experts.hpp): its gate and up
rows become stage-1 tasks beside the routed experts', its down rows join each stage-2 task's
columns after the routed experts' sum, and the sigmoid gate is one more integer dot product.

Numerics: the shared expert's matmuls were already q16_decode's integer products on the same
activations (the same bits), and the sum is added last as the plugin's Add did (f32, same
order). What changes: the gate row (the plugin's bf16 matmul where it runs bf16, now the integer
products at f32-level precision), silu and sigmoid (the op's f32 `exp` instead of the plugin's
approximations). tests/test_decode_shared_expert.py checks the op against float64 and the engine
against the graph without the rewrite.

A rewrite for the decode graph only (after q16_decode with `split=False` and
`q16_decode.pin_one_token`): the op takes the shared expert for every row it is given, reading
its matrices once per row. Blocks whose shared expert is not of the exported form (u4 matrices
grouped by a multiple of 128 inputs) are left as they are. CPU only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels import q16_decode
from kernels.q16_decode import RewriteError, _as_bytes, _decompression

NAME = "decode_shared_expert"
_PASS = ("Reshape",)  # nodes between the block's parts that do not change the values


def _through(output: Any) -> Any:
    """`output` past reshapes (towards the inputs)."""
    while output.get_node().get_type_name() in _PASS:
        output = output.get_node().input_value(0)
    return output


def _same(a: Any, b: Any) -> bool:
    return a.get_node().get_name() == b.get_node().get_name() and a.get_index() == b.get_index()


def _weights(matmul: Any) -> list[Any] | None:
    """(w as packed u4 bytes, zp, scale) of a q16_decode `Q16Linear` or of a MatMul on the
    exported u4 decompression, with w [O, G, g / 2]; None otherwise."""
    kind = matmul.get_type_name()
    if kind == "Q16Linear":
        if not matmul.get_attributes().get("nibbles"):
            return None
        parts = [matmul.input_value(i) for i in (1, 2, 3)]
    elif kind == "MatMul":
        attrs = matmul.get_attributes()
        if attrs.get("transpose_a") or not attrs.get("transpose_b"):
            return None
        found = _decompression(matmul.input_value(1))
        if found is None or found[0].get_output_element_type(0).get_type_name() != "u4":
            return None
        parts = [c.output(0) for c in found]
        if len(parts[0].get_shape()) != 3:
            return None
        parts[0] = _as_bytes(parts[0])
    else:
        return None
    shape = [int(d) for d in parts[0].get_shape()]
    if len(shape) != 3 or (shape[2] * 2) % q16_decode.BLOCK:
        return None
    return parts


def _input(matmul: Any) -> Any:
    return _through(matmul.input_value(0))


def _product_of(output: Any, kind: str) -> tuple[Any, Any] | None:
    """(a, b) of `output` = Multiply(a, b) with a's node of `kind` (either order), else None."""
    node = _through(output).get_node()
    if node.get_type_name() != "Multiply":
        return None
    a, b = node.input_value(0), node.input_value(1)
    if _through(a).get_node().get_type_name() != kind:
        a, b = b, a
    return (a, b) if _through(a).get_node().get_type_name() == kind else None


def _shared_expert(experts: Any) -> tuple[Any, list[Any]] | None:
    """The Add of `experts`' block (U4Experts) summing its shared expert, and that expert's
    gate row, gate, up and down weights (12 outputs), or None if the block is not of the form."""
    out = experts.output(0)
    while True:
        users = [t.get_node() for t in out.get_target_inputs()]
        if len(users) != 1:
            return None
        if users[0].get_type_name() not in _PASS:
            break
        out = users[0].output(0)
    add = users[0]
    if add.get_type_name() != "Add":
        return None
    other = add.input_value(1) if _same(_through(add.input_value(0)), experts.output(0)) else add.input_value(0)
    scaled = _product_of(other, "Sigmoid")
    if scaled is None:
        return None
    row = _through(_through(scaled[0]).get_node().input_value(0)).get_node()
    down = _through(scaled[1]).get_node()
    act = _product_of(down.input_value(0), "Swish") if down.get_type_name() in ("Q16Linear", "MatMul") else None
    if act is None:
        return None
    swish = _through(act[0]).get_node()
    if swish.get_input_size() != 1:  # Swish with a beta is not silu
        return None
    gate, up = _through(swish.input_value(0)).get_node(), _through(act[1]).get_node()
    x = _through(experts.input_value(0))
    if not all(m.get_type_name() in ("Q16Linear", "MatMul") and _same(_input(m), x) for m in (row, gate, up)):
        return None
    weights = [_weights(m) for m in (row, gate, up, down)]
    if any(w is None for w in weights):
        return None
    return add, [part for w in weights for part in w]


def apply(model: Any) -> int:
    """Rewrite the decode graph `model` (before compile) in place; returns the number of MoE
    blocks whose shared expert moved into their U4Experts op (0: none of the form)."""
    from openvino import opset15 as op

    from kernels import native

    native.require_cpu(NAME, RewriteError)
    factory = native.factory()
    done = 0
    for experts in [n for n in model.get_ordered_ops() if n.get_type_name() == "U4Experts"]:
        if experts.get_input_size() != 13 or not experts.get_attributes().get("nibbles"):
            continue
        found = _shared_expert(experts)
        if found is None:
            continue
        add, shared = found
        args = [experts.input_value(i) for i in range(13)]
        fused = factory.create("U4Experts", [*args, *shared], experts.get_attributes())
        fused.set_friendly_name(f"{experts.get_friendly_name()}/{NAME}")
        shape = add.get_output_partial_shape(0)
        if not shape.is_static:
            raise RewriteError(f"{add.get_friendly_name()}: the MoE block's sum has no static shape "
                               "(pin the decode graph to one token first)")
        y = op.reshape(fused.output(0), op.constant(np.array([d.get_length() for d in shape], np.int64)), False)
        for target in list(add.output(0).get_target_inputs()):
            target.replace_source_output(y.output(0))
        done += 1
    if done:
        model.validate_nodes_and_infer_types()
    return done
