// U8Linear(x, w, zp, scale) -> y
//   x      f32 [..., K]     activations (any leading dims; the LM head after last_token_logits
//                           has one row)
//   w      u8  [N, K]       per-row asymmetric int8 weights, as exported for the LM head
//   zp     u8  [N, 1]       zero point of each row
//   scale  f16 [N, 1]       scale of each row (f32 accepted)
//   y      f32 [..., N]     y[n] = scale[n] * sum_k (w[n, k] - zp[n]) * x[k]
//
// Why: the exported head is `MatMul(x, Convert(Multiply(Subtract(Convert(w), zp), scale)))`.
// On an AVX2 machine without VNNI the plugin's compressed-weights GEMV reads it at about a third
// of the memory bandwidth; this loop streams the bytes once, widens them to f32 in registers and
// accumulates in f32, so decode pays for the bytes only (docs/perf-log.md). Same math as the
// export up to the summation order and the rounding of the f16 product `(w - zp) * scale`,
// which the export rounds to f16 and this op keeps in f32.
#pragma once

#include <immintrin.h>

#include "common.hpp"

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/core/type/float16.hpp>
#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace iq36 {

namespace {

inline __m256 widen8(const uint8_t* p, __m256i zero_point) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(q, zero_point));
}

// Four rows of w against one x: out[r] = sum_k (w[r][k] - zp[r]) * x[k]. Two accumulators per
// row (eight independent FMA chains) hide the FMA latency.
void dot4(const uint8_t* w, size_t K, const float* x, const uint8_t* zp, float* out) {
    const uint8_t* r0 = w;
    const uint8_t* r1 = w + K;
    const uint8_t* r2 = w + 2 * K;
    const uint8_t* r3 = w + 3 * K;
    const __m256i z0 = _mm256_set1_epi32(zp[0]), z1 = _mm256_set1_epi32(zp[1]);
    const __m256i z2 = _mm256_set1_epi32(zp[2]), z3 = _mm256_set1_epi32(zp[3]);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    size_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 xa = _mm256_loadu_ps(x + k), xb = _mm256_loadu_ps(x + k + 8);
        a0 = _mm256_fmadd_ps(widen8(r0 + k, z0), xa, a0);
        a1 = _mm256_fmadd_ps(widen8(r1 + k, z1), xa, a1);
        a2 = _mm256_fmadd_ps(widen8(r2 + k, z2), xa, a2);
        a3 = _mm256_fmadd_ps(widen8(r3 + k, z3), xa, a3);
        b0 = _mm256_fmadd_ps(widen8(r0 + k + 8, z0), xb, b0);
        b1 = _mm256_fmadd_ps(widen8(r1 + k + 8, z1), xb, b1);
        b2 = _mm256_fmadd_ps(widen8(r2 + k + 8, z2), xb, b2);
        b3 = _mm256_fmadd_ps(widen8(r3 + k + 8, z3), xb, b3);
    }
    out[0] = hsum(_mm256_add_ps(a0, b0));
    out[1] = hsum(_mm256_add_ps(a1, b1));
    out[2] = hsum(_mm256_add_ps(a2, b2));
    out[3] = hsum(_mm256_add_ps(a3, b3));
    for (; k < K; ++k) {
        out[0] += (static_cast<int>(r0[k]) - zp[0]) * x[k];
        out[1] += (static_cast<int>(r1[k]) - zp[1]) * x[k];
        out[2] += (static_cast<int>(r2[k]) - zp[2]) * x[k];
        out[3] += (static_cast<int>(r3[k]) - zp[3]) * x[k];
    }
}

float dot1(const uint8_t* w, size_t K, const float* x, uint8_t zp) {
    float acc = 0.f;
    for (size_t k = 0; k < K; ++k)
        acc += (static_cast<int>(w[k]) - zp) * x[k];
    return acc;
}

float scale_at(const ov::Tensor& scale, size_t n) {
    if (scale.get_element_type() == ov::element::f16)
        return static_cast<float>(scale.data<const ov::float16>()[n]);
    return scale.data<const float>()[n];
}

}  // namespace

class U8Linear final : public ov::op::Op {
public:
    OPENVINO_OP("U8Linear", "iq36");

    U8Linear() = default;
    explicit U8Linear(const ov::OutputVector& args) : Op(args) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 4, "U8Linear takes x, w, zp, scale");
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
        NODE_VALIDATION_CHECK(this, get_input_element_type(1) == ov::element::u8, "w must be u8");
        NODE_VALIDATION_CHECK(this, get_input_element_type(2) == ov::element::u8, "zp must be u8");
        const auto st = get_input_element_type(3);
        NODE_VALIDATION_CHECK(this, st == ov::element::f16 || st == ov::element::f32, "scale must be f16 or f32");
        const auto& w = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, w.rank().is_static() && w.rank().get_length() == 2, "w must be [N, K]");
        auto out = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, out.rank().is_static() && out.rank().get_length() >= 1, "x must have a rank");
        NODE_VALIDATION_CHECK(this, out[out.size() - 1].compatible(w[1]), "x's last dim must be w's K");
        out[out.size() - 1] = w[0];
        set_output_type(0, ov::element::f32, out);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<U8Linear>(args);
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Tensor& x = inputs[0];
        const ov::Tensor& w = inputs[1];
        const ov::Tensor& zp = inputs[2];
        const ov::Tensor& scale = inputs[3];
        const ov::Shape xs = x.get_shape();
        const size_t K = xs.back();
        const size_t N = w.get_shape()[0];
        if (w.get_shape()[1] != K || zp.get_size() != N || scale.get_size() != N)
            return false;
        const size_t M = K ? ov::shape_size(xs) / K : 0;
        ov::Shape ys = xs;
        ys.back() = N;
        outputs[0].set_shape(ys);
        const float* xp = x.data<const float>();
        const uint8_t* wp = w.data<const uint8_t>();
        const uint8_t* zpp = zp.data<const uint8_t>();
        float* yp = outputs[0].data<float>();
        constexpr size_t kBlock = 64;  // rows per task: 64 x K bytes of weights
        tbb::parallel_for(tbb::blocked_range<size_t>(0, (N + kBlock - 1) / kBlock), [&](const tbb::blocked_range<size_t>& r) {
            for (size_t b = r.begin(); b != r.end(); ++b) {
                const size_t n0 = b * kBlock, n1 = std::min(N, n0 + kBlock);
                for (size_t m = 0; m < M; ++m) {
                    const float* xm = xp + m * K;
                    float* ym = yp + m * N;
                    size_t n = n0;
                    for (; n + 4 <= n1; n += 4)
                        dot4(wp + n * K, K, xm, zpp + n, ym + n);
                    for (; n < n1; ++n)
                        ym[n] = dot1(wp + n * K, K, xm, zpp[n]);
                    for (n = n0; n < n1; ++n)
                        ym[n] *= scale_at(scale, n);
                }
            }
        });
        return true;
    }
};

}  // namespace iq36

