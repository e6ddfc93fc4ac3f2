"""Benchmark (not a test): a prefill chunk's last rows past the plugin's 64-row blocks, on the
plugin's compressed matmul against `q16_tail_tiles` (the op's bf16 tiles), one dense u4 matmul.

    .venv/bin/python -m tests.bench_tail_rows --rows 8192 --inputs 2048 --tails 0,5,16,32,48 [--tail-rows 64] [--int8]

Two compiled graphs of the same rewritten matmul (`q16_decode.apply`): tails of at most MAX_ROWS
rows on the op (as before) and of at most TAIL_ROWS on its tiles. Each takes 256 + t rows,
alternating call by call; prints the medians. `--int8`: a third graph, the tiles on int8
activations (`tile_int8`, AVX512-VNNI). Needs AVX512-BF16 and the plugin in bf16 (its default
there). docs/perf-log.md, sessions 31 and 32.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192, help="weight rows (outputs; default 8192)")
    p.add_argument("--inputs", type=int, default=2048, help="inputs per row, a multiple of 128 (default 2048)")
    p.add_argument("--tails", default="0,1,4,5,8,16,24,32,40,48,56", help="comma-separated t: 256 + t rows")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--tail-rows", type=int, default=0,
                   help="tails of at most this many rows on the tiles (default: q16_decode.TAIL_ROWS; 64: every tail)")
    p.add_argument("--int8", action="store_true", help="also the tiles on int8 activations (tile_int8)")
    args = p.parse_args()

    import openvino as ov
    from openvino import opset15 as op

    from kernels import native, q16_decode
    from tests.test_q16_decode import _u4

    if not native.bf16_supported():
        raise SystemExit("the op's tiles need a CPU with AVX512-BF16")
    n, k, group = args.rows, args.inputs, 128
    rng = np.random.default_rng(0)
    core = ov.Core()
    native.register(core)
    (wc, _), (zc, _) = _u4(rng, (n, k // group, group)), _u4(rng, (n, k // group, 1))
    s = op.constant((rng.random((n, k // group, 1)) * 0.05 + 0.01).astype(np.float16))

    def compiled(tail_rows: int, tile_int8: bool = False) -> object:
        deq = op.multiply(op.subtract(op.convert(wc, np.float16), op.convert(zc, np.float16)), s)
        weight = op.convert(op.reshape(deq, op.constant(np.array([n, k])), False), np.float32)
        x = op.parameter([-1, k], np.float32, name="x")
        model = ov.Model([op.matmul(x, weight, False, True)], [x])
        q16_decode.apply(model, min_bytes=0, residual=False, tail_rows=tail_rows, tile_int8=tile_int8)
        return core.compile_model(model, "CPU", {"PERFORMANCE_HINT": "LATENCY"}).create_infer_request()

    requests = {"plugin": compiled(q16_decode.MAX_ROWS), "tiles": compiled(args.tail_rows or q16_decode.TAIL_ROWS)}
    if args.int8:
        requests["int8"] = compiled(args.tail_rows or q16_decode.TAIL_ROWS, tile_int8=True)
    for t in (int(v) for v in args.tails.split(",")):
        x = rng.standard_normal((256 + t, k)).astype(np.float32)
        times: dict[str, list[float]] = {name: [] for name in requests}
        for request in requests.values():
            request.infer({"x": x})
        for rep in range(args.reps):
            for name in (list(requests) if rep % 2 == 0 else list(requests)[::-1]):
                t0 = time.perf_counter()
                requests[name].infer({"x": x})
                times[name].append((time.perf_counter() - t0) * 1e3)
        a, b = np.median(times["plugin"]), np.median(times["tiles"])
        line = f"256 + {t:2d} rows: plugin {a:6.2f} ms, q16_tail_tiles {b:6.2f} ms ({a - b:+.2f})"
        if args.int8:
            c = np.median(times["int8"])
            line += f", int8 tiles {c:6.2f} ms ({a - c:+.2f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
