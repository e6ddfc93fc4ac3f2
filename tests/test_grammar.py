"""Constrained decoding (worker/grammar.py) and the stock engine's structured output.

The fuzz tests need no model: random logits (seeded) -> mask -> the candidate's own sampler
(greedy and temperature) -> accept, until EOS. Every schema is bounded, so every run must end;
MAX_STEPS turns a grammar bug into a failure instead of a hang. The tokens are then decoded with
the model's tokenizer (dev-tiny: the real Qwen tokenizer) and validated with jsonschema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from iq36.profile import load
from worker.engine.types import EngineRequest, OutputConstraint, SamplingParams, StepOutput
from worker.grammar import ConstrainedDecoder, GrammarCompiler
from worker.sampling import Sampler
from worker.tokenizer import ModelTokenizer

MAX_STEPS = 1500
SEEDS = (0, 1, 2)
MODES = {"greedy": SamplingParams(temperature=0.0), "temperature": SamplingParams(temperature=1.0, top_p=0.95)}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "active", "role"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                           "y": {"type": "integer", "minimum": 10, "maximum": 999}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6}, "maxItems": 3},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
        "note": {"type": ["string", "null"], "maxLength": 8},
    },
    "required": ["point", "tags"],
    "additionalProperties": False,
}
CHOICES = {
    "type": "array",
    "items": {"anyOf": [{"const": 42}, {"enum": ["a", "b", None]}, {"type": "integer", "minimum": 0, "maximum": 9}]},
    "minItems": 1,
    "maxItems": 4,
}
REFS = {
    "type": "object",
    "$defs": {"Level": {"type": "string", "enum": ["low", "high"]}},
    "properties": {"level": {"$ref": "#/$defs/Level"}, "count": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["level", "count"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "nested": NESTED, "choices": CHOICES, "refs": REFS}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16, "description": "City name"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "hourly": {"type": "boolean"},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                "offsets": {"type": "array", "items": {"type": "integer", "minimum": -12, "maximum": 12},
                            "maxItems": 2},
            },
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
CALL = re.compile(r"<tool_call>\n<function=([^>\n]+)>\n((?:<parameter=[^>\n]+>\n.*?\n</parameter>\n)*)"
                  r"</function>\n</tool_call>", re.S)
PARAM = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", re.S)


# -- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tiny_dir: Path) -> GrammarCompiler:
    return GrammarCompiler(tiny_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(tiny_dir)


def _json(kind: str, schema: object = None, **kw: Any) -> OutputConstraint:
    return OutputConstraint(kind, schema=None if schema is None else json.dumps(schema), **kw)


def _tools(tools: list[dict[str, Any]], **kw: Any) -> OutputConstraint:
    return OutputConstraint("tool_calls", tools=json.dumps(tools), **kw)


def _generate(compiler: GrammarCompiler, decoder: ConstrainedDecoder, seed: int, params: SamplingParams,
              bias: dict[int, float] | None = None, bias_after: int = 0) -> list[int]:
    """Random-logit decoding under `decoder` until EOS; the tokens before EOS."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=seed), ())
    tokens: list[int] = []
    for step in range(MAX_STEPS):
        logits = rng.standard_normal(compiler.vocab_size, dtype=np.float32) * 4.0
        if bias and step >= bias_after:
            for token, value in bias.items():
                logits[token] += value
        before = logits.copy()
        masked = decoder.mask(logits)
        assert np.array_equal(logits, before), "mask() wrote into its input"
        token = sampler.sample(masked)
        assert np.isfinite(masked[token])
        decoder.accept(token)
        sampler.accept(token)
        if token == compiler.eos_token_id:
            assert decoder.done
            return tokens
        tokens.append(token)
    raise AssertionError(f"no EOS after {MAX_STEPS} steps: {tokens[:80]}")


def _allowed(decoder: ConstrainedDecoder, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.isfinite(decoder.mask(np.zeros(vocab, dtype=np.float32))))


def _feed(decoder: ConstrainedDecoder, compiler: GrammarCompiler, text: str) -> None:
    for token in compiler.tokenizer.tokenize_str(text, parse_special=True):
        decoder.accept(token)


def _arguments(body: str, params: dict[str, Any]) -> dict[str, Any]:
    """The `<parameter=...>` blocks of one call as typed arguments, in order of appearance."""
    args: dict[str, Any] = {}
    for key, raw in PARAM.findall(body):
        assert key not in args, f"parameter {key} repeated"
        prop = params["properties"][key]
        args[key] = raw if prop.get("type") == "string" else json.loads(raw)
    return args


