"""Kernel `native_decode_attention`: the decode graph's attention as the native `DecodeAttention`.

The export writes a full-attention layer's KV cache as a state variable (f32 [B, Hkv, L, D]):
`ReadValue -> Gather(beam_idx) -> Concat(past, token's k) -> Assign`, the concatenation repeated
to every query head for `ScaledDotProductAttention`. The CPU plugin fuses that into its
`ScaledDotProductAttentionWithKVCache`, which keeps the cache in u8 (per token and head) and
whose decode attention grows ~0.55 us per token of context and layer (Zen 4 EPYC, dev-bench:
0.45 ms a layer at 1024 tokens, 2.1 ms at 4096; the real model has 10 such layers;
docs/perf-log.md). `DecodeAttention` (kernels/native/decode_attention.hpp) takes the attention
and the cache together: the variable becomes u8 [1, Hkv, L, D + 8], each row a token's D
quantised bytes followed by its scale and zero point (f32), quantised exactly as the plugin
quantises its own cache (`pack`; tests/test_native_decode_attention.py checks it bit for bit
against the plugin's state), and the op appends the token's rows and attends over the cache.

A rewrite for the decode graph only (one token, batch 1: `q16_decode.pin_one_token`); the
prefill graph keeps the f32 cache and the engine converts the state when it moves between them
(`to_state`). The variable keeps its id, so snapshots name the same variables in either form.
`beam_idx`'s Gather is dropped (batch 1: the index is 0). CPU only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.native_attention import RewriteError, _scale, _unrepeated

NAME = "native_decode_attention"
EXTRA = 8  # bytes after a row's quantised values: its scale and zero point, f32


def pack(x: np.ndarray) -> np.ndarray:
    """f32 [..., D] as the cache variable's u8 rows [..., D + 8], bit for bit as the CPU plugin
    quantises its u8 KV cache (scale (max - min) / 255, 0.0001 if 0; zp -min / scale; values
    round-half-even(x * (1 / scale) + zp), clamped to [0, 255]; the fused multiply-add emulated
    in float64, where the product is exact)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    mx, mn = x.max(axis=-1, keepdims=True), x.min(axis=-1, keepdims=True)
    scale = ((mx - mn) / np.float32(255)).astype(np.float32)
    scale[scale == 0] = np.float32(0.0001)
    zp = (-mn / scale).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)
    v = (x.astype(np.float64) * inv.astype(np.float64) + zp.astype(np.float64)).astype(np.float32)
    q = np.clip(np.rint(v), 0, 255).astype(np.uint8)
    out = np.empty((*x.shape[:-1], x.shape[-1] + EXTRA), dtype=np.uint8)
    out[..., : x.shape[-1]] = q
    out[..., x.shape[-1]:] = np.concatenate([scale, zp], axis=-1).view(np.uint8)
    return out


def unpack(rows: np.ndarray) -> np.ndarray:
    """The cache variable's u8 rows [..., D + 8] as f32 [..., D]: (q - zp) * scale, as the CPU
    plugin returns its u8 cache's state."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    d = rows.shape[-1] - EXTRA
    params = np.ascontiguousarray(rows[..., d:]).view(np.float32)
    scale, zp = params[..., :1], params[..., 1:]
    return ((rows[..., :d].astype(np.float32) - zp) * scale).astype(np.float32)


def to_state(array: np.ndarray, variable_id: str, packed: frozenset[str]) -> np.ndarray:
    """`array` (a snapshot of variable `variable_id` in either form) in the form a graph whose
    packed cache variables are `packed` holds."""
    is_packed = array.dtype == np.uint8
    if variable_id in packed:
        return array if is_packed else pack(array)
    return unpack(array) if is_packed else array


def packed_variables(model: Any) -> frozenset[str]:
    """The ids of `model`'s state variables in the packed u8 form (after `apply`)."""
    from openvino import Type

    return frozenset(v.info.variable_id for v in model.get_variables() if v.info.data_type == Type.u8)


def _cache(concat: Any) -> tuple[Any, Any, Any] | None:
    """(ReadValue, Assign, the token's rows) of a KV cache concatenation of the export's form."""
    if concat.get_type_name() != "Concat" or concat.get_input_size() != 2:
        return None
    gather = concat.input_value(0).get_node()
    read = gather.input_value(0).get_node() if gather.get_type_name() == "Gather" else gather
    if read.get_type_name() != "ReadValue":
        return None
    assigns = [t.get_node() for t in concat.output(0).get_target_inputs() if t.get_node().get_type_name() == "Assign"]
    if len(assigns) != 1:
        return None
    return read, assigns[0], concat.input_value(1)


