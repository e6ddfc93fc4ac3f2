"""iq36's native extension ops (kernels/native) and the kernels built on them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import last_token_logits, lm_head_u8, native
from tests.helpers import REFERENCE, kernel_greedy
from worker.reference import stateful_feed

pytestmark = pytest.mark.skipif(not native.cpu_supported(), reason=f"needs a CPU with {native.CPU_FLAGS}")


def _u8_linear(x: np.ndarray, w: np.ndarray, zp: np.ndarray, scale: np.ndarray) -> np.ndarray:
    import openvino as ov
    from openvino import opset15 as op

    core = ov.Core()
    native.register(core)
    p = op.parameter(list(x.shape), np.float32, name="x")
    y = native.factory().create("U8Linear", [p, op.constant(w), op.constant(zp), op.constant(scale)])
    request = core.compile_model(ov.Model([y], [p]), "CPU").create_infer_request()
    return np.array(request.infer({"x": x})[0])


@pytest.mark.parametrize("shape", [(1, 2048), (3, 40), (2, 1, 17)])
@pytest.mark.parametrize("rows", [1, 7, 64, 131])
def test_u8_linear_is_the_decompressed_matmul(shape: tuple[int, ...], rows: int) -> None:
    """Every row (blocks of 4 and the remainder) and every column (16-wide steps and the tail),
    any leading dims, f16 scales: y = ((w - zp) * scale) @ x, to f32 rounding."""
    rng = np.random.default_rng(rows * shape[-1])
    k = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    zp = rng.integers(0, 256, (rows, 1), dtype=np.uint8)
    scale = (rng.random((rows, 1)) * 0.02 + 0.001).astype(np.float16)
    expected = x.astype(np.float64) @ ((w.astype(np.float64) - zp) * scale.astype(np.float64)).T
    got = _u8_linear(x, w, zp, scale)
    assert got.shape == (*shape[:-1], rows)
    assert np.abs(got - expected).max() <= 1e-5 * max(1.0, float(np.abs(expected).max()))


def test_u8_linear_rejects_mismatched_inputs() -> None:
    from openvino import opset15 as op

    p = op.parameter([1, 8], np.float32, name="x")
    w = op.constant(np.zeros((4, 9), np.uint8))
    z, s = op.constant(np.zeros((4, 1), np.uint8)), op.constant(np.ones((4, 1), np.float16))
    with pytest.raises(RuntimeError, match="K"):
        native.factory().create("U8Linear", [p, w, z, s])
    with pytest.raises(RuntimeError, match="u8"):
        native.factory().create("U8Linear", [p, op.constant(np.zeros((4, 8), np.int8)), z, s])


def _u4(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[object, np.ndarray]:
    """A u4 constant of random values, and the values."""
    import openvino as ov
    from openvino import opset15 as op

    values = rng.integers(0, 16, shape, dtype=np.uint8)
    tensor = ov.Tensor(ov.Type.u4, list(shape))
    flat = values.ravel()
    tensor.data[:] = flat[0::2] | (flat[1::2] << 4)  # two per byte, the first in the low nibble
    return op.constant(tensor), values


def _matrix(rng: np.random.Generator, experts: int, out: int, inp: int, group: int,
            scale_type: type) -> tuple[list, np.ndarray]:
    from openvino import opset15 as op

    w, q = _u4(rng, (experts, out, inp // group, group))
    z, zq = _u4(rng, (experts, out, inp // group, 1))
    s = (rng.random((experts, out, inp // group, 1)) * 0.05 + 0.01).astype(scale_type)
    dense = ((q.astype(np.float64) - zq) * s.astype(np.float64)).reshape(experts, out, inp)
    return [w, z, op.constant(s)], dense


@pytest.mark.parametrize(("skip", "idx_type", "scale_type"), [(0, np.int32, np.float16), (1, np.int64, np.float32),
                                                               (4, np.int32, np.float32), (8, np.int32, np.float16),
                                                               (9, np.int64, np.float16)])
@pytest.mark.parametrize("nibbles", [False, True], ids=["u8", "packed-u4"])
def test_u4_experts_is_the_moe_block(skip: int, idx_type: type, scale_type: type, nibbles: bool) -> None:
    """Rows from `skip` on: sum_j w[t, j] * down_e(silu(gate_e x) * up_e x); rows before: zero.
    Experts with 0, 1, 2 (`direct`), 3 and more rows (tiles), one expert never routed; skip 8: one
    row, every expert `direct` (decode). Weights as the plugin leaves a u4 constant that only the
    op reads (widened to u8) and as q16_decode passes them (the packed bytes, `nibbles`)."""
    rng = np.random.default_rng(skip)
    tokens, k = 9, 3
    routed = [0, 1, 2, 4, 5]  # expert 3: no row
    idx = np.stack([rng.permutation(routed)[:k] for _ in range(tokens)]).astype(idx_type)
    idx[:, 0] = [0] * 5 + [1] * 3 + [2]  # 0: >3 rows, 1: 3 rows, 2: 1 row (+ what the rest adds)
    _check_u4_experts(rng, idx, skip, scale_type, experts=6, hidden=64, width=32, groups=(32, 16), nibbles=nibbles)


@pytest.mark.parametrize("skip", [0, 3])
@pytest.mark.parametrize("nibbles", [False, True], ids=["u8", "packed-u4"])
def test_u4_experts_walks_every_tile_and_tail(skip: int, nibbles: bool) -> None:
    """Shapes that leave a remainder everywhere: an expert with 37 rows (token vectors 2 + 2 + 1,
    3 padded columns), 100 gate/up rows (tasks of 64 + 36), 612 outputs (64-column tasks and a
    36-column tail; 6-row kernels and a 2-row one), 612 inputs in groups of 36 (whole rows per
    pass where a task's tile fits L2, else slices 252, 252, 108: `test_u4_experts_in_slices`; a
    transpose tail of 4)."""
    rng = np.random.default_rng(100 + skip)
    tokens, k, experts = 40, 3, 5
    idx = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
    idx[:37, 0] = 0
    idx[:37, 1:] = np.where(idx[:37, 1:] == 0, 4, idx[:37, 1:])
    idx[37:, :] = [1, 2, 3]
    _check_u4_experts(rng, idx, skip, np.float16, experts=experts, hidden=612, width=100, groups=(36, 20),
                      nibbles=nibbles)


@pytest.mark.parametrize("skip", [0, 5])
@pytest.mark.parametrize("nibbles", [False, True], ids=["u8", "packed-u4"])
def test_u4_experts_dot_form_tails(skip: int, nibbles: bool) -> None:
    """The f32 tiles on packed u4 weights in groups of a multiple of 16 (split input order): an
    expert's tokens past whole vectors of 8, when at most 4, in the dot form (3 and 4 tokens:
    only dots; 9, 12: a vector and 1, 4 dots; 13: a padded second vector; 8, 20: whole vectors
    and none, 4 dots), over whole rows of 544 inputs (or three slices, 256 + 256 + 32:
    `test_u4_experts_in_slices`) and down's 48. The u8 weights keep the packed order and padded
    vectors: the same sums either way."""
    rng = np.random.default_rng(200 + skip)
    counts = [3, 4, 9, 12, 13, 8, 20, 1, 2]
    experts = len(counts)
    idx = rng.permutation(np.repeat(np.arange(experts), counts))[:, None].astype(np.int32)
    _check_u4_experts(rng, idx, skip, np.float16, experts=experts, hidden=544, width=48, groups=(32, 16),
                      nibbles=nibbles)


def _bf16(a: np.ndarray) -> np.ndarray:
    """`a` rounded to the nearest bf16 (ties to even), as float64."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _int8(a: np.ndarray) -> np.ndarray:
    """`a` (f32, a multiple of 32 values) quantized to int8 per 32 values as the op's int8 tiles do
    (scale max |a| / 127, f32 arithmetic, ties to even), dequantized, as float64."""
    a = np.asarray(a, np.float32).reshape(-1, 32)
    amax = np.abs(a).max(axis=1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.clip(np.rint(a * inv), -127, 127)
    return ((amax / np.float32(127)).astype(np.float64) * q).ravel()


def _check_u4_experts(rng: np.random.Generator, idx: np.ndarray, skip: int, scale_type: type, experts: int,
                      hidden: int, width: int, groups: tuple[int, int], q16_rows: int = 0,
                      tol: float = 1e-5, nibbles: bool = False, bf16: bool = False,
                      round_act: bool | None = None, residual: bool = True, int8: bool = False,
                      quantize: bool = True, few_int8: bool = True) -> np.ndarray:
    """Runs the op (with the `q16_rows` attribute; with `nibbles`, on the weights' packed bytes
    typed u8, as q16_decode hands them over) against float64 within `tol` of the scale; returns
    its output. `bf16`: the `bf16` attribute, with inputs that are bf16 values (as the plugin's
    bf16 nodes hand them over); the reference rounds the act rows of the experts with more than
    two rows (the tiled ones) to bf16, as the op does (unless `round_act` is False). `residual`:
    the attribute (False: the q16 rows' activations without their residual term). `int8`: the
    attribute too (with `bf16`); the reference quantizes x and the act rows of the experts of at
    least 3 rows (the row form's up to 10, the lane form's from 11; with `few_int8` False, as with
    IQ36_INT8_ROW_TOKENS=0, only the lane form's) to int8 per 32 inputs, as the op does (unless
    `quantize` is False), and allows a few tokens' rows a quantization step apart."""
    import openvino as ov
    from openvino import opset15 as op

    tokens, k = idx.shape
    gate, g = _matrix(rng, experts, width, hidden, groups[0], scale_type)
    up, u = _matrix(rng, experts, width, hidden, groups[0], scale_type)
    down, d = _matrix(rng, experts, hidden, width, groups[1], scale_type)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    if bf16:
        x = _bf16(x).astype(np.float32)
    weights = rng.random((tokens, k)).astype(np.float32)
    idx_type = idx.dtype.type

    px = op.parameter([-1, hidden], np.float32, name="x")
    pidx = op.parameter([-1, k], idx_type, name="idx")
    pw = op.parameter([-1, k], np.float32, name="weights")
    skip_c = op.constant(np.array([skip], np.int64))
    if nibbles:
        from kernels.q16_decode import _as_bytes

        for m in (gate, up, down):
            m[0] = _as_bytes(m[0].output(0)).get_node()
    attributes = {"q16_rows": q16_rows, "nibbles": nibbles, "bf16": bf16, "residual": residual, "int8": int8}
    node = native.factory().create("U4Experts", [px, pidx, pw, skip_c, *gate, *up, *down], attributes)
    core = ov.Core()
    request = core.compile_model(ov.Model([node], [px, pidx, pw]), "CPU").create_infer_request()
    got = np.array(request.infer({"x": x, "idx": idx, "weights": weights})[0])

    expected = np.zeros((tokens, hidden))
    xd = x.astype(np.float64)
    counts = np.bincount(idx[skip:].ravel(), minlength=experts)
    tiled = counts > 2
    lanes8 = (counts >= (3 if few_int8 else 11)) if int8 and quantize else np.zeros(experts, bool)
    for t in range(skip, tokens):
        for j in range(k):
            e = int(idx[t, j])
            xt = _int8(x[t]) if lanes8[e] else xd[t]
            a, b = g[e] @ xt, u[e] @ xt
            act = a / (1 + np.exp(-a)) * b
            rounded = (bf16 if round_act is None else round_act) and tiled[e]
            if lanes8[e]:
                act = _int8(act.astype(np.float32))
            elif rounded:
                act = _bf16(act)
            expected[t] += weights[t, j] * (d[e] @ act)
    assert got.shape == (tokens, hidden)
    assert not got[:skip].any()
    err = np.abs(got - expected).max(axis=1) / max(1.0, float(np.abs(expected).max()))
    if lanes8.any():
        # an act value within f32 rounding of a quantization boundary may land one step apart (the
        # op's f32 sums against float64): a few tokens' rows, each within one step's weight
        assert (err > tol).sum() <= max(1, tokens // 20) and err.max() <= 2e-3, np.sort(err)[-5:]
    else:
        assert err.max() <= tol
    return got


@pytest.mark.skipif(not native.bf16_supported(), reason=f"needs a CPU with {', '.join(native.BF16_CPU_FLAGS)}")
@pytest.mark.parametrize("nibbles", [False, True], ids=["u8", "packed-u4"])
def test_u4_experts_bf16_tiles(nibbles: bool) -> None:
    """The `bf16` tiles: (q - z) exact in bf16, the group scale on the group's f32 sum, so the
    result is the float64 block with the tiled experts' act rows rounded to bf16 (measured
    ~1.5e-6 of the scale, against ~1.7e-3 without that rounding in the reference); the shapes
    of `test_u4_experts_walks_every_tile_and_tail` (remainders in every loop), and the one-
    and two-row experts on their f32 paths."""
    rng = np.random.default_rng(7)
    tokens, k, experts = 40, 3, 6
    idx = np.stack([rng.permutation(experts - 1)[:k] for _ in range(tokens)]).astype(np.int32)
    idx[:37, 0] = 0
    idx[:37, 1:] = np.where(idx[:37, 1:] == 0, 4, idx[:37, 1:])
    idx[37:, :] = [1, 2, 3]
    idx[39, 2] = 5  # a one-row expert
    _check_u4_experts(rng, idx, 1, np.float16, experts=experts, hidden=612, width=100, groups=(36, 20),
                      nibbles=nibbles, bf16=True)
    with pytest.raises(AssertionError):  # the bf16 path really ran: without the act rounding it is 1e-3 off
        _check_u4_experts(np.random.default_rng(7), idx, 1, np.float16, experts=experts, hidden=612, width=100,
                          groups=(36, 20), nibbles=nibbles, bf16=True, round_act=False)


@pytest.mark.skipif(not native.bf16_supported(), reason=f"needs a CPU with {', '.join(native.BF16_CPU_FLAGS)}")
@pytest.mark.parametrize("nibbles", [False, True], ids=["u8", "packed-u4"])
def test_u4_experts_bf16_few_tokens(nibbles: bool) -> None:
    """An expert with fewer tokens than a vector of 16: up to `kDotTokens` (10) of them as dot
    products over the same tile, more as a padded vector; a longer expert's tokens past whole
    vectors likewise. Experts of 3, 4, 5 and 10 tokens (the dot form: register blocks of 3, then
    1 and 2), 11 (padded), 16 (a vector), 17 and 26 (a vector, then 1 and 10 dot-form tokens), 43
    (two vectors and a padded one); 102 act rows (4-row blocks and a 2-row tail), groups of 36
    and 34 inputs (a masked tail of input pairs in every group). Against float64, as
    `test_u4_experts_bf16_tiles`."""
    rng = np.random.default_rng(11)
    counts = [3, 4, 5, 10, 11, 16, 17, 26, 43, 1]  # the last: one row, `direct`
    idx = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)[:, None]
    _check_u4_experts(rng, idx, 0, np.float16, experts=len(counts), hidden=612, width=102, groups=(36, 34),
                      nibbles=nibbles, bf16=True)


@pytest.mark.skipif(not native.bf16_supported(), reason=f"needs a CPU with {', '.join(native.BF16_CPU_FLAGS)}")
@pytest.mark.parametrize("nibbles", [False, True], ids=["u8", "packed-u4"])
def test_u4_experts_bf16_groups_of_128(nibbles: bool) -> None:
    """The real model's groups of 128 inputs (gate, up), whose packed nibbles decompress 64 at a
    time, and groups of 96 for down (one 64-weight step, then one of 32); the experts of
    `test_u4_experts_bf16_few_tokens` (dot form, padded vectors, whole vectors). Against float64."""
    rng = np.random.default_rng(13)
    counts = [3, 10, 11, 17, 40, 1]
    idx = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)[:, None]
    _check_u4_experts(rng, idx, 0, np.float16, experts=len(counts), hidden=640, width=192, groups=(128, 96),
                      nibbles=nibbles, bf16=True)


