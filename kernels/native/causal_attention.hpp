// CausalAttention: a full-attention layer's grouped-query attention over a prefill chunk, causal,
// in blocks of keys with a running softmax (no chunk x context score matrix).
//
// CausalAttention(q, k, v, scale) -> out
//   q      f32 [B, Hq, T, D]   the chunk's queries (rotary applied)
//   k, v   f32 [B, Hkv, L, D]  the past keys and values followed by the chunk's own (L >= T)
//   scale  f32 scalar          softmax scale (the export's 1 / sqrt(D))
//   out    f32 [B, Hq, T, D]
// Query t of head h sees keys 0 .. L - T + t of kv head h / (Hq / Hkv): the export's mask at
// batch 1 with every attention_mask entry 1, which is all iq36 feeds (worker.reference.stateful_feed).
//
// How: one task per (batch, kv head, block of tokens). Its rows are the block's tokens x the
// group's query heads (the heads that read the same keys share every key and value load), scaled
// once. Per block of 64 keys: scores S = Q K^T in register tiles of 6 rows x 16 keys (K packed
// once per call as 16-key panels, d-major), the running max, exp and row sums, then O = O * alpha
// + P V in tiles of 6 rows x 16 columns. Keys past a row's last visible key are never computed
// beyond the block holding it. The CPU plugin's SDPA for a prefill chunk computes every score of
// the chunk x context matrix and masks afterwards (dev-bench-256, 4096 tokens, this AVX2 CPU:
// 14.3 s of a 23 s prefill in its one attention layer; docs/perf-log.md).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common.hpp"

