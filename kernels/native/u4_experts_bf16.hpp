// U4Experts' tile products on bf16 dot products (AVX512-BF16 `vdpbf16ps`), for a compiled model
// whose CPU plugin runs in bf16 (the `bf16` attribute; kernels/native_experts.py).
//
// What changes against the f32 tiles (u4_experts.hpp): a tile holds (q - z) as bf16 -- small
// integers, exact -- and the group's scale is applied to each group's sum, so every weight
// product is exact in f32 and the sums are f32 as before. The activations are rounded to bf16:
// the block's input is the output of the plugin's own bf16 nodes (exact already), the act
// columns between gate/up and down are rounded once, as the plugin's own bf16 kernels round
// every activation. One zmm `vdpbf16ps` takes two inputs of 16 tokens: four times the
// multiply-adds of a ymm f32 FMA per instruction. An expert's token columns are padded to a
// multiple of 16 (zero columns, sliced off by the caller).
//
// Layout: the token columns of a pair of inputs (k, k + 1) are one 32-bit lane per token
// (bf16(x[t][k]) low, bf16(x[t][k + 1]) high); a weight pair is broadcast to every lane.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "u4_experts_amx.hpp"

// Included by u4_experts.hpp after its `experts` helpers (Packed, value, slice_of, token_blocks).

#define IQ36_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace iq36 {
namespace experts {
namespace bf16 {

inline bool supported() {
    static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    return yes;
}

// bf16(q - z) for q < 16, twice (32 words), for every zero point z < 256 (u8 zero points): small
// integers, exact in bf16. The tiles' 64-weight step and the fused form look them up.
struct ZeroTables {
    alignas(64) uint16_t t[256][32];
    ZeroTables() {
        for (int z = 0; z < 256; ++z)
            for (int i = 0; i < 32; ++i) {
                const float f = static_cast<float>(i % 16 - z);
                uint32_t bits;
                std::memcpy(&bits, &f, 4);
                t[z][i] = static_cast<uint16_t>(bits >> 16);
            }
    }
};

inline const ZeroTables& zero_tables() {
    static const ZeroTables tables;
    return tables;
}

// Rows [r0, r0 + n) of expert e, inputs [k0, k0 + kn) (whole groups): (q - z) as bf16 into w
// (n x kn) and the scales into s (n x kn / group).
IQ36_BF16 inline void decompress(const Packed& m, size_t e, size_t r0, size_t n, size_t k0, size_t kn, uint16_t* w, float* s) {
    const __m128i low = _mm_set1_epi16(0x000F);
    // m's fields as locals: the stores below (may-alias vector types) would otherwise make the
    // compiler reload them from m at every step
    const size_t group = m.group, groups = m.groups;
    const size_t g0 = k0 / group, g1 = (k0 + kn) / group, gn = g1 - g0;
    const ZeroTables& tables = zero_tables();
    for (size_t r = 0; r < n; ++r) {
        const size_t row = e * m.out + r0 + r;
        uint16_t* out = w + r * kn;
        for (size_t g = g0; g < g1; ++g) {
            const size_t gi = row * groups + g;
            s[r * gn + g - g0] = m.scale(gi);
            const int z = value(m.z, gi, m.z4);
            const __m512i zv = _mm512_set1_epi32(z);
            uint16_t* o = out + (g - g0) * group;
            size_t j = 0;
            if (m.w4) {
                const uint8_t* src = m.w + (gi * group >> 1);
                // the same row's next slice (the row's bytes are contiguous, a slice is a few
                // of its lines): the weights otherwise arrive one demand miss at a time
                for (size_t line = 0; line < group / 2; line += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(src + kn / 2 + line), _MM_HINT_T0);
                // the nibbles as words index a table of bf16(q - z), q < 16 (vpermw reads an index's
                // low 5 bits: the table twice, so a whole byte indexes its low nibble's entry)
                const __m512i table = _mm512_load_si512(tables.t[z]);
                const __m128i nib = _mm_set1_epi8(0x0F);
                // 64 weights per step: 32 bytes as words, each looked up twice (low nibble, high
                // nibble), the two interleaved (word 2i from the low nibbles' i, 2i + 1 from the
                // high ones'): 5 shuffles per 64 weights, where the 32-weight step below takes 5
                // per 32. The same words as that step gives (tests/test_native.py).
                const __m512i even = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
                const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(16));
                for (; j + 64 <= group; j += 64) {
                    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j / 2)));
                    const __m512i lo = _mm512_permutexvar_epi16(b, table);
                    const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
                    _mm512_storeu_si512(o + j, _mm512_permutex2var_epi16(lo, even, hi));
                    _mm512_storeu_si512(o + j + 32, _mm512_permutex2var_epi16(lo, odd, hi));
                }
                for (; j + 32 <= group; j += 32) {
                    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j / 2));
                    const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
                    const __m256i q = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
                    _mm512_storeu_si512(o + j, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table));
                }
                for (; j + 16 <= group; j += 16) {
                    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j / 2)));
                    const __m128i v = _mm_or_si128(_mm_and_si128(b, low), _mm_slli_epi16(_mm_srli_epi16(b, 4), 8));
                    const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(v), zv));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
                }
            } else {
                const uint8_t* src = m.w + gi * group;
                for (; j + 16 <= group; j += 16) {
                    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
                    const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(b), zv));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
                }
            }
            for (; j < group; ++j) {
                const float f = static_cast<float>(static_cast<int>(value(m.w, gi * group + j, m.w4)) - z);
                uint32_t bits;
                std::memcpy(&bits, &f, 4);
                o[j] = static_cast<uint16_t>(bits >> 16);  // a small integer: exact
            }
        }
    }
}

