"""Kernel `grouped_experts` (kernels/grouped_experts.py): token-grouped routed experts for prefill.

Numeric equivalence on dev-tiny (int4) in f32: the rewritten block computes the same sums in
another order, so logits agree to float rounding and greedy generation through the candidate
engine (prefill graph rewritten, decode graph not, the state moving between them) gives the
same tokens as without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels import grouped_experts, last_token_logits
from tests.helpers import REFERENCE, kernel_greedy
from worker.reference import stateful_feed


def _prefill_logits(model_dir: Path, rewrite: bool, ids: np.ndarray) -> np.ndarray:
    import openvino as ov

    core = ov.Core()
    model = last_token_logits.apply(core.read_model(model_dir / "openvino_model.xml"))
    if rewrite:
        grouped_experts.apply(model)
    request = core.compile_model(model, "CPU", REFERENCE).create_infer_request()
    request.infer(stateful_feed(ids, 0, {p.get_any_name() for p in model.inputs}))
    return np.array(request.get_tensor("logits").data[0, -1])


def test_the_rewrite_keeps_the_logits(tiny_dir: Path) -> None:
    ids = np.arange(100, 400, dtype=np.int64)
    plain, grouped = _prefill_logits(tiny_dir, False, ids), _prefill_logits(tiny_dir, True, ids)
    assert np.abs(plain - grouped).max() <= 1e-5 * max(1.0, float(np.abs(plain).max()))
    assert int(plain.argmax()) == int(grouped.argmax())


def test_the_rewrite_replaces_every_moe_block(tiny_dir: Path) -> None:
    import openvino as ov

    model = ov.Core().read_model(tiny_dir / "openvino_model.xml")
    blocks = len(grouped_experts._blocks(model))
    assert blocks == 4  # dev-tiny has 4 MoE layers
    grouped_experts.apply(model)
    assert grouped_experts._blocks(model) == []
    names = [n.get_friendly_name() for n in model.get_ops() if n.get_friendly_name().endswith("/grouped_experts")]
    assert len(names) == blocks


def test_a_model_without_the_pattern_is_refused(tiny_f32_dir: Path) -> None:
    import openvino as ov

    model = ov.Core().read_model(tiny_f32_dir / "openvino_model.xml")  # float weights, not the u4 block
    with pytest.raises(grouped_experts.RewriteError, match="no routed-experts block"):
        grouped_experts.apply(model)


def test_greedy_generation_is_unchanged(tiny_dir: Path) -> None:
    prompt = tuple(range(1000, 1200))  # 200 tokens: four prefill chunks of 64, then decode
    tokens, kernels = kernel_greedy(tiny_dir, "grouped_experts", True, prompt, 48)
    assert "grouped_experts (prefill)" in kernels
    assert tokens == kernel_greedy(tiny_dir, "grouped_experts", False, prompt, 48)[0]


def test_grouped_experts_beside_the_decode_graph(tiny_dir: Path) -> None:
    """The prefill model re-applies the main model's rewrites; the decode graph is not one of
    them (it used to raise KeyError at start): with q16_decode and decode_graph on, the engine
    starts and generates the tokens it generates without grouped_experts."""
    from tests.helpers import greedy_with_kernels

    prompt = tuple(range(1000, 1200))
    kernels = {"q16_decode": True, "decode_graph": True}
    tokens, reported = greedy_with_kernels(tiny_dir, {**kernels, "grouped_experts": True}, prompt, 24)
    assert "grouped_experts (prefill)" in reported and "decode_graph" in reported
    assert tokens == greedy_with_kernels(tiny_dir, kernels, prompt, 24)[0]


def test_grouped_experts_excludes_the_other_experts_rewrites(tiny_dir: Path) -> None:
    import msgspec
    import openvino as ov

    from iq36.profile import load
    from worker.engine.candidate import specialised_model

    profile = load("cpu")
    profile = msgspec.structs.replace(profile, kernels={**profile.kernels, "grouped_experts": True})
    with pytest.raises(ValueError, match="grouped_experts and native_experts rewrite the same blocks"):
        specialised_model(ov.Core(), tiny_dir, profile)
