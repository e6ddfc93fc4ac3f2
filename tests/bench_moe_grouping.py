"""Probe (not a test): one routed-experts block, dense as exported vs token-grouped per expert.

    .venv/bin/python -m tests.bench_moe_grouping --experts 64 --tokens 1024 [--kinds dense,grouped,loop]

Issue #7 groundwork. The exported IR computes the routed experts densely (every token through
every expert, `aten::bmm`, then weighted by the scattered top-k routing matrix); the CPU plugin
rewrites that pattern into `GatherMatmulCompressed`. This builds one block at the real per-layer
dims (hidden 2048, expert 512, top-8, u4 asym group-128 weights) two ways, with the same weights:

- `dense`: the exported pattern (here compiled as dense FCs: this synthetic graph is not fused
  into `GatherMatmulCompressed`, so it shows the cost of all experts, not the plugin's path);
- `grouped`: per expert, gather the tokens routed to it (`NonZero`, `GatherND`), run its three
  compressed FCs on those rows only (static per-expert weights), weight them and scatter-add
  them back (`ScatterNDUpdate`, reduction sum) — every expert's weights read once per chunk;
- `loop`: the same in one `Loop` over the experts, gathering each expert's u4 weights from the
  stacked constants at run time (decompressed per iteration; no per-expert weight copies).

Prints the max difference between the two outputs and the median of interleaved timings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

HIDDEN, EXPERT, TOP_K, GROUP = 2048, 512, 8, 128


class Weights:
    """Random u4 weights + u4 zero points + f32 scales per expert, built once, sliced per expert."""

    def __init__(self, experts: int, seed: int = 0) -> None:
        self.experts = experts
        self._rng = np.random.default_rng(seed)
        self._raw: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def node(self, name: str, expert: int | None, rows: int, cols: int) -> Any:
        """The decompression subgraph of one projection: [experts?, rows, cols] f32."""
        import openvino as ov
        import openvino.opset15 as op

        if name not in self._raw:
            g = cols // GROUP
            rng = self._rng
            self._raw[name] = (rng.integers(0, 16, size=(self.experts, rows, g, GROUP), dtype=np.uint8),
                               rng.integers(0, 16, size=(self.experts, rows, g, 1), dtype=np.uint8),
                               (rng.random((self.experts, rows, g, 1), dtype=np.float32) * 0.02).astype(np.float32))
        w8, z8, scale = self._raw[name]
        if expert is not None:
            w8, z8, scale = w8[expert], z8[expert], scale[expert]
        prefix = list(w8.shape[:-3])
        w = op.convert(_u4(np.ascontiguousarray(w8)), ov.Type.f32)
        zp = op.convert(_u4(np.ascontiguousarray(z8)), ov.Type.f32)
        d = op.multiply(op.subtract(w, zp), op.constant(np.ascontiguousarray(scale)))
        return op.reshape(d, op.constant(np.array([*prefix, rows, cols], np.int64)), False)


def _u4(values: np.ndarray) -> Any:
    import openvino as ov
    import openvino.opset15 as op

    tensor = ov.Tensor(ov.Type.u4, list(values.shape))
    flat = values.reshape(-1)
    tensor.data.view(np.uint8).reshape(-1)[:] = flat[0::2] | (flat[1::2] << 4)
    return op.constant(tensor)


def dense_block(w: Weights, x: Any, idx: Any, wts: Any) -> Any:
    import openvino.opset15 as op

    e = w.experts
    xe = op.reshape(op.tile(x, op.constant(np.array([e, 1], np.int64))),
                    op.constant(np.array([e, -1, HIDDEN], np.int64)), False)
    gate = op.matmul(xe, w.node("gate", None, EXPERT, HIDDEN), False, True)
    up = op.matmul(xe, w.node("up", None, EXPERT, HIDDEN), False, True)
    down = op.matmul(op.multiply(op.swish(gate), up), w.node("down", None, HIDDEN, EXPERT), False, True)
    tokens = op.unsqueeze(op.gather(op.shape_of(x), op.constant(0), op.constant(0)), op.constant(0))
    zeros = op.broadcast(op.constant(np.float32(0)), op.concat([tokens, op.constant(np.array([e], np.int64))], 0))
    routing = op.scatter_elements_update(zeros, idx, wts, op.constant(1))  # [T, E]
    per_expert = op.unsqueeze(op.transpose(routing, op.constant(np.array([1, 0]))), op.constant(2))
    return op.reduce_sum(op.multiply(down, per_expert), op.constant(0), False)


def grouped_block(w: Weights, x: Any, idx: Any, wts: Any) -> Any:
    import openvino as ov
    import openvino.opset15 as op

    y = op.multiply(x, op.constant(np.float32(0)))
    for e in range(w.experts):
        hit = op.equal(idx, op.constant(np.int64(e)))  # [T, K]
        weight = op.reduce_sum(op.multiply(op.convert(hit, ov.Type.f32), wts), op.constant(1), False)  # [T]
        rows = op.transpose(op.non_zero(op.reduce_logical_or(hit, op.constant(1), False), ov.Type.i64),
                            op.constant(np.array([1, 0])))  # [n, 1]
        xs = op.gather_nd(x, rows)
        gate = op.matmul(xs, w.node("gate", e, EXPERT, HIDDEN), False, True)
        up = op.matmul(xs, w.node("up", e, EXPERT, HIDDEN), False, True)
        down = op.matmul(op.multiply(op.swish(gate), up), w.node("down", e, HIDDEN, EXPERT), False, True)
        scaled = op.multiply(down, op.unsqueeze(op.gather_nd(weight, rows), op.constant(1)))
        y = op.scatter_nd_update(y, rows, scaled, reduction="sum")
    return y


def loop_block(w: Weights, x: Any, idx: Any, wts: Any) -> Any:
    """`grouped`, but one `Loop` over the experts that gathers expert i's u4 weights from the
    stacked constants at run time (no per-expert copies of the weights in the graph)."""
    import openvino as ov
    import openvino.opset15 as op

    def stacked(name: str, rows: int, cols: int, index: Any) -> Any:
        w.node(name, None, rows, cols)  # makes sure the raw weights exist
        w8, z8, scale = w._raw[name]
        q = op.convert(op.gather(_u4(w8), index, op.constant(0)), ov.Type.f32)
        zp = op.convert(op.gather(_u4(z8), index, op.constant(0)), ov.Type.f32)
        d = op.multiply(op.subtract(q, zp), op.gather(op.constant(scale), index, op.constant(0)))
        return op.reshape(d, op.constant(np.array([rows, cols], np.int64)), False)

    i = op.parameter([], np.int64, name="i")
    bx = op.parameter([-1, HIDDEN], np.float32, name="bx")
    bidx = op.parameter([-1, TOP_K], np.int64, name="bidx")
    bw = op.parameter([-1, TOP_K], np.float32, name="bw")
    by = op.parameter([-1, HIDDEN], np.float32, name="by")
    hit = op.equal(bidx, i)
    weight = op.reduce_sum(op.multiply(op.convert(hit, ov.Type.f32), bw), op.constant(1), False)
    rows = op.transpose(op.non_zero(op.reduce_logical_or(hit, op.constant(1), False), ov.Type.i64),
                        op.constant(np.array([1, 0])))
    xs = op.gather_nd(bx, rows)
    gate = op.matmul(xs, stacked("gate", EXPERT, HIDDEN, i), False, True)
    up = op.matmul(xs, stacked("up", EXPERT, HIDDEN, i), False, True)
    down = op.matmul(op.multiply(op.swish(gate), up), stacked("down", HIDDEN, EXPERT, i), False, True)
    scaled = op.multiply(down, op.unsqueeze(op.gather_nd(weight, rows), op.constant(1)))
    y_next = op.scatter_nd_update(by, rows, scaled, reduction="sum")
    keep_going = op.constant(True)
    loop = op.loop(op.constant(np.int64(w.experts)), op.constant(True))
    loop.set_function(ov.Model([keep_going, y_next], [i, bx, bidx, bw, by]))
    loop.set_special_body_ports([0, 0])  # input 0: the iteration number; output 0: the condition
    loop.set_invariant_input(bx, x.output(0))
    loop.set_invariant_input(bidx, idx.output(0))
    loop.set_invariant_input(bw, wts.output(0))
    loop.set_merged_input(by, op.broadcast(op.constant(np.float32(0)), op.shape_of(x)).output(0), y_next.output(0))
    return loop.get_iter_value(y_next.output(0), -1)


BLOCKS = {"dense": dense_block, "grouped": grouped_block, "loop": loop_block}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kinds", default="dense,grouped", help=f"of {', '.join(BLOCKS)}; the first is the reference")
    args = p.parse_args()
    kinds = args.kinds.split(",")

    import openvino as ov
    import openvino.opset15 as op

    rng = np.random.default_rng(1)
    t, e = args.tokens, args.experts
    feeds = {"x": rng.standard_normal((t, HIDDEN), dtype=np.float32),
             "idx": np.stack([rng.choice(e, TOP_K, replace=False) for _ in range(t)]).astype(np.int64),
             "w": rng.random((t, TOP_K), dtype=np.float32)}
    weights = Weights(e)
    core = ov.Core()
    requests, outputs = {}, {}
    for kind in kinds:
        x = op.parameter([-1, HIDDEN], np.float32, name="x")
        idx = op.parameter([-1, TOP_K], np.int64, name="idx")
        wts = op.parameter([-1, TOP_K], np.float32, name="w")
        model = ov.Model([BLOCKS[kind](weights, x, idx, wts)], [x, idx, wts], kind)
        t0 = time.perf_counter()
        compiled = core.compile_model(model, "CPU", {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"})
        requests[kind] = compiled.create_infer_request()
        outputs[kind] = requests[kind].infer(feeds)[0].copy()
        print(f"{kind}: compiled in {time.perf_counter() - t0:.1f} s")
    ref = kinds[0]
    for kind in kinds[1:]:
        diff = float(np.abs(outputs[ref] - outputs[kind]).max())
        print(f"max |{ref} - {kind}| = {diff:.3g} (output scale {float(np.abs(outputs[ref]).max()):.3g})")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for run in range(args.runs):
        for kind in kinds if run % 2 == 0 else kinds[::-1]:
            t0 = time.perf_counter()
            requests[kind].infer(feeds)
            times[kind].append(time.perf_counter() - t0)
    medians = ", ".join(f"{kind} {statistics.median(times[kind]) * 1000:.0f} ms" for kind in kinds)
    print(f"experts {e}, tokens {t}: {medians}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
