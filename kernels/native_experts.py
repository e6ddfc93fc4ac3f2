"""Kernel `native_experts`: `phase_experts` with the native `U4Experts` op in place of its Loop.

The layout is `phase_experts`' (kernels/phase_experts.py): the exported, plugin-fused block runs
the first n rows of a chunk (n = the chunk below `MIN_TOKENS` tokens, else 1), and the other
rows go to the token-grouped path. Here that path is one extension op (kernels/native/
u4_experts.hpp) that buckets the rows by expert and multiplies them with each expert's u4
weights decompressed tile by tile in cache, instead of a Loop that decompresses whole experts to
f32 in memory before a MatMul. The op reads the block's own constants: no copy of the weights.
Decode (one row) never reaches it.

CPU only; mutually exclusive with `phase_experts` (the engine refuses both).

`bf16_tiles` (switch `experts_bf16`): where the CPU plugin runs the model in bf16 (its default on
an AVX512-BF16 CPU) and the CPU has AVX512-BF16, the op's tiles take bf16 dot products
(kernels/native/u4_experts_bf16.hpp): (q - z) exact in bf16, the group's scale on the group's
f32 sum, the activations rounded to bf16 as the plugin's own bf16 nodes round theirs (the
block's input already is bf16 there). Where the CPU also has AMX-BF16, the tiles' whole 16-row
blocks take AMX tile products with the same numerics (kernels/native/u4_experts_amx.hpp;
`IQ36_AMX=0` keeps the vector tiles). Decode rows (one or two per expert) keep their paths.

`int8_tiles` (switch `experts_int8`, with the bf16 tiles): where the plugin also quantizes its own
compressed matmuls' activations to int8 per 32 inputs (its dynamic quantization: the default
where it runs bf16) and the CPU has AVX512-VNNI without AMX, the lane form's tiles (experts of at
least 11 rows) take x and the act rows as int8 per 32 inputs, the weights q as bytes, vpdpbusd
products (kernels/native/u4_experts_int8.hpp): twice vdpbf16ps' multiply-adds per instruction,
at the precision of the plugin's own matmuls there.
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


def bf16_tiles(model: Any) -> int:
    """Set the `bf16` attribute on every `U4Experts` op of `model` (in place); returns how many.
    Only for a model compiled with bf16 inference precision (its activations are bf16 values):
    the engine decides (worker/engine/candidate.py)."""
    return _switch_on(model, "bf16")


def int8_tiles(model: Any) -> int:
    """Set the `int8` attribute on every `U4Experts` op of `model` (in place; after `bf16_tiles`,
    which it needs); returns how many. Only for a model whose plugin quantizes its own matmuls'
    activations to int8 per 32 inputs: the engine decides (worker/engine/candidate.py)."""
    return _switch_on(model, "int8")


def _switch_on(model: Any, attribute: str) -> int:
    from kernels import native

    done = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "U4Experts":
            continue
        attrs = {**node.get_attributes(), attribute: True}
        new = native.factory().create("U4Experts", [node.input_value(i) for i in range(node.get_input_size())], attrs)
        new.set_friendly_name(node.get_friendly_name())
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(new.output(0))
        done += 1
    model.validate_nodes_and_infer_types()
    return done