@pytest.mark.skipif(not native.int8_supported(),
                    reason=f"needs a CPU with {', '.join(native.INT8_CPU_FLAGS)} and "
                           f"{native.BF16_CPU_FLAGS[-1]}, without AMX (the op keeps its AMX tiles there)")
@pytest.mark.parametrize("groups", [(128, 96), (32, 64)], ids=["g128-96", "g32-64"])
@pytest.mark.parametrize("nibbles", [False, True], ids=["u8", "packed-u4"])
def test_u4_experts_int8_tiles(groups: tuple[int, int], nibbles: bool) -> None:
    """The `int8` tiles: experts of at least 3 tokens take x and their act rows as int8 per 32
    inputs and the weights q as they are (packed u4 read in place, u8 through a tile); the integer
    sums are exact, so the result is the float64 block on the dequantized activations. Experts of
    11, 15 (one padded vector), 16, 17 (a vector of 16 and a padded one of 8, in one pass), 24
    (one of 16 and one of 8), 40 (two and one of 8 in one pass), 43 (three: the 2 x 3 register
    block), 56 (a pair, then one and one of 8), 70 (a pair, then two and one of 8) tokens in the
    lane form; 3 and 10 in the row form (packed u4; u8 weights: a padded vector), 1 and 2
    (`direct`); 192 act rows (tasks of 128 and 64); groups of 128 and 96, 32 and 64."""
    rng = np.random.default_rng(17)
    counts = [3, 10, 11, 15, 16, 17, 24, 40, 43, 56, 70, 1, 2]
    idx = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)[:, None]
    check = functools.partial(_check_u4_experts, idx=idx, skip=0, scale_type=np.float16, experts=len(counts),
                              hidden=640, width=192, groups=groups, nibbles=nibbles, bf16=True, int8=True)
    check(np.random.default_rng(17))
    with pytest.raises(AssertionError):  # the int8 path really ran: without the quantization the reference is off
        check(np.random.default_rng(17), quantize=False)



