"""The gate end to end on dev-tiny: a smoke run's outputs, and proof the gate can fail.

Both run the `cpu` profile's kernels with the plugin in reference mode (`reference_cpu_profile`):
the same numerics on every CPU (under its bf16 default on an AVX-512 BF16 CPU, stock's bf16/int8
roundings move dev-tiny's greedy tokens; docs/perf-log.md, session 9)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from tests.helpers import reference_cpu_profile, run_cli

pytestmark = pytest.mark.slow


def test_smoke_gate_writes_all_outputs_and_claims_nothing(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gate"
    args = ["gate", "--model", str(tiny_dir), "--smoke", "--buckets", "96", "--blocks", "2",
            "--output-tokens", "24", "--correctness-tokens", "64", "--out", str(out), "--quiet",
            "--profile", str(reference_cpu_profile(tmp_path))]
    proc = run_cli(*args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "smoke" and report["smoke"] is True
    assert report["baseline"] == "stock-tuned"
    assert {"model", "graph", "runtime", "profiles", "machine"} <= set(report["identities"])
    assert len(report["identities"]["graph"]) == 16  # the candidate's specialised graph
    assert [(c["bucket"], c["prompt_class"]) for c in report["cases"]] == [
        (96, "filler"), (96, "prefill-shape"), (96, "sentinel")]
    for case in report["cases"]:
        for key in ("prompt_tokens", "baseline", "prefill_lcb", "decode_lcb", "total_lcb", "jitter",
                    "peak_rss_bytes", "correctness"):
            assert key in case, key
        assert case["raw"]["candidate"]["runs"] == 4 and case["raw"]["baseline"]["runs"] == 4
        assert case["raw"]["candidate"]["cached_tokens"] == 0
        cor = case["correctness"]
        assert cor["greedy_match"] is True and cor["top1_agreement"] >= 0.99 and cor["max_kld"] <= 0.005
        assert [n["length"] for n in case["near_boundary"]] == [49, 89, 95]
        roof = case["roofline"]
        # (no upper bound: dev-tiny's 41 MB per token partly stays in the CPU's caches)
        assert roof["bytes_per_token"] > roof["lm_head_bytes"] > 0 and roof["candidate_share"] > 0
    # one read-bandwidth probe before the runs and one in each of the 2 blocks; the median counts
    samples = report["bandwidth"]["read_samples_bytes_s"]
    assert len(samples) == 3 and all(x > 0 for x in samples)
    assert report["bandwidth"]["read_bandwidth_bytes_s"] == pytest.approx(sorted(samples)[1])
    assert "smoke run" in (out / "report.md").read_text()
    assert "memory-bandwidth roofline" in (out / "report.md").read_text()
    for png in ("ratios.png", "tpot.png", "memory.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # a finished gate resumes to the same report without running anything again
    runs_before = (out / "runs.jsonl").read_text()
    again = run_cli(*args, "--resume", timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "runs.jsonl").read_text() == runs_before
    refused = run_cli(*args, timeout=120)
    assert refused.returncode == 1 and "--resume" in refused.stderr
    # blocks timed on another machine must not be mixed into this gate
    machine = json.loads((out / "machine.json").read_text())
    (out / "machine.json").write_text(json.dumps({**machine, "cpu": "another CPU"}))
    elsewhere = run_cli(*args, "--resume", timeout=120)
    assert elsewhere.returncode == 1 and "another machine" in elsewhere.stderr


def test_a_session_warms_up_at_its_longest_case_on_a_prompt_of_its_own(tiny_dir: Path) -> None:
    """The warm-up sizes the engines' buffers for the longest timed prompt (a short one left the
    first long prompt of each process slow) and shares no more than the opening `[` with a timed one."""
    from iq36.gate.prompts import build
    from iq36.gate.session import Case, warm_up_prompt
    from worker.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(tiny_dir)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    cases = [Case(96, "filler", 96, "b0s0:96:filler", 8), Case(192, "sentinel", 192, "b0s0:192:sentinel", 8),
             Case(192, "filler", 191, "b0s0:191:nb", 1), Case(192, "filler", 97, "b0s0:97:nb", 1)]
    warm = warm_up_prompt(encode, cases)
    assert len(warm) == 192
    for case in cases:
        timed = build(encode, case.bucket, case.prompt_class, length=case.length, salt=case.salt).ids
        shared = next(i for i, (a, b) in enumerate(zip(warm, timed, strict=False)) if a != b)
        assert shared <= 1
    assert len(warm_up_prompt(encode, cases[:1])) == 96


def test_corrupted_candidate_fails_the_correctness_gate(tiny_dir: Path, tmp_path: Path) -> None:
    """A deliberately wrong rewrite (kernels/perturb.py) must fail; the same case passes without it."""
    from iq36.gate.correctness import CorrectnessSpec, run_case
    from iq36.gate.session import Case

    case = Case(bucket=96, prompt_class="filler", length=96, salt="perturb", output_tokens=64)
    spec = CorrectnessSpec(model_dir=str(tiny_dir), profile=str(reference_cpu_profile(tmp_path)), cases=[case],
                           output_tokens=64)
    assert run_case(spec, case)["passed"] is True
    bad = run_case(msgspec.structs.replace(spec, perturb=True), case)
    assert bad["passed"] is False
    assert bad["greedy_match"] is False or bad["top1_agreement"] < 0.99 or bad["max_kld"] > 0.005


def test_a_failed_correctness_case_makes_a_complete_gate_not_claimable(tmp_path: Path, tiny_dir: Path) -> None:
    """The verdict logic on a complete 8-block gate whose only correctness case failed."""
    from iq36.gate.report import build_report, render_markdown
    from iq36.gate.run import GateOptions, plan

    opts = GateOptions(model_dir=str(tiny_dir), buckets=(64,), classes=("filler",), blocks=8,
                       output_tokens=4, near_boundary=False)
    sessions = plan(opts)
    with (tmp_path / "runs.jsonl").open("w") as fh:
        for s in sessions:
            for case in s.cases:
                rate = 100.0 if s.engine == "stock" else 120.0
                fh.write(json.dumps({"session": s.key, "block": s.block, "slot": s.slot, **msgspec.to_builtins(case),
                                     "engine": s.engine_config, "prompt_tokens": 64, "output_tokens": 4,
                                     "cached_tokens": 0, "ttft_s": 64 / rate, "prefill_tok_s": rate,
                                     "decode_tok_s": rate / 10, "total_s": 1.0, "tpot_s": [0.01] * 3,
                                     "sentinel": None, "peak_rss_bytes": 1, "min_available_bytes": 1,
                                     "memory": [], "load_s": 0.1}) + "\n")
            fh.write(json.dumps({"session_done": s.key}) + "\n")
    good = {"bucket": 64, "prompt_class": "filler", "greedy_match": True, "top1_agreement": 1.0,
            "max_kld": 0.0, "passed": True, "first_divergence": None, "near_tie_divergences": []}
    (tmp_path / "correctness.jsonl").write_text(json.dumps(good) + "\n")
    report = build_report(opts, tmp_path, sessions)
    assert report["complete"] and report["verdict"] == "claimable"
    assert report["cases"][0]["prefill_lcb"] == pytest.approx(1.2)
    assert report["bandwidth"] is None and "roofline" not in report["cases"][0]
    # decode against the roofline: rate / (read bandwidth / bytes a token reads)
    (tmp_path / "roofline.json").write_text(json.dumps({"threads": 2, "read_bandwidth_bytes_s": 1e10,
                                                        "copy_bandwidth_bytes_s": 1e10}))
    roof = build_report(opts, tmp_path, sessions)["cases"][0]["roofline"]
    assert roof["tok_s"] == pytest.approx(1e10 / roof["bytes_per_token"])
    assert roof["candidate_share"] == pytest.approx(12.0 / roof["tok_s"])
    assert roof["baseline_share"] == pytest.approx(10.0 / roof["tok_s"])
    # with samples taken in the blocks, the roofline takes the median of all probes
    (tmp_path / "bandwidth.jsonl").write_text("".join(json.dumps({"block": b, "read_bandwidth_bytes_s": x}) + "\n"
                                                      for b, x in enumerate((3e10, 2e10))))
    report = build_report(opts, tmp_path, sessions)
    assert report["bandwidth"]["read_bandwidth_bytes_s"] == pytest.approx(2e10)
    assert report["bandwidth"]["first_read_bandwidth_bytes_s"] == pytest.approx(1e10)
    assert report["cases"][0]["roofline"]["tok_s"] == pytest.approx(2e10 / roof["bytes_per_token"])
    assert "median of 3 probes" in render_markdown(report) and "10.0-30.0 GB/s" in render_markdown(report)
    hard = {"position": 7, "stock_token": 11, "candidate_token": 12, "margin": 0.5, "near_tie": False}
    failed = {**good, "greedy_match": False, "passed": False, "first_divergence": hard, "hard_divergences": [hard]}
    (tmp_path / "correctness.jsonl").write_text(json.dumps(failed) + "\n")
    report = build_report(opts, tmp_path, sessions)
    assert report["verdict"] == "not-claimable"
    # every divergence is reported with its margin (SPEC §5), the hard ones too
    assert report["cases"][0]["correctness"]["hard_divergences"] == [hard]
    text = render_markdown(report)
    assert "## Hard divergences" in text and "64/filler position 7: stock 11, candidate 12, margin 0.5000" in text


def test_bench_reports_rates_and_op_tables(tiny_dir: Path) -> None:
    proc = run_cli("bench", "--model", str(tiny_dir), "--lengths", "64", "--runs", "1", "--output-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["length"] == 64 and row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    roof = run_cli("bench", "--model", str(tiny_dir), "--lengths", "64", "--runs", "1", "--output-tokens", "4",
                   "--roofline")
    assert roof.returncode == 0, roof.stderr[-2000:]
    rate, line = (json.loads(x) for x in roof.stdout.strip().splitlines()[-2:])
    r = line["roofline"]
    assert r["bytes_per_token"]["total"] > 0 and r["read_bandwidth_bytes_s"] > 0
    assert r["decode"]["candidate"]["share"] == pytest.approx(rate["decode_tok_s"] / r["roofline_tok_s"])
    ops = run_cli("bench", "--model", str(tiny_dir), "--lengths", "64", "--ops")
    assert ops.returncode == 0, ops.stderr[-2000:]
    tables = [json.loads(line) for line in ops.stdout.strip().splitlines()]
    assert [t["phase"] for t in tables] == ["prefill", "decode-step"]
    for t in tables:  # the routed experts: the plugin's fused op, or iq36's extension ops (`Reference`)
        assert t["total_ms"] > 0 and {"GatherMatmulCompressed", "Reference"} & set(t["share"])
    assert tables[1]["total_ms"] < tables[0]["total_ms"]  # one token costs less than 64
