"""Greedy parity of the dev model across engines (SPEC §2, issue #2 acceptance).

f32 reference: the HF fp32 model, the fp32 export run by a raw OpenVINO stateful loop, and
the same export run by openvino-genai (f32 + SDPA) must give identical greedy tokens. The int4
export is only reported against HF: on random weights greedy decisions sit on near-ties
(FACTS.md), so int4 rounding legitimately changes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import REFERENCE

NEW_TOKENS = 32
PROMPT = [9707, 11, 1879, 0, 3555, 374, 264, 1273, 315, 279, 8433, 3703, 13, 220, 16, 17, 18]
F32 = REFERENCE


@pytest.fixture(scope="module")
def hf_greedy(tiny_checkpoint: Path) -> list[int]:
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):  # full forward each step: the simplest reference
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def _genai_greedy(model_dir: Path) -> list[int]:
    import openvino as ov
    import openvino_genai

    pipe = openvino_genai.LLMPipeline(str(model_dir), "CPU", ATTENTION_BACKEND="SDPA", **F32)
    config = openvino_genai.GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, do_sample=False)
    result = pipe.generate(ov.Tensor(np.array([PROMPT], dtype=np.int64)), config)
    return [int(t) for t in result.tokens[0]]


def test_raw_openvino_loop_matches_hf_fp32(tiny_f32_dir: Path, hf_greedy: list[int]) -> None:
    from worker.reference import ReferenceRunner

    tokens, _ = ReferenceRunner(tiny_f32_dir, properties=F32).greedy(PROMPT, NEW_TOKENS)
    assert tokens == hf_greedy


def test_genai_matches_hf_fp32(tiny_f32_dir: Path, hf_greedy: list[int]) -> None:
    assert _genai_greedy(tiny_f32_dir) == hf_greedy


def test_report_int4_greedy_agreement_with_hf(tiny_dir: Path, hf_greedy: list[int], tmp_path_factory,
                                               record_property) -> None:
    """Not a pass/fail figure: records how far int4 greedy tokens follow HF fp32."""
    from worker.reference import ReferenceRunner

    raw, _ = ReferenceRunner(tiny_dir, properties=F32).greedy(PROMPT, NEW_TOKENS)
    genai = _genai_greedy(tiny_dir)
    assert raw == genai  # the two OpenVINO paths agree with each other on the int4 IR
    prefix = next((i for i, (a, b) in enumerate(zip(raw, hf_greedy, strict=False)) if a != b), NEW_TOKENS)
    same = sum(a == b for a, b in zip(raw, hf_greedy, strict=False))
    report = {"new_tokens": NEW_TOKENS, "matching_prefix": prefix, "matching_positions": same}
    record_property("int4_vs_hf", json.dumps(report))
    print(f"\nint4 dev-tiny vs HF fp32: {json.dumps(report)}")
