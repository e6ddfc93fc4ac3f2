"""Decode's memory-bandwidth roofline (iq36/gate/roofline.py): bytes per token from the IR and
the STREAM-style read probe."""

from __future__ import annotations

import json
from pathlib import Path

from iq36.gate import roofline


def test_bytes_per_token_follow_the_model_shapes(tiny_dir: Path) -> None:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    hidden, inter, experts, k = (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"],
                                 cfg["num_experts_per_tok"])
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    a, b = roofline.bytes_per_token(tiny_dir, 1024), roofline.bytes_per_token(tiny_dir, 2048)
    # every expert's three u4 matrices, and no more than twice that with zero points and scales
    packed = layers * experts * 3 * hidden * inter // 2
    assert packed <= a.experts_all <= 2 * packed
    # the int8 LM head is read whole; the embedding table (the same size) only one row
    assert vocab * hidden <= a.lm_head <= a.weights
    assert a.weights < a.lm_head + vocab * hidden  # the embedding table is not counted whole
    # only the top-k of the experts are counted in what a token reads
    assert a.weights - a.lm_head < (a.experts_all * k // experts) + a.lm_head
    # the KV cache grows with the context, the weights and the recurrent state do not
    assert b.kv == 2 * a.kv > 0 and (b.weights, b.state) == (a.weights, a.state)
    assert a.total == a.weights + a.state + a.kv


def test_read_probe_reports_bytes_per_second() -> None:
    bw = roofline.read_bandwidth(1, size=64 << 20, passes=2)
    # any machine this runs on reads between 100 MB/s and 10 TB/s; a unit slip fails this
    assert 1e8 < bw < 1e13
    assert 1e8 < roofline.copy_bandwidth(1, size=64 << 20, passes=2) < 1e13