// o[c][v * 16 ..] (+)= sum over groups of s[c][g] * sum_{k in g} w[c][k] * x[k][v * 16 ..], for C
// weight rows (ldw apart) and V vectors of 16 tokens; xp holds input pairs (ldx lanes apart).
// Per group its own accumulators (the scale applies to the group's sum): 2 C V + V + 1 of the
// 32 registers AVX-512 gives. zmm vectors: a Zen 5 core runs vdpbf16ps at the same rate in
// either width (7.8 G/s), so 16 tokens per instruction do twice the multiply-adds of 8; each
// token's lane sums its products in the same order at any width (the same bits as 8-token
// vectors gave).
template <int C, int V>
IQ36_BF16 inline void kernel(const uint16_t* w, size_t ldw, const float* s, size_t lds, size_t group, const uint32_t* xp,
                             size_t ldx, size_t kn, float* o, size_t ldo, bool add) {
    __m512 acc[C][V];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v)
            acc[c][v] = _mm512_setzero_ps();
    for (size_t g0 = 0; g0 < kn; g0 += group) {
        __m512 ga[C][V];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v)
                ga[c][v] = _mm512_setzero_ps();
        for (size_t k = g0; k < g0 + group; k += 2) {
            __m512bh xv[V];
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v)
                xv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xp + (k / 2) * ldx + v * 16));
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                int32_t pair;
                std::memcpy(&pair, w + c * ldw + k, 4);
                const __m512bh wb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 8
                for (int v = 0; v < V; ++v)
                    ga[c][v] = _mm512_dpbf16_ps(ga[c][v], wb, xv[v]);
            }
        }
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const __m512 sc = _mm512_set1_ps(s[c * lds + g0 / group]);
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v)
                acc[c][v] = _mm512_fmadd_ps(ga[c][v], sc, acc[c][v]);
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) {
            float* dst = o + c * ldo + v * 16;
            _mm512_storeu_ps(dst, add ? _mm512_add_ps(_mm512_loadu_ps(dst), acc[c][v]) : acc[c][v]);
        }
}

template <int C, int V>
IQ36_BF16 inline void run(const uint16_t* w, const float* s, size_t gn, size_t group, size_t n, size_t kn, const uint32_t* xp,
                          size_t ldx, float* o, size_t ldo, bool add) {
    size_t c = 0;
    for (; c + C <= n; c += C)
        kernel<C, V>(w + c * kn, kn, s + c * gn, gn, group, xp, ldx, kn, o + c * ldo, ldo, add);
    for (; c < n; ++c)
        kernel<1, V>(w + c * kn, kn, s + c * gn, gn, group, xp, ldx, kn, o + c * ldo, ldo, add);
}

