"""`decode_shared_expert` (kernels/decode_shared_expert.py): the decode graph's shared expert and
its gate inside the block's U4Experts op (its 12 optional inputs, kernels/native/u4_experts.hpp)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import decode_shared_expert as dse
from kernels import native
from kernels.q16_decode import _as_bytes
from tests.helpers import chunk_logits

pytestmark = pytest.mark.skipif(not native.cpu_supported(), reason="the native ops need AVX2, FMA and F16C")


def _ops(tokens: int, skip: int, residual: bool, hidden: int = 256, width: int = 128, shared_width: int = 256,
         seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(routed op's y, fused op's y, the shared expert's term in float64) for random x and routing."""
    import openvino as ov
    from openvino import opset15 as op

    from tests.test_native import _matrix, _u4

    rng = np.random.default_rng(seed)
    experts, k = 6, 3
    routed = []
    for out, inp in ((width, hidden), (width, hidden), (hidden, width)):
        parts, _ = _matrix(rng, experts, out, inp, 128, np.float16)
        parts[0] = _as_bytes(parts[0].output(0)).get_node()
        routed += parts
    shared, dense = [], []
    for out, inp in ((1, hidden), (shared_width, hidden), (shared_width, hidden), (hidden, shared_width)):
        (w, q), (z, zq) = _u4(rng, (out, inp // 128, 128)), _u4(rng, (out, inp // 128, 1))
        s = (rng.random((out, inp // 128, 1)) * 0.05 + 0.01).astype(np.float16)
        shared += [_as_bytes(w.output(0)).get_node(), z, op.constant(s)]
        dense.append(((q.astype(np.float64) - zq) * s.astype(np.float64)).reshape(out, inp))
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    idx = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)

    px = op.parameter([-1, hidden], np.float32, name="x")
    pidx = op.parameter([-1, k], np.int32, name="idx")
    pw = op.parameter([-1, k], np.float32, name="weights")
    args = [px, pidx, pw, op.constant(np.array([skip], np.int64)), *routed]
    attributes = {"q16_rows": 4, "nibbles": True, "bf16": False, "residual": residual, "int8": False}
    plain = native.factory().create("U4Experts", args, attributes)
    fused = native.factory().create("U4Experts", [*args, *shared], attributes)
    request = ov.Core().compile_model(ov.Model([plain, fused], [px, pidx, pw]), "CPU").create_infer_request()
    got = request.infer({"x": x, "idx": idx, "weights": weights})
    xd = x.astype(np.float64)
    gate = 1.0 / (1.0 + np.exp(-(xd @ dense[0].T)))
    g, u = xd @ dense[1].T, xd @ dense[2].T
    term = gate * ((g / (1.0 + np.exp(-g)) * u) @ dense[3].T)
    term[:skip] = 0.0
    return np.array(got[0]), np.array(got[1]), term


@pytest.mark.parametrize(("tokens", "skip"), [(1, 0), (3, 0), (3, 1), (6, 0)])
def test_the_op_adds_the_shared_expert(tokens: int, skip: int) -> None:
    """With the shared expert's inputs the op's rows are the routed experts' sum (the op without
    them, to f32 rounding) plus sigmoid(g . x) * down(silu(gate x) * up x) to f32 accuracy
    against float64; rows before `skip` stay zero. Every row count takes the integer products
    (6 rows: the routed experts on the tiles, the shared expert still on Q16Linear's products)."""
    plain, fused, term = _ops(tokens, skip, residual=True, seed=tokens + 10 * skip)
    scale = np.abs(term).max()
    assert scale > 0.1  # a term that matters
    assert np.abs(fused - (plain + term)).max() <= 2e-6 * (scale + np.abs(plain).max())
    assert not fused[:skip].any()


def test_the_op_without_the_residual_rounds_the_shared_expert_as_its_routed_ones() -> None:
    """`residual` False: x and the act rows as their int16 term alone, the shared expert too:
    within the int16 term's steps of float64 (2e-4 of the scale here), not the residual's result."""
    plain_r, fused_r, term = _ops(2, 0, residual=True, seed=7)
    plain, fused, _ = _ops(2, 0, residual=False, seed=7)
    scale = np.abs(term).max()
    assert np.abs(fused - (plain + term)).max() <= 2e-4 * (scale + np.abs(plain).max())
    assert not np.array_equal(fused - plain, fused_r - plain_r)


def test_the_op_refuses_a_shared_expert_that_does_not_fit() -> None:
    from openvino import opset15 as op

    from tests.test_native import _matrix, _u4

    rng = np.random.default_rng(3)
    routed = []
    for out, inp in ((128, 256), (128, 256), (256, 128)):
        parts, _ = _matrix(rng, 4, out, inp, 128, np.float16)
        routed += parts
    args = [op.parameter([-1, 256], np.float32), op.parameter([-1, 2], np.int32), op.parameter([-1, 2], np.float32),
            op.constant(np.array([0], np.int64)), *routed]

    def shared(shapes: list[tuple[int, int]]) -> list[Any]:
        out = []
        for o, i in shapes:
            out += [_u4(rng, (o, i // 128, 128))[0], _u4(rng, (o, i // 128, 1))[0],
                    op.constant(np.ones((o, i // 128, 1), np.float16))]
        return out

    with pytest.raises(RuntimeError, match="gate is one row"):
        native.factory().create("U4Experts", [*args, *shared([(2, 256), (128, 256), (128, 256), (256, 128)])], {})
    with pytest.raises(RuntimeError, match="down must map"):
        native.factory().create("U4Experts", [*args, *shared([(1, 256), (128, 256), (128, 256), (256, 256)])], {})
    with pytest.raises(RuntimeError, match="takes x, idx"):
        native.factory().create("U4Experts", [*args, *shared([(1, 256)])], {})


def _decode_graph(tiny_dir: Path, min_bytes: int) -> Any:
    """dev-tiny's decode graph as the engine builds it (native_experts, q16_decode without the
    split, pinned to one token), with q16_decode's floor at `min_bytes`."""
    import openvino as ov

    from kernels import last_token_logits, native_experts, q16_decode

    model = last_token_logits.apply(ov.Core().read_model(tiny_dir / "openvino_model.xml"))
    native_experts.apply(model)
    return q16_decode.pin_one_token(q16_decode.apply(model, min_bytes=min_bytes, split=False))


@pytest.mark.parametrize("min_bytes", [0, None], ids=["q16-linear", "plugin-matmuls"])
def test_the_rewrite_moves_every_blocks_shared_expert(tiny_dir: Path, min_bytes: int | None) -> None:
    """Every MoE block's shared expert (on Q16Linear, or on the plugin's matmuls where q16_decode's
    floor leaves them: dev-tiny's 256-wide layers) moves into its U4Experts op, no matmul of it is
    left, and one-token steps give the graph's logits without the rewrite to f32 accuracy (the
    gate row on the integer products instead of the plugin's f32 matmul, silu and sigmoid on
    the op's exp)."""
    from kernels import q16_decode

    floor = q16_decode.MIN_BYTES if min_bytes is None else min_bytes
    plain, fused = _decode_graph(tiny_dir, floor), _decode_graph(tiny_dir, floor)
    kinds = {o.get_type_name() for o in plain.get_ordered_ops() if "shared_expert." in o.get_friendly_name()}
    assert ("Q16Linear" in kinds) == (min_bytes == 0)
    blocks = sum(o.get_type_name() == "U4Experts" for o in fused.get_ordered_ops())
    assert blocks > 0 and dse.apply(fused) == blocks
    ops = fused.get_ordered_ops()
    assert all(o.get_input_size() == 25 for o in ops if o.get_type_name() == "U4Experts")
    assert not [o for o in ops if o.get_type_name() in ("MatMul", "Q16Linear", "Sigmoid")
                and "shared_expert" in o.get_friendly_name()]
    chunks = [1] * 6
    want, got = chunk_logits(tiny_dir, chunks, model=plain), chunk_logits(tiny_dir, chunks, model=fused)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert dse.apply(fused) == 0  # nothing of the form is left


def test_the_engine_decodes_with_the_switch(tiny_dir: Path) -> None:
    """The candidate on `cpu` (plugin in f32): the switch is reported and changes the identity;
    teacher-forced decode gives the logits without it to f32 accuracy, the same greedy tokens."""
    import msgspec

    from iq36.profile import PrefillSection, load
    from tests.helpers import REFERENCE
    from worker.engine import create

    def engine(on: bool) -> Any:
        profile = load("cpu")
        properties = {**profile.engine.properties, **REFERENCE}
        profile = msgspec.structs.replace(
            profile, prefill=PrefillSection(chunk_tokens=64),
            engine=msgspec.structs.replace(profile.engine, properties=properties),
            kernels={**profile.kernels, dse.NAME: on})
        return create("candidate", tiny_dir, profile)

    prompt, forced = list(range(1000, 1150)), list(range(2000, 2016))
    on, off = engine(True), engine(False)
    try:
        assert dse.NAME in on.describe()["kernels"] and dse.NAME not in off.describe()["kernels"]
        assert on.graph_hash != off.graph_hash
        got = np.stack(list(on.forced_logits(prompt, forced)))
        want = np.stack(list(off.forced_logits(prompt, forced)))
    finally:
        on.close()
        off.close()
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