def _parse_calls(text: str) -> list[tuple[str, dict[str, Any], list[str]]]:
    """(name, typed arguments, parameter order) per call; the text must be calls joined by "\\n"."""
    calls = list(CALL.finditer(text))
    assert calls, f"no tool call in {text!r}"
    assert "\n".join(m.group(0) for m in calls) == text, f"stray text around the calls: {text!r}"
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = []
    for m in calls:
        name, body = m.group(1), m.group(2)
        assert "".join(p.group(0) for p in PARAM.finditer(body)) == body
        out.append((name, _arguments(body, by_name[name]), [k for k, _ in PARAM.findall(body)]))
    return out


# -- (a) json_schema fuzz ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_fuzz_always_validates(compiler: GrammarCompiler, tokenizer: ModelTokenizer,
                                           name: str, mode: str) -> None:
    schema = SCHEMAS[name]
    constraint = _json("json_schema", schema)
    compiler.check(constraint)
    for seed in SEEDS:
        tokens = _generate(compiler, compiler.matcher(constraint), seed, MODES[mode])
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        jsonschema.validate(json.loads(text), schema)


def test_complete_json_allows_only_eos(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_json("json_schema", REFS))
    _feed(decoder, compiler, '{"level": "high", "count": 2}')
    assert decoder.done
    assert _allowed(decoder, compiler.vocab_size).tolist() == [compiler.eos_token_id]


def test_json_property_order_follows_the_schema(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_json("json_schema", REFS))
    _feed(decoder, compiler, "{")
    with pytest.raises(ValueError, match="violates the output constraint"):
        _feed(decoder, compiler, '"count"')


def test_logits_past_the_tokenizer_are_never_allowed(compiler: GrammarCompiler, tiny_dir: Path) -> None:
    spec = json.loads((tiny_dir / "tokenizer.json").read_text())
    ntok = 1 + max([*spec["model"]["vocab"].values(), *(t["id"] for t in spec["added_tokens"])])
    assert compiler.vocab_size > ntok  # dev-tiny pads its logits past the tokenizer
    decoder = compiler.matcher(_json("json_object"))
    _feed(decoder, compiler, '{"')  # inside a key: almost every token is allowed
    masked = decoder.mask(np.full(compiler.vocab_size, 5.0, dtype=np.float32))
    assert np.isfinite(masked[:ntok]).sum() > ntok // 2
    assert np.isneginf(masked[ntok:]).all()


def test_prepare_ahead_gives_the_same_mask(compiler: GrammarCompiler) -> None:
    eager, lazy = (compiler.matcher(_json("json_schema", PERSON)) for _ in range(2))
    logits = np.random.default_rng(3).standard_normal(compiler.vocab_size, dtype=np.float32)
    for token in compiler.tokenizer.tokenize_str('{"name": "Ada", "age": 3'):
        eager.prepare()
        assert np.array_equal(eager.mask(logits), lazy.mask(logits))
        eager.accept(token)
        lazy.accept(token)


def test_mask_rejects_logits_of_another_width(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_json("json_object"))
    with pytest.raises(ValueError, match="logits have"):
        decoder.mask(np.zeros(compiler.vocab_size - 1, dtype=np.float32))


# -- (b) tool_calls fuzz -------------------------------------------------------------------------------


@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
@pytest.mark.parametrize("tool_name", [None, "get_weather", "get_time"], ids=["any", "weather", "time"])
def test_tool_calls_fuzz_parse_and_validate(compiler: GrammarCompiler, tokenizer: ModelTokenizer,
                                            tool_name: str | None, parallel: bool) -> None:
    constraint = _tools(TOOLS, tool_name=tool_name, parallel=parallel)
    compiler.check(constraint)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    n_calls = []
    for seed in SEEDS:
        for mode in sorted(MODES):
            tokens = _generate(compiler, compiler.matcher(constraint), seed, MODES[mode])
            calls = _parse_calls(tokenizer.decode(tokens, skip_special_tokens=False))
            n_calls.append(len(calls))
            for name, args, order in calls:
                assert tool_name is None or name == tool_name
                params = by_name[name]
                jsonschema.validate(args, params)
                assert order == [k for k in params["properties"] if k in args]  # schema order
    if not parallel:
        assert set(n_calls) == {1}


def test_tool_call_starts_with_the_tool_call_token(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_tools(TOOLS))
    start = compiler.tokenizer.tokenize_str("<tool_call>", parse_special=True)
    assert len(start) == 1
    assert _allowed(decoder, compiler.vocab_size).tolist() == start


