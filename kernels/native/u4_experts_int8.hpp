// U4Experts' lane-form products on int8 activations (AVX512-VNNI `vpdpbusd`), for a compiled model
// whose CPU plugin quantizes the activations of its own compressed matmuls to int8 (its dynamic
// quantization, per 32 inputs: its default where it runs the model in bf16): the `int8` attribute.
//
// What changes against the bf16 tiles (u4_experts_bf16.hpp): the kernels read the weights q where
// the model holds them, packed u4 (a mask and a shift per 8 weights, kInputOrder; no tile, no
// table), the activations are int8 per kGroup inputs (a = s_G * a8, s_G = max |a| / 127 over the
// group, a8 rounded to nearest even), and one zmm vpdpbusd takes four inputs of 16 tokens: twice
// vdpbf16ps' multiply-adds per instruction. Per weight row r and
// weight group g (scale w_s, zero point z):
//   sum_k (q_k - z) w_s a_k = w_s sum_G s_G (sum_{k in G} q_k a8_k) - w_s z S_g,
//   S_g = sum_{G in g} s_G sum_{k in G} a8_k,
// so the zero point never meets the integer products: each activation group's int32 sum is
// scaled by s_G into the weight group's sum, which meets w_s once, as does S_g (per token,
// computed with the activations) with w_s z.
// The integer sums are exact; the f32 sums run in a fixed order. Only the lane form: an expert's
// tokens padded to a multiple of 8 (kPad; zero columns: zero products, zero S); the dot and fused
// forms (experts of at most bf16::kDotTokens tokens) keep their bf16 products.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

// Included by u4_experts.hpp after u4_experts_bf16.hpp (Packed, value, slice_of, token_blocks).

#define IQ36_INT8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace iq36 {
namespace experts {
namespace int8 {

constexpr size_t kGroup = 32;  // inputs per activation scale (the plugin's dynamic quantization group)

// The lane form's columns: whole vectors of 16 tokens (zmm), then one of 8 (ymm, `Ymm`) when at
// most 8 tokens are left.
constexpr size_t kPad = 8;
inline size_t padded(size_t m) { return (m + kPad - 1) / kPad * kPad; }

inline bool supported() {
    static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return yes;
}

// The lane form's input order: within each 8 inputs the even ones, then the odd ones. A packed
// weight byte holds an even input's q in its low nibble and the next one's in its high nibble, so
// four packed bytes (8 weights) are two words of four weights by one mask and one shift, each
// against one word of four inputs of a token (the bytes in this order), and the kernels read the
// weights as the model holds them, with no tile to unpack them into.
constexpr int kInputOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// A row of n floats (n a multiple of kGroup) as int8 per kGroup inputs: q (n bytes, each 8 in
// kInputOrder), s (n / kGroup scales) and, per weight group of `group` inputs (a multiple of kGroup),
// S[g] = sum_G s_G sum_k q_k.
IQ36_INT8 inline void quantize_row(const float* x, size_t n, size_t group, int8_t* q, float* s, float* S) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);  // kInputOrder
    for (size_t g = 0; g < n / group; ++g)
        S[g] = 0.0f;
    for (size_t k = 0; k < n; k += kGroup) {
        const __m512 a = _mm512_loadu_ps(x + k), b = _mm512_loadu_ps(x + k + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i qa = _mm512_permutexvar_epi32(order, _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv))));
        const __m512i qb = _mm512_permutexvar_epi32(order, _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k + 16), _mm512_cvtsepi32_epi8(qb));
        const float sk = amax / 127.0f;
        s[k / kGroup] = sk;
        S[k / group] += sk * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    }
}

// Token columns (a: K x ld floats, K a multiple of kGroup) as int8 per kGroup rows of each column,
// for t < cols (a multiple of kPad): q[(k / 4) * ld + t] holds four rows of column t, a byte each
// (rows k .. k + 3 of the rows in kInputOrder, the first lowest), s[(k / kGroup) * ld + t] the group's scale, P[(k / kGroup) * ld + t] = s_G *
// sum_{k in G} q_k (summed into S per weight group by `sum_groups`).
IQ36_INT8 inline void quantize_columns(const float* a, size_t K, size_t ld, size_t cols, int32_t* q, float* s, float* P) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i byte = _mm512_set1_epi32(0xFF);
    for (size_t k0 = 0; k0 < K; k0 += kGroup)
        for (size_t t = 0; t < cols; t += 16) {
            const __mmask16 in = cols - t >= 16 ? 0xFFFF : 0x00FF;  // a last ymm vector's 8 columns
            __m512 amax = _mm512_setzero_ps();
            for (size_t k = k0; k < k0 + kGroup; ++k)
                amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_maskz_loadu_ps(in, a + k * ld + t)));
            const __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
            const __m512 inv = _mm512_maskz_div_ps(live, _mm512_set1_ps(127.0f), amax);
            __m512i sum = _mm512_setzero_si512();
            for (size_t k = k0; k < k0 + kGroup; k += 4) {
                __m512i word = _mm512_setzero_si512();
                for (int i = 0; i < 4; ++i) {
                    const size_t row = k / 8 * 8 + kInputOrder[k % 8 + i];
                    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, a + row * ld + t), inv));
                    sum = _mm512_add_epi32(sum, v);
                    word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_and_si512(v, byte), 8 * i));
                }
                _mm512_mask_storeu_epi32(q + (k / 4) * ld + t, in, word);
            }
            const __m512 sc = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
            _mm512_mask_storeu_ps(s + (k0 / kGroup) * ld + t, in, sc);
            _mm512_mask_storeu_ps(P + (k0 / kGroup) * ld + t, in, _mm512_mul_ps(sc, _mm512_cvtepi32_ps(sum)));
        }
}

