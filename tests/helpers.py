"""Helpers shared by tests."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run `iq36 ARGS` in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "iq36.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


# -- engines in-process ------------------------------------------------------------------------

MAX_STEPS = 10_000  # a runaway loop fails the test instead of hanging it

# The CPU plugin's reference mode, for tests that bound numeric differences: f32 inference and no
# dynamic quantisation of the activations (on an AVX-512 VNNI CPU the plugin's default rounds them
# to int8 in groups of 32 for its compressed matmuls: 8e-3 of the logits' scale on dev-tiny, even
# with f32 inference). Same as the `cpu-f32` profile's properties.
REFERENCE = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}


def chunk_logits(model_dir: Path, chunks: list[int], rewrite: Any = None, model: Any = None,
                 properties: dict[str, Any] | None = None) -> Any:
    """Last-position logits (float64) after each chunk of random ids fed to `model` (default:
    `model_dir`'s IR with `last_token_logits`), then `rewrite(model)` if given, in the plugin's
    reference mode (`properties` added to it)."""
    import numpy as np
    import openvino as ov

    from kernels import last_token_logits, native
    from worker.reference import stateful_feed

    core = ov.Core()
    native.register(core)
    if model is None:
        model = last_token_logits.apply(core.read_model(Path(model_dir) / "openvino_model.xml"))
    if rewrite is not None:
        rewrite(model)
    names = {p.get_any_name() for p in model.inputs}
    request = core.compile_model(model, "CPU", {**REFERENCE, **(properties or {})}).create_infer_request()
    rng = np.random.default_rng(0)
    rows, pos = [], 0
    for call, n in enumerate(chunks):
        request.infer(stateful_feed(rng.integers(10, 1000, n), pos, names, call))
        pos += n
        rows.append(np.array(request.get_tensor("logits").data[0, -1], np.float64))
    return np.stack(rows)


def reference_cpu_profile(directory: Path) -> Path:
    """The `cpu` profile (every kernel) with the plugin in reference mode (`REFERENCE`), written
    to `directory`: what the correctness gate sees on every CPU alike. Under the plugin's bf16
    default (AVX-512 BF16 CPUs) stock and the reference round to bf16 and int8 where the
    candidate's own ops compute in f32, and a random-weight model's flat distributions turn
    those roundings into greedy divergences (docs/perf-log.md, session 9)."""
    import profiles

    text = (Path(profiles.__file__).parent / "cpu.toml").read_text()
    lines = "".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in REFERENCE.items())
    text = text.replace('name = "cpu"', 'name = "cpu-reference"', 1)
    text = text.replace('PERFORMANCE_HINT = "LATENCY"\n', f'PERFORMANCE_HINT = "LATENCY"\n{lines}', 1)
    path = directory / "cpu-reference.toml"
    path.write_text(text)
    return path


def run_engine(engine: Any, *reqs: Any) -> list[Any]:
    """Add `reqs` and step until the engine is idle; every output, in order."""
    for req in reqs:
        engine.add(req)
    outputs: list[Any] = []
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError("the engine did not go idle")


def tokens_of(outputs: list[Any], request_id: str) -> list[int]:
    return [t for o in outputs if o.request_id == request_id for t in o.token_ids]


def final(outputs: list[Any], request_id: str) -> Any:
    done = [o for o in outputs if o.request_id == request_id and o.finished]
    assert len(done) == 1, f"expected one final output for {request_id}, got {done}"
    return done[0]


def kernel_greedy(model_dir: Path, kernel: str, enabled: bool, prompt: tuple[int, ...],
                  max_tokens: int) -> tuple[list[int], list[str]]:
    """Greedy tokens of the candidate engine (f32 reference mode, 64-token prefill chunks, no
    prefix reuse) with one `[kernels]` switch set; and the kernels the engine reports."""
    return greedy_with_kernels(model_dir, {kernel: enabled}, prompt, max_tokens)


def greedy_with_kernels(model_dir: Path, kernels: dict[str, bool], prompt: tuple[int, ...],
                        max_tokens: int) -> tuple[list[int], list[str]]:
    """`kernel_greedy` with several `[kernels]` switches set."""
    import msgspec

    from iq36.profile import PrefillSection, load
    from worker.engine import EngineRequest, SamplingParams, create

    profile = load("cpu-f32")
    profile = msgspec.structs.replace(profile, prefill=PrefillSection(chunk_tokens=64),
                                      kernels={**profile.kernels, **kernels})
    engine = create("candidate", model_dir, profile)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = run_engine(engine, EngineRequest("greedy", prompt, params, reuse_prefix=False))
        return tokens_of(outputs, "greedy"), engine.describe()["kernels"]  # type: ignore[attr-defined]
    finally:
        engine.close()


# -- tool schemas shared by the agent tests ------------------------------------------------------

# Bounded (maxLength, minimum/maximum, enum) so a random-weight model under a grammar terminates.
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}


def bench_parser(doc: str | None, lengths: str) -> argparse.ArgumentParser:
    """A benchmark's command line: --model, --profile and --lengths (comma-separated, `lengths`
    by default; `bench_lengths` reads them back)."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--model", default="dev-bench", metavar="NAME_OR_DIR")
    p.add_argument("--profile", default="cpu", metavar="NAME_OR_PATH")
    p.add_argument("--lengths", default=lengths, help=f"comma-separated prompt lengths (default: {lengths})")
    return p


def bench_lengths(args: argparse.Namespace) -> list[int]:
    return [int(v) for v in args.lengths.split(",") if v.strip()]


def bench_rounds(p: argparse.ArgumentParser, rounds: int, rounds_what: str, tokens: int, tokens_what: str) -> None:
    """A benchmark's --rounds (`rounds_what`: what one round is, per what) and --tokens."""
    p.add_argument("--rounds", type=int, default=rounds, help=f"{rounds_what} (default: {rounds})")
    p.add_argument("--tokens", type=int, default=tokens, help=f"{tokens_what} (default: {tokens})")


def bench_args(p: argparse.ArgumentParser, one_length: bool = False) -> tuple[argparse.Namespace, list[int]]:
    """The parsed command line of a benchmark with `bench_rounds`, and its lengths; refuses
    fewer than 3 tokens, no round, or no length (or more than one, with `one_length`)."""
    args = p.parse_args()
    lengths = bench_lengths(args)
    if args.tokens < 3 or args.rounds < 1 or not lengths or (one_length and len(lengths) != 1):
        p.error(f"need --tokens >= 3, --rounds >= 1 and {'one length' if one_length else 'at least one length'}")
    return args, lengths
