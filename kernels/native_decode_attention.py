"""Kernel `native_decode_attention`: the decode graph's attention as the native `DecodeAttention`.

The export writes a full-attention layer's KV cache as a state variable (f32 [B, Hkv, L, D]):
`ReadValue -> Gather(beam_idx) -> Concat(past, token's k) -> Assign`, the concatenation repeated
to every query head for `ScaledDotProductAttention`. The CPU plugin fuses that into its
`ScaledDotProductAttentionWithKVCache`, which keeps the cache in u8 (per token and head) and
whose decode attention grows ~0.55 us per token of context and layer (Zen 4 EPYC, dev-bench:
0.45 ms a layer at 1024 tokens, 2.1 ms at 4096; the real model has 10 such layers;
docs/perf-log.md). `DecodeAttention` (kernels/native/decode_attention.hpp) takes the attention
and the cache together, and holds the cache itself, outside OpenVINO's state: per layer and kv
head u8 rows of D quantised bytes followed by the row's scale and zero point (f32), quantised
exactly as the plugin quantises its own cache (`pack`; tests/test_native_decode_attention.py
checks it bit for bit against the plugin's state). A step writes its token's rows in place; as
a state variable (session 23) the cache had to be written whole at every step.

A rewrite for the decode graph only (one token, batch 1: `q16_decode.pin_one_token`). The layer's
state variables leave the graph; the op names the store by a new input (`STORE`, fed by the engine)
and its `slot` attribute, and reads the past length from `attention_mask`. The engine moves,
snapshots and resets the caches through `KvStore`; in snapshots they keep their variables' ids,
in the packed u8 form [1, Hkv, L, D + 8], and the engine converts them for the graphs that hold
the f32 form (`to_state`). `beam_idx`'s Gather is dropped (batch 1: the index is 0). CPU only.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.native_attention import RewriteError, _scale, _unrepeated

NAME = "native_decode_attention"
EXTRA = 8  # bytes after a row's quantised values: its scale and zero point, f32
STORE = "iq36_kv_store"  # the decode graph's input naming the engine's KvStore


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


@dataclass(frozen=True)
class Slot:
    """One layer's cache in the store: its slot, the ids of the variables it replaced (its names in
    snapshots), its kv heads and bytes per row (head size + EXTRA)."""

    slot: int
    key: str
    value: str
    heads: int
    row: int


def slots(model: Any) -> list[Slot]:
    """The caches `model`'s DecodeAttention ops keep (after `apply`), in slot order."""
    found = []
    for node in model.get_ordered_ops():
        if node.get_type_name() != "DecodeAttention":
            continue
        attrs = node.get_attributes()
        shape = node.input_value(1).get_partial_shape()  # the token's k [1, Hkv, 1, D]
        found.append(Slot(int(attrs["slot"]), str(attrs["key"]), str(attrs["value"]), shape[1].get_length(),
                          shape[3].get_length() + EXTRA))
    return sorted(found, key=lambda s: s.slot)


