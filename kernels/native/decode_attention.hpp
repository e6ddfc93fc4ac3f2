// DecodeAttention: a full-attention layer's attention for one decode token over a u8 KV cache the
// op keeps in the model state itself, quantised exactly as the CPU plugin quantises its own.
//
// DecodeAttention(q, k, v, past_k, past_v, scale) -> out, k_all, v_all
//   q               f32 [1, Hq, 1, D]          the token's queries (rotary applied)
//   k, v            f32 [1, Hkv, 1, D]         the token's key and value (rotary applied to k)
//   past_k, past_v  u8  [1, Hkv, P, D + 8]     the cache: per token and kv head a row of D
//                                              quantised bytes, then its scale and zero point (f32)
//   scale           f32 scalar                 softmax scale (the export's 1 / sqrt(D))
//   out             f32 [1, Hq, 1, D]
//   k_all, v_all    u8  [1, Hkv, P + 1, D + 8] the cache with the token's rows appended (to Assign)
// The token sees every key, its own included: the export's mask at batch 1 with every
// attention_mask entry 1, which is all iq36 feeds (worker.reference.stateful_feed).
//
// Why: the CPU plugin's fused ScaledDotProductAttentionWithKVCache owns the KV cache (u8 per token
// and head), and its decode attention ran ~0.55 us per token of context and layer (~15 G
// multiply-adds/s; Zen 4 EPYC, dev-bench: 2.1 ms a layer at 4096 tokens; docs/perf-log.md). An op
// of ours cannot take the attention without taking the cache, so the cache becomes a plain state
// variable in the same quantisation: per token and kv head, scale = (max - min) / 255 (0.0001 if
// 0), zp = -min / scale, q = clamp(round_half_even(fma(x, 1 / scale, zp)), 0, 255), dequantised
// (q - zp) * scale. The plugin computes a decode token's attention from its cache after
// appending the token's quantised rows, and so does this op. The price of a plain state: the
// op writes the whole cache to its outputs at each step (a copy of P rows it reads anyway).
//
// How: one task per (kv head, span of up to kSpan keys). It copies its span of the past rows to
// the outputs, then from that hot copy computes the scores of the group's query heads (every
// key row is converted once and serves all of them), their softmax within the span (its max and
// sum), and the values' sum weighted by it; the spans then merge by their maxima. AVX2 + FMA.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

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

