"""Kernel `q16_decode`: decode rows of the compressed dense matmuls through `Q16Linear`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels import last_token_logits, native, q16_decode
from tests.helpers import kernel_greedy
from worker.reference import stateful_feed

pytestmark = pytest.mark.skipif(not native.cpu_supported(), reason=f"needs a CPU with {native.CPU_FLAGS}")


def _u4(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[object, np.ndarray]:
    """A u4 constant of random values (any count, odd included), and the values."""
    import openvino as ov
    from openvino import opset15 as op

    values = rng.integers(0, 16, shape, dtype=np.uint8)
    tensor = ov.Tensor(ov.Type.u4, list(shape))
    flat = np.append(values.ravel(), np.uint8(0)) if values.size % 2 else values.ravel()
    tensor.data[:] = flat[0::2] | (flat[1::2] << 4)  # two per byte, the first in the low nibble
    return op.constant(tensor), values


def _run(node_inputs: list, x: np.ndarray) -> np.ndarray:
    import openvino as ov
    from openvino import opset15 as op

    core = ov.Core()
    native.register(core)
    p = op.parameter(list(x.shape), np.float32, name="x")
    y = native.factory().create("Q16Linear", [p, *node_inputs])
    request = core.compile_model(ov.Model([y], [p]), "CPU").create_infer_request()
    return np.array(request.infer({"x": x})[0])


def _weights(rng: np.random.Generator, kind: str, n: int, k: int, group: int, scale_type: type):
    """(op inputs, dense f64 [n, k]) for u8 per-row [n, k], u8 grouped or u4 grouped [n, G, g]."""
    from openvino import opset15 as op

    if kind == "u8-rows":
        w = rng.integers(0, 256, (n, k), dtype=np.uint8)
        z = rng.integers(0, 256, (n, 1), dtype=np.uint8)
        s = (rng.random((n, 1)) * 0.02 + 0.001).astype(scale_type)
        return [op.constant(w), op.constant(z), op.constant(s)], (w.astype(np.float64) - z) * s.astype(np.float64)
    shape, zshape = (n, k // group, group), (n, k // group, 1)
    if kind == "u4":
        (wc, w), (zc, z) = _u4(rng, shape), _u4(rng, zshape)
    else:
        w, z = rng.integers(0, 256, shape, dtype=np.uint8), rng.integers(0, 256, zshape, dtype=np.uint8)
        wc, zc = op.constant(w), op.constant(z)
    s = (rng.random(zshape) * 0.05 + 0.01).astype(scale_type)
    dense = ((w.astype(np.float64) - z) * s.astype(np.float64)).reshape(n, k)
    return [wc, zc, op.constant(s)], dense


def _bound(x: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """What rounding x to int16 per 128-input block may cost each output: sum over blocks of
    0.5 * (block max / 32767) * sum |dense| over the block; plus f32 accumulation."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    blocks = rows.reshape(rows.shape[0], -1, 128)
    step = 0.5 * np.abs(blocks).max(axis=2) / 32767  # [M, B]
    weight = np.abs(dense).reshape(dense.shape[0], -1, 128).sum(axis=2)  # [N, B]
    f32 = 1e-6 * (np.abs(rows) @ np.abs(dense).T)
    return (step @ weight.T + f32).reshape(*x.shape[:-1], dense.shape[0])


@pytest.mark.parametrize(("kind", "k", "group"), [("u8-rows", 2048, 2048), ("u8-rows", 384, 384),
                                                  ("u4", 512, 128), ("u4", 768, 256), ("u8", 512, 256)])
@pytest.mark.parametrize("shape", [(1,), (3,), (2, 1)], ids=["1", "3", "2x1"])
@pytest.mark.parametrize("scale_type", [np.float16, np.float32])
def test_q16_linear_is_within_its_rounding_bound(kind: str, k: int, group: int, shape: tuple[int, ...],
                                                 scale_type: type) -> None:
    """Against ((w - zp) * s) @ x in float64, every output within the bound of rounding x to
    int16 per 128-input block (an outlier of 40 in one block makes that block's step large);
    u4 and u8, per-row and grouped (one and two blocks per group), f16 and f32 scales, any
    leading dims. And the bound is tight enough to mean something: the rounding really shows."""
    rng = np.random.default_rng(k + group)
    n = 37
    x = rng.standard_normal((*shape, k)).astype(np.float32)
    x[..., 5] = 40.0
    inputs, dense = _weights(rng, kind, n, k, group, scale_type)
    got = _run(inputs, x)
    want = x.astype(np.float64) @ dense.T
    assert got.shape == (*shape, n)
    err, bound = np.abs(got - want), _bound(x, dense)
    assert (err <= bound).all(), float((err / bound).max())
    assert err.max() > 1e-3 * bound.max()  # not silently exact: the op does round


def test_q16_linear_zero_blocks_and_zero_rows() -> None:
    """A block of zeros (scale 0) contributes nothing, the zero points included; an empty x
    gives an empty y (prefill chunks leave the op no rows)."""
    rng = np.random.default_rng(3)
    inputs, dense = _weights(rng, "u4", 16, 512, 128, np.float16)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    x[:, 128:256] = 0.0
    got, want = _run(inputs, x), x.astype(np.float64) @ dense.T
    assert (np.abs(got - want) <= _bound(x, dense)).all()
    assert _run(inputs, np.zeros((0, 512), np.float32)).shape == (0, 16)