// o (n x vecs*16) (+)= the tile (n x kn, scales n x kn / group) . the pairs (kn / 2 x vecs*16).
IQ36_BF16 inline void gemm(const uint16_t* w, const float* s, size_t group, size_t n, size_t kn, const uint32_t* xp, size_t ldx,
                           size_t vecs, float* o, size_t ldo, bool add) {
    const size_t gn = kn / group;
    token_blocks(vecs, [&](auto c, auto vs, size_t v) {
        run<decltype(c)::value, decltype(vs)::value>(w, s, gn, group, n, kn, xp + v * 16, ldx, o + v * 16, ldo, add);
    });
}

// A few tokens (an expert with fewer than a vector of 16, which the lane form pads with zero
// columns) as dot products over the same row-major tile: per (weight row, token) one vector
// accumulator sums 16 input pairs per vdpbf16ps, the group's scale on the group's sum as in the
// lane form; the accumulators live in `acc` (row c, token t at (c * rem + t) * 16) across the
// slices and are reduced once at the end (`products`). Each product is exact as in the lane
// form; the f32 sums run in another order. x[t]: token t's inputs of this slice as bf16 words.
// Measured (the op alone, E = 256, 257 tokens: ~8 per expert): 92.8 -> 77.7-81.9 ms. Also the
// tail of a longer expert (its last m % 16 tokens, when at most kDotTokens): with whole-row
// tiles (`slice_of`) the op 4-8% faster at E = 64, 257-1024 tokens, and 6-15% at E = 256, 513
// and 1024 (docs/perf-log.md, session 29; with 256-input slices, session 11, it measured no
// better than the padded vector).
#ifndef IQ36_DOT_TOKENS
#define IQ36_DOT_TOKENS 10
#endif
constexpr size_t kDotTokens = IQ36_DOT_TOKENS;  // at most this many tokens past whole vectors take the dot form
static_assert(kDotTokens < 16, "the dot-form tokens are those past whole vectors of 16");

// tot[c][t] += ga[c][t] * scale(c): a group's sums (one vector per weight row and token) scaled
// by the row's scale for the group, into the totals.
template <int C, int R, class Scale>
IQ36_BF16 inline void add_scaled(__m512 (&tot)[C][R], const __m512 (&ga)[C][R], Scale scale) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
        const __m512 sc = _mm512_set1_ps(scale(c));
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t)
            tot[c][t] = _mm512_fmadd_ps(ga[c][t], sc, tot[c][t]);
    }
}

template <int C, int R>
IQ36_BF16 inline void dot_kernel(const uint16_t* w, size_t ldw, const float* s, size_t lds, size_t group, size_t kn,
                                 const uint16_t* const* x, float* acc, size_t lda, bool add) {
    __m512 tot[C][R];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int t = 0; t < R; ++t)
            tot[c][t] = add ? _mm512_loadu_ps(acc + c * lda + t * 16) : _mm512_setzero_ps();
    const size_t gp = group / 2;  // input pairs per group
    for (size_t g0 = 0; g0 < kn; g0 += group) {
        __m512 ga[C][R];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
            for (int t = 0; t < R; ++t)
                ga[c][t] = _mm512_setzero_ps();
        for (size_t q = 0; q < gp; q += 16) {
            const __mmask16 mk = q + 16 <= gp ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (gp - q)) - 1);
            __m512bh xv[R];
#pragma GCC unroll 8
            for (int t = 0; t < R; ++t)
                xv[t] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi32(mk, x[t] + g0 + 2 * q));
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi32(mk, w + c * ldw + g0 + 2 * q));
#pragma GCC unroll 8
                for (int t = 0; t < R; ++t)
                    ga[c][t] = _mm512_dpbf16_ps(ga[c][t], wv, xv[t]);
            }
        }
        add_scaled<C, R>(tot, ga, [&](int c) { return s[c * lds + g0 / group]; });
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int t = 0; t < R; ++t)
            _mm512_storeu_ps(acc + c * lda + t * 16, tot[c][t]);
}

template <int R>
IQ36_BF16 inline void dot_rows(const uint16_t* w, const float* s, size_t gn, size_t group, size_t n, size_t kn,
                               const uint16_t* const* x, float* acc, size_t lda, bool add) {
    size_t c = 0;
    for (; c + 4 <= n; c += 4)
        dot_kernel<4, R>(w + c * kn, kn, s + c * gn, gn, group, kn, x, acc + c * lda, lda, add);
    for (; c < n; ++c)
        dot_kernel<1, R>(w + c * kn, kn, s + c * gn, gn, group, kn, x, acc + c * lda, lda, add);
}

