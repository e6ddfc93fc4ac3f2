"""Kernel `q16_decode`: decode rows of the compressed dense matmuls through `Q16Linear`."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import last_token_logits, native, q16_decode
from tests.helpers import REFERENCE, chunk_logits, kernel_greedy
from tests.test_native import _bf16

pytestmark = pytest.mark.skipif(not native.cpu_supported(), reason=f"needs a CPU with {native.CPU_FLAGS}")
# Numeric comparisons run the plugin in its reference mode (tests.helpers.REFERENCE): on an AVX-512
# BF16 CPU its default rounds to bf16 and int8, which would swamp the differences these tests bound.


def _u4(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[object, np.ndarray]:
    """A u4 constant of random values (any count, odd included), and the values."""
    import openvino as ov
    from openvino import opset15 as op

    values = rng.integers(0, 16, shape, dtype=np.uint8)
    tensor = ov.Tensor(ov.Type.u4, list(shape))
    flat = np.append(values.ravel(), np.uint8(0)) if values.size % 2 else values.ravel()
    tensor.data[:] = flat[0::2] | (flat[1::2] << 4)  # two per byte, the first in the low nibble
    return op.constant(tensor), values


def _op_outputs(node_inputs: list, x: np.ndarray, attributes: dict[str, Any]) -> list[np.ndarray]:
    """Every output of the op with these attributes on `x`, its weights as given."""
    import openvino as ov
    from openvino import opset15 as op

    core = ov.Core()
    native.register(core)
    p = op.parameter(list(x.shape), np.float32, name="x")
    y = native.factory().create("Q16Linear", [p, *node_inputs], attributes)
    result = core.compile_model(ov.Model(y.outputs(), [p]), "CPU").create_infer_request().infer({"x": x})
    return [np.array(result[i]) for i in range(len(y.outputs()))]


def _packed(node_inputs: list) -> tuple[list, bool]:
    """The op's inputs as q16_decode passes them, and whether they are u4 bytes (`nibbles`): a u4
    constant that only the op reads would reach it widened to u8 by the plugin."""
    import openvino as ov

    w, *rest = node_inputs
    nibbles = w.get_element_type() == ov.Type.u4
    if nibbles:
        w = q16_decode._as_bytes(w.output(0)).get_node()
    return [w, *rest], nibbles


def _run(node_inputs: list, x: np.ndarray) -> np.ndarray:
    """The op on `x`, u4 weights as their packed bytes (`_packed`)."""
    inputs, nibbles = _packed(node_inputs)
    return _op_outputs(inputs, x, {"nibbles": nibbles})[0]


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
    """f32 accuracy for each output: 1e-6 of sum |x| |w|. Rounding x to two terms per 128-input
    block costs at most 2^-17 (u4: 2^-9) of q's unit, 32767 units to the block's largest
    magnitude: far below."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    return (1e-6 * (np.abs(rows) @ np.abs(dense).T) + 1e-30).reshape(*x.shape[:-1], dense.shape[0])


@pytest.mark.parametrize(("kind", "k", "group"), [("u8-rows", 2048, 2048), ("u8-rows", 384, 384),
                                                  ("u4", 512, 128), ("u4", 768, 256), ("u8", 512, 256)])
@pytest.mark.parametrize("shape", [(1,), (3,), (2, 1)], ids=["1", "3", "2x1"])
@pytest.mark.parametrize("scale_type", [np.float16, np.float32])
def test_q16_linear_is_the_decompressed_matmul(kind: str, k: int, group: int, shape: tuple[int, ...],
                                               scale_type: type) -> None:
    """Against ((w - zp) * s) @ x in float64, every output to f32 accuracy, also with an outlier
    of 40 in one block (a single int16 term would lose 2e-5 of that block's scale there); u4
    and u8, per-row and grouped (one and two blocks per group), f16 and f32 scales, any leading
    dims."""
    rng = np.random.default_rng(k + group)
    n = 37
    x = rng.standard_normal((*shape, k)).astype(np.float32)
    x[..., 5] = 40.0
    inputs, dense = _weights(rng, kind, n, k, group, scale_type)
    got = _run(inputs, x)
    want = x.astype(np.float64) @ dense.T
    assert got.shape == (*shape, n)
    err = np.abs(got - want)
    assert (err <= _bound(x, dense)).all(), float((err / _bound(x, dense)).max())


@pytest.mark.parametrize(("k", "group"), [(2048, 128), (1536, 128), (1152, 128), (512, 128), (1024, 256)],
                         ids=["16-groups", "12-groups", "9-groups", "4-groups", "2-blocks-per-group"])
@pytest.mark.parametrize("scale_type", [np.float16, np.float32])
def test_q16_linear_u4_as_exported(k: int, group: int, scale_type: type) -> None:
    """The op evaluated without the plugin, so u4 zero points and f16 scales reach it as exported
    (a compiled model hands it u8 and f32 copies): the row's scales and zero points are read
    eight, then four groups at a time where they can be (one-block groups; a row starting at an
    odd zero-point nibble, as row 1 of 9 groups does, takes the scalar path), and eight rows'
    at once (rows 0-7 of 4 and 16 groups), every output to f32 accuracy."""
    import openvino as ov
    from openvino import opset15 as op

    rng = np.random.default_rng(k + group)
    n = 13
    inputs, dense = _weights(rng, "u4", n, k, group, scale_type)
    w = q16_decode._as_bytes(inputs[0].output(0)).get_node()
    node = native.factory().create("Q16Linear", [op.parameter([2, k], np.float32), w, *inputs[1:]],
                                   {"nibbles": True})
    assert [c.get_element_type() for c in inputs[1:]] == [ov.Type.u4, ov.Type(scale_type)]
    x = rng.standard_normal((2, k)).astype(np.float32)
    x[1, 3] = -40.0
    out = ov.Tensor(ov.Type.f32, [2, n])
    assert node.evaluate([out], [ov.Tensor(x), *(c.get_tensor_view() for c in (w, *inputs[1:]))])
    err = np.abs(out.data - x.astype(np.float64) @ dense.T)
    assert (err <= _bound(x, dense)).all(), float((err / _bound(x, dense)).max())


