"""The dev models' tokenizer: real Qwen BPE ranks with Qwen3's special-token layout.

The ranks (`qwen.tiktoken`, 151,643 byte-level BPE tokens) ship inside the `dashscope` wheel.
They are rebuilt into a Hugging Face fast tokenizer (ByteLevel, Qwen2 split regex, NFC), the
special tokens are appended in Qwen3's order so their ids match Qwen3's, and the Qwen3.6-style
chat template is attached. openvino-tokenizers converts the result during export.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

# Qwen2/Qwen3 pre-tokenizer split: like cl100k's but with single-digit numbers.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens in id order, right after the 151,643 BPE ranks. The flag says whether
# the token is "special" (skipped when decoding with skip_special_tokens); the markup tokens of
# tools and reasoning are not, as in Qwen3, so they survive decoding and can be parsed.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


def qwen_ranks_path() -> Path:
    """Locate `qwen.tiktoken` inside the installed dashscope package."""
    try:
        import dashscope
    except ImportError as exc:  # pragma: no cover - builder extra missing
        raise RuntimeError(
            "the dev-model builder needs the 'build' extra (dashscope ships qwen.tiktoken): "
            "run `make setup`"
        ) from exc
    path = Path(dashscope.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"qwen.tiktoken not found at {path}; is the pinned dashscope installed?")
    return path


def chat_template() -> str:
    return importlib.resources.files(__package__).joinpath("chat_template.jinja").read_text()


def build_hf_tokenizer(max_length: int):  # -> transformers.PreTrainedTokenizerFast
    """Build the fast tokenizer from the BPE ranks (deterministic, offline, ~2 s)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = str(qwen_ranks_path())
    vocab, merges = TikTokenConverter(vocab_file=ranks).extract_vocab_merges_from_model(ranks)
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    next_id = len(vocab)
    for content, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False, single_word=False)
        tok.add_tokens([added]) if not special else tok.add_special_tokens([added])
        got = tok.token_to_id(content)
        if got != next_id:
            raise RuntimeError(f"added token {content!r} got id {got}, expected {next_id}")
        next_id += 1

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        chat_template=chat_template(),
    )