// acc (n rows x rem tokens x 16) (+)= the tile's rows dotted with the rem tokens' slices x.
IQ36_BF16 inline void dots(const uint16_t* w, const float* s, size_t group, size_t n, size_t kn, const uint16_t* const* x,
                           size_t rem, float* acc, bool add) {
    const size_t gn = kn / group, lda = rem * 16;
    for (size_t t = 0; t < rem;) {
        const size_t left = rem - t;
        if (left >= 3) {
            dot_rows<3>(w, s, gn, group, n, kn, x + t, acc + t * 16, lda, add);
            t += 3;
        } else if (left == 2) {
            dot_rows<2>(w, s, gn, group, n, kn, x + t, acc + t * 16, lda, add);
            t += 2;
        } else {
            dot_rows<1>(w, s, gn, group, n, kn, x + t, acc + t * 16, lda, add);
            t += 1;
        }
    }
}

// The dot form without a tile ("fused"), for an expert whose tokens all take the dot form: each
// weight row's packed bytes are widened in registers, 128 weights per 64-byte load, and multiplied
// at once with every token's inputs; nothing is stored and read back. Word w of a 64-byte load
// holds inputs 4w .. 4w + 3 of its 128 (a nibble each); vpermw reads an index's low 5 bits, so
// the word shifted by 0, 4, 8 and 12 bits looks up bf16(q - z) for inputs 4w, 4w + 1, 4w + 2 and
// 4w + 3 in a table held twice (a zmm of 32 words). The token rows come in the same order
// (`fused_index`: per 128 inputs, those at 4w first, then 4w + 1, ...), so each vdpbf16ps pairs
// the same weight and input as the tiles do; the products are exact and the group's scale applies
// to the group's sum, as in the dot form, with the f32 sums in another order.
// IQ36_FUSED_DOTS=0 keeps the tiles (the tests cover both forms that way).
constexpr size_t kFuseBlock = 128;  // inputs per 64-byte load

inline size_t fused_index(size_t k) {
    const size_t b = k % kFuseBlock;
    return k - b + (b % 4) * (kFuseBlock / 4) + b / 4;
}

inline bool fused_enabled() {
    static const bool on = [] {
        const char* env = std::getenv("IQ36_FUSED_DOTS");
        return !(env && env[0] == '0');
    }();
    return on;
}

// Whether m's rows suit the fused form: packed u4 in groups of whole 64-byte loads.
inline bool fuses(const Packed& m) { return fused_enabled() && m.w4 && m.group % kFuseBlock == 0; }

// o[c * ldo + t] = dot(row `row` + c, token t) for c < C, t < R; x[t]: token t's inputs (all K of
// them) in the fused order. Registers: 2 C R accumulators (each group's sums, and the scaled
// totals), C tables, C loads, C weight vectors and one input vector.
template <int C, int R>
IQ36_BF16 inline void fused_kernel(const Packed& m, size_t row, const uint16_t* const* x, float* o, size_t ldo) {
    const ZeroTables& zt = zero_tables();
    __m512 tot[C][R];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t)
            tot[c][t] = _mm512_setzero_ps();
    for (size_t g = 0; g < m.groups; ++g) {
        __m512 ga[C][R];
        __m512i tab[C];
        const uint8_t* src[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const size_t gi = (row + c) * m.groups + g;
            tab[c] = _mm512_load_si512(zt.t[value(m.z, gi, m.z4)]);
            src[c] = m.w + (gi * m.group >> 1);
#pragma GCC unroll 16
            for (int t = 0; t < R; ++t)
                ga[c][t] = _mm512_setzero_ps();
        }
        for (size_t k = 0; k < m.group; k += kFuseBlock) {
            __m512i v[C];
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
                v[c] = _mm512_loadu_si512(src[c] + k / 2);
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) {
                __m512bh w[C];
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c)
                    w[c] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(q == 0 ? v[c] : _mm512_srli_epi16(v[c], 4 * q), tab[c]));
                const size_t at = g * m.group + k + q * (kFuseBlock / 4);
#pragma GCC unroll 16
                for (int t = 0; t < R; ++t) {
                    const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x[t] + at));
