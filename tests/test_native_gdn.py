"""Kernel `native_gdn`: the gated delta rule as the native `GatedDeltaRule` op."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels import native, native_gdn
from tests.helpers import chunk_logits, kernel_greedy

pytestmark = pytest.mark.skipif(not native.cpu_supported(), reason=f"needs a CPU with {native.CPU_FLAGS}")


def _rule(q, k, v, g, beta, state):
    """The exported loop body, token by token, in float64."""
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[2]):
        s *= np.exp(g[:, :, t])[:, :, None, None]
        kv = np.einsum("bhij,bhi->bhj", s, k[:, :, t])
        delta = (v[:, :, t] - kv) * beta[:, :, t][:, :, None]
        s += np.einsum("bhi,bhj->bhij", k[:, :, t], delta)
        out[:, :, t] = np.einsum("bhij,bhi->bhj", s, q[:, :, t])
    return out, s


def _rule_op(values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The native op on q, k, v, g, beta, state: its outputs and its state after them."""
    import openvino as ov
    from openvino import opset15 as op

    params = [op.parameter(list(x.shape), np.float32, name=f"p{i}") for i, x in enumerate(values)]
    node = native.factory().create("GatedDeltaRule", params)
    request = ov.Core().compile_model(ov.Model(node.outputs(), params), "CPU").create_infer_request()
    got = request.infer({f"p{i}": np.ascontiguousarray(x) for i, x in enumerate(values)})
    return np.array(got[0]), np.array(got[1])


@pytest.mark.parametrize(("tokens", "dk", "dv"), [(1, 16, 24), (7, 16, 20), (100, 32, 8)])
def test_gated_delta_rule_is_the_loop_body(tokens: int, dk: int, dv: int) -> None:
    """Outputs and final state against the body's math in float64: one token (decode), a chunk,
    a long chunk; dv with and without a tail past the 8-wide vectors."""
    rng = np.random.default_rng(tokens)
    b, h = 1, 3
    q, k = (rng.standard_normal((b, h, tokens, dk)).astype(np.float32) / np.sqrt(dk) for _ in range(2))
    v = rng.standard_normal((b, h, tokens, dv)).astype(np.float32)
    g = -rng.random((b, h, tokens)).astype(np.float32)
    beta = rng.random((b, h, tokens)).astype(np.float32)
    state = rng.standard_normal((b, h, dk, dv)).astype(np.float32)
    values = [q, k, v, g, beta, state]
    out, s = _rule_op(values)
    want_out, want_s = _rule(*values)
    assert out.shape == want_out.shape and s.shape == want_s.shape
    assert np.abs(out - want_out).max() <= 1e-5 * max(1.0, float(np.abs(want_out).max()))
    assert np.abs(s - want_s).max() <= 1e-5 * max(1.0, float(np.abs(want_s).max()))


@pytest.mark.parametrize("dv", [24, 20, 32, 128])
def test_gated_delta_rule_decode_steps_are_the_chunk(dv: int) -> None:
    """Tokens fed one call each (decode: the state read from the input and streamed to the
    output, dv a multiple of 8; dv = 20 takes the chunk path; 128 is the real model's head) give
    the same bits, outputs and state, as the same tokens in one chunk: per element the same
    operations in the same order."""
    rng = np.random.default_rng(dv)
    b, h, tokens, dk = 1, 3, 3, 16
    q, k = ((rng.standard_normal((b, h, tokens, dk)) / np.sqrt(dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((b, h, tokens, dv)).astype(np.float32)
    g = -rng.random((b, h, tokens)).astype(np.float32)
    beta = rng.random((b, h, tokens)).astype(np.float32)
    state = rng.standard_normal((b, h, dk, dv)).astype(np.float32)

    chunk_out, chunk_state = _rule_op([x[:, :, :tokens] for x in (q, k, v, g, beta)] + [state])
    s, outs = state, []
    for t in range(tokens):
        out, s = _rule_op([x[:, :, t:t + 1] for x in (q, k, v, g, beta)] + [s])
        outs.append(out)
    assert np.array_equal(np.concatenate(outs, axis=2), chunk_out)
    assert np.array_equal(s, chunk_state)


def test_every_linear_attention_loop_is_replaced(tiny_dir: Path) -> None:
    import openvino as ov

    model = ov.Core().read_model(tiny_dir / "openvino_model.xml")
    loops = sum(op.get_type_name() == "Loop" for op in model.get_ordered_ops())
    native_gdn.apply(model)
    types = [op.get_type_name() for op in model.get_ordered_ops()]
    assert loops > 0 and "Loop" not in types and types.count("GatedDeltaRule") == loops
    for node in model.get_ordered_ops():  # the export's flatten/concat/slice of the loop's outputs is bypassed
        if node.get_type_name() == "GatedDeltaRule":
            users = [t.get_node().get_type_name() for o in node.outputs() for t in o.get_target_inputs()]
            assert "Reshape" not in users, users
            assert node.input_value(5).get_node().get_type_name() == "ReadValue"  # no beam reorder at batch 1


@pytest.mark.parametrize("chunks", [[1], [17], [100, 1, 1], [256] * 4], ids=["1", "17", "100+decode", "4x256"])
def test_native_gdn_keeps_the_logits(tiny_dir: Path, chunks: list[int]) -> None:
    """Against the plugin's own GatedDeltaNet: ~1e-6 on short chunks; over 100+ tokens the two
    differ by up to ~1.2e-4 of the logits' scale (the op is within 1e-5 of the float64 rule
    above; the plugin's fused node computes the same rule another way)."""
    plain, rewritten = chunk_logits(tiny_dir, chunks), chunk_logits(tiny_dir, chunks, native_gdn.apply)
    assert np.abs(plain - rewritten).max() <= 3e-4 * max(1.0, float(np.abs(plain).max()))


def test_native_gdn_keeps_greedy_generation(tiny_dir: Path) -> None:
    prompt = tuple(range(1000, 1200))
    tokens, kernels = kernel_greedy(tiny_dir, native_gdn.NAME, True, prompt, 24)
    assert native_gdn.NAME in kernels
    assert tokens == kernel_greedy(tiny_dir, native_gdn.NAME, False, prompt, 24)[0]


def test_a_model_without_the_loop_is_refused() -> None:
    import openvino as ov
    from openvino import opset15 as op

    p = op.parameter([2], np.float32, name="x")
    with pytest.raises(native_gdn.RewriteError, match="no gated-delta-rule Loop"):
        native_gdn.apply(ov.Model([op.relu(p)], [p]))
