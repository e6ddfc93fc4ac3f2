"""Kernel `native_conv`: the linear-attention layers' causal conv as the native `CausalConv1d`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels import native, native_conv
from tests.helpers import chunk_logits, kernel_greedy

pytestmark = pytest.mark.skipif(not native.cpu_supported(), reason=f"needs a CPU with {native.CPU_FLAGS}")


@pytest.mark.parametrize(("batch", "tokens", "channels", "kept", "taps"),
                         [(1, 1, 64, 4, 4), (1, 3, 64, 4, 4), (1, 37, 70, 4, 4), (2, 5, 16, 3, 4), (1, 9, 24, 6, 2),
                          (2, 1, 70, 3, 4), (1, 1, 24, 6, 2)])
def test_causal_conv_is_the_exported_convolution(batch: int, tokens: int, channels: int, kept: int, taps: int) -> None:
    """y[t] = sum_j w[j] z[S - K + 1 + t + j] over z = concat(state, x^T), the last S columns of z
    as the new state; chunks shorter than the state (the new state mixes old state and x),
    channels off the vector width, batch 2, a state longer than K - 1."""
    import openvino as ov
    from openvino import opset15 as op

    rng = np.random.default_rng(tokens * 100 + channels)
    x = rng.standard_normal((batch, tokens, channels)).astype(np.float32)
    state = rng.standard_normal((batch, channels, kept)).astype(np.float32)
    w = rng.standard_normal((channels, taps)).astype(np.float32)
    px = op.parameter(list(x.shape), np.float32, name="x")
    ps = op.parameter(list(state.shape), np.float32, name="state")
    node = native.factory().create("CausalConv1d", [px, ps, op.constant(w)])
    request = ov.Core().compile_model(ov.Model(node.outputs(), [px, ps]), "CPU").create_infer_request()
    got = request.infer({"x": x, "state": state})
    z = np.concatenate([state, x.transpose(0, 2, 1)], axis=2).astype(np.float64)  # [B, C, S + T]
    want = np.stack([(z[:, :, kept - taps + 1 + t: kept + 1 + t] * w).sum(-1) for t in range(tokens)], axis=1)
    assert np.abs(np.array(got[0]) - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    assert np.array_equal(np.array(got[1]), z[:, :, -kept:].astype(np.float32))


@pytest.mark.parametrize(("channels", "kept", "taps"), [(8192, 3, 4), (70, 3, 4), (24, 6, 2)])
def test_causal_conv_one_token_at_a_time_is_the_chunk_bit_for_bit(channels: int, kept: int, taps: int) -> None:
    """A decode step (T = 1) takes its own path (no transposes); its outputs and states, token by
    token, are the chunk's bit for bit: the same products in the same order."""
    import openvino as ov
    from openvino import opset15 as op

    rng = np.random.default_rng(channels + kept)
    tokens = 5
    x = rng.standard_normal((1, tokens, channels)).astype(np.float32)
    state = rng.standard_normal((1, channels, kept)).astype(np.float32)
    w = op.constant(rng.standard_normal((channels, taps)).astype(np.float32))
    px = op.parameter([1, -1, channels], np.float32, name="x")
    ps = op.parameter([1, channels, kept], np.float32, name="state")
    node = native.factory().create("CausalConv1d", [px, ps, w])
    request = ov.Core().compile_model(ov.Model(node.outputs(), [px, ps]), "CPU").create_infer_request()
    chunk = request.infer({"x": x, "state": state})
    y_chunk, state_chunk = np.array(chunk[0]), np.array(chunk[1])
    s = state
    for t in range(tokens):
        step = request.infer({"x": x[:, t:t + 1], "state": s})
        assert np.array_equal(np.array(step[0])[:, 0], y_chunk[:, t]), t
        s = np.array(step[1])
    assert np.array_equal(s, state_chunk)


def _rewrite(model: object) -> None:
    native_conv.apply(model)
    assert sum(n.get_type_name() == "CausalConv1d" for n in model.get_ops()) == 3  # dev-tiny's three


@pytest.mark.parametrize("chunks", [[1], [3, 1, 1], [64, 1, 1, 1], [5, 100, 2]],
                         ids=["1", "3+decode", "64+decode", "5+100+2"])
def test_native_conv_keeps_the_logits(tiny_dir: Path, chunks: list[int]) -> None:
    """The state carried across chunks shorter and longer than it; measured bit for bit equal
    (the same K products summed in the same order)."""
    plain, rewritten = chunk_logits(tiny_dir, chunks), chunk_logits(tiny_dir, chunks, _rewrite)
    assert np.abs(plain - rewritten).max() <= 1e-6 * np.abs(plain).max()


def test_native_conv_keeps_greedy_generation(tiny_dir: Path) -> None:
    prompt = tuple(range(1000, 1100))
    tokens, kernels = kernel_greedy(tiny_dir, "native_conv", True, prompt, 24)
    assert "native_conv" in kernels
    assert tokens == kernel_greedy(tiny_dir, "native_conv", False, prompt, 24)[0]


def test_a_model_without_the_pattern_is_refused() -> None:
    import openvino as ov
    from openvino import opset15 as op

    p = op.parameter([1, 4], np.float32)
    with pytest.raises(native_conv.RewriteError, match="no causal convolution"):
        native_conv.apply(ov.Model([op.relu(p)], [p]))