def _keep_shape_readers(read: Any, new_read: Any, head_size: int) -> None:
    """The export also reads a cache's shape (the past length for the positions: ShapeOf of the
    Gather on the ReadValue): such readers get the old shape, [1, Hkv, P, D], from the new
    variable's [1, Hkv, P, D + 8]. Anything else reading the old cache is not the export's form."""
    from openvino import opset15 as ops

    outputs = [read.output(0)]
    gathers = [t.get_node() for t in read.output(0).get_target_inputs() if t.get_node().get_type_name() == "Gather"]
    outputs += [g.output(0) for g in gathers]
    for out in outputs:
        for target in list(out.get_target_inputs()):
            node = target.get_node()
            if node.get_type_name() in ("Concat", "Gather"):
                continue
            if node.get_type_name() != "ShapeOf":
                raise RewriteError(f"{read.get_friendly_name()}: the KV cache is read by {node.get_type_name()} "
                                   f"{node.get_friendly_name()}, not only by its concatenation and a ShapeOf")
            kind = node.get_output_element_type(0)
            shape = ops.shape_of(new_read, kind.get_type_name())
            head = ops.slice(shape, np.array([0]), np.array([3]), np.array([1]))
            tail = ops.constant(np.array([head_size], dtype=kind.to_dtype()))
            old_shape = ops.concat([head, tail], 0)
            for reader in list(node.output(0).get_target_inputs()):
                reader.replace_source_output(old_shape.output(0))


def apply(model: Any) -> Any:
    """Rewrite the decode graph `model` (before compile) in place; returns it (its packed cache
    variables: `packed_variables`). Raises RewriteError if it has no attention of the export's
    form."""
    from openvino import PartialShape, Type, opset6
    from openvino import opset15 as ops
    from openvino.op.util import Variable, VariableInfo

    from kernels import native

    native.require_cpu(NAME, RewriteError)
    done = 0
    for sdpa in [op for op in model.get_ordered_ops() if op.get_type_name() == "ScaledDotProductAttention"]:
        if sdpa.get_attributes().get("causal") or sdpa.get_input_size() < 4:
            continue
        q = sdpa.input_value(0)
        shape = q.get_partial_shape()
        if shape.rank.is_dynamic or shape.rank.get_length() != 4 or not all(shape[i].is_static for i in (0, 1, 2, 3)):
            continue
        heads, head_size = shape[1].get_length(), shape[3].get_length()
        if shape[0].get_length() != 1 or shape[2].get_length() != 1 or head_size % 8:
            continue  # one token at batch 1 only: the pinned decode graph
        if q.get_element_type().get_type_name() != "f32":
            continue
        k, v = _unrepeated(sdpa.input_value(1), heads), _unrepeated(sdpa.input_value(2), heads)
        scale = _scale(sdpa, head_size)
        if k is None or v is None or scale is None:
            continue
        kc, vc = _cache(k.get_node()), _cache(v.get_node())
        if kc is None or vc is None:
            continue
        states = []
        for read, assign, _ in (kc, vc):
            old = model.get_variable_by_id(read.get_variable_id())
            kv = old.info.data_shape[1]
            if kv.is_dynamic:
                break
            model.remove_sink(assign)
            model.remove_variable(old)
            info = VariableInfo()
            info.variable_id = old.info.variable_id
            info.data_type = Type.u8
            info.data_shape = PartialShape([1, kv.get_length(), -1, head_size + EXTRA])
            variable = Variable(info)
            model.add_variables([variable])
            empty = ops.constant(np.zeros((1, kv.get_length(), 0, head_size + EXTRA), dtype=np.uint8))
            new_read = opset6.read_value(empty, variable)
            _keep_shape_readers(read, new_read, head_size)
            states.append((variable, new_read))
        if len(states) != 2:
            raise RewriteError(f"{sdpa.get_friendly_name()}: a KV cache variable without a static head count")
        node = native.factory().create(
            "DecodeAttention", [q, kc[2], vc[2], states[0][1].output(0), states[1][1].output(0), scale])
        node.set_friendly_name(f"{sdpa.get_friendly_name()}/{NAME}")
        for target in list(sdpa.output(0).get_target_inputs()):
            target.replace_source_output(node.output(0))
        for (variable, read), out in zip(states, (node.output(1), node.output(2)), strict=True):
            # the Python Assign takes a node's first output only: made on the ReadValue, then moved
            assign = opset6.assign(read, variable)
            assign.input(0).replace_source_output(out)
            model.add_sinks([assign])
        done += 1
    if not done:
        raise RewriteError("no ScaledDotProductAttention of the export's form in the model")
    model.validate_nodes_and_infer_types()
    return model
