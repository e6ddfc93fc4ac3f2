"""Kernel `native_experts`: `phase_experts` with the native `U4Experts` op in place of its Loop.

The layout is `phase_experts`' (kernels/phase_experts.py): the exported, plugin-fused block runs
the first n rows of a chunk (n = the chunk below `MIN_TOKENS` tokens, else 1), and the other
rows go to the token-grouped path. Here that path is one extension op (kernels/native/
u4_experts.hpp) that buckets the rows by expert and multiplies them with each expert's u4
weights decompressed tile by tile in cache, instead of a Loop that decompresses whole experts to
f32 in memory before a MatMul. The op reads the block's own constants: no copy of the weights.
Decode (one row) never reaches it.

CPU only; mutually exclusive with `phase_experts` (the engine refuses both).
"""

from __future__ import annotations

from typing import Any

NAME = "native_experts"


def apply(model: Any, rows: bool | str = True) -> Any:
    """Rewrite `model` in place; returns it. `rows="all"`: every row goes to the op, decode
    included (a probe, `tests/bench_phase_decode.py --modes native-all`: no decode gain)."""
    from kernels import native, phase_experts

    native.require_cpu(NAME, phase_experts.RewriteError)
    return phase_experts.apply(model, native=rows)


def apply_all(model: Any) -> Any:
    """`apply(model, rows="all")`."""
    return apply(model, rows="all")
