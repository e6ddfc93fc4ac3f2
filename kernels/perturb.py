"""A deliberately wrong rewrite: perturbs the token embeddings by a fixed pseudo-random offset.

It exists to prove the correctness gate can fail (issue #6): enabled through the profile's
`[kernels] perturb_embeddings = true` (never in a shipped profile), it changes every hidden
state of the model the way a buggy fused kernel would. Deterministic, so the failure is too.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _embedding_gather(model: Any) -> Any:
    """The Gather that looks up `input_ids` in the embedding table (rank-3 output)."""
    start = next(p for p in model.inputs if p.get_any_name() == "input_ids").get_node()
    frontier, seen = [start], set()
    for _ in range(4):  # input_ids -> Convert -> Gather in optimum-intel exports
        nxt = []
        for node in frontier:
            for out in node.outputs():
                for target in out.get_target_inputs():
                    consumer = target.get_node()
                    if consumer.get_friendly_name() in seen:
                        continue
                    seen.add(consumer.get_friendly_name())
                    rank = consumer.get_output_partial_shape(0).rank.get_length()
                    if consumer.get_type_name() == "Gather" and rank == 3:
                        return consumer
                    nxt.append(consumer)
        frontier = nxt
    raise ValueError("no embedding Gather found downstream of input_ids")


def apply(model: Any, scale: float = 1.0, seed: int = 0) -> Any:
    import openvino as ov
    import openvino.opset13 as ops

    gather = _embedding_gather(model)
    hidden = gather.get_output_partial_shape(0)[2].get_length()
    offset = np.random.default_rng(seed).standard_normal(hidden).astype(np.float32) * 0.02 * scale
    out = gather.output(0)
    targets = list(out.get_target_inputs())
    add = ops.add(out, ops.constant(offset, ov.Type.f32))
    for target in targets:
        target.replace_source_output(add.output(0))
    model.validate_nodes_and_infer_types()
    return model