def test_q16_linear_rejects_what_it_cannot_do() -> None:
    from openvino import opset15 as op

    rng = np.random.default_rng(4)
    p = op.parameter([1, 192], np.float32, name="x")
    inputs, _ = _weights(rng, "u4", 8, 192, 64, np.float16)  # groups of 64 inputs
    with pytest.raises(RuntimeError, match="multiple of 128"):
        native.factory().create("Q16Linear", [p, *inputs])
    inputs, _ = _weights(rng, "u4", 8, 256, 128, np.float16)
    with pytest.raises(RuntimeError, match="K"):
        native.factory().create("Q16Linear", [p, *inputs])
    with pytest.raises(RuntimeError, match="u8 or u4"):
        native.factory().create("Q16Linear", [op.parameter([1, 256], np.float32), op.constant(np.zeros((8, 256), np.int8)),
                                              *inputs[1:]])


def _logits(model_dir: Path, chunks: list[int], **rewrite: object) -> np.ndarray:
    import openvino as ov

    core = ov.Core()
    native.register(core)
    model = last_token_logits.apply(core.read_model(model_dir / "openvino_model.xml"))
    if rewrite:
        q16_decode.apply(model, **rewrite)
    names = {p.get_any_name() for p in model.inputs}
    request = core.compile_model(model, "CPU").create_infer_request()
    rng = np.random.default_rng(0)
    rows, pos = [], 0
    for call, n in enumerate(chunks):
        request.infer(stateful_feed(rng.integers(10, 1000, n), pos, names, call))
        pos += n
        rows.append(np.array(request.get_tensor("logits").data[0, -1], np.float64))
    return np.stack(rows)


def test_every_dense_compressed_matmul_but_the_routers_is_rewritten(tiny_dir: Path) -> None:
    import openvino as ov

    model = ov.Core().read_model(tiny_dir / "openvino_model.xml")
    last_token_logits.apply(model)
    routers = [m for m in model.get_ordered_ops() if m.get_type_name() == "MatMul"
               and any(t.get_node().get_type_name() == "Softmax" for t in m.output(0).get_target_inputs())]
    dense = [m for m in model.get_ordered_ops() if m.get_type_name() == "MatMul"
             and q16_decode._eligible(m, 0) is not None]
    q16_decode.apply(model, min_bytes=0)
    ops = [op.get_type_name() for op in model.get_ordered_ops()]
    assert routers and dense and ops.count("Q16Linear") == len(dense)
    assert all(q16_decode._eligible(r, 0) is None for r in routers)
    # with the default floor only the LM head is big enough on dev-tiny (256-wide layers)
    small = last_token_logits.apply(ov.Core().read_model(tiny_dir / "openvino_model.xml"))
    q16_decode.apply(small)
    assert [op.get_type_name() for op in small.get_ordered_ops()].count("Q16Linear") == 1


def test_prefill_chunks_stay_on_the_plugin(tiny_dir: Path) -> None:
    """Chunks longer than MAX_ROWS take the plugin's own matmuls. With the head left alone their
    logits are the plain graph's up to f32 summation order (~4e-7 of the scale: the plugin
    compiles a matmul behind a Slice a little differently); a decode row after them takes the op
    and shows its rounding (~5e-5). Ten times apart either way."""
    chunks = [q16_decode.MAX_ROWS + 1, 40, 1]
    plain = _logits(tiny_dir, chunks)
    split = _logits(tiny_dir, chunks, min_bytes=0, head=False)
    scale = np.abs(plain).max()
    assert np.abs(plain[:2] - split[:2]).max() <= 5e-6 * scale
    assert np.abs(plain[2] - split[2]).max() >= 5e-6 * scale


@pytest.mark.parametrize("chunks", [[1], [3, 1, 1], [64, 1, 1, 1]], ids=["1", "3+decode", "64+decode"])
def test_q16_decode_keeps_the_logits(tiny_dir: Path, chunks: list[int]) -> None:
    """Every dense matmul and the head on the op: the logits stay within 1e-3 of their scale
    and the next-token distributions within a KL divergence of 1e-5 (the gate allows 5e-3)."""
    plain, rewritten = _logits(tiny_dir, chunks), _logits(tiny_dir, chunks, min_bytes=0)
    assert np.abs(plain - rewritten).max() <= 1e-3 * np.abs(plain).max()

    def logp(v: np.ndarray) -> np.ndarray:
        v = v - v.max(axis=-1, keepdims=True)
        return v - np.log(np.exp(v).sum(axis=-1, keepdims=True))

    kld = (np.exp(logp(plain)) * (logp(plain) - logp(rewritten))).sum(axis=-1)
    assert kld.max() <= 1e-5, kld


def test_q16_decode_keeps_greedy_generation(tiny_dir: Path) -> None:
    prompt = tuple(range(1000, 1200))
    tokens, kernels = kernel_greedy(tiny_dir, q16_decode.NAME, True, prompt, 24)
    assert q16_decode.NAME in kernels
    assert tokens == kernel_greedy(tiny_dir, q16_decode.NAME, False, prompt, 24)[0]


def test_a_model_without_compressed_matmuls_is_refused() -> None:
    import openvino as ov
    from openvino import opset15 as op

    p = op.parameter([2], np.float32, name="x")
    with pytest.raises(q16_decode.RewriteError, match="no compressed dense matmul"):
        q16_decode.apply(ov.Model([op.relu(p)], [p]))
