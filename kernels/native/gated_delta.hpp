// GatedDeltaRule: the gated delta rule recurrence of a linear-attention (GatedDeltaNet) layer over
// a chunk of tokens, replacing the exported per-token Loop.
//
// GatedDeltaRule(q, k, v, g, beta, state) -> (out, state_out)
//   q, k   f32 [B, H, T, dk]
//   v      f32 [B, H, T, dv]
//   g      f32 [B, H, T]      log decay
//   beta   f32 [B, H, T]
//   state  f32 [B, H, dk, dv] the recurrent state before the chunk
//   out    f32 [B, H, T, dv]
//   state_out f32 [B, H, dk, dv] after the chunk
//
// Per token t, as the exported loop body computes it (S = state, rows i < dk, columns j < dv):
//   S = S * exp(g_t)
//   kv[j] = sum_i S[i, j] * k_t[i]
//   delta = (v_t - kv) * beta_t
//   S[i, j] += k_t[i] * delta[j]
//   out_t[j] = sum_i S[i, j] * q_t[i]
// How: one task per (batch, head); the state stays in that task's cache for the whole chunk and
// is walked once per token (the previous token's update + out, then this token's decay + kv:
// `sweep`) instead of the loop's five full-tensor ops, each with its own buffers and threading.
// Sums run over i in order, vectorised over j. A decode step (T = 1) reads the state from the
// input and writes the output state once, streamed (`head_one`).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common.hpp"

