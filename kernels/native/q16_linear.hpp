// Q16Linear(x, w, zp, scale) -> y: a compressed-weights matmul for a few rows (decode) whose inner
// loop is integer multiply-adds on the packed weights instead of widening every weight to f32.
//
//   x      f32 [..., K]               activations (rows = product of the leading dims)
//   w      u8  [N, K]                 per-row asymmetric int8 weights (the LM head), or
//          u4/u8 [N, G, g]            grouped weights, G * g = K (u4: two per byte, low nibble first;
//                                     with the `nibbles` attribute the u4 bytes typed u8 [N, G, g / 2])
//   zp     u8 [N, 1] / u4,u8 [N, G, 1]  zero points, one per row or per group
//   scale  f16/f32, same shape as zp
//   y      f32 [..., N]               y[n] = sum_g scale[n, g] * sum_{k in g} (w[n, k] - zp[n, g]) * x[k]
//
// How: each row of x is cut into blocks of 128 inputs, and each block is written as two int16
// terms against its own scale sx = max |x| / 32767: x = sx * (q + lo / 65536), |q|, |lo| <= 32767
// (lo is the rounding residual of q, itself rounded: the representation error is at most 2^-17
// of the block's largest magnitude, below f32's own rounding of a sum of products). Then over a
// block, sum (w - zp) x = sx * (sum w q + (sum w lo) / 65536 - zp * sum (q + lo / 65536)): the
// two sums are exact in int32 (at most 128 * 255 * 32767 < 2^31 each), the zero point enters once
// per group, and the blocks are combined in f32 with the weights' scales. The results are as
// close to float64 as the plugin's f32 kernels (tests/test_q16_decode.py), with only summation
// order differing. Per 32 u4 weights the loop is one widening load, two byte ops, four pmaddwd and
// four adds; the plugin widens each weight to f32 (convert, subtract, FMA), which is what bounds
// its kernels at batch 1 on an AVX2 CPU without VNNI (docs/perf-log.md).
//
// Threads: rows of w in tasks (TBB); each task reads its weight rows once for every row of x.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <openvino/core/type/float16.hpp>
#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common.hpp"

namespace iq36 {

namespace q16 {

constexpr size_t kBlock = 128;  // inputs per activation block (one int16 scale each)

// One row of x as two int16 terms (q, lo) in the weights' byte order (u4: per 32 inputs, the 16
// even inputs then the 16 odd ones, to match the low/high nibbles of 16 packed bytes), a scale
// per block, and per weight group sum_{blocks of g} sx * sum (q + lo / 65536) (for the zero points).
struct Row {
    std::vector<int16_t> q, lo;  // x / sx = q + lo / 65536
    std::vector<float> sx;
    std::vector<float> zq;
};

inline void quantize(const float* x, size_t K, size_t group, bool nibbles, Row& r) {
    r.q.resize(K);
    r.lo.resize(K);
    r.sx.resize(K / kBlock);
    r.zq.assign(K / group, 0.f);
    for (size_t b = 0; b < K / kBlock; ++b) {
        const float* xb = x + b * kBlock;
        float m = 0.f;
        for (size_t i = 0; i < kBlock; ++i)
            m = std::max(m, std::fabs(xb[i]));
        const float sx = m / 32767.f;
        const float inv = m > 0.f ? 32767.f / m : 0.f;
        int16_t* qb = r.q.data() + b * kBlock;
        int16_t* lb = r.lo.data() + b * kBlock;
        double total = 0.0;
        for (size_t i = 0; i < kBlock; ++i) {
            const float f = xb[i] * inv;
            const int32_t v = std::clamp(static_cast<int32_t>(std::lrintf(f)), -32767, 32767);
            const int32_t l = std::clamp(static_cast<int32_t>(std::lrintf((f - static_cast<float>(v)) * 65536.f)), -32767, 32767);
            total += v + l / 65536.0;
            // u4: within each 32 inputs, input 2j goes to j and input 2j + 1 to 16 + j
            const size_t at = nibbles ? (i & ~size_t(31)) + ((i & 1) ? 16 : 0) + ((i & 31) >> 1) : i;
            qb[at] = static_cast<int16_t>(v);
            lb[at] = static_cast<int16_t>(l);
        }
        r.sx[b] = sx;
        r.zq[b * kBlock / group] += static_cast<float>(sx * total);
    }
}

// Over one block of 128 inputs: sum w * q and sum w * lo, in int32 lanes (each at most
// 128 * 255 * 32767 < 2^31).
__attribute__((always_inline)) inline void block_u8(const uint8_t* w, const int16_t* q, const int16_t* lo, __m256i& hi_sum, __m256i& lo_sum) {
    __m256i a = _mm256_setzero_si256(), b = a;
    for (size_t i = 0; i < kBlock; i += 16) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i))));
        b = _mm256_add_epi32(b, _mm256_madd_epi16(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i))));
    }
    hi_sum = a;
    lo_sum = b;
}

