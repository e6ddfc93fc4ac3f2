"""One gate session: a fresh process running one engine over a fixed list of cases.

Run as `python -m iq36.gate.session` with a JSON `SessionSpec` on stdin; prints one JSON line
per finished case on stdout. The engine compiles with its own compile cache, does one untimed
warm-up as long as the session's longest case on a prompt that shares no prefix with any timed
one, then times each case cold (every prompt carries a distinct salt, so no prefix cache can
serve it). Both engines are driven through the same `Engine` protocol and timed by the same
code, so the comparison is fair.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from iq36.gate.prompts import Encode, build, sentinel_found
from iq36.profile import EngineSection, Profile, load


class Case(msgspec.Struct, frozen=True):
    bucket: int
    prompt_class: str
    length: int
    salt: str
    output_tokens: int  # 1 for prefill-only (near-boundary) cases


class SessionSpec(msgspec.Struct, frozen=True):
    engine: str  # "candidate" | "stock"
    engine_config: str  # "candidate" | "stock-tuned" | "stock-default"
    model_dir: str
    profile: str
    cases: list[Case]
    cache_dir: str = ""
    sample_interval_s: float = 0.05


def engine_profile(base: Profile, engine_config: str, cache_dir: str = "") -> Profile:
    """The profile each engine configuration runs with.

    candidate: the base profile. stock-tuned: the same device and properties plus genai's SDPA
    attention backend (faster than the default paged attention on this CPU, FACTS.md).
    stock-default: the library's defaults — only the device is set.
    """
    if engine_config == "candidate":
        engine = base.engine
    elif engine_config == "stock-tuned":
        engine = msgspec.structs.replace(base.engine, attention_backend="SDPA")
    elif engine_config == "stock-default":
        engine = EngineSection(device=base.engine.device)
    else:
        raise ValueError(f"unknown engine configuration {engine_config!r}")
    if cache_dir:
        engine = msgspec.structs.replace(engine, properties={**engine.properties, "CACHE_DIR": cache_dir})
    return msgspec.structs.replace(base, engine=engine)


class MemorySampler:
    """Samples this process's RSS and the system's MemAvailable on a named thread."""

    def __init__(self, interval: float) -> None:
        import psutil

        self._proc, self._vm = psutil.Process(), psutil.virtual_memory
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gate-memory-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), self._proc.memory_info().rss, self._vm().available))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, since: float) -> list[tuple[float, int, int]]:
        return [s for s in self.samples if s[0] >= since]


def time_request(engine: Any, request_id: str, ids: tuple[int, ...], output_tokens: int) -> dict[str, Any]:
    """Greedy-generate `output_tokens` (EOS ignored) and time prefill and decode."""
    from worker.engine import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    stamps: list[float] = []
    text: list[str] = []
    final = None
    t0 = time.perf_counter()
    engine.add(EngineRequest(request_id, ids, params, reuse_prefix=False))  # timed runs are cold (SPEC §5)
    while engine.has_work():
        for out in engine.step():
            now = time.perf_counter()
            stamps.extend(now for _ in out.token_ids)
            text.append(out.text)
            if out.finished:
                final = out
    t_end = time.perf_counter()
    if final is None or final.error or not stamps:
        raise RuntimeError(f"request {request_id} failed: {final.error if final else 'no output'}")
    ttft = stamps[0] - t0
    decode_s = stamps[-1] - stamps[0]
    return {
        "prompt_tokens": final.prompt_tokens,
        "output_tokens": len(stamps),
        "cached_tokens": 0,  # both engines start every request from an empty state
        "ttft_s": ttft,
        "prefill_tok_s": final.prompt_tokens / ttft,
        "decode_tok_s": (len(stamps) - 1) / decode_s if len(stamps) > 1 and decode_s > 0 else None,
        "total_s": t_end - t0,
        "tpot_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "text": "".join(text),
    }


def warm_up_prompt(encode: Encode, cases: list[Case]) -> tuple[int, ...]:
    """The session's untimed warm-up: as long as its longest case, so that both engines have
    sized their buffers (and the candidate compiled its long-prompt paths) before the first timed
    prompt. After a 64-token warm-up, the first long prompt of each stock process ran up to 2x
    slower than the same process's later ones (docs/perf-log.md, sessions 14 and 25), which
    inflated the ratio of whichever class came first. Its own salt: it shares no prefix with any
    timed prompt."""
    longest = max(cases, key=lambda c: c.length)
    return build(encode, longest.bucket, "prefill-shape", length=longest.length, salt="warm-up").ids


def run(spec: SessionSpec, emit: Any) -> None:
    from worker.engine import create
    from worker.tokenizer import ModelTokenizer

    model_dir = Path(spec.model_dir)
    profile = engine_profile(load(spec.profile), spec.engine_config, spec.cache_dir)
    tokenizer = ModelTokenizer(model_dir)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    t_start = time.perf_counter()
    engine = create(spec.engine, model_dir, profile)
    load_s = time.perf_counter() - t_start
    try:
        with MemorySampler(spec.sample_interval_s) as mem:
            time_request(engine, "warm-up", warm_up_prompt(encode, spec.cases), 4)
            for i, case in enumerate(spec.cases):
                prompt = build(encode, case.bucket, case.prompt_class, length=case.length, salt=case.salt)
                since = time.time()
                result = time_request(engine, f"case-{i}", prompt.ids, case.output_tokens)
                window = mem.window(since) or mem.samples[-1:]
                answer = result.pop("text")
                emit({
                    **msgspec.to_builtins(case),
                    "engine": spec.engine_config,
                    **result,
                    "sentinel": sentinel_found(answer, prompt.sentinel_value),
                    "peak_rss_bytes": max(s[1] for s in window),
                    "min_available_bytes": min(s[2] for s in window),
                    "memory": [[round(s[0], 3), s[1], s[2]] for s in window[:: max(1, len(window) // 50)]],
                    "load_s": load_s,
                })
    finally:
        engine.close()


def main() -> None:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=SessionSpec)

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)

    run(spec, emit)


if __name__ == "__main__":
    main()
