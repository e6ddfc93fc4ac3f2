"""Probe (not a test): iq36's `U4Experts` op alone, at the real per-layer dims.

    .venv/bin/python -m tests.bench_u4_experts --experts 256 --tokens 64,257,512 [--reps 15] [--f32]

One routed-experts block (hidden 2048, expert 512, top-8, u4 asym group-128 weights passed as
their packed bytes, as `q16_decode` hands them over), random routing, tokens rounded to bf16.
Prints the median and minimum time of one call per token count (after one untimed call). The
bf16 tiles run where the CPU has AVX512-BF16, on AMX tiles where it has AMX-BF16 (`IQ36_AMX=0`:
the vector tiles; `--f32`: the f32 tiles; `--int8`: the bf16 tiles and the int8 ones, their calls
alternating, with the ratio). To compare two builds of
the op, change a tuning macro in `kernels/native/*.hpp` (the build cache is keyed by content) and
run this once per build: docs/perf-log.md, session 11.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kernels import native
from kernels.q16_decode import _as_bytes
from tests.test_native import _bf16, _matrix

HIDDEN, WIDTH, TOP_K, GROUP = 2048, 512, 8, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--tokens", default="64,257,512", help="comma-separated token counts")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--f32", action="store_true", help="f32 tiles instead of bf16")
    p.add_argument("--int8", action="store_true", help="bf16 and int8 tiles side by side (alternating calls)")
    args = p.parse_args()

    import openvino as ov
    from openvino import opset15 as op

    rng = np.random.default_rng(0)
    mats = []
    for out, inp in ((WIDTH, HIDDEN), (WIDTH, HIDDEN), (HIDDEN, WIDTH)):
        m, _ = _matrix(rng, args.experts, out, inp, GROUP, np.float16)
        m[0] = _as_bytes(m[0].output(0)).get_node()
        mats += m
    px = op.parameter([-1, HIDDEN], np.float32, name="x")
    pidx = op.parameter([-1, TOP_K], np.int32, name="idx")
    pw = op.parameter([-1, TOP_K], np.float32, name="weights")
    variants = {"bf16": False, "int8": True} if args.int8 else {"f32" if args.f32 else "bf16": False}
    requests = {}
    for name, int8 in variants.items():
        node = native.factory().create("U4Experts", [px, pidx, pw, op.constant(np.array([0], np.int64)), *mats],
                                       {"q16_rows": 4, "nibbles": True, "bf16": not args.f32, "int8": int8})
        requests[name] = ov.Core().compile_model(ov.Model([node], [px, pidx, pw]), "CPU",
                                                 {"PERFORMANCE_HINT": "LATENCY"}).create_infer_request()
    for tokens in (int(t) for t in args.tokens.split(",")):
        feed = {"x": _bf16(rng.standard_normal((tokens, HIDDEN))).astype(np.float32),
                "idx": np.stack([rng.permutation(args.experts)[:TOP_K] for _ in range(tokens)]).astype(np.int32),
                "weights": rng.random((tokens, TOP_K)).astype(np.float32)}
        times: dict[str, list[float]] = {name: [] for name in requests}
        for request in requests.values():
            request.infer(feed)
        for _ in range(args.reps):
            for name, request in requests.items():
                t0 = time.perf_counter()
                request.infer(feed)
                times[name].append(time.perf_counter() - t0)
        medians = {name: float(np.median(t)) for name, t in times.items()}
        line = ", ".join(f"{name} {medians[name] * 1e3:.1f} ms (min {min(times[name]) * 1e3:.1f})" for name in times)
        ratio = f"; bf16 / int8 {medians['bf16'] / medians['int8']:.2f}" if args.int8 else ""
        print(f"experts {args.experts}, {tokens} tokens: {line}{ratio}", flush=True)


if __name__ == "__main__":
    main()