// S[(g) * ld + t] = sum of P[(G) * ld + t] over the activation groups G of weight group g, for K
// inputs and t < cols.
inline void sum_groups(const float* P, size_t K, size_t group, size_t ld, size_t cols, float* S) {
    const size_t per = group / kGroup;
    for (size_t g = 0; g < K / group; ++g)
        for (size_t t = 0; t < cols; ++t) {
            float v = 0.0f;
            for (size_t G = g * per; G < (g + 1) * per; ++G)
                v += P[G * ld + t];
            S[g * ld + t] = v;
        }
}

// Rows [r0, r0 + n) of expert e, inputs [k0, k0 + kn) (whole groups): the group's scale into sw
// and scale x zero point into zs (n x kn / group); u8 weights (one byte each) also their q into w
// (n x kn, each 8 in kInputOrder). Packed u4 weights need no copy: the kernels read them in place.
IQ36_INT8 inline void prepare(const Packed& m, size_t e, size_t r0, size_t n, size_t k0, size_t kn, uint8_t* w, float* sw,
                              float* zs) {
    const size_t group = m.group, groups = m.groups;  // locals: the stores below may alias m
    const size_t g0 = k0 / group, g1 = (k0 + kn) / group, gn = g1 - g0;
    for (size_t r = 0; r < n; ++r) {
        const size_t row = e * m.out + r0 + r;
        for (size_t g = g0; g < g1; ++g) {
            const size_t gi = row * groups + g;
            const float scale = m.scale(gi);
            sw[r * gn + g - g0] = scale;
            zs[r * gn + g - g0] = scale * static_cast<float>(value(m.z, gi, m.z4));
        }
        if (!m.w4) {
            const uint8_t* src = m.w + row * m.in() + k0;
            for (size_t j = 0; j < kn; ++j)
                w[r * kn + j] = src[j / 8 * 8 + kInputOrder[j % 8]];
        }
    }
}

// The lane form's token vectors: 16 tokens in a zmm, or 8 in a ymm for an expert's last tokens
// when at most 8 are past its whole zmm vectors (kPad: at ~32 tokens an expert, with columns padded
// to 16 a fifth of the lanes were padding, with 8 a tenth). A ymm vpdpbusd takes half the
// multiply-adds of a zmm one, which on a CPU whose 512-bit units are two 256-bit ones (Zen 4)
// costs it half the time.
struct Zmm {
    using F = __m512;
    using I = __m512i;
    static constexpr size_t kLanes = 16;
    IQ36_INT8 static F zero() { return _mm512_setzero_ps(); }
    IQ36_INT8 static I zero_i() { return _mm512_setzero_si512(); }
    IQ36_INT8 static F load(const float* p) { return _mm512_loadu_ps(p); }
    IQ36_INT8 static I load(const int32_t* p) { return _mm512_loadu_si512(p); }
    IQ36_INT8 static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
    IQ36_INT8 static F set1(float v) { return _mm512_set1_ps(v); }
    IQ36_INT8 static I set1(int32_t v) { return _mm512_set1_epi32(v); }
    IQ36_INT8 static I dpbusd(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
    IQ36_INT8 static I nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
    IQ36_INT8 static I high_nibbles(I v) { return nibbles(_mm512_srli_epi32(v, 4)); }
    IQ36_INT8 static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
    IQ36_INT8 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    IQ36_INT8 static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    IQ36_INT8 static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
};

struct Ymm {
    using F = __m256;
    using I = __m256i;
    static constexpr size_t kLanes = 8;
    IQ36_INT8 static F zero() { return _mm256_setzero_ps(); }
    IQ36_INT8 static I zero_i() { return _mm256_setzero_si256(); }
    IQ36_INT8 static F load(const float* p) { return _mm256_loadu_ps(p); }
    IQ36_INT8 static I load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    IQ36_INT8 static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
    IQ36_INT8 static F set1(float v) { return _mm256_set1_ps(v); }
    IQ36_INT8 static I set1(int32_t v) { return _mm256_set1_epi32(v); }
    IQ36_INT8 static I dpbusd(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }
    IQ36_INT8 static I nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
    IQ36_INT8 static I high_nibbles(I v) { return nibbles(_mm256_srli_epi32(v, 4)); }
    IQ36_INT8 static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
    IQ36_INT8 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    IQ36_INT8 static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    IQ36_INT8 static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
};

// V vectors of Vec's lanes of floats from p.
template <class Vec, int V>
IQ36_INT8 inline void lanes_of(const float* p, typename Vec::F (&out)[V]) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v)
        out[v] = Vec::load(p + v * Vec::kLanes);
}

