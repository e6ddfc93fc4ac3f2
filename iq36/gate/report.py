"""The gate's outputs: `report.json` (SPEC §5 structure), `report.md` for people, PNG plots."""

from __future__ import annotations

import functools
import json
import platform
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from iq36.gate.stats import block_ratio, bootstrap_median, jitter

JITTER_MAX = 1.25
CLIFF_MIN = 0.90  # near-boundary prefill rate / exact bucket's rate


def _final_runs(records: list[dict[str, Any]], sessions: list[Any]) -> list[dict[str, Any]]:
    """Case records of completed sessions; of a session that reran, only its last full run."""
    done = {r["session_done"] for r in records if "session_done" in r}
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if "session" in r:
            by_session[r["session"]].append(r)
    out = []
    for s in sessions:
        if s.key in done:
            out.extend(by_session[s.key][-len(s.cases):])
    return out


def machine() -> dict[str, Any]:
    import psutil

    flags: list[str] = []
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx")))
                break
    except OSError:
        pass
    return {"cpu": model, "isa": flags, "logical_cpus": psutil.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30), "platform": platform.platform()}


@functools.cache
def _graph_hash(model_dir: str, profile: str, perturb: bool) -> str:
    """The candidate's specialised graph (kernels/graph_hash.py): the profile's rewrites of the
    locked IR, as the candidate engine builds them (the perturbed gate adds its kernel)."""
    import openvino as ov

    from iq36.profile import load
    from kernels.graph_hash import structure_hash
    from worker.engine.candidate import specialised_model

    prof = load(profile)
    if perturb:  # as iq36/gate/correctness.py runs the candidate
        prof = msgspec.structs.replace(prof, kernels={**prof.kernels, "perturb_embeddings": True})
    model, _, decode = specialised_model(ov.Core(), Path(model_dir), prof)
    return structure_hash(model, *([decode] if decode is not None else []))


def _identities(opts: Any) -> dict[str, Any]:
    from iq36.gate.session import engine_profile
    from iq36.profile import load
    from worker.identity import runtime_identity

    base = load(opts.profile)
    manifest = json.loads((Path(opts.model_dir) / "manifest.json").read_text())
    return {
        "model": {"dir": opts.model_dir, "fingerprint": manifest["fingerprint"]},
        "graph": _graph_hash(opts.model_dir, opts.profile, opts.perturb),
        "runtime": runtime_identity(),
        "profiles": {
            "candidate": {"name": base.name, "hash": base.hash},
            "baseline": msgspec.to_builtins(engine_profile(base, opts.baseline).engine),
        },
        "machine": machine(),
    }


def _median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.median(vals)) if vals else None