def test_tool_call_string_value_cannot_swallow_the_closing_tag(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_tools([WEATHER]))
    _feed(decoder, compiler, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>")
    with pytest.raises(ValueError, match="violates"):  # the value ended: a newline must follow
        _feed(decoder, compiler, "x")


def test_tool_call_exact_format_is_accepted(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_tools(TOOLS, parallel=True))
    one = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    two = "<tool_call>\n<function=get_time>\n<parameter=zone>\nParis\n</parameter>\n</function>\n</tool_call>"
    _feed(decoder, compiler, one + "\n" + two)
    assert not decoder.done  # another call may follow
    assert compiler.eos_token_id in _allowed(decoder, compiler.vocab_size)
    decoder.accept(compiler.eos_token_id)
    assert decoder.done


def test_single_tool_call_then_only_eos(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_tools(TOOLS, parallel=False))
    _feed(decoder, compiler, "<tool_call>\n<function=get_time>\n<parameter=zone>\nRome\n</parameter>\n"
                             "</function>\n</tool_call>")
    assert decoder.done
    assert _allowed(decoder, compiler.vocab_size).tolist() == [compiler.eos_token_id]


# -- (c) json_object -----------------------------------------------------------------------------------


def test_json_object_must_open_with_a_brace(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_json("json_object"))
    allowed = _allowed(decoder, compiler.vocab_size)
    texts = {compiler.tokenizer.decode_str([int(t)]) for t in allowed}
    assert texts and all(t.startswith("{") for t in texts)


def test_json_object_accepts_any_object_then_only_eos(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_json("json_object"))
    _feed(decoder, compiler, '{"x": [1, 2.5e3, {"y": null}], "z": "w\\n", "t": true}')
    assert decoder.done
    assert _allowed(decoder, compiler.vocab_size).tolist() == [compiler.eos_token_id]


def test_json_object_fuzz_is_an_object(compiler: GrammarCompiler, tokenizer: ModelTokenizer) -> None:
    # Any object is unbounded: after a while, closing tokens are favoured so every run ends.
    closing = {compiler.tokenizer.tokenize_str(s)[0]: 30.0 for s in ("}", "]", '"')}
    for seed in SEEDS:
        for mode in sorted(MODES):
            tokens = _generate(compiler, compiler.matcher(_json("json_object")), seed, MODES[mode],
                               bias=closing, bias_after=40)
            assert isinstance(json.loads(tokenizer.decode(tokens, skip_special_tokens=False)), dict)


# -- (d) after_reasoning -------------------------------------------------------------------------------


def test_after_reasoning_masks_only_after_the_think_end_token(compiler: GrammarCompiler,
                                                              tokenizer: ModelTokenizer) -> None:
    decoder = compiler.matcher(_json("json_schema", PERSON, after_reasoning=True))
    # Free reasoning, including JSON-breaking text and `</think>` spelled in several tokens.
    free = compiler.tokenizer.tokenize_str("Let me think: [1, 2] </ think> done.\n</", parse_special=True)
    free += compiler.tokenizer.tokenize_str("think>")
    assert compiler.think_end_id not in free
    rng = np.random.default_rng(0)
    for token in free:
        logits = rng.standard_normal(compiler.vocab_size, dtype=np.float32)
        assert decoder.mask(logits) is logits  # untouched, not even copied
        decoder.accept(token)
        assert not decoder.done
    decoder.accept(compiler.think_end_id)
    allowed = _allowed(decoder, compiler.vocab_size)
    texts = {compiler.tokenizer.decode_str([int(t)]) for t in allowed}
    assert "\n\n" in texts and "{" in texts and "Let" not in texts
    tokens = _generate(compiler, decoder, 7, MODES["temperature"])
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    assert re.fullmatch(r"\n{0,2}\{.*\}", text, re.S), text
    jsonschema.validate(json.loads(text), PERSON)


def test_after_reasoning_tool_calls_allow_the_template_gap(compiler: GrammarCompiler) -> None:
    decoder = compiler.matcher(_tools(TOOLS, after_reasoning=True))
    decoder.accept(compiler.tokenizer.tokenize_str("hmm")[0])
    decoder.accept(compiler.think_end_id)
    _feed(decoder, compiler, "\n\n<tool_call>\n<function=get_time>\n<parameter=zone>\nRome\n</parameter>\n"
                             "</function>\n</tool_call>")
    assert compiler.eos_token_id in _allowed(decoder, compiler.vocab_size)


# -- (e) check() rejects what it cannot enforce -----------------------------------------------------------


def _tool_with(prop: dict[str, Any], **params: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": prop}, "required": ["p"], **params}}}]


@pytest.mark.parametrize(("constraint", "message"), [
    (_json("json_schema", {"type": "object", "not": {"required": ["a"]}}), "not"),
    (_json("json_schema", {"type": "array", "uniqueItems": True}), "uniqueItems"),
    (_json("json_schema", {"type": "string", "format": "credit-card"}), "credit-card"),
    (_json("json_schema", {"type": "string", "pattern": "(?<=a)b"}), "look-around"),
    (_json("json_schema", {"$ref": "#/$defs/Missing"}), "Missing"),
    (_json("json_schema", {"type": "strng"}), "strng"),
    (OutputConstraint("json_schema", schema="{not json"), "not valid JSON"),
    (OutputConstraint("json_schema", schema="[1, 2]"), "JSON object"),
    (OutputConstraint("xml"), "unknown constraint kind 'xml'"),
    (_tools(_tool_with({"type": "string", "format": "date"})), "format"),
    (_tools(_tool_with({"type": "object", "dependentRequired": {"a": ["b"]}})), "dependentRequired"),
    (_tools(_tool_with({"type": "string"}, anyOf=[{"required": ["p"]}])), "anyOf"),
    (_tools(_tool_with({"type": "string"}, required=["p", "q"])), "'q'"),
    (_tools(_tool_with({"type": "string", "maxLength": -1})), "maxLength"),
    (_tools(_tool_with({"$ref": "#/$defs/Nope"})), "Nope"),
    (_tools(TOOLS, tool_name="get_stock"), "get_stock"),
    (OutputConstraint("tool_calls", tools="[]"), "non-empty"),
    (OutputConstraint("tool_calls", tools='[{"type": "function"}]'), "every tool"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_check_rejects_unsupported_features(compiler: GrammarCompiler, constraint: OutputConstraint,
                                            message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.check(constraint)
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.matcher(constraint)


def test_check_accepts_annotations_and_nullable_strings(compiler: GrammarCompiler) -> None:
    prop = {"type": ["string", "null"], "description": "d", "title": "t", "default": "x", "examples": ["y"],
            "minLength": 1, "pattern": "[a-z]"}
    compiler.check(_tools(_tool_with(prop, additionalProperties=False, description="params")))


def test_compiler_from_an_llguidance_tokenizer(compiler: GrammarCompiler) -> None:
    other = GrammarCompiler(compiler.tokenizer)
    assert (other.vocab_size, other.eos_token_id, other.think_end_id) == (
        compiler.vocab_size, compiler.eos_token_id, compiler.think_end_id)
    with pytest.raises(ValueError, match="logits"):
        GrammarCompiler(compiler.tokenizer, vocab_size=compiler.vocab_size + 1)


# -- (f) the stock engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stock(tiny_dir: Path) -> Iterator[Any]:
    from worker.engine.stock import StockEngine

    engine = StockEngine(tiny_dir, load("cpu-f32"))
    yield engine
    engine.close()


def _run(engine: Any, req: EngineRequest) -> list[StepOutput]:
    engine.add(req)
    outputs: list[StepOutput] = []
    for _ in range(10_000):
        if not engine.has_work():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError("the engine did not go idle")


def _prompt(tokenizer: ModelTokenizer) -> tuple[int, ...]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Reply in JSON."}], enable_thinking=False)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


# genai's JSON grammar (xgrammar) allows unbounded whitespace between JSON tokens, which a random
# model pads forever; these schemas leave it none (top-level literals, strings, numbers).
STOCK_SCHEMAS: Sequence[dict[str, Any]] = (
    {"enum": [{"name": "x", "age": 3}, {"name": "yy", "age": 5}]},
    {"type": "string", "maxLength": 10},
    {"type": "integer", "minimum": -50, "maximum": 50},
)


@pytest.mark.parametrize("schema", STOCK_SCHEMAS, ids=["enum", "string", "integer"])
def test_stock_json_schema_output_validates(stock: Any, tokenizer: ModelTokenizer, schema: dict[str, Any]) -> None:
    req = EngineRequest("js", _prompt(tokenizer), SamplingParams(max_tokens=64, temperature=0.0),
                        constraint=_json("json_schema", schema))
    outputs = _run(stock, req)
    assert outputs[-1].finished and outputs[-1].error is None
    assert outputs[-1].finish_reason is not None and outputs[-1].finish_reason.value == "stop"
    jsonschema.validate(json.loads("".join(o.text for o in outputs)), schema)


@pytest.mark.parametrize(("constraint", "message"), [
    (_tools(TOOLS), "not supported by the stock engine"),
    (_json("json_object", after_reasoning=True), "not supported by the stock engine"),
    (_json("json_schema", {"type": "object", "not": {}}), "not"),
    (OutputConstraint("json_schema", schema="{"), "not valid JSON"),
])
def test_stock_rejects_at_add(stock: Any, tokenizer: ModelTokenizer, constraint: OutputConstraint,
                              message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        stock.add(EngineRequest("bad", _prompt(tokenizer), constraint=constraint))
    assert not stock.has_work()