// o[c][v * L ..] (+)= the products of C weight rows with V vectors of L tokens (L = Vec::kLanes)
// and, for H = 1 (Vec = Zmm only), one more of 8 tokens in a ymm at lane V * L (an expert's last
// tokens past its whole zmm vectors): the rows' q as packed u4 bytes in the model's order (Nib;
// ldw bytes apart, two weights a byte) or as bytes in kInputOrder (ldw apart); xq holds the
// tokens' int8 inputs four to a lane (ldx lanes apart per input quad, in kInputOrder), sa their
// scales per kGroup inputs and S their sums per weight group (both ldx apart); sw / zs the rows'
// scales and scale x zero point per weight group (lds apart). Registers: 2 C (V + H) accumulators
// (a kGroup's int32 sums; the weight group's f32 sum, which meets w_s and the zero point once per
// weight group, into o), 2 (V + H) token vectors, V + H scales and the weight words. The ymm vector
// takes the low halves of the zmm weight words: per lane the same operations as Ymm's kernel, so
// the same bits, without a second pass over the rows to unpack their words again.
template <class Vec, int C, int V, bool Nib, int H = 0>
IQ36_INT8 inline void kernel(const uint8_t* w, size_t ldw, const float* sw, const float* zs, size_t lds, size_t group,
                             const int32_t* xq, const float* sa, const float* S, size_t ldx, size_t kn, float* o, size_t ldo,
                             bool add, const char* ahead) {
    static_assert(H == 0 || (H == 1 && std::is_same_v<Vec, Zmm>), "a ymm tail only beside zmm vectors");
    constexpr size_t L = Vec::kLanes;
    constexpr int Hn = H > 0 ? H : 1;  // array extents (unused when H = 0)
    for (size_t g0 = 0; g0 < kn; g0 += group) {
        typename Vec::F t[C][V];  // the weight group's sum_G s_G ga_G
        Ymm::F th[C][Hn];
        for (size_t h = g0; h < g0 + group; h += kGroup) {
            if (ahead)  // the next C rows' bytes, spread over this block's steps (C kGroup / 2 per step)
                for (size_t l = 0; l < C * kGroup / 2; l += 64)
                    _mm_prefetch(ahead + h / kGroup * (C * kGroup / 2) + l, _MM_HINT_T0);
            typename Vec::I ga[C][V];
            Ymm::I gh[C][Hn];
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
#pragma GCC unroll 8
                for (int v = 0; v < V; ++v)
                    ga[c][v] = Vec::zero_i();
                if constexpr (H > 0)
                    gh[c][0] = Ymm::zero_i();
            }
#pragma GCC unroll 8
            for (size_t k = h; k < h + kGroup; k += 8) {  // 8 inputs: the even ones' word, the odd ones'
                typename Vec::I even[V], odd[V];
                Ymm::I even_h, odd_h;
#pragma GCC unroll 8
                for (int v = 0; v < V; ++v) {
                    even[v] = Vec::load(xq + (k / 4) * ldx + v * L);
                    odd[v] = Vec::load(xq + (k / 4 + 1) * ldx + v * L);
                }
                if constexpr (H > 0) {
                    even_h = Ymm::load(xq + (k / 4) * ldx + V * L);
                    odd_h = Ymm::load(xq + (k / 4 + 1) * ldx + V * L);
                }
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) {
                    typename Vec::I we, wo;
                    if constexpr (Nib) {
                        int32_t packed;
                        std::memcpy(&packed, w + c * ldw + k / 2, 4);
                        const typename Vec::I b = Vec::set1(packed);
                        we = Vec::nibbles(b);
                        wo = Vec::high_nibbles(b);
                    } else {
                        int32_t q[2];
                        std::memcpy(q, w + c * ldw + k, 8);
                        we = Vec::set1(q[0]);
                        wo = Vec::set1(q[1]);
                    }
#pragma GCC unroll 8
                    for (int v = 0; v < V; ++v)
                        ga[c][v] = Vec::dpbusd(Vec::dpbusd(ga[c][v], we, even[v]), wo, odd[v]);
                    if constexpr (H > 0)
                        gh[c][0] = Ymm::dpbusd(Ymm::dpbusd(gh[c][0], _mm512_castsi512_si256(we), even_h),
                                               _mm512_castsi512_si256(wo), odd_h);
                }
            }
            typename Vec::F sv[V];
            lanes_of<Vec, V>(sa + (h / kGroup) * ldx, sv);
            Ymm::F sv_h;
            if constexpr (H > 0)
                sv_h = Ymm::load(sa + (h / kGroup) * ldx + V * L);
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
#pragma GCC unroll 8
                for (int v = 0; v < V; ++v)
                    t[c][v] = h == g0 ? Vec::mul(Vec::to_float(ga[c][v]), sv[v]) : Vec::fmadd(Vec::to_float(ga[c][v]), sv[v], t[c][v]);
                if constexpr (H > 0)
                    th[c][0] = h == g0 ? Ymm::mul(Ymm::to_float(gh[c][0]), sv_h) : Ymm::fmadd(Ymm::to_float(gh[c][0]), sv_h, th[c][0]);
            }
        }
        // o (+)= w_s t - w_s z S_g: the totals in memory, once per weight group (in registers
        // too they would need 3 C V of the 32)
        typename Vec::F sg[V];
        lanes_of<Vec, V>(S + (g0 / group) * ldx, sg);
        Ymm::F sg_h;
        if constexpr (H > 0)
            sg_h = Ymm::load(S + (g0 / group) * ldx + V * L);
        const bool first = g0 == 0 && !add;
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const float scale = sw[c * lds + g0 / group], zero = zs[c * lds + g0 / group];
            const typename Vec::F sc = Vec::set1(scale), zc = Vec::set1(zero);
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v) {
                float* out = o + c * ldo + v * L;
                const typename Vec::F before = first ? Vec::zero() : Vec::load(out);
                Vec::store(out, Vec::fnmadd(zc, sg[v], Vec::fmadd(t[c][v], sc, before)));
            }
            if constexpr (H > 0) {
                float* out = o + c * ldo + V * L;
                const Ymm::F before = first ? Ymm::zero() : Ymm::load(out);
                Ymm::store(out, Ymm::fnmadd(Ymm::set1(zero), sg_h, Ymm::fmadd(th[c][0], Ymm::set1(scale), before)));
            }
        }
    }
}