__attribute__((always_inline)) inline void block_u4(const uint8_t* w, const int16_t* q, const int16_t* lo, __m256i& hi_sum, __m256i& lo_sum) {
    const __m256i low = _mm256_set1_epi16(0x000F);
    __m256i a = _mm256_setzero_si256(), b = a;
    for (size_t i = 0; i < kBlock; i += 32) {  // 16 packed bytes: even inputs low, odd inputs high
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i / 2)));
        const __m256i even = _mm256_and_si256(v, low), odd = _mm256_srli_epi16(v, 4);
        a = _mm256_add_epi32(a, _mm256_madd_epi16(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i))));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i + 16))));
        b = _mm256_add_epi32(b, _mm256_madd_epi16(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i))));
        b = _mm256_add_epi32(b, _mm256_madd_epi16(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i + 16))));
    }
    hi_sum = a;
    lo_sum = b;
}

struct Weights {
    const uint8_t* w;
    const uint8_t* z;
    const void* s;
    bool w4, z4, s16;
    size_t N, K, group;  // group = K for per-row weights

    float scale(size_t i) const {
        return s16 ? _cvtsh_ss(static_cast<const uint16_t*>(s)[i]) : static_cast<const float*>(s)[i];  // F16C
    }
    int zero(size_t i) const { return z4 ? ((i & 1) ? z[i >> 1] >> 4 : z[i >> 1] & 0x0F) : z[i]; }
};

// y[n] for one weight row against one rounded row of x.
template <bool W4>
float dot(const Weights& W, size_t n, const Row& r) {
    const size_t groups = W.K / W.group, per = W.group / kBlock;
    const uint8_t* row = W.w + (W4 ? n * W.K / 2 : n * W.K);
    const int16_t* q = r.q.data();
    const int16_t* lo = r.lo.data();
    const float* sx = r.sx.data();
    const float* zq = r.zq.data();
    const __m256 unit = _mm256_set1_ps(1.f / 65536.f);
    __m256 acc = _mm256_setzero_ps();
    float zero_terms = 0.f;
    for (size_t g = 0; g < groups; ++g) {
        const float s = W.scale(n * groups + g);
        for (size_t b = g * per; b < (g + 1) * per; ++b) {
            __m256i hi_sum, lo_sum;
            if (W4)
                block_u4(row + b * kBlock / 2, q + b * kBlock, lo + b * kBlock, hi_sum, lo_sum);
            else
                block_u8(row + b * kBlock, q + b * kBlock, lo + b * kBlock, hi_sum, lo_sum);
            const __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo_sum), unit, _mm256_cvtepi32_ps(hi_sum));
            acc = _mm256_fmadd_ps(part, _mm256_set1_ps(s * sx[b]), acc);
        }
        zero_terms += s * static_cast<float>(W.zero(n * groups + g)) * zq[g];
    }
    return hsum(acc) - zero_terms;
}

inline float dot(const Weights& W, size_t n, const Row& r) {
    return W.w4 ? dot<true>(W, n, r) : dot<false>(W, n, r);
}

}  // namespace q16

class Q16Linear final : public ov::op::Op {
public:
    OPENVINO_OP("Q16Linear", "iq36");