def _int16_term(x: np.ndarray) -> np.ndarray:
    """x as the op rounds it without the residual: per block of 128 inputs sx = max |x| / 32767
    and x = sx * q, q = rint(x * (32767 / max |x|)), in the op's f32 arithmetic."""
    blocks = x.reshape(*x.shape[:-1], -1, 128).astype(np.float32)
    m = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.where(m > 0, np.float32(32767) / np.where(m > 0, m, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inv), -32767, 32767)
    sx = (m / np.float32(32767)).astype(np.float32)
    return (sx.astype(np.float64) * q).reshape(x.shape)


@pytest.mark.parametrize(("k", "group"), [(2048, 128), (1152, 128), (512, 128), (1024, 256)])
@pytest.mark.parametrize("shape", [(1,), (3,)], ids=["1", "3"])
def test_q16_linear_without_the_residual(k: int, group: int, shape: tuple[int, ...]) -> None:
    """`residual` False (u4): the products of the int16 term alone, x = sx * q per block, to f32
    accuracy; against the exact x within half a step of q per input (sum |w| sx / 2), and not
    the products with the residual. u8 weights ignore the attribute (both terms)."""
    rng = np.random.default_rng(7 * k + group)
    n = 29
    x = rng.standard_normal((*shape, k)).astype(np.float32)
    x[..., 5] = 40.0  # a block whose step is 40 / 32767
    inputs, dense = _weights(rng, "u4", n, k, group, np.float16)
    w = q16_decode._as_bytes(inputs[0].output(0)).get_node()
    got = _run_attrs([w, *inputs[1:]], x, {"nibbles": True, "residual": False})
    rounded = _int16_term(x)
    err = np.abs(got - rounded @ dense.T)
    assert (err <= _bound(x, dense)).all(), float((err / _bound(x, dense)).max())
    steps = np.repeat(np.abs(x.reshape(*shape, -1, 128)).max(axis=-1) / 32767, 128, axis=-1)
    assert (np.abs(got - x.astype(np.float64) @ dense.T) <= (steps / 2) @ np.abs(dense).T + _bound(x, dense)).all()
    with_residual = _run_attrs([w, *inputs[1:]], x, {"nibbles": True})
    assert not np.array_equal(got, with_residual)
    u8_inputs, _ = _weights(rng, "u8", n, k, group, np.float16)
    assert np.array_equal(_run_attrs(u8_inputs, x, {"residual": False}), _run_attrs(u8_inputs, x, {}))


_BF16 = pytest.mark.skipif(not native.bf16_supported(), reason="the bf16 tiles need a CPU with AVX512-BF16")


@_BF16
@pytest.mark.parametrize(("k", "group"), [(2048, 128), (512, 128), (1024, 256)])
@pytest.mark.parametrize("rows", [5, 7, 10, 11, 16, 21, 26, 32, 37])
def test_q16_linear_tile_rows(k: int, group: int, rows: int) -> None:
    """`tile_rows`: calls of at least that many rows take the routed experts' bf16 tiles (lane
    form for whole vectors of 16 rows, the dot form for up to 10 more, the fused form for up to 10
    alone): against float64 on x rounded to bf16, every output to f32 accuracy, and not the
    integer products' numbers (the tiles ran); fewer rows keep the integer products bit for bit.
    200 weight rows: a task of 128 and one of 72."""
    weights, dense, x, attributes = _tile_case(rows * 7 + k, k, group, rows)
    got = _run_attrs(weights, x, {**attributes, q16_decode.TILE_ROWS: 5})
    want = _bf16(x) @ dense.T
    err = np.abs(got - want)
    assert (err <= _bound(x, dense)).all(), float((err / _bound(x, dense)).max())
    assert not np.array_equal(got, _run_attrs(weights, x, attributes))
    few = x[:4]
    assert np.array_equal(_run_attrs(weights, few, {**attributes, q16_decode.TILE_ROWS: 5}),
                          _run_attrs(weights, few, attributes))


def _tile_case(seed: int, k: int, group: int, rows: int) -> tuple[list, np.ndarray, np.ndarray, dict[str, Any]]:
    """200 rows of u4 weights (as the op's inputs, the bytes typed u8) over k inputs, their dense
    float64 form, `rows` rows of x, and the op's attributes without tiles."""
    rng = np.random.default_rng(seed)
    inputs, dense = _weights(rng, "u4", 200, k, group, np.float16)
    w = q16_decode._as_bytes(inputs[0].output(0)).get_node()
    x = rng.standard_normal((rows, k)).astype(np.float32)
    return [w, *inputs[1:]], dense, x, {"nibbles": True, "residual": False}


@pytest.mark.skipif(not native.int8_supported(),
                    reason=f"the int8 tiles need a CPU with {', '.join(native.INT8_CPU_FLAGS)} and AVX512-BF16, "
                           "without AMX")