template <class Vec, int C, int V, bool Nib, int H = 0>
IQ36_INT8 inline void run(const uint8_t* w, size_t ldw, const float* sw, const float* zs, size_t gn, size_t group, size_t n,
                          size_t kn, const int32_t* xq, const float* sa, const float* S, size_t ldx, float* o, size_t ldo, bool add,
                          bool ahead) {
    const auto next = [&](size_t c, size_t rows) {  // whole packed rows only (ldw == kn / 2)
        return Nib && ahead && ldw * 2 == kn ? reinterpret_cast<const char*>(w + (c + rows) * ldw) : nullptr;
    };
    size_t c = 0;
    for (; c + C <= n; c += C)
        kernel<Vec, C, V, Nib, H>(w + c * ldw, ldw, sw + c * gn, zs + c * gn, gn, group, xq, sa, S, ldx, kn, o + c * ldo, ldo, add,
                                  next(c, C));
    for (; c < n; ++c)
        kernel<Vec, 1, V, Nib, H>(w + c * ldw, ldw, sw + c * gn, zs + c * gn, gn, group, xq, sa, S, ldx, kn, o + c * ldo, ldo, add,
                                  next(c, 1));
}

// Weight rows per ymm block: 8 (E = 256, 513 tokens, from an unpacked tile: 4 rows 3% slower, 12
// and 16 rows 18-24%).
constexpr int kYmmRows = 8;

// Inputs per pass: experts::slice_of's rule for tiles of one byte per weight.
inline size_t slice_of(const Packed& m) { return experts::slice_of(m, 1); }

// A thread's tile: the scales and scale x zero points per group of up to `rows` weight rows x
// slice_of(m) inputs, and for u8 weights their q as bytes (`prepare`).
struct Tile {
    AlignedVector<uint8_t> w;
    std::vector<float> sw, zs;
    std::vector<float> swT, zsT, oT;  // the row form's (`row_products`)
    void fit(const Packed& m, size_t rows) {
        const size_t ks = slice_of(m);
        w.resize(m.w4 ? 0 : rows * ks);  // packed u4 weights are read in place
        sw.resize(rows * ks / m.group);
        zs.resize(rows * ks / m.group);
    }
};

