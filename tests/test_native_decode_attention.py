"""`native_decode_attention` (kernels/native_decode_attention.py, kernels/native/decode_attention.hpp):
the decode graph's attention and its u8 KV cache as one native op."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import native
from kernels import native_decode_attention as nda
from tests.helpers import final, run_engine, tokens_of

pytestmark = pytest.mark.skipif(not native.cpu_supported(), reason="the native ops need AVX2, FMA and F16C")


def _rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random f32 rows with a few awkward ones: constant (scale 0), one outlier, tiny values."""
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    if flat.shape[0] >= 3:
        flat[0] = 1.5
        flat[1, 7] = 400.0
        flat[2] *= 1e-6
    return x


def test_pack_is_the_plugins_u8_kv_cache(tiny_dir: Path) -> None:
    """`pack` quantises as the CPU plugin does its u8 KV cache, bit for bit: a state set on the
    plugin's fused cache reads back as `unpack(pack(x))`."""
    import openvino as ov

    from tests.helpers import REFERENCE

    core = ov.Core()
    compiled = core.compile_model(core.read_model(tiny_dir / "openvino_model.xml"), "CPU", REFERENCE)
    if str(compiled.get_property("KV_CACHE_PRECISION")) not in ("<Type: 'uint8_t'>", "u8"):
        pytest.skip(f"the plugin's KV cache is {compiled.get_property('KV_CACHE_PRECISION')} here, not u8")
    request = compiled.create_infer_request()
    caches = [v for v in request.query_state() if ".key." in v.name or ".value." in v.name]
    assert caches
    rng = np.random.default_rng(7)
    for variable in caches:
        heads, size = variable.state.shape[1], variable.state.shape[3]
        x = _rows(rng, (1, heads, 300, size))
        variable.state = ov.Tensor(x)
        assert np.array_equal(np.array(variable.state.data), nda.unpack(nda.pack(x))), variable.name
    packed = nda.pack(x)
    assert packed.dtype == np.uint8 and packed.shape == (*x.shape[:-1], x.shape[-1] + nda.EXTRA)
    assert np.array_equal(nda.to_state(x, "k", frozenset({"k"})), packed)
    assert np.array_equal(nda.to_state(packed, "k", frozenset()), nda.unpack(packed))
    assert nda.to_state(x, "k", frozenset()) is x and nda.to_state(packed, "k", frozenset({"k"})) is packed


class _Op:
    """One DecodeAttention layer (slot 0) compiled alone, with a KvStore of its own."""

    def __init__(self, heads: int, kv: int, size: int) -> None:
        import openvino as ov
        from openvino import opset15 as op

        self.scale = 1 / np.sqrt(size)
        self.q = op.parameter([1, heads, 1, size], np.float32)
        self.k, self.v = (op.parameter([1, kv, 1, size], np.float32) for _ in range(2))
        self.mask = op.parameter([1, -1], np.int64)
        self.store_input = op.parameter([1], np.int64)
        node = native.factory().create(
            "DecodeAttention", [self.q.output(0), self.k.output(0), self.v.output(0), self.mask.output(0),
                                self.store_input.output(0), op.constant(np.float32(self.scale)).output(0)],
            {"slot": 0, "key": "k", "value": "v"})
        model = ov.Model([node.output(0)], [self.q, self.k, self.v, self.mask, self.store_input])
        core = ov.Core()
        native.register(core)
        self.request = core.compile_model(model, "CPU").create_infer_request()
        self.store = nda.KvStore(nda.slots(model))

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int) -> np.ndarray:
        self.request.infer([q, k, v, np.ones((1, past + 1), np.int64), self.store.feed])
        return np.array(self.request.get_output_tensor(0).data)


@pytest.mark.parametrize(("kv", "group", "size", "past"),
                         [(2, 8, 256, 0), (2, 8, 256, 1100), (1, 2, 64, 37), (1, 10, 64, 600), (2, 3, 32, 512)])
