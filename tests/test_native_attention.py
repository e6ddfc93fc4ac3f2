"""Kernel `native_attention`: prefill attention as the native `CausalAttention` op."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels import native, native_attention
from tests.helpers import chunk_logits, kernel_greedy

pytestmark = pytest.mark.skipif(not native.cpu_supported(), reason=f"needs a CPU with {native.CPU_FLAGS}")


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal grouped-query attention in float64: query t of the chunk sees keys 0 .. L - T + t of
    kv head h // (Hq / Hkv)."""
    _, hq, t, _ = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    hidden = np.arange(keys)[None, :] > (keys - t + np.arange(t))[:, None]
    out = np.zeros(q.shape)
    for h in range(hq):
        s = q[0, h].astype(np.float64) @ k[0, h // (hq // hkv)].T.astype(np.float64) * scale
        s[hidden] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[0, h] = (p / p.sum(axis=1, keepdims=True)) @ v[0, h // (hq // hkv)]
    return out


def _attention_op(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    import openvino as ov
    from openvino import opset15 as op

    params = [op.parameter(list(x.shape), np.float32, name=f"p{i}") for i, x in enumerate((q, k, v))]
    node = native.factory().create("CausalAttention", [*params, op.constant(np.float32(scale)).output(0)])
    request = ov.Core().compile_model(ov.Model(node.outputs(), params), "CPU").create_infer_request()
    return np.array(request.infer({"p0": q, "p1": k, "p2": v})[0])


@pytest.mark.parametrize(("heads", "kv_heads", "tokens", "keys", "head_size"), [
    (16, 2, 100, 100, 256),  # the real model's heads: a chunk from an empty cache, keys past one block
    (16, 2, 37, 300, 256),   # a chunk after 263 cached keys
    (16, 2, 1, 70, 256),     # one token (a decode row) after 69
    (4, 2, 5, 5, 16),        # fewer rows than one register tile
    (8, 8, 70, 70, 32),      # no grouping
    (2, 1, 130, 130, 64),    # dev-tiny's heads, a task of many tokens
])
def test_causal_attention_is_the_masked_softmax(heads: int, kv_heads: int, tokens: int, keys: int,
                                                head_size: int) -> None:
    rng = np.random.default_rng(tokens + keys)
    q = rng.standard_normal((1, heads, tokens, head_size)).astype(np.float32)
    k, v = (rng.standard_normal((1, kv_heads, keys, head_size)).astype(np.float32) for _ in range(2))
    scale = 1.0 / np.sqrt(head_size)
    got, want = _attention_op(q, k, v, scale), _attention(q, k, v, scale)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 5e-6 * max(1.0, float(np.abs(want).max()))


def test_a_task_sees_no_key_past_its_rows() -> None:
    """A key after a query's position must not move that query's output: changing the last key
    and value changes only the last token's rows."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 16, 90, 256)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 90, 256)).astype(np.float32) for _ in range(2))
    before = _attention_op(q, k, v, 1 / 16)
    k[:, :, -1] += 3.0
    v[:, :, -1] -= 3.0
    after = _attention_op(q, k, v, 1 / 16)
    assert np.array_equal(before[:, :, :-1], after[:, :, :-1])
    assert not np.array_equal(before[:, :, -1], after[:, :, -1])


def test_every_attention_is_replaced(tiny_dir: Path) -> None:
    import openvino as ov

    model = ov.Core().read_model(tiny_dir / "openvino_model.xml")
    count = sum(op.get_type_name() == "ScaledDotProductAttention" for op in model.get_ordered_ops())
    native_attention.apply(model)
    types = [op.get_type_name() for op in model.get_ordered_ops()]
    assert count > 0 and "ScaledDotProductAttention" not in types and types.count("CausalAttention") == count
    for node in model.get_ordered_ops():  # K and V read unrepeated (the kv heads, not one per query head)
        if node.get_type_name() == "CausalAttention":
            q, k = node.get_input_partial_shape(0), node.get_input_partial_shape(1)
            assert k[1].get_length() < q[1].get_length()
            assert node.input_value(1).get_node().get_type_name() != "Reshape"


@pytest.mark.parametrize("chunks", [[2], [17], [100, 1, 1], [64] * 4], ids=["2", "17", "100+decode", "4x64"])
def test_native_attention_keeps_the_logits(tiny_dir: Path, chunks: list[int]) -> None:
    """Against the plugin's SDPA with an f32 KV cache: chunks after cached keys and decode rows
    included. (The plugin's default u8 cache feeds a chunk's attention its past keys and values
    quantized: with it, a chunk after cached keys differs from f32 by ~2e-3 of the logits' scale
    on dev-tiny. A first chunk of several tokens attends its own keys unquantized either way:
    the engine's prefill graph runs only such chunks and the chunks after them.)"""
    f32_cache = {"KV_CACHE_PRECISION": "f32"}
    plain = chunk_logits(tiny_dir, chunks, properties=f32_cache)
    rewritten = chunk_logits(tiny_dir, chunks, native_attention.apply, properties=f32_cache)
    assert np.abs(plain - rewritten).max() <= 1e-5 * max(1.0, float(np.abs(plain).max()))


def test_a_first_chunk_matches_the_default_cache(tiny_dir: Path) -> None:
    """The gate's prompts (one chunk each): against the plugin at its default KV cache precision."""
    plain, rewritten = chunk_logits(tiny_dir, [200]), chunk_logits(tiny_dir, [200], native_attention.apply)
    assert np.abs(plain - rewritten).max() <= 1e-5 * max(1.0, float(np.abs(plain).max()))


def test_native_attention_keeps_greedy_generation(tiny_dir: Path) -> None:
    """Through the engine: the prompt in 64-token chunks on the prefill graph, the state moved to
    the decode graph for the generated tokens."""
    prompt = tuple(range(1000, 1200))
    tokens, kernels = kernel_greedy(tiny_dir, native_attention.NAME, True, prompt, 24)
    assert f"{native_attention.NAME} (prefill)" in kernels
    assert tokens == kernel_greedy(tiny_dir, native_attention.NAME, False, prompt, 24)[0]


def test_a_model_without_attention_is_refused() -> None:
    import openvino as ov
    from openvino import opset15 as op

    p = op.parameter([2], np.float32, name="x")
    with pytest.raises(native_attention.RewriteError, match="no ScaledDotProductAttention"):
        native_attention.apply(ov.Model([op.relu(p)], [p]))
