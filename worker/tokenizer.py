"""The model's tokenizer as the worker uses it: encode, decode, chat template and EOS ids.

Wraps `openvino_genai.Tokenizer` (the model dir's `openvino_tokenizer.xml` /
`openvino_detokenizer.xml` and its chat template) so both engines and the process shell share
one implementation. Nothing here hard-codes token ids or the vocabulary size: EOS ids come from
the model dir's `generation_config.json` (a list, as Qwen ships `[<|im_end|>, <|endoftext|>]`),
else `config.json`, else the tokenizer's own EOS token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


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


class ModelTokenizer:
    """openvino-genai's tokenizer for one model dir, with the dir's EOS ids."""

    def __init__(self, model_dir: Path) -> None:
        import openvino_genai

        self.model_dir = Path(model_dir)
        self._tok = openvino_genai.Tokenizer(str(self.model_dir))
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
        return str(self._tok.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens))

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