#pragma GCC unroll 8
                    for (int c = 0; c < C; ++c)
                        ga[c][t] = _mm512_dpbf16_ps(ga[c][t], w[c], xv);
                }
            }
        }
        add_scaled<C, R>(tot, ga, [&](int c) { return m.scale((row + c) * m.groups + g); });
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t)
            o[c * ldo + t] = _mm512_reduce_add_ps(tot[c][t]);
}

template <int C, int R>
IQ36_BF16 inline void fused_rows(const Packed& m, size_t row, size_t n, const uint16_t* const* x, float* o, size_t ldo) {
    size_t c = 0;
    for (; c + C <= n; c += C)
        fused_kernel<C, R>(m, row + c, x, o + c * ldo, ldo);
    for (; c < n; ++c)
        fused_kernel<1, R>(m, row + c, x, o + c * ldo, ldo);
}

#ifndef IQ36_FUSED_PASS
#define IQ36_FUSED_PASS 5
#endif
// Tokens per pass over the weights: two rows per kernel share each input vector. Measured (the op
// alone, E = 256, 257 tokens): passes of up to 5 tokens, two rows, 64-68 ms; one pass of up to 10
// tokens, one row (the weights widened once, an input load per product), 75-82 (docs/perf-log.md,
// session 30).
constexpr size_t kFusedPass = IQ36_FUSED_PASS;
static_assert(kFusedPass >= 1 && kFusedPass <= 5, "fused_dots has kernels for 1 to 5 tokens");

// o[c][t] = dot(row r0 + c of expert e, token t), c < n, t < rem: the fused form, in passes of at
// most kFusedPass tokens of about equal size.
IQ36_BF16 inline void fused_dots(const Packed& m, size_t e, size_t r0, size_t n, const uint16_t* const* x, size_t rem, float* o,
                                 size_t ldo) {
    const size_t row = e * m.out + r0;
    const size_t passes = (rem + kFusedPass - 1) / kFusedPass;
    for (size_t p = 0, t = 0; p < passes; ++p) {
        const size_t r = (rem - t) / (passes - p);
        switch (r) {
        case 1: fused_rows<2, 1>(m, row, n, x + t, o + t, ldo); break;
        case 2: fused_rows<2, 2>(m, row, n, x + t, o + t, ldo); break;
        case 3: fused_rows<2, 3>(m, row, n, x + t, o + t, ldo); break;
        case 4: fused_rows<2, 4>(m, row, n, x + t, o + t, ldo); break;
        default: fused_rows<2, 5>(m, row, n, x + t, o + t, ldo); break;
        }
        t += r;
    }
}

// fuse_row's word indices: lo[q] picks words 4w + q (w < 16) of the first two input vectors, hi[q]
// words 4(w - 16) + q (w >= 16) of the last two.
struct FuseIndices {
    alignas(64) uint16_t lo[4][32], hi[4][32];
    FuseIndices() {
        for (int q = 0; q < 4; ++q)
            for (int w = 0; w < 32; ++w) {
                lo[q][w] = static_cast<uint16_t>((4 * w + q) % 64);
                hi[q][w] = static_cast<uint16_t>((4 * (w - 16) + q + 64) % 64);
            }
    }
};

// A bf16 row of n inputs (a multiple of kFuseBlock) into the fused order, 128 at a time: output
// vector q (of 4) takes words 4w + q of the four input vectors (two two-source permutes and a blend).
IQ36_BF16 inline void fuse_row(const uint16_t* in, size_t n, uint16_t* out) {
    static const FuseIndices idx;
    __m512i il[4], ih[4];
    for (int q = 0; q < 4; ++q) {
        il[q] = _mm512_load_si512(idx.lo[q]);
        ih[q] = _mm512_load_si512(idx.hi[q]);
    }
    for (size_t k = 0; k < n; k += kFuseBlock) {
        const __m512i a = _mm512_loadu_si512(in + k), b = _mm512_loadu_si512(in + k + 32);
        const __m512i c = _mm512_loadu_si512(in + k + 64), d = _mm512_loadu_si512(in + k + 96);
        for (int q = 0; q < 4; ++q) {
            const __m512i ab = _mm512_permutex2var_epi16(a, il[q], b), cd = _mm512_permutex2var_epi16(c, ih[q], d);
            _mm512_storeu_si512(out + k + q * 32, _mm512_mask_blend_epi16(0xFFFF0000u, ab, cd));
        }
    }
}

