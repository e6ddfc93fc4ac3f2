// U4Experts: the routed experts of a MoE block for a chunk of tokens, grouped by expert, reading
// the exported u4 weights directly (no decompressed copy in memory).
//
// U4Experts(x, idx, weights, skip, gate_w, gate_z, gate_s, up_w, up_z, up_s, down_w, down_z, down_s) -> y
//   x        f32 [T, H]          the block's input rows
//   idx      i32/i64 [T, k]      the router's top-k experts per row
//   weights  f32 [T, k]          their (normalised) routing weights
//   skip     i32/i64 [1]         rows [0, skip) are left at zero (computed elsewhere)
//   *_w      u4 [E, O, G, g]     packed two per byte, the first in the low nibble (or u8, one
//                                value per byte: the CPU plugin converts u4 constants that feed
//                                no decompression pattern of its own to u8)
//   *_z      u4 [E, O, G, 1]     zero point per group of g inputs (or u8)
//   *_s      f16/f32 [E, O, G, 1] scale per group
//   y        f32 [T, H]          y[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = idx[t, j]
//
// gate/up: O = I (the expert's width), G * g = H; down: O = H, G * g = I.
//
// How: rows are bucketed by expert. Stage 1, one task per (expert, 32 rows of gate and up):
// decompress those rows to f32 in a thread-local tile, then every routed token's dot products
// against them -> act[(expert, token), i] = silu(gate) * up. Stage 2, one task per 64 output
// columns (rows of down): for each present expert, decompress its 64 down rows and accumulate
// weight * act . down into y[t, columns] -- each task owns its columns, so no two tasks write
// the same output. Each expert's weights are read from memory once per chunk; the dot products
// are 4 weight rows x up to 3 token rows of 8-wide FMAs. An expert with one or two rows (decode)
// skips the tile: its products are taken straight from the packed bytes (`direct`). Math: (q - z) * s in f32, as the CPU
// plugin's own fused kernels compute it (the export's graph says f16; rounding the product to
// f16 moved the logits 10x further from stock's, docs/perf-log.md), f32 accumulation in another
// order than the plugin's.
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

namespace experts {

// One stacked u4 matrix [E, O, G, g] with its zero points and scales.
struct Packed {
    const uint8_t* w;
    const uint8_t* z;
    bool w4, z4;  // two values per byte (u4), else one (u8)
    const void* s;
    bool s16;  // scales in f16 (else f32)
    size_t out, groups, group;
    float scale(size_t i) const {
        return s16 ? static_cast<float>(static_cast<const ov::float16*>(s)[i]) : static_cast<const float*>(s)[i];
    }
    size_t in() const { return groups * group; }
};

inline uint8_t nibble(const uint8_t* base, size_t index) {
    const uint8_t b = base[index >> 1];
    return (index & 1) ? (b >> 4) : (b & 0x0F);
}

inline uint8_t value(const uint8_t* base, size_t index, bool packed) {
    return packed ? nibble(base, index) : base[index];
}

// Rows [r0, r0 + n) of expert e, decompressed to f32 into dst (n x in, row-major).
inline void decompress(const Packed& m, size_t e, size_t r0, size_t n, float* dst) {
    const size_t in = m.in();
    const __m128i low = _mm_set1_epi16(0x000F);
    for (size_t r = 0; r < n; ++r) {
        const size_t row = e * m.out + r0 + r;
        float* out = dst + r * in;
        for (size_t g = 0; g < m.groups; ++g) {
            const size_t gi = row * m.groups + g;
            const __m256 z = _mm256_set1_ps(static_cast<float>(value(m.z, gi, m.z4)));
            const __m256 s = _mm256_set1_ps(m.scale(gi));
            float* o = out + g * m.group;
            size_t j = 0;
            if (!m.w4) {
                const uint8_t* src = m.w + gi * m.group;
                for (; j + 8 <= m.group; j += 8) {
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j))));
                    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_sub_ps(f, z), s));
                }
            }
            const uint8_t* src = m.w + (gi * m.group >> 1);
            for (; m.w4 && j + 16 <= m.group; j += 16) {
                const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j / 2)));
                const __m128i v = _mm_or_si128(_mm_and_si128(b, low), _mm_slli_epi16(_mm_srli_epi16(b, 4), 8));
                const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
                _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_sub_ps(f0, z), s));
                _mm256_storeu_ps(o + j + 8, _mm256_mul_ps(_mm256_sub_ps(f1, z), s));
            }
            for (; j < m.group; ++j) {
                const float q = static_cast<float>(value(m.w, gi * m.group + j, m.w4));
                o[j] = (q - _mm256_cvtss_f32(z)) * _mm256_cvtss_f32(s);
            }
        }
    }
}

