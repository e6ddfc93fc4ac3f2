// DecodeAttention: a full-attention layer's attention for one decode token over a u8 KV cache the
// op keeps itself, outside OpenVINO's state, quantised exactly as the CPU plugin quantises its own.
//
// DecodeAttention(q, k, v, attention_mask, store, scale) -> out
//   attributes: slot (int64, which of the engine's layers), key and value (the ids of the state
//   variables the export kept this layer's cache in: the engine's snapshots keep those names)
//   q               f32 [1, Hq, 1, D]     the token's queries (rotary applied)
//   k, v            f32 [1, Hkv, 1, D]    the token's key and value (rotary applied to k)
//   attention_mask  any [1, P + 1]        only its length is read: P tokens precede this one
//   store           i64 [1]               the engine's KV store (`iq36_kv_*` in iq36_ops.cpp); with
//                                         the `slot` attribute it names this layer's cache (the
//                                         plugin hands i64 inputs over as i32: ids stay below 2^31)
//   scale           f32 scalar            softmax scale (the export's 1 / sqrt(D))
//   out             f32 [1, Hq, 1, D]
// The cache: per kv head, rows of D quantised bytes followed by the row's scale and zero point
// (f32), one row per token. The op writes the token's rows at position P (the store must hold
// at least P rows: a shorter store is an error, never garbage), the store's length becomes P + 1,
// and the token attends to every key, its own included: the export's mask at batch 1 with every
// attention_mask entry 1, which is all iq36 feeds (worker.reference.stateful_feed).
//
// Why: the CPU plugin's fused ScaledDotProductAttentionWithKVCache owns the KV cache (u8 per token
// and head), and its decode attention ran ~0.55 us per token of context and layer (~15 G
// multiply-adds/s; Zen 4 EPYC, dev-bench: 2.1 ms a layer at 4096 tokens; docs/perf-log.md). An op
// of ours cannot take the attention without taking the cache, in the same quantisation: per token
// and kv head, scale = (max - min) / 255 (0.0001 if 0), zp = -min / scale,
// q = clamp(round_half_even(fma(x, 1 / scale, zp)), 0, 255), dequantised (q - zp) * scale. The
// plugin computes a decode token's attention from its cache after appending the token's quantised
// rows, and so does this op. Kept as a model state variable (session 23), the cache had to be
// written whole to the op's outputs at every step (OpenVINO's state semantics: an Assign takes a
// new tensor); held here it grows in place and a step writes two rows per kv head. The engine
// moves, snapshots and resets it through the `iq36_kv_*` functions.
//
// How: one task per (kv head, span of up to kSpan keys): the scores of the group's query heads
// (every key row is converted once and serves all of them), their softmax within the span (its max
// and sum), and the values' sum weighted by it; the spans then merge by their maxima. AVX2 + FMA,
// and both passes on zmm vectors where the CPU has AVX-512F (`dattn::zmm`). The scores pass
// prefetches the keys ahead and the values for the pass after it (`prefetch_rows`): in a decode
// step the cache comes from memory, the weights having passed through the caches since the last
// step. Zen 4 EPYC, dev-bench decode step, both attention layers (PERF_COUNT): 1.82-1.96 -> 1.00-1.08
// ms at 4096 tokens of context, 0.41-0.47 -> 0.29-0.33 at 512; the zmm passes alone, the op on
// its own at 4096: 583 -> 509 us (docs/perf-log.md, session 36).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "causal_attention.hpp"
#include "common.hpp"