def test_decode_attention_is_attention_over_the_dequantised_cache(kv: int, group: int, size: int,
                                                                  past: int) -> None:
    """The op appends the token's rows to its store, quantised as `pack` does (bit for bit), and
    attends over the whole cache, its own key included, as float64 does over the dequantised
    cache; spans of 512 keys and more than 8 query heads per kv head included."""
    rng = np.random.default_rng(past + group)
    q = rng.standard_normal((1, kv * group, 1, size)).astype(np.float32)
    k, v = (_rows(rng, (1, kv, 1, size)) for _ in range(2))
    past_k, past_v = (np.ascontiguousarray(nda.pack(_rows(rng, (1, kv, max(past, 3), size)))[:, :, :past])
                      for _ in range(2))
    layer = _Op(kv * group, kv, size)
    try:
        layer.store.write({"k": past_k, "v": past_v})
        out = layer(q, k, v, past)
        cache = layer.store.read(max_bytes=1 << 40)
    finally:
        layer.store.drop()
    assert cache is not None
    k_all, v_all = cache["k"], cache["v"]
    assert np.array_equal(k_all, np.concatenate([past_k, nda.pack(k)], axis=2))
    assert np.array_equal(v_all, np.concatenate([past_v, nda.pack(v)], axis=2))
    keys, values = nda.unpack(k_all)[0].astype(np.float64), nda.unpack(v_all)[0].astype(np.float64)
    queries = q.reshape(kv, group, size).astype(np.float64)
    scores = np.einsum("hgd,htd->hgt", queries, keys) * layer.scale
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("hgt,htd->hgd", weights, values).reshape(q.shape)
    assert np.abs(out - want).max() <= 2e-6 * np.abs(want).max()


def forms_probe(path: str) -> None:
    """Save the op's outputs over cases that take every pass (8 and 3 query heads a kv head, one
    span and three, head sizes 256, 64 and 32) with their float64 references to `path` (.npz); run
    in a subprocess by the test below, once per form of the passes."""
    outputs = {}
    for i, (kv, group, size, past) in enumerate([(2, 8, 256, 1100), (1, 3, 64, 40), (2, 8, 32, 700)]):
        rng = np.random.default_rng(100 + i)
        q = rng.standard_normal((1, kv * group, 1, size)).astype(np.float32)
        k, v = (_rows(rng, (1, kv, 1, size)) for _ in range(2))
        past_k, past_v = (np.ascontiguousarray(nda.pack(_rows(rng, (1, kv, past, size)))) for _ in range(2))
        layer = _Op(kv * group, kv, size)
        try:
            layer.store.write({"k": past_k, "v": past_v})
            outputs[f"out{i}"] = layer(q, k, v, past)
            cache = layer.store.read(max_bytes=1 << 40)
        finally:
            layer.store.drop()
        assert cache is not None
        keys, values = nda.unpack(cache["k"])[0].astype(np.float64), nda.unpack(cache["v"])[0].astype(np.float64)
        scores = np.einsum("hgd,htd->hgt", q.reshape(kv, group, size).astype(np.float64), keys) * layer.scale
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        outputs[f"want{i}"] = np.einsum("hgt,htd->hgd", weights, values).reshape(q.shape)
    np.savez(path, **outputs)


def test_the_zmm_and_ymm_passes_are_both_the_attention(tmp_path: Path) -> None:
    """On an AVX-512 CPU the scores and the weighted value sum take zmm vectors (`dattn::zmm`);
    `IQ36_NATIVE_AVX512=0` keeps the ymm passes. Both are attention over the dequantised cache as
    float64 computes it, and they differ from each other by f32 rounding only (a score's lanes
    summed in another order)."""
    import os
    import subprocess
    import sys

    if "avx512f" not in native.cpu_flags():
        pytest.skip("the zmm passes need a CPU with avx512f")
    runs = {}
    for flag in ("0", "1"):
        path = tmp_path / f"avx512-{flag}.npz"
        code = f"from tests.test_native_decode_attention import forms_probe; forms_probe({str(path)!r})"
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "IQ36_NATIVE_AVX512": flag}, check=True,
                       cwd=Path(__file__).parent.parent, capture_output=True, text=True)
        runs[flag] = np.load(path)
    for i in range(3):
        want = runs["0"][f"want{i}"]
        bound = 2e-6 * np.abs(want).max()
        assert np.abs(runs["0"][f"out{i}"] - want).max() <= bound, i
        assert np.abs(runs["1"][f"out{i}"] - want).max() <= bound, i
        assert np.abs(runs["1"][f"out{i}"] - runs["0"][f"out{i}"]).max() <= bound, i