// The row form: the weight rows are the lanes (16 to a zmm) and each token's word of four inputs
// is broadcast, for an expert of few tokens: 16 rows' 32 packed weights are transposed in
// registers (4 loads, 12 inserts, 8 unpacks), unpacked once (a mask, a shift and a mask) and
// meet each token in 8 vpdpbusd, with no padded tokens. Per (row, token) the same int32 sums and
// the same f32 operations in the same order as `kernel`: the same bits. Zen 4 EPYC, the op alone:
// per product about the lane form's speed at 11-24 tokens an expert and 10% slower at ~32, so
// the lane form keeps those; what it brings is int8 products for the experts of 3-10 tokens
// (row_tokens()), which took the bf16 dot form: E = 256, 257 tokens 58.6 -> 48.5 ms, 513 tokens
// 73.4 -> 69.8 ms (docs/perf-log.md, session 34).
constexpr size_t kRowLanes = 16;
constexpr int kRowBlock = 12;  // tokens per pass: 2 x 12 accumulators, 4 weight words, 4 more

// Experts of at most this many tokens take the row form (0: never). `IQ36_INT8_ROW_TOKENS` in the
// environment overrides it (A/B timings, tests).
#ifndef IQ36_INT8_ROW_TOKENS
#define IQ36_INT8_ROW_TOKENS 10
#endif
inline size_t row_tokens() {
    static const size_t tokens = [] {
        const char* env = std::getenv("IQ36_INT8_ROW_TOKENS");
        return env && *env ? static_cast<size_t>(std::strtoul(env, nullptr, 10)) : size_t{IQ36_INT8_ROW_TOKENS};
    }();
    return tokens;
}

// acc + the products of u's bytes with the word at p in every lane: the word as the instruction's
// broadcast memory operand ({1to16}), which GCC does not fold from _mm512_set1_epi32 (a separate
// vpbroadcastd per product otherwise).
IQ36_INT8 inline __m512i dpbusd_word(__m512i acc, __m512i u, const int32_t* p) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*p));
    return acc;
}

// B[j] lane i: the j-th 4 bytes of the 16 at w + i ldw (16 rows' 32 packed weights, 8 a word).
IQ36_INT8 inline void rows_of_words(const uint8_t* w, size_t ldw, __m512i (&B)[4]) {
    __m512i A[4];  // A[q]'s 128-bit lane L: row q + 4 L
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
        __m512i a = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + q * ldw)));
        a = _mm512_inserti32x4(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (q + 4) * ldw)), 1);
        a = _mm512_inserti32x4(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (q + 8) * ldw)), 2);
        A[q] = _mm512_inserti32x4(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (q + 12) * ldw)), 3);
    }
    // a 4 x 4 transpose within each 128-bit lane: element i of lane L is row 4 L + i
    const __m512i t0 = _mm512_unpacklo_epi32(A[0], A[1]), t1 = _mm512_unpackhi_epi32(A[0], A[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(A[2], A[3]), t3 = _mm512_unpackhi_epi32(A[2], A[3]);
    B[0] = _mm512_unpacklo_epi64(t0, t2);
    B[1] = _mm512_unpackhi_epi64(t0, t2);
    B[2] = _mm512_unpacklo_epi64(t1, t3);
    B[3] = _mm512_unpackhi_epi64(t1, t3);
}

// oT[t * 16 + i] (+)= the products of 16 packed u4 rows (ldw bytes apart) with T tokens, over kn
// inputs: xq / sa / S as for `kernel` (the lane form's columns, token t at lane t), swT / zsT the
// rows' scales and scale x zero points per weight group (16 a group). `add`: oT holds a previous
// slice's sums. `ahead`: the next 16 rows, prefetched a line of each per 128 inputs.
template <int T>
IQ36_INT8 inline void row_kernel(const uint8_t* w, size_t ldw, const float* swT, const float* zsT, size_t group,
                                 const int32_t* xq, const float* sa, const float* S, size_t ldx, size_t kn, float* oT,
                                 bool add, const uint8_t* ahead) {
    for (size_t g0 = 0; g0 < kn; g0 += group) {
        __m512 t[T];  // the weight group's sum_G s_G ga_G
        for (size_t h = g0; h < g0 + group; h += kGroup) {
            if (ahead && h % 128 == 0)
#pragma GCC unroll 16
                for (size_t i = 0; i < kRowLanes; ++i)
                    _mm_prefetch(reinterpret_cast<const char*>(ahead + i * ldw + h / 2), _MM_HINT_T0);
            __m512i B[4];
            rows_of_words(w + h / 2, ldw, B);
            __m512i ga[T];
#pragma GCC unroll 16
            for (int j = 0; j < T; ++j)
                ga[j] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) {  // 8 inputs: the even ones' word, the odd ones'
                const __m512i we = Zmm::nibbles(B[q]), wo = Zmm::high_nibbles(B[q]);
                const int32_t* even = xq + ((h + 8 * q) / 4) * ldx;
#pragma GCC unroll 16
                for (int j = 0; j < T; ++j) {
                    ga[j] = dpbusd_word(ga[j], we, even + j);
                    ga[j] = dpbusd_word(ga[j], wo, even + ldx + j);
                }
            }
            const float* sv = sa + (h / kGroup) * ldx;
#pragma GCC unroll 16
            for (int j = 0; j < T; ++j)
                t[j] = h == g0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(ga[j]), _mm512_set1_ps(sv[j]))
                               : _mm512_fmadd_ps(_mm512_cvtepi32_ps(ga[j]), _mm512_set1_ps(sv[j]), t[j]);
        }
        const size_t g = g0 / group;
        const __m512 sc = _mm512_loadu_ps(swT + g * kRowLanes), zc = _mm512_loadu_ps(zsT + g * kRowLanes);
        const float* sg = S + g * ldx;
        const bool first = g0 == 0 && !add;
#pragma GCC unroll 16
        for (int j = 0; j < T; ++j) {
            float* out = oT + j * kRowLanes;
            const __m512 before = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out);
            _mm512_storeu_ps(out, _mm512_fnmadd_ps(zc, _mm512_set1_ps(sg[j]), _mm512_fmadd_ps(t[j], sc, before)));
        }
    }
}