class KvStore:
    """An engine's DecodeAttention caches, reached through the native library's `iq36_kv_*`
    functions (the library OpenVINO loaded: one copy per process, so the same stores). Named by a
    process-unique id below 2^31 (the CPU plugin narrows i64 inputs to i32) fed to the decode
    graph as `STORE` (`feed`); a store missing from the library (never written, or dropped) holds
    no tokens, and a step after P tokens on a store holding fewer fails instead of attending to
    garbage."""

    _ids = itertools.count(1)

    def __init__(self, layers: list[Slot]) -> None:
        import ctypes

        from kernels import native

        lib = ctypes.CDLL(str(native.library()))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.iq36_kv_length.argtypes, lib.iq36_kv_length.restype = [i64, i64], i64
        for name in ("iq36_kv_read", "iq36_kv_write", "iq36_kv_write_f32"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [i64, i64, ptr, ptr, i64, i64, i64], ctypes.c_int
        lib.iq36_kv_drop.argtypes, lib.iq36_kv_drop.restype = [i64], None
        self._lib = lib
        self.id = next(self._ids)
        self.feed = np.array([self.id], dtype=np.int64)
        self.layers = tuple(layers)
        self.variables = frozenset(v for s in self.layers for v in (s.key, s.value))

    def read(self, max_bytes: int) -> dict[str, np.ndarray] | None:
        """Copies of every cache, by variable id ([1, Hkv, L, row] u8), or None past `max_bytes`."""
        states: dict[str, np.ndarray] = {}
        total = 0
        for s in self.layers:
            n = int(self._lib.iq36_kv_length(self.id, s.slot))
            total += 2 * s.heads * n * s.row
            if total > max_bytes:
                return None
            k, v = (np.empty((1, s.heads, n, s.row), dtype=np.uint8) for _ in range(2))
            if self._lib.iq36_kv_read(self.id, s.slot, k.ctypes.data, v.ctypes.data, s.heads, n, s.row):
                raise RuntimeError(f"reading KV store slot {s.slot} ({n} tokens) failed")
            states[s.key], states[s.value] = k, v
        return states

    def write(self, states: Mapping[str, np.ndarray]) -> None:
        """Set every cache from arrays by variable id, in either form: packed u8 [1, Hkv, L, row]
        (copied) or f32 [1, Hkv, L, D] (a prefill graph's state: quantised natively, row by row as
        the op quantises its own tokens, so bit for bit `pack`). Raises ValueError, before touching
        anything, unless `states` holds every cache in one of its shapes (a partial restore would
        leave layers at other lengths)."""
        missing = sorted(self.variables - states.keys())
        if missing:
            raise ValueError(f"snapshot does not match the decode graph's KV caches: missing {missing}")
        arrays = []
        for s in self.layers:
            k, v = (np.ascontiguousarray(states[name]) for name in (s.key, s.value))
            size = s.row if k.dtype == np.uint8 else s.row - EXTRA
            want = (1, s.heads, k.shape[2] if k.ndim == 4 else -1, size)
            if k.dtype not in (np.uint8, np.float32) or v.dtype != k.dtype or k.shape != want or v.shape != want:
                raise ValueError(f"KV cache {s.key}: {k.dtype} {k.shape} / {v.dtype} {v.shape}, expected packed "
                                 f"u8 [1, {s.heads}, L, {s.row}] or f32 [1, {s.heads}, L, {s.row - EXTRA}]")
            arrays.append((s, k, v))
        for s, k, v in arrays:
            fn = self._lib.iq36_kv_write if k.dtype == np.uint8 else self._lib.iq36_kv_write_f32
            if fn(self.id, s.slot, k.ctypes.data, v.ctypes.data, s.heads, k.shape[2], k.shape[3]):
                raise RuntimeError(f"writing KV store slot {s.slot} failed")

    def drop(self) -> None:
        """Forget every cache (their memory too): the next step must follow 0 tokens."""
        self._lib.iq36_kv_drop(self.id)


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


def _keep_shape_readers(read: Any, mask: Any, heads: int, head_size: int) -> None:
    """The export also reads a cache's shape (the past length for the positions: ShapeOf of the
    Gather on the ReadValue): such readers get [1, Hkv, P, D] with P from `attention_mask`
    ([1, P + 1] in a decode step). Anything else reading the old cache is not the export's form."""
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
            dtype = kind.to_dtype()
            length = ops.gather(ops.shape_of(mask, kind.get_type_name()), np.array([1]), np.array(0))
            past = ops.subtract(length, np.array([1], dtype=dtype))
            old_shape = ops.concat([ops.constant(np.array([1, heads], dtype=dtype)), past,
                                    ops.constant(np.array([head_size], dtype=dtype))], 0)
            for reader in list(node.output(0).get_target_inputs()):
                reader.replace_source_output(old_shape.output(0))


def apply(model: Any) -> Any:
    """Rewrite the decode graph `model` (before compile) in place; returns it (its caches:
    `slots`). Raises RewriteError if it has no attention of the export's form."""
    from openvino import Type
    from openvino import opset15 as ops

    from kernels import native

    native.require_cpu(NAME, RewriteError)
    names = {name for p in model.inputs for name in p.get_names()}
    if "attention_mask" not in names:
        raise RewriteError("the model has no attention_mask input (the past length the op reads)")
    mask = model.input("attention_mask")
    store = ops.parameter([1], Type.i64, name=STORE)
    store.output(0).get_tensor().set_names({STORE})
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
        ids = []
        for read, _, _ in (kc, vc):
            kv = model.get_variable_by_id(read.get_variable_id()).info.data_shape[1]
            if kv.is_dynamic:
                raise RewriteError(f"{sdpa.get_friendly_name()}: a KV cache variable without a static head count")
            ids.append(read.get_variable_id())
        for read, assign, _ in (kc, vc):
            _keep_shape_readers(read, mask, kv.get_length(), head_size)
            model.remove_sink(assign)
            model.remove_variable(model.get_variable_by_id(read.get_variable_id()))
        node = native.factory().create("DecodeAttention", [q, kc[2], vc[2], mask, store.output(0), scale],
                                       {"slot": done, "key": ids[0], "value": ids[1]})
        node.set_friendly_name(f"{sdpa.get_friendly_name()}/{NAME}")
        for target in list(sdpa.output(0).get_target_inputs()):
            target.replace_source_output(node.output(0))
        done += 1
    if not done:
        raise RewriteError("no ScaledDotProductAttention of the export's form in the model")
    model.add_parameters([store])
    model.validate_nodes_and_infer_types()
    return model
