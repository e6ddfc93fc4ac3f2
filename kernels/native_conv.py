"""Kernel `native_conv`: each linear-attention layer's causal depthwise convolution as one op.

The export computes a GatedDeltaNet layer's short convolution channel-major: the projection's
[B, T, C] output transposed to [B, C, T], concatenated after the conv state [B, C, S], a
K-tap `GroupConvolution`, the last T outputs sliced, Swish, and transposed back to [B, T, C]; a
second Slice keeps the concatenation's last S columns as the new state. On an AVX-512 CPU in
bf16 the two transposes of the 8,192 channels ran in the plugin's generic f32 implementation:
~28 ms per layer for a 1024-token chunk of dev-bench (docs/perf-log.md, session 9).
`CausalConv1d` (kernels/native/causal_conv.hpp) reads the token-major projection and the state
as they are and writes the token-major result and the new state; the Swish stays with the
plugin. Same sums (K taps in order) in f32. CPU only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NAME = "native_conv"


class RewriteError(RuntimeError):
    pass


def _consumers(output: Any) -> list[Any]:
    return [t.get_node() for t in output.get_target_inputs()]


def _order(node: Any) -> list[int] | None:
    """A Transpose's constant permutation, or None."""
    if node.get_type_name() != "Transpose":
        return None
    perm = node.input_value(1).get_node()
    return [int(v) for v in perm.get_data()] if perm.get_type_name() == "Constant" else None


def _match(conv: Any) -> dict[str, Any] | None:
    """The pieces of one exported causal conv around `conv` (a GroupConvolution), or None."""
    attrs = conv.get_attributes()
    if (list(attrs.get("strides", [])) != [1] or list(attrs.get("dilations", [])) != [1]
            or list(attrs.get("pads_begin", [])) != [0] or list(attrs.get("pads_end", [])) != [0]):
        return None
    cat = conv.input_value(0).get_node()
    if cat.get_type_name() != "Concat" or cat.get_input_size() != 2 or cat.get_attributes()["axis"] not in (-1, 2):
        return None
    into = cat.input_value(1).get_node()
    if _order(into) != [0, 2, 1]:
        return None
    state = cat.input_value(0)
    s_shape, w_shape = state.get_partial_shape(), conv.get_input_partial_shape(1)
    if s_shape.rank.is_dynamic or s_shape.rank.get_length() != 3 or s_shape[2].is_dynamic or not w_shape.is_static:
        return None
    taps = int(w_shape[-1].get_length())
    if s_shape[2].get_length() < taps - 1:
        return None
    after = _consumers(conv.output(0))
    if len(after) != 1 or after[0].get_type_name() != "Slice":
        return None
    act = _consumers(after[0].output(0))
    if len(act) != 1 or act[0].get_type_name() != "Swish" or act[0].get_input_size() != 1:
        return None
    back = _consumers(act[0].output(0))
    if len(back) != 1 or _order(back[0]) != [0, 2, 1]:
        return None
    keep = [n for n in _consumers(cat.output(0)) if n.get_name() != conv.get_name()]
    if len(keep) != 1 or keep[0].get_type_name() != "Slice" or not all(
            n.get_type_name() == "Assign" for n in _consumers(keep[0].output(0))):
        return None
    return {"x": into.input_value(0), "state": state, "w": conv.input_value(1), "out": back[0], "keep": keep[0]}


def apply(model: Any, factory: Any = None) -> Any:
    """Rewrite `model` (before compile) in place; returns it. `factory`: the NodeFactory that
    creates the op (default: kernels.native's)."""
    from openvino import opset15 as op

    from kernels import native

    native.require_cpu(NAME, RewriteError)
    factory = factory or native.factory()
    done = 0
    for conv in model.get_ordered_ops():
        if conv.get_type_name() != "GroupConvolution":
            continue
        parts = _match(conv)
        if parts is None:
            continue
        c = int(parts["w"].get_partial_shape()[0].get_length())
        weights = op.reshape(parts["w"], op.constant(np.array([c, -1], np.int64)), special_zero=False)
        node = factory.create("CausalConv1d", [parts["x"], parts["state"], weights.output(0)])
        node.set_friendly_name(f"{conv.get_friendly_name()}/{NAME}")
        y = op.swish(node.output(0))
        y.set_friendly_name(f"{parts['out'].get_friendly_name()}/{NAME}")
        for target in list(parts["out"].output(0).get_target_inputs()):
            target.replace_source_output(y.output(0))
        for target in list(parts["keep"].output(0).get_target_inputs()):
            target.replace_source_output(node.output(1))
        done += 1
    if not done:
        raise RewriteError("no causal convolution of the exported pattern was found")
    model.validate_nodes_and_infer_types()
    return model