// Tokens [t0, t0 + nt) (nt <= kRowBlock) of the row form through row_kernel<nt>.
IQ36_INT8 inline void row_pass(size_t nt, const uint8_t* w, size_t ldw, const float* swT, const float* zsT, size_t group,
                               const int32_t* xq, const float* sa, const float* S, size_t ldx, size_t kn, float* oT,
                               bool add, const uint8_t* ahead) {
    switch (nt) {
#define IQ36_ROW_CASE(N) \
    case N: return row_kernel<N>(w, ldw, swT, zsT, group, xq, sa, S, ldx, kn, oT, add, ahead);
        IQ36_ROW_CASE(1) IQ36_ROW_CASE(2) IQ36_ROW_CASE(3) IQ36_ROW_CASE(4) IQ36_ROW_CASE(5) IQ36_ROW_CASE(6)
        IQ36_ROW_CASE(7) IQ36_ROW_CASE(8) IQ36_ROW_CASE(9) IQ36_ROW_CASE(10) IQ36_ROW_CASE(11) IQ36_ROW_CASE(12)
#undef IQ36_ROW_CASE
        default: return;
    }
}

// Whether products() takes the row form for n rows and `tokens` tokens of m.
inline bool row_form(const Packed& m, size_t n, size_t tokens) {
    return m.w4 && tokens > 0 && tokens <= row_tokens() && n % kRowLanes == 0;
}

// products() in the row form: o[c * ldo + t] for c < n (whole blocks of 16), t < tokens, and 0 for
// t in [tokens, cols) (the lane form's padded columns, which the callers read as zeros).
inline void row_products(const Packed& m, size_t e, size_t r0, size_t n, const int32_t* xq, const float* sa, const float* S,
                         size_t ldx, size_t tokens, size_t cols, Tile& tile, float* o, size_t ldo) {
    const size_t K = m.in(), ks = slice_of(m);
    const size_t passes = (tokens + kRowBlock - 1) / kRowBlock, per = (tokens + passes - 1) / passes;
    tile.oT.resize(n * tokens);
    float* oT = tile.oT.data();  // block b, token t: oT + (b tokens + t) 16
    for (size_t k0 = 0; k0 < K; k0 += ks) {
        const size_t kn = std::min(ks, K - k0), gn = kn / m.group, g0 = k0 / m.group;
        // the rows' scales and scale x zero points, 16 rows to a group's vector (block b at b gn 16)
        tile.swT.resize(n * gn);
        tile.zsT.resize(n * gn);
        for (size_t r = 0; r < n; ++r) {
            const size_t row = e * m.out + r0 + r;
            float* sw = tile.swT.data() + (r / kRowLanes * gn) * kRowLanes + r % kRowLanes;
            float* zs = tile.zsT.data() + (r / kRowLanes * gn) * kRowLanes + r % kRowLanes;
            for (size_t g = 0; g < gn; ++g) {
                const size_t gi = row * m.groups + g0 + g;
                const float scale = m.scale(gi);
                sw[g * kRowLanes] = scale;
                zs[g * kRowLanes] = scale * static_cast<float>(value(m.z, gi, m.z4));
            }
        }
        const uint8_t* w = m.w + (e * m.out + r0) * (K / 2) + k0 / 2;
        const int32_t* xs = xq + (k0 / 4) * ldx;
        const float *ss = sa + (k0 / kGroup) * ldx, *Ss = S + (k0 / m.group) * ldx;
        for (size_t b = 0; b < n / kRowLanes; ++b) {
            const uint8_t* wb = w + b * kRowLanes * (K / 2);
            const uint8_t* next = b + 1 < n / kRowLanes && kn == K ? wb + kRowLanes * (K / 2) : nullptr;
            const float *sw = tile.swT.data() + b * gn * kRowLanes, *zs = tile.zsT.data() + b * gn * kRowLanes;
            for (size_t t0 = 0; t0 < tokens; t0 += per) {
                const size_t nt = std::min(per, tokens - t0);
                row_pass(nt, wb, K / 2, sw, zs, m.group, xs + t0, ss + t0, Ss + t0, ldx, kn, oT + (b * tokens + t0) * kRowLanes,
                         k0 > 0, t0 == 0 ? next : nullptr);
            }
        }
    }
    for (size_t b = 0; b < n / kRowLanes; ++b)
        for (size_t i = 0; i < kRowLanes; ++i) {
            float* row = o + (b * kRowLanes + i) * ldo;
            for (size_t t = 0; t < tokens; ++t)
                row[t] = oT[(b * tokens + t) * kRowLanes + i];
            std::fill(row + tokens, row + cols, 0.0f);
        }
}

