"""Kernel `phase_experts` (kernels/phase_experts.py): one graph, token-grouped routed experts
for prefill chunks, the exported (plugin-fused) block for decode.

On dev-tiny (int4) in f32: logits after a prefill (the loop branch) and after decode steps (the
fused branch) agree with the unmodified IR to float rounding, and greedy generation through the
candidate engine gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kernels import last_token_logits, phase_experts
from tests.helpers import REFERENCE, kernel_greedy
from worker.reference import stateful_feed


def _logits(model_dir: Path, rewrite: bool) -> np.ndarray:
    import openvino as ov

    core = ov.Core()
    model = last_token_logits.apply(core.read_model(model_dir / "openvino_model.xml"))
    if rewrite:
        phase_experts.apply(model)
    request = core.compile_model(model, "CPU", REFERENCE).create_infer_request()
    names = {p.get_any_name() for p in model.inputs}
    ids = np.arange(100, 200, dtype=np.int64)
    rows = []
    request.infer(stateful_feed(ids, 0, names, 0))  # >= MIN_TOKENS: the loop branch
    rows.append(np.array(request.get_tensor("logits").data[0, -1]))
    for k in range(3):  # one token: the fused branch
        request.infer(stateful_feed(np.array([7 + k], np.int64), ids.size + k, names, 1 + k))
        rows.append(np.array(request.get_tensor("logits").data[0, -1]))
    return np.stack(rows)


def test_prefill_and_decode_logits_are_kept(tiny_dir: Path) -> None:
    plain, phased = _logits(tiny_dir, False), _logits(tiny_dir, True)
    assert np.abs(plain - phased).max() <= 1e-4 * max(1.0, float(np.abs(plain).max()))
    assert (plain.argmax(axis=1) == phased.argmax(axis=1)).all()


def test_greedy_generation_is_unchanged(tiny_dir: Path) -> None:
    prompt = tuple(range(1000, 1200))
    tokens = kernel_greedy(tiny_dir, "phase_experts", True, prompt, 32)[0]
    assert tokens == kernel_greedy(tiny_dir, "phase_experts", False, prompt, 32)[0]


@pytest.mark.parametrize("tokens", [1, phase_experts.MIN_TOKENS - 1, phase_experts.MIN_TOKENS,
                                    phase_experts.MIN_TOKENS + 1])
def test_both_sides_of_the_threshold_are_kept(tiny_dir: Path, tokens: int) -> None:
    """Below the threshold the fused block takes every row; from it on, the fused block one row
    and the loop the others: the logits are the plain graph's either way."""
    import openvino as ov

    core = ov.Core()
    out = []
    for rewrite in (False, True):
        model = last_token_logits.apply(core.read_model(tiny_dir / "openvino_model.xml"))
        if rewrite:
            phase_experts.apply(model)
        request = core.compile_model(model, "CPU", REFERENCE).create_infer_request()
        names = {p.get_any_name() for p in model.inputs}
        request.infer(stateful_feed(np.arange(300, 300 + tokens, dtype=np.int64), 0, names, 0))
        out.append(np.array(request.get_tensor("logits").data[0, -1]))
    assert np.abs(out[0] - out[1]).max() <= 1e-4 * max(1.0, float(np.abs(out[0]).max()))


def _chunked_logits(model_dir: Path, rewrite: bool, chunk: int, chunks: int, calls: Callable[[int], int]) -> np.ndarray:
    """Every position's logits of a prompt fed in `chunks` equal chunks ([chunks, chunk, V])."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(model_dir / "openvino_model.xml")
    if rewrite:
        phase_experts.apply(model)
    # an f32 KV cache: a u8 one rounds the two graphs' (f32-close) keys apart now and then (3e-4)
    properties = {**REFERENCE, "KV_CACHE_PRECISION": "f32"}
    request = core.compile_model(model, "CPU", properties).create_infer_request()
    names = {p.get_any_name() for p in model.inputs}
    prompt = np.random.default_rng(chunk * chunks).integers(1000, 150000, chunk * chunks)
    out = []
    for k in range(chunks):
        request.infer(stateful_feed(prompt[k * chunk:(k + 1) * chunk], k * chunk, names, calls(k)))
        out.append(np.array(request.get_tensor("logits").data[0]))
    return np.stack(out)


def test_equal_chunks_of_a_long_prompt_are_kept(tiny_dir: Path) -> None:
    """Equal-shaped chunks while the KV cache grows: without a tick whose shape changes at every
    inference, the plugin's Loop read stale outer buffers and rows 1.. of the 3rd-6th chunk came
    out wrong (max |delta| ~0.6). Every row of every chunk must match the plain graph."""
    plain = _chunked_logits(tiny_dir, False, 256, 8, lambda k: k)
    phased = _chunked_logits(tiny_dir, True, 256, 8, lambda k: k)
    delta = np.abs(plain - phased).max(axis=-1)  # [chunk, row]
    assert delta.max() <= 1e-4 * max(1.0, float(np.abs(plain).max())), np.argwhere(delta > 1e-4)[:5]


def test_the_tick_is_required(tiny_dir: Path) -> None:
    import openvino as ov

    model = phase_experts.apply(ov.Core().read_model(tiny_dir / "openvino_model.xml"))
    names = {p.get_any_name() for p in model.inputs}
    assert phase_experts.TICK in names
    with pytest.raises(ValueError, match="iq36_tick"):
        stateful_feed(np.arange(4), 0, names)
    shapes = {stateful_feed(np.arange(4), 0, names, call)[phase_experts.TICK].shape for call in (0, 1)}
    assert len(shapes) == 2
