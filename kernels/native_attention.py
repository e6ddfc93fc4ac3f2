"""Kernel `native_attention`: each full-attention layer's prefill attention as one native op.

The export writes a full-attention layer's attention as `ScaledDotProductAttention(q, K, V,
mask, scale)`, where K and V are the KV cache (state read, reordered by `beam_idx`, the chunk's
keys concatenated) repeated to every query head (Unsqueeze -> Broadcast -> Reshape) and the mask
is causal, built from `attention_mask`. The CPU plugin fuses it with the cache into its
`ScaledDotProductAttentionWithKVCache`, whose prefill computes the whole chunk x context score
matrix per head and masks afterwards: on dev-bench-256 (one attention layer) a 1024-token prefill
spends 0.36 s there and a 4096-token one 14.3 s of 23 s (AVX2, f32; docs/perf-log.md).
`CausalAttention` (kernels/native/causal_attention.hpp) reads the unrepeated K and V and
computes only the scores the causal mask keeps, in blocks of keys with a running softmax.

A rewrite for the prefill graph only (the engine's `_PREFILL_KERNELS`): without the plugin's
fused node the cache is a plain state, concatenated (copied) at every call, which costs a
chunk little and a decode step a full copy of the cache. The mask input is dropped: at batch 1
with every `attention_mask` entry 1 (all iq36 feeds: worker.reference.stateful_feed) it is
exactly causal. f32, sums in another order than the plugin's. CPU only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

NAME = "native_attention"


class RewriteError(RuntimeError):
    pass


def _constant(node: Any) -> np.ndarray | None:
    return node.get_data() if node.get_type_name() == "Constant" else None


def _unrepeated(value: Any, heads: int) -> Any:
    """The [B, Hkv, L, D] tensor `value` (SDPA's K or V input, [B, Hq, L, D]) repeats per query
    head as Reshape(Broadcast(Unsqueeze(x, 2))), query head h reading x's head h // (Hq / Hkv);
    None if it is not that."""
    reshape = value.get_node()
    if reshape.get_type_name() != "Reshape":
        return None
    broadcast = reshape.input_value(0).get_node()
    if broadcast.get_type_name() != "Broadcast":
        return None
    unsqueeze = broadcast.input_value(0).get_node()
    if unsqueeze.get_type_name() != "Unsqueeze":
        return None
    axis = _constant(unsqueeze.input_value(1).get_node())
    if axis is None or axis.size != 1 or int(axis.reshape(-1)[0]) not in (2, -3):
        return None
    source = unsqueeze.input_value(0)
    shape, repeated = source.get_partial_shape(), broadcast.get_output_partial_shape(0)
    if shape.rank.is_dynamic or repeated.rank.is_dynamic:
        return None
    if shape.rank.get_length() != 4 or repeated.rank.get_length() != 5:
        return None
    kv, group, d = shape[1], repeated[2], shape[3]
    if kv.is_dynamic or group.is_dynamic or d.is_dynamic or repeated[1].is_dynamic:
        return None
    if repeated[1].get_length() != kv.get_length() or kv.get_length() * group.get_length() != heads:
        return None
    return source


def _scale(sdpa: Any, head_size: int) -> Any:
    """SDPA's scale input as a constant f32 scalar output (1 / sqrt(D) when the op has none)."""
    from openvino import opset15 as ops

    if sdpa.get_input_size() > 4:
        value = _constant(sdpa.input_value(4).get_node())
        if value is None or value.size != 1:
            return None
        scale = float(value.reshape(-1)[0])
    else:
        scale = 1.0 / math.sqrt(head_size)
    return ops.constant(np.float32(scale)).output(0)


def apply(model: Any) -> Any:
    """Rewrite `model` (before compile) in place; returns it. Raises RewriteError if the model
    has no attention of the export's form."""
    from kernels import native

    native.require_cpu(NAME, RewriteError)
    done = 0
    for sdpa in [op for op in model.get_ordered_ops() if op.get_type_name() == "ScaledDotProductAttention"]:
        if sdpa.get_attributes().get("causal") or sdpa.get_input_size() < 4:
            continue  # not the export's form (the mask is an input)
        q = sdpa.input_value(0)
        shape = q.get_partial_shape()
        if shape.rank.is_dynamic or shape.rank.get_length() != 4 or shape[1].is_dynamic or shape[3].is_dynamic:
            continue
        heads, head_size = shape[1].get_length(), shape[3].get_length()
        if head_size % 16 or q.get_element_type().get_type_name() != "f32":
            continue
        k, v = _unrepeated(sdpa.input_value(1), heads), _unrepeated(sdpa.input_value(2), heads)
        scale = _scale(sdpa, head_size)
        if k is None or v is None or scale is None:
            continue
        node = native.factory().create("CausalAttention", [q, k, v, scale])
        node.set_friendly_name(f"{sdpa.get_friendly_name()}/{NAME}")
        for target in list(sdpa.output(0).get_target_inputs()):
            target.replace_source_output(node.output(0))
        done += 1
    if not done:
        raise RewriteError("no ScaledDotProductAttention of the export's form in the model")
    model.validate_nodes_and_infer_types()
    return model