@pytest.mark.parametrize(("k", "group"), [(2048, 128), (1024, 256), (512, 128)])
@pytest.mark.parametrize("rows", [11, 16, 21, 32, 37, 57, 63])
def test_q16_linear_tile_rows_int8(k: int, group: int, rows: int) -> None:
    """`tile_int8` with `tile_rows`: calls of more than 10 rows take the int8 tiles (x as int8 per 32
    inputs, the lane form padded to vectors of 16): against float64 on x so quantized, every
    output to f32 accuracy, and not the bf16 tiles' numbers; 5-10 rows keep the bf16 tiles' dot or
    fused form (as an expert of that many tokens), fewer the integer products, bit for bit. 200
    weight rows: a task of 128 and one of 72. Up to 63 rows: every tail past the plugin's row
    blocks (TAIL_ROWS_INT8)."""
    from tests.test_native import _int8

    weights, dense, x, attributes = _tile_case(rows * 11 + k, k, group, rows)
    tiles = {**attributes, q16_decode.TILE_ROWS: 5, q16_decode.TILE_INT8: True}
    got = _run_attrs(weights, x, tiles)
    xq = np.stack([_int8(row) for row in x])
    err = np.abs(got - xq @ dense.T)
    assert (err <= _bound(xq, dense)).all(), float((err / _bound(xq, dense)).max())
    bf16_tiles = {**attributes, q16_decode.TILE_ROWS: 5}
    assert not np.array_equal(got, _run_attrs(weights, x, bf16_tiles))
    assert np.array_equal(_run_attrs(weights, x[:10], tiles), _run_attrs(weights, x[:10], bf16_tiles))
    few = x[:4]
    assert np.array_equal(_run_attrs(weights, few, tiles), _run_attrs(weights, few, attributes))


def _run_attrs(node_inputs: list, x: np.ndarray, attributes: dict[str, Any]) -> np.ndarray:
    """The op with these attributes on `x`, its weights as given (u4 bytes already typed u8)."""
    return _op_outputs(node_inputs, x, attributes)[0]


def vnni_probe() -> None:
    """Print the digest of Q16Linear's u4 outputs over shapes that take every path of the
    products (eight- and four-group steps, an odd zero-point nibble, two blocks per group) and
    an outlier, with and without the residual; run in a subprocess by the test below, once per
    form of the products."""
    import hashlib

    import openvino as ov
    from openvino import opset15 as op

    digest = hashlib.sha256()
    for (k, group), residual in itertools.product(((2048, 128), (1152, 128), (512, 128), (1024, 256)), (True, False)):
        rng = np.random.default_rng(k + group)
        inputs, _ = _weights(rng, "u4", 9, k, group, np.float32)
        w = q16_decode._as_bytes(inputs[0].output(0)).get_node()
        node = native.factory().create("Q16Linear", [op.parameter([3, k], np.float32), w, *inputs[1:]],
                                       {"nibbles": True, "residual": residual})
        x = rng.standard_normal((3, k)).astype(np.float32)
        x[1, 3] = -40.0
        out = ov.Tensor(ov.Type.f32, [3, 9])
        assert node.evaluate([out], [ov.Tensor(x), *(c.get_tensor_view() for c in (w, *inputs[1:]))])
        digest.update(np.ascontiguousarray(out.data).tobytes())
    print(digest.hexdigest())


_FORMS = {  # the products' forms: the CPU flags each needs, and the environment that picks it
    "vnni": (("avx_vnni",), {"IQ36_NATIVE_VNNI": "1", "IQ36_NATIVE_AVX512": "0"}),
    "zmm": (("avx512f", "avx512bw", "avx512_vnni"), {"IQ36_NATIVE_VNNI": "1", "IQ36_NATIVE_AVX512": "1"}),
}


@pytest.mark.parametrize("form", sorted(_FORMS))
def test_q16_linear_products_are_the_avx2_products_bit_for_bit(form: str) -> None:
    """With AVX-VNNI (ymm) or AVX512-VNNI (zmm) the u4 products take vpdpbusd; their int32 lanes
    are the AVX2 form's, so every output is bit for bit the same, with the residual and without
    (IQ36_NATIVE_VNNI=0 keeps the AVX2 form, IQ36_NATIVE_AVX512=0 the ymm forms)."""
    import os
    import subprocess
    import sys

    flags, picks = _FORMS[form]
    missing = [f for f in flags if f not in native.cpu_flags()]
    if missing:
        pytest.skip(f"the {form} form needs a CPU with {', '.join(missing)}")

    def digest(env: dict[str, str]) -> str:
        code = "from tests.test_q16_decode import vnni_probe; vnni_probe()"
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent.parent)
        return done.stdout.strip().splitlines()[-1]

    assert digest(picks) == digest({"IQ36_NATIVE_VNNI": "0"})


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