    Q16Linear() = default;
    explicit Q16Linear(const ov::OutputVector& args, bool nibbles = false) : Op(args), m_nibbles(nibbles) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 4, "Q16Linear takes x, w, zp, scale");
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
        const auto wt = get_input_element_type(1), zt = get_input_element_type(2), st = get_input_element_type(3);
        NODE_VALIDATION_CHECK(this, wt == ov::element::u8 || wt == ov::element::u4, "w must be u8 or u4");
        NODE_VALIDATION_CHECK(this, zt == ov::element::u8 || zt == ov::element::u4, "zp must be u8 or u4");
        NODE_VALIDATION_CHECK(this, st == ov::element::f16 || st == ov::element::f32, "scale must be f16 or f32");
        const auto& w = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, w.is_static() && (w.size() == 2 || w.size() == 3), "w must be [N, K] or [N, G, g]");
        const ov::Shape ws = w.to_shape();
        NODE_VALIDATION_CHECK(this, !m_nibbles || (wt == ov::element::u8 && ws.size() == 3),
                              "with nibbles, the weights are u8 bytes [N, G, g / 2] holding two u4 values each");
        const auto [K, group] = k_and_group(ws);
        NODE_VALIDATION_CHECK(this, group % q16::kBlock == 0, "the weights' group must be a multiple of 128 inputs");
        NODE_VALIDATION_CHECK(this, wt == ov::element::u8 || ws.size() == 3, "u4 weights must be grouped [N, G, g]");
        const auto& z = get_input_partial_shape(2);
        NODE_VALIDATION_CHECK(this, z.is_static() && ov::shape_size(z.to_shape()) == ws[0] * (K / group),
                              "one zero point per row and group");
        NODE_VALIDATION_CHECK(this, get_input_partial_shape(3).is_static() &&
                                        ov::shape_size(get_input_partial_shape(3).to_shape()) == ws[0] * (K / group),
                              "one scale per row and group");
        auto out = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, out.rank().is_static() && out.rank().get_length() >= 1, "x must have a rank");
        NODE_VALIDATION_CHECK(this, out[out.size() - 1].compatible(static_cast<int64_t>(K)), "x's last dim must be w's K");
        out[out.size() - 1] = static_cast<int64_t>(ws[0]);
        set_output_type(0, ov::element::f32, out);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<Q16Linear>(args, m_nibbles);
    }

    // nibbles: w is u8 [N, G, g / 2], the packed bytes of u4 weights (the CPU plugin widens a u4
    // constant that none of its own kernels reads to u8; typed u8 the bytes arrive as they are).
    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("nibbles", m_nibbles);
        return true;
    }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Tensor& x = inputs[0];
        const ov::Tensor& w = inputs[1];
        const ov::Shape xs = x.get_shape(), ws = w.get_shape();
        const auto [K, group] = k_and_group(ws);
        const size_t N = ws[0];
        q16::Weights W{static_cast<const uint8_t*>(w.data()),
                       static_cast<const uint8_t*>(inputs[2].data()),
                       inputs[3].data(),
                       m_nibbles || w.get_element_type() == ov::element::u4,
                       inputs[2].get_element_type() == ov::element::u4,
                       inputs[3].get_element_type() == ov::element::f16,
                       N,
                       K,
                       group};
        if (xs.back() != K)
            return false;
        const size_t M = ov::shape_size(xs) / K;
        ov::Shape ys = xs;
        ys.back() = N;
        outputs[0].set_shape(ys);
        if (M == 0)
            return true;
        std::vector<q16::Row> rows(M);
        for (size_t m = 0; m < M; ++m)
            q16::quantize(x.data<const float>() + m * K, K, W.group, W.w4, rows[m]);
        float* y = outputs[0].data<float>();
        const size_t grain = std::max<size_t>(8, N / 64);
        tbb::parallel_for(tbb::blocked_range<size_t>(0, N, grain), [&](const tbb::blocked_range<size_t>& r) {
            for (size_t n = r.begin(); n != r.end(); ++n)
                for (size_t m = 0; m < M; ++m)
                    y[m * N + n] = q16::dot(W, n, rows[m]);
        });
        return true;
    }

private:
    // Inputs per row and per group of w [N, K] (one group) or [N, G, g] (g / 2 bytes with nibbles).
    std::pair<size_t, size_t> k_and_group(const ov::Shape& ws) const {
        if (ws.size() == 2)
            return {ws[1], ws[1]};
        const size_t group = ws[2] * (m_nibbles ? 2 : 1);
        return {ws[1] * group, group};
    }

    bool m_nibbles = false;
};

}  // namespace iq36