// Inputs per pass of the bf16 tiles: experts::slice_of's rule (whole rows when a task's tile fits
// L2), except with AMX tiles, which keep kSlice: a whole-row tile's rows would lie 4 KB apart
// (2048 inputs), the stride at which a tile load's 16 rows share one L1 set; not measured on an
// AMX machine.
inline size_t slice_of(const Packed& m) { return experts::slice_of(m, 2, !amx::supported()); }

// o[c][t] = dot(row r0 + c of expert e, token t) for c < n: tokens t < vecs * 16 from the token
// columns xp (the lane form), then `rem` more, t = vecs * 16 + j, from the token-major rows xr[j]
// (the dot form; `acc`: n x rem x 16 floats of scratch). `fused`: no lane-form tokens (vecs 0), the
// rows xr in the fused order and fuses(m): the fused form, no tile.
IQ36_BF16 inline void products(const Packed& m, size_t e, size_t r0, size_t n, const uint32_t* xp, size_t ldx, size_t vecs,
                               const uint16_t* const* xr, size_t rem, float* acc, uint16_t* tile, float* scales, float* o,
                               size_t ldo, bool fused = false) {
    if (fused)
        return fused_dots(m, e, r0, n, xr, rem, o, ldo);
    const size_t K = m.in(), ks = slice_of(m);
    const uint16_t* xs[kDotTokens];
    // AMX tiles for the lane form's whole 16-row blocks, where the CPU has them; the vector tiles
    // for the rows after them and everywhere else
    const bool tiles = vecs > 0 && n >= 16 && amx::fits(m.group);
    const size_t vrows = tiles ? n / 16 * 16 : 0;
    std::optional<amx::TileScope> scope;
    if (tiles)
        scope.emplace();
    for (size_t k0 = 0; k0 < K; k0 += ks) {
        const size_t kn = std::min(ks, K - k0);
        decompress(m, e, r0, n, k0, kn, tile, scales);
        if (tiles)
            amx::gemm(tile, scales, m.group, n, kn, xp + (k0 / 2) * ldx, ldx, vecs, o, ldo, k0 > 0);
        if (vecs > 0 && vrows < n)
            gemm(tile + vrows * kn, scales + vrows * (kn / m.group), m.group, n - vrows, kn, xp + (k0 / 2) * ldx, ldx, vecs,
                 o + vrows * ldo, ldo, k0 > 0);
        if (rem > 0) {
            for (size_t j = 0; j < rem; ++j)
                xs[j] = xr[j] + k0;
            dots(tile, scales, m.group, n, kn, xs, rem, acc, k0 > 0);
        }
    }
    for (size_t c = 0; c < n; ++c)
        for (size_t j = 0; j < rem; ++j)
            o[c * ldo + vecs * 16 + j] = _mm512_reduce_add_ps(_mm512_loadu_ps(acc + (c * rem + j) * 16));
}

// One f32 row as bf16 (round to nearest even), n even.
IQ36_BF16 inline void round_row(const float* x, size_t n, uint16_t* out) {
    size_t k = 0;
    for (; k + 16 <= n; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k))));
    if (k < n) {
        const __mmask16 mask = static_cast<__mmask16>((1u << (n - k)) - 1);
        const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + k)));
        _mm256_mask_storeu_epi16(out + k, mask, b);
    }
}

// Token columns (a: K x ld f32, K even) as input pairs: p[k / 2][t] = bf16(a[k][t]) | bf16(a[k + 1][t]) << 16,
// for t < cols (a multiple of 8).
IQ36_BF16 inline void pair_columns(const float* a, size_t K, size_t ld, size_t cols, uint32_t* p) {
    for (size_t k = 0; k < K; k += 2) {
        const float* lo = a + k * ld;
        const float* hi = lo + ld;
        uint32_t* dst = p + (k / 2) * ld;
        for (size_t t = 0; t < cols; t += 8) {
            const __m128i l = reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(_mm256_loadu_ps(lo + t)));
            const __m128i h = reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(_mm256_loadu_ps(hi + t)));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + t), _mm_unpacklo_epi16(l, h));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + t + 4), _mm_unpackhi_epi16(l, h));
        }
    }
}

