"""Kernel `lm_head_u8`: the int8 LM head as one native GEMV (`U8Linear`, kernels/native).

Why (docs/perf-log.md, "Decode: the LM head"): in a decode step the head reads the most bytes
of any layer (V x H u8: 311 MB on dev-bench, 509 MB on the real model's 248,320 x 2048). The
exported pattern is

    MatMul(x, Convert(Multiply(Subtract(Convert(w u8), Convert(zp u8)), scale f16)), transpose_b)

and on an AVX2 CPU without VNNI the plugin's compressed-weights kernel reads it at about a third
of the memory bandwidth. `U8Linear` streams the bytes once and widens them in registers.

The rewrite replaces that MatMul (after `last_token_logits`, which slices its input to the last
position) by `U8Linear(x, w, zp, scale)` on the same constants: no copy of the weights. Same
math up to the summation order and the f16 rounding of `(w - zp) * scale`, which the export
applies and the op does not (`tests/test_native.py` bounds the difference).

CPU only (the op runs through the CPU plugin's `evaluate`); the profile's switch turns it on.
"""

from __future__ import annotations

from typing import Any

NAME = "lm_head_u8"


class RewriteError(RuntimeError):
    pass


def _skip_converts(output: Any) -> Any:
    node = output.get_node()
    while node.get_type_name() == "Convert":
        output = node.input_value(0)
        node = output.get_node()
    return output


def _constant(output: Any, types: tuple[str, ...]) -> Any:
    node = _skip_converts(output).get_node()
    if node.get_type_name() != "Constant" or node.get_output_element_type(0).get_type_name() not in types:
        raise RewriteError(f"expected a {'/'.join(types)} constant, found {node.get_type_name()}")
    return node


def _decompression(weight: Any) -> tuple[Any, Any, Any]:
    """(w u8 [N, K], zp u8 [N, 1], scale [N, 1]) of the exported u8 decompression chain."""
    mul = _skip_converts(weight).get_node()
    if mul.get_type_name() != "Multiply":
        raise RewriteError(f"the LM head's weight is {mul.get_type_name()}, not a decompression Multiply")
    a, b = (mul.input_value(i) for i in range(2))
    sub, scale = (a, b) if _skip_converts(a).get_node().get_type_name() == "Subtract" else (b, a)
    sub = _skip_converts(sub).get_node()
    if sub.get_type_name() != "Subtract":
        raise RewriteError("the LM head's weight has no zero-point Subtract (not asymmetric u8)")
    w = _constant(sub.input_value(0), ("u8",))
    zp = _constant(sub.input_value(1), ("u8",))
    s = _constant(scale, ("f16", "f32"))
    n, k = w.get_output_shape(0)
    if list(zp.get_output_shape(0)) != [n, 1] or list(s.get_output_shape(0)) != [n, 1]:
        raise RewriteError(f"per-row zero points and scales expected for [{n}, {k}] weights")
    return w, zp, s


def apply(model: Any) -> Any:
    """Rewrite `model` (before compile) in place; returns it."""
    from kernels import native
    from kernels.last_token_logits import RewriteError as HeadError
    from kernels.last_token_logits import _logits_matmul

    try:
        matmul = _logits_matmul(model)
    except HeadError as exc:
        raise RewriteError(str(exc)) from exc
    attrs = matmul.get_attributes()
    if attrs.get("transpose_a") or not attrs.get("transpose_b"):
        raise RewriteError("the LM head MatMul is not x @ w^T")
    w, zp, s = _decompression(matmul.input_value(1))
    native.require_cpu(NAME, RewriteError)
    node = native.factory().create("U8Linear", [matmul.input_value(0), w.output(0), zp.output(0), s.output(0)])
    node.set_friendly_name(f"{matmul.get_friendly_name()}/{NAME}")
    for target in list(matmul.output(0).get_target_inputs()):
        target.replace_source_output(node.output(0))
    model.validate_nodes_and_infer_types()
    return model
