"""`iq36 gate`: plan, run (resumably) and report the paired performance + correctness gate.

The plan is `blocks` ABBA blocks — baseline, candidate, candidate, baseline — each slot a fresh
process (`iq36.gate.session`) running every case of the block in a fixed order. Every finished
case is appended to `DIR/runs.jsonl` at once, and every finished session is marked there, so
`--resume` continues an interrupted gate where it stopped. The correctness gate
(`iq36.gate.correctness`) runs once per bucket x class, appended to `DIR/correctness.jsonl`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from iq36 import paths
from iq36.gate.correctness import DEFAULT_EPS, CorrectnessSpec
from iq36.gate.prompts import CLASSES, near_boundary_lengths
from iq36.gate.session import Case, SessionSpec

BASELINES = ("stock-tuned", "stock-default")
SLOTS = ("baseline", "candidate", "candidate", "baseline")  # ABBA


class GateError(Exception):
    pass


class GateOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_dir: str
    baseline: str = "stock-tuned"
    buckets: tuple[int, ...] = (512, 1024, 2048, 4096)
    classes: tuple[str, ...] = CLASSES
    blocks: int = 8
    output_tokens: int = 128
    correctness_tokens: int = 512
    profile: str = "cpu"
    smoke: bool = False
    seed: int = 0
    eps: float = DEFAULT_EPS
    near_boundary: bool = True
    perturb: bool = False  # corrupt the candidate on purpose (proves the gate can fail)


class SessionPlan(msgspec.Struct, frozen=True):
    key: str
    block: int
    slot: int
    engine: str  # "stock" | "candidate"
    engine_config: str  # "candidate" | "stock-tuned" | "stock-default"
    cases: list[Case]


def validate(opts: GateOptions) -> None:
    if opts.baseline not in BASELINES:
        raise GateError(f"--baseline must be one of {', '.join(BASELINES)}, got {opts.baseline!r}")
    bad = [c for c in opts.classes if c not in CLASSES]
    if bad:
        raise GateError(f"unknown prompt class {bad[0]!r}; choose from {', '.join(CLASSES)}")
    if not opts.buckets or min(opts.buckets) < 64:
        raise GateError("--buckets needs at least one bucket of >= 64 tokens")
    if opts.blocks < 1 or (opts.blocks < 8 and not opts.smoke):
        raise GateError(f"--blocks must be >= 8 for a claimable gate (got {opts.blocks}); use --smoke")
    if opts.output_tokens < 2:
        raise GateError("--output-tokens must be >= 2 (decode rate needs two tokens)")


def plan(opts: GateOptions) -> list[SessionPlan]:
    sessions = []
    for block in range(opts.blocks):
        for slot, role in enumerate(SLOTS):
            config = opts.baseline if role == "baseline" else "candidate"
            cases = []
            for bucket in opts.buckets:
                for cls in opts.classes:
                    salt = f"b{block}s{slot}:{bucket}:{cls}"
                    cases.append(Case(bucket, cls, bucket, salt, opts.output_tokens))
                if opts.near_boundary:
                    for length in near_boundary_lengths(bucket):
                        cases.append(Case(bucket, "filler", length, f"b{block}s{slot}:{length}:nb", 1))
            engine = "stock" if role == "baseline" else "candidate"
            sessions.append(SessionPlan(f"b{block}s{slot}", block, slot, engine, config, cases))
    return sessions


def correctness_cases(opts: GateOptions) -> list[Case]:
    return [Case(b, c, b, f"correctness:{b}:{c}", opts.correctness_tokens)
            for b in opts.buckets for c in opts.classes]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line torn by an interrupted write: its session reruns
    return out


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _stream_subprocess(module: str, payload: bytes, on_line: Any, log: Path) -> None:
    with log.open("a") as err, subprocess.Popen(
        [sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(payload)
        proc.stdin.close()
        for line in proc.stdout:
            on_line(json.loads(line))
        code = proc.wait()
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-12:])
        raise GateError(f"{module} exited with {code}; last lines of {log}:\n{tail}")


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="gate", unit="run", file=sys.stderr, disable=not enabled,
                        mininterval=1.0 if sys.stderr.isatty() else 30.0)

    def advance(self, label: str) -> None:
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run(opts: GateOptions, out: Path, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run (or continue) the gate into `out`; write and return the report."""
    from iq36.gate.report import write_report

    validate(opts)
    out.mkdir(parents=True, exist_ok=True)
    options_file = out / "gate.json"
    runs_file, corr_file, log = out / "runs.jsonl", out / "correctness.jsonl", out / "gate.log"
    machine_file = out / "machine.json"
    machine = machine_identity()
    if options_file.exists():
        if not resume:
            raise GateError(f"{out} already holds a gate: pass --resume to continue it, or choose a new --out")
        previous = msgspec.json.decode(options_file.read_bytes(), type=GateOptions)
        if previous != opts:
            raise GateError(f"{out} holds a gate with other options; --resume needs the same flags")
        if machine_file.exists() and json.loads(machine_file.read_text()) != machine:
            # blocks timed on another machine are not comparable: ratios must come from one machine
            raise GateError(f"{out} was started on another machine ({machine_file}); start a new gate here")
    else:
        options_file.write_bytes(msgspec.json.format(msgspec.json.encode(opts)))
        machine_file.write_text(json.dumps(machine, indent=1) + "\n")

    roofline_file, bandwidth_file = out / "roofline.json", out / "bandwidth.jsonl"
    if not roofline_file.exists():
        # read and copy bandwidth before any timed run (the probe keeps both cores busy for seconds)
        roofline_file.write_text(json.dumps(measure_bandwidth(opts.profile), indent=1) + "\n")
    probed = {r["block"] for r in _read_jsonl(bandwidth_file)}
    sessions = plan(opts)
    records = _read_jsonl(runs_file)
    done = {r["session_done"] for r in records if "session_done" in r}
    corr_done = {(r["bucket"], r["prompt_class"]) for r in _read_jsonl(corr_file)}
    todo_cases = sum(len(s.cases) for s in sessions if s.key not in done)
    todo_corr = [c for c in correctness_cases(opts) if (c.bucket, c.prompt_class) not in corr_done]
    bar = _Progress(todo_cases + len(todo_corr), progress)
    fingerprint = json.loads((Path(opts.model_dir) / "manifest.json").read_text())["fingerprint"]
    try:
        for session in sessions:
            if session.key in done:
                continue
            if session.slot == len(SLOTS) // 2 and session.block not in probed:
                # the read bandwidth again in each block: this machine's drifted by a third between
                # gates (47-69 GB/s), so the roofline takes the median of these samples. Between
                # the block's two candidate sessions: any cost of the probe falls on the candidate
                _append(bandwidth_file, {"block": session.block,
                                         "read_bandwidth_bytes_s": measure_read_bandwidth(opts.profile)})
                probed.add(session.block)
            # drop partial records of a session that was interrupted: it reruns whole
            cache = paths.home() / "compile-cache" / f"{session.engine_config}-{fingerprint[7:19]}"
            spec = SessionSpec(engine=session.engine, engine_config=session.engine_config,
                               model_dir=opts.model_dir, profile=opts.profile, cases=session.cases,
                               cache_dir=str(cache))
            t0 = time.time()

            def on_line(record: dict[str, Any], session: SessionPlan = session) -> None:
                _append(runs_file, {"session": session.key, "block": session.block, "slot": session.slot,
                                    **record})
                bar.advance(f"{session.key} {session.engine_config} {record['length']}")

            _stream_subprocess("iq36.gate.session", msgspec.json.encode(spec), on_line, log)
            _append(runs_file, {"session_done": session.key, "wall_s": time.time() - t0})
        if todo_corr:
            spec_c = CorrectnessSpec(model_dir=opts.model_dir, profile=opts.profile, cases=todo_corr,
                                     output_tokens=opts.correctness_tokens, eps=opts.eps,
                                     exact=_is_f32_reference(opts.profile), perturb=opts.perturb)

            def on_corr(record: dict[str, Any]) -> None:
                _append(corr_file, record)
                bar.advance(f"correctness {record['bucket']} {record['prompt_class']}")

            _stream_subprocess("iq36.gate.correctness", msgspec.json.encode(spec_c), on_corr, log)
    finally:
        bar.close()
    return write_report(opts, out, sessions)


def _probe_threads(profile_name: str) -> int:
    import os

    from iq36.profile import load

    return int(load(profile_name).engine.properties.get("INFERENCE_NUM_THREADS", 0)) or len(os.sched_getaffinity(0))


def measure_bandwidth(profile_name: str) -> dict[str, Any]:
    """This machine's read and copy bandwidth at the candidate's thread count (decode roofline)."""
    from iq36.gate import roofline

    threads = _probe_threads(profile_name)
    return {"threads": threads, "read_bandwidth_bytes_s": roofline.read_bandwidth(threads),
            "copy_bandwidth_bytes_s": roofline.copy_bandwidth(threads)}


def measure_read_bandwidth(profile_name: str) -> float:
    """Read bandwidth alone (the per-block sample), at the candidate's thread count."""
    from iq36.gate import roofline

    return roofline.read_bandwidth(_probe_threads(profile_name))


def machine_identity() -> dict[str, Any]:
    """What makes timings comparable: CPU model, ISA extensions, logical CPUs, memory."""
    from iq36.gate.report import machine

    return machine()


def _is_f32_reference(profile_name: str) -> bool:
    from iq36.profile import load

    return str(load(profile_name).engine.properties.get("INFERENCE_PRECISION_HINT", "")).lower() == "f32"