// Columns [0, rem) of rows [0, K) of a (ld apart; rem <= 16) rounded to bf16 as the lane form
// rounds them, token-major: r[j * ldr + k] = bf16(a[k * ld + j]); `fused`: at fused_index(k)
// instead (K a multiple of kFuseBlock, r at a multiple of it in its row).
IQ36_BF16 inline void rows_of_columns(const float* a, size_t K, size_t ld, size_t rem, uint16_t* r, size_t ldr, bool fused = false) {
    const __mmask16 mk = rem >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1);
    alignas(32) uint16_t b[16];
    for (size_t k = 0; k < K; ++k) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(b), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mk, a + k * ld))));
        const size_t at = fused ? fused_index(k) : k;
        for (size_t j = 0; j < rem; ++j)
            r[j * ldr + at] = b[j];
    }
}


// A compressed dense matmul's rows on these tiles, for Q16Linear's `tile_rows`: y [M, N] = x [M, K]
// . W^T, W's N rows taken as one expert's, its tokens the M rows of x, laid out as U4Experts lays
// out an expert's (whole vectors of 16 in the lane form, the last M % 16 in the dot form when at
// most kDotTokens, all of them in the fused form when they are that few). What it is for: a
// prefill chunk's last rows past the plugin's row blocks (kernels/q16_decode.py: TAIL_ROWS), which
// the plugin's compressed matmul computes as a whole block of 64 rows. Numerics as the experts'
// tiles: x rounded to bf16 (the plugin's bf16 nodes' outputs are bf16 already), exact weight
// products, the group's scale on the group's f32 sum. False, computing nothing, where the tiles do
// not apply (no AVX512-BF16, u8 weights).
inline bool dense(const q16::Weights& W, const float* x, size_t M, float* y) {
    if (!supported() || !W.w4 || W.K % 2 != 0 || W.group % 2 != 0)
        return false;
    const Packed m{W.w, W.z, W.w4, W.z4, W.s, W.s16, W.N, W.K / W.group, W.group};
    const size_t K = W.K, N = W.N, tail = M % 16;
    const bool dot = tail <= kDotTokens;
    const size_t rem = dot ? tail : 0, lanes = dot ? M - tail : M + 16 - tail;
    const bool fused = lanes == 0 && fuses(m) && K % kFuseBlock == 0;
    Scratch<uint16_t> xb_buffer(M * K);  // x's rows as bf16 (in the fused order when fused)
    uint16_t* xb = xb_buffer.data();
    std::vector<uint16_t> natural(fused ? K : 0);
    std::vector<const float*> rows(M);
    for (size_t t = 0; t < M; ++t) {
        if (fused) {
            round_row(x + t * K, K, natural.data());
            fuse_row(natural.data(), K, xb + t * K);
        } else {
            round_row(x + t * K, K, xb + t * K);
        }
        rows[t] = reinterpret_cast<const float*>(xb + t * K);  // a row's input pairs as 32-bit words
    }
    // the lane-form tokens' input pairs as columns (K / 2 x lanes words; zero columns past M)
    Scratch<float> xT_buffer(K / 2 * lanes);
    const std::vector<float> zero(lanes > 0 ? K / 2 : 0, 0.0f);
    if (lanes > 0)
        transpose_rows(rows.data(), std::min(M, lanes), zero.data(), K / 2, xT_buffer.data(), lanes);
    const auto* xp = reinterpret_cast<const uint32_t*>(xT_buffer.data());
    const uint16_t* xr[kDotTokens];
    for (size_t j = 0; j < rem; ++j)
        xr[j] = xb + (lanes + j) * K;
    const size_t ldo = lanes + rem, ks = slice_of(m);
    dense_tasks(m, N, M, ldo, y, [&](size_t r0, size_t n, float* o) {
        thread_local AlignedVector<uint16_t> tile;
        thread_local std::vector<float> scales, acc;
        tile.resize(kGateRows * ks);
        scales.resize(kGateRows * ks / m.group);
        acc.resize(kGateRows * kDotTokens * 16);
        products(m, 0, r0, n, xp, lanes, lanes / 16, xr, rem, acc.data(), tile.data(), scales.data(), o, ldo, fused);
    });
    return true;
}

}  // namespace bf16
}  // namespace experts
}  // namespace iq36