namespace iq36 {

namespace gdn {

// State element (i, j) of one sweep, scalar (the columns past whole vectors): the previous
// token's update and output (kUpdate), then this token's decay and kv (kDecay); returns it.
template <bool kUpdate, bool kDecay>
inline float element(float s, size_t i, size_t j, const float* kp, const float* dp, const float* qp, float* op, float decay_s,
                     const float* kt, float* kv) {
    if constexpr (kUpdate) {
        s += kp[i] * dp[j];
        op[j] += s * qp[i];
    }
    if constexpr (kDecay) {
        s *= decay_s;
        kv[j] += s * kt[i];
    }
    return s;
}

// Columns [j0, j0 + 8 V) of one sweep, every row: the column block's output and kv sums stay in
// registers for the whole walk down the rows (a row-major walk kept them in memory: a load and a
// store of each per 8 elements and row, which bound the sweep), and dp's block too. Per element
// the same operations in the same order of rows as the row-major walk, so the same bits.
template <bool kUpdate, bool kDecay, int V>
inline void sweep_columns(const float* src, float* dst, size_t dk, size_t dv, size_t j0, const float* kp, const float* dp,
                          const float* qp, float* op, __m256 decay, const float* kt, float* kv) {
    __m256 d[V], o[V], a[V];
    for (int v = 0; v < V; ++v) {
        d[v] = kUpdate ? _mm256_loadu_ps(dp + j0 + 8 * v) : _mm256_setzero_ps();
        o[v] = kUpdate ? _mm256_loadu_ps(op + j0 + 8 * v) : _mm256_setzero_ps();
        a[v] = kDecay ? _mm256_loadu_ps(kv + j0 + 8 * v) : _mm256_setzero_ps();
    }
    for (size_t i = 0; i < dk; ++i) {
        const float* in = src + i * dv + j0;
        float* row = dst + i * dv + j0;
        const __m256 kpi = _mm256_set1_ps(kUpdate ? kp[i] : 0.0f), qpi = _mm256_set1_ps(kUpdate ? qp[i] : 0.0f);
        const __m256 ki = _mm256_set1_ps(kDecay ? kt[i] : 0.0f);
        for (int v = 0; v < V; ++v) {
            __m256 s = _mm256_loadu_ps(in + 8 * v);
            if constexpr (kUpdate) {
                s = _mm256_fmadd_ps(kpi, d[v], s);
                o[v] = _mm256_fmadd_ps(s, qpi, o[v]);
            }
            if constexpr (kDecay) {
                s = _mm256_mul_ps(s, decay);
                a[v] = _mm256_fmadd_ps(s, ki, a[v]);
            }
            _mm256_storeu_ps(row + 8 * v, s);
        }
    }
    for (int v = 0; v < V; ++v) {
        if constexpr (kUpdate)
            _mm256_storeu_ps(op + j0 + 8 * v, o[v]);
        if constexpr (kDecay)
            _mm256_storeu_ps(kv + j0 + 8 * v, a[v]);
    }
}

#ifndef IQ36_GDN_COLUMNS
#define IQ36_GDN_COLUMNS 3
#endif
// 8-wide vectors per column block: three (9 accumulators, a state vector, 4 broadcasts in the 16
// ymm registers)
constexpr int kColumnVectors = IQ36_GDN_COLUMNS;

// One sweep over the state for one token, for a chunk's state, which stays in cache: first the
// previous token's update and output (kUpdate: S += kp (x) dp, then op = qp . S), then this
// token's decay and kv (kDecay: S *= decay, kv = k . S); per element the same operations in the
// same order as two separate passes per token (decay + kv, then update + out), so the same bits,
// with the state walked once per token instead of twice. Column blocks of kColumnVectors x 8
// (`sweep_columns`), then of 8, then single columns. The op at dev-bench's shape (32 heads of
// 128 x 128, 512 tokens) 29-31 -> 15-18 ms on a Zen 4 (docs/perf-log.md, session 32).
template <bool kUpdate, bool kDecay>
inline void sweep(const float* src, float* dst, size_t dk, size_t dv, const float* kp, const float* dp, const float* qp, float* op,
                  float decay_s, const float* kt, float* kv) {
    const __m256 decay = _mm256_set1_ps(decay_s);
    size_t j = 0;
    for (; j + 8 * kColumnVectors <= dv; j += 8 * kColumnVectors)
        sweep_columns<kUpdate, kDecay, kColumnVectors>(src, dst, dk, dv, j, kp, dp, qp, op, decay, kt, kv);
    for (; j + 8 <= dv; j += 8)
        sweep_columns<kUpdate, kDecay, 1>(src, dst, dk, dv, j, kp, dp, qp, op, decay, kt, kv);
    for (; j < dv; ++j)
        for (size_t i = 0; i < dk; ++i)
            dst[i * dv + j] = element<kUpdate, kDecay>(src[i * dv + j], i, j, kp, dp, qp, op, decay_s, kt, kv);
}

// One head over T tokens; S (dk x dv) updated in place. Per token t (as the exported loop):
// S *= exp(g_t); kv = k_t . S; delta = (v_t - kv) * beta_t; S += k_t (x) delta; out_t = q_t . S,
// with token t's update and output done in token t + 1's sweep (and a last sweep after the chunk).
// `delta` holds two rows of dv: this token's and the previous one's.
inline void head(const float* q, const float* k, const float* v, const float* g, const float* beta, size_t T, size_t dk,
                 size_t dv, float* S, float* out, float* delta) {
    float* cur = delta;
    float* prev = delta + dv;
    for (size_t t = 0; t < T; ++t) {
        const float* kt = k + t * dk;
        std::fill(cur, cur + dv, 0.0f);  // kv, then delta in place
        if (t == 0) {
            sweep<false, true>(S, S, dk, dv, nullptr, nullptr, nullptr, nullptr, std::exp(g[t]), kt, cur);
        } else {
            float* op = out + (t - 1) * dv;
            std::fill(op, op + dv, 0.0f);
            sweep<true, true>(S, S, dk, dv, k + (t - 1) * dk, prev, q + (t - 1) * dk, op, std::exp(g[t]), kt, cur);
        }
        const float* vt = v + t * dv;
        const float b = beta[t];
        for (size_t j = 0; j < dv; ++j)
            cur[j] = (vt[j] - cur[j]) * b;
        std::swap(cur, prev);
    }
    if (T > 0) {
        float* op = out + (T - 1) * dv;
        std::fill(op, op + dv, 0.0f);
        sweep<true, false>(S, S, dk, dv, k + (T - 1) * dk, prev, q + (T - 1) * dk, op, 1.0f, nullptr, nullptr);
    }
}

// One head, one token (a decode step), the state before the step read from `s0` and the state
// after it written to `s1`: two walks down the rows, as `head` computes them with T = 1 (the same
// bits): the first decays each row of s0 and sums kv (reading the state from DRAM: it is 2 MB a
// layer at 32 heads, evicted by the weights between steps), the second decays the row again (64
// KB a head: it is still in L2; storing the decayed rows for the second walk cost more) and adds
// the update, sums the output and streams the row to `s1` (non-temporal stores: `head` copies s0
// to s1 first and walks s1 twice, and the copy's read-for-ownership of s1 and its write-back made
// three DRAM transfers of the state per step where two are needed). The second walk also brings
// the next head's state (`next`) into L2 row by row, so its first walk waits on no DRAM and its
// reads overlap this head's writes. dv a multiple of 8; `delta` dv floats of scratch.
inline void head_one(const float* q, const float* k, const float* v, float g, float beta, size_t dk, size_t dv, const float* s0,
                     float* s1, float* out, float* delta, const float* next) {
    const __m256 decay = _mm256_set1_ps(std::exp(g));
    std::fill(delta, delta + dv, 0.0f);  // kv, then delta in place
    for (size_t i = 0; i < dk; ++i) {
        const float* row = s0 + i * dv;
        const __m256 ki = _mm256_set1_ps(k[i]);
        for (size_t j = 0; j < dv; j += 8) {
            const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + j), decay);
            _mm256_storeu_ps(delta + j, _mm256_fmadd_ps(s, ki, _mm256_loadu_ps(delta + j)));
        }
    }
    for (size_t j = 0; j < dv; ++j)
        delta[j] = (v[j] - delta[j]) * beta;
    std::fill(out, out + dv, 0.0f);
    for (size_t i = 0; i < dk; ++i) {
        const float* row = s0 + i * dv;
        if (next) {
            const char* p = reinterpret_cast<const char*>(next + i * dv);
            for (size_t b = 0; b < dv * sizeof(float); b += 64)
                _mm_prefetch(p + b, _MM_HINT_T1);
        }
        const __m256 kpi = _mm256_set1_ps(k[i]), qpi = _mm256_set1_ps(q[i]);
        for (size_t j = 0; j < dv; j += 8) {
            __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + j), decay);
            s = _mm256_fmadd_ps(kpi, _mm256_loadu_ps(delta + j), s);
            _mm256_storeu_ps(out + j, _mm256_fmadd_ps(s, qpi, _mm256_loadu_ps(out + j)));
            _mm256_stream_ps(s1 + i * dv + j, s);
        }
    }
}

}  // namespace gdn

