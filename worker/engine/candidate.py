"""The candidate engine: our own generation loop over `openvino.Core` on the locked IR.

One compiled model, one infer request, one request at a time (a profile may add a prefill
model and a decode graph, between which the state moves: `_PREFILL_KERNELS`, `DECODE_GRAPH`).
The IR is stateful (conv/ssm states of the Gated-DeltaNet layers, KV of the full-attention
layers), so a request starts from an empty state (`reset_state()`), then its prompt is fed in
chunks — one chunk per `step()`, so an abort lands between chunks — and then one token per
`step()`. The chunk size comes from the profile's context profile for the prompt's length
(`[prefill]` for short prompts, `[prefill.long]` from its `from_tokens` on): the caller never
pads or picks. Kernels from `kernels/` rewrite the IR before compile (see `_KERNELS`).

Prefix-state reuse (`[prefix_cache]`, worker/prefix_cache.py): a request instead starts from
a snapshot of the longest cached proper prefix of its prompt and prefills only the rest. The
engine snapshots the state (a0) just before the prompt's last chat turn header
(`<|im_start|>`, see `_turn_start`), (a) once the prompt is prefilled and (b) when a request
finishes normally (STOP/LENGTH), keyed by exactly the tokens the state holds: prompt +
generated tokens but the last, which was sampled and never fed. A chat's next turn (history +
new message) then prefills only what the template did not render identically. Snapshots are
taken at the start of the following `step()`, before anything changes the state, so neither
the first token nor the final output waits for the copy. `EngineRequest.reuse_prefix=False`
neither reads nor fills the cache.

Chunks end on multiples of the chunk size. A fresh prompt chunks exactly as before; after a
restore at position p the first chunk is shorter (it ends at the next multiple), so every
later chunk covers the same span, with the same shape, as in a fresh run of that prompt: the
only computation that differs from a fresh run is the first partial chunk. It costs at most one
extra (short) inference per request compared with chunking from p.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from iq36.profile import Profile
from kernels.q16_decode import GREEDY
from worker.detok import OutputStream
from worker.engine import check_request
from worker.engine.types import EngineRequest, FinishReason, StepOutput
from worker.grammar import ConstrainedDecoder, GrammarCompiler
from worker.prefix_cache import PrefixStateCache, restore, snapshot
from worker.reference import stateful_feed
from worker.sampling import Sampler
from worker.tokenizer import ModelTokenizer, read_vocab_size

log = logging.getLogger(__name__)


def _last_token_logits(model: Any) -> Any:
    from kernels import last_token_logits

    return last_token_logits.apply(model)


def _lm_head_u8(model: Any) -> Any:
    from kernels import lm_head_u8

    return lm_head_u8.apply(model)


def _perturb_embeddings(model: Any) -> Any:
    from kernels import perturb

    return perturb.apply(model)


def _phase_experts(model: Any) -> Any:
    from kernels import phase_experts

    return phase_experts.apply(model)


def _native_experts(model: Any) -> Any:
    from kernels import native_experts

    return native_experts.apply(model)


def _native_gdn(model: Any) -> Any:
    from kernels import native_gdn

    return native_gdn.apply(model)


def _native_conv(model: Any) -> Any:
    from kernels import native_conv

    return native_conv.apply(model)


def _q16_decode(model: Any, residual: bool = True, tail_tiles: bool = False, tile_int8: bool = False) -> Any:
    from kernels import q16_decode

    tail_rows = q16_decode.MAX_ROWS
    if tail_tiles:
        tail_rows = q16_decode.TAIL_ROWS_INT8 if tile_int8 else q16_decode.TAIL_ROWS
    return q16_decode.apply(model, residual=residual, tail_rows=tail_rows, tile_int8=tile_int8)


def _grouped_experts(model: Any) -> Any:
    from kernels import grouped_experts

    return grouped_experts.apply(model)


def _native_attention(model: Any) -> Any:
    from kernels import native_attention

    return native_attention.apply(model)


# name -> (rewrite, default when the profile's [kernels] table does not name it)
_KERNELS: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "last_token_logits": (_last_token_logits, True),
    # the int8 LM head as one native GEMV (kernels/lm_head_u8.py; after last_token_logits)
    "lm_head_u8": (_lm_head_u8, False),
    # deliberately wrong; only for proving the correctness gate fails (kernels/perturb.py)
    "perturb_embeddings": (_perturb_embeddings, False),
    # experimental (issue #7): token-grouped experts for prefill chunks inside one graph
    "phase_experts": (_phase_experts, False),
    # phase_experts' layout with the native U4Experts op in place of its Loop (CPU, kernels/native)
    "native_experts": (_native_experts, False),
    # each linear-attention layer's gated delta rule as the native GatedDeltaRule op (CPU)
    "native_gdn": (_native_gdn, False),
    # each linear-attention layer's causal depthwise conv as the native CausalConv1d op (CPU)
    "native_conv": (_native_conv, False),
    # decode rows of the compressed matmuls (dense, LM head, routed experts) on integer products,
    # the activations as two int16 terms (native Q16Linear, CPU); last, after the MoE rewrites
    "q16_decode": (_q16_decode, False),
}
# Kernels that rewrite the same blocks (the routed experts): at most one of each group may be on.
_EXCLUSIVE = ({"phase_experts", "native_experts", "grouped_experts"},)

# A second compiled model for single-token steps (decode) of short contexts: the main model
# with q16_decode's matmuls replaced outright instead of split between the plugin and the op,
# so a decode step runs no zero-row plugin matmul and concat per matmul (dev-bench: 4-6% of a
# step). Built from a clone taken just before q16_decode (the clone shares the constants: no
# second copy of the weights). The state moves to it after prefill (one host copy of every
# variable: ~30 ms for 1024 tokens of dev-bench context); long contexts ([prefill.long]) keep
# decoding on the main model, where moving a KV cache of GBs would cost more than it saves,
# unless a prefill graph (`_PREFILL_KERNELS`) ran the prompt: the state moves after prefill then
# anyway, so it moves to the decode graph.
# The decode graph is pinned to one token (`q16_decode.pin_one_token`): static shapes on the
# whole hidden-state path, no per-call shape inference (AVX-512 EPYC: decode +16-19%).
DECODE_GRAPH = "decode_graph"

# The decode graph's full-attention layers as the native DecodeAttention op, which keeps the KV
# cache itself, outside the model state, u8 quantised exactly as the plugin's own cache
# (kernels/native_decode_attention.py). The engine reaches those caches through a KvStore: it
# writes them when a state moves into the decode graph or a snapshot is restored there, reads them
# into snapshots of the decode graph's state (under the variables' ids, in the packed u8 form) and
# drops them on reset; the other graphs hold the f32 form, converted on the way (`_restore`). Only
# where the plugin's own cache would be u8 (its default on x86 CPUs, unless the profile sets
# KV_CACHE_PRECISION) and there is a decode graph: elsewhere the switch does nothing and the
# engine does not report it.
DECODE_ATTENTION = "native_decode_attention"

DECODE_SHARED_EXPERT = "decode_shared_expert"

# The routed experts' prefill tiles on bf16 dot products (kernels/native_experts.py: bf16_tiles):
# applied after the rewrites when `native_experts` is on, the plugin runs the model in bf16 (its
# default on an AVX512-BF16 CPU, unless the profile sets INFERENCE_PRECISION_HINT) and the CPU has
# AVX512-BF16; elsewhere the switch does nothing and the engine does not report it.
EXPERTS_BF16 = "experts_bf16"

# With EXPERTS_BF16 applied: the lane form's tiles on int8 activations per 32 inputs
# (kernels/native_experts.py: int8_tiles), and Q16_TAIL_TILES' rows on the same int8 tiles
# (kernels/q16_decode.py: TILE_INT8), where the plugin quantizes its own compressed matmuls'
# activations the same way (DYNAMIC_QUANTIZATION_GROUP_SIZE 32, its default where it runs bf16)
# and the CPU has AVX512-VNNI without AMX; elsewhere the switch does nothing and the engine does
# not report it.
EXPERTS_INT8 = "experts_int8"

# q16_decode's u4 products (the dense matmuls' decode rows and the routed experts' one- and
# two-row experts) on the activations' int16 term alone, without its residual
# (kernels/q16_decode.py: RESIDUAL): where `q16_decode` is on and the plugin runs the model in
# bf16, whose activations are bf16 values already; elsewhere the switch does nothing and the
# engine does not report it.
Q16_BF16 = "q16_bf16"

# A prefill chunk's last rows past the plugin's row blocks of 64, 5 to q16_decode.TAIL_ROWS of
# them, on Q16Linear's bf16 tiles (the routed experts' prefill tiles) instead of one more whole
# block of the plugin's compressed matmul (kernels/q16_decode.py: TAIL_ROWS): where `q16_decode` is
# on, the plugin runs the model in bf16 and the CPU has AVX512-BF16; elsewhere the switch does
# nothing and the engine does not report it.
Q16_TAIL_TILES = "q16_tail_tiles"

# Every page of the weights file's mappings brought into the process at load (worker/resident.py:
# madvise MADV_POPULATE_READ), so no token waits on the disk for a page of the embedding table or
# of a rarely routed expert that the kernel had dropped from its cache: where the device is the
# CPU (whose plugin reads the weights where the file is mapped); elsewhere the switch does nothing
# and the engine does not report it. dev-bench, the weights file evicted from the page cache
# before each process: decode steps 28.4-29.7 -> 23.7-27.0 ms (20 major faults in 40 steps -> 0),
# 1.1 s at load (docs/perf-log.md, session 44).
RESIDENT_WEIGHTS = "resident_weights"

# The IR's weights read into the worker's own anonymous memory at load, on transparent huge pages
# where the kernel allows (worker/resident.py: `private_copy`), and the model read from that copy
# instead of the file's mapping: where the device is the CPU; elsewhere, or where the memory
# cannot be had (logged), the switch does nothing and the engine does not report it. With it the
# file is not mapped, so `resident_weights` has nothing to do (the copy is out of the page cache's
# reclaim anyway). The same bytes, the same logits; RSS as with `resident_weights` (the whole
# file). dev-bench decode steps 3-7% shorter, dev-bench-256 3-5%, prefill unchanged; load
# +0.5-1.5 s (docs/perf-log.md, session 47).
ANONYMOUS_WEIGHTS = "anonymous_weights"

# Rewrites that pay off only for chunks of many tokens: applied to a clone of the main model
# (after its rewrites; the clone shares the weights) compiled as a model of its own for prefill
# chunks (> 1 token), while single tokens (decode) run the main or the decode graph (with both,
# the main model is not compiled). The model state
# moves between them when the phase changes (a host copy of every state variable, once per
# request: the move from the main model to the decode graph it replaces costs the same).
_PREFILL_KERNELS: dict[str, tuple[Callable[[Any], Any], bool]] = {
    # experimental: the routed experts of prefill chunks token-grouped in standard ops; it
    # rewrites weights, so the prefill model holds its own copy of them (docs/perf-log.md)
    "grouped_experts": (_grouped_experts, False),
    # each full-attention layer's prefill attention as the native CausalAttention op (causal
    # blocks, a running softmax); the KV cache stays the plugin's fused one in the other models
    "native_attention": (_native_attention, False),
}


# Each rewrite's default when the profile's [kernels] table does not name it.
_DEFAULTS = {name: default for name, (_, default) in {**_KERNELS, **_PREFILL_KERNELS}.items()}
# Every name a profile's [kernels] table may hold (a misspelt one is refused, not ignored).
KNOWN_KERNELS = frozenset({*_DEFAULTS, DECODE_GRAPH, DECODE_ATTENTION, DECODE_SHARED_EXPERT, EXPERTS_BF16,
                           EXPERTS_INT8, Q16_BF16, Q16_TAIL_TILES, RESIDENT_WEIGHTS,
                           ANONYMOUS_WEIGHTS})

# kernels/native ops a rewrite may insert
_NATIVE_OPS = {"U8Linear", "U4Experts", "GatedDeltaRule", "Q16Linear", "CausalConv1d", "CausalAttention",
               "DecodeAttention"}


def specialised_model(core: Any, model_dir: Path, profile: Profile, weights: Any = None) -> tuple[Any, list[str], Any]:
    """The locked IR read by `core` with the profile's rewrites (`_KERNELS`) applied, not yet
    compiled, the names of the rewrites applied, and the decode graph (`DECODE_GRAPH`) or None.
    `weights`: the bytes of the IR's weights file (an ov.Tensor sharing them) to read the
    constants from instead of the file (`ANONYMOUS_WEIGHTS`); the caller keeps them alive."""
    unknown = sorted(profile.kernels.keys() - KNOWN_KERNELS)
    if unknown:
        raise ValueError(f"profile {profile.name}: unknown kernel{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)} in [kernels]; known: {', '.join(sorted(KNOWN_KERNELS))}")
    xml = Path(model_dir) / "openvino_model.xml"
    model = core.read_model(xml) if weights is None else core.read_model(xml.read_text(encoding="utf-8"), weights)
    for group in _EXCLUSIVE:
        on = sorted(name for name in group if profile.kernels.get(name, _DEFAULTS[name]))
        if len(on) > 1:
            raise ValueError(f"profile {profile.name}: kernels {' and '.join(on)} rewrite the same blocks; "
                             "turn all but one off in [kernels]")
    decode_graph = profile.kernels.get(DECODE_GRAPH, False)
    if decode_graph and not profile.kernels.get("q16_decode", _KERNELS["q16_decode"][1]):
        raise ValueError(f"profile {profile.name}: kernel {DECODE_GRAPH} is q16_decode's decode graph; "
                         "turn q16_decode on in [kernels] too")
    applied, decode, decode_attention, shared_expert = [], None, False, False
    # the q16 products without the activations' residual (Q16_BF16)
    residual = not (profile.kernels.get(Q16_BF16, False) and _plugin_bf16(core, profile))
    # the prefill tail rows on the op's bf16 tiles (Q16_TAIL_TILES)
    tail_tiles = profile.kernels.get(Q16_TAIL_TILES, False) and _plugin_bf16(core, profile) and _bf16_cpu()
    # the experts' tiles on bf16 dot products (EXPERTS_BF16, once native_experts has run), and on
    # int8 activations with the tail rows' too (EXPERTS_INT8)
    experts_bf16 = profile.kernels.get(EXPERTS_BF16, False) and _plugin_bf16(core, profile) and _bf16_cpu()
    int8 = (experts_bf16 and profile.kernels.get(EXPERTS_INT8, False)
            and profile.kernels.get("native_experts", _DEFAULTS["native_experts"])
            and _plugin_int8_group(core, profile) == INT8_GROUP and _int8_cpu())
    for name, (rewrite, default) in _KERNELS.items():
        if profile.kernels.get(name, default):
            if name == "q16_decode" and decode_graph:
                from kernels import q16_decode

                decode = q16_decode.pin_one_token(q16_decode.apply(model.clone(), split=False, residual=residual))
                if profile.kernels.get(DECODE_ATTENTION, False) and _plugin_kv_u8(core, profile):
                    from kernels import native_decode_attention

                    decode = native_decode_attention.apply(decode)
                    decode_attention = True
                if profile.kernels.get(DECODE_SHARED_EXPERT, False):
                    from kernels import decode_shared_expert

                    shared_expert = decode_shared_expert.apply(decode) > 0
            model = (rewrite(model, residual=residual, tail_tiles=tail_tiles, tile_int8=int8) if name == "q16_decode"
                     else rewrite(model))
            applied.append(name)
    if decode is not None:
        applied.append(DECODE_GRAPH)
        if decode_attention:
            applied.append(DECODE_ATTENTION)
        if shared_expert:
            applied.append(DECODE_SHARED_EXPERT)
    if not residual and "q16_decode" in applied:
        applied.append(Q16_BF16)
    if tail_tiles and "q16_decode" in applied:
        applied.append(Q16_TAIL_TILES)
    if experts_bf16 and "native_experts" in applied:
        from kernels import native_experts

        if native_experts.bf16_tiles(model):
            applied.append(EXPERTS_BF16)
            if int8 and native_experts.int8_tiles(model):
                applied.append(EXPERTS_INT8)
    return model, applied, decode


def _plugin_type(core: Any, profile: Profile, key: str) -> str:
    """The element type the plugin will use for property `key` (the profile's value, else the
    device's default), lower case."""
    value = profile.engine.properties.get(key)
    if value is None:
        value = core.get_property(profile.engine.device, key)
    return (value.get_type_name() if hasattr(value, "get_type_name") else str(value)).lower()


def _bf16_cpu() -> bool:
    from kernels import native

    return native.bf16_supported()


# The activation group of U4Experts' int8 tiles (u4_experts_int8.hpp: kGroup).
INT8_GROUP = 32


def _int8_cpu() -> bool:
    from kernels import native

    return native.int8_supported()


def _plugin_int8_group(core: Any, profile: Profile) -> int:
    """The inputs per int8 activation scale in the plugin's compressed matmuls
    (DYNAMIC_QUANTIZATION_GROUP_SIZE; 0: no dynamic quantization)."""
    try:
        return int(_plugin_type(core, profile, "DYNAMIC_QUANTIZATION_GROUP_SIZE"))
    except ValueError:
        return 0


def _plugin_bf16(core: Any, profile: Profile) -> bool:
    """Whether the plugin will run the model in bf16 (INFERENCE_PRECISION_HINT)."""
    return _plugin_type(core, profile, "INFERENCE_PRECISION_HINT") in ("bf16", "bfloat16")


def _plugin_kv_u8(core: Any, profile: Profile) -> bool:
    """Whether the plugin keeps the KV cache in u8 (KV_CACHE_PRECISION)."""
    return _plugin_type(core, profile, "KV_CACHE_PRECISION") in ("u8", "uint8", "uint8_t")


class _Running:
    """The request being served: where its prefill is, its sampler and its output stream."""

    def __init__(self, req: EngineRequest, tokenizer: ModelTokenizer, decoder: ConstrainedDecoder | None) -> None:
        self.req = req
        self.decoder = decoder  # constrained decoding (structured output, forced tool calls)
        self.prompt = np.asarray(req.prompt_ids, dtype=np.int64)
        self.fed = 0  # tokens already in the model state
        self.sampler = Sampler(req.params, req.prompt_ids)
        self.stream = OutputStream(tokenizer.decode, req.params, tokenizer.eos_token_ids)
        self.aborted = False
        self.turn_start = 0  # where the prompt's last chat turn header begins (0: none / not used)

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt.size

    def output(self, tokens: list[int], text: str) -> StepOutput:
        return self.stream.step_output(self.req.request_id, int(self.prompt.size), tokens, text)


class CandidateEngine:
    """The `Engine` protocol over a raw OpenVINO stateful loop."""

    def __init__(self, model_dir: Path, profile: Profile, tokenizer: ModelTokenizer | None = None) -> None:
        import openvino as ov

        self.profile = profile
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer or ModelTokenizer(self.model_dir)
        core = ov.Core()
        on_cpu = profile.engine.device.upper() == "CPU"
        weights = None
        if profile.kernels.get(ANONYMOUS_WEIGHTS, False) and on_cpu:
            from worker import resident

            copy = resident.private_copy(self.model_dir / "openvino_model.bin")
            if copy is not None:  # kept by `resident` for the process's lifetime
                weights = ov.Tensor(copy, shared_memory=True)
        model, kernels, decode = specialised_model(core, self.model_dir, profile, weights)
        self.kernels: list[str] = kernels
        if weights is not None:
            self.kernels.append(ANONYMOUS_WEIGHTS)
        prefill = [name for name, (_, default) in _PREFILL_KERNELS.items() if profile.kernels.get(name, default)]
        pmodel = None
        if prefill:
            pmodel = model.clone()  # the main model's rewrites, its constants (no second copy)
            for name in prefill:
                pmodel = _PREFILL_KERNELS[name][0](pmodel)
                self.kernels.append(f"{name} (prefill)")
        from kernels.graph_hash import structure_hash

        # joins the identity (READY, /v1/models, gate)
        self.graph_hash = structure_hash(model, *(m for m in (decode, pmodel) if m is not None))
        self._inputs = {p.get_any_name() for p in model.inputs}
        vocab = model.output("logits").get_partial_shape()[-1]
        self.vocab_size = vocab.get_length() if vocab.is_static else read_vocab_size(self.model_dir)
        properties = dict(profile.engine.properties)
        if (decode is not None or pmodel is not None) and properties.pop("CACHE_DIR", None):
            # a model imported from the compile cache holds its own copy of the weights: the
            # decode graph and the main model would hold two (dev-bench gate: 3.96 GB instead
            # of 2.7); compiled from the IR they share its constants
            log.info("compiling without CACHE_DIR, so the engine's graphs share the weights")
        graphs = [m for m in (model, pmodel, decode) if m is not None]
        if any(op.get_type_name() in _NATIVE_OPS for m in graphs for op in m.get_ops()):
            from kernels import native

            native.register(core)  # compiling does not need it; importing a cached blob would
        self._decode_request: Any = None
        self._decode_compiled: Any = None
        # the decode graph's KV caches, held by its DecodeAttention ops (DECODE_ATTENTION)
        self._kv: Any = None
        if decode is not None and DECODE_ATTENTION in self.kernels:
            from kernels.native_decode_attention import KvStore, slots

            self._kv = KvStore(slots(decode))
        if decode is not None:
            self._decode_compiled = core.compile_model(decode, profile.engine.device, properties)
            self._decode_request = self._decode_compiled.create_infer_request()
        # contexts from here on decode on the main model (see DECODE_GRAPH)
        self._decode_until = profile.prefill.long.from_tokens if profile.prefill.long is not None else None
        self._prefill_request: Any = None
        if pmodel is not None:
            self._decode_until = None  # the state moves after prefill anyway
            self._prefill_compiled = core.compile_model(pmodel, profile.engine.device, properties)
            self._prefill_request = self._prefill_compiled.create_infer_request()
        if pmodel is not None and decode is not None:
            # every call runs on the prefill or the decode graph: the main model would never
            # run, so it is not compiled (a compile's time and the plugin's per-model memory)
            self._compiled, self._request = self._prefill_compiled, self._prefill_request
        else:
            self._compiled = core.compile_model(model, profile.engine.device, properties)
            self._request = self._compiled.create_infer_request()
        if profile.kernels.get(RESIDENT_WEIGHTS, False) and on_cpu and weights is None:
            self._make_resident()
        # the infer requests whose graph gives the LM head's argmax (kernels/q16_decode.py: GREEDY)
        self._greedy = {id(r) for r in self._requests() if any(GREEDY in o.get_names() for o in r.model_outputs)}
        self._live: Any = self._request  # the infer request holding the model state (None: empty)
        self._calls: dict[int, int] = {}  # inferences per infer request (`stateful_feed`'s `call`)
        self._queue: deque[EngineRequest] = deque()
        self._running: _Running | None = None
        self._ready: list[StepOutput] = []  # outputs owed to the caller (e.g. queued aborts)
        pc = profile.prefix_cache
        self.prefix_cache = PrefixStateCache(pc.max_bytes, pc.max_entries, pc.idle_s) if pc.enabled else None
        self._snapshot_due: _Running | None = None  # its state is to be kept before the next inference
        # The chat turn marker (`<|im_start|>`), if the vocabulary has one: see `_turn_start`.
        marker = self.tokenizer.encode("<|im_start|>", add_special_tokens=False)
        self._turn_marker = marker[0] if len(marker) == 1 else None
        self._grammar: GrammarCompiler | None = None  # built on the first constrained request (~2-4 s)

    def _make_resident(self) -> None:
        """RESIDENT_WEIGHTS: every page of the compiled graphs' weights file in the process."""
        from worker import resident

        path = self.model_dir / "openvino_model.bin"
        start = time.perf_counter()
        done = resident.populate(path)
        if done:
            self.kernels.append(RESIDENT_WEIGHTS)
            log.info("weights resident: %.2f GB of %s in %.2f s", done / 1e9, path.name, time.perf_counter() - start)

    # -- contract --------------------------------------------------------------------------

    def add(self, req: EngineRequest) -> None:
        check_request(req, self.profile, self.vocab_size)
        if req.constraint is not None:
            if req.params.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured output: a complete output "
                                 "allows only the end-of-sequence token")
            self._compiler().check(req.constraint)  # unsupported schema features: refused before generation
        if self._known(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is already queued or running")
        self._queue.append(req)

    def abort(self, request_id: str) -> None:
        if self._running is not None and self._running.req.request_id == request_id:
            self._running.aborted = True  # honoured by the next step(), before any compute
            return
        for req in self._queue:
            if req.request_id == request_id:
                self._queue.remove(req)
                self._ready.append(
                    StepOutput(request_id=request_id, finished=True, finish_reason=FinishReason.ABORT,
                               prompt_tokens=len(req.prompt_ids))
                )
                return

    def step(self) -> list[StepOutput]:
        outputs, self._ready = self._ready, []
        self._take_due_snapshot()
        if self._running is None and self._queue:
            req = self._queue.popleft()
            try:
                decoder = self._compiler().matcher(req.constraint) if req.constraint is not None else None
                self._running = _Running(req, self.tokenizer, decoder)
                self._start(self._running)
            except Exception as exc:  # a request-level failure: report it, keep serving
                log.exception("request %s failed to start", req.request_id)
                self._running = None
                outputs.append(StepOutput(request_id=req.request_id, finished=True,
                                          finish_reason=FinishReason.ERROR, error=str(exc),
                                          prompt_tokens=len(req.prompt_ids)))
                return outputs
        run = self._running
        if run is None:
            return outputs
        try:
            out = self._advance(run)
        except Exception as exc:
            log.exception("request %s failed", run.req.request_id)
            run.stream.finish(FinishReason.ERROR)
            out = run.output([], "")
            out.error = f"{type(exc).__name__}: {exc}"
        if self._state_worth_keeping(run):
            self._snapshot_due = run
        if out is not None:
            outputs.append(out)
            if out.finished:
                self._running = None
        return outputs

    def has_work(self) -> bool:
        """Also True while a snapshot is due: the next `step()` takes it (no output)."""
        return bool(self._ready or self._queue or self._running is not None or self._snapshot_due is not None)

    def close(self) -> None:
        self._queue.clear()
        self._running = None
        self._snapshot_due = None
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self._request = self._live = self._prefill_request = self._decode_request = None
        self._compiled = self._prefill_compiled = self._decode_compiled = None
        if self._kv is not None:
            self._kv.drop()

    def describe(self) -> dict[str, Any]:
        """What the compiled model resolved to (reported in the worker's READY identity)."""
        return {
            "INFERENCE_PRECISION_HINT": str(self._compiled.get_property("INFERENCE_PRECISION_HINT")),
            "kernels": list(self.kernels),
            "graph": self.graph_hash,
        }

    def op_profile(self) -> dict[str, float]:
        """Seconds per op type summed over every inference so far, of every compiled model the
        engine runs (the CPU plugin reports per-request averages; needs PERF_COUNT=True in the
        profile). Differences between two calls give the time of the inferences between them."""
        totals: dict[str, float] = {}
        for request in self._requests():
            calls = self._calls.get(id(request), 0)
            if not calls:
                continue
            for info in request.profiling_info:
                totals[info.node_type] = totals.get(info.node_type, 0.0) + info.real_time.total_seconds() * calls
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def forced_logits(self, prompt: list[int], forced: list[int]) -> Iterator[np.ndarray]:
        """Teacher forcing through the candidate's own prefill and decode path (the gate).

        Yields, for each token of `forced`, the logits (float32 copy) the candidate computes for
        that position having seen `prompt` + the forced tokens before it. Not for serving: it
        bypasses the queue, so call it only on an idle engine.
        """
        if self._running is not None or self._queue:
            raise RuntimeError("forced_logits needs an idle engine")
        self._take_due_snapshot()  # before the state is replaced; the cache is otherwise bypassed
        self._reset_state()
        ids = np.asarray(prompt, dtype=np.int64)
        fed = 0
        while fed < ids.size:
            chunk = ids[fed:fed + self._chunk_for(ids.size)]
            logits, _ = self._infer(chunk, fed)
            fed += chunk.size
        for i, token in enumerate(forced):
            yield np.array(logits, dtype=np.float32)
            if i + 1 < len(forced):
                logits, _ = self._infer(np.array([token], dtype=np.int64), fed)
                fed += 1

    # -- the loop ----------------------------------------------------------------------------

    def _known(self, request_id: str) -> bool:
        if self._running is not None and self._running.req.request_id == request_id:
            return True
        return any(r.request_id == request_id for r in self._queue)

    def _advance(self, run: _Running) -> StepOutput | None:
        """One prefill chunk or one decode step of `run`; None when there is nothing to report."""
        if run.aborted:
            run.stream.finish(FinishReason.ABORT)
            return run.output([], "")
        if run.prefilling:
            start = run.fed
            size = self._chunk_for(run.prompt.size)
            end = (start // size + 1) * size  # on the chunk grid
            if start < run.turn_start < end:
                end = run.turn_start  # stop there once, to keep the history's state (see _turn_start)
            ids = run.prompt[start:end]
            logits, top = self._infer(ids, start)
            run.fed += ids.size
            if run.prefilling:
                return None  # more chunks to go; nothing to say yet
        else:
            last = run.stream.token_ids[-1]
            logits, top = self._infer(np.array([last], dtype=np.int64), run.fed)
            run.fed += 1
        if run.decoder is not None:
            logits, top = run.decoder.mask(logits), None
        token = run.sampler.sample(logits, top)
        if run.decoder is not None:
            run.decoder.accept(token)
        run.sampler.accept(token)
        text = run.stream.push(token)
        return run.output([token], text)

    def _chunk_for(self, prompt_tokens: int) -> int:
        return self.profile.prefill.chunk_for(prompt_tokens)

    def _compiler(self) -> GrammarCompiler:
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.model_dir, vocab_size=self.vocab_size)
        return self._grammar

    # -- prefix-state reuse ------------------------------------------------------------------

    def _start(self, run: _Running) -> None:
        """Set the model state for a new request: a snapshot of its longest cached prefix, or empty."""
        entry = None
        if self.prefix_cache is not None and run.req.reuse_prefix:
            entry = self.prefix_cache.lookup(run.prompt)
        if entry is not None:
            try:
                holder = self._request_for(int(run.prompt.size) - entry.length, entry.length)
                self._restore(holder, entry.states)
                self._live = holder
                run.fed = run.stream.cached_tokens = entry.length
                log.debug("request %s: restored %d of %d prompt tokens", run.req.request_id, entry.length,
                          run.prompt.size)
            except Exception:  # the cache is an optimisation: fall back to a full prefill
                log.exception("request %s: restoring a %d-token prefix failed", run.req.request_id, entry.length)
                entry = None
        if entry is None:
            self._reset_state()
        if self.prefix_cache is not None and run.req.reuse_prefix:
            run.turn_start = self._turn_start(run)

    def _turn_start(self, run: _Running) -> int:
        """The position of the prompt's last `<|im_start|>` (the generation prompt's header), if
        it is still to be prefilled: 0 otherwise.

        Qwen's chat template renders a past assistant turn differently from the generation prompt
        that produced it (`<|im_start|>assistant\n<think>…` becomes the bare answer once a newer
        user message follows), so the next turn's prompt shares everything up to this header but
        not the prompt's end. A snapshot here lets that next turn skip the whole history.
        """
        if self._turn_marker is None:
            return 0
        hits = np.flatnonzero(run.prompt == self._turn_marker)
        if hits.size == 0:
            return 0
        b = int(hits[-1])
        return b if run.fed < b < run.prompt.size else 0

    def _state_worth_keeping(self, run: _Running) -> bool:
        """After this step: (a0) the history before the last turn header was just prefilled, (a)
        the prompt was just prefilled (the state holds exactly the prompt) or (b) the request
        finished normally. Aborted or failed requests keep only (a0) and (a)."""
        if self.prefix_cache is None or not run.req.reuse_prefix:
            return False
        if run.stream.finished:
            return run.stream.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if run.prefilling:
            return run.fed == run.turn_start > 0  # (a0) the history before the last turn header
        return run.fed == run.prompt.size

    def _take_due_snapshot(self) -> None:
        """Keep the state under exactly the tokens it holds: the prompt, then the generated tokens
        fed back so far (the last sampled one never is). Must run before the next inference."""
        run, self._snapshot_due = self._snapshot_due, None
        if run is None or self.prefix_cache is None:
            return
        if run.fed <= run.prompt.size:
            tokens = run.prompt[:run.fed]
        else:
            generated = np.asarray(run.stream.token_ids[:run.fed - run.prompt.size], dtype=np.int64)
            tokens = np.concatenate([run.prompt, generated])
        try:
            states = self._snapshot(self._live or self._request, self.prefix_cache.max_bytes - tokens.nbytes)
            if states is not None:
                self.prefix_cache.put(tokens, states)
        except Exception:  # never fail a request over the cache
            log.exception("request %s: taking a %d-token snapshot failed", run.req.request_id, tokens.size)

    def _request_for(self, tokens: int, past: int) -> Any:
        """The infer request that feeds `tokens` tokens after `past` tokens of state."""
        if tokens > 1:
            return self._prefill_request if self._prefill_request is not None else self._request
        if self._decode_request is not None and (self._decode_until is None or past < self._decode_until):
            return self._decode_request
        return self._request

    def _infer(self, ids: np.ndarray, past: int) -> tuple[np.ndarray, int | None]:
        """Feed `ids` after `past` tokens of state; the last position's logits (a view) and, where
        the graph has the LM head's `greedy_token` output, their argmax."""
        request = self._request_for(int(ids.size), past)
        if self._live is None:  # every request holds an empty state
            self._live = request
        elif request is not self._live:
            # through the host, as prefix snapshots (handing one request's state tensor to another
            # is not supported), but from views: the restore is the one copy (at 4096 tokens of
            # dev-bench the handoff took ~100 ms with numpy's copy and pack, ~5 ms now)
            states = self._snapshot(self._live, max_bytes=np.iinfo(np.int64).max, copy=False)
            self._restore(request, states or {})
            if self._live is self._prefill_request:
                # its copy is stale now; the prefill graph's KV cache is a plain f32 state
                # (no plugin cache compression), the largest one the engine holds
                self._live.reset_state()
            self._live = request
        calls = self._calls.get(id(request), 0)
        self._calls[id(request)] = calls + 1
        feed = stateful_feed(ids, past, self._inputs, calls)
        if self._kv is not None and request is self._decode_request:
            from kernels.native_decode_attention import STORE

            feed[STORE] = self._kv.feed
        # zero-copy both ways: the request reads the feed's fresh arrays in place (the copying
        # dispatch took ~65 us a step against ~20), and no copy of every output is made for a
        # result nobody reads (the logits are read from the request's tensor below). Every call
        # shares: a request whose inputs were shared cannot take a copying call after it (the
        # shared tensor cannot grow to a longer attention mask).
        request.infer(feed, share_inputs=True, share_outputs=True)
        logits = request.get_tensor("logits").data[0, -1]
        if id(request) not in self._greedy:
            return logits, None
        return logits, int(request.get_tensor(GREEDY).data[0, -1])

    def _snapshot(self, request: Any, max_bytes: int, copy: bool = True) -> dict[str, np.ndarray] | None:
        """Copies of `request`'s state (`worker.prefix_cache.snapshot`; views if not `copy`), with
        the decode graph's KV caches from its store (copies), or None past `max_bytes`."""
        states = snapshot(request, max_bytes, copy)
        if states is None or self._kv is None or request is not self._decode_request:
            return states
        caches = self._kv.read(max_bytes - sum(a.nbytes for a in states.values()))
        return None if caches is None else {**states, **caches}

    def _restore(self, request: Any, states: dict[str, np.ndarray]) -> None:
        """Set `request`'s state from a snapshot of any of the engine's graphs (every variable;
        see `worker.prefix_cache.restore`): the KV caches converted to the form its graph holds
        (DECODE_ATTENTION's packed u8 rows in the decode graph's store, f32 elsewhere)."""
        if self._kv is not None:
            from kernels.native_decode_attention import to_state

            if request is self._decode_request:  # the store takes either form (f32: quantised natively)
                self._kv.write(states)
                states = {name: array for name, array in states.items() if name not in self._kv.variables}
            else:
                states = {name: to_state(array, name, frozenset()) for name, array in states.items()}
        restore(request, states)

    def _reset_state(self) -> None:
        # An empty state cannot be moved between requests (the KV cache's empty shape is not a
        # valid one to set): reset every request, and the first inference picks the holder.
        for request in self._requests():
            request.reset_state()
        if self._kv is not None:
            self._kv.drop()
        self._live = None

    def _requests(self) -> list[Any]:
        """Every distinct infer request (the main one may be the prefill graph's)."""
        found: list[Any] = []
        for request in (self._request, self._prefill_request, self._decode_request):
            if request is not None and all(request is not r for r in found):
                found.append(request)
        return found