namespace iq36 {

namespace attn {

constexpr size_t kPanel = 16;     // keys per packed K panel (two ymm)
constexpr size_t kBlock = 64;     // keys per softmax block (four panels)
constexpr size_t kRows = 6;       // rows per register tile
constexpr size_t kTaskRows = 64;  // rows (tokens x group heads) per task, about

// exp(x) for x <= 0 (a score minus its row's running max); 0 below -87.3, where exp(x) is
// below f32's normal range. Range reduction by ln 2 in two parts and a degree-6 polynomial
// (the Cephes expf coefficients): within ~2 ulp.
inline __m256 exp_nonpositive(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

// K of one kv head as panels of 16 keys, d-major: panel p holds kp[(p * D + d) * 16 + j] =
// k[16 p + j][d], zero past the last key.
inline void pack_keys(const float* k, size_t L, size_t D, float* kp) {
    const size_t panels = (L + kPanel - 1) / kPanel;
    for (size_t p = 0; p < panels; ++p) {
        float* dst = kp + p * D * kPanel;
        const size_t n = std::min(kPanel, L - p * kPanel);
        for (size_t j = 0; j < n; ++j) {
            const float* row = k + (p * kPanel + j) * D;
            for (size_t d = 0; d < D; ++d)
                dst[d * kPanel + j] = row[d];
        }
        for (size_t j = n; j < kPanel; ++j)
            for (size_t d = 0; d < D; ++d)
                dst[d * kPanel + j] = 0.0f;
    }
}

// s[r][0..16) = sum over d, in order, of q[r][d] * panel[d][0..16), for R rows.
template <size_t R>
inline void scores(const float* q, size_t D, const float* panel, float* s) {
    __m256 a0[R], a1[R];
    for (size_t r = 0; r < R; ++r)
        a0[r] = a1[r] = _mm256_setzero_ps();
    for (size_t d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_load_ps(panel + d * kPanel), k1 = _mm256_load_ps(panel + d * kPanel + 8);
        for (size_t r = 0; r < R; ++r) {
            const __m256 x = _mm256_broadcast_ss(q + r * D + d);
            a0[r] = _mm256_fmadd_ps(x, k0, a0[r]);
            a1[r] = _mm256_fmadd_ps(x, k1, a1[r]);
        }
    }
    for (size_t r = 0; r < R; ++r) {
        _mm256_store_ps(s + r * kBlock, a0[r]);
        _mm256_store_ps(s + r * kBlock + 8, a1[r]);
    }
}

// o[r][c..c+16) = o[r][c..c+16) * alpha[r] + sum over keys n < keys, in order, of
// p[r][n] * v[n][c..c+16), for R rows and every 16 columns c of D.
template <size_t R>
inline void values(const float* p, size_t keys, const float* v, size_t D, const float* alpha, float* o) {
    for (size_t c = 0; c < D; c += 16) {
        __m256 a0[R], a1[R];
        for (size_t r = 0; r < R; ++r) {
            const __m256 al = _mm256_broadcast_ss(alpha + r);
            a0[r] = _mm256_mul_ps(_mm256_load_ps(o + r * D + c), al);
            a1[r] = _mm256_mul_ps(_mm256_load_ps(o + r * D + c + 8), al);
        }
        for (size_t n = 0; n < keys; ++n) {
            const __m256 v0 = _mm256_loadu_ps(v + n * D + c), v1 = _mm256_loadu_ps(v + n * D + c + 8);
            for (size_t r = 0; r < R; ++r) {
                const __m256 x = _mm256_broadcast_ss(p + r * kBlock + n);
                a0[r] = _mm256_fmadd_ps(x, v0, a0[r]);
                a1[r] = _mm256_fmadd_ps(x, v1, a1[r]);
            }
        }
        for (size_t r = 0; r < R; ++r) {
            _mm256_store_ps(o + r * D + c, a0[r]);
            _mm256_store_ps(o + r * D + c + 8, a1[r]);
        }
    }
}

// f(std::integral_constant<size_t, R>) for a row group of R <= kRows rows: the row count as a
// template argument of the register tiles.
template <class F>
inline void with_rows(size_t R, F&& f) {
    switch (R) {
    case 6: f(std::integral_constant<size_t, 6>{}); break;
    case 5: f(std::integral_constant<size_t, 5>{}); break;
    case 4: f(std::integral_constant<size_t, 4>{}); break;
    case 3: f(std::integral_constant<size_t, 3>{}); break;
    case 2: f(std::integral_constant<size_t, 2>{}); break;
    default: f(std::integral_constant<size_t, 1>{}); break;
    }
}

// How many of the block's nb keys from j0 a row whose last visible key is `last` sees.
inline size_t seen(size_t last, size_t j0, size_t nb) { return last < j0 ? 0 : std::min(nb, last + 1 - j0); }

// One task: tokens [t0, t1) of the chunk for the G query heads of one kv head. `qh` is the
// first of those heads' queries ([G][T][D]), `oh` its output, `kp` the kv head's packed keys,
// `v` its values [L][D]; the chunk starts after `past` keys.
inline void task(const float* qh, float* oh, const float* kp, const float* v, size_t G, size_t T, size_t D, size_t past,
                 size_t t0, size_t t1, float scale) {
    const size_t M = (t1 - t0) * G;  // rows: token-major, the group's heads within a token
    Scratch<float> buffer(M * D * 2 + M * kBlock + 3 * M);
    Scratch<size_t> lasts(M);
    float* Q = buffer.data();
    float* O = Q + M * D;
    float* S = O + M * D;
    float* mx = S + M * kBlock;
    float* sum = mx + M;
    float* alpha = sum + M;
    size_t* last = lasts.data();  // each row's last visible key
    for (size_t t = t0; t < t1; ++t)
        for (size_t g = 0; g < G; ++g) {
            const size_t r = (t - t0) * G + g;
            const float* src = qh + (g * T + t) * D;
            for (size_t d = 0; d < D; ++d)
                Q[r * D + d] = src[d] * scale;
            last[r] = past + t;
        }
    std::fill(O, O + M * D, 0.0f);
    std::fill(mx, mx + M, -std::numeric_limits<float>::infinity());
    std::fill(sum, sum + M, 0.0f);
    const size_t end = past + t1;  // keys any row of the task sees
    for (size_t j0 = 0; j0 < end; j0 += kBlock) {
        const size_t nb = std::min(kBlock, end - j0);
        for (size_t r0 = 0; r0 < M; r0 += kRows) {
            const size_t R = std::min(kRows, M - r0);
            const size_t visible = seen(last[r0 + R - 1], j0, nb);  // rows ascend in `last`
            const size_t panels = (visible + kPanel - 1) / kPanel;
            with_rows(R, [&](auto rows) {
                for (size_t p = 0; p < panels; ++p)
                    scores<rows()>(Q + r0 * D, D, kp + (j0 / kPanel + p) * D * kPanel, S + r0 * kBlock + p * kPanel);
            });
        }
        for (size_t r = 0; r < M; ++r) {
            float* s = S + r * kBlock;
            const size_t n = seen(last[r], j0, nb);
            float m = mx[r];
            for (size_t j = 0; j < n; ++j)
                m = std::max(m, s[j]);
            const float a = n ? std::exp(mx[r] - m) : 1.0f;  // exp(-inf) = 0 on the first block
            const __m256 mv = _mm256_set1_ps(m);
            __m256 acc = _mm256_setzero_ps();
            size_t j = 0;
            for (; j + 8 <= n; j += 8) {
                const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(s + j), mv));
                _mm256_store_ps(s + j, e);
                acc = _mm256_add_ps(acc, e);
            }
            float tail = 0.0f;
            for (; j < n; ++j) {
                s[j] = std::exp(s[j] - m);
                tail += s[j];
            }
            for (; j < kBlock; ++j)
                s[j] = 0.0f;
            mx[r] = m;
            sum[r] = sum[r] * a + (hsum(acc) + tail);
            alpha[r] = a;
        }
        for (size_t r0 = 0; r0 < M; r0 += kRows) {
            const size_t R = std::min(kRows, M - r0);
            const size_t visible = seen(last[r0 + R - 1], j0, nb);
            with_rows(R, [&](auto rows) { values<rows()>(S + r0 * kBlock, visible, v + j0 * D, D, alpha + r0, O + r0 * D); });
        }
    }
    for (size_t t = t0; t < t1; ++t)
        for (size_t g = 0; g < G; ++g) {
            const size_t r = (t - t0) * G + g;
            const float inv = 1.0f / sum[r];
            float* dst = oh + (g * T + t) * D;
            for (size_t d = 0; d < D; ++d)
                dst[d] = O[r * D + d] * inv;
        }
}

}  // namespace attn

