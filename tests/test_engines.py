"""The two engines (worker/engine): greedy parity, chunked prefill, aborts, seeds, stops, limits.

All on dev-tiny (int4) with the `cpu-f32` profile (f32 + SDPA): the f32 reference mode where
candidate and stock must agree token for token (SPEC §5). Engines are compiled once per module.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from iq36.profile import PrefillSection, Profile, load
from tests.helpers import MAX_STEPS, REFERENCE, final, tokens_of
from tests.helpers import run_engine as run
from worker.engine import (
    Engine,
    EngineRequest,
    FinishReason,
    OutputTooLong,
    PromptTooLong,
    SamplingParams,
    StepOutput,
    create,
)
from worker.tokenizer import ModelTokenizer

GREEDY_TOKENS = 128
CHUNK = 16
TEXT = (
    "The quick brown fox jumps over the lazy dog. 0123456789. Pack my box with five dozen liquor jugs; "
    "how vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
)


def _greedy(max_tokens: int = GREEDY_TOKENS, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def step_until_tokens(engine: Engine, request_id: str, n: int) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    for _ in range(MAX_STEPS):
        outputs.extend(engine.step())
        if len(tokens_of(outputs, request_id)) >= n:
            return outputs
    raise AssertionError(f"{request_id} produced fewer than {n} tokens")


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def f32_profile() -> Profile:
    return load("cpu-f32")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(tiny_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer: ModelTokenizer) -> tuple[int, ...]:
    ids = tuple(tokenizer.encode(TEXT, add_special_tokens=False))
    assert len(ids) > 2 * CHUNK + 1  # several chunks, the last one partial
    return ids


def _engine(kind: str, model_dir: Path, profile: Profile) -> Iterator[Engine]:
    engine = create(kind, model_dir, profile)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def candidate(tiny_dir: Path, f32_profile: Profile) -> Iterator[Engine]:
    yield from _engine("candidate", tiny_dir, f32_profile)


@pytest.fixture(scope="module")
def chunked(tiny_dir: Path, f32_profile: Profile) -> Iterator[Engine]:
    profile = msgspec.structs.replace(f32_profile, prefill=PrefillSection(chunk_tokens=CHUNK))
    yield from _engine("candidate", tiny_dir, profile)


@pytest.fixture(scope="module")
def stock(tiny_dir: Path, f32_profile: Profile) -> Iterator[Engine]:
    yield from _engine("stock", tiny_dir, f32_profile)


@pytest.fixture(params=["candidate", "stock"])
def engine(request: pytest.FixtureRequest) -> Engine:
    eng: Engine = request.getfixturevalue(request.param)
    assert not eng.has_work()
    return eng


@pytest.fixture(scope="module")
def stock_greedy(stock: Engine, prompt: tuple[int, ...]) -> list[StepOutput]:
    return run(stock, EngineRequest("ref", prompt, _greedy()))


# -- the kernel ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_fixture", ["tiny_f32_dir", "tiny_dir"])
def test_last_token_logits_kernel_keeps_the_last_row(model_fixture: str, prompt: tuple[int, ...],
                                                     request: pytest.FixtureRequest) -> None:
    import openvino as ov

    from kernels import last_token_logits
    from worker.reference import ReferenceRunner

    model_dir: Path = request.getfixturevalue(model_fixture)
    props = REFERENCE
    full = ReferenceRunner(model_dir, properties=props)
    core = ov.Core()
    model = last_token_logits.apply(core.read_model(model_dir / "openvino_model.xml"))
    sliced = core.compile_model(model, "CPU", props).create_infer_request()
    n = len(prompt)
    feed = {
        "input_ids": np.array([prompt], dtype=np.int64),
        "attention_mask": np.ones((1, n), dtype=np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
        "beam_idx": np.zeros(1, dtype=np.int32),
    }
    full.request.reset_state()
    full.request.infer(feed)
    want = np.array(full.request.get_tensor("logits").data)
    sliced.infer(feed)
    got = sliced.get_tensor("logits").data
    assert want.shape[1] == n and got.shape == (1, 1, want.shape[2])
    np.testing.assert_allclose(got[0, 0], want[0, -1], rtol=1e-5, atol=1e-5)


# -- greedy parity -------------------------------------------------------------------------------


def test_candidate_greedy_matches_stock(candidate: Engine, stock_greedy: list[StepOutput],
                                        prompt: tuple[int, ...]) -> None:
    got = run(candidate, EngineRequest("c", prompt, _greedy()))
    want = tokens_of(stock_greedy, "ref")
    assert len(want) == GREEDY_TOKENS
    assert tokens_of(got, "c") == want
    assert "".join(o.text for o in got) == "".join(o.text for o in stock_greedy)


def test_chunked_prefill_greedy_matches_stock(chunked: Engine, stock_greedy: list[StepOutput],
                                              prompt: tuple[int, ...]) -> None:
    got = run(chunked, EngineRequest("c16", prompt, _greedy()))
    assert tokens_of(got, "c16") == tokens_of(stock_greedy, "ref")


def test_prefill_chunks_report_nothing_until_the_first_token(chunked: Engine,
                                                             prompt: tuple[int, ...]) -> None:
    chunked.add(EngineRequest("p", prompt, _greedy(max_tokens=1)))
    n_chunks = -(-len(prompt) // CHUNK)
    for _ in range(n_chunks - 1):
        assert chunked.step() == []
    (out,) = chunked.step()
    assert len(out.token_ids) == 1 and out.finished


def test_prompt_length_picks_the_context_profile(tiny_dir: Path, f32_profile: Profile, stock: Engine,
                                                 prompt: tuple[int, ...]) -> None:
    """Prompts from `[prefill.long] from_tokens` on are fed in the long profile's chunks, shorter
    ones in `[prefill]`'s; the tokens are stock's either way (the caller picks nothing)."""
    from iq36.profile import LongContextSection

    boundary = len(prompt) - 1
    section = PrefillSection(chunk_tokens=CHUNK, long=LongContextSection(from_tokens=boundary, chunk_tokens=4))
    engine = create("candidate", tiny_dir, msgspec.structs.replace(f32_profile, prefill=section))
    try:
        for ids, chunk in ((prompt[:boundary - 1], CHUNK), (prompt[:boundary], 4), (prompt, 4)):
            engine.add(EngineRequest("b", ids, _greedy(max_tokens=1), reuse_prefix=False))
            for _ in range(-(-len(ids) // chunk) - 1):
                assert engine.step() == []
            (out,) = engine.step()
            want = tokens_of(run(stock, EngineRequest("s", ids, _greedy(max_tokens=1))), "s")
            assert out.finished and out.token_ids == want
    finally:
        engine.close()


def test_usage_counts_prompt_and_completion_tokens(engine: Engine, prompt: tuple[int, ...]) -> None:
    out = final(run(engine, EngineRequest("u", prompt, _greedy(max_tokens=7))), "u")
    assert (out.prompt_tokens, out.completion_tokens) == (len(prompt), 7)
    assert out.finish_reason is FinishReason.LENGTH


# -- aborts ----------------------------------------------------------------------------------------


def test_abort_during_prefill_lands_at_the_next_step(chunked: Engine, prompt: tuple[int, ...]) -> None:
    chunked.add(EngineRequest("a", prompt, _greedy()))
    assert chunked.step() == []  # first chunk done, more to go
    chunked.abort("a")
    (out,) = chunked.step()
    assert (out.request_id, out.finished, out.token_ids) == ("a", True, [])
    assert out.finish_reason is FinishReason.ABORT
    assert not chunked.has_work()


def test_abort_during_decode_lands_at_the_next_step(engine: Engine, prompt: tuple[int, ...]) -> None:
    engine.add(EngineRequest("a", prompt, _greedy()))
    before = step_until_tokens(engine, "a", 3)
    engine.abort("a")
    out = final(engine.step(), "a")
    assert out.finish_reason is FinishReason.ABORT and out.token_ids == []
    assert out.completion_tokens >= len(tokens_of(before, "a"))
    assert all(o.request_id != "a" for o in run(engine))  # nothing more for it, engine goes idle


def test_engine_serves_the_next_request_after_an_abort(engine: Engine, prompt: tuple[int, ...],
                                                       stock_greedy: list[StepOutput]) -> None:
    engine.add(EngineRequest("x", prompt[:-3], _greedy()))
    step_until_tokens(engine, "x", 2)
    engine.abort("x")
    got = run(engine, EngineRequest("y", prompt, _greedy(max_tokens=16)))
    assert final(got, "x").finish_reason is FinishReason.ABORT
    assert tokens_of(got, "y") == tokens_of(stock_greedy, "ref")[:16]


def test_abort_of_a_queued_request_reports_abort(engine: Engine, prompt: tuple[int, ...]) -> None:
    engine.add(EngineRequest("first", prompt, _greedy(max_tokens=4)))
    engine.add(EngineRequest("queued", prompt, _greedy(max_tokens=4)))
    engine.abort("queued")
    outputs = run(engine)
    assert final(outputs, "queued").finish_reason is FinishReason.ABORT
    assert tokens_of(outputs, "queued") == []
    assert final(outputs, "first").finish_reason is FinishReason.LENGTH


def test_abort_of_unknown_or_finished_id_is_a_noop(engine: Engine, prompt: tuple[int, ...]) -> None:
    run(engine, EngineRequest("done", prompt, _greedy(max_tokens=2)))
    engine.abort("done")
    engine.abort("never-seen")
    assert not engine.has_work()
    assert engine.step() == []


# -- sampling --------------------------------------------------------------------------------------


def _sampled(engine: Engine, prompt: tuple[int, ...], request_id: str, seed: int) -> list[int]:
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)
    return tokens_of(run(engine, EngineRequest(request_id, prompt, params)), request_id)


def test_same_seed_gives_the_same_tokens(engine: Engine, prompt: tuple[int, ...]) -> None:
    assert _sampled(engine, prompt, "s1", 42) == _sampled(engine, prompt, "s2", 42)


def test_different_seeds_give_different_tokens(engine: Engine, prompt: tuple[int, ...]) -> None:
    # random weights give near-flat distributions: 32 equal draws under two seeds would be a bug
    assert _sampled(engine, prompt, "s1", 1) != _sampled(engine, prompt, "s2", 2)


@pytest.mark.parametrize("mask", [{"top_k": 1}, {"min_p": 0.9999}, {"top_p": 1e-6}])
def test_a_mask_keeping_only_the_top_token_samples_the_greedy_tokens(
    engine: Engine, prompt: tuple[int, ...], stock_greedy: list[StepOutput], mask: dict[str, float]
) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, **mask)  # type: ignore[arg-type]
    got = tokens_of(run(engine, EngineRequest("m", prompt, params)), "m")
    assert got == tokens_of(stock_greedy, "ref")[:16]


def test_greedy_with_repetition_penalty_matches_across_engines(candidate: Engine, stock: Engine,
                                                               prompt: tuple[int, ...]) -> None:
    params = _greedy(max_tokens=24, repetition_penalty=1.5)
    got = tokens_of(run(candidate, EngineRequest("rc", prompt, params)), "rc")
    want = tokens_of(run(stock, EngineRequest("rs", prompt, params)), "rs")
    assert got == want


# -- stops -----------------------------------------------------------------------------------------


def _crossing_stop(pieces: list[str]) -> tuple[str, str]:
    """A stop string spanning two tokens' text whose first occurrence is that crossing, and the
    text expected before it."""
    full = "".join(pieces)
    for i in range(3, len(pieces) - 1):
        if pieces[i] and pieces[i + 1]:
            stop = pieces[i][-1] + pieces[i + 1][0]
            at = len("".join(pieces[: i + 1])) - 1
            if full.find(stop) == at:
                return stop, full[:at]
    raise AssertionError("no token boundary to put a stop string across")


def test_stop_string_across_tokens_is_never_emitted(engine: Engine, prompt: tuple[int, ...],
                                                    stock_greedy: list[StepOutput]) -> None:
    stop, expected = _crossing_stop([o.text for o in stock_greedy if o.token_ids])
    outputs = run(engine, EngineRequest("s", prompt, _greedy(stop=(stop,))))
    assert "".join(o.text for o in outputs) == expected
    assert all(stop not in o.text for o in outputs)
    assert final(outputs, "s").finish_reason is FinishReason.STOP


def test_stop_token_id_ends_the_request(engine: Engine, prompt: tuple[int, ...],
                                        stock_greedy: list[StepOutput]) -> None:
    ref = tokens_of(stock_greedy, "ref")
    i = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
    outputs = run(engine, EngineRequest("t", prompt, _greedy(stop_token_ids=(ref[i],))))
    assert tokens_of(outputs, "t") == ref[: i + 1]
    out = final(outputs, "t")
    assert (out.finish_reason, out.completion_tokens) == (FinishReason.STOP, i + 1)


# -- limits and errors -----------------------------------------------------------------------------


def test_prompt_over_the_limit_raises_and_generates_nothing(engine: Engine, f32_profile: Profile) -> None:
    limit = f32_profile.limits.max_prompt_tokens
    with pytest.raises(PromptTooLong, match=rf"{limit + 1}.*{limit}"):
        engine.add(EngineRequest("long", (1,) * (limit + 1), _greedy(max_tokens=1)))
    assert not engine.has_work()


def test_max_tokens_over_the_cap_raises_and_generates_nothing(engine: Engine, f32_profile: Profile,
                                                               prompt: tuple[int, ...]) -> None:
    cap = f32_profile.limits.max_output_tokens
    with pytest.raises(OutputTooLong, match=rf"{cap + 1}.*{cap}"):
        engine.add(EngineRequest("many", prompt, _greedy(max_tokens=cap + 1)))
    assert not engine.has_work()


def test_empty_prompt_raises(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.add(EngineRequest("empty", (), _greedy(max_tokens=1)))
    assert not engine.has_work()


class _FailOnce:
    """Wraps an object; the named method raises the first time it is called."""

    def __init__(self, inner: object, method: str) -> None:
        self._inner, self._method, self.failed = inner, method, False

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._inner, name)
        if name != self._method or self.failed:
            return attr

        def boom(*args: object, **kwargs: object) -> object:
            self.failed = True
            raise RuntimeError("injected failure")

        return boom


def test_a_failing_request_ends_with_error_and_the_engine_keeps_serving(
    engine: Engine, prompt: tuple[int, ...], stock_greedy: list[StepOutput], monkeypatch: pytest.MonkeyPatch
) -> None:
    if hasattr(engine, "_request"):  # candidate: the infer request
        monkeypatch.setattr(engine, "_request", _FailOnce(engine._request, "infer"))
    else:  # stock: the pipeline
        monkeypatch.setattr(engine, "_pipe", _FailOnce(engine._pipe, "generate"))
    outputs = run(engine, EngineRequest("bad", prompt, _greedy(max_tokens=4)))
    bad = final(outputs, "bad")
    assert bad.finish_reason is FinishReason.ERROR and "injected failure" in (bad.error or "")
    good = run(engine, EngineRequest("good", prompt, _greedy(max_tokens=8)))
    assert tokens_of(good, "good") == tokens_of(stock_greedy, "ref")[:8]


def test_stock_rejects_penalties_genai_applies_differently(stock: Engine, prompt: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="presence_penalty"):
        stock.add(EngineRequest("pp", prompt, SamplingParams(presence_penalty=0.5)))
    assert not stock.has_work()


def test_duplicate_request_id_is_rejected(engine: Engine, prompt: tuple[int, ...]) -> None:
    engine.add(EngineRequest("dup", prompt, _greedy(max_tokens=1)))
    with pytest.raises(ValueError, match="dup"):
        engine.add(EngineRequest("dup", prompt, _greedy(max_tokens=1)))
    run(engine)


# -- construction ----------------------------------------------------------------------------------


def test_engines_satisfy_the_protocol(candidate: Engine, stock: Engine) -> None:
    assert isinstance(candidate, Engine) and isinstance(stock, Engine)


def test_create_rejects_an_unknown_kind(tiny_dir: Path, f32_profile: Profile) -> None:
    with pytest.raises(ValueError, match="candidate, stock"):
        create("turbo", tiny_dir, f32_profile)


def test_a_misspelt_kernel_is_refused(tiny_dir: Path, f32_profile: Profile) -> None:
    import msgspec

    profile = msgspec.structs.replace(f32_profile, kernels={**f32_profile.kernels, "nativ_gdn": True})
    with pytest.raises(ValueError, match=r"unknown kernel nativ_gdn in \[kernels\]; known: .*native_gdn"):
        create("candidate", tiny_dir, profile)


def test_stock_close_joins_its_named_thread(tiny_dir: Path, f32_profile: Profile,
                                            prompt: tuple[int, ...]) -> None:
    from worker.engine.stock import THREAD_NAME

    engine = create("stock", tiny_dir, f32_profile)
    engine.add(EngineRequest("r", prompt, _greedy(max_tokens=2)))
    run(engine)
    (thread,) = [t for t in threading.enumerate() if t is engine._thread]  # type: ignore[attr-defined]
    assert thread.name == THREAD_NAME
    engine.close()
    assert not thread.is_alive()


def test_eos_ids_come_from_the_model_dir(tokenizer: ModelTokenizer, tiny_dir: Path) -> None:
    declared = json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"]
    assert list(tokenizer.eos_token_ids) == declared


def test_tokenizer_round_trips_with_and_without_special_tokens(tokenizer: ModelTokenizer) -> None:
    text = "<|im_start|>user\nhi 👋<|im_end|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "user\nhi 👋"


def test_chat_template_keywords_reach_the_template(tokenizer: ModelTokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], add_generation_prompt=True,
                                         enable_thinking=False)
    assert text == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_worker_warm_up_runs_a_request_and_leaves_no_trace(engine: Engine, prompt: tuple[int, ...],
                                                           stock_greedy: list[StepOutput]) -> None:
    """`worker.process.warm_up` (the request a worker runs before READY): the engine prefills and
    decodes it (its infer calls grow) and is idle after it, with nothing in the prefix cache;
    the next request's greedy tokens are the stock engine's."""
    from worker.process import warm_up

    cache = getattr(engine, "prefix_cache", None)
    before = len(cache) if cache is not None else 0
    calls = dict(getattr(engine, "_calls", {}))
    warm_up(engine, 100)
    assert not engine.has_work()
    if cache is not None:
        assert len(cache) == before
    if hasattr(engine, "_calls"):  # the candidate counts its infer calls per request
        assert sum(engine._calls.values()) >= sum(calls.values()) + 2  # a prefill and a decode step
    got = run(engine, EngineRequest("after", prompt, _greedy(max_tokens=8)))
    assert tokens_of(got, "after") == tokens_of(stock_greedy, "ref")[:8]