def test_the_store_grows_in_place_and_rewinds() -> None:
    """Steps append to the store across its growth (past 256 and 1024 + 256 rows: copies keep
    every row); a step after fewer tokens than the store holds overwrites from there (a rewind);
    a step after more tokens than it holds fails, as does one after a drop; `read` stops at
    `max_bytes`."""
    kv, group, size = 2, 4, 32
    rng = np.random.default_rng(3)
    layer = _Op(kv * group, kv, size)
    steps = 1400
    ks, vs = (_rows(rng, (1, kv, steps, size)) for _ in range(2))
    q = rng.standard_normal((1, kv * group, 1, size)).astype(np.float32)
    try:
        for t in range(steps):
            layer(q, ks[:, :, t:t + 1], vs[:, :, t:t + 1], t)
        cache = layer.store.read(max_bytes=1 << 40)
        assert cache is not None
        assert np.array_equal(cache["k"], nda.pack(ks)) and np.array_equal(cache["v"], nda.pack(vs))
        assert layer.store.read(max_bytes=cache["k"].nbytes) is None
        layer(q, vs[:, :, :1], ks[:, :, :1], 10)  # rewind: the 11th row replaced, 11 rows kept
        cache = layer.store.read(max_bytes=1 << 40)
        assert cache is not None and cache["k"].shape[2] == 11
        assert np.array_equal(cache["k"][:, :, :10], nda.pack(ks[:, :, :10]))
        assert np.array_equal(cache["k"][:, :, 10:], nda.pack(vs[:, :, :1]))
        with pytest.raises(RuntimeError, match="holds 11 tokens"):
            layer(q, ks[:, :, :1], vs[:, :, :1], 12)
        layer.store.drop()
        cache = layer.store.read(max_bytes=1 << 40)
        assert cache is not None and {a.shape for a in cache.values()} == {(1, kv, 0, size + nda.EXTRA)}
        with pytest.raises(RuntimeError, match="holds 0 tokens"):
            layer(q, ks[:, :, :1], vs[:, :, :1], 1)
    finally:
        layer.store.drop()


def test_store_write_quantises_f32_rows_as_pack() -> None:
    """f32 caches (a prefill graph's state) written to the store read back as `pack` of them, bit
    for bit, at lengths across the native write's tasks of 256 rows; a step after them attends to
    them as after the packed form's write."""
    kv, group, size = 2, 4, 64
    rng = np.random.default_rng(5)
    layer = _Op(kv * group, kv, size)
    q = rng.standard_normal((1, kv * group, 1, size)).astype(np.float32)
    k1, v1 = (_rows(rng, (1, kv, 1, size)) for _ in range(2))
    try:
        for n in (0, 1, 255, 256, 700):
            ks, vs = (_rows(rng, (1, kv, n, size)) for _ in range(2))
            ks[:, :, :1] = 0.5  # a constant row: the zero-range scale
            layer.store.write({"k": ks, "v": vs})
            cache = layer.store.read(max_bytes=1 << 40)
            assert cache is not None
            assert np.array_equal(cache["k"], nda.pack(ks)) and np.array_equal(cache["v"], nda.pack(vs)), n
            after_f32 = layer(q, k1, v1, n)
            layer.store.write({"k": nda.pack(ks), "v": nda.pack(vs)})
            assert np.array_equal(layer(q, k1, v1, n), after_f32), n
    finally:
        layer.store.drop()


def test_store_write_refuses_what_is_not_its_caches() -> None:
    """A missing cache or another shape or dtype is refused before anything is written."""
    layer = _Op(4, 2, 32)
    good = nda.pack(np.ones((1, 2, 5, 32), np.float32))
    try:
        with pytest.raises(ValueError, match="missing"):
            layer.store.write({"k": good})
        with pytest.raises(ValueError, match="expected packed u8"):
            layer.store.write({"k": good, "v": good[:, :, :4]})
        with pytest.raises(ValueError, match="expected packed u8"):
            layer.store.write({"k": good, "v": nda.unpack(good)})
        with pytest.raises(ValueError, match=r"or f32 \[1, 2, L, 32\]"):
            layer.store.write({"k": nda.unpack(good), "v": nda.unpack(good).astype(np.float64)})
        with pytest.raises(ValueError, match="expected packed u8"):
            layer.store.write({"k": nda.unpack(good)[..., :16], "v": nda.unpack(good)[..., :16]})
        assert layer.store.read(max_bytes=1 << 40)["k"].shape == (1, 2, 0, 40)  # nothing written
    finally:
        layer.store.drop()