class CausalAttention final : public ov::op::Op {
public:
    OPENVINO_OP("CausalAttention", "iq36");

    CausalAttention() = default;
    explicit CausalAttention(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 4, "CausalAttention takes q, k, v, scale");
        for (size_t i = 0; i < 4; ++i)
            NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::f32, "inputs must be f32");
        const auto& q = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, q.rank().compatible(4) && get_input_partial_shape(1).rank().compatible(4) &&
                                        get_input_partial_shape(2).rank().compatible(4),
                              "q must be [B, Hq, T, D], k and v [B, Hkv, L, D]");
        if (q.rank().is_static() && q[3].is_static())
            NODE_VALIDATION_CHECK(this, q[3].get_length() % 16 == 0, "the head size must be a multiple of 16");
        set_output_type(0, ov::element::f32, q);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<CausalAttention>(args);
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto qs = inputs[0].get_shape(), ks = inputs[1].get_shape();
        if (qs.size() != 4 || ks.size() != 4 || inputs[2].get_shape() != ks || inputs[3].get_size() != 1)
            return false;
        const size_t B = qs[0], Hq = qs[1], T = qs[2], D = qs[3], Hkv = ks[1], L = ks[2];
        if (ks[0] != B || ks[3] != D || D % 16 || Hkv == 0 || Hq % Hkv || L < T)
            return false;
        outputs[0].set_shape(qs);
        if (B * Hq * T == 0)
            return true;
        const size_t G = Hq / Hkv, past = L - T;
        const float* q = inputs[0].data<const float>();
        const float* k = inputs[1].data<const float>();
        const float* v = inputs[2].data<const float>();
        const float scale = inputs[3].data<const float>()[0];
        float* out = outputs[0].data<float>();

        const size_t panels = (L + attn::kPanel - 1) / attn::kPanel, packed = panels * attn::kPanel * D;
        Scratch<float> keys(B * Hkv * packed);
        float* kp = keys.data();
        tbb::parallel_for(tbb::blocked_range<size_t>(0, B * Hkv), [&](const tbb::blocked_range<size_t>& r) {
            for (size_t bh = r.begin(); bh != r.end(); ++bh)
                attn::pack_keys(k + bh * L * D, L, D, kp + bh * packed);
        });
        // Tasks from the last tokens (the most keys) down, so the short ones fill in at the end.
        const size_t per = std::max<size_t>(1, attn::kTaskRows / G), blocks = (T + per - 1) / per;
        tbb::parallel_for(tbb::blocked_range<size_t>(0, B * Hkv * blocks, 1), [&](const tbb::blocked_range<size_t>& r) {
            for (size_t i = r.begin(); i != r.end(); ++i) {
                const size_t bh = i % (B * Hkv), blk = blocks - 1 - i / (B * Hkv);
                const size_t t0 = blk * per, t1 = std::min(T, t0 + per);
                const size_t b = bh / Hkv, h = bh % Hkv;
                const size_t first = (b * Hq + h * G) * T * D;  // the group's first query head
                attn::task(q + first, out + first, kp + bh * packed, v + bh * L * D, G, T, D, past, t0, t1, scale);
            }
        });
        return true;
    }
};

}  // namespace iq36