_INT8_ROW_CHECKS = """
import os
import sys
import numpy as np
from tests import test_native as t

few = os.environ.get("IQ36_INT8_ROW_TOKENS") != "0"
counts = [3, 5, 8, 10, 11, 13, 16, 17, 24, 33, 43, 56, 70, 1, 2]
rng = np.random.default_rng(29)
idx = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)[:, None]
out = []
for groups in ((128, 96), (32, 64)):
    for nibbles in (False, True):
        out.append(t._check_u4_experts(np.random.default_rng(7), idx, 0, np.float16, experts=len(counts), hidden=640,
                                       width=192, groups=groups, nibbles=nibbles, bf16=True, int8=True, few_int8=few))
np.save(sys.argv[1], np.concatenate([o.ravel() for o in out]))
print("checked")
"""


@pytest.mark.skipif(not native.int8_supported(),
                    reason=f"needs a CPU with {', '.join(native.INT8_CPU_FLAGS)} and "
                           f"{native.BF16_CPU_FLAGS[-1]}, without AMX (the op keeps its AMX tiles there)")
def test_u4_experts_int8_row_form(tmp_path: Path) -> None:
    """The int8 row form (weight rows as the lanes, each token's inputs broadcast): by default the
    experts of 3-10 tokens, which otherwise take the bf16 dot form, take it on int8 activations;
    with IQ36_INT8_ROW_TOKENS=80 every expert here up to 80 tokens does, including those the lane
    form takes by default (11-70 tokens: a padded vector, vectors of 16 and one of 8, the last in
    the pass of the last one or two of 16). Each
    against float64 (`_check_u4_experts`, the reference quantizing as the op does), packed u4 and
    u8 weights (the row form reads packed rows only: u8 keeps the lane form), two group shapes.
    The row and lane forms compute the same int32 sums and the same f32 operations per (row,
    token): 80 gives the default's bits. With 0 the few-token experts take the bf16 dot form
    again: other bits, and the reference's int8 rule only from 11 tokens."""
    got = _run_checks(tmp_path, _INT8_ROW_CHECKS, "IQ36_INT8_ROW_TOKENS", ("", "80", "0"))
    np.testing.assert_array_equal(got[""], got["80"])
    assert not np.array_equal(got[""], got["0"])