def _run_top(node_inputs: list, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The op with `top` on `x` (u4 weights as their bytes): its products and its argmax output."""
    inputs, nibbles = _packed(node_inputs)
    y, top = _op_outputs(inputs, x, {q16_decode.TOP: True, "nibbles": nibbles})
    return y, top


@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 256), (0, 256)])
@pytest.mark.parametrize("kind", ["u8-rows", "u4"])
def test_q16_linear_top_is_the_argmax_of_its_products(shape: tuple[int, ...], kind: str) -> None:
    """With `top` the op's second output is numpy's argmax of each row of its products (rows of
    x of any leading dims, enough weight rows for many tasks, a row count off the 8-row units)."""
    rng = np.random.default_rng(len(shape) * 7 + shape[0])
    inputs, _ = _weights(rng, kind, 3001, 256, 128, np.float16)
    x = rng.standard_normal(shape).astype(np.float32)
    y, top = _run_top(inputs, x)
    assert top.dtype == np.int64 and top.shape == shape[:-1]
    assert np.array_equal(top, np.argmax(y, axis=-1) if y.size else np.zeros(shape[:-1], np.int64))


@_BF16
def test_q16_linear_top_on_the_tiles() -> None:
    """Calls that take the bf16 tiles (`tile_rows`) give the argmax of what the tiles wrote too."""
    weights, _, x, attributes = _tile_case(5, 512, 128, 21)
    tiles = {**attributes, q16_decode.TILE_ROWS: 5}
    got, top = _op_outputs(weights, x, {**tiles, q16_decode.TOP: True})
    assert np.array_equal(got, _run_attrs(weights, x, tiles))
    assert np.array_equal(top, np.argmax(got, axis=-1))


@pytest.mark.parametrize(
    ("ties", "nans", "expected"),
    [
        ([], [], 0),  # every row equal: the first
        ([70, 1400, 2999], [], 70),  # equal maxima in different tasks: the first
        ([70, 1400], [1500, 1301], 1301),  # a NaN wins over any value, the first NaN over later ones
        ([], [5, 2990], 5),
    ],
)
def test_q16_linear_top_is_numpys_argmax(ties: list[int], nans: list[int], expected: int) -> None:
    """Equal maxima and NaNs across the op's tasks: the first, as `np.argmax` picks (the engine
    takes this output instead of an argmax over the logits)."""
    from openvino import opset15 as op

    rows, k = 3000, 128
    w = np.full((rows, k), 3, np.uint8)
    scale = np.ones((rows, 1), np.float32)
    if ties:
        scale[:] = 0.5
        scale[ties] = 2.0
    scale[nans] = np.nan
    inputs = [op.constant(w), op.constant(np.zeros((rows, 1), np.uint8)), op.constant(scale)]
    y, top = _run_top(inputs, np.ones((1, k), np.float32))
    assert int(np.argmax(y[0])) == expected
    assert top.tolist() == [expected]


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
        native.factory().create("Q16Linear", [op.parameter([1, 256], np.float32),
                                              op.constant(np.zeros((8, 256), np.int8)), *inputs[1:]])
    with pytest.raises(RuntimeError, match="with nibbles"):  # nibbles means u8 bytes, not u4 values
        native.factory().create("Q16Linear", [op.parameter([1, 256], np.float32), *inputs], {"nibbles": True})


@pytest.mark.parametrize("tokens", [1, 2, 4, 5])
def test_u4_experts_q16_rows(tokens: int) -> None:
    """U4Experts with `q16_rows` 4: up to 4 rows, its one- and two-row experts take the int16
    activations (to f32 accuracy against the float64 block, but not the f32 path's numbers);
    at 5 rows the op is the f32 op exactly."""
    from tests.test_native import _check_u4_experts

    def run(q16_rows: int, tol: float) -> np.ndarray:
        rng = np.random.default_rng(tokens)
        idx = np.stack([rng.permutation(6)[:3] for _ in range(tokens)]).astype(np.int32)
        return _check_u4_experts(rng, idx, 0, np.float16, experts=6, hidden=256, width=128, groups=(128, 128),
                                 q16_rows=q16_rows, tol=tol)

    f32, q16 = run(0, 1e-5), run(4, 1e-5)
    assert np.array_equal(f32, q16) == (tokens > 4)


@pytest.mark.parametrize("tokens", [1, 2])
def test_u4_experts_q16_rows_past_one_column_block(tokens: int) -> None:
    """Decode's down products take `kDecodeColumns` (1024) output columns a task, every row of a
    present expert on its own: 1152 columns are a whole block and an eighth of one, and an expert
    picked by both rows (two tokens) sums both rows' outputs into their own tokens."""
    from tests.test_native import _check_u4_experts

    rng = np.random.default_rng(200 + tokens)
    idx = np.array([[0, 3, 5], [5, 1, 0]][:tokens], dtype=np.int32)
    _check_u4_experts(rng, idx, 0, np.float16, experts=6, hidden=1152, width=128, groups=(128, 128), q16_rows=4)


@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_u4_experts_q16_rows_without_the_residual(tokens: int) -> None:
    """`residual` False: the q16 rows' activations (x and the act rows) as their int16 term
    alone, within 2e-4 of the float64 block's scale (the input blocks' steps are ~4e-5 of their
    largest magnitude here), not the results with the residual; at 5 rows (the tiles) nothing
    changes."""
    from tests.test_native import _check_u4_experts

    def run(residual: bool, tol: float) -> np.ndarray:
        rng = np.random.default_rng(100 + tokens)
        idx = np.stack([rng.permutation(6)[:3] for _ in range(tokens)]).astype(np.int32)
        return _check_u4_experts(rng, idx, 0, np.float16, experts=6, hidden=256, width=128, groups=(128, 128),
                                 q16_rows=4, nibbles=True, tol=tol, residual=residual)

    full, short = run(True, 1e-5), run(False, 2e-4)
    assert np.array_equal(full, short) == (tokens > 4)


@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_u4_experts_reads_packed_bytes(tokens: int) -> None:
    """`nibbles`: the u4 weights' bytes typed u8 (as `_experts_to_op` passes them, so the plugin
    does not widen them) give the same block: within f32 accuracy of float64 on every path, and
    the u8 op's result to f32 rounding where every expert has enough rows for the tiles (20
    tokens: both decompress to the same f32 weights, but the packed bytes' tiles sum each run of
    16 inputs evens first (`split_index`) and a few tokens as dot products, so not bit for bit)."""
    from tests.test_native import _check_u4_experts

    def run(q16_rows: int, nibbles: bool) -> np.ndarray:
        rng = np.random.default_rng(50 + tokens)
        idx = np.stack([rng.permutation(6)[:3] for _ in range(tokens)]).astype(np.int32)
        return _check_u4_experts(rng, idx, 0, np.float16, experts=6, hidden=256, width=128, groups=(128, 128),
                                 q16_rows=q16_rows, nibbles=nibbles)

    packed = run(0, True)
    if tokens == 20:
        u8 = run(0, False)
        assert not np.array_equal(packed, u8)  # another summation order...
        assert np.abs(packed - u8).max() <= 1e-5 * np.abs(u8).max()  # ...the same sums
    run(4, True)


def test_packed_bytes_share_the_constant_memory() -> None:
    from openvino import Type
    from openvino import opset15 as op

    q = np.random.default_rng(0).integers(0, 16, (2, 3, 2, 8)).astype(np.uint8)
    u4 = op.constant(q, Type.u4)
    packed = q16_decode._as_bytes(u4.output(0)).get_node()
    assert packed.get_element_type() == Type.u8 and list(packed.get_shape()) == [2, 3, 2, 4]
    assert np.array_equal(packed.data, (q[..., 0::2] | q[..., 1::2] << 4))  # the first value in the low nibble
    assert packed.data.ctypes.data == u4.data.ctypes.data  # no copy
    with pytest.raises(q16_decode.RewriteError, match="not a u4 constant"):
        q16_decode._as_bytes(op.constant(q).output(0))


def _kld(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row of logits."""

    def logp(v: np.ndarray) -> np.ndarray:
        v = v - v.max(axis=-1, keepdims=True)
        return v - np.log(np.exp(v).sum(axis=-1, keepdims=True))

    return (np.exp(logp(p)) * (logp(p) - logp(q))).sum(axis=-1)


def _logits(model_dir: Path, chunks: list[int], model: object = None, **rewrite: object) -> np.ndarray:
    """Last-position logits after each chunk, of the plain graph, a rewrite of it, or `model`."""
    return chunk_logits(model_dir, chunks, (lambda m: q16_decode.apply(m, **rewrite)) if rewrite else None, model)


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


def _split_weights(rng: np.random.Generator) -> tuple[Any, Any, Any, Any]:
    """u4 [64, 4, 128] weights, zero points and f16 scales as constants, and the exported pattern
    that decompresses them to the f32 [64, 512] matrix a MatMul reads (what q16_decode rewrites)."""
    from openvino import opset15 as op

    (wc, _), (zc, _) = _u4(rng, (64, 4, 128)), _u4(rng, (64, 4, 1))
    s = op.constant((rng.random((64, 4, 1)) * 0.05 + 0.01).astype(np.float16))
    deq = op.multiply(op.subtract(op.convert(wc, np.float16), op.convert(zc, np.float16)), s)
    return wc, zc, s, op.convert(op.reshape(deq, op.constant(np.array([64, 512])), False), np.float32)


def test_rows_are_split_between_the_plugin_and_the_op() -> None:
    """One rewritten matmul [T, 512] x u4 [64, 4, 128]: chunks of up to MAX_ROWS rows give the
    op's own numbers bit for bit, longer ones the plugin's MatMul's, but for their last
    T mod ROW_BLOCK rows when those are at most MAX_ROWS (the op's)."""
    import openvino as ov
    from openvino import opset15 as op

    rng = np.random.default_rng(5)
    wc, zc, s, weight = _split_weights(rng)
    core = ov.Core()
    native.register(core)

    p = op.parameter([-1, 512], np.float32, name="x")
    # both paths side by side (the constants feed the plugin's pattern too, so they stay u4 as
    # in the rewritten graph: fed only to an extension op the plugin would widen them to u8)
    both = core.compile_model(ov.Model([native.factory().create("Q16Linear", [p, wc, zc, s]),
                                        op.matmul(p, weight, False, True)], [p]), "CPU", REFERENCE)
    both = both.create_infer_request()
    x_in = op.parameter([-1, 512], np.float32, name="x")
    model = ov.Model([op.matmul(x_in, weight, False, True)], [x_in])
    q16_decode.apply(model, min_bytes=0)
    assert [o.get_type_name() for o in model.get_ordered_ops()].count("Q16Linear") == 1
    split = core.compile_model(model, "CPU", REFERENCE).create_infer_request()
    few, block = q16_decode.MAX_ROWS, q16_decode.ROW_BLOCK
    for rows in (1, few, few + 1, 40, block, block + 1, block + few, block + few + 1, 2 * block + 2):
        x = rng.standard_normal((rows, 512)).astype(np.float32)
        got = np.array(split.infer({"x": x})[0])
        ours, plugin = (np.array(t) for t in both.infer({"x": x}).values())
        n = 0 if rows <= few else rows - rows % block if rows % block <= few else rows  # the plugin's rows
        assert np.array_equal(got[:n], plugin[:n]) and np.array_equal(got[n:], ours[n:]), rows
        assert not np.array_equal(got, ours if n else plugin), rows  # the two paths differ here


@_BF16
def test_tail_rows_go_to_the_tiles() -> None:
    """`tail_rows` (TAIL_ROWS): a chunk's last T mod ROW_BLOCK rows go to the op when at most that
    many, and the op takes those past MAX_ROWS on its tiles; the plugin's rows as before. The op's
    rows are its own numbers on those rows bit for bit (the op alone, same rows, `tile_rows`)."""
    import openvino as ov
    from openvino import opset15 as op

    rng = np.random.default_rng(6)
    wc, zc, s, weight = _split_weights(rng)
    core = ov.Core()
    native.register(core)
    p = op.parameter([-1, 512], np.float32, name="x")
    plugin = core.compile_model(ov.Model([op.matmul(p, weight, False, True)], [p]), "CPU", REFERENCE)
    plugin = plugin.create_infer_request()
    w = q16_decode._as_bytes(wc.output(0)).get_node()
    x_in = op.parameter([-1, 512], np.float32, name="x")
    model = ov.Model([op.matmul(x_in, weight, False, True)], [x_in])
    q16_decode.apply(model, min_bytes=0, residual=False, tail_rows=q16_decode.TAIL_ROWS)
    ops = [o for o in model.get_ordered_ops() if o.get_type_name() == "Q16Linear"]
    assert len(ops) == 1 and ops[0].get_attributes()[q16_decode.TILE_ROWS] == q16_decode.TILE_FROM
    split = core.compile_model(model, "CPU", REFERENCE).create_infer_request()
    few, tail, block = q16_decode.MAX_ROWS, q16_decode.TAIL_ROWS, q16_decode.ROW_BLOCK
    for rows in (1, few, few + 1, tail, tail + 1, block, block + few, block + few + 1, block + tail, block + tail + 1,
                 2 * block + 20):
        x = rng.standard_normal((rows, 512)).astype(np.float32)
        got = np.array(split.infer({"x": x})[0])
        n = 0 if rows <= few else rows - rows % block if rows % block <= tail else rows  # the plugin's rows
        assert np.array_equal(got[:n], np.array(plugin.infer({"x": x[:n]})[0])), rows
        if n < rows:
            attributes = {"nibbles": True, "residual": False, q16_decode.TILE_ROWS: q16_decode.TILE_FROM}
            ours = _run_attrs([w, zc, s], x[n:], attributes)
            assert np.array_equal(got[n:], ours), rows


@pytest.mark.parametrize("chunks", [[1], [3, 1, 1], [64, 1, 1, 1]], ids=["1", "3+decode", "64+decode"])
def test_q16_decode_keeps_the_logits(tiny_dir: Path, chunks: list[int]) -> None:
    """Every dense matmul and the head on the op: the logits stay within 5e-6 of their scale
    (measured ~8e-7, the plugin's own f32 summation-order level) and the next-token
    distributions within a KL divergence of 1e-10 (measured ~3e-14; the gate allows 5e-3)."""
    plain, rewritten = _logits(tiny_dir, chunks), _logits(tiny_dir, chunks, min_bytes=0)
    assert np.abs(plain - rewritten).max() <= 5e-6 * np.abs(plain).max()
    kld = _kld(plain, rewritten)
    assert kld.max() <= 1e-10, kld


@_BF16
@pytest.mark.parametrize("chunks", [[69, 1, 1], [20, 1], [159, 1]], ids=["64+5", "20", "128+31"])
def test_q16_tail_tiles_keep_the_logits(tiny_dir: Path, chunks: list[int]) -> None:
    """A chunk's last rows past whole blocks (5 to TAIL_ROWS of them, or a whole chunk of that
    many) on the op's bf16 tiles, every dense matmul rewritten: in the plugin's f32 reference mode
    the tiles' rounding of their inputs to bf16 is what moves the logits (where the plugin runs
    bf16, its own outputs are bf16 already). Next-token distributions within a KL divergence of
    1e-5 (measured <= 8e-7; the gate allows 5e-3), the same argmax."""
    plain = _logits(tiny_dir, chunks)
    tiles = _logits(tiny_dir, chunks, min_bytes=0, residual=False, tail_rows=q16_decode.TAIL_ROWS)
    kld = _kld(plain, tiles)
    assert kld.max() <= 1e-5, kld
    assert (plain.argmax(axis=-1) == tiles.argmax(axis=-1)).all()
    assert not np.array_equal(plain, tiles)


def test_native_experts_blocks_take_decode_rows(tiny_dir: Path) -> None:
    """After native_experts, each MoE block's U4Experts op takes every row with `q16_rows`, the
    plugin's fused block (the rank-4 expert matmuls) is gone, and the logits of a prefill and
    decode steps stay at f32 summation-order distance from the plain graph."""
    import openvino as ov

    from kernels import native_experts

    def expert_matmuls(model: object) -> int:  # the fused block's MatMuls on stacked [E, O, K] weights
        return sum(o.get_type_name() == "MatMul" and o.get_input_partial_shape(1).rank.get_length() == 3
                   for o in model.get_ordered_ops())

    model = last_token_logits.apply(ov.Core().read_model(tiny_dir / "openvino_model.xml"))
    native_experts.apply(model)
    assert expert_matmuls(model) > 0
    q16_decode.apply(model)
    experts = [o for o in model.get_ordered_ops() if o.get_type_name() == "U4Experts"]
    assert experts and all(o.get_attributes()["q16_rows"] == q16_decode.MAX_ROWS for o in experts)
    assert all(o.input_value(3).get_node().get_type_name() == "Constant" for o in experts)
    assert all(o.get_attributes()["nibbles"] and o.input_value(4).get_element_type().to_string() == "u8"
               for o in experts)  # the packed bytes, not a u4 constant the plugin would widen
    assert expert_matmuls(model) == 0

    chunks = [20, 1, 1, 3]
    plain, rewritten = _logits(tiny_dir, chunks), _logits(tiny_dir, chunks, model=model)
    assert np.abs(plain - rewritten).max() <= 5e-6 * np.abs(plain).max()


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


# -- the decode graph (worker/engine/candidate.py: DECODE_GRAPH) ---------------------------------

def _cpu_engine(model_dir: Path, decode_graph: bool, kv_f32: bool = False, kernels: dict[str, bool] | None = None,
                **prefill: Any) -> Any:
    """The candidate on the `cpu` profile's kernels with `decode_graph` set (and `kernels`), the
    plugin in f32; 64-token chunks (and `prefill` overrides, e.g. a long-context profile);
    `kv_f32`: an f32 KV cache instead of the plugin's default (u8 on the CPUs we run on)."""
    import msgspec

    from iq36.profile import PrefillSection, load
    from worker.engine import create

    profile = load("cpu")
    properties = {**profile.engine.properties, **REFERENCE, **({"KV_CACHE_PRECISION": "f32"} if kv_f32 else {})}
    profile = msgspec.structs.replace(profile, prefill=PrefillSection(**{"chunk_tokens": 64, **prefill}),
                                      engine=msgspec.structs.replace(profile.engine, properties=properties),
                                      kernels={**profile.kernels, "decode_graph": decode_graph, **(kernels or {})})
    return create("candidate", model_dir, profile)


def _forced(engine: Any, prompt: list[int], forced: list[int]) -> np.ndarray:
    try:
        return np.stack(list(engine.forced_logits(prompt, forced)))
    finally:
        engine.close()


def test_decode_graph_gives_the_split_graphs_logits(tiny_dir: Path) -> None:
    """Decode steps on the decode graph (every matmul on the op) compute what the split graph's
    do (the op takes their decode rows too): with an f32 KV cache the logits are bit for bit the
    same (without decode_shared_expert, which the split graph has no form of: its own tests
    bound it). With the plugin's u8 KV cache, moving the state from the prefill model reads it as f32
    and quantises it again, which moves the logits by ~4e-7 of their scale (the op's own
    rounding is 2-3e-7): within 2e-6, same greedy tokens. Prefill runs on the main model, every
    decode step on the decode graph; the graph identity covers both graphs."""
    prompt, forced = list(range(1000, 1150)), list(range(2000, 2016))
    alone = {"decode_shared_expert": False}
    on = _cpu_engine(tiny_dir, True, kv_f32=True, kernels=alone)
    assert "decode_graph" in on.describe()["kernels"]
    off = _cpu_engine(tiny_dir, False, kv_f32=True)
    assert on.graph_hash != off.graph_hash
    decode = on._decode_request
    got = _forced(on, prompt, forced)
    assert on._calls[id(decode)] == len(forced) - 1  # every decode step ran there
    assert np.array_equal(got, _forced(off, prompt, forced))

    got = _forced(_cpu_engine(tiny_dir, True), prompt, forced)
    want = _forced(_cpu_engine(tiny_dir, False), prompt, forced)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_the_heads_argmax_is_the_engines_greedy_choice(tiny_dir: Path) -> None:
    """On the `cpu` profile every graph the engine runs gives the LM head's argmax
    (`greedy_token`): after each prefill chunk and decode step it is the argmax of the logits,
    and greedy generation, which takes it, gives numpy's tokens."""
    from tests.helpers import run_engine, tokens_of
    from worker.engine import EngineRequest, SamplingParams

    engine = _cpu_engine(tiny_dir, True)
    try:
        assert engine._greedy and engine._greedy == {id(r) for r in engine._requests()}
        engine._reset_state()
        prompt = np.arange(1000, 1150, dtype=np.int64)
        for start in range(0, prompt.size, 64):
            logits, top = engine._infer(prompt[start:start + 64], start)
            assert top == int(np.argmax(logits))
        for step in range(8):
            logits, top = engine._infer(np.array([top], np.int64), prompt.size + step)
            assert top == int(np.argmax(logits))
        engine._reset_state()

        def greedy(name: str) -> list[int]:
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            return tokens_of(run_engine(engine, EngineRequest(name, tuple(prompt.tolist()), params,
                                                              reuse_prefix=False)), name)

        taken = greedy("op")
        engine._greedy = set()  # numpy's argmax over the logits instead
        assert taken == greedy("numpy")
    finally:
        engine.close()


def test_decode_graph_runs_static_shapes(tiny_dir: Path) -> None:
    """The decode graph is pinned to one token (`q16_decode.pin_one_token`): every extension op,
    norm, projection and attention output has a static shape, and so has every state variable
    but for the KV caches' length (where the plugin keeps them; native_decode_attention's op
    keeps them outside the state); only mask and position plumbing stays dynamic. The
    decode graph's logits being the split graph's bit for bit (above) covers what the pinning
    must not change, the linear-attention states carried from step to step included."""
    import openvino as ov

    from iq36.profile import load
    from worker.engine.candidate import specialised_model

    _, _, decode = specialised_model(ov.Core(), tiny_dir, load("cpu"))

    def dynamic(node: Any) -> bool:
        return any(node.get_output_partial_shape(i).is_dynamic for i in range(node.get_output_size()))

    # the attention is the plugin's, or native_decode_attention's op where the plugin's cache is u8
    kinds = {"Q16Linear", "U4Experts", "GatedDeltaRule", "ScaledDotProductAttention", "DecodeAttention", "MatMul"}
    ops = [n for n in decode.get_ordered_ops() if n.get_type_name() in kinds]
    found = {n.get_type_name() for n in ops}
    assert found >= {"Q16Linear", "U4Experts", "GatedDeltaRule"}
    assert "ScaledDotProductAttention" in found or "DecodeAttention" in found
    # the one MatMul left dynamic is the rotary tables' position product (before their pin)
    assert [n.get_friendly_name() for n in ops if dynamic(n) and "rotary" not in n.get_friendly_name()] == []
    for variable in decode.get_variables():
        dims = list(variable.info.data_shape)
        assert dims[0].is_static and dims[0].get_length() == 1, variable.info.variable_id
        assert sum(d.is_dynamic for d in dims) == (1 if ".key." in variable.info.variable_id
                                                   or ".value." in variable.info.variable_id else 0)
    assert sum(map(dynamic, decode.get_ordered_ops())) < len(decode.get_ops()) // 10


def test_long_contexts_decode_on_the_main_model(tiny_dir: Path) -> None:
    """From `[prefill.long] from_tokens` on, decode stays where prefill ran (no state move of a
    long KV cache) when prefill ran on the main model; the logits are the same either way."""
    from iq36.profile import LongContextSection

    prompt, forced = list(range(1000, 1150)), list(range(2000, 2008))
    main_prefill = {"native_attention": False}  # no prefill graph
    on = _cpu_engine(tiny_dir, True, kernels=main_prefill, long=LongContextSection(from_tokens=100, chunk_tokens=32))
    decode = on._decode_request
    got = _forced(on, prompt, forced)
    assert on._calls.get(id(decode), 0) == 0
    off = _cpu_engine(tiny_dir, False, kernels=main_prefill, long=LongContextSection(from_tokens=100, chunk_tokens=32))
    assert np.array_equal(got, _forced(off, prompt, forced))


def test_long_contexts_decode_on_the_decode_graph_after_a_prefill_graph(tiny_dir: Path) -> None:
    """With a prefill graph (`native_attention`) the state moves after prefill whatever the
    context's length, so long contexts decode on the decode graph too, and the main model, which
    would never run, is not compiled; with an f32 KV cache the logits are bit for bit the main
    model's (without decode_shared_expert, as above)."""
    from iq36.profile import LongContextSection

    prompt, forced = list(range(1000, 1150)), list(range(2000, 2008))
    long = LongContextSection(from_tokens=100, chunk_tokens=32)
    on = _cpu_engine(tiny_dir, True, kv_f32=True, kernels={"decode_shared_expert": False}, long=long)
    assert "native_attention (prefill)" in on.describe()["kernels"]
    decode, prefill = on._decode_request, on._prefill_request
    assert on._request is prefill and on._compiled is on._prefill_compiled
    got = _forced(on, prompt, forced)
    assert on._calls[id(decode)] == len(forced) - 1
    assert on._calls[id(prefill)] == -(-len(prompt) // 32)
    off = _cpu_engine(tiny_dir, False, kv_f32=True, long=long)
    assert np.array_equal(got, _forced(off, prompt, forced))


def test_decode_graph_needs_q16_decode(tiny_dir: Path) -> None:
    import msgspec
    import openvino as ov

    from iq36.profile import load
    from worker.engine.candidate import specialised_model

    profile = load("cpu")
    profile = msgspec.structs.replace(profile, kernels={**profile.kernels, "q16_decode": False, "decode_graph": True})
    with pytest.raises(ValueError, match="turn q16_decode on"):
        specialised_model(ov.Core(), tiny_dir, profile)


def _specialised(model_dir: Path, precision: str, switch: str, on: bool) -> tuple[Any, list[str], Any]:
    """The `cpu` profile's specialised model and decode graph (and the rewrites applied), with the
    plugin's INFERENCE_PRECISION_HINT set to `precision` and kernel `switch` on or off."""
    import msgspec
    import openvino as ov

    from iq36.profile import load
    from worker.engine.candidate import specialised_model

    profile = load("cpu")
    properties = {**profile.engine.properties, "INFERENCE_PRECISION_HINT": precision}
    engine = msgspec.structs.replace(profile.engine, properties=properties)
    profile = msgspec.structs.replace(profile, engine=engine, kernels={**profile.kernels, switch: on})
    return specialised_model(ov.Core(), model_dir, profile)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_q16_bf16_switch_follows_the_plugin_precision(tiny_dir: Path, precision: str) -> None:
    """`q16_bf16` drops the activations' residual in every Q16Linear and U4Experts op of the main
    model and of the decode graph only where the plugin runs the model in bf16 (the profile's
    INFERENCE_PRECISION_HINT here; the rewrite does not need a bf16 CPU); the engine reports it
    then, and the graph identity changes with it."""
    from kernels.graph_hash import structure_hash

    def specialised(switch: bool) -> tuple[Any, list[str], Any]:
        return _specialised(tiny_dir, precision, "q16_bf16", switch)

    model, applied, decode = specialised(True)
    residual = [n.get_attributes()[q16_decode.RESIDUAL] for m in (model, decode) for n in m.get_ops()
                if n.get_type_name() in ("Q16Linear", "U4Experts")]
    want = precision == "bf16"
    assert residual and all(r == (not want) for r in residual)
    assert ("q16_bf16" in applied) == want
    off, off_applied, off_decode = specialised(False)
    assert "q16_bf16" not in off_applied
    assert (structure_hash(model, decode) != structure_hash(off, off_decode)) == want


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_q16_tail_tiles_switch_follows_the_plugin_precision(tiny_dir: Path, precision: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`q16_tail_tiles` sends a chunk's last rows past whole row blocks to the op up to TAIL_ROWS
    of them, on its tiles (`tile_rows`), only where the plugin runs the model in bf16 and the CPU
    has AVX512-BF16; the decode graph's ops never take the tiles. The engine reports it then, and
    the graph identity changes with it. Every dense matmul rewritten (dev-tiny's are all below
    MIN_BYTES)."""
    from kernels.graph_hash import structure_hash

    apply = q16_decode.apply
    monkeypatch.setattr(q16_decode, "apply", lambda model, **kw: apply(model, **{**kw, "min_bytes": 0}))

    def specialised(switch: bool) -> tuple[Any, list[str], Any]:
        return _specialised(tiny_dir, precision, "q16_tail_tiles", switch)

    def tile_rows(model: Any) -> list[int]:
        return [n.get_attributes().get(q16_decode.TILE_ROWS, 0) for n in model.get_ops()
                if n.get_type_name() == "Q16Linear" and n.get_attributes()["nibbles"]]

    model, applied, decode = specialised(True)
    want = precision == "bf16" and native.bf16_supported()
    assert tile_rows(model) and set(tile_rows(model)) == {q16_decode.TILE_FROM if want else 0}
    assert set(tile_rows(decode)) == {0}
    assert ("q16_tail_tiles" in applied) == want
    off, off_applied, off_decode = specialised(False)
    assert "q16_tail_tiles" not in off_applied and set(tile_rows(off)) == {0}
    assert (structure_hash(model, decode) != structure_hash(off, off_decode)) == want