namespace iq36 {

namespace dattn {

constexpr size_t kExtra = 2 * sizeof(float);  // a row's scale and zero point after its bytes
constexpr size_t kSpan = 512;                  // keys per task
constexpr size_t kBlock = 64;                  // keys per pass of the weighted value sum
constexpr size_t kHeads = 8;                   // query heads per register pass

// One row of x (n floats, n a multiple of 8) quantised as the CPU plugin's u8 KV cache.
inline void quantize_row(const float* x, size_t n, uint8_t* row) {
    __m256 vmax = _mm256_set1_ps(-FLT_MAX), vmin = _mm256_set1_ps(FLT_MAX);
    for (size_t i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vmax = _mm256_max_ps(vmax, v);
        vmin = _mm256_min_ps(vmin, v);
    }
    alignas(32) float hi[8], lo[8];
    _mm256_store_ps(hi, vmax);
    _mm256_store_ps(lo, vmin);
    float mx = hi[0], mn = lo[0];
    for (int i = 1; i < 8; ++i) {
        mx = std::max(mx, hi[i]);
        mn = std::min(mn, lo[i]);
    }
    float scale = (mx - mn) / 255;
    if (scale == 0)
        scale = 0.0001f;
    const float zp = -mn / scale;
    const __m256 inv = _mm256_set1_ps(1 / scale), z = _mm256_set1_ps(zp);
    const __m256i zero = _mm256_setzero_si256(), top = _mm256_set1_epi32(255);
    for (size_t i = 0; i < n; i += 8) {
        const __m256 v = _mm256_round_ps(_mm256_fmadd_ps(_mm256_loadu_ps(x + i), inv, z),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i w = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(v), zero), top);
        const __m128i p16 = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(row + i), _mm_packus_epi16(p16, p16));
    }
    std::memcpy(row + n, &scale, sizeof(float));
    std::memcpy(row + n + sizeof(float), &zp, sizeof(float));
}

inline void row_params(const uint8_t* row, size_t D, float& scale, float& zp) {
    std::memcpy(&scale, row + D, sizeof(float));
    std::memcpy(&zp, row + D + sizeof(float), sizeof(float));
}

// 8 quantised bytes as floats minus the zero point (exact: small integers minus zp).
inline __m256 centred(const uint8_t* p, __m256 zp) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), zp);
}

// Ahead of the scores: key row j + kAhead into L1, and value row j into L2 for the weighted value
// sum that follows (a span's value rows, ~135 KB at D 256, stay in L2 until then).
constexpr size_t kAhead = 8;
inline void prefetch_rows(const uint8_t* krows, const uint8_t* vrows, size_t W, size_t j, size_t j1) {
    for (size_t b = 0; b < W; b += 64) {
        if (j + kAhead < j1)
            _mm_prefetch(reinterpret_cast<const char*>(krows + (j + kAhead) * W + b), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vrows + j * W + b), _MM_HINT_T1);
    }
}

// Scores of NG query heads (q rows D apart) against keys [j0, j1) of rows W bytes apart:
// s[g * stride + j - j0] = scale * kscale_j * sum_d q_g[d] (k_jd - zp_j).
template <size_t NG>
void scores(const float* q, const uint8_t* rows, const uint8_t* vrows, size_t W, size_t D, size_t j0, size_t j1,
            float scale, float* s, size_t stride) {
    for (size_t j = j0; j < j1; ++j) {
        const uint8_t* row = rows + j * W;
        prefetch_rows(rows, vrows, W, j, j1);
        float ks, kz;
        row_params(row, D, ks, kz);
        const __m256 zp = _mm256_set1_ps(kz);
        __m256 acc[NG];
        for (size_t g = 0; g < NG; ++g)
            acc[g] = _mm256_setzero_ps();
        for (size_t d = 0; d < D; d += 8) {
            const __m256 k = centred(row + d, zp);
            for (size_t g = 0; g < NG; ++g)
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), k, acc[g]);
        }
        const float f = scale * ks;
        for (size_t g = 0; g < NG; ++g)
            s[g * stride + (j - j0)] = hsum(acc[g]) * f;
    }
}

// The weighted value sum's per-key factors for keys [b0, b1) of a span starting at j0:
// c[(j - b0) * NG + g] = w[g * stride + j - j0] * vscale_j and vz[j - b0] = zp_j.
template <size_t NG>
void value_factors(const float* w, size_t stride, const uint8_t* rows, size_t W, size_t D, size_t j0, size_t b0,
                   size_t b1, float* c, float* vz) {
    for (size_t j = b0; j < b1; ++j) {
        float vs;
        row_params(rows + j * W, D, vs, vz[j - b0]);
        for (size_t g = 0; g < NG; ++g)
            c[(j - b0) * NG + g] = w[g * stride + (j - j0)] * vs;
    }
}