def _run_checks(tmp_path: Path, script: str, name: str, values: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Runs `script` (a check script that saves its outputs to argv[1]) once per value of the
    environment setting `name` (a process reads these once), each in a fresh process; returns
    the outputs by value."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    got = {}
    for value in values:
        env = {k: v for k, v in os.environ.items() if k != name}
        if value:
            env[name] = value
        out = tmp_path / f"{name}-{value or 'unset'}.npy"
        done = subprocess.run([sys.executable, "-c", script, str(out)], cwd=root, capture_output=True, text=True,
                              env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        got[value] = np.load(out)
    return got


_AMX_CHECKS = """
import sys
import numpy as np
from tests import test_native as t

counts = [3, 11, 17, 40, 70, 1]  # dot form; one padded vector; 2, 3 (a pair and one), 5 vectors; `direct`
rng = np.random.default_rng(23)
idx = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)[:, None]
out = []
for nibbles in (False, True):
    # gate/up in groups of 32 (AMX): tasks of 128 and 40 rows (two 16-row blocks, then 8 rows on the
    # vector tiles); down in groups of 56 (vector tiles only). tol 1e-4: an act value within an f32
    # ulp of a bf16 rounding boundary rounds the other way than float64's (both paths; ~3e-5 here)
    out.append(t._check_u4_experts(np.random.default_rng(1), idx, 0, np.float16, experts=len(counts), hidden=544,
                                   width=168, groups=(32, 56), nibbles=nibbles, bf16=True, tol=1e-4))
    # down in groups of 64 (AMX): 552 output rows, tasks of 128 and a 40-row one; gate/up in 24s
    out.append(t._check_u4_experts(np.random.default_rng(2), idx, 0, np.float16, experts=len(counts), hidden=552,
                                   width=192, groups=(24, 64), nibbles=nibbles, bf16=True, tol=1e-4))
    # both stages on AMX (groups of 32 and 64): the 3-token expert takes a padded vector of 16
    # tokens there instead of the dot form
    out.append(t._check_u4_experts(np.random.default_rng(3), idx, 0, np.float16, experts=len(counts), hidden=544,
                                   width=192, groups=(32, 64), nibbles=nibbles, bf16=True, tol=1e-4))
np.save(sys.argv[1], np.concatenate([o.ravel() for o in out]))
print("checked")
"""


@pytest.mark.skipif(not native.bf16_supported(), reason=f"needs a CPU with {', '.join(native.BF16_CPU_FLAGS)}")
def test_u4_experts_amx_tiles(tmp_path: Path) -> None:
    """The bf16 lane form on AMX tiles (u4_experts_amx.hpp) where the CPU has AMX-BF16, and with
    IQ36_AMX=0 on the vector tiles: both against float64 as `test_u4_experts_bf16_tiles`, for
    groups of 32 and 64 inputs in stage 1 and in stage 2, 16-row blocks in pairs and alone, rows
    past the last whole block, token vectors in pairs and alone, and where both stages take the
    tiles a 3-token expert as a padded vector (not the dot form). With AMX the two outputs differ
    (the order of the f32 sums), which shows the tiles ran; without it they are the same bits."""
    got = _run_checks(tmp_path, _AMX_CHECKS, "IQ36_AMX", ("0", "1"))
    if native.amx_supported():
        assert not np.array_equal(got["0"], got["1"])
    else:
        np.testing.assert_array_equal(got["0"], got["1"])


_SLICE_CHECKS = """
import sys
import numpy as np
from kernels import native
from tests import test_native as t

out = []
for nibbles in (False, True):
    for bf16 in (False, True) if native.bf16_supported() else (False,):
        rng = np.random.default_rng(31)
        idx = np.stack([rng.permutation(5)[:3] for _ in range(40)]).astype(np.int32)
        idx[:37, 0] = 0
        idx[:37, 1:] = np.where(idx[:37, 1:] == 0, 4, idx[:37, 1:])
        idx[37:, :] = [1, 2, 3]
        out.append(t._check_u4_experts(rng, idx, 3, np.float16, experts=5, hidden=612, width=100, groups=(36, 20),
                                       nibbles=nibbles, bf16=bf16))
        counts = [3, 4, 9, 12, 13, 8, 20, 1, 2]  # f32: dot-form tails; bf16: the dot form and vectors
        idx = rng.permutation(np.repeat(np.arange(len(counts)), counts))[:, None].astype(np.int32)
        # bf16 tol 1e-4: an act value within an f32 ulp of a bf16 rounding boundary rounds the other
        # way than float64's (as in _AMX_CHECKS; ~2e-5 here, whole rows or slices alike)
        out.append(t._check_u4_experts(rng, idx, 0, np.float16, experts=len(counts), hidden=640, width=192,
                                       groups=(128, 64), nibbles=nibbles, bf16=bf16, tol=1e-4 if bf16 else 1e-5))
np.save(sys.argv[1], np.concatenate([o.ravel() for o in out]))
print("checked")
"""


def test_u4_experts_in_slices(tmp_path: Path) -> None:
    """A task's tiles hold whole weight rows where they fit the core's L2 (every shape of these
    tests, on any machine with 256 KB of it), else about 256 inputs per pass (the real model's
    2048-input rows on f32 tiles with a 512 KB L2). `IQ36_SLICE_INPUTS=256` forces the slices:
    612 inputs in groups of 36 as 252 + 252 + 108, 640 in groups of 128 as 256 + 256 + 128, the
    f32 and bf16 tiles, packed and u8 weights, the dot forms; against float64 as the other
    U4Experts tests, and not the same bits as whole rows (the f32 sums run in another order:
    the setting was read)."""
    got = _run_checks(tmp_path, _SLICE_CHECKS, "IQ36_SLICE_INPUTS", ("", "256"))
    assert not np.array_equal(got[""], got["256"])


_FUSED_CHECKS = """
import sys
import numpy as np
from tests import test_native as t

out = []
for nibbles in (False, True):
    rng = np.random.default_rng(37)
    # whole-dot experts of 3 to 10 tokens (one pass over the weights up to 5, then two), beside a
    # padded vector (11), a vector with a dot-form tail (17, 26: tiles) and `direct` (1, 2)
    counts = [3, 4, 5, 6, 7, 8, 9, 10, 11, 17, 26, 1, 2]
    idx = rng.permutation(np.repeat(np.arange(len(counts)), counts))[:, None].astype(np.int32)
    # gate/up in groups of 128, down in groups of 256 (two 64-byte loads per group)
    out.append(t._check_u4_experts(rng, idx, 0, np.float16, experts=len(counts), hidden=640, width=256,
                                   groups=(128, 256), nibbles=nibbles, bf16=True, tol=1e-4))
    # gate/up in groups of 256, down in groups of 128; top-2 routing, f32 scales
    idx = np.stack([rng.permutation(12)[:2] for _ in range(30)]).astype(np.int32)
    out.append(t._check_u4_experts(rng, idx, 0, np.float32, experts=12, hidden=512, width=384, groups=(256, 128),
                                   nibbles=nibbles, bf16=True, tol=1e-4))
np.save(sys.argv[1], np.concatenate([o.ravel() for o in out]))
print("checked")
"""


@pytest.mark.skipif(not native.bf16_supported(), reason=f"needs a CPU with {', '.join(native.BF16_CPU_FLAGS)}")
def test_u4_experts_bf16_fused_dots(tmp_path: Path) -> None:
    """The bf16 dot form without a tile (`fused_dots`): an expert whose tokens all take the dot
    form multiplies each weight row's packed bytes as it widens them, against its token rows in
    the fused order (stage 1: x's rows; stage 2: the act rows). Experts of 3 to 10 tokens beside
    the tiled forms, groups of 128 and 256 in both stages, against float64, on packed weights (u8
    weights take the tiles either way); with IQ36_FUSED_DOTS=0 (the tiles) likewise, and not the
    same bits as the fused form (its f32 sums run in another order: the setting was read and the
    form ran)."""
    got = _run_checks(tmp_path, _FUSED_CHECKS, "IQ36_FUSED_DOTS", ("1", "0"))
    assert not np.array_equal(got["1"], got["0"])


_POISONED_CHECKS = """
import numpy as np
from kernels import native
from tests import test_native as t

rng = np.random.default_rng(5)
idx = np.stack([rng.permutation(5)[:3] for _ in range(40)]).astype(np.int32)
idx[:37, 0] = 0
idx[:37, 1:] = np.where(idx[:37, 1:] == 0, 4, idx[:37, 1:])
idx[37:, :] = [1, 2, 3]
for nibbles in (False, True):
    for bf16 in (False, True) if native.bf16_supported() else (False,):
        t._check_u4_experts(rng, idx, 2, np.float16, experts=5, hidden=612, width=100, groups=(36, 20),
                            nibbles=nibbles, bf16=bf16)
        # then fewer rows (the buffers are larger than the call needs), then decode rows
        t._check_u4_experts(rng, idx[:9], 0, np.float16, experts=5, hidden=612, width=100, groups=(36, 20),
                            nibbles=nibbles, bf16=bf16)
        t._check_u4_experts(rng, idx[:1], 0, np.float32, experts=5, hidden=512, width=256, groups=(128, 128),
                            q16_rows=4, nibbles=nibbles, bf16=bf16)
if native.int8_supported():  # the int8 tiles' buffers (x and the act columns as int8, their scales and sums)
    counts = [3, 10, 11, 15, 16, 17, 43, 1, 2]
    idx8 = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)[:, None]
    for nibbles in (False, True):
        for rows in (len(idx8), 40):
            t._check_u4_experts(rng, idx8[:rows], 0, np.float16, experts=len(counts), hidden=640, width=192,
                                groups=(128, 96), nibbles=nibbles, bf16=True, int8=True)
print("checked")
"""


def test_u4_experts_reads_only_what_it_wrote() -> None:
    """U4Experts keeps its act buffers between calls (`Scratch`, kernels/native/common.hpp). With
    IQ36_NATIVE_POISON=1 every such buffer is all-ones bytes (NaN) at each call, so an element
    read before the call wrote it puts NaN in the output and fails the float64 comparison: f32,
    bf16 and int8 tiles, packed and u8 weights, a large call then smaller ones (stale larger
    buffers), then decode rows."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", _POISONED_CHECKS], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "IQ36_NATIVE_POISON": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("checked")


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_experts_bf16_switch_follows_the_plugin_precision(tiny_dir: Path, precision: str) -> None:
    """`experts_bf16` marks the U4Experts ops only for a model the plugin runs in bf16, on a CPU
    with AVX512-BF16; otherwise the engine does not report it and the ops keep f32 tiles."""
    import msgspec
    import openvino as ov

    from iq36.profile import load
    from worker.engine.candidate import specialised_model

    profile = load("cpu")
    properties = {**profile.engine.properties, "INFERENCE_PRECISION_HINT": precision}
    profile = msgspec.structs.replace(profile, engine=msgspec.structs.replace(profile.engine, properties=properties),
                                      kernels={**profile.kernels, "experts_bf16": True})
    model, applied, _ = specialised_model(ov.Core(), tiny_dir, profile)
    marked = [n.get_attributes()["bf16"] for n in model.get_ops() if n.get_type_name() == "U4Experts"]
    want = precision == "bf16" and native.bf16_supported()
    assert marked and all(m == want for m in marked)
    assert ("experts_bf16" in applied) == want


@pytest.mark.parametrize(("precision", "group"), [("bf16", 32), ("bf16", 0), ("bf16", 64), ("f32", 32)])
def test_experts_int8_switch_follows_the_plugin_quantization(tiny_dir: Path, precision: str, group: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`experts_int8` marks the U4Experts ops (and q16_tail_tiles' Q16Linear ops) only with the
    bf16 tiles and where the plugin quantizes its own matmuls' activations per 32 inputs
    (DYNAMIC_QUANTIZATION_GROUP_SIZE 32), on a CPU with AVX512-VNNI and no AMX; otherwise the
    engine does not report it."""
    import msgspec
    import openvino as ov

    from iq36.profile import load
    from kernels import q16_decode
    from worker.engine.candidate import specialised_model

    apply = q16_decode.apply  # every dense matmul rewritten (dev-tiny's are all below MIN_BYTES)
    monkeypatch.setattr(q16_decode, "apply", lambda model, **kw: apply(model, **{**kw, "min_bytes": 0}))
    profile = load("cpu")
    properties = {**profile.engine.properties, "INFERENCE_PRECISION_HINT": precision,
                  "DYNAMIC_QUANTIZATION_GROUP_SIZE": group}
    profile = msgspec.structs.replace(profile, engine=msgspec.structs.replace(profile.engine, properties=properties),
                                      kernels={**profile.kernels, "experts_bf16": True, "experts_int8": True})
    model, applied, _ = specialised_model(ov.Core(), tiny_dir, profile)
    marked = [n.get_attributes()["int8"] for n in model.get_ops() if n.get_type_name() == "U4Experts"]
    want = precision == "bf16" and group == 32 and native.int8_supported()
    assert marked and all(m == want for m in marked)
    assert ("experts_int8" in applied) == want
    # q16_tail_tiles' rows on the same tiles (where the tail tiles apply at all: bf16)
    tails = [n.get_attributes()["tile_int8"] for n in model.get_ops()
             if n.get_type_name() == "Q16Linear" and n.get_attributes()["tile_rows"] > 0]
    assert bool(tails) == (precision == "bf16" and native.bf16_supported())
    assert all(t == want for t in tails)


def _kld(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row of logits."""

    def logp(v: np.ndarray) -> np.ndarray:
        v = v - v.max(axis=-1, keepdims=True)
        return v - np.log(np.exp(v).sum(axis=-1, keepdims=True))

    return (np.exp(logp(p)) * (logp(p) - logp(q))).sum(axis=-1)


@pytest.mark.skipif(not native.int8_supported(),
                    reason=f"needs a CPU with {', '.join(native.INT8_CPU_FLAGS)} and "
                           f"{native.BF16_CPU_FLAGS[-1]}, without AMX")
@pytest.mark.parametrize("chunks", [[256, 256], [40]], ids=["2x256", "40"])
def test_experts_int8_moves_the_logits_less_than_the_plugins_own_quantization(tiny_dir: Path,
                                                                               chunks: list[int]) -> None:
    """The int8 tiles' budget is the plugin's own: in its f32 reference mode, the routed experts on
    the int8 tiles move every position's next-token distribution (KL from the plain graph) no
    further, in median and at most, than the plugin's dynamic quantization per 32 inputs moves the
    plain graph (what it does to its compressed matmuls where it runs bf16). Measured on dev-tiny:
    int8 tiles median 3-4e-6, max 0.7-4.3e-3; the plugin's median 7e-6 to 2e-5, max 2.3-5.9e-3."""
    from kernels import native_experts

    plain = _experts_logits(tiny_dir, False, chunks)
    quantized = _experts_logits(tiny_dir, False, chunks,
                                properties={"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32})
    tiles = _experts_logits(tiny_dir, True, chunks,
                            then=lambda m: (native_experts.bf16_tiles(m), native_experts.int8_tiles(m)))
    plugin, ours = _kld(plain, quantized), _kld(plain, tiles)
    assert plugin.max() > 0 and ours.max() > 0  # both really quantized
    assert np.median(ours) <= np.median(plugin), (np.median(ours), np.median(plugin))
    assert ours.max() <= plugin.max(), (ours.max(), plugin.max())


def test_u4_experts_rejects_out_of_range_experts() -> None:
    import openvino as ov
    from openvino import opset15 as op

    rng = np.random.default_rng(0)
    mats = [_matrix(rng, 2, o, i, 32, np.float16)[0] for o, i in ((32, 64), (32, 64), (64, 32))]
    px = op.parameter([-1, 64], np.float32, name="x")
    pidx = op.parameter([-1, 1], np.int32, name="idx")
    pw = op.parameter([-1, 1], np.float32, name="weights")
    node = native.factory().create("U4Experts", [px, pidx, pw, op.constant(np.array([0], np.int64)), *sum(mats, [])])
    request = ov.Core().compile_model(ov.Model([node], [px, pidx, pw]), "CPU").create_infer_request()
    with pytest.raises(RuntimeError):
        request.infer({"x": np.ones((2, 64), np.float32), "idx": np.array([[0], [2]], np.int32),
                       "weights": np.ones((2, 1), np.float32)})


def test_the_library_is_cached_by_content() -> None:
    lib = native.library()
    assert lib.exists() and lib.parent.parent.name == "native"
    assert native.library() == lib


def _head_logits(model_dir: Path, rewrite: bool) -> np.ndarray:
    import openvino as ov

    core = ov.Core()
    model = last_token_logits.apply(core.read_model(model_dir / "openvino_model.xml"))
    if rewrite:
        lm_head_u8.apply(model)
        assert any(op.get_type_name() == "U8Linear" for op in model.get_ops())
    request = core.compile_model(model, "CPU", REFERENCE).create_infer_request()
    names = {p.get_any_name() for p in model.inputs}
    rows = []
    request.infer(stateful_feed(np.arange(100, 180, dtype=np.int64), 0, names))
    rows.append(np.array(request.get_tensor("logits").data[0, -1]))
    for k in range(4):
        request.infer(stateful_feed(np.array([11 + k], np.int64), 80 + k, names))
        rows.append(np.array(request.get_tensor("logits").data[0, -1]))
    return np.stack(rows)


def test_lm_head_u8_keeps_the_logits(tiny_dir: Path) -> None:
    plain, native_head = _head_logits(tiny_dir, False), _head_logits(tiny_dir, True)
    assert plain.shape == native_head.shape
    assert np.abs(plain - native_head).max() <= 1e-4 * max(1.0, float(np.abs(plain).max()))
    assert (plain.argmax(axis=1) == native_head.argmax(axis=1)).all()


def test_lm_head_u8_keeps_greedy_generation(tiny_dir: Path) -> None:
    prompt = tuple(range(1000, 1100))
    tokens = kernel_greedy(tiny_dir, "lm_head_u8", True, prompt, 24)[0]
    assert tokens == kernel_greedy(tiny_dir, "lm_head_u8", False, prompt, 24)[0]


def test_lm_head_u8_needs_a_u8_head(tiny_f32_dir: Path) -> None:
    import openvino as ov

    model = last_token_logits.apply(ov.Core().read_model(tiny_f32_dir / "openvino_model.xml"))
    with pytest.raises(lm_head_u8.RewriteError, match="decompression"):
        lm_head_u8.apply(model)


def _experts_logits(model_dir: Path, rewrite: bool | str, chunks: list[int], properties: dict | None = None,
                    then: Callable[[Any], Any] | None = None) -> np.ndarray:
    """Every position's logits of a prompt fed in chunks of the given sizes (concatenated), the
    model compiled with `properties` (default: the f32 reference mode); `then`: applied to the
    model after the rewrite."""
    import openvino as ov

    from kernels import native_experts

    core = ov.Core()
    model = core.read_model(model_dir / "openvino_model.xml")
    if rewrite:
        (native_experts.apply_all if rewrite == "all" else native_experts.apply)(model)
        assert sum(op.get_type_name() == "U4Experts" for op in model.get_ops()) >= 1
    if then is not None:
        then(model)
    request = core.compile_model(model, "CPU", REFERENCE if properties is None else properties).create_infer_request()
    names = {p.get_any_name() for p in model.inputs}
    prompt = np.random.default_rng(sum(chunks)).integers(1000, 150000, sum(chunks))
    out, past = [], 0
    for n in chunks:
        request.infer(stateful_feed(prompt[past:past + n], past, names))
        out.append(np.array(request.get_tensor("logits").data[0]))
        past += n
    return np.concatenate(out)


@pytest.mark.parametrize("chunks", [[1], [15], [16], [17], [100, 1, 1], [256] * 6],
                         ids=["1", "15", "16", "17", "100+decode", "6x256"])
@pytest.mark.parametrize("mode", [True, "all"], ids=["prefill", "all"])
def test_native_experts_keeps_the_logits(tiny_dir: Path, chunks: list[int], mode: bool | str) -> None:
    """Below MIN_TOKENS the fused block takes every row, from it on the op takes rows 1.. (`all`:
    the op takes every row); the logits of every position are the plain graph's (equal-shaped
    chunks as the KV grows too)."""
    plain, native_rows = _experts_logits(tiny_dir, False, chunks), _experts_logits(tiny_dir, mode, chunks)
    assert np.abs(plain - native_rows).max() <= 1e-4 * max(1.0, float(np.abs(plain).max()))


def test_native_experts_keeps_greedy_generation(tiny_dir: Path) -> None:
    prompt = tuple(range(1000, 1200))
    tokens, kernels = kernel_greedy(tiny_dir, "native_experts", True, prompt, 32)
    assert "native_experts" in kernels
    assert tokens == kernel_greedy(tiny_dir, "native_experts", False, prompt, 32)[0]


def test_phase_and_native_experts_exclude_each_other(tiny_dir: Path) -> None:
    import msgspec

    from iq36.profile import load
    from worker.engine import create

    profile = load("cpu")
    both = {**profile.kernels, "phase_experts": True, "native_experts": True}
    profile = msgspec.structs.replace(profile, kernels=both)
    with pytest.raises(ValueError, match="native_experts and phase_experts"):
        create("candidate", tiny_dir, profile)


_EXPF_FLAGS = ("avx512f", "avx512dq")


@pytest.mark.skipif(not all(f in native.cpu_flags() for f in _EXPF_FLAGS),
                    reason=f"needs a CPU with {', '.join(_EXPF_FLAGS)} (the ops' vector expf)")
def test_vector_expf_gives_the_scalar_bits() -> None:
    """`vexp::exp16` (kernels/native/expf.hpp) against the C library's expf on every 101st float
    bit pattern with |x| < 87 (~22 million; the whole range was checked once: docs/perf-log.md,
    session 45), and the experts' silu(g) * u on it against the scalar expression, bit for bit,
    over values of every magnitude, the limit's neighbours, infinities, NaN and lengths with a
    scalar tail."""
    import ctypes

    lib = ctypes.CDLL(str(native.library()))
    lib.iq36_expf_mismatches.restype = ctypes.c_int64
    lib.iq36_expf_mismatches.argtypes = [ctypes.c_int64]
    assert lib.iq36_expf_mismatches(101) == 0

    lib.iq36_silu_mul.restype = None
    ptr = ctypes.POINTER(ctypes.c_float)
    lib.iq36_silu_mul.argtypes = [ptr, ptr, ctypes.c_int64, ptr, ctypes.c_int]
    rng = np.random.default_rng(45)
    g = np.concatenate([rng.standard_normal(4000) * s for s in (1e-30, 1e-3, 1.0, 10.0, 40.0, 100.0)])
    g = np.concatenate([g, [86.99999, -86.99999, 87.0, -87.0, 88.8, -104.0, np.inf, -np.inf, np.nan, 0.0, -0.0]])
    g = rng.permutation(g).astype(np.float32)
    u = rng.standard_normal(g.size).astype(np.float32)

    def run(n: int, vector: int) -> np.ndarray:
        out = np.empty(n, np.float32)
        lib.iq36_silu_mul(g.ctypes.data_as(ptr), u.ctypes.data_as(ptr), n, out.ctypes.data_as(ptr), vector)
        return out

    for n in (g.size, 16 * 5 + 7, 3):
        vector, scalar = run(n, 1), run(n, 0)
        np.testing.assert_array_equal(vector.view(np.uint32), scalar.view(np.uint32))
    with np.errstate(over="ignore", invalid="ignore"):
        expected = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    finite = np.isfinite(expected)
    np.testing.assert_allclose(run(g.size, 1)[finite], expected[finite], rtol=1e-6, atol=1e-30)