class GatedDeltaRule final : public ov::op::Op {
public:
    OPENVINO_OP("GatedDeltaRule", "iq36");

    GatedDeltaRule() = default;
    explicit GatedDeltaRule(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 6, "GatedDeltaRule takes q, k, v, g, beta, state");
        for (size_t i = 0; i < 6; ++i)
            NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::f32, "inputs must be f32");
        const auto& q = get_input_partial_shape(0);
        const auto& v = get_input_partial_shape(2);
        const auto& s = get_input_partial_shape(5);
        NODE_VALIDATION_CHECK(this, q.rank().compatible(4) && v.rank().compatible(4) && s.rank().compatible(4),
                              "q, k, v must be [B, H, T, d] and state [B, H, dk, dv]");
        NODE_VALIDATION_CHECK(this, get_input_partial_shape(3).rank().compatible(3) && get_input_partial_shape(4).rank().compatible(3),
                              "g and beta must be [B, H, T]");
        set_output_type(0, ov::element::f32, v);
        set_output_type(1, ov::element::f32, s);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<GatedDeltaRule>(args);
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto qs = inputs[0].get_shape(), vs = inputs[2].get_shape(), ss = inputs[5].get_shape();
        const size_t B = qs[0], H = qs[1], T = qs[2], dk = qs[3], dv = vs[3];
        if (inputs[1].get_shape() != qs || vs[0] != B || vs[1] != H || vs[2] != T || ss != ov::Shape{B, H, dk, dv} ||
            inputs[3].get_shape() != ov::Shape{B, H, T} || inputs[4].get_shape() != ov::Shape{B, H, T})
            return false;
        outputs[0].set_shape(vs);
        outputs[1].set_shape(ss);
        const float* q = inputs[0].data<const float>();
        const float* k = inputs[1].data<const float>();
        const float* v = inputs[2].data<const float>();
        const float* g = inputs[3].data<const float>();
        const float* beta = inputs[4].data<const float>();
        const float* s0 = inputs[5].data<const float>();
        float* out = outputs[0].data<float>();
        float* s1 = outputs[1].data<float>();
        // A decode step takes `head_one` where the state's rows suit 32-byte stores.
        const bool one = T == 1 && dv % 8 == 0 && reinterpret_cast<uintptr_t>(s1) % 32 == 0;
        tbb::parallel_for(tbb::blocked_range<size_t>(0, B * H), [&](const tbb::blocked_range<size_t>& r) {
            thread_local std::vector<float> delta;
            delta.resize(2 * dv);
            if (one) {
                // The next head in index order: the default partitioner hands out ranges of a head
                // or two, and a thread mostly takes the next ones.
                for (size_t bh = r.begin(); bh != r.end(); ++bh) {
                    const float* next = bh + 1 < B * H ? s0 + (bh + 1) * dk * dv : nullptr;
                    gdn::head_one(q + bh * dk, k + bh * dk, v + bh * dv, g[bh], beta[bh], dk, dv, s0 + bh * dk * dv,
                                  s1 + bh * dk * dv, out + bh * dv, delta.data(), next);
                }
                _mm_sfence();  // the streamed state is visible before the op returns
                return;
            }
            for (size_t bh = r.begin(); bh != r.end(); ++bh) {
                float* S = s1 + bh * dk * dv;
                std::copy_n(s0 + bh * dk * dv, dk * dv, S);
                gdn::head(q + bh * T * dk, k + bh * T * dk, v + bh * T * dv, g + bh * T, beta + bh * T, T, dk, dv, S,
                          out + bh * T * dv, delta.data());
            }
        });
        return true;
    }
};

}  // namespace iq36