// o[g * D + d] += sum_j w[g * stride + j - j0] * vscale_j * (v_jd - zp_j) for keys [j0, j1).
template <size_t NG>
void values(const float* w, size_t stride, const uint8_t* rows, size_t W, size_t D, size_t j0, size_t j1, float* o) {
    alignas(32) float c[kBlock * NG], vz[kBlock];  // c[j * NG + g]: the weight times the row's scale
    for (size_t b0 = j0; b0 < j1; b0 += kBlock) {
        const size_t b1 = std::min(j1, b0 + kBlock);
        value_factors<NG>(w, stride, rows, W, D, j0, b0, b1, c, vz);
        for (size_t d = 0; d < D; d += 8) {
            __m256 acc[NG];
            for (size_t g = 0; g < NG; ++g)
                acc[g] = _mm256_loadu_ps(o + g * D + d);
            const uint8_t* p = rows + b0 * W + d;
            for (size_t j = 0; j < b1 - b0; ++j, p += W) {
                const __m256 v = centred(p, _mm256_broadcast_ss(vz + j));
                for (size_t g = 0; g < NG; ++g)
                    acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(c + j * NG + g), v, acc[g]);
            }
            for (size_t g = 0; g < NG; ++g)
                _mm256_storeu_ps(o + g * D + d, acc[g]);
        }
    }
}

// The same two passes on zmm vectors (AVX-512F; D a multiple of 16): 16 inputs per conversion
// and multiply-add, half the instructions of the ymm form per key and head. The weighted value
// sum is the ymm form's bit for bit (each output lane takes the same multiply-adds in the same
// key order); a score sums its 16 lanes in another order than the ymm form's 8 (f32 rounding).
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace zmm {

inline __m512 centred(const uint8_t* p, __m512 zp) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), zp);
}

template <size_t NG>
void scores(const float* q, const uint8_t* rows, const uint8_t* vrows, size_t W, size_t D, size_t j0, size_t j1,
            float scale, float* s, size_t stride) {
    for (size_t j = j0; j < j1; ++j) {
        const uint8_t* row = rows + j * W;
        prefetch_rows(rows, vrows, W, j, j1);
        float ks, kz;
        row_params(row, D, ks, kz);
        const __m512 zp = _mm512_set1_ps(kz);
        __m512 acc[NG];
        for (size_t g = 0; g < NG; ++g)
            acc[g] = _mm512_setzero_ps();
        for (size_t d = 0; d < D; d += 16) {
            const __m512 k = centred(row + d, zp);
            for (size_t g = 0; g < NG; ++g)
                acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), k, acc[g]);
        }
        const float f = scale * ks;
        for (size_t g = 0; g < NG; ++g)
            s[g * stride + (j - j0)] = _mm512_reduce_add_ps(acc[g]) * f;
    }
}

template <size_t NG>
void values(const float* w, size_t stride, const uint8_t* rows, size_t W, size_t D, size_t j0, size_t j1, float* o) {
    alignas(64) float c[kBlock * NG], vz[kBlock];
    for (size_t b0 = j0; b0 < j1; b0 += kBlock) {
        const size_t b1 = std::min(j1, b0 + kBlock);
        value_factors<NG>(w, stride, rows, W, D, j0, b0, b1, c, vz);
        for (size_t d = 0; d < D; d += 16) {
            __m512 acc[NG];
            for (size_t g = 0; g < NG; ++g)
                acc[g] = _mm512_loadu_ps(o + g * D + d);
            const uint8_t* p = rows + b0 * W + d;
            for (size_t j = 0; j < b1 - b0; ++j, p += W) {
                const __m512 v = centred(p, _mm512_set1_ps(vz[j]));
                for (size_t g = 0; g < NG; ++g)
                    acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(c[j * NG + g]), v, acc[g]);
            }
            for (size_t g = 0; g < NG; ++g)
                _mm512_storeu_ps(o + g * D + d, acc[g]);
        }
    }
}

}  // namespace zmm
#pragma GCC pop_options

