"""Benchmark (not a test): decode steps of two worker processes that differ in their environment.

    .venv/bin/python -m tests.bench_env_pair --model dev-bench --b GLIBC_TUNABLES=glibc.malloc.hugetlb=1

For what acts on a whole process (a glibc tunable, an allocator, a thread setting read at start),
which two engines in one process cannot compare. Two child processes, `a` with this environment
(plus `--a` settings) and `b` with `--b`'s, each load the profile's candidate engine and prefill the
same prompt, then take the same random forced tokens one decode step at a time, in lockstep: the
parent asks one child for a step, waits for it, then the other (the order alternating), so only one
runs at a time and the machine's drift hits both alike. Separate processes run one after another
spread +-5% here (docs/perf-log.md, session 47); lockstep pairs do not.
Prints each child's median step every 100 pairs and over all, the paired ratio (b / a) and how
many steps b took less time; checks that the two computed the same logits (a digest per step),
and reports each child's prefill (also in lockstep), its anonymous memory on huge pages and its
peak RSS after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from typing import IO, Any

import numpy as np

from tests.helpers import bench_args, bench_parser, bench_rounds

CHILD = "--child"


def child(model: str, profile: str, length: int) -> int:
    """One side: reads commands from stdin (`run SEED TOKENS`, `step`, `quit`), answers one JSON
    line each on stdout; the engine's log goes to stderr."""
    from iq36.cli import resolve_model
    from iq36.gate.prompts import build
    from iq36.profile import load
    from worker.engine.candidate import CandidateEngine
    from worker.tokenizer import ModelTokenizer

    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but the protocol on the pipe
    model_dir = resolve_model(model)
    tokenizer = ModelTokenizer(model_dir)
    engine = CandidateEngine(model_dir, load(profile), tokenizer)
    prompt = list(build(lambda t: tokenizer.encode(t, add_special_tokens=False), length, "filler",
                        salt="env-pair").ids)
    out.write(json.dumps({"kernels": sorted(engine.kernels)}) + "\n")
    out.flush()
    steps: Any = None
    for line in iter(sys.stdin.readline, ""):
        word, *rest = line.split() or ["quit"]
        if word == "run":
            seed, tokens = (int(v) for v in rest)
            forced = [int(i) for i in np.random.default_rng(seed).integers(1000, 30000, tokens)]
            steps = engine.forced_logits(prompt, forced)
            t = time.perf_counter()
            next(steps)  # the prefill
            answer = {"prefill_s": time.perf_counter() - t, **memory_kb()}
        elif word == "step":
            t = time.perf_counter()
            logits = next(steps)
            spent = time.perf_counter() - t
            answer = {"s": spent, "digest": hashlib.blake2b(logits.tobytes(), digest_size=16).hexdigest()}
        else:
            break
        out.write(json.dumps(answer) + "\n")
        out.flush()
    engine.close()
    return 0


def memory_kb() -> dict[str, int]:
    """This process's anonymous memory on huge pages and peak RSS (kB; -1 where unreadable)."""
    found = {"huge_kb": -1, "peak_kb": -1}
    for path, field, key in (("/proc/self/smaps_rollup", "AnonHugePages:", "huge_kb"),
                             ("/proc/self/status", "VmHWM:", "peak_kb")):
        try:
            with open(path) as f:
                found[key] = next((int(line.split()[1]) for line in f if line.startswith(field)), -1)
        except OSError:
            pass
    return found


class Side:
    def __init__(self, name: str, settings: list[str], args: Any, length: int) -> None:
        env = dict(os.environ)
        for item in settings:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise SystemExit(f"--{name} {item!r}: expected KEY=VALUE")
            env[key] = value
        self.name, self.settings = name, settings
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench_env_pair", CHILD, args.model, args.profile, str(length)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, line: str | None = None) -> dict[str, Any]:
        stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
        stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]
        if line is not None:
            stdin.write(line + "\n")
            stdin.flush()
        reply = stdout.readline()
        if not reply:
            raise SystemExit(f"child {self.name} exited ({self.proc.wait()}); its log is above")
        return dict(json.loads(reply))

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == CHILD:
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    p = bench_parser(__doc__, "1024")
    bench_rounds(p, 1, "runs of --tokens lockstep steps", 401, "decode steps per process and run")
    p.add_argument("--a", action="append", default=[], metavar="KEY=VALUE", help="environment of a (repeatable)")
    p.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="environment of b (repeatable)")
    args, lengths = bench_args(p, one_length=True)

    sides = [Side("a", args.a, args, lengths[0]), Side("b", args.b, args, lengths[0])]
    try:
        for side in sides:
            ready = side.ask()
            print(f"{side.name} ({' '.join(side.settings) or 'this environment'}): kernels "
                  f"{', '.join(ready['kernels'])}", flush=True)
        a, b = sides
        for run in range(args.rounds):
            for side in (sides if run % 2 == 0 else sides[::-1]):
                got = side.ask(f"run {run} {args.tokens}")
                print(f"run {run} {side.name}: prefill {got['prefill_s'] * 1e3:.0f} ms; after it "
                      f"{got['huge_kb'] / 1024:.0f} MB of anonymous memory on huge pages, peak RSS "
                      f"{got['peak_kb'] / 1024:.0f} MB", flush=True)
            spent: dict[str, list[float]] = {"a": [], "b": []}
            for i in range(args.tokens - 1):
                got = {}
                for side in ((a, b) if i % 2 == 0 else (b, a)):
                    got[side.name] = side.ask("step")
                    spent[side.name].append(got[side.name]["s"])
                if got["a"]["digest"] != got["b"]["digest"]:
                    print(f"run {run} step {i}: the logits differ")
                    return 1
                if (i + 1) % 100 == 0:
                    x, y = (np.array(spent[w][-100:]) for w in "ab")
                    print(f"run {run} steps {i - 98}-{i + 1}: a {np.median(x) * 1e3:.2f} ms, b "
                          f"{np.median(y) * 1e3:.2f} ms, paired {np.median(y / x):.3f}", flush=True)
            x, y = (np.array(spent[w]) for w in "ab")
            print(f"run {run}: a {np.median(x) * 1e3:.2f} ms, b {np.median(y) * 1e3:.2f} ms a step, paired "
                  f"{np.median(y / x):.3f}, b faster in {int((y < x).sum())} of {x.size}; logits the same",
                  flush=True)
    finally:
        for side in sides:
            side.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
