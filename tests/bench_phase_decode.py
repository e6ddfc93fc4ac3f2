"""Probe (not a test): decode-step and prefill time of graph variants, side by side in one process.

    .venv/bin/python -m tests.bench_phase_decode --model dev-bench-256 --modes plain,phase,if

Each mode is the locked IR + `last_token_logits`, then: `plain` nothing more; `phase` the
`phase_experts` kernel; `native` the `native_experts` kernel (`native-all`: its op takes decode
rows too); `if` every MoE block in both branches of an `If` (the same block twice: what the `If`
alone costs). Suffixes add kernels: `+head` the `lm_head_u8` kernel, `+gdn` the `native_gdn`
kernel, `+q16` the `q16_decode` kernel (`plain+head`, `native+gdn`, `native+gdn+q16`), applied
after the base's rewrite in the order given. All
modes are compiled in this one process and timed in interleaved ABBA rounds (a prefill of
`--tokens`, then `--decode` single-token steps each), so the machine's drift hits every mode
alike. Prints each mode's median prefill time and median decode step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dev-bench-256")
    p.add_argument("--modes", default="plain,phase")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each mode runs twice per round)")
    p.add_argument("--threads", type=int, default=0, help="INFERENCE_NUM_THREADS (0: the plugin's choice)")
    args = p.parse_args()

    import openvino as ov

    from iq36.cli import resolve_model
    from kernels import last_token_logits, lm_head_u8, native, native_experts, native_gdn, phase_experts, q16_decode
    from worker.reference import stateful_feed

    core = ov.Core()
    if native.cpu_supported():
        native.register(core)
    xml = resolve_model(args.model) / "openvino_model.xml"
    modes = args.modes.split(",")
    requests = {}
    names: dict[str, set[str]] = {}
    for mode in modes:
        model = last_token_logits.apply(core.read_model(xml))
        base, *extras = mode.split("+")
        if base == "phase":
            phase_experts.apply(model)
        elif base == "native":
            native_experts.apply(model)
        elif base == "native-all":
            native_experts.apply_all(model)
        elif base == "if":
            phase_experts.wrap_blocks(model, 2, None)
        elif base != "plain":
            raise SystemExit(f"unknown mode {mode!r}")
        for extra in extras:
            if extra == "head":
                lm_head_u8.apply(model)
            elif extra == "gdn":
                native_gdn.apply(model)
            elif extra == "q16":
                q16_decode.apply(model)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
        props: dict[str, object] = {"PERFORMANCE_HINT": "LATENCY"}
        if args.threads:
            props["INFERENCE_NUM_THREADS"] = args.threads
        requests[mode] = core.compile_model(model, "CPU", props).create_infer_request()
        names[mode] = {port.get_any_name() for port in model.inputs}
    rng = np.random.default_rng(0)

    def once(mode: str) -> tuple[float, list[float]]:
        req = requests[mode]
        req.reset_state()
        ids = rng.integers(1000, 100000, args.tokens).astype(np.int64)
        t0 = time.perf_counter()
        req.infer(stateful_feed(ids, 0, names[mode], 0))
        prefill = time.perf_counter() - t0
        steps = []
        for k in range(args.decode):
            t0 = time.perf_counter()
            req.infer(stateful_feed(np.array([7 + k], np.int64), args.tokens + k, names[mode], 1 + k))
            steps.append(time.perf_counter() - t0)
        return prefill, steps

    for mode in modes:
        once(mode)  # warm-up
    prefills: dict[str, list[float]] = {m: [] for m in modes}
    steps: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes + modes[::-1]:
            pf, st = once(mode)
            prefills[mode].append(pf)
            steps[mode].extend(st)
    for mode in modes:
        print(f"{mode:11s} prefill {args.tokens} tokens {np.median(prefills[mode]):6.2f} s "
              f"({args.tokens / np.median(prefills[mode]):6.1f} tok/s), decode step "
              f"{np.median(steps[mode]) * 1000:6.2f} ms (p90 {np.percentile(steps[mode], 90) * 1000:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