// The zmm passes: on a CPU with AVX-512F, for heads of a multiple of 16 inputs;
// `IQ36_NATIVE_AVX512=0` keeps the ymm ones.
inline bool wide(size_t D) {
    static const bool yes = __builtin_cpu_supports("avx512f") && !env_off("IQ36_NATIVE_AVX512");
    return yes && D % 16 == 0;
}

template <class F>
void with_heads(size_t n, F&& f) {
    switch (n) {
    case 1: f(std::integral_constant<size_t, 1>{}); break;
    case 2: f(std::integral_constant<size_t, 2>{}); break;
    case 3: f(std::integral_constant<size_t, 3>{}); break;
    case 4: f(std::integral_constant<size_t, 4>{}); break;
    case 5: f(std::integral_constant<size_t, 5>{}); break;
    case 6: f(std::integral_constant<size_t, 6>{}); break;
    case 7: f(std::integral_constant<size_t, 7>{}); break;
    default: f(std::integral_constant<size_t, 8>{}); break;
    }
}

// One span [j0, j1) of keys for the G query heads of one kv head: per head its span max m[g],
// sum of exp l[g] and unnormalised output o[g * D ..] (exp(s - m) weighted values).
// `on_zmm`: the passes on zmm vectors (`wide`).
inline void span(const float* q, const uint8_t* krows, const uint8_t* vrows, size_t W, size_t D, size_t G,
                 size_t j0, size_t j1, float scale, float* s, float* m, float* l, float* o, bool on_zmm) {
    const size_t n = j1 - j0;
    for (size_t g0 = 0; g0 < G; g0 += kHeads) {
        const size_t ng = std::min(kHeads, G - g0);
        with_heads(ng, [&](auto heads) {
            (on_zmm ? zmm::scores<heads()> : scores<heads()>)(q + g0 * D, krows, vrows, W, D, j0, j1, scale,
                                                              s + g0 * kSpan, kSpan);
        });
    }
    for (size_t g = 0; g < G; ++g) {
        float* sg = s + g * kSpan;
        float mx = -FLT_MAX;
        for (size_t j = 0; j < n; ++j)
            mx = std::max(mx, sg[j]);
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 acc = _mm256_setzero_ps();
        size_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 e = attn::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + j), vm));
            _mm256_storeu_ps(sg + j, e);
            acc = _mm256_add_ps(acc, e);
        }
        float tail = 0.0f;
        for (; j < n; ++j) {
            sg[j] = std::exp(sg[j] - mx);
            tail += sg[j];
        }
        m[g] = mx;
        l[g] = hsum(acc) + tail;
    }
    std::fill(o, o + G * D, 0.0f);
    for (size_t g0 = 0; g0 < G; g0 += kHeads) {
        const size_t ng = std::min(kHeads, G - g0);
        with_heads(ng, [&](auto heads) {
            (on_zmm ? zmm::values<heads()> : values<heads()>)(s + g0 * kSpan, kSpan, vrows, W, D, j0, j1, o + g0 * D);
        });
    }
}

}  // namespace dattn

namespace dattn {

// One layer's KV cache: per kv head `cap` rows of W bytes for K and for V, the first `len` valid.
class Store {
public:
    size_t heads() const { return hkv_; }
    size_t row_bytes() const { return W_; }
    size_t length() const { return len_; }
    uint8_t* keys(size_t h) { return k_.get() + h * cap_ * W_; }
    uint8_t* values(size_t h) { return v_.get() + h * cap_ * W_; }

