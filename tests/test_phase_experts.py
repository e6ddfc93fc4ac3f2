"""Kernel `phase_experts` (kernels/phase_experts.py): one graph, token-grouped routed experts
for prefill chunks, the exported (plugin-fused) block for decode.

On dev-tiny (int4) in f32: logits after a prefill (the loop branch) and after decode steps (the
fused branch) agree with the unmodified IR to float rounding, and greedy generation through the
candidate engine gives the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from iq36.profile import PrefillSection, load
from kernels import last_token_logits, phase_experts
from worker.engine import EngineRequest, SamplingParams, create
from worker.reference import stateful_feed


def _logits(model_dir: Path, rewrite: bool) -> np.ndarray:
    import openvino as ov

    core = ov.Core()
    model = last_token_logits.apply(core.read_model(model_dir / "openvino_model.xml"))
    if rewrite:
        phase_experts.apply(model)
    request = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    names = {p.get_any_name() for p in model.inputs}
    ids = np.arange(100, 200, dtype=np.int64)
    rows = []
    request.infer(stateful_feed(ids, 0, names))  # >= MIN_TOKENS: the loop branch
    rows.append(np.array(request.get_tensor("logits").data[0, -1]))
    for k in range(3):  # one token: the fused branch
        request.infer(stateful_feed(np.array([7 + k], np.int64), ids.size + k, names))
        rows.append(np.array(request.get_tensor("logits").data[0, -1]))
    return np.stack(rows)


def test_prefill_and_decode_logits_are_kept(tiny_dir: Path) -> None:
    plain, phased = _logits(tiny_dir, False), _logits(tiny_dir, True)
    assert np.abs(plain - phased).max() <= 1e-4 * max(1.0, float(np.abs(plain).max()))
    assert (plain.argmax(axis=1) == phased.argmax(axis=1)).all()


def _greedy(tiny_dir: Path, kernel: bool) -> list[int]:
    profile = load("cpu-f32")
    profile = msgspec.structs.replace(profile, prefill=PrefillSection(chunk_tokens=64),
                                      kernels={**profile.kernels, "phase_experts": kernel})
    engine = create("candidate", tiny_dir, profile)
    try:
        engine.add(EngineRequest("p", tuple(range(1000, 1200)),
                                 SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), reuse_prefix=False))
        tokens: list[int] = []
        while engine.has_work():
            for out in engine.step():
                tokens.extend(out.token_ids)
        return tokens
    finally:
        engine.close()


def test_greedy_generation_is_unchanged(tiny_dir: Path) -> None:
    assert _greedy(tiny_dir, True) == _greedy(tiny_dir, False)