// o[c][t] = dot(row r0 + c of expert e, token t) for c < n, t < cols (a multiple of kPad): the
// token columns xq (K / 4 x ldx lanes), their scales sa (K / kGroup x ldx) and sums S (K / m.group
// x ldx); the scales (and u8 weights' q) prepared one slice at a time into `tile` (fit for n rows of m).
inline void products(const Packed& m, size_t e, size_t r0, size_t n, const int32_t* xq, const float* sa, const float* S,
                     size_t ldx, size_t tokens, size_t cols, Tile& tile, float* o, size_t ldo) {
    if (row_form(m, n, tokens))
        return row_products(m, e, r0, n, xq, sa, S, ldx, tokens, cols, tile, o, ldo);
    const size_t K = m.in(), ks = slice_of(m);
    float* sw = tile.sw.data();
    float* zs = tile.zs.data();
    for (size_t k0 = 0; k0 < K; k0 += ks) {
        const size_t kn = std::min(ks, K - k0), gn = kn / m.group;
        prepare(m, e, r0, n, k0, kn, tile.w.data(), sw, zs);
        const auto block = [&](auto vec, auto c, auto vs, size_t t, auto tail) {
            constexpr int C = decltype(c)::value, V = decltype(vs)::value, H = decltype(tail)::value;
            const int32_t* xs = xq + (k0 / 4) * ldx + t;
            const float *ss = sa + (k0 / kGroup) * ldx + t, *Ss = S + (k0 / m.group) * ldx + t;
            if (m.w4)
                run<decltype(vec), C, V, true, H>(m.w + (e * m.out + r0) * (K / 2) + k0 / 2, K / 2, sw, zs, gn, m.group, n, kn, xs,
                                                  ss, Ss, ldx, o + t, ldo, k0 > 0, t == 0);
            else
                run<decltype(vec), C, V, false, H>(tile.w.data(), kn, sw, zs, gn, m.group, n, kn, xs, ss, Ss, ldx, o + t, ldo, k0 > 0,
                                                   false);
        };
        using std::integral_constant;
        const integral_constant<int, 0> whole;
        const size_t vecs = cols / Zmm::kLanes;
        if (cols % Zmm::kLanes == 0 || vecs == 0) {
            // weight rows per block of 2, 1 and 3 zmm vectors: 4, 8 and 2, which divide the tasks'
            // 128 rows (the bf16 tiles' 6 left two rows to single-row kernels: the op 2-3% slower at
            // 1024 tokens) and keep a block's registers within the 32 (2 C V accumulators, 2 V
            // token vectors)
            token_blocks<4, 8, 2>(vecs, [&](auto c, auto vs, size_t v) { block(Zmm{}, c, vs, v * Zmm::kLanes, whole); });
            if (cols % Zmm::kLanes != 0)  // at most 8 tokens: a ymm vector alone
                block(Ymm{}, integral_constant<int, kYmmRows>{}, integral_constant<int, 1>{}, 0, whole);
        } else {
            // The last 8 tokens' ymm vector in the pass of the last one or two zmm vectors (4 rows a
            // block), pairs before them: one pass over the rows' words fewer, the same bits. Zen 4
            // EPYC, against a pass of its own: one 512 x 2048 expert alone 0.78-0.80x the time at
            // 20-24 tokens, 0.84-0.86x at 40 and 56; the op (E = 256, calls alternating) 0.90-0.91x
            // at 513 tokens, 0.97x at 1024, 0.98-1.00x at 2048 (docs/perf-log.md, session 45).
            const size_t last = vecs % 2 == 1 ? 1 : 2;
            token_blocks<4, 8, 2>(vecs - last, [&](auto c, auto vs, size_t v) { block(Zmm{}, c, vs, v * Zmm::kLanes, whole); });
            const size_t t = (vecs - last) * Zmm::kLanes;
            if (last == 1)
                block(Zmm{}, integral_constant<int, 4>{}, integral_constant<int, 1>{}, t, integral_constant<int, 1>{});
            else
                block(Zmm{}, integral_constant<int, 4>{}, integral_constant<int, 2>{}, t, integral_constant<int, 1>{});
        }
    }
}