    // Room for `need` rows of (hkv, W), keeping the first min(len, keep) rows; len = min(len, keep).
    void reserve(size_t hkv, size_t W, size_t need, size_t keep) {
        if (hkv != hkv_ || W != W_) {
            if (std::min(len_, keep))
                throw std::runtime_error("DecodeAttention: a layer's KV store changed its head count or row size");
            release();
            hkv_ = hkv;
            W_ = W;
        }
        len_ = std::min(len_, keep);
        if (need <= cap_)
            return;
        // doubling: the copies of a growing cache add up to less than its final size
        const size_t cap = std::max({need, 2 * cap_, size_t(256)});
        Bytes k = allocate(hkv * cap * W), v = allocate(hkv * cap * W);
        for (size_t h = 0; h < hkv; ++h) {
            std::memcpy(k.get() + h * cap * W, keys(h), len_ * W);
            std::memcpy(v.get() + h * cap * W, values(h), len_ * W);
        }
        k_ = std::move(k);
        v_ = std::move(v);
        cap_ = cap;
    }
    void set_length(size_t len) { len_ = len; }
    void release() {
        k_.reset();
        v_.reset();
        cap_ = len_ = 0;
    }

private:
    struct Free {
        void operator()(uint8_t* p) const { ::operator delete(p, std::align_val_t{64}); }
    };
    using Bytes = std::unique_ptr<uint8_t, Free>;
    static Bytes allocate(size_t n) { return Bytes(static_cast<uint8_t*>(::operator new(n, std::align_val_t{64}))); }

    Bytes k_, v_;
    size_t hkv_ = 0, W_ = 0, cap_ = 0, len_ = 0;
};

// Every store of the process by (engine's store id, layer slot). An engine uses its stores from
// one thread at a time (its infer calls and its iq36_kv_* calls), so only the map is locked.
inline std::mutex& registry_lock() {
    static std::mutex m;
    return m;
}
inline std::map<std::pair<int64_t, int64_t>, std::shared_ptr<Store>>& registry() {
    static std::map<std::pair<int64_t, int64_t>, std::shared_ptr<Store>> stores;
    return stores;
}
inline std::shared_ptr<Store> find_store(int64_t id, int64_t slot, bool create) {
    std::lock_guard<std::mutex> lock(registry_lock());
    auto& stores = registry();
    auto it = stores.find({id, slot});
    if (it != stores.end())
        return it->second;
    if (!create)
        return nullptr;
    auto store = std::make_shared<Store>();
    stores.emplace(std::make_pair(id, slot), store);
    return store;
}

}  // namespace dattn

class DecodeAttention final : public ov::op::Op {
public:
    OPENVINO_OP("DecodeAttention", "iq36");

