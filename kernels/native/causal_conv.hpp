// CausalConv1d: a linear-attention layer's short causal depthwise convolution over a chunk of
// tokens, in the token-major layout its projections produce, replacing the export's
// Transpose -> Concat(state) -> GroupConvolution -> Slice -> (Swish) -> Transpose and the Slice
// that keeps the new state.
//
// CausalConv1d(x, state, w) -> (y, state_out)
//   x         f32 [B, T, C]   the chunk (the in_proj_qkv output)
//   state     f32 [B, C, S]   the last S inputs before the chunk (S >= K - 1)
//   w         f32 [C, ..., K] one K-tap filter per channel (GroupConvolution's [C, 1, 1, K])
//   y         f32 [B, T, C]   y[t][c] = sum_j w[c][j] * z[S - K + 1 + t + j][c]
//   state_out f32 [B, C, S]   the last S columns of z
// where z = concat(state, x^T) along time (S + T entries). The activation stays with the plugin.
// Sums run j = 0 .. K-1 in order, vectorised over channels.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace iq36 {

class CausalConv1d final : public ov::op::Op {
public:
    OPENVINO_OP("CausalConv1d", "iq36");

    CausalConv1d() = default;
    explicit CausalConv1d(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 3, "CausalConv1d takes x, state and w");
        for (size_t i = 0; i < 3; ++i)
            NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::f32, "CausalConv1d's inputs must be f32");
        const auto& x = get_input_partial_shape(0);
        const auto& s = get_input_partial_shape(1);
        const auto& w = get_input_partial_shape(2);
        NODE_VALIDATION_CHECK(this, x.rank().compatible(3) && s.rank().compatible(3), "x must be [B, T, C] and state [B, C, S]");
        NODE_VALIDATION_CHECK(this, w.is_static() && w.rank().get_length() >= 2, "w must be a static [C, ..., K]");
        if (x.rank().is_static() && s.rank().is_static()) {
            NODE_VALIDATION_CHECK(this, x[2].compatible(s[1]), "x's channels must be the state's");
            NODE_VALIDATION_CHECK(this, x[2].compatible(w[0]), "x's channels must be w's filters");
            const int64_t K = static_cast<int64_t>(w.to_shape().back());
            NODE_VALIDATION_CHECK(this, s[2].is_dynamic() || s[2].get_length() >= K - 1, "the state must hold K - 1 inputs or more");
        }
        set_output_type(0, ov::element::f32, x);
        set_output_type(1, ov::element::f32, s);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<CausalConv1d>(args);
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto xs = inputs[0].get_shape(), ss = inputs[1].get_shape(), ws = inputs[2].get_shape();
        const size_t B = xs[0], T = xs[1], C = xs[2], S = ss[2], K = ws.back();
        if (ss[0] != B || ss[1] != C || inputs[2].get_size() != C * K || S + 1 < K)
            return false;
        outputs[0].set_shape(xs);
        outputs[1].set_shape(ss);
        const float* x = inputs[0].data<const float>();
        const float* state = inputs[1].data<const float>();
        const float* w = inputs[2].data<const float>();
        float* y = outputs[0].data<float>();
        float* out_state = outputs[1].data<float>();
        if (T == 1) {
            decode(x, state, w, y, out_state, B, C, S, K);
            return true;
        }

        std::vector<float> wT(K * C), pre(S * C);  // taps [K][C]; the state token-major [S][C]
        for (size_t c = 0; c < C; ++c)
            for (size_t j = 0; j < K; ++j)
                wT[j * C + c] = w[c * K + j];
        for (size_t b = 0; b < B; ++b) {
            const float* xb = x + b * T * C;
            const float* sb = state + b * C * S;
            for (size_t c = 0; c < C; ++c)
                for (size_t i = 0; i < S; ++i)
                    pre[i * C + c] = sb[c * S + i];
            const auto row = [&](size_t i) { return i < S ? pre.data() + i * C : xb + (i - S) * C; };  // z[i]
            float* yb = y + b * T * C;
            tbb::parallel_for(tbb::blocked_range<size_t>(0, T, 16), [&](const tbb::blocked_range<size_t>& r) {
                for (size_t t = r.begin(); t != r.end(); ++t) {
                    const size_t first = S + 1 - K + t;
                    float* yt = yb + t * C;
                    size_t c = 0;
                    for (; c + 8 <= C; c += 8) {
                        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(wT.data() + c), _mm256_loadu_ps(row(first) + c));
                        for (size_t j = 1; j < K; ++j)
                            acc = _mm256_fmadd_ps(_mm256_loadu_ps(wT.data() + j * C + c), _mm256_loadu_ps(row(first + j) + c), acc);
                        _mm256_storeu_ps(yt + c, acc);
                    }
                    for (; c < C; ++c) {
                        float acc = wT[c] * row(first)[c];
                        for (size_t j = 1; j < K; ++j)
                            acc = std::fma(wT[j * C + c], row(first + j)[c], acc);
                        yt[c] = acc;
                    }
                }
            });
            float* ob = out_state + b * C * S;
            for (size_t i = 0; i < S; ++i) {  // the last S entries of z, channel-major
                const float* zi = row(T + i);
                for (size_t c = 0; c < C; ++c)
                    ob[c * S + i] = zi[c];
            }
        }
        return true;
    }

private:
    // One token (decode): the same sums in the same order as above (a product, then FMAs over
    // j), read straight from the channel-major state and filters, without the chunk path's
    // transposes of the filters, the state and the new state: 36 -> 18-20 us per call at 8192
    // channels (~5 us of it the fixed cost of an extension op's call; docs/perf-log.md, session
    // 13). The new state is the old one shifted by one entry per channel, then x.
    static void decode(const float* x, const float* state, const float* w, float* y, float* out_state, size_t B, size_t C,
                       size_t S, size_t K) {
        const size_t first = S + 1 - K;  // z[first + j], z = state's S entries, then x
        for (size_t b = 0; b < B; ++b) {
            const float* xb = x + b * C;
            const float* sb = state + b * C * S;
            float* yb = y + b * C;
            float* ob = out_state + b * C * S;
            tbb::parallel_for(tbb::blocked_range<size_t>(0, C, 1024), [&](const tbb::blocked_range<size_t>& r) {
                for (size_t c = r.begin(); c != r.end(); ++c) {
                    const float* wc = w + c * K;
                    const float* sc = sb + c * S;
                    const auto z = [&](size_t i) { return i < S ? sc[i] : xb[c]; };
                    float acc = wc[0] * z(first);
                    for (size_t j = 1; j < K; ++j)
                        acc = std::fma(wc[j], z(first + j), acc);
                    yb[c] = acc;
                }
            });
            if (S == 0)
                continue;
            std::memmove(ob, sb + 1, (C * S - 1) * sizeof(float));  // ob[c][i] = sb[c][i + 1] for i < S - 1
            for (size_t c = 0; c < C; ++c)
                ob[c * S + S - 1] = xb[c];
        }
    }
};

}  // namespace iq36