// M rows of K inputs quantized (`quantize_row`, the rows in parallel): row t's bytes at q + t K,
// its scales at s + t gs (gs = K / kGroup), its sums at S + t gw (gw = K / group).
struct QuantizedRows {
    size_t K, gs, gw;
    Scratch<int8_t> q_buffer;
    Scratch<float> s_buffer, S_buffer;
    QuantizedRows(const float* x, size_t M, size_t K_, size_t group)
        : K(K_), gs(K_ / kGroup), gw(K_ / group), q_buffer(M * K_), s_buffer(M * gs), S_buffer(M * gw) {
        tbb::parallel_for(size_t(0), M, [&](size_t t) {
            quantize_row(x + t * K, K, group, q_buffer.data() + t * K, s_buffer.data() + t * gs, S_buffer.data() + t * gw);
        });
    }

    // Rows row(0) .. row(m - 1) as the lane form's columns, nl of them (zero past m): their words of
    // four inputs into xT (K / 4 x nl), scales into sa (gs x nl) and sums into S (gw x nl).
    template <class Row>
    void columns(size_t m, Row row, size_t nl, float* xT, float* sa, float* S) {
        thread_local std::vector<const float*> rows;
        thread_local std::vector<float> zero;
        rows.resize(m);
        zero.assign(K / 4, 0.0f);
        for (size_t i = 0; i < m; ++i)
            rows[i] = reinterpret_cast<const float*>(q_buffer.data() + row(i) * K);
        transpose_rows(rows.data(), m, zero.data(), K / 4, xT, nl);
        std::fill(sa, sa + gs * nl, 0.0f);
        std::fill(S, S + gw * nl, 0.0f);
        for (size_t i = 0; i < m; ++i) {
            const size_t t = row(i);
            for (size_t G = 0; G < gs; ++G)
                sa[G * nl + i] = s_buffer.data()[t * gs + G];
            for (size_t G = 0; G < gw; ++G)
                S[G * nl + i] = S_buffer.data()[t * gw + G];
        }
    }
};

// A compressed dense matmul's rows on these tiles, for Q16Linear's `tile_rows` with `tile_int8`:
// y [M, N] = x [M, K] . W^T, W's N rows taken as one expert's and x's M rows as its tokens, in the
// lane form (padded to kPad), as bf16::dense does on the bf16 tiles. What it is for: a
// prefill chunk's last rows past the plugin's row blocks (kernels/q16_decode.py: TAIL_ROWS) in a
// model whose plugin quantizes these matmuls' activations to int8 per 32 inputs itself. False,
// computing nothing, where the tiles do not apply (no AVX512-VNNI, u8 weights, groups or K not
// whole activation groups) and for at most bf16::kDotTokens rows, which the bf16 tiles' dot or
// fused form takes (as an expert of that many tokens).
inline bool dense(const q16::Weights& W, const float* x, size_t M, float* y) {
    if (!supported() || !W.w4 || W.K % kGroup != 0 || W.group % kGroup != 0 || M <= bf16::kDotTokens)
        return false;
    const Packed m{W.w, W.z, W.w4, W.z4, W.s, W.s16, W.N, W.K / W.group, W.group};
    const size_t K = W.K, lanes = padded(M);
    QuantizedRows rows(x, M, K, W.group);
    Scratch<float> xT_buffer(K / 4 * lanes);
    std::vector<float> sa(rows.gs * lanes), S(rows.gw * lanes);
    rows.columns(M, [](size_t i) { return i; }, lanes, xT_buffer.data(), sa.data(), S.data());
    const auto* xq = reinterpret_cast<const int32_t*>(xT_buffer.data());
    dense_tasks(m, W.N, M, lanes, y, [&](size_t r0, size_t n, float* o) {
        thread_local Tile tile;
        tile.fit(m, kGateRows);
        products(m, 0, r0, n, xq, sa.data(), S.data(), lanes, M, lanes, tile, o, lanes);
    });
    return true;
}

}  // namespace int8
}  // namespace experts
}  // namespace iq36