// out[r][c] = dot(x[r], w[c]) over K, for R token rows and 4 weight rows (w rows ldw apart).
template <int R>
inline void dot(const float* const* x, const float* w, size_t ldw, size_t K, float out[][4]) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c)
            acc[r][c] = _mm256_setzero_ps();
    size_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + ldw + k);
        const __m256 w2 = _mm256_loadu_ps(w + 2 * ldw + k), w3 = _mm256_loadu_ps(w + 3 * ldw + k);
        for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_loadu_ps(x[r] + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(xv, w3, acc[r][3]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) {
            float v = hsum(acc[r][c]);
            for (size_t kk = k; kk < K; ++kk)
                v += x[r][kk] * w[c * ldw + kk];
            out[r][c] = v;
        }
}

// out[i][c] = dot(x[i], w[c]) for every token row i < m and weight row c < n (n % 4 == 0), w
// rows K apart. K is walked in slices of kSlice so that a dot's 4 weight rows and 3 token rows
// stay in L1 (7 rows x 2048 f32 = 56 KB would not); partial sums accumulate in `out`.
#ifndef IQ36_SLICE
#define IQ36_SLICE 512
#endif
constexpr size_t kSlice = IQ36_SLICE;

inline void block(const float* const* x, size_t m, const float* w, size_t n, size_t K, float* out, size_t ldo) {
    float tmp[3][4];
    const float* xs[3];
    for (size_t k0 = 0; k0 < K; k0 += kSlice) {
        const size_t kn = std::min(kSlice, K - k0);
        for (size_t i = 0; i < m;) {
            const size_t rows = std::min<size_t>(3, m - i);
            for (size_t r = 0; r < rows; ++r)
                xs[r] = x[i + r] + k0;
            for (size_t c = 0; c < n; c += 4) {
                if (rows == 3)
                    dot<3>(xs, w + c * K + k0, K, kn, tmp);
                else if (rows == 2)
                    dot<2>(xs, w + c * K + k0, K, kn, tmp);
                else
                    dot<1>(xs, w + c * K + k0, K, kn, tmp);
                for (size_t r = 0; r < rows; ++r)
                    for (int q = 0; q < 4; ++q) {
                        float& o = out[(i + r) * ldo + c + q];
                        o = k0 ? o + tmp[r][q] : tmp[r][q];
                    }
            }
            i += rows;
        }
    }
}

// out[r] = dot(row r0 + r of expert e, x) for r < n, straight from the packed bytes: for an
// expert with one or two tokens (decode, or a rare expert in a chunk) decompressing a tile to
// memory costs more than the products. Same arithmetic per weight as `decompress` + `dot`
// ((q - z) * s * x), the scale applied once per group.
inline void direct(const Packed& m, size_t e, size_t r0, size_t n, const float* x, float* out) {
    const __m128i low = _mm_set1_epi16(0x000F);
    for (size_t r = 0; r < n; ++r) {
        const size_t row = e * m.out + r0 + r;
        __m256 acc = _mm256_setzero_ps();
        float tail = 0.0f;
        for (size_t g = 0; g < m.groups; ++g) {
            const size_t gi = row * m.groups + g;
            const float zf = static_cast<float>(value(m.z, gi, m.z4));
            const __m256 z = _mm256_set1_ps(zf);
            const float* xg = x + g * m.group;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            size_t j = 0;
            if (m.w4) {
                const uint8_t* src = m.w + (gi * m.group >> 1);
                for (; j + 16 <= m.group; j += 16) {
                    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j / 2)));
                    const __m128i v = _mm_or_si128(_mm_and_si128(b, low), _mm_slli_epi16(_mm_srli_epi16(b, 4), 8));
                    a0 = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), z), _mm256_loadu_ps(xg + j), a0);
                    a1 = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), z),
                                         _mm256_loadu_ps(xg + j + 8), a1);
                }
            } else {
                const uint8_t* src = m.w + gi * m.group;
                for (; j + 8 <= m.group; j += 8) {
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j))));
                    a0 = _mm256_fmadd_ps(_mm256_sub_ps(f, z), _mm256_loadu_ps(xg + j), a0);
                }
            }
            float rest = 0.0f;
            for (; j < m.group; ++j)
                rest += (static_cast<float>(value(m.w, gi * m.group + j, m.w4)) - zf) * xg[j];
            const float sc = m.scale(gi);
            acc = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(sc), acc);
            tail += rest * sc;
        }
        out[r] = hsum(acc) + tail;
    }
}

constexpr size_t kDirect = 2;  // experts with at most this many rows take `direct`

// out[i][c] = dot(x[i], row r0 + c of expert e) for i < count, c < n: `direct` for few rows,
// else the rows decompressed into `tile` (n x K) and `block`.
inline void products(const Packed& m, size_t e, size_t r0, size_t n, const float* const* x, size_t count, float* tile,
                     float* out, size_t ldo) {
    if (count <= kDirect) {
        for (size_t i = 0; i < count; ++i)
            direct(m, e, r0, n, x[i], out + i * ldo);
        return;
    }
    decompress(m, e, r0, n, tile);
    block(x, count, tile, n, m.in(), out, ldo);
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

#ifndef IQ36_GATE_ROWS
#define IQ36_GATE_ROWS 32
#endif
constexpr size_t kGateRows = IQ36_GATE_ROWS;  // rows of gate and of up per stage-1 task
#ifndef IQ36_DOWN_ROWS
#define IQ36_DOWN_ROWS 64
#endif
constexpr size_t kDownRows = IQ36_DOWN_ROWS;  // rows of down (output columns) per stage-2 task

}  // namespace experts

class U4Experts final : public ov::op::Op {
public:
    OPENVINO_OP("U4Experts", "iq36");

    U4Experts() = default;
    explicit U4Experts(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 13, "U4Experts takes x, idx, weights, skip and 3 x (w, z, s)");
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
        const auto it = get_input_element_type(1);
        NODE_VALIDATION_CHECK(this, it == ov::element::i32 || it == ov::element::i64, "idx must be i32 or i64");
        NODE_VALIDATION_CHECK(this, get_input_element_type(2) == ov::element::f32, "weights must be f32");
        const auto st = get_input_element_type(3);
        NODE_VALIDATION_CHECK(this, st == ov::element::i32 || st == ov::element::i64, "skip must be i32 or i64");
        for (size_t m = 0; m < 3; ++m) {
            for (size_t j = 0; j < 2; ++j) {
                const auto t = get_input_element_type(4 + 3 * m + j);
                NODE_VALIDATION_CHECK(this, t == ov::element::u4 || t == ov::element::u8, "weights and zero points must be u4 (or u8)");
            }
            const auto sc = get_input_element_type(6 + 3 * m);
            NODE_VALIDATION_CHECK(this, sc == ov::element::f16 || sc == ov::element::f32, "scales must be f16 or f32");
            for (size_t j = 0; j < 3; ++j)
                NODE_VALIDATION_CHECK(this, get_input_partial_shape(4 + 3 * m + j).is_static(), "expert tensors must be static");
            const auto ws = get_input_shape(4 + 3 * m);
            NODE_VALIDATION_CHECK(this, ws.size() == 4 && ws[3] % 2 == 0, "expert weights must be [E, O, G, g], g even");
            const ov::Shape group_shape{ws[0], ws[1], ws[2], 1};
            NODE_VALIDATION_CHECK(this, get_input_shape(5 + 3 * m) == group_shape && get_input_shape(6 + 3 * m) == group_shape,
                                  "zero points and scales must be [E, O, G, 1]");
        }
        const auto g = get_input_shape(4), u = get_input_shape(7), d = get_input_shape(10);
        NODE_VALIDATION_CHECK(this, g == u, "gate and up must have one shape");
        NODE_VALIDATION_CHECK(this, d[0] == g[0] && d[2] * d[3] == g[1], "down's inputs must be gate's outputs");
        NODE_VALIDATION_CHECK(this, g[1] % experts::kGateRows == 0 && d[1] % experts::kDownRows == 0,
                              "expert widths must be multiples of the tile sizes");
        const auto& x = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, x.rank().is_static() && x.rank().get_length() == 2, "x must be [T, H]");
        NODE_VALIDATION_CHECK(this, x[1].compatible(static_cast<int64_t>(g[2] * g[3])) && x[1].compatible(static_cast<int64_t>(d[1])),
                              "x's width must be the experts' input and output width");
        set_output_type(0, ov::element::f32, x);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<U4Experts>(args);
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        using namespace experts;
        const ov::Tensor& x = inputs[0];
        const size_t T = x.get_shape()[0], H = x.get_shape()[1];
        const size_t K = inputs[1].get_shape()[1];
        outputs[0].set_shape({T, H});
        float* y = outputs[0].data<float>();
        std::fill(y, y + T * H, 0.0f);
        const int64_t skip_in = inputs[3].get_element_type() == ov::element::i64 ? inputs[3].data<const int64_t>()[0]
                                                                                  : inputs[3].data<const int32_t>()[0];
        const size_t skip = static_cast<size_t>(std::clamp<int64_t>(skip_in, 0, static_cast<int64_t>(T)));
        if (skip >= T)
            return true;

        Packed mats[3];
        for (size_t m = 0; m < 3; ++m) {
            const auto ws = inputs[4 + 3 * m].get_shape();
            mats[m] = {static_cast<const uint8_t*>(inputs[4 + 3 * m].data()), static_cast<const uint8_t*>(inputs[5 + 3 * m].data()),
                       inputs[4 + 3 * m].get_element_type() == ov::element::u4, inputs[5 + 3 * m].get_element_type() == ov::element::u4,
                       inputs[6 + 3 * m].data(), inputs[6 + 3 * m].get_element_type() == ov::element::f16, ws[1], ws[2], ws[3]};
        }
        const Packed& gate = mats[0];
        const Packed& up = mats[1];
        const Packed& down = mats[2];
        const size_t E = inputs[4].get_shape()[0];
        const size_t I = gate.out;

        // bucket (row, slot) pairs by expert: order[start[e] .. start[e + 1])
        std::vector<size_t> start(E + 1, 0);
        std::vector<int64_t> ids((T - skip) * K);
        const bool i64 = inputs[1].get_element_type() == ov::element::i64;
        for (size_t t = skip; t < T; ++t)
            for (size_t j = 0; j < K; ++j) {
                const int64_t e = i64 ? inputs[1].data<const int64_t>()[t * K + j] : inputs[1].data<const int32_t>()[t * K + j];
                if (e < 0 || static_cast<size_t>(e) >= E)
                    return false;
                ids[(t - skip) * K + j] = e;
                ++start[e + 1];
            }
        for (size_t e = 0; e < E; ++e)
            start[e + 1] += start[e];
        std::vector<size_t> fill(start.begin(), start.end() - 1);
        std::vector<uint32_t> token(ids.size());
        std::vector<float> route(ids.size());
        const float* rw = inputs[2].data<const float>();
        for (size_t t = skip; t < T; ++t)
            for (size_t j = 0; j < K; ++j) {
                const size_t e = static_cast<size_t>(ids[(t - skip) * K + j]);
                token[fill[e]] = static_cast<uint32_t>(t);
                route[fill[e]++] = rw[t * K + j];
            }
        std::vector<size_t> present;
        for (size_t e = 0; e < E; ++e)
            if (start[e + 1] > start[e])
                present.push_back(e);

        const float* xp = x.data<const float>();
        std::vector<float> act(ids.size() * I);  // [bucketed (row, slot), I]

        // stage 1: act = silu(x . gate^T) * (x . up^T), per (expert, kGateRows rows)
        const size_t tiles = I / kGateRows;
        tbb::parallel_for(tbb::blocked_range<size_t>(0, present.size() * tiles), [&](const tbb::blocked_range<size_t>& r) {
            thread_local std::vector<float> wg, wu, g, u;
            thread_local std::vector<const float*> rows;
            wg.resize(kGateRows * H);
            wu.resize(kGateRows * H);
            for (size_t task = r.begin(); task != r.end(); ++task) {
                const size_t e = present[task / tiles], r0 = (task % tiles) * kGateRows;
                const size_t b = start[e], m = start[e + 1] - b;
                rows.resize(m);
                for (size_t i = 0; i < m; ++i)
                    rows[i] = xp + token[b + i] * H;
                g.resize(m * kGateRows);
                u.resize(m * kGateRows);
                products(gate, e, r0, kGateRows, rows.data(), m, wg.data(), g.data(), kGateRows);
                products(up, e, r0, kGateRows, rows.data(), m, wu.data(), u.data(), kGateRows);
                for (size_t i = 0; i < m; ++i)
                    for (size_t c = 0; c < kGateRows; ++c)
                        act[(b + i) * I + r0 + c] = silu(g[i * kGateRows + c]) * u[i * kGateRows + c];
            }
        });

        // stage 2: y[t, cols] += route * act . down^T, per kDownRows output columns
        tbb::parallel_for(tbb::blocked_range<size_t>(0, H / kDownRows), [&](const tbb::blocked_range<size_t>& r) {
            thread_local std::vector<float> wd, out;
            thread_local std::vector<const float*> rows;
            wd.resize(kDownRows * I);
            for (size_t task = r.begin(); task != r.end(); ++task) {
                const size_t c0 = task * kDownRows;
                for (size_t e : present) {
                    const size_t b = start[e], m = start[e + 1] - b;
                    rows.resize(m);
                    for (size_t i = 0; i < m; ++i)
                        rows[i] = act.data() + (b + i) * I;
                    out.resize(m * kDownRows);
                    products(down, e, c0, kDownRows, rows.data(), m, wd.data(), out.data(), kDownRows);
                    for (size_t i = 0; i < m; ++i) {
                        float* dst = y + token[b + i] * H + c0;
                        const float w = route[b + i];
                        for (size_t c = 0; c < kDownRows; ++c)
                            dst[c] += w * out[i * kDownRows + c];
                    }
                }
            }
        });
        return true;
    }
};

}  // namespace iq36
