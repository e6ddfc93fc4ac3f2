"""The model's tokenizer as the worker uses it: encode, decode, chat template and EOS ids.

Wraps `openvino_genai.Tokenizer` (the model dir's `openvino_tokenizer.xml` /
`openvino_detokenizer.xml` and its chat template) so both engines and the process shell share
one implementation. Nothing here hard-codes token ids or the vocabulary size: EOS ids come from
the model dir's `generation_config.json` (a list, as Qwen ships `[<|im_end|>, <|endoftext|>]`),
else `config.json`, else the tokenizer's own EOS token.
"""

from __future__ import annotations

import json
import logging
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Decoding. genai's detokenizer is an OpenVINO model (VocabDecoder -> FuzeRagged -> UTF8Validate
# -> StringTensorPack, from openvino-tokenizers): ~120-180 us a call alone on the Zen 4 EPYC, ~0.4
# ms in the decode loop, ~1.5% of a dev-bench decode step (docs/perf-log.md, session 42). That
# graph joins the vocabulary's byte strings of the ids (an id past the vocabulary adds nothing,
# one in its skip list nothing when skipping special tokens) and leaves valid UTF-8 as it is, so
# `IrVocabulary` joins the same bytes from the same constants and decodes them strictly; bytes
# that are not valid UTF-8 (a character split across tokens, where the graph puts U+FFFD) and any
# other graph go to genai. Read with the standard library and numpy: no long call holding the GIL
# while the worker loads (its IO thread answers pings throughout; `tokenizers`' from_file held it
# ~0.5 s, session 42). PROBES random id sequences over the whole vocabulary, both ways of
# skipping, are checked against genai at load; any difference keeps genai's.
PROBES = 16


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids declared by the model dir: generation_config.json first (as transformers and vLLM
    read them), then config.json. Empty if neither declares any."""
    for name in ("generation_config.json", "config.json"):
        ids = _as_id_list(_read_json(model_dir / name).get("eos_token_id"))
        if ids:
            return tuple(dict.fromkeys(ids))  # de-duplicated, order kept
    return ()


def read_vocab_size(model_dir: Path) -> int | None:
    """`vocab_size` from config.json (top level or the text sub-config), if present."""
    cfg = _read_json(model_dir / "config.json")
    for section in (cfg, cfg.get("text_config") or {}):
        if isinstance(section, dict) and isinstance(section.get("vocab_size"), int):
            return int(section["vocab_size"])
    return None


class IrVocabulary:
    """The byte strings of a detokenizer IR's vocabulary, joined as its graph joins them.

    `load` returns None unless the IR is the graph this mirrors (the layers named above, UTF8Validate
    replacing, the vocabulary as the begins / ends / bytes constants VocabDecoder reads, and its
    skip list a constant). `decode` returns None where the graph's output could differ from the
    joined bytes decoded strictly (an id outside [0, size), bytes that are not valid UTF-8)."""

    _LAYERS = {"Parameter": 1, "Convert": 1, "Const": 4, "VocabDecoder": 1, "FuzeRagged": 1, "UTF8Validate": 1,
               "StringTensorPack": 1, "Result": 1}
    _INPUTS = {1: "i32", 2: "i32", 3: "u8", 4: "i32"}  # VocabDecoder's port -> its constant's type

    def __init__(self, data: bytes, begins: list[int], ends: list[int], skip: frozenset[int]) -> None:
        self._data, self._begins, self._ends, self._skip = data, begins, ends, skip
        self.size = len(begins)

    @classmethod
    def load(cls, xml: Path) -> IrVocabulary | None:
        try:
            root = ET.parse(xml).getroot()
            layers = {layer.get("id"): layer for layer in root.iter("layer")}
            if Counter(layer.get("type") for layer in layers.values()) != cls._LAYERS:
                return None
            by_type = {layer.get("type"): layer for layer in layers.values()}
            vocab, validate = by_type["VocabDecoder"], by_type["UTF8Validate"]
            vocab_data = vocab.find("data")
            if vocab_data is not None and vocab_data.get("skip_tokens"):
                return None  # a skip list in an attribute, not the constant read below
            validate_data = validate.find("data")
            if validate_data is None or validate_data.get("replace_mode") != "true":
                return None
            sources = {e.get("to-port"): layers[e.get("from-layer", "")] for e in root.iter("edge")
                       if e.get("to-layer") == vocab.get("id")}
            blob = np.fromfile(xml.with_suffix(".bin"), dtype=np.uint8)
            consts = {}
            for port, kind in cls._INPUTS.items():
                const = sources.get(str(port))
                data = const.find("data") if const is not None and const.get("type") == "Const" else None
                if data is None or data.get("element_type") != kind:
                    return None
                offset, size = int(data.get("offset", -1)), int(data.get("size", -1))
                if offset < 0 or size < 0 or offset + size > blob.size:
                    return None
                consts[port] = blob[offset:offset + size].view(np.int32 if kind == "i32" else np.uint8)
        except (OSError, ET.ParseError, KeyError, ValueError):
            return None
        begins, ends, chars, skip = consts[1], consts[2], consts[3], consts[4]
        if begins.size != ends.size or begins.size == 0 or (ends < begins).any() or int(ends.max()) > chars.size:
            return None
        return cls(chars.tobytes(), begins.tolist(), ends.tolist(), frozenset(skip.tolist()))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str | None:
        if not ids:
            return ""
        if min(ids) < 0 or max(ids) >= self.size:
            return None
        data, begins, ends = self._data, self._begins, self._ends
        if skip_special_tokens:
            skip = self._skip
            joined = b"".join([data[begins[i]:ends[i]] for i in ids if i not in skip])
        else:
            joined = b"".join([data[begins[i]:ends[i]] for i in ids])
        try:
            return joined.decode("utf-8")
        except UnicodeDecodeError:
            return None


class ModelTokenizer:
    """openvino-genai's tokenizer for one model dir, with the dir's EOS ids (decoding: PROBES)."""

    def __init__(self, model_dir: Path) -> None:
        import openvino_genai

        self.model_dir = Path(model_dir)
        self._tok = openvino_genai.Tokenizer(str(self.model_dir))
        self._vocab = self._ir_vocabulary()
        eos = read_eos_token_ids(self.model_dir)
        if not eos:
            own = int(self._tok.get_eos_token_id())
            eos = (own,) if own >= 0 else ()
        self.eos_token_ids: tuple[int, ...] = eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encoded = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return [int(t) for t in encoded.input_ids.data[0]]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if not ids:
            return ""
        ids = [int(t) for t in ids]
        if self._vocab is not None:
            text = self._vocab.decode(ids, skip_special_tokens)
            if text is not None:
                return text
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def _ir_vocabulary(self) -> IrVocabulary | None:
        """The detokenizer IR's vocabulary if it decodes the PROBES as genai does, else None."""
        vocab = IrVocabulary.load(self.model_dir / "openvino_detokenizer.xml")
        if vocab is None:
            log.info("%s: decoding with openvino-genai's detokenizer (not the graph IrVocabulary reads)",
                     self.model_dir)
            return None
        rng = np.random.default_rng(0)
        for i in range(PROBES):
            ids = [int(t) for t in rng.integers(0, vocab.size, 1 + i % 24)] + [vocab.size - 1 - i]
            for skip in (True, False):
                got = vocab.decode(ids, skip)
                if got is not None and got != str(self._tok.decode(ids, skip_special_tokens=skip)):
                    log.warning("%s: the detokenizer IR's vocabulary decodes %s unlike openvino-genai; decoding "
                                "with openvino-genai's detokenizer", self.model_dir, ids)
                    return None
        return vocab

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render the model's chat template. `tools=` and `chat_template=` go to genai's named
        parameters; every other keyword (e.g. `enable_thinking`) becomes template context."""
        tools = kwargs.pop("tools", None)
        chat_template = kwargs.pop("chat_template", "") or ""
        return str(
            self._tok.apply_chat_template(
                [dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=list(tools) if tools is not None else None,
                extra_context=kwargs or None,
            )
        )
