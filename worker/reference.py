"""A plain stateful loop over the unmodified IR on stock OpenVINO: the numeric reference.

No specialisation, no chunking: the IR exactly as exported, one `infer` for the prompt and
one per token. Used by parity tests and, later, by the gate for full-vocabulary distributions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

TICK = "iq36_tick"  # kernels.phase_experts.TICK (not imported: that would pull in the kernels)


def stateful_feed(ids: np.ndarray, past: int, input_names: set[str], call: int | None = None) -> dict[str, np.ndarray]:
    """Inputs of an optimum-intel stateful IR for `ids` fed after `past` tokens of state.

    `call`: how many inferences this infer request has run before; required by a model rewritten
    with a tick input (kernels/phase_experts.py), whose shape it alternates."""
    n = int(ids.size)
    feed: dict[str, np.ndarray] = {
        "input_ids": ids.reshape(1, n).astype(np.int64, copy=False),
        "attention_mask": np.ones((1, past + n), dtype=np.int64),
    }
    if "position_ids" in input_names:
        feed["position_ids"] = np.arange(past, past + n, dtype=np.int64).reshape(1, n)
    if "beam_idx" in input_names:
        feed["beam_idx"] = np.zeros((1,), dtype=np.int32)
    if TICK in input_names:
        if call is None:
            raise ValueError(f"the model has a '{TICK}' input: pass the request's inference count as `call`")
        feed[TICK] = np.zeros((1 + call % 2,), dtype=np.uint8)
    return feed


class ReferenceRunner:
    def __init__(self, model_dir: Path, device: str = "CPU", properties: dict[str, Any] | None = None):
        import openvino as ov

        core = ov.Core()
        self.model = core.read_model(model_dir / "openvino_model.xml")
        self.compiled = core.compile_model(self.model, device, properties or {})
        self.request = self.compiled.create_infer_request()
        self._inputs = {p.get_any_name() for p in self.model.inputs}

    def _feed(self, ids: np.ndarray, past: int) -> np.ndarray:
        self.request.infer(stateful_feed(ids, past, self._inputs))
        return self.request.get_tensor("logits").data[0]  # [n, vocab]

    def forced_logits(self, prompt: list[int], forced: list[int], prefill_chunk: int = 4096):
        """Logits predicting each of `forced` after `prompt` (teacher forcing), one row at a time.

        Yields len(forced) float32 arrays: row i is the distribution the model gives for
        position len(prompt) + i, having seen prompt + forced[:i]. The prompt goes in calls of
        at most `prefill_chunk` tokens: the IR computes logits for every position it is fed,
        so one call on a long prompt would hold len(prompt) x vocab floats.
        """
        self.request.reset_state()
        past = 0
        for start in range(0, len(prompt), prefill_chunk):
            chunk = np.asarray(prompt[start:start + prefill_chunk])
            logits = self._feed(chunk, past)[-1]
            past += chunk.size
        for i, token in enumerate(forced):
            yield np.array(logits, dtype=np.float32)
            if i + 1 < len(forced):
                logits = self._feed(np.asarray([token]), past)[-1]
                past += 1

    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
        """Greedy tokens and the logits each was chosen from ([new_tokens, vocab], float32)."""
        self.request.reset_state()
        logits = self._feed(np.asarray(prompt), 0)[-1]
        out, steps = [], []
        past = len(prompt)
        for _ in range(new_tokens):
            steps.append(np.array(logits, dtype=np.float32))
            token = int(np.argmax(logits))
            out.append(token)
            logits = self._feed(np.asarray([token]), past)[-1]
            past += 1
        return out, np.stack(steps)