// Scores of NG query heads (q rows D apart) against keys [j0, j1) of rows W bytes apart:
// s[g * stride + j - j0] = scale * kscale_j * sum_d q_g[d] (k_jd - zp_j).
template <size_t NG>
void scores(const float* q, const uint8_t* rows, size_t W, size_t D, size_t j0, size_t j1, float scale, float* s,
            size_t stride) {
    for (size_t j = j0; j < j1; ++j) {
        const uint8_t* row = rows + j * W;
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

// o[g * D + d] += sum_j w[g * stride + j - j0] * vscale_j * (v_jd - zp_j) for keys [j0, j1).
template <size_t NG>
void values(const float* w, size_t stride, const uint8_t* rows, size_t W, size_t D, size_t j0, size_t j1, float* o) {
    alignas(32) float c[kBlock * NG], vz[kBlock];  // c[j * NG + g]: the weight times the row's scale
    for (size_t b0 = j0; b0 < j1; b0 += kBlock) {
        const size_t b1 = std::min(j1, b0 + kBlock);
        for (size_t j = b0; j < b1; ++j) {
            float vs;
            row_params(rows + j * W, D, vs, vz[j - b0]);
            for (size_t g = 0; g < NG; ++g)
                c[(j - b0) * NG + g] = w[g * stride + (j - j0)] * vs;
        }
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
inline void span(const float* q, const uint8_t* krows, const uint8_t* vrows, size_t W, size_t D, size_t G,
                 size_t j0, size_t j1, float scale, float* s, float* m, float* l, float* o) {
    const size_t n = j1 - j0;
    for (size_t g0 = 0; g0 < G; g0 += kHeads) {
        const size_t ng = std::min(kHeads, G - g0);
        with_heads(ng, [&](auto heads) { scores<heads()>(q + g0 * D, krows, W, D, j0, j1, scale, s + g0 * kSpan, kSpan); });
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
        with_heads(ng, [&](auto heads) { values<heads()>(s + g0 * kSpan, kSpan, vrows, W, D, j0, j1, o + g0 * D); });
    }
}

}  // namespace dattn

class DecodeAttention final : public ov::op::Op {
public:
    OPENVINO_OP("DecodeAttention", "iq36");

    DecodeAttention() = default;
    explicit DecodeAttention(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 6, "DecodeAttention takes q, k, v, past_k, past_v, scale");
        for (size_t i : {0, 1, 2, 5})
            NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::f32, "q, k, v and scale must be f32");
        for (size_t i : {3, 4})
            NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::u8, "the cache inputs must be u8");
        for (size_t i = 0; i < 5; ++i)
            NODE_VALIDATION_CHECK(this, get_input_partial_shape(i).rank().compatible(4), "inputs 0-4 must be rank 4");
        const auto& q = get_input_partial_shape(0);
        if (q.rank().is_static() && q[3].is_static())
            NODE_VALIDATION_CHECK(this, q[3].get_length() % 8 == 0, "the head size must be a multiple of 8");
        set_output_type(0, ov::element::f32, q);
        for (size_t i : {3, 4}) {
            ov::PartialShape cache = get_input_partial_shape(i);
            if (cache.rank().is_static() && cache[2].is_static())
                cache[2] = cache[2].get_length() + 1;
            else if (cache.rank().is_static())
                cache[2] = ov::Dimension::dynamic();
            set_output_type(i - 2, ov::element::u8, cache);
        }
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<DecodeAttention>(args);
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto qs = inputs[0].get_shape(), ks = inputs[1].get_shape(), ps = inputs[3].get_shape();
        if (qs.size() != 4 || ks.size() != 4 || ps.size() != 4 || inputs[2].get_shape() != ks ||
            inputs[4].get_shape() != ps || inputs[5].get_size() != 1)
            return false;
        const size_t Hq = qs[1], D = qs[3], Hkv = ks[1], P = ps[2], W = D + dattn::kExtra;
        if (qs[0] != 1 || qs[2] != 1 || ks[0] != 1 || ks[2] != 1 || ks[3] != D || ps[0] != 1 || ps[1] != Hkv ||
            ps[3] != W || D % 8 || Hkv == 0 || Hq % Hkv)
            return false;
        const size_t G = Hq / Hkv, L = P + 1;
        outputs[0].set_shape(qs);
        outputs[1].set_shape({1, Hkv, L, W});
        outputs[2].set_shape({1, Hkv, L, W});
        const float* q = inputs[0].data<const float>();
        const float* knew = inputs[1].data<const float>();
        const float* vnew = inputs[2].data<const float>();
        const uint8_t* kpast = inputs[3].data<const uint8_t>();
        const uint8_t* vpast = inputs[4].data<const uint8_t>();
        const float scale = inputs[5].data<const float>()[0];
        float* out = outputs[0].data<float>();
        uint8_t* kall = outputs[1].data<uint8_t>();
        uint8_t* vall = outputs[2].data<uint8_t>();
        for (size_t h = 0; h < Hkv; ++h) {  // the token's rows first: its own key is in the spans
            dattn::quantize_row(knew + h * D, D, kall + (h * L + P) * W);
            dattn::quantize_row(vnew + h * D, D, vall + (h * L + P) * W);
        }
        const size_t spans = (L + dattn::kSpan - 1) / dattn::kSpan;
        // per (kv head, span): G maxima, G sums, G x D outputs
        const size_t part = G * (2 + D);
        Scratch<float> partial(Hkv * spans * part);
        float* parts = partial.data();
        tbb::parallel_for(tbb::blocked_range<size_t>(0, Hkv * spans, 1), [&](const tbb::blocked_range<size_t>& r) {
            Scratch<float> scores(G * dattn::kSpan);
            for (size_t i = r.begin(); i != r.end(); ++i) {
                const size_t h = i / spans, sp = i % spans;
                const size_t j0 = sp * dattn::kSpan, j1 = std::min(L, j0 + dattn::kSpan), c1 = std::min(P, j1);
                uint8_t* krows = kall + h * L * W;
                uint8_t* vrows = vall + h * L * W;
                if (c1 > j0) {
                    std::memcpy(krows + j0 * W, kpast + (h * P + j0) * W, (c1 - j0) * W);
                    std::memcpy(vrows + j0 * W, vpast + (h * P + j0) * W, (c1 - j0) * W);
                }
                float* p = parts + i * part;
                dattn::span(q + h * G * D, krows, vrows, W, D, G, j0, j1, scale, scores.data(), p, p + G,
                            p + 2 * G);
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
};

}  // namespace iq36
