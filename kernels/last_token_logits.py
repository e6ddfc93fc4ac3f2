"""Kernel `last_token_logits`: run the LM head on the last sequence position only.

Why: the exported IR computes `logits [B, T, V]` for every position of every call, but a
generation loop only ever reads the last one. For a 131,072-token prompt that is 131k × vocab
(248,320 on the real model) logits — a 131k×2048 by 2048×248k matmul and a ~130 GB f32
tensor — to keep one row. Slicing the LM head's activation input to the last position before
the MatMul makes prefill's head cost that of one token, whatever the chunk size.

The rewrite: find the MatMul that produces the `logits` output (through any Convert that the
export put between them), insert `Slice(start=-1, stop=INT64_MAX, step=1, axis=1)` on its
activation input. The output keeps rank 3, `[B, 1, V]`, so callers read `logits[0, -1]` either
way. openvino-genai applies the same rewrite inside `LLMPipeline`, so stock and candidate run
the same head. Numerically the last row is unchanged (tests/test_engines.py checks it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

NAME = "last_token_logits"
LOGITS = "logits"
SEQ_AXIS = 1
_PASS_THROUGH = {"Convert"}  # element-type casts the exporter may place after the head


class RewriteError(RuntimeError):
    pass


def _logits_matmul(model: Any) -> Any:
    try:
        out = model.output(LOGITS)
    except RuntimeError as exc:
        raise RewriteError(f"the model has no '{LOGITS}' output") from exc
    node = out.get_node()  # the Result
    node = node.input_value(0).get_node()
    while node.get_type_name() in _PASS_THROUGH:
        node = node.input_value(0).get_node()
    if node.get_type_name() != "MatMul":
        raise RewriteError(f"'{LOGITS}' is produced by {node.get_type_name()}, not by a MatMul")
    return node


def apply(model: Any) -> Any:
    """Rewrite `model` (an `openvino.Model`, before compile) in place; returns it.

    Idempotent: a head whose activation is already sliced to one position is left alone.
    """
    from openvino import opset8

    matmul = _logits_matmul(model)
    activation = matmul.input_value(0)
    source = activation.get_node()
    if source.get_type_name() == "Slice" and source.get_friendly_name().endswith(f"/{NAME}"):
        return model
    if activation.get_partial_shape().rank.get_length() != 3:
        raise RewriteError(f"the LM head's activation is not [B, T, H]: {activation.get_partial_shape()}")
    sliced = opset8.slice(
        activation,
        np.array([-1], dtype=np.int64),
        np.array([np.iinfo(np.int64).max], dtype=np.int64),
        np.array([1], dtype=np.int64),
        np.array([SEQ_AXIS], dtype=np.int64),
    )
    sliced.set_friendly_name(f"{matmul.get_friendly_name()}/{NAME}")
    matmul.input(0).replace_source_output(sliced.output(0))
    model.validate_nodes_and_infer_types()
    return model
