"""Decode's memory-bandwidth roofline: what one token must read, and how fast this machine reads.

At batch size 1 a decode step is a read of every weight it uses; its ceiling is

    roofline tok/s = read bandwidth / bytes per token

- `bytes_per_token(model_dir, context)` counts them from the IR: every constant, except the
  routed experts (only top-k of E are read: the experts' stacked constants count k/E of their
  bytes) and the embedding table (one row); plus the recurrent state (GDN conv/ssm, f32, read
  and written) and the attention KV cache at `context` tokens (read; u8 as the CPU plugin keeps
  it, or the profile's `KV_CACHE_PRECISION`). Nothing depends on the dev models' sizes: the
  counts come from the IR's shapes and config.json.
- `read_bandwidth(threads)` is a STREAM-style probe at the engine's thread count: OpenVINO's CPU
  plugin summing a buffer far larger than the caches (`ReduceSum`, `INFERENCE_NUM_THREADS` =
  threads); the best of several passes, as STREAM reports. `copy_bandwidth` is STREAM's
  `copy` (numpy, one thread per slice) for reference.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROBE_BYTES = 1 << 30  # 1 GiB: far beyond any last-level cache


@dataclass(frozen=True)
class TokenBytes:
    weights: int  # constants a decode step reads (experts: top-k of E; embeddings: one row)
    experts_all: int  # the routed experts' constants, all of them (for the report)
    lm_head: int  # the LM head's constants (for per-op shares: it is ~30% of the real model's)
    state: int  # recurrent state read and written per step
    kv: int  # KV cache read at `context` tokens
    context: int

    @property
    def total(self) -> int:
        return self.weights + self.state + self.kv


def _const_bytes(node: Any, seen: set[str]) -> int:
    """Bytes of the constants feeding `node` through constant-only paths (its weight chain)."""
    from kernels.phase_experts import _constant_only

    total, stack, memo = 0, [node], {}
    while stack:
        n = stack.pop()
        if n.get_name() in seen:
            continue
        seen.add(n.get_name())
        if n.get_type_name() == "Constant":
            total += int(n.get_byte_size())
            continue
        stack.extend(src for i in range(n.get_input_size())
                     if _constant_only(src := n.input_value(i).get_node(), memo))
    return total


def bytes_per_token(model_dir: Path, context: int, kv_bytes_per_value: float = 1.0) -> TokenBytes:
    import openvino as ov

    from kernels import grouped_experts

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    model = ov.Core().read_model(model_dir / "openvino_model.xml")
    all_consts = sum(int(n.get_byte_size()) for n in model.get_ordered_ops() if n.get_type_name() == "Constant")

    # Routed experts: the stacked constants of every block's three bmm weights.
    top_k = int(cfg["num_experts_per_tok"])
    experts_all = experts_read = 0
    for block in grouped_experts._blocks(model):
        for w in (block.gate, block.up, block.down):
            b = w.packed.nbytes + w.zero_packed.nbytes + w.scale.nbytes
            experts_all += b
            experts_read += b * top_k // w.shape[0]

    # Embedding table: the Gather fed by input_ids reads one row per token.
    embed_all = embed_read = 0
    ids = next(p for p in model.get_parameters() if p.get_friendly_name() == "input_ids")
    frontier = [t.get_node() for t in ids.output(0).get_target_inputs()]
    while frontier:
        n = frontier.pop()
        if n.get_type_name() == "Gather":
            embed_all = _const_bytes(n, set())
            rows = int(n.get_input_partial_shape(0)[0].get_length())
            embed_read = embed_all // rows
            break
        if n.get_type_name() == "Convert":
            frontier.extend(t.get_node() for t in n.output(0).get_target_inputs())

    # LM head: the MatMul producing the logits.
    logits = model.output("logits").get_node()
    node = logits
    while node.get_type_name() != "MatMul":
        node = node.input_value(0).get_node()
    lm_head = _const_bytes(node, set())

    state = 0
    kv_per_token = 0
    for var in model.get_sinks():
        # batch (and the KV's sequence axis) are dynamic: the static dims are one token's worth
        static = int(np.prod([d.get_length() for d in var.get_input_partial_shape(0) if d.is_static]))
        name = var.get_variable_id()
        if ".key." in name or ".value." in name:
            kv_per_token += static
        else:
            state += 2 * 4 * static  # f32, read and written
    kv = int(kv_per_token * context * kv_bytes_per_value)
    weights = all_consts - experts_all + experts_read - embed_all + embed_read
    return TokenBytes(weights=weights, experts_all=experts_all, lm_head=lm_head, state=state, kv=kv,
                      context=context)


def read_bandwidth(threads: int, size: int = PROBE_BYTES, passes: int = 5) -> float:
    """Bytes/s: the best of `passes` full reads of `size` bytes by the CPU plugin on `threads`."""
    import openvino as ov
    from openvino import opset15 as op

    rows = 4096  # the plugin parallelises a reduction over its output elements: many rows, one sum each
    n = size // 4 // rows * rows
    x = op.parameter([rows, n // rows], np.float32)
    model = ov.Model([op.reduce_sum(x, op.constant(np.array([1], np.int64)), False)], [x], "stream_read")
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                      "INFERENCE_PRECISION_HINT": "f32"})
    req = compiled.create_infer_request()
    data = np.ones((rows, n // rows), np.float32)
    req.set_input_tensor(ov.Tensor(data, shared_memory=True))
    req.infer()  # first touch and warm-up
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        req.infer()
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best


def copy_bandwidth(threads: int, size: int = PROBE_BYTES, passes: int = 5) -> float:
    """Bytes/s moved by STREAM's `copy` (read + write), numpy on `threads` threads."""
    n = size // 8
    src, dst = np.ones(n), np.zeros(n)
    bounds = np.linspace(0, n, threads + 1, dtype=np.int64)

    def part(i: int) -> None:
        np.copyto(dst[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]])

    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, range(threads)))
        for _ in range(passes):
            t0 = time.perf_counter()
            list(pool.map(part, range(threads)))
            best = min(best, time.perf_counter() - t0)
    return 2 * n * 8 / best


def report(model_dir: Path, context: int, threads: int, decode_tok_s: dict[str, float] | None = None,
           kv_bytes_per_value: float = 1.0) -> dict[str, Any]:
    """The roofline as plain data: bandwidths, bytes per token, and each engine's share of it."""
    tb = bytes_per_token(model_dir, context, kv_bytes_per_value)
    bw = read_bandwidth(threads)
    roof = bw / tb.total
    out: dict[str, Any] = {
        "threads": threads,
        "read_bandwidth_bytes_s": bw,
        "copy_bandwidth_bytes_s": copy_bandwidth(threads),
        "bytes_per_token": asdict(tb) | {"total": tb.total},
        "roofline_tok_s": roof,
    }
    if decode_tok_s:
        out["decode"] = {name: {"tok_s": rate, "share": rate / roof} for name, rate in decode_tok_s.items()}
    return out
