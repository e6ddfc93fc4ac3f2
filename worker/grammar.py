"""Constrained decoding: an `OutputConstraint` becomes an llguidance grammar, then a logits mask.

Two objects, so the expensive part is paid once per engine:

- `GrammarCompiler` (one per engine): the llguidance tokenizer of the model dir (its
  `tokenizer.json`, padded to the logits width) and the constraint -> grammar translation.
  `check` runs at admission and raises ValueError naming what cannot be enforced.
- `ConstrainedDecoder` (one per request): `mask(logits)` -> logits with every token the grammar
  forbids at -inf, `accept(token)`, `done`. With `after_reasoning` it passes logits through
  untouched until the model emits the `</think>` token.

Grammars are Lark (llguidance's dialect). JSON goes through `%json {schema}` with a bounded
whitespace pattern, so a bounded schema has a bounded output. Tool calls use the model's own
markup (`<tool_call>` / `</tool_call>` are single tokens, forced as such):

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

where a string VALUE is raw text (as the chat template renders it) and anything else is JSON.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

from worker.engine.types import OutputConstraint
from worker.tokenizer import read_eos_token_ids, read_vocab_size

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "tool_calls")
THINK_END = "</think>"
# JSON whitespace, matched at most once between tokens: one space or tab run, or a newline plus
# indentation. Bounded so a bounded schema gives a bounded output (a model cannot pad forever).
JSON_WHITESPACE = r"[ \t]{1,4}|\n[ \t]{0,64}"
# What the chat template puts between `</think>` and the answer.
REASONING_GAP = r"\n{1,2}"
PARAM_END = "\n</parameter>"
# Keywords a raw-text (string) tool parameter may carry; anything else is refused, not ignored.
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly", "$id", "$schema"})
_RAW_STRING_KEYS = _ANNOTATIONS | {"type", "minLength", "maxLength", "pattern", "enum", "const"}
_PARAMETERS_KEYS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "$defs",
                                   "definitions"}
_CACHE_SIZE = 64
_ALLOW_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # indexed by the mask bit


def _lark_str(text: str) -> str:
    """A Lark string literal for `text` (JSON escapes are Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: dict[str, Any]) -> str:
    """`%json {...}` for `schema`, with our whitespace policy (a user's x-guidance is replaced)."""
    body = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    return "%json " + json.dumps(body, ensure_ascii=False)


def _llg_error(messages: list[str]) -> str:
    """llguidance's first error on one line, without its position prefix and grammar excerpt."""
    lines = messages[0].splitlines() if messages else ["invalid grammar"]
    msg = lines[0]
    if msg.startswith("at ") and "): " in msg:
        msg = msg.split("): ", 1)[1]
    msg = msg.removeprefix("failed to compile JSON schema: ")
    detail = next((line for line in lines if line.startswith("error: ")), None)
    return f"{msg} {detail.removeprefix('error: ')}" if detail else msg


def _check_json_schema(schema: dict[str, Any], what: str) -> None:
    """Raise ValueError if llguidance cannot enforce `schema` exactly (no lenient mode)."""
    grammar = llguidance.LLMatcher.grammar_from_lark("start: " + _json_rule(schema))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{what} is not supported: {_llg_error(messages)}")


def _split_alternatives(pattern: str) -> list[str]:
    """`pattern` split at its top-level `|` (outside groups and character classes)."""
    parts: list[str] = []
    depth, start, i, in_class = 0, 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":
                i += 1  # a leading `]` is literal
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    parts.append(pattern[start:])
    return parts


def _search_regex(pattern: str) -> str:
    """A JSON Schema `pattern` (search semantics, ECMA classes) as a full-match Lark regex."""
    anything = "(?s:.*)"
    branches: list[str] = []
    for alt in _split_alternatives(pattern):
        head = alt[1:] if alt.startswith("^") else anything + alt
        # A trailing `$` anchors unless escaped (preceded by an odd number of backslashes).
        if head.endswith("$") and (len(head) - 1 - len(head[:-1].rstrip("\\"))) % 2 == 0:
            body = head[:-1]
        else:
            body = head + anything
        branches.append(f"(?:{body})")
    return llguidance.regex_to_lark("|".join(branches), "dw")