    DecodeAttention() = default;
    DecodeAttention(const ov::OutputVector& args, int64_t slot, std::string key, std::string value)
        : Op(args), m_slot(slot), m_key(std::move(key)), m_value(std::move(value)) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 6,
                              "DecodeAttention takes q, k, v, attention_mask, store, scale");
        for (size_t i : {0, 1, 2, 5})
            NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::f32, "q, k, v and scale must be f32");
        NODE_VALIDATION_CHECK(this, get_input_element_type(4) == ov::element::i64 || get_input_element_type(4) == ov::element::i32,
                              "store must be i64 (the CPU plugin hands it over as i32)");
        for (size_t i = 0; i < 3; ++i)
            NODE_VALIDATION_CHECK(this, get_input_partial_shape(i).rank().compatible(4), "q, k and v must be rank 4");
        NODE_VALIDATION_CHECK(this, get_input_partial_shape(3).rank().compatible(2), "attention_mask must be rank 2");
        const auto& q = get_input_partial_shape(0);
        if (q.rank().is_static() && q[3].is_static())
            NODE_VALIDATION_CHECK(this, q[3].get_length() % 8 == 0, "the head size must be a multiple of 8");
        set_output_type(0, ov::element::f32, q);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<DecodeAttention>(args, m_slot, m_key, m_value);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("slot", m_slot);
        visitor.on_attribute("key", m_key);
        visitor.on_attribute("value", m_value);
        return true;
    }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto qs = inputs[0].get_shape(), ks = inputs[1].get_shape(), ms = inputs[3].get_shape();
        if (qs.size() != 4 || ks.size() != 4 || inputs[2].get_shape() != ks || ms.size() != 2 || ms[0] != 1 ||
            ms[1] == 0 || inputs[4].get_size() != 1 || inputs[5].get_size() != 1)
            return false;
        const size_t Hq = qs[1], D = qs[3], Hkv = ks[1], P = ms[1] - 1, L = P + 1, W = D + dattn::kExtra;
        if (qs[0] != 1 || qs[2] != 1 || ks[0] != 1 || ks[2] != 1 || ks[3] != D || D % 8 || Hkv == 0 || Hq % Hkv)
            return false;
        const int64_t id = inputs[4].get_element_type() == ov::element::i64 ? inputs[4].data<const int64_t>()[0]
                                                                             : inputs[4].data<const int32_t>()[0];
        const auto store = dattn::find_store(id, m_slot, true);
        if (store->length() < P)
            throw std::runtime_error("DecodeAttention: the KV store holds " + std::to_string(store->length()) +
                                     " tokens, the step follows " + std::to_string(P));
        store->reserve(Hkv, W, L, P);
        const size_t G = Hq / Hkv;
        outputs[0].set_shape(qs);
        const float* q = inputs[0].data<const float>();
        const float* knew = inputs[1].data<const float>();
        const float* vnew = inputs[2].data<const float>();
        const float scale = inputs[5].data<const float>()[0];
        float* out = outputs[0].data<float>();
        for (size_t h = 0; h < Hkv; ++h) {  // the token's rows first: its own key is in the spans
            dattn::quantize_row(knew + h * D, D, store->keys(h) + P * W);
            dattn::quantize_row(vnew + h * D, D, store->values(h) + P * W);
        }
        store->set_length(L);
        const size_t spans = (L + dattn::kSpan - 1) / dattn::kSpan;
        // per (kv head, span): G maxima, G sums, G x D outputs
        const size_t part = G * (2 + D);
        Scratch<float> partial(Hkv * spans * part);
        float* parts = partial.data();
        dattn::Store& cache = *store;
        const bool on_zmm = dattn::wide(D);
        tbb::parallel_for(tbb::blocked_range<size_t>(0, Hkv * spans, 1), [&](const tbb::blocked_range<size_t>& r) {
            Scratch<float> scores(G * dattn::kSpan);
            for (size_t i = r.begin(); i != r.end(); ++i) {
                const size_t h = i / spans, sp = i % spans;
                const size_t j0 = sp * dattn::kSpan, j1 = std::min(L, j0 + dattn::kSpan);
                float* p = parts + i * part;
                dattn::span(q + h * G * D, cache.keys(h), cache.values(h), W, D, G, j0, j1, scale, scores.data(), p,
                            p + G, p + 2 * G, on_zmm);
            }
        });
        for (size_t h = 0; h < Hkv; ++h)
            for (size_t g = 0; g < G; ++g) {
                float mx = -FLT_MAX;
                for (size_t sp = 0; sp < spans; ++sp)
                    mx = std::max(mx, parts[(h * spans + sp) * part + g]);
                float* dst = out + (h * G + g) * D;
                std::fill(dst, dst + D, 0.0f);
                float sum = 0.0f;
                for (size_t sp = 0; sp < spans; ++sp) {
                    const float* p = parts + (h * spans + sp) * part;
                    const float a = std::exp(p[g] - mx);
                    sum += a * p[G + g];
                    const float* o = p + 2 * G + g * D;
                    for (size_t d = 0; d < D; ++d)
                        dst[d] += a * o[d];
                }
                const float inv = 1.0f / sum;
                for (size_t d = 0; d < D; ++d)
                    dst[d] *= inv;
            }
        return true;
    }

private:
    int64_t m_slot = 0;  // which of the engine's layers: with the store input, the store's name
    std::string m_key, m_value;
};

}  // namespace iq36