def test_decode_attention_refuses_more_than_one_token() -> None:
    import openvino as ov
    from openvino import opset15 as op

    shapes = ([1, 2, 2, 32], [1, 1, 2, 32], [1, 1, 2, 32])
    params = [*(op.parameter(s, np.float32) for s in shapes), op.parameter([1, 3], np.int64),
              op.parameter([1], np.int64)]
    node = native.factory().create("DecodeAttention", [*(x.output(0) for x in params),
                                                       op.constant(np.float32(0.1)).output(0)],
                                   {"slot": 0, "key": "k", "value": "v"})
    core = ov.Core()
    native.register(core)
    request = core.compile_model(ov.Model([node.output(0)], params), "CPU").create_infer_request()
    with pytest.raises(RuntimeError):
        request.infer([*(np.zeros(s, np.float32) for s in shapes), np.ones((1, 3), np.int64),
                       np.zeros((1,), np.int64)])


def _engine(model_dir: Path, on: bool, prefix_cache: bool = False, **properties: Any) -> Any:
    """The candidate on the `cpu` profile (decode graph on) with `native_decode_attention` set,
    the plugin in f32 with its u8 KV cache (unless `properties` say otherwise); 64-token prefill
    chunks."""
    import msgspec

    from iq36.profile import PrefillSection, load
    from tests.helpers import REFERENCE
    from worker.engine import create

    profile = load("cpu")
    properties = {**profile.engine.properties, **REFERENCE, **properties}
    profile = msgspec.structs.replace(
        profile, prefill=PrefillSection(chunk_tokens=64),
        engine=msgspec.structs.replace(profile.engine, properties=properties),
        kernels={**profile.kernels, "decode_graph": True, nda.NAME: on},
        prefix_cache=msgspec.structs.replace(profile.prefix_cache, enabled=prefix_cache))
    return create("candidate", model_dir, profile)


def test_engine_decodes_as_with_the_plugins_cache(tiny_dir: Path) -> None:
    """Teacher-forced decode with the op gives the plugin's fused cache's logits: the same
    quantised cache, attention summed in another order (within 2e-6 of the logits' scale), the
    same greedy tokens; every decode step ran on the decode graph, whose identity changed."""
    prompt, forced = list(range(1000, 1150)), list(range(2000, 2016))
    on, off = _engine(tiny_dir, True), _engine(tiny_dir, False)
    assert nda.NAME in on.describe()["kernels"] and nda.NAME not in off.describe()["kernels"]
    assert on.graph_hash != off.graph_hash
    assert on._kv.variables and all(".key." in n or ".value." in n for n in on._kv.variables)
    assert not any(".key." in v.name or ".value." in v.name for v in on._decode_request.query_state())
    try:
        got = np.stack(list(on.forced_logits(prompt, forced)))
        want = np.stack(list(off.forced_logits(prompt, forced)))
        assert on._calls[id(on._decode_request)] == len(forced) - 1
    finally:
        on.close()
        off.close()
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_prefix_snapshots_cross_between_the_cache_forms(tiny_dir: Path) -> None:
    """A turn's snapshot taken from the decode graph (packed u8 cache) restores into the prefill
    graph (f32) for the next turn, and one taken after prefill restores into the decode graph:
    the second turn reuses the first and gives the greedy tokens of a run without the op."""
    from worker.engine import EngineRequest, SamplingParams

    first = tuple(range(1000, 1140))
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = {}
    for on in (True, False):
        engine = _engine(tiny_dir, on, prefix_cache=True)
        try:
            out1 = run_engine(engine, EngineRequest("t1", first, greedy))
            answer = tokens_of(out1, "t1")
            second = first + tuple(answer) + tuple(range(3000, 3003))
            out2 = run_engine(engine, EngineRequest("t2", second, greedy))
            # one token past a cached state: restored straight into the decode graph
            out3 = run_engine(engine, EngineRequest("t3", first + (answer[0],), greedy))
            results[on] = (answer, tokens_of(out2, "t2"), tokens_of(out3, "t3"))
            assert final(out2, "t2").cached_tokens > len(first)
            assert final(out3, "t3").cached_tokens == len(first)
        finally:
            engine.close()
    assert results[True] == results[False]


def test_the_switch_does_nothing_where_the_plugins_cache_is_not_u8(tiny_dir: Path) -> None:
    """With an f32 KV cache (a profile's KV_CACHE_PRECISION) the op would quantise where stock
    does not: the decode graph keeps the plugin's attention and the engine does not report it."""
    engine = _engine(tiny_dir, True, KV_CACHE_PRECISION="f32")
    try:
        assert nda.NAME not in engine.describe()["kernels"] and engine._kv is None
        runtime = engine._decode_compiled.get_runtime_model().get_ops()
        types = {op.get_rt_info()["layerType"].astype(str) for op in runtime}
        assert "ScaledDotProductAttention" in types  # the plugin's fused attention and cache
    finally:
        engine.close()