class _ToolGrammar:
    """Lark rules for the `<tool_call>` markup of a list of OpenAI function tools."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.rules: list[str] = []
        self.calls: list[str] = []
        for i, fn in enumerate(tools):
            self.calls.append(self._call(f"t{i}", fn["name"], fn.get("parameters") or {}))

    def _call(self, rule: str, name: str, params: object) -> str:
        where = f"tool {name!r}"
        if not isinstance(params, dict):
            raise ValueError(f"{where}: 'parameters' must be a JSON Schema object")
        unknown = sorted(set(params) - _PARAMETERS_KEYS)
        if unknown:
            raise ValueError(f"{where}: parameters keyword(s) {unknown} are not supported for tool calls")
        if params.get("type", "object") != "object":
            raise ValueError(f"{where}: parameters must have type 'object', got {params.get('type')!r}")
        props = params.get("properties") or {}
        required = params.get("required") or []
        if not isinstance(props, dict) or not isinstance(required, list):
            raise ValueError(f"{where}: 'properties' must be an object and 'required' a list")
        missing = [r for r in required if r not in props]
        if missing:
            raise ValueError(f"{where}: required parameter(s) {missing} have no schema in 'properties'")
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            prule = f"{rule}_p{j}"
            if any(c in key for c in "<>\n"):
                raise ValueError(f"{where}: parameter name {key!r} cannot appear in the <parameter=...> markup")
            if schema is False:
                if key in required:
                    raise ValueError(f"{where}: required parameter {key!r} has the schema false")
                continue
            value = self._value(prule, schema if isinstance(schema, dict) else {}, defs, f"{where} parameter {key!r}")
            head = _lark_str(f"<parameter={key}>\n")
            self.rules.append(f"{prule}: {head} {value}")
            parts.append(prule if key in required else f"{prule}?")
        head, tail = _lark_str(f"\n<function={name}>\n"), _lark_str("</function>\n")
        self.rules.append(f"{rule}: <tool_call> {head} {' '.join(parts)} {tail} </tool_call>")
        return rule

    def _value(self, rule: str, schema: dict[str, Any], defs: dict[str, Any], where: str) -> str:
        """The rule body for one parameter value, through `\\n</parameter>\\n`."""
        resolved = _resolve_ref(schema, defs, where)
        literals = _enum_literals(resolved, where)
        end = _lark_str(PARAM_END + "\n")
        if literals is not None:
            options = [_lark_str(v) for v in literals if v]
            alts = f"({' | '.join(options)})" if options else ""
            if "" in literals and options:
                alts += "?"
            return f"{alts} {end}".strip()
        if _is_raw_string(resolved):
            unknown = sorted(set(resolved) - _RAW_STRING_KEYS)
            if unknown:
                raise ValueError(f"{where}: string keyword(s) {unknown} are not supported in tool arguments "
                                 "(string values are raw text)")
            terminal = rule.upper()
            lo, hi = resolved.get("minLength", 0), resolved.get("maxLength")
            if not all(isinstance(n, int) and n >= 0 for n in (lo, 0 if hi is None else hi)):
                raise ValueError(f"{where}: minLength / maxLength must be non-negative integers")
            # A counted repeat costs llguidance ~10x per step (no token slices apply): only when asked.
            length = "*" if lo == 0 and hi is None else f"{{{lo},{'' if hi is None else hi}}}"
            parts = [f"/(?s:.{length})/", r"~/(?s:.*)\n<\/parameter>(?s:.*)/"]
            if "pattern" in resolved:
                parts.append(f"/{_search_regex(str(resolved['pattern']))}/")
            self.rules.append(f"{terminal}: {' & '.join(parts)}")
            # Lazy (via suffix): the value ends at the first "\n</parameter>", as a parser reads it.
            self.rules.append(f"{rule}_v[suffix={_lark_str(PARAM_END)}]: {terminal}")
            return f'{rule}_v "\\n"'
        sub = {**defs, **schema} if defs else schema  # local $refs resolve against the parameters
        _check_json_schema(sub, where)
        return f"{_json_rule(sub)} {end}"


def _resolve_ref(schema: dict[str, Any], defs: dict[str, Any], where: str) -> dict[str, Any]:
    """`schema`, or the local `#/$defs/X` / `#/definitions/X` it points at (one level)."""
    ref = schema.get("$ref")
    if not isinstance(ref, str):
        return schema
    for section in ("$defs", "definitions"):
        prefix = f"#/{section}/"
        if ref.startswith(prefix) and ref[len(prefix):] in defs.get(section, {}):
            target = defs[section][ref[len(prefix):]]
            return target if isinstance(target, dict) and "$ref" not in target else schema
    raise ValueError(f"{where}: $ref {ref!r} does not point into the parameters' $defs")


def _enum_literals(schema: dict[str, Any], where: str) -> list[str] | None:
    """An enum/const as the raw texts the chat template renders (strings raw, the rest as JSON)."""
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = list(schema["enum"])
    else:
        return None
    if not values:
        raise ValueError(f"{where}: an empty enum admits no value")
    return [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values]


def _is_raw_string(schema: dict[str, Any]) -> bool:
    """A string parameter (possibly nullable: the raw text `null` then reads as null)."""
    t = schema.get("type")
    if isinstance(t, list):
        return "string" in t and set(t) <= {"string", "null"}
    return t == "string"


def _tools(constraint: OutputConstraint) -> list[dict[str, Any]]:
    """The function definitions a tool_calls constraint allows (one if `tool_name` is set)."""
    try:
        tools = json.loads(constraint.tools or "")
    except ValueError as exc:
        raise ValueError(f"tool_calls constraint: 'tools' is not valid JSON ({exc})") from None
    if not isinstance(tools, list) or not tools:
        raise ValueError("tool_calls constraint: 'tools' must be a non-empty JSON list")
    fns = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise ValueError("tool_calls constraint: every tool must be {'type': 'function', "
                             "'function': {'name': ..., 'parameters': ...}}")
        if any(c in fn["name"] for c in "<>\n"):
            raise ValueError(f"tool name {fn['name']!r} cannot appear in the <function=...> markup")
        fns.append(fn)
    if constraint.tool_name is not None:
        fns = [fn for fn in fns if fn["name"] == constraint.tool_name]
        if not fns:
            raise ValueError(f"tool_name {constraint.tool_name!r} is not one of the tools")
    return fns


def build_grammar(constraint: OutputConstraint) -> str:
    """The Lark grammar text for `constraint` (ValueError for what cannot be enforced)."""
    rules: list[str] = []
    if constraint.kind == "json_object":
        body = _json_rule({"type": "object"})
    elif constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.schema or "")
        except ValueError as exc:
            raise ValueError(f"json_schema constraint: the schema is not valid JSON ({exc})") from None
        if schema is False or not isinstance(schema, (dict, bool)):
            raise ValueError("json_schema constraint: the schema must be a JSON object (or true)")
        schema = {} if schema is True else schema
        _check_json_schema(schema, "json_schema constraint")
        body = _json_rule(schema)
    elif constraint.kind == "tool_calls":
        tools = _ToolGrammar(_tools(constraint))
        sep = _lark_str("\n")  # between parallel calls, as the chat template joins them
        body = f"call ({sep} call)*" if constraint.parallel else "call"
        rules = [f"call: {' | '.join(tools.calls)}", *tools.rules]
    else:
        raise ValueError(f"unknown constraint kind {constraint.kind!r}: valid kinds are {', '.join(KINDS)}")
    start = f"start: GAP? {body}\nGAP: /{REASONING_GAP}/" if constraint.after_reasoning else f"start: {body}"
    return "\n".join(["%llguidance {}", start, *rules]) + "\n"


class ConstrainedDecoder:
    """One request's grammar state over the logits of one model.

    Per decode step: `logits = decoder.mask(logits)`, sample from them, `decoder.accept(token)`.
    `mask` never writes into its input: it returns a float32 buffer owned by the decoder and
    overwritten by the next `mask` — or, while the reasoning is still open, the input itself.
    `prepare()` computes the next mask's token set early (llguidance releases the GIL), e.g. while
    the model runs the forward pass; `mask` does it itself otherwise.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, think_end_id: int | None) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._bits = self._bitmask.view(np.uint8)
        self._prepared = False
        self._out = np.empty(vocab_size, dtype=np.float32)
        self._bias = np.empty(vocab_size, dtype=np.float32)
        self._think_end = think_end_id
        self.started = think_end_id is None  # False while the reasoning is open: no masking

    @property
    def done(self) -> bool:
        """The structured output is complete: from now on only EOS is allowed."""
        return self.started and self._matcher.is_stopped()

    def prepare(self) -> None:
        """Compute the allowed-token set for the next `mask` (no-op before `</think>`)."""
        if not self.started or self._prepared:
            return
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self._matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {self._matcher.get_error().splitlines()[0]}")
        self._prepared = True

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (the model's vocab width) with every token the grammar forbids at -inf."""
        if not self.started:
            return logits
        row = logits.reshape(-1)
        if row.size != self._vocab:
            raise ValueError(f"logits have {row.size} entries, the grammar was built for {self._vocab}")
        self.prepare()
        allowed = np.unpackbits(self._bits, count=self._vocab, bitorder="little")
        out = self._out
        if np.count_nonzero(allowed) <= self._vocab // 64:  # mostly forced text: scatter the few
            idx = np.flatnonzero(allowed)
            out.fill(-np.inf)
            out[idx] = row[idx]
        else:  # branch-free: logit + (0 | -inf); a boolean `where` is slow on mixed masks
            np.take(_ALLOW_BIAS, allowed, out=self._bias)
            np.add(row, self._bias, out=out)
        return out

    def accept(self, token: int) -> None:
        """Advance past a sampled token; ValueError if the grammar does not allow it."""
        if not self.started:
            self.started = token == self._think_end
            return
        self._prepared = False
        if not self._matcher.consume_token(int(token)):
            error = self._matcher.get_error().split("\n", 1)[0]
            raise ValueError(f"token {token} violates the output constraint: {error}")


class GrammarCompiler:
    """The model's llguidance tokenizer and the constraint -> grammar step, one per engine.

    `source` is a model dir (its `tokenizer.json`, EOS ids and `config.json` vocab_size are read)
    or a ready `llguidance.LLTokenizer`. `vocab_size` is the logits width, which may exceed the
    tokenizer's vocabulary; ids past the tokenizer are never allowed. The only EOS the grammar
    emits is the model's first EOS id (`<|im_end|>` for Qwen).
    """

    def __init__(self, source: Path | str | llguidance.LLTokenizer, vocab_size: int | None = None) -> None:
        if isinstance(source, llguidance.LLTokenizer):
            if vocab_size is not None and vocab_size != source.vocab_size:
                raise ValueError(f"the tokenizer has {source.vocab_size} ids, the logits {vocab_size}")
            self.tokenizer = source
        else:
            model_dir = Path(source)
            eos = read_eos_token_ids(model_dir)
            self.tokenizer = llguidance.LLTokenizer(
                str(model_dir / "tokenizer.json"),
                n_vocab=vocab_size or read_vocab_size(model_dir),
                eos_token=eos[0] if eos else None,
            )
        self.vocab_size: int = self.tokenizer.vocab_size
        self.eos_token_id: int = self.tokenizer.eos_token
        ids = self.tokenizer.tokenize_str(THINK_END, parse_special=True)
        self.think_end_id: int | None = ids[0] if len(ids) == 1 else None
        self._grammars: OrderedDict[OutputConstraint, str] = OrderedDict()
        # Runtime errors without the grammar and parser state (they would carry request data).
        self._limits = llguidance.LLParserLimits(verbose_errors=False)

    def check(self, constraint: OutputConstraint) -> None:
        """Raise ValueError (naming the feature) unless `constraint` can be enforced exactly."""
        self._grammar(constraint)

    def matcher(self, constraint: OutputConstraint) -> ConstrainedDecoder:
        """A fresh decoder for one request under `constraint`."""
        grammar = self._grammar(constraint)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValueError(f"the output constraint cannot be compiled: {matcher.get_error()}")
        think_end = self.think_end_id if constraint.after_reasoning else None
        return ConstrainedDecoder(matcher, self.vocab_size, think_end)

    def _grammar(self, constraint: OutputConstraint) -> str:
        grammar = self._grammars.get(constraint)
        if grammar is not None:
            self._grammars.move_to_end(constraint)
            return grammar
        if constraint.after_reasoning and self.think_end_id is None:
            raise ValueError(f"after_reasoning needs {THINK_END} to be one token of the vocabulary")
        grammar = build_grammar(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"the output constraint cannot be enforced: {_llg_error(messages)}")
        for warning in messages:
            log.warning("output constraint grammar: %s", warning)
        self._grammars[constraint] = grammar
        if len(self._grammars) > _CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar
