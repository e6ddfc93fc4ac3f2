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
//                                no decompression pattern of its own to u8; or, with the
//                                `nibbles` attribute, u8 [E, O, G, g / 2]: the packed bytes)
//   *_z      u4 [E, O, G, 1]     zero point per group of g inputs (or u8)
//   *_s      f16/f32 [E, O, G, 1] scale per group
//   y        f32 [T, H]          y[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = idx[t, j]
//
// gate/up: O = I (the expert's width), G * g = H; down: O = H, G * g = I.
//
// With 12 more inputs, the block's shared expert too (decode_shared_expert, for the decode graph):
//   sg_w, sg_z, sg_s            u4 [1, G, g] (and zero points, scales [1, G, 1]): its gate's row
//   sgate_*, sup_*, sdown_*     u4 [Is, G, g], [Is, G, g], [H, Gs, gs]: its three matrices
//   y[t] += sigmoid(sg . x[t]) * sdown(silu(sgate(x[t])) * sup(x[t])), added after the routed
//   experts' sum, for every row from `skip` on, on the integer products of Q16Linear (whatever
//   the rows: meant for decode, where each row reads the matrices once). The same `nibbles`.
//
// How: rows are bucketed by expert. Stage 1, one task per (expert, 128 rows of gate and up): the
// expert's token rows transposed once (xT: inputs x tokens, padded to 8 tokens), then, one slice
// of inputs at a time (whole rows where the tile fits L2, else ~256 inputs: `slice_of`), the
// weight rows decompressed to f32 in a thread-local tile and
// multiplied into act[expert][i][token] = silu(gate) * up. Stage 2, one task per 128 output
// columns (rows of down): for each present expert, the same on its act columns, then
// y[t, columns] += weight * result -- each task owns its columns, so no two tasks write the same
// output. Each expert's weights are read from memory once per chunk. The register block is 6
// weight rows x 2 vectors of 8 tokens: the weight is broadcast and the tokens are the lanes, so
// every FMA lands in its final accumulator (no horizontal sums). On packed u4 weights the f32
// tiles hold each run of 16 inputs as its 8 even then its 8 odd ones (`split_index`: the bytes
// widen without shuffles) and an expert's last 1-4 tokens past whole vectors take dot products
// along the inputs instead of a padded vector (`dots`). An expert with one or two rows
// (decode) skips the tile: its products are taken straight from the packed bytes (`direct`).
// With the `q16_rows` attribute (q16_decode), a call of at most that many rows (decode) takes
// those products on integers instead: each row and each act row written as two integer terms per
// 128 inputs, pmaddwd / pmaddubsw on the packed weights (q16_linear.hpp); as close to float64 as
// the f32 path.
// With the `bf16` attribute the tiles take bf16 dot products (u4_experts_bf16.hpp), with `int8`
// too the lane form's take int8 activations per 32 inputs (u4_experts_int8.hpp).
// Math: (q - z) * s in f32, as the CPU plugin's own fused kernels compute it (the export's graph says f16; rounding the product to
// f16 moved the logits 10x further from stock's, docs/perf-log.md), f32 accumulation in another
// order than the plugin's.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <openvino/core/type/float16.hpp>
#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common.hpp"
#include "expf.hpp"
#include "q16_linear.hpp"

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

// The f32 tiles' input order ("split"): within each run of 16 inputs, the 8 even ones, then the 8
// odd ones -- the low nibbles of 8 packed bytes, then their high nibbles, which is how the bytes
// widen without shuffles (one zero-extension, one and, one shift: 3 operations per 16 weights
// instead of 8 to restore the packed order). The token columns (xT) and stage 1's act rows (down's
// inputs) are laid out in the same order, so every product pairs the same weight and input.
constexpr size_t kSplit = 16;
inline size_t split_index(size_t k) { return (k & ~(kSplit - 1)) | ((k & 1) << 3) | ((k & (kSplit - 1)) >> 1); }
inline bool splits(const Packed& m) { return m.w4 && m.group % kSplit == 0; }

// Rows [r0, r0 + n) of expert e, inputs [k0, k0 + kn) (whole groups), decompressed to f32 into
// dst (n x kn, row-major; with `split`, in the split order: splits(m) must hold).
inline void decompress(const Packed& m, size_t e, size_t r0, size_t n, size_t k0, size_t kn, float* dst, bool split = false) {
    const __m128i low = _mm_set1_epi16(0x000F);
    const size_t g0 = k0 / m.group, g1 = (k0 + kn) / m.group;
    for (size_t r = 0; r < n; ++r) {
        const size_t row = e * m.out + r0 + r;
        float* out = dst + r * kn;
        for (size_t g = g0; g < g1; ++g) {
            const size_t gi = row * m.groups + g;
            const __m256 z = _mm256_set1_ps(static_cast<float>(value(m.z, gi, m.z4)));
            const __m256 s = _mm256_set1_ps(m.scale(gi));
            float* o = out + (g - g0) * m.group;
            size_t j = 0;
            if (!m.w4) {
                const uint8_t* src = m.w + gi * m.group;
                for (; j + 8 <= m.group; j += 8) {
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j))));
                    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_sub_ps(f, z), s));
                }
            }
            const uint8_t* src = m.w + (gi * m.group >> 1);
            // the same row's next slice, as the bf16 tiles do (u4_experts_bf16.hpp): a slice is a
            // few lines of each of its rows, which otherwise arrive one demand miss at a time
            for (size_t line = 0; m.w4 && line < m.group / 2; line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(src + kn / 2 + line), _MM_HINT_T0);
            for (; split && j < m.group; j += 16) {
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j / 2)));
                const __m256 f0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)));
                const __m256 f1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_sub_ps(f0, z), s));
                _mm256_storeu_ps(o + j + 8, _mm256_mul_ps(_mm256_sub_ps(f1, z), s));
            }
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

// The inputs walked per pass (whole groups). A task decompresses its rows (at most kTaskRows) x
// one slice into a thread's tile, then multiplies the tile into the slice's token columns.
// Whole rows when that tile fits the core's L2: each row's bytes are then read once, front to
// back, and each product kernel runs once per task with its sums in registers. Measured on a
// Zen 4 (1 MB L2; the op alone, E = 256): bf16 tiles 100 / 146 / 217 -> 79 / 124 / 188 ms at
// 257 / 513 / 1024 tokens, f32 tiles 154 / 338 -> 132 / 316 ms at 257 / 1024 (docs/perf-log.md,
// session 29). Else kSlice inputs, so that the tile stays in L2 and the slice's token columns in
// L1 (session 11's choice). `IQ36_SLICE_INPUTS=n` walks about n inputs per pass whatever the
// cache (the tests' way to cover the slices on any machine).
#ifndef IQ36_SLICE
#define IQ36_SLICE 256
#endif
constexpr size_t kSlice = IQ36_SLICE;
constexpr size_t kTaskRows = 128;  // the most rows a stage-1 or stage-2 task takes (kGateRows, kDownRows)

inline size_t slice_setting() {
    static const size_t inputs = [] {
        const char* env = std::getenv("IQ36_SLICE_INPUTS");
        return env ? static_cast<size_t>(std::strtoul(env, nullptr, 10)) : size_t{0};
    }();
    return inputs;
}

inline size_t l2_bytes() {
    static const size_t bytes = [] {
        const long got = sysconf(_SC_LEVEL2_CACHE_SIZE);
        return got > 0 ? static_cast<size_t>(got) : size_t{0};
    }();
    return bytes;
}

// Inputs per pass for m's tiles of `bytes` per weight (4: f32, 2: bf16); `whole`: whether whole
// rows may be taken.
inline size_t slice_of(const Packed& m, size_t bytes, bool whole = true) {
    const size_t forced = slice_setting();
    if (forced == 0 && whole && kTaskRows * m.in() * bytes <= l2_bytes())
        return m.in();
    return m.group * std::max<size_t>(1, (forced ? forced : kSlice) / m.group);
}

// Rows [r0, r0 + n) of expert e, their first kSlice inputs: requested a task ahead of the one that
// reads them. Within a task each row's next slice is prefetched as it is decompressed; a task's
// first slice (a few lines of each of its rows, 1 KB apart for gate and up) otherwise arrives one
// demand miss at a time. With the 64-weight decompression step: the op 4-10% faster at 257-1024
// tokens, E = 256 (docs/perf-log.md, session 27).
inline void prefetch_slice(const Packed& m, size_t e, size_t r0, size_t n) {
    const size_t row_bytes = m.w4 ? m.in() / 2 : m.in();
    const size_t bytes = std::min(row_bytes, m.w4 ? kSlice / 2 : kSlice);
    for (size_t r = 0; r < n; ++r) {
        const char* src = reinterpret_cast<const char*>(m.w + (e * m.out + r0 + r) * row_bytes);
        for (size_t line = 0; line < bytes; line += 64)
            _mm_prefetch(src + line, _MM_HINT_T0);
    }
}

// o[c][v * 8 ..] (+)= sum_k w[c][k] * xT[k][v * 8 ..] for C weight rows (ldw apart) and V
// vectors of 8 token columns (xT rows ldx apart): the weight is broadcast, the tokens are the
// vector lanes, so every FMA lands in its final accumulator (no horizontal sums).
template <int C, int V>
inline void kernel(const float* w, size_t ldw, const float* xT, size_t ldx, size_t kn, float* o, size_t ldo, bool add) {
    __m256 acc[C][V];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v)
            acc[c][v] = _mm256_setzero_ps();
    for (size_t k = 0; k < kn; ++k) {
        __m256 xv[V];
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v)
            xv[v] = _mm256_loadu_ps(xT + k * ldx + v * 8);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const __m256 wb = _mm256_broadcast_ss(w + c * ldw + k);
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v)
                acc[c][v] = _mm256_fmadd_ps(wb, xv[v], acc[c][v]);
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) {
            float* dst = o + c * ldo + v * 8;
            _mm256_storeu_ps(dst, add ? _mm256_add_ps(_mm256_loadu_ps(dst), acc[c][v]) : acc[c][v]);
        }
}

// Register blocks (12 accumulators, the token vectors and one broadcast in 16 ymm registers):
// 6 weight rows x 2 token vectors, 4 x 3 for a run of 3 vectors, 6 x 1 for a last single one.
template <int C, int V>
inline void run(const float* w, size_t n, size_t kn, const float* xT, size_t ldx, float* o, size_t ldo, bool add) {
    size_t c = 0;
    for (; c + C <= n; c += C)
        kernel<C, V>(w + c * kn, kn, xT, ldx, kn, o + c * ldo, ldo, add);
    for (; c < n; ++c)
        kernel<1, V>(w + c * kn, kn, xT, ldx, kn, o + c * ldo, ldo, add);
}

// Calls block(C, V, v) (C and V as std::integral_constant) over vecs token vectors in register
// blocks: C weight rows x V vectors from vector v; Triple x 3 for a run of 3 vectors, Single x 1
// for a last single one, else Pair x 2. Shared by the f32 tiles and the bf16 and int8 ones.
template <int Pair = 6, int Single = 6, int Triple = 4, typename Block>
inline void token_blocks(size_t vecs, Block&& block) {
    using std::integral_constant;
    for (size_t v = 0; v < vecs;) {
        const size_t left = vecs - v;
        if (left == 3) {
            block(integral_constant<int, Triple>{}, integral_constant<int, 3>{}, v);
            v += 3;
        } else if (left == 1) {
            block(integral_constant<int, Single>{}, integral_constant<int, 1>{}, v);
            v += 1;
        } else {
            block(integral_constant<int, Pair>{}, integral_constant<int, 2>{}, v);
            v += 2;
        }
    }
}

// o (n x vecs*8, ld ldo) (+)= w (n x kn, ld kn) . xT (kn x vecs*8, ld ldx). Token vectors
// outermost so that their slice of xT stays in L1 while the weight rows stream from L2.
inline void gemm(const float* w, size_t n, size_t kn, const float* xT, size_t ldx, size_t vecs, float* o, size_t ldo, bool add) {
    token_blocks(vecs, [&](auto c, auto vs, size_t v) {
        run<decltype(c)::value, decltype(vs)::value>(w, n, kn, xT + v * 8, ldx, o + v * 8, ldo, add);
    });
}

// The f32 tiles' dot form: o[c][j] (+)= sum_k w[c][k] * x[j][k] for C weight rows (kn apart) and
// R token rows (contiguous inputs, in the tile's input order), the inputs as vector lanes and one
// horizontal sum per product at the end: for an expert's last few tokens (at most kDotTail past
// its whole vectors of 8), whose padded vector would cost 8 lanes of FMAs for each of them.
constexpr size_t kDotTail = 4;

template <int C, int R>
inline void dot_kernel(const float* w, size_t kn, const float* const* x, size_t k0, float* o, size_t ldo, bool add) {
    __m256 acc[C][R];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int j = 0; j < R; ++j)
            acc[c][j] = _mm256_setzero_ps();
    for (size_t k = 0; k < kn; k += 8) {
        __m256 wv[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
            wv[c] = _mm256_loadu_ps(w + c * kn + k);
#pragma GCC unroll 8
        for (int j = 0; j < R; ++j) {
            const __m256 xv = _mm256_loadu_ps(x[j] + k0 + k);
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
                acc[c][j] = _mm256_fmadd_ps(wv[c], xv, acc[c][j]);
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int j = 0; j < R; ++j) {
            const float v = hsum(acc[c][j]);
            o[c * ldo + j] = add ? o[c * ldo + j] + v : v;
        }
}

// dot_kernel over n weight rows (w: n x kn, kn a multiple of 8) and R tokens: C x R accumulators,
// the C weight vectors and one token vector in 16 ymm registers.
template <int R>
inline void dots_of(const float* w, size_t n, size_t kn, const float* const* x, size_t k0, float* o, size_t ldo, bool add) {
    constexpr int C = R == 1 ? 6 : R == 2 ? 4 : R == 3 ? 3 : 2;
    size_t c = 0;
    for (; c + C <= n; c += C)
        dot_kernel<C, R>(w + c * kn, kn, x, k0, o + c * ldo, ldo, add);
    for (; c < n; ++c)
        dot_kernel<1, R>(w + c * kn, kn, x, k0, o + c * ldo, ldo, add);
}

inline void dots(const float* w, size_t n, size_t kn, const float* const* x, size_t rows, size_t k0, float* o, size_t ldo, bool add) {
    switch (rows) {
        case 0: return;
        case 1: return dots_of<1>(w, n, kn, x, k0, o, ldo, add);
        case 2: return dots_of<2>(w, n, kn, x, k0, o, ldo, add);
        case 3: return dots_of<3>(w, n, kn, x, k0, o, ldo, add);
        default: return dots_of<4>(w, n, kn, x, k0, o, ldo, add);  // rows <= kDotTail
    }
}

// o[c][t] = dot(row r0 + c of expert e, column t of xT) for c < n, t < vecs * 8; the weights
// are decompressed one slice of inputs at a time into `tile` (n x slice_of(m, 4)).
// Then o[c][vecs * 8 + j] = dot(row r0 + c, x[j]) for j < nx token rows (dot form; inputs in
// the tile's order, kn a multiple of 8 when nx > 0).
inline void products(const Packed& m, size_t e, size_t r0, size_t n, const float* xT, size_t ldx, size_t vecs, float* tile,
                     float* o, size_t ldo, bool split = false, const float* const* x = nullptr, size_t nx = 0) {
    const size_t K = m.in(), ks = slice_of(m, 4);
    for (size_t k0 = 0; k0 < K; k0 += ks) {
        const size_t kn = std::min(ks, K - k0);
        decompress(m, e, r0, n, k0, kn, tile, split);
        gemm(tile, n, kn, xT + k0 * ldx, ldx, vecs, o, ldo, k0 > 0);
        dots(tile, n, kn, x, nx, k0, o + vecs * 8, ldo, k0 > 0);
    }
}

inline void transpose8(__m256& r0, __m256& r1, __m256& r2, __m256& r3, __m256& r4, __m256& r5, __m256& r6, __m256& r7) {
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r0 = _mm256_permute2f128_ps(u0, u4, 0x20);
    r1 = _mm256_permute2f128_ps(u1, u5, 0x20);
    r2 = _mm256_permute2f128_ps(u2, u6, 0x20);
    r3 = _mm256_permute2f128_ps(u3, u7, 0x20);
    r4 = _mm256_permute2f128_ps(u0, u4, 0x31);
    r5 = _mm256_permute2f128_ps(u1, u5, 0x31);
    r6 = _mm256_permute2f128_ps(u2, u6, 0x31);
    r7 = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// xT[k][t] = rows[t][k] for k < K, t < ldx (ldx a multiple of 8; rows past m read `zero`); with
// `split`, xT[split_index(k)][t] (K a multiple of kSplit).
inline void transpose_rows(const float* const* rows, size_t m, const float* zero, size_t K, float* xT, size_t ldx, bool split = false) {
    for (size_t t0 = 0; t0 < ldx; t0 += 8) {
        const float* r[8];
        for (size_t i = 0; i < 8; ++i)
            r[i] = t0 + i < m ? rows[t0 + i] : zero;
        size_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v0 = _mm256_loadu_ps(r[0] + k), v1 = _mm256_loadu_ps(r[1] + k), v2 = _mm256_loadu_ps(r[2] + k),
                   v3 = _mm256_loadu_ps(r[3] + k), v4 = _mm256_loadu_ps(r[4] + k), v5 = _mm256_loadu_ps(r[5] + k),
                   v6 = _mm256_loadu_ps(r[6] + k), v7 = _mm256_loadu_ps(r[7] + k);
            transpose8(v0, v1, v2, v3, v4, v5, v6, v7);
            const auto d = [&](size_t i) { return xT + (split ? split_index(k + i) : k + i) * ldx + t0; };
            _mm256_storeu_ps(d(0), v0);
            _mm256_storeu_ps(d(1), v1);
            _mm256_storeu_ps(d(2), v2);
            _mm256_storeu_ps(d(3), v3);
            _mm256_storeu_ps(d(4), v4);
            _mm256_storeu_ps(d(5), v5);
            _mm256_storeu_ps(d(6), v6);
            _mm256_storeu_ps(d(7), v7);
        }
        for (; k < K; ++k)
            for (size_t i = 0; i < 8; ++i)
                xT[(split ? split_index(k) : k) * ldx + t0 + i] = r[i][k];
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

using vexp::silu;

#ifndef IQ36_GATE_ROWS
#define IQ36_GATE_ROWS 128
#endif
constexpr size_t kGateRows = IQ36_GATE_ROWS;  // rows of gate and of up per stage-1 task
#ifndef IQ36_DOWN_ROWS
#define IQ36_DOWN_ROWS 128
#endif
constexpr size_t kDownRows = IQ36_DOWN_ROWS;  // rows of down (output columns) per stage-2 task
// Output columns per stage-2 task in decode: 256 KB of down's packed rows at 512 inputs (the real
// model's experts) read as one stream; two tasks per row at H = 2048. 256, 512 and 2048 measured
// alike (docs/perf-log.md, session 53).
constexpr size_t kDecodeColumns = 1024;
static_assert(kGateRows <= kTaskRows && kDownRows <= kTaskRows, "slice_of sizes the tiles for kTaskRows rows");

// A dense matmul's N output rows (m's, taken as expert 0's) for M tokens on the tiles, in tasks of
// kGateRows rows (Q16Linear's `tile_rows`: bf16::dense, int8::dense): rows(r0, n, o) writes rows
// [r0, r0 + n) into o (n x ldo, a column per token), then y[t][r0 + c] = o[c][t].
template <class Rows>
inline void dense_tasks(const Packed& m, size_t N, size_t M, size_t ldo, float* y, Rows&& rows) {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, (N + kGateRows - 1) / kGateRows), [&](const tbb::blocked_range<size_t>& r) {
        thread_local std::vector<float> o;
        o.resize(kGateRows * ldo);
        const auto rows_of = [&](size_t task) { return std::min(kGateRows, N - task * kGateRows); };
        prefetch_slice(m, 0, r.begin() * kGateRows, rows_of(r.begin()));
        for (size_t task = r.begin(); task != r.end(); ++task) {
            const size_t r0 = task * kGateRows, n = rows_of(task);
            if (task + 1 != r.end())
                prefetch_slice(m, 0, r0 + kGateRows, rows_of(task + 1));
            rows(r0, n, o.data());
            for (size_t t = 0; t < M; ++t)
                for (size_t c = 0; c < n; ++c)
                    y[t * N + r0 + c] = o[c * ldo + t];
        }
    });
}

}  // namespace experts
}  // namespace iq36

#include "u4_experts_bf16.hpp"
#include "u4_experts_int8.hpp"

namespace iq36 {

class U4Experts final : public ov::op::Op {
public:
    OPENVINO_OP("U4Experts", "iq36");

    U4Experts() = default;
    explicit U4Experts(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }
    U4Experts(const ov::OutputVector& args, int64_t q16_rows, bool nibbles, bool bf16, bool residual = true, bool int8 = false)
        : Op(args), m_q16_rows(q16_rows), m_nibbles(nibbles), m_bf16(bf16), m_residual(residual), m_int8(int8) {
        constructor_validate_and_infer_types();
    }

    static constexpr size_t kRouted = 13, kShared = 25;  // inputs without and with the shared expert

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == kRouted || get_input_size() == kShared,
                              "U4Experts takes x, idx, weights, skip and 3 x (w, z, s), then optionally the shared expert's "
                              "gate row and 3 x (w, z, s)");
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
            NODE_VALIDATION_CHECK(this, !m_nibbles || get_input_element_type(4 + 3 * m) == ov::element::u8,
                                  "with nibbles, the weights are u8 bytes holding two u4 values each");
            const auto sc = get_input_element_type(6 + 3 * m);
            NODE_VALIDATION_CHECK(this, sc == ov::element::f16 || sc == ov::element::f32, "scales must be f16 or f32");
            for (size_t j = 0; j < 3; ++j)
                NODE_VALIDATION_CHECK(this, get_input_partial_shape(4 + 3 * m + j).is_static(), "expert tensors must be static");
            const auto ws = get_input_shape(4 + 3 * m);
            NODE_VALIDATION_CHECK(this, ws.size() == 4 && (m_nibbles || ws[3] % 2 == 0),
                                  "expert weights must be [E, O, G, g], g even (or [E, O, G, g / 2] bytes with nibbles)");
            const ov::Shape group_shape{ws[0], ws[1], ws[2], 1};
            NODE_VALIDATION_CHECK(this, get_input_shape(5 + 3 * m) == group_shape && get_input_shape(6 + 3 * m) == group_shape,
                                  "zero points and scales must be [E, O, G, 1]");
        }
        const auto g = get_input_shape(4), u = get_input_shape(7), d = get_input_shape(10);
        const size_t per_byte = per_element();
        NODE_VALIDATION_CHECK(this, g == u, "gate and up must have one shape");
        NODE_VALIDATION_CHECK(this, d[0] == g[0] && d[2] * d[3] * per_byte == g[1], "down's inputs must be gate's outputs");
        const auto& x = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, x.rank().is_static() && x.rank().get_length() == 2, "x must be [T, H]");
        NODE_VALIDATION_CHECK(this, x[1].compatible(static_cast<int64_t>(g[2] * g[3] * per_byte)) && x[1].compatible(static_cast<int64_t>(d[1])),
                              "x's width must be the experts' input and output width");
        if (get_input_size() == kShared)
            validate_shared(d[1]);
        set_output_type(0, ov::element::f32, x);
    }

    // The shared expert's inputs (13-24): four dense matrices [O, G, g] on Q16Linear's products.
    void validate_shared(size_t H) {
        size_t out[4], in[4];
        for (size_t m = 0; m < 4; ++m) {
            const size_t at = kRouted + 3 * m;
            for (size_t j = 0; j < 3; ++j)
                NODE_VALIDATION_CHECK(this, get_input_partial_shape(at + j).is_static(), "shared expert tensors must be static");
            const auto wt = get_input_element_type(at), zt = get_input_element_type(at + 1), st = get_input_element_type(at + 2);
            NODE_VALIDATION_CHECK(this, (wt == ov::element::u4 || wt == ov::element::u8) && (zt == ov::element::u4 || zt == ov::element::u8),
                                  "shared expert weights and zero points must be u4 (or u8)");
            NODE_VALIDATION_CHECK(this, !m_nibbles || wt == ov::element::u8, "with nibbles, the shared expert's weights are u8 bytes");
            NODE_VALIDATION_CHECK(this, st == ov::element::f16 || st == ov::element::f32, "shared expert scales must be f16 or f32");
            const auto ws = get_input_shape(at);
            NODE_VALIDATION_CHECK(this, ws.size() == 3, "shared expert weights must be [O, G, g]");
            const size_t group = ws[2] * (m_nibbles ? 2 : 1);
            NODE_VALIDATION_CHECK(this, group % q16::kBlock == 0, "the shared expert's groups must be multiples of 128 inputs");
            const ov::Shape group_shape{ws[0], ws[1], 1};
            NODE_VALIDATION_CHECK(this, get_input_shape(at + 1) == group_shape && get_input_shape(at + 2) == group_shape,
                                  "shared expert zero points and scales must be [O, G, 1]");
            out[m] = ws[0];
            in[m] = ws[1] * group;
            NODE_VALIDATION_CHECK(this, !(m_nibbles || wt == ov::element::u4) || in[m] <= q16::kMaxInputs,
                                  "u4 weights take at most 32768 inputs per row");
        }
        NODE_VALIDATION_CHECK(this, out[0] == 1 && in[0] == H, "the shared expert's gate is one row over x");
        NODE_VALIDATION_CHECK(this, get_input_shape(kRouted + 3) == get_input_shape(kRouted + 6) && in[1] == H,
                              "the shared expert's gate and up must have one shape, over x");
        NODE_VALIDATION_CHECK(this, out[3] == H && in[3] == out[1], "the shared expert's down must map its width back to x's");
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<U4Experts>(args, m_q16_rows, m_nibbles, m_bf16, m_residual, m_int8);
    }

    // q16_rows: when the op has at most this many rows (decode), experts with one or two rows
    // take the integer products of Q16Linear (q16_linear.hpp) instead of `direct`'s f32
    // ones; 0 (the default): never.
    // nibbles: the weights are u8 tensors [E, O, G, g / 2] holding the packed u4 values (two per
    // byte, the first in the low nibble). The CPU plugin widens a u4 constant that feeds none of
    // its own decompression patterns to u8 (twice the bytes to read in decode); the same bytes
    // typed u8 reach the op as they are.
    // bf16: the tiles (experts with more than kDirect rows) take bf16 dot products
    // (u4_experts_bf16.hpp) where the CPU has AVX512-BF16, else the f32 tiles: for a model the
    // plugin runs in bf16, whose activations are bf16 values already.
    // residual: false rounds the q16 rows' activations (x and the act rows) to their int16 term
    // alone (`q16::Row`: within 2^-16 of a block's largest magnitude), a third fewer products.
    // int8: with bf16, the lane form's tiles (experts of at least 16 rows, and of 11-15) take int8
    // activations per 32 inputs and vpdpbusd products (u4_experts_int8.hpp) where the CPU has
    // AVX512-VNNI and no AMX: for a model whose plugin quantizes its own compressed matmuls'
    // activations that way (its dynamic quantization).
    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("q16_rows", m_q16_rows);
        visitor.on_attribute("nibbles", m_nibbles);
        visitor.on_attribute("bf16", m_bf16);
        visitor.on_attribute("residual", m_residual);
        visitor.on_attribute("int8", m_int8);
        return true;
    }
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
                       m_nibbles || inputs[4 + 3 * m].get_element_type() == ov::element::u4,
                       inputs[5 + 3 * m].get_element_type() == ov::element::u4, inputs[6 + 3 * m].data(),
                       inputs[6 + 3 * m].get_element_type() == ov::element::f16, ws[1], ws[2], ws[3] * per_element()};
        }
        const Packed& gate = mats[0];
        const Packed& up = mats[1];
        const Packed& down = mats[2];
        // the f32 tiles in the split input order (all three matrices, or none: act rows are down's inputs)
        const bool split = splits(gate) && splits(up) && splits(down);
        const size_t E = inputs[4].get_shape()[0];
        const size_t I = gate.out;
        // the shared expert (decode_shared_expert): its gate row, gate, up and down as Q16Linear weights
        const bool shared = inputs.size() == kShared;
        q16::Weights sw[4] = {};
        if (shared)
            for (size_t m = 0; m < 4; ++m) {
                const ov::Tensor &w = inputs[kRouted + 3 * m], &z = inputs[kRouted + 3 * m + 1], &s = inputs[kRouted + 3 * m + 2];
                const auto ws = w.get_shape();
                sw[m] = {static_cast<const uint8_t*>(w.data()), static_cast<const uint8_t*>(z.data()), s.data(),
                         m_nibbles || w.get_element_type() == ov::element::u4, z.get_element_type() == ov::element::u4,
                         s.get_element_type() == ov::element::f16, ws[0], ws[1] * ws[2] * per_element(), ws[2] * per_element()};
            }
        const size_t Is = shared ? sw[1].N : 0;

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
        // decode rows with q16_rows: the one- and two-row experts' products on two-term integer activations
        const bool use_q16 = m_q16_rows > 0 && T - skip <= static_cast<size_t>(m_q16_rows) && gate.w4 == up.w4 &&
                             gate.group % q16::kBlock == 0 && down.group % q16::kBlock == 0 &&
                             H <= q16::kMaxInputs && I <= q16::kMaxInputs;
        const auto view = [](const Packed& m, size_t E_) {
            return q16::Weights{m.w, m.z, m.s, m.w4, m.z4, m.s16, E_ * m.out, m.in(), m.group};
        };
        const q16::Weights qgate = view(gate, E), qup = view(up, E), qdown = view(down, E);
        // the rounded rows, the calling thread's kept between calls (`q16::held_rows`), each sized
        // to this call (the loops below count on it): x's and the act rows, routed and shared
        std::vector<q16::Row>& xq = q16::held_rows<1>();
        std::vector<q16::Row>& aq = q16::held_rows<2>();
        xq.resize(use_q16 ? T - skip : 0);
        aq.resize(use_q16 ? ids.size() : 0);
        for (size_t t = 0; t < xq.size(); ++t)
            q16::quantize(xp + (skip + t) * H, H, gate.group, gate.w4, xq[t], m_residual);
        // the shared expert's rows: x for its gate row and for gate and up, its act rows for down,
        // and each row's sigmoid gate
        std::vector<q16::Row>& sx = q16::held_rows<3>();
        std::vector<q16::Row>& sa = q16::held_rows<4>();
        sx.resize(shared ? T - skip : 0);
        sa.resize(sx.size());
        std::vector<float> sgate(sx.size()), sact(sx.size() * Is);
        const bool same_rounding = sw[0].group == sw[1].group && sw[0].w4 == sw[1].w4;  // gate row and gate alike
        for (size_t t = 0; t < sx.size(); ++t) {
            q16::quantize(xp + (skip + t) * H, H, sw[1].group, sw[1].w4, sx[t], m_residual);
            q16::Row xg;
            if (!same_rounding)
                q16::quantize(xp + (skip + t) * H, H, sw[0].group, sw[0].w4, xg, m_residual);
            float v = 0.0f;
            q16::dot(sw[0], 0, 1, same_rounding ? sx[t] : xg, &v);
            sgate[t] = 1.0f / (1.0f + std::exp(-v));
        }
        // bf16 tiles: the act columns of the tiled experts also as input pairs for down
        const bool bf = m_bf16 && bf16::supported() && H % 2 == 0 && I % 2 == 0 && gate.group % 2 == 0 && down.group % 2 == 0 &&
                        kGateRows % 2 == 0;
        // int8 tiles for the lane form (`int8`): whole activation groups in x, in the act rows and
        // in each weight group and stage-1 task; not with AMX tiles (their bf16 products are faster)
        const bool i8 = bf && m_int8 && int8::supported() && !amx::supported() && H % int8::kGroup == 0 &&
                        I % int8::kGroup == 0 && gate.group % int8::kGroup == 0 && down.group % int8::kGroup == 0 &&
                        kGateRows % int8::kGroup == 0;
        // act, per present expert: [I, m rounded up to 8] (token columns, as stage 2 reads them;
        // bf16 tiles: to 16, whole zmm vectors), or [m, I] rows for an expert with at most kDirect
        // rows (taken by `direct`). bf16 vector tiles: an expert with at most kDotTokens rows takes the
        // dot form instead of one padded vector (`lanes` columns, then `rem` dot-form tokens).
        const size_t pad = bf ? 16 : 8;
        // On AMX tiles a padded vector of 16 tokens costs one tile product per 16 rows x 32
        // inputs whatever it holds, so a few-token expert takes the lane form there too (in both
        // stages: both groups must suit the tiles) instead of the vector dot products.
        const size_t dot_tokens = bf && amx::fits(gate.group) && amx::fits(down.group) ? 0 : bf16::kDotTokens;
        std::vector<size_t> aoff(E + 1, 0), ld(E, 0), lanes(E, 0), rem(E, 0), roff(E + 1, 0);
        std::vector<char> q8(E, 0);  // experts on the int8 tiles
        for (size_t e = 0; e < E; ++e) {
            const size_t m = start[e + 1] - start[e];
            if (m > kDirect) {
                // the tokens past whole vectors in the dot form when at most kDotTail (f32 tiles;
                // splits' tiles: inputs in multiples of 16, whole dot vectors) or dot_tokens (bf16
                // tiles: an expert of fewer tokens than a vector takes the dot form alone)
                // (int8 tiles: no dot-form tail, which would need a bf16 tile of the same rows too;
                // columns padded to int8::kPad instead, a last vector of 8 tokens in a ymm; an
                // expert of at most int8::row_tokens() tokens takes the int8 row form instead of
                // the dot form)
                const bool few8 = i8 && m <= int8::row_tokens();
                const bool dot = bf ? m % pad <= dot_tokens && (!i8 || m < pad) && !few8 : split && m % pad <= kDotTail;
                q8[e] = i8 && !dot;
                rem[e] = dot ? m % pad : 0;
                lanes[e] = dot ? m - rem[e] : q8[e] ? int8::padded(m) : (m + pad - 1) / pad * pad;
                ld[e] = lanes[e] + rem[e];
            }
            aoff[e + 1] = aoff[e] + I * (m > kDirect ? ld[e] : m);
            roff[e + 1] = roff[e] + rem[e];
        }
        // bf16 tiles: an expert whose tokens all take the dot form (at most kDotTokens) takes the
        // fused form instead, no tile, in a stage whose matrices suit it; its inputs there are rows
        // in the fused order. The op alone, E = 256: 129 / 257 tokens 61 / 81 -> 47 / 68 ms;
        // experts of up to 16 or 24 tokens in two or three fused passes were slower than their
        // tiles (docs/perf-log.md, session 30).
        const bool fuse1 = bf && bf16::fuses(gate) && bf16::fuses(up) && H % bf16::kFuseBlock == 0;
        const bool fuse2 = bf && bf16::fuses(down) && I % bf16::kFuseBlock == 0 && kGateRows % bf16::kFuseBlock == 0;
        const auto fused = [&](bool stage, size_t e) { return stage && lanes[e] == 0 && rem[e] > 0; };
        // Kept between calls (`Scratch`): a prefill chunk's act is T x k x I floats (64 MB at 4096
        // tokens), which as a fresh vector per call was a fresh mmap faulted in page by page.
        // Every element a call reads it has written first (tests/test_native.py, poisoned).
        Scratch<float> act_buffer(aoff[E]);
        Scratch<uint32_t> act2_buffer(bf ? aoff[E] / 2 : 0);
        Scratch<uint16_t> actr_buffer(bf ? roff[E] * I : 0);
        Scratch<float> actf_buffer(bf ? 0 : roff[E] * I);  // f32: the dot-form tokens' act rows
        float* actf = actf_buffer.data();
        float* act = act_buffer.data();
        uint32_t* act2 = act2_buffer.data();
        uint16_t* actr = actr_buffer.data();  // the dot-form tokens' act rows, bf16, token-major
        const size_t ldmax = *std::max_element(ld.begin(), ld.end());
        // int8 tiles: x's rows as int8 (with their scales per kGroup and sums per weight group),
        // the act columns likewise per expert (P: each kGroup's scaled sum, S: per down group)
        const bool any8 = std::any_of(q8.begin(), q8.end(), [](char c) { return c != 0; });
        int8::QuantizedRows x8(xp + skip * H, any8 ? T - skip : 0, H, gate.group);
        Scratch<int32_t> act8_buffer(any8 ? aoff[E] / 4 : 0);
        Scratch<float> asa_buffer(any8 ? aoff[E] / int8::kGroup : 0), aP_buffer(any8 ? aoff[E] / int8::kGroup : 0);
        Scratch<float> aS_buffer(any8 ? aoff[E] / down.group : 0);
        int32_t* act8 = act8_buffer.data();
        float* asa = asa_buffer.data();
        float* aP = aP_buffer.data();
        float* aS = aS_buffer.data();

        // stage 1: act = silu(x . gate^T) * (x . up^T), per (expert, kGateRows rows)
        // (then the shared expert's rows, kGateRows a task, after the routed experts' tasks)
        const size_t tiles = (I + kGateRows - 1) / kGateRows, routed = present.size() * tiles;
        const size_t shared_tasks = (Is + kGateRows - 1) / kGateRows;
        static std::atomic<uint64_t> calls{0};
        const uint64_t call = ++calls;  // names this call's bf16 token columns in a thread's cache
        tbb::parallel_for(tbb::blocked_range<size_t>(0, routed + shared_tasks), [&](const tbb::blocked_range<size_t>& r) {
            thread_local std::vector<float> tile, g, u, zero, scales, dacc;
            thread_local AlignedVector<float> xT;  // AMX tiles load from it and from tile16
            thread_local AlignedVector<uint16_t> tile16;
            thread_local std::vector<uint16_t> xb, xf;  // xf: a row in the natural order, before fuse_row
            thread_local std::vector<float> xs;
            thread_local std::vector<const float*> rows;
            thread_local int8::Tile tile8;
            thread_local std::vector<float> esa, eS;
            // the expert whose token columns xT (and xb, bf16) hold (the same call): its other row
            // tasks, which a thread mostly takes next, reuse them (measured: the rounding and
            // the transpose were ~20% of the op at 1024 tokens with AMX tiles; the f32 transpose
            // ~1% with the f32 tiles on AVX2)
            thread_local uint64_t held_call = 0;
            thread_local size_t held_expert = 0;
            const uint16_t* xr[bf16::kDotTokens];
            zero.assign(H, 0.0f);
            if (bf) {
                const size_t ks = std::max(bf16::slice_of(gate), bf16::slice_of(up));
                tile16.resize(kGateRows * ks);
                scales.resize(kGateRows * ks / std::min(gate.group, up.group));
                dacc.resize(kGateRows * bf16::kDotTokens * 16);
                if (any8)
                    tile8.fit(gate, kGateRows);  // up's: one shape
            } else {
                tile.resize(kGateRows * std::max(slice_of(gate, 4), slice_of(up, 4)));
            }
            const auto prefetch_task = [&](size_t task) {
                if (task >= routed)
                    return;
                const size_t e = present[task / tiles], r0 = (task % tiles) * kGateRows, nr = std::min(kGateRows, I - r0);
                prefetch_slice(gate, e, r0, nr);
                prefetch_slice(up, e, r0, nr);
            };
            prefetch_task(r.begin());
            for (size_t task = r.begin(); task != r.end(); ++task) {
                if (task >= routed) {  // rows r0 .. r0 + nr of the shared expert's gate and up, every row of x
                    const size_t r0 = (task - routed) * kGateRows, nr = std::min(kGateRows, Is - r0);
                    g.resize(kGateRows);
                    u.resize(kGateRows);
                    for (size_t t = 0; t < sx.size(); ++t) {
                        q16::dot(sw[1], r0, nr, sx[t], g.data());
                        q16::dot(sw[2], r0, nr, sx[t], u.data());
                        vexp::silu_mul(g.data(), u.data(), nr, sact.data() + t * Is + r0);
                    }
                    continue;
                }
                const size_t e = present[task / tiles], r0 = (task % tiles) * kGateRows, nr = std::min(kGateRows, I - r0);
                const size_t b = start[e], m = start[e + 1] - b;
                if (task + 1 != r.end())
                    prefetch_task(task + 1);
                rows.resize(m);
                for (size_t i = 0; i < m; ++i)
                    rows[i] = xp + token[b + i] * H;
                float* a = act + aoff[e];
                if (m <= kDirect) {
                    g.resize(kGateRows);
                    u.resize(kGateRows);
                    for (size_t i = 0; i < m; ++i) {
                        if (use_q16) {
                            const q16::Row& r = xq[token[b + i] - skip];
                            q16::dot(qgate, e * I + r0, nr, r, g.data());
                            q16::dot(qup, e * I + r0, nr, r, u.data());
                        } else {
                            direct(gate, e, r0, nr, rows[i], g.data());
                            direct(up, e, r0, nr, rows[i], u.data());
                        }
                        vexp::silu_mul(g.data(), u.data(), nr, a + i * I + r0);
                    }
                    continue;
                }
                const size_t n = ld[e];
                g.resize(kGateRows * n);
                u.resize(kGateRows * n);
                if (q8[e]) {  // the rows as int8; four inputs are a 32-bit word, transposed like f32
                    const size_t nl = lanes[e];
                    if (held_call != call || held_expert != e) {
                        xT.resize(H / 4 * nl);
                        esa.resize(x8.gs * nl);
                        eS.resize(x8.gw * nl);
                        x8.columns(m, [&](size_t i) { return token[b + i] - skip; }, nl, xT.data(), esa.data(), eS.data());
                        held_call = call;
                        held_expert = e;
                    }
                    const auto* xq = reinterpret_cast<const int32_t*>(xT.data());
                    int8::products(gate, e, r0, nr, xq, esa.data(), eS.data(), nl, m, nl, tile8, g.data(), n);
                    int8::products(up, e, r0, nr, xq, esa.data(), eS.data(), nl, m, nl, tile8, u.data(), n);
                } else if (bf) {  // the rows as bf16; a row's input pairs are 32-bit words, transposed like f32
                    const size_t nl = lanes[e];  // lane-form columns; then rem[e] dot-form tokens
                    const bool f = fused(fuse1, e);
                    if (held_call != call || held_expert != e) {
                        xb.resize(m * H);
                        if (f)
                            xf.resize(H);
                        for (size_t i = 0; i < m; ++i) {
                            if (f) {
                                bf16::round_row(rows[i], H, xf.data());
                                bf16::fuse_row(xf.data(), H, xb.data() + i * H);
                            } else {
                                bf16::round_row(rows[i], H, xb.data() + i * H);
                            }
                            rows[i] = reinterpret_cast<const float*>(xb.data() + i * H);
                        }
                        xT.resize(H / 2 * nl);
                        if (nl > 0)
                            transpose_rows(rows.data(), std::min(m, nl), zero.data(), H / 2, xT.data(), nl);
                        held_call = call;
                        held_expert = e;
                    }
                    for (size_t j = 0; j < rem[e]; ++j)
                        xr[j] = xb.data() + (nl + j) * H;
                    const auto* xp = reinterpret_cast<const uint32_t*>(xT.data());
                    bf16::products(gate, e, r0, nr, xp, nl, nl / 16, xr, rem[e], dacc.data(), tile16.data(), scales.data(), g.data(), n, f);
                    bf16::products(up, e, r0, nr, xp, nl, nl / 16, xr, rem[e], dacc.data(), tile16.data(), scales.data(), u.data(), n, f);
                } else {
                    const size_t nl = lanes[e];  // lane-form columns; then rem[e] dot-form tokens
                    if (held_call != call || held_expert != e) {  // as for bf16: the expert's other row tasks reuse it
                        xT.resize(H * nl);
                        transpose_rows(rows.data(), std::min(m, nl), zero.data(), H, xT.data(), nl, split);
                        xs.resize(rem[e] * H);  // the dot-form tokens' rows in the tiles' input order
                        for (size_t j = 0; j < rem[e]; ++j)
                            for (size_t k = 0; k < H; ++k)
                                xs[j * H + split_index(k)] = rows[nl + j][k];
                        held_call = call;
                        held_expert = e;
                    }
                    const float* xd[kDotTail];
                    for (size_t j = 0; j < rem[e]; ++j)
                        xd[j] = xs.data() + j * H;
                    products(gate, e, r0, nr, xT.data(), nl, nl / 8, tile.data(), g.data(), n, split, xd, rem[e]);
                    products(up, e, r0, nr, xT.data(), nl, nl / 8, tile.data(), u.data(), n, split, xd, rem[e]);
                }
                for (size_t c = 0; c < nr; ++c) {
                    float* ac = a + (split && !bf ? split_index(r0 + c) : r0 + c) * n;  // down's input order
                    vexp::silu_mul(g.data() + c * n, u.data() + c * n, n, ac);  // padded columns: silu(0) * 0 = 0
                }
                if (q8[e]) {  // rows r0 .. r0 + nr of act as int8 columns (whole kGroups: r0 and nr multiples of it)
                    const size_t at = aoff[e] + r0 * n;
                    int8::quantize_columns(a + r0 * n, nr, n, lanes[e], act8 + at / 4, asa + at / int8::kGroup, aP + at / int8::kGroup);
                } else if (bf) {  // rows r0 .. r0 + nr of act as input pairs (r0 and nr even), the dot-form tokens' as rows
                    bf16::pair_columns(a + r0 * n, nr, n, lanes[e], act2 + (aoff[e] + r0 * n) / 2);
                    if (rem[e] > 0)
                        bf16::rows_of_columns(a + r0 * n + lanes[e], nr, n, rem[e], actr + roff[e] * I + r0, I, fused(fuse2, e));
                }
            }
        });

        if (!bf)  // the f32 dot-form tokens' act rows (columns lanes[e] .. of act), for down
            for (size_t e : present)
                for (size_t j = 0; j < rem[e]; ++j)
                    for (size_t i = 0; i < I; ++i)
                        actf[(roff[e] + j) * I + i] = act[aoff[e] + i * ld[e] + lanes[e] + j];

        for (size_t e : present)  // int8 tiles: the act columns' sums per down group
            if (q8[e])
                int8::sum_groups(aP + aoff[e] / int8::kGroup, I, down.group, ld[e], lanes[e], aS + aoff[e] / down.group);

        for (size_t t = 0; t < sx.size(); ++t)  // the shared expert's act rows, rounded for its down
            q16::quantize(sact.data() + t * Is, Is, sw[3].group, sw[3].w4, sa[t], m_residual);
        if (use_q16)  // the direct experts' act rows, rounded for down
            for (size_t e : present)
                if (start[e + 1] - start[e] <= kDirect)
                    for (size_t i = 0; i < start[e + 1] - start[e]; ++i)
                        q16::quantize(act + aoff[e] + i * I, I, down.group, down.w4, aq[start[e] + i], m_residual);

        // stage 2 in decode (every present expert of at most kDirect rows, on the q16 products): a task
        // per (row of a present expert, or of the shared expert; kDecodeColumns output columns), so
        // each task reads its rows of down front to back, one stream of kDecodeColumns x I / 2 bytes,
        // instead of a kDownRows slice of every expert in turn. The rows' outputs are kept apart and
        // summed after, per column in the order below (the present experts in order, each one's
        // rows, then the shared expert): the same sums. Measured (dev-bench, 1024): this stage
        // 180 -> 154 us a call (docs/perf-log.md, session 53).
        if (use_q16 && std::all_of(present.begin(), present.end(), [&](size_t e) { return start[e + 1] - start[e] <= kDirect; })) {
            const size_t units = ids.size() + sx.size(), cols = std::min(H, kDecodeColumns);
            const size_t blocks = (H + cols - 1) / cols;
            std::vector<size_t> unit_expert(ids.size());  // the expert of each (row, slot) pair, in bucket order
            for (size_t e : present)
                std::fill(unit_expert.begin() + start[e], unit_expert.begin() + start[e + 1], e);
            std::vector<float>& held = decode_outputs();  // the calling thread's; the tasks get its data
            held.resize(units * H);
            float* const outs = held.data();
            tbb::parallel_for(tbb::blocked_range<size_t>(0, units * blocks), [&](const tbb::blocked_range<size_t>& r) {
                for (size_t task = r.begin(); task != r.end(); ++task) {
                    const size_t u = task / blocks, c0 = (task % blocks) * cols, nc = std::min(cols, H - c0);
                    if (u < ids.size())
                        q16::dot(qdown, unit_expert[u] * H + c0, nc, aq[u], outs + u * H + c0);
                    else
                        q16::dot(sw[3], c0, nc, sa[u - ids.size()], outs + u * H + c0);
                }
            });
            for (size_t e : present)
                for (size_t k = start[e]; k < start[e + 1]; ++k) {
                    float* dst = y + token[k] * H;
                    const float* o = outs + k * H;
                    for (size_t c = 0; c < H; ++c)
                        dst[c] += route[k] * o[c];
                }
            for (size_t t = 0; t < sx.size(); ++t) {
                float* dst = y + (skip + t) * H;
                const float* o = outs + (ids.size() + t) * H;
                for (size_t c = 0; c < H; ++c)
                    dst[c] += sgate[t] * o[c];
            }
            return true;
        }

        // stage 2: y[t, cols] += route * act . down^T, per kDownRows output columns
        tbb::parallel_for(tbb::blocked_range<size_t>(0, (H + kDownRows - 1) / kDownRows), [&](const tbb::blocked_range<size_t>& r) {
            thread_local std::vector<float> tile, out, scales, dacc;
            thread_local AlignedVector<uint16_t> tile16;
            thread_local int8::Tile tile8;
            const uint16_t* xr[bf16::kDotTokens];
            if (bf) {
                tile16.resize(kDownRows * bf16::slice_of(down));
                scales.resize(kDownRows * bf16::slice_of(down) / down.group);
                dacc.resize(kDownRows * bf16::kDotTokens * 16);
                if (any8)
                    tile8.fit(down, kDownRows);
            } else {
                tile.resize(kDownRows * slice_of(down, 4));
            }
            out.resize(kDownRows * std::max(ldmax, kDirect));
            for (size_t task = r.begin(); task != r.end(); ++task) {
                const size_t c0 = task * kDownRows, nc = std::min(kDownRows, H - c0);
                if (!present.empty())
                    prefetch_slice(down, present[0], c0, nc);
                for (size_t pi = 0; pi < present.size(); ++pi) {
                    const size_t e = present[pi], b = start[e], m = start[e + 1] - b;
                    if (pi + 1 < present.size())
                        prefetch_slice(down, present[pi + 1], c0, nc);
                    const float* a = act + aoff[e];
                    if (m <= kDirect) {
                        for (size_t i = 0; i < m; ++i) {
                            if (use_q16)
                                q16::dot(qdown, e * H + c0, nc, aq[b + i], out.data());
                            else
                                direct(down, e, c0, nc, a + i * I, out.data());
                            float* dst = y + token[b + i] * H + c0;
                            const float w = route[b + i];
                            for (size_t c = 0; c < nc; ++c)
                                dst[c] += w * out[c];
                        }
                        continue;
                    }
                    const size_t n = ld[e];
                    if (q8[e]) {
                        int8::products(down, e, c0, nc, act8 + aoff[e] / 4, asa + aoff[e] / int8::kGroup, aS + aoff[e] / down.group, n,
                                       m, lanes[e], tile8, out.data(), n);
                    } else if (bf) {
                        for (size_t j = 0; j < rem[e]; ++j)
                            xr[j] = actr + (roff[e] + j) * I;
                        bf16::products(down, e, c0, nc, act2 + aoff[e] / 2, n, lanes[e] / 16, xr, rem[e], dacc.data(),
                                       tile16.data(), scales.data(), out.data(), n, fused(fuse2, e));
                    } else {
                        const float* xd[kDotTail];
                        for (size_t j = 0; j < rem[e]; ++j)
                            xd[j] = actf + (roff[e] + j) * I;
                        products(down, e, c0, nc, a, n, lanes[e] / 8, tile.data(), out.data(), n, split, xd, rem[e]);
                    }
                    for (size_t i = 0; i < m; ++i) {
                        float* dst = y + token[b + i] * H + c0;
                        const float w = route[b + i];
                        for (size_t c = 0; c < nc; ++c)
                            dst[c] += w * out[c * n + i];
                    }
                }
                for (size_t t = 0; t < sx.size(); ++t) {  // the shared expert, after the routed experts' sum
                    q16::dot(sw[3], c0, nc, sa[t], out.data());
                    float* dst = y + (skip + t) * H + c0;
                    for (size_t c = 0; c < nc; ++c)
                        dst[c] += sgate[t] * out[c];
                }
            }
        });
        return true;
    }

private:
    size_t per_element() const { return m_nibbles ? 2 : 1; }  // weight values per element of w

    // Stage 2's decode outputs, a row of H per (row, slot) pair and shared row: the calling
    // thread's, kept between calls (a thread_local named inside a task would be the worker's own).
    static std::vector<float>& decode_outputs() {
        thread_local std::vector<float> outs;
        return outs;
    }

    int64_t m_q16_rows = 0;
    bool m_nibbles = false;
    bool m_bf16 = false;
    bool m_residual = true;
    bool m_int8 = false;
};

}  // namespace iq36