def near_boundary(near: list[dict[str, Any]], exact: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each near-boundary length's prefill rate against the exact bucket's (`exact`: one prompt
    class's runs at the bucket), per engine, two ways: `<role>_vs_bucket`, the median rate of
    the length's runs over the median of the exact runs, and `<role>_vs_bucket_paired`, the
    median over sessions of each session's own ratio (its run of the length over its exact runs'
    median; `<role>_pairs` sessions had both). A session is one process whose runs lie minutes
    apart, so the pairing leaves out what the machine does between sessions (the development VMs
    slow down by 20-40% for a minute or two at times: two `dev-bench-256` gates of the same
    prefill code, the unpaired ratios 0.82-0.89 and 0.86-0.87 at 513 tokens, the paired 0.88-0.91
    and 0.88-0.90; docs/perf-log.md, session 44). The cliff flag reads the paired ratio where any
    session has both runs."""
    out = []
    for length in sorted({r["length"] for r in near}):
        entry: dict[str, Any] = {"length": length}
        for role in ("candidate", "baseline"):
            mine = [r for r in near if r["length"] == length and (r["engine"] == "candidate") == (role == "candidate")]
            ref = [r for r in exact if (r["engine"] == "candidate") == (role == "candidate")]
            rate, ref_rate = _median([r["prefill_tok_s"] for r in mine]), _median([r["prefill_tok_s"] for r in ref])
            entry[f"{role}_prefill_tok_s"] = rate
            entry[f"{role}_vs_bucket"] = rate / ref_rate if rate and ref_rate else None
            by_session: dict[str, list[float]] = defaultdict(list)
            for r in ref:
                by_session[r["session"]].append(r["prefill_tok_s"])
            paired = [r["prefill_tok_s"] / float(np.median(by_session[r["session"]]))
                      for r in mine if by_session.get(r["session"])]
            entry[f"{role}_vs_bucket_paired"] = _median(paired)
            entry[f"{role}_pairs"] = len(paired)
        ratio = entry["candidate_vs_bucket_paired"]
        if ratio is None:
            ratio = entry["candidate_vs_bucket"]
        entry["cliff"] = ratio is not None and ratio < CLIFF_MIN
        out.append(entry)
    return out


def _case(opts: Any, bucket: int, cls: str, runs: list[dict[str, Any]], corr: dict[str, Any] | None,
          near: list[dict[str, Any]]) -> dict[str, Any]:
    blocks: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: {"cand": [], "base": []})
    for r in runs:
        blocks[r["block"]]["cand" if r["engine"] == "candidate" else "base"].append(r)
    full = [b for b in blocks.values() if b["cand"] and b["base"]]
    ratios: dict[str, list[float]] = {"prefill": [], "decode": [], "total": []}
    for b in full:
        ratios["prefill"].append(block_ratio([r["prefill_tok_s"] for r in b["cand"]],
                                             [r["prefill_tok_s"] for r in b["base"]]))
        ratios["decode"].append(block_ratio([r["decode_tok_s"] for r in b["cand"]],
                                            [r["decode_tok_s"] for r in b["base"]]))
        ratios["total"].append(block_ratio([r["total_s"] for r in b["cand"]],
                                           [r["total_s"] for r in b["base"]], higher_is_better=False))
    bounds = {k: bootstrap_median(v, seed=opts.seed).as_dict() for k, v in ratios.items() if v}
    cand = [r for r in runs if r["engine"] == "candidate"]
    base = [r for r in runs if r["engine"] != "candidate"]
    jit = [jitter(r["tpot_s"]) for r in cand]
    jit = [j for j in jit if np.isfinite(j)]

    def raw(rs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"prefill_tok_s": _median([r["prefill_tok_s"] for r in rs]),
                "decode_tok_s": _median([r["decode_tok_s"] for r in rs]),
                "ttft_s": _median([r["ttft_s"] for r in rs]),
                "total_s": _median([r["total_s"] for r in rs]),
                "runs": len(rs), "cached_tokens": sum(r["cached_tokens"] for r in rs)}

    near_out = near_boundary(near, runs)
    correctness = None
    if corr is not None:
        correctness = {k: corr.get(k) for k in (
            "greedy_match", "first_divergence", "near_tie_divergences", "hard_divergences", "top1_agreement", "max_kld",
            "sentinel_stock", "sentinel_candidate", "passed", "positions", "eps", "exact")}
    return {
        "bucket": bucket,
        "prompt_class": cls,
        "prompt_tokens": bucket,
        "baseline": opts.baseline,
        "prefill_lcb": bounds.get("prefill", {}).get("lcb"),
        "decode_lcb": bounds.get("decode", {}).get("lcb"),
        "total_lcb": bounds.get("total", {}).get("lcb"),
        "bounds": bounds,
        "block_ratios": ratios,
        "raw": {"candidate": raw(cand), "baseline": raw(base)},
        "jitter": {"max": max(jit) if jit else None, "median": _median(jit), "limit": JITTER_MAX,
                   "ok": bool(jit) and max(jit) <= JITTER_MAX},
        "peak_rss_bytes": max((r["peak_rss_bytes"] for r in cand), default=None),
        "baseline_peak_rss_bytes": max((r["peak_rss_bytes"] for r in base), default=None),
        "min_available_bytes": min((r["min_available_bytes"] for r in runs), default=None),
        "near_boundary": near_out,
        "correctness": correctness,
    }


def build_report(opts: Any, out: Path, sessions: list[Any]) -> dict[str, Any]:
    records = _final_runs(_read(out / "runs.jsonl"), sessions)
    corr = {(r["bucket"], r["prompt_class"]): r for r in _read(out / "correctness.jsonl")}
    cases = []
    for bucket in opts.buckets:
        near = [r for r in records if r["bucket"] == bucket and r["output_tokens"] == 1]
        for cls in opts.classes:
            runs = [r for r in records if r["bucket"] == bucket and r["prompt_class"] == cls
                    and r["length"] == bucket and r["output_tokens"] > 1]
            cases.append(_case(opts, bucket, cls, runs, corr.get((bucket, cls)), near))
    buckets = []
    for bucket in opts.buckets:
        mine = [c for c in cases if c["bucket"] == bucket]
        worst = {k: min((c[k] for c in mine if c[k] is not None), default=None)
                 for k in ("prefill_lcb", "decode_lcb", "total_lcb")}
        buckets.append({"bucket": bucket, **worst})
    bandwidth = _bandwidth(out)
    if bandwidth is not None:
        _add_roofline(opts, cases, bandwidth)
    correctness_ok = all(c["correctness"] is not None and c["correctness"]["passed"] for c in cases)
    complete = all(c["raw"]["candidate"]["runs"] >= 2 * opts.blocks for c in cases)
    verdict = "smoke" if opts.smoke else ("claimable" if correctness_ok and complete else "not-claimable")
    return {
        "verdict": verdict,
        "smoke": opts.smoke,
        "baseline": opts.baseline,
        "correctness_passed": correctness_ok,
        "complete": complete,
        "options": msgspec.to_builtins(opts),
        "identities": _identities(opts),
        "buckets": buckets,
        "cases": cases,
        "bandwidth": bandwidth,
    }


def _bandwidth(out: Path) -> dict[str, Any] | None:
    """roofline.json (the probe before the first run) with the read-bandwidth samples taken
    before each block (bandwidth.jsonl); the roofline uses the median of all of them."""
    if not (out / "roofline.json").exists():
        return None
    first = json.loads((out / "roofline.json").read_text())
    samples = [first["read_bandwidth_bytes_s"]] + [r["read_bandwidth_bytes_s"] for r in _read(out / "bandwidth.jsonl")]
    return {**first, "first_read_bandwidth_bytes_s": first["read_bandwidth_bytes_s"],
            "read_samples_bytes_s": samples, "read_bandwidth_bytes_s": float(np.median(samples))}


def _add_roofline(opts: Any, cases: list[dict[str, Any]], bandwidth: dict[str, Any]) -> None:
    """Each case's decode rates as a share of the memory-bandwidth roofline at its context
    (iq36/gate/roofline.py: bytes one token must read / measured read bandwidth)."""
    from iq36.gate import roofline

    per_bucket: dict[int, Any] = {}
    for c in cases:
        context = c["bucket"] + opts.output_tokens // 2  # decode runs from bucket to bucket + output
        if c["bucket"] not in per_bucket:
            per_bucket[c["bucket"]] = roofline.bytes_per_token(Path(opts.model_dir), context)
        tb = per_bucket[c["bucket"]]
        roof = bandwidth["read_bandwidth_bytes_s"] / tb.total
        rates = {role: c["raw"][role]["decode_tok_s"] for role in ("candidate", "baseline")}
        c["roofline"] = {"bytes_per_token": tb.total, "lm_head_bytes": tb.lm_head, "tok_s": roof,
                         **{f"{role}_share": (rate / roof if rate else None) for role, rate in rates.items()}}


def _read(path: Path) -> list[dict[str, Any]]:
    from iq36.gate.run import _read_jsonl

    return _read_jsonl(path)


def _samples(bw: dict[str, Any]) -> str:
    samples = bw.get("read_samples_bytes_s") or [bw["read_bandwidth_bytes_s"]]
    if len(samples) == 1:
        return "one probe before the runs"
    return (f"median of {len(samples)} probes, one before the runs and one in each block: "
            f"{min(samples) / 1e9:.1f}-{max(samples) / 1e9:.1f} GB/s")


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def render_markdown(report: dict[str, Any]) -> str:
    o = report["options"]
    ident = report["identities"]
    lines = [
        "# iq36 gate report",
        "",
        f"**Verdict: {report['verdict']}**" + (" — a smoke run: it checks the machinery and claims nothing."
                                               if report["smoke"] else ""),
        "",
        f"- model: `{ident['model']['dir']}` ({ident['model']['fingerprint'][:19]}…)",
        f"- candidate profile: `{ident['profiles']['candidate']['name']}` "
        f"({ident['profiles']['candidate']['hash'][:19]}…); baseline: `{report['baseline']}` = "
        f"`{json.dumps(ident['profiles']['baseline'])}`",
        f"- candidate graph (the profile's rewrites of the IR, `kernels/graph_hash.py`): "
        f"`{ident.get('graph', 'not recorded')}`",
        f"- runtime: openvino {ident['runtime']['openvino']}",
        f"- machine: {ident['machine']['cpu']}, {ident['machine']['logical_cpus']} CPUs, "
        f"ISA {' '.join(ident['machine']['isa']) or '—'}",
        f"- {o['blocks']} ABBA blocks, {o['output_tokens']} output tokens, correctness on "
        f"{o['correctness_tokens']} tokens; ratios are candidate/baseline (> 1 = faster), "
        "figures are one-sided 95% lower confidence bounds of the median block ratio.",
        "",
        "## Per bucket (worst prompt class)",
        "",
        "| bucket | prefill LCB | decode LCB | total LCB |",
        "|---|---|---|---|",
    ]
    for b in report["buckets"]:
        lines.append(f"| {b['bucket']} | {_fmt(b['prefill_lcb'])} | {_fmt(b['decode_lcb'])} | "
                     f"{_fmt(b['total_lcb'])} |")
    lines += ["", "## Cases", "",
              "| bucket | class | prefill LCB | decode LCB | total LCB | cand prefill tok/s | base prefill tok/s "
              "| cand decode tok/s | base decode tok/s | jitter max | peak RSS MB | greedy | top-1 | max KLD "
              "| sentinel s/c |",
              "|" + "---|" * 15]
    for c in report["cases"]:
        rc, rb, cor = c["raw"]["candidate"], c["raw"]["baseline"], c["correctness"] or {}
        lines.append(
            f"| {c['bucket']} | {c['prompt_class']} | {_fmt(c['prefill_lcb'])} | {_fmt(c['decode_lcb'])} | "
            f"{_fmt(c['total_lcb'])} | {_fmt(rc['prefill_tok_s'], '.1f')} | {_fmt(rb['prefill_tok_s'], '.1f')} | "
            f"{_fmt(rc['decode_tok_s'], '.1f')} | {_fmt(rb['decode_tok_s'], '.1f')} | "
            f"{_fmt(c['jitter']['max'])} | {_fmt((c['peak_rss_bytes'] or 0) / 2**20, '.0f')} | "
            f"{cor.get('greedy_match', '—')} | {_fmt(cor.get('top1_agreement'), '.3f')} | "
            f"{_fmt(cor.get('max_kld'), '.2e')} | {cor.get('sentinel_stock')}/{cor.get('sentinel_candidate')} |")
    bw = report.get("bandwidth")
    if bw:
        lines += ["", "## Decode against the memory-bandwidth roofline", "",
                  f"Read bandwidth {bw['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s at {bw['threads']} threads "
                  f"(STREAM-style probe; {_samples(bw)}; copy {bw['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s). "
                  "Roofline = "
                  "bandwidth / bytes one decode step must read (weights with top-k experts, recurrent state, "
                  "KV at the bucket's context).", "",
                  "| bucket | class | MB/token (LM head) | roofline tok/s | candidate share | baseline share |",
                  "|---|---|---|---|---|---|"]
        for c in report["cases"]:
            r = c.get("roofline")
            if r:
                lines.append(f"| {c['bucket']} | {c['prompt_class']} | {r['bytes_per_token'] / 1e6:.0f} "
                             f"({r['lm_head_bytes'] / 1e6:.0f}) | {r['tok_s']:.1f} | "
                             f"{_fmt(r['candidate_share'])} | {_fmt(r['baseline_share'])} |")
    lines += ["", "## Near-boundary prefill (rate / exact bucket's rate)", "",
              "Against each prompt class's runs at the bucket; *paired*: the median over sessions of each "
              "session's own ratio (one process, its runs minutes apart), which the cliff flag reads.", "",
              "| bucket | class | length | candidate, paired | candidate, medians | baseline, paired | "
              "baseline, medians | cliff |", "|---|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        for n in c["near_boundary"]:
            ratios = " | ".join(_fmt(n.get(f"{role}_vs_bucket{way}"), ".3f")
                                for role in ("candidate", "baseline") for way in ("_paired", ""))
            lines.append(f"| {c['bucket']} | {c['prompt_class']} | {n['length']} | {ratios} | "
                         f"{'yes' if n['cliff'] else 'no'} |")
    for kind, title in (("hard_divergences", "Hard divergences (stock's top-2 margin >= eps: each fails the gate)"),
                        ("near_tie_divergences", "Near-tie divergences")):
        divs = [(c, d) for c in report["cases"] for d in (c["correctness"] or {}).get(kind) or []]
        if kind == "hard_divergences" and not divs:
            continue
        lines += ["", f"## {title} ({len(divs)})", ""]
        lines += [f"- {c['bucket']}/{c['prompt_class']} position {d['position']}: stock {d['stock_token']}, "
                  f"candidate {d['candidate_token']}, margin {d['margin']:.4f}" for c, d in divs[:50]]
        if len(divs) > 50:
            lines.append(f"- … {len(divs) - 50} more in `report.json`")
    lines += ["", "Plots: `ratios.png`, `tpot.png`, `memory.png`.", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path, records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    for ax, metric in zip(axes, ("prefill", "decode", "total"), strict=True):
        for i, cls in enumerate(report["options"]["classes"]):
            cs = [c for c in report["cases"] if c["prompt_class"] == cls and metric in c["bounds"]]
            x = np.arange(len(cs)) + (i - 1) * 0.2
            med = [c["bounds"][metric]["median"] for c in cs]
            lo = [c["bounds"][metric]["median"] - c["bounds"][metric]["lcb"] for c in cs]
            hi = [c["bounds"][metric]["ucb"] - c["bounds"][metric]["median"] for c in cs]
            ax.errorbar(x, med, yerr=[lo, hi], fmt="o", capsize=3, label=cls)
            ax.set_xticks(np.arange(len(cs)), [str(c["bucket"]) for c in cs])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{metric}: candidate / {report['baseline']}")
        ax.set_xlabel("bucket (tokens)")
    axes[0].set_ylabel("ratio (median, 95% interval)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ratios.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    data, labels = [], []
    for engine in sorted({r["engine"] for r in records}):
        tp = [t * 1000 for r in records if r["engine"] == engine for t in r["tpot_s"][16:]]
        if tp:
            data.append(tp)
            labels.append(engine)
    if data:
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(labels) + 1), labels)
    ax.set_ylabel("decode time per token (ms)")
    ax.set_title("TPOT distribution (first 16 tokens dropped)")
    fig.tight_layout()
    fig.savefig(out / "tpot.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    for engine in sorted({r["engine"] for r in records}):
        pts = sorted(p for r in records if r["engine"] == engine for p in r.get("memory", []))
        if pts:
            t0 = pts[0][0]
            ax.plot([p[0] - t0 for p in pts], [p[1] / 2**30 for p in pts], ".", ms=2, label=f"{engine} RSS")
    ax.set_xlabel("seconds since the engine's first sample")
    ax.set_ylabel("GiB")
    ax.set_title("memory through the runs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)


def write_report(opts: Any, out: Path, sessions: list[Any]) -> dict[str, Any]:
    report = build_report(opts, out, sessions)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    plot(report, out, _final_runs(_read(out / "runs.jsonl"), sessions))
    return report
