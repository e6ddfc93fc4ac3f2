// Q16Linear(x, w, zp, scale) -> y: a compressed-weights matmul for a few rows (decode), with the
// activations rounded to 16-bit integers and the weights kept as integers, so the inner loop is
// integer multiply-adds instead of widening every weight to f32.
//
//   x      f32 [..., K]               activations (rows = product of the leading dims)
//   w      u8  [N, K]                 per-row asymmetric int8 weights (the LM head), or
//          u4/u8 [N, G, g]            grouped weights, G * g = K (u4: two per byte, low nibble first)
//   zp     u8 [N, 1] / u4,u8 [N, G, 1]  zero points, one per row or per group
//   scale  f16/f32, same shape as zp
//   y      f32 [..., N]               y[n] = sum_g scale[n, g] * sum_{k in g} (w[n, k] - zp[n, g]) * x[k]
//
// How: each row of x is cut into blocks of 128 inputs; each block is scaled to its own maximum
// (sx = max |x| / 32767) and rounded to int16 (q). Then (w - zp) . x over a block is
// sx * (sum w q - zp * sum q), exactly in int32 (a block sums at most 128 * 255 * 32767 < 2^31),
// and the blocks are combined in f32 with the weights' scales. The only rounding that the
// plugin's f32 path does not have is x's: at most 0.5 / 32767 of its block's largest magnitude
// per input, ~1e-5 of the block's scale (the GPU plugin's own default dynamic quantization of
// activations is 8-bit per 32-64 inputs, ~250x coarser). Per 16 (u8) or 32 (u4) weights the
// loop is one widening load, one or three byte ops, one or two pmaddwd and adds: about half the
// instructions of widening to f32, which is what bounds the plugin's kernels on an AVX2 CPU
// without VNNI (docs/perf-log.md).
//
// Threads: rows of w in tasks (TBB); each task reads its weight rows once for every row of x.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <openvino/core/type/float16.hpp>
#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common.hpp"

namespace iq36 {

namespace q16 {

constexpr size_t kBlock = 128;  // inputs per activation block (one int16 scale each)

// One row of x, rounded: q in the weights' byte order (u4: per 32 inputs, the 16 even inputs
// then the 16 odd ones, to match the low/high nibbles of 16 packed bytes), a scale per block,
// and per weight group sum_{blocks of g} sx * sum q (for the zero points).
struct Row {
    std::vector<int16_t> q;
    std::vector<float> sx;
    std::vector<float> zq;
};

inline void quantize(const float* x, size_t K, size_t group, bool nibbles, Row& r) {
    r.q.resize(K);
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
        int32_t total = 0;
        for (size_t i = 0; i < kBlock; ++i) {
            const int32_t v = std::clamp(static_cast<int32_t>(std::lrintf(xb[i] * inv)), -32767, 32767);
            total += v;
            // u4: within each 32 inputs, input 2j goes to j and input 2j + 1 to 16 + j
            const size_t at = nibbles ? (i & ~size_t(31)) + ((i & 1) ? 16 : 0) + ((i & 31) >> 1) : i;
            qb[at] = static_cast<int16_t>(v);
        }
        r.sx[b] = sx;
        r.zq[b * kBlock / group] += sx * static_cast<float>(total);
    }
}

// sum over one block of 128 inputs of w * q, in int32 lanes.
inline __m256i block_u8(const uint8_t* w, const int16_t* q) {
    __m256i a = _mm256_setzero_si256(), b = a;
    for (size_t i = 0; i < kBlock; i += 32) {
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
        const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 16)));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i))));
        b = _mm256_add_epi32(b, _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i + 16))));
    }
    return _mm256_add_epi32(a, b);
}

inline __m256i block_u4(const uint8_t* w, const int16_t* q) {  // w: 64 packed bytes
    const __m256i low = _mm256_set1_epi16(0x000F);
    __m256i a = _mm256_setzero_si256(), b = a;
    for (size_t i = 0; i < kBlock; i += 32) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i / 2)));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_and_si256(v, low), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i))));
        b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_srli_epi16(v, 4), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i + 16))));
    }
    return _mm256_add_epi32(a, b);
}

struct Weights {
    const uint8_t* w;
    const uint8_t* z;
    const void* s;
    bool w4, z4, s16;
    size_t N, K, group;  // group = K for per-row weights

    float scale(size_t i) const {
        return s16 ? static_cast<float>(static_cast<const ov::float16*>(s)[i]) : static_cast<const float*>(s)[i];
    }
    int zero(size_t i) const { return z4 ? ((i & 1) ? z[i >> 1] >> 4 : z[i >> 1] & 0x0F) : z[i]; }
};

// y[n] for one weight row against one rounded row of x.
template <bool W4>
float dot(const Weights& W, size_t n, const Row& r) {
    const size_t groups = W.K / W.group, per = W.group / kBlock;
    const uint8_t* row = W.w + (W4 ? n * W.K / 2 : n * W.K);
    __m256 acc = _mm256_setzero_ps();
    float zero_terms = 0.f;
    for (size_t g = 0; g < groups; ++g) {
        const float s = W.scale(n * groups + g);
        for (size_t b = g * per; b < (g + 1) * per; ++b) {
            const __m256i sum = W4 ? block_u4(row + b * kBlock / 2, r.q.data() + b * kBlock)
                                   : block_u8(row + b * kBlock, r.q.data() + b * kBlock);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(s * r.sx[b]), acc);
        }
        zero_terms += s * static_cast<float>(W.zero(n * groups + g)) * r.zq[g];
    }
    return hsum(acc) - zero_terms;
}

}  // namespace q16

class Q16Linear final : public ov::op::Op {
public:
    OPENVINO_OP("Q16Linear", "iq36");

    Q16Linear() = default;
    explicit Q16Linear(const ov::OutputVector& args) : Op(args) {
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
        const size_t K = ws.size() == 2 ? ws[1] : ws[1] * ws[2];
        const size_t group = ws.size() == 2 ? ws[1] : ws[2];
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
        return std::make_shared<Q16Linear>(args);
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Tensor& x = inputs[0];
        const ov::Tensor& w = inputs[1];
        const ov::Shape xs = x.get_shape(), ws = w.get_shape();
        q16::Weights W{static_cast<const uint8_t*>(w.data()),
                       static_cast<const uint8_t*>(inputs[2].data()),
                       inputs[3].data(),
                       w.get_element_type() == ov::element::u4,
                       inputs[2].get_element_type() == ov::element::u4,
                       inputs[3].get_element_type() == ov::element::f16,
                       ws[0],
                       ws.size() == 2 ? ws[1] : ws[1] * ws[2],
                       ws.size() == 2 ? ws[1] : ws[2]};
        const size_t K = W.K, N = W.N;
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
                    y[m * N + n] = W.w4 ? q16::dot<true>(W, n, rows[m]) : q16::dot<false>(W, n, rows[m]);
        });
        return true;
    }
};

}  // namespace iq36
