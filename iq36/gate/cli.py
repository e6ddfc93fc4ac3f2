"""`iq36 gate` and `iq36 bench` subcommands (registered by `iq36.cli`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from iq36.gate.prompts import CLASSES


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def _classes(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in CLASSES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"prompt classes are {', '.join(CLASSES)}; got {text!r}")
    return values


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "gate", help="paired performance gate bound to a correctness gate",
        description="Candidate vs stock openvino-genai on the same IR: ABBA blocks of fresh processes, "
        "bootstrap LCB of the median block ratio, plus the correctness gate (greedy match with "
        "near-ties, top-1, max KLD, sentinel). Writes DIR/report.json, report.md and plots; "
        "results are appended as runs finish, so --resume continues an interrupted gate.")
    p.add_argument("--model", default="dev-tiny", metavar="NAME_OR_DIR")
    p.add_argument("--baseline", choices=["stock-tuned", "stock-default"], default="stock-tuned",
                   help="stock-tuned: genai with ATTENTION_BACKEND=SDPA and the profile's properties; "
                   "stock-default: genai library defaults (default: stock-tuned)")
    p.add_argument("--buckets", type=_ints, default=(512, 1024, 2048, 4096), metavar="N,N,…",
                   help="prompt lengths in tokens (default: 512,1024,2048,4096)")
    p.add_argument("--classes", type=_classes, default=CLASSES, metavar="C,C,…",
                   help=f"prompt classes (default: {','.join(CLASSES)})")
    p.add_argument("--blocks", type=int, default=8, help="ABBA blocks, >= 8 unless --smoke (default: 8)")
    p.add_argument("--output-tokens", type=int, default=128, help="generated tokens per timed run (default: 128)")
    p.add_argument("--correctness-tokens", type=int, default=512,
                   help="greedy tokens compared per case (default: 512)")
    p.add_argument("--profile", default="cpu", metavar="NAME_OR_PATH", help="candidate profile (default: cpu)")
    p.add_argument("--near-tie-eps", type=float, default=None, metavar="LOGITS",
                   help="stock top-1/top-2 margin below which a greedy divergence is a near-tie "
                   "(default: 0.02; 0 in f32 reference mode)")
    p.add_argument("--no-near-boundary", action="store_true", help="skip the bucket-1/-7/half+1 prefill checks")
    p.add_argument("--perturb", action="store_true",
                   help="corrupt the candidate on purpose (proves the correctness gate fails)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--smoke", action="store_true", help="machinery check: fewer blocks allowed, claims nothing")
    p.add_argument("--resume", action="store_true", help="continue the gate already in DIR")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=cmd_gate)

    p = sub.add_parser("bench", help="quick single-engine numbers (prefill/decode tok/s, TTFT)",
                       description="Time one engine in this process: one untimed warm-up, then RUNS cold runs "
                       "per length. For claims use `iq36 gate`.")
    p.add_argument("--model", default="dev-tiny", metavar="NAME_OR_DIR")
    p.add_argument("--engine", choices=["candidate", "stock-tuned", "stock-default"], default="candidate")
    p.add_argument("--profile", default="cpu", metavar="NAME_OR_PATH")
    p.add_argument("--lengths", type=_ints, default=(1024,), metavar="N,N,…")
    p.add_argument("--prompt-class", choices=CLASSES, default="prefill-shape")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ops", action="store_true",
                   help="candidate only: per-op-type time of one prefill and one decode step (PERF_COUNT)")
    p.add_argument("--roofline", action="store_true",
                   help="also probe this machine's read bandwidth (STREAM-style, the engine's thread count) "
                   "and report decode against the memory-bandwidth roofline")
    p.set_defaults(func=cmd_bench)


def _fail(message: str) -> None:
    print(f"iq36: error: {message}", file=sys.stderr)
    raise SystemExit(1)


def cmd_gate(args: argparse.Namespace) -> None:
    from iq36.cli import resolve_model
    from iq36.gate.correctness import DEFAULT_EPS
    from iq36.gate.run import GateError, GateOptions, run

    model_dir = resolve_model(args.model)
    opts = GateOptions(
        model_dir=str(model_dir), baseline=args.baseline, buckets=args.buckets, classes=args.classes,
        blocks=args.blocks, output_tokens=args.output_tokens, correctness_tokens=args.correctness_tokens,
        profile=args.profile, smoke=args.smoke, seed=args.seed,
        eps=DEFAULT_EPS if args.near_tie_eps is None else args.near_tie_eps,
        near_boundary=not args.no_near_boundary, perturb=args.perturb,
    )
    try:
        report = run(opts, args.out, resume=args.resume, progress=not args.quiet)
    except GateError as exc:
        _fail(str(exc))
    print(f"verdict: {report['verdict']}")
    for b in report["buckets"]:
        print(f"bucket {b['bucket']}: prefill LCB {b['prefill_lcb']}, decode LCB {b['decode_lcb']}, "
              f"total LCB {b['total_lcb']}")
    print(args.out / "report.md")


def cmd_bench(args: argparse.Namespace) -> None:
    import numpy as np

    from iq36.cli import resolve_model
    from iq36.gate.session import Case, SessionSpec, run

    model_dir = resolve_model(args.model)
    if args.ops:
        _op_tables(model_dir, args)
        return
    engine = "candidate" if args.engine == "candidate" else "stock"
    cases = [Case(n, args.prompt_class, n, f"bench:{n}:{i}", args.output_tokens)
             for n in args.lengths for i in range(args.runs)]
    rows: list[dict[str, Any]] = []
    run(SessionSpec(engine=engine, engine_config=args.engine, model_dir=str(model_dir),
                    profile=args.profile, cases=cases), rows.append)
    for n in args.lengths:
        mine = [r for r in rows if r["length"] == n]
        summary = {k: float(np.median([r[k] for r in mine])) for k in ("prefill_tok_s", "decode_tok_s", "ttft_s")}
        print(json.dumps({"engine": args.engine, "length": n, "runs": len(mine), **summary,
                          "peak_rss_bytes": max(r["peak_rss_bytes"] for r in mine)}))
        if args.roofline:
            from iq36.gate import roofline
            from iq36.profile import load

            threads = int(load(args.profile).engine.properties.get("INFERENCE_NUM_THREADS", 0)) or len(
                os.sched_getaffinity(0))
            # decode runs between n and n + output tokens of context: count the KV at the midpoint
            print(json.dumps({"length": n, "roofline": roofline.report(
                model_dir, n + args.output_tokens // 2, threads, {args.engine: summary["decode_tok_s"]})}))


def _op_tables(model_dir: Path, args: argparse.Namespace) -> None:
    """Per-op-type time of one prefill and one decode step of the candidate's compiled graph."""
    import msgspec

    from iq36.gate.prompts import build
    from iq36.profile import load
    from worker.engine.candidate import CandidateEngine
    from worker.tokenizer import ModelTokenizer

    if args.engine != "candidate":
        _fail("--ops profiles the candidate's graph; stock genai does not expose its infer request")
    base = load(args.profile)
    section = msgspec.structs.replace(base.engine, properties={**base.engine.properties, "PERF_COUNT": True})
    profile = msgspec.structs.replace(base, engine=section)
    tokenizer = ModelTokenizer(model_dir)
    for n in args.lengths:
        prompt = list(build(lambda t: tokenizer.encode(t, add_special_tokens=False), n, args.prompt_class,
                            salt=f"ops:{n}").ids)
        engine = CandidateEngine(model_dir, profile, tokenizer)  # fresh request: counters start at zero
        try:
            rows = engine.forced_logits(prompt, [prompt[-1], prompt[-1]])
            next(rows)  # the prefill ran
            prefill = engine.op_profile()  # seconds per op type over every inference so far
            next(rows)  # one decode step
            after = engine.op_profile()
        finally:
            engine.close()
        decode = {op: max(0.0, t - prefill.get(op, 0.0)) for op, t in after.items()}
        for phase, table in (("prefill", prefill), ("decode-step", decode)):
            ranked = sorted(table.items(), key=lambda kv: -kv[1])
            total = sum(table.values()) or 1.0
            print(json.dumps({"length": n, "phase": phase, "total_ms": round(total * 1000, 2),
                              "share": {op: round(v / total, 4) for op, v in ranked[:12]}}))
