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
//   top    i64 [...]                  with the `top` attribute only: argmax_n y[n] of each row, as
//                                     numpy's (`Top`); the LM head's greedy choice, taken while each
//                                     task's logits are in its core's cache
//
// How: each row of x is cut into blocks of 128 inputs, and each block is written as two integer
// terms against its own scale sx = max |x| / 32767: x = sx * (q + lo / L), |q| <= 32767, lo the
// rounded residual of q (u8 weights: int16, L = 65536; u4 weights: int8, L = 256, which already
// resolves f32's own rounding of x / sx). Then over a block, sum (w - zp) x =
// sx * (sum w q + (sum w lo) / L - zp * sum (q + lo / L)): the sums are exact in int32, the zero
// point enters once per group, and the blocks are combined in f32 with the weights' scales. The
// results are as close to float64 as the plugin's f32 kernels (tests/test_q16_decode.py), with
// only summation order differing. Per 64 u4 weights the loop is one load, three byte ops and six
// byte products (q's two bytes and lo, each against the weights' bytes; q16_u4_dot.inc); per 16
// u8 weights one widening load and two pmaddwd. The plugin widens each weight to f32 (convert,
// subtract, FMA), which is what bounds its kernels at batch 1 on an AVX2 CPU without VNNI
// (docs/perf-log.md).
//
// Threads: rows of w in tasks (TBB); each task reads its weight rows once for every row of x.
#pragma once

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
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
constexpr size_t kMaxInputs = 32768;  // u4 rows: `dot_u4` keeps a row's block scales on the stack

// One row of x as two terms per input against a scale per block of 128 inputs, sx = max |x| / 32767:
// x = sx * (q + lo / L), |q| <= 32767. u8 weights: lo int16, L = 65536, q and lo in input order.
// u4 weights: lo int8, L = 256, and q as its two bytes q = 256 * qh + ql (qh int8, ql u8), all
// three in the order `block_u4` reads them (below). Per weight group, zq = sum over its blocks of
// sx * sum (q + lo / L) (for the zero points).
//
// An int8 `lo` resolves 2^-9 of q's unit: f32's own rounding of x * 32767 / max |x| near the
// block's largest magnitude (2^-24 of 32767), so the second term adds no precision beyond it at
// 16 bits. With q's bytes apart too, every u4 product is a byte product (u8 x s8: pmaddubsw, or
// vpdpbusd with VNNI) on the weights' bytes as they are unpacked, with no widening to words.
// The byte and word vectors are cache-line aligned: a 32-byte load from a 16-byte aligned
// buffer straddles two lines every other time (AVX2 probe: ~10% of the u4 loop's rate).
//
// Without the residual (`residual` false, u4 weights only): x = sx * q, the int16 term alone,
// rounded to nearest: within sx / 2 = 2^-16 of the block's largest magnitude per input, and the
// products skip lo8's two byte products per 64 weights (a third of them). For activations that
// are bf16 already (the plugin's outputs where it runs bf16) that is below their own rounding:
// an input within 2^8 of the block's largest magnitude is exact at 16 bits, a smaller one's error
// is at most what bf16 rounding costs an input 2^8 times smaller than the largest.
struct Row {
    AlignedVector<int16_t> q, lo;  // u8 weights
    AlignedVector<int8_t> qh, lo8;  // u4 weights (lo8 empty without the residual)
    AlignedVector<uint8_t> ql;
    std::vector<float> sx;
    std::vector<float> zq;
    bool residual = true;
};

// The calling thread's rows for one use (`Slot`), kept between calls so that their buffers are
// reused instead of allocated anew by every call (~1 us of a `Q16Linear` call's ~8 us fixed cost;
// `U4Experts` 0.97-0.99 of its time without the allocations: docs/perf-log.md, session 49). A
// reference: the tasks a call runs on other threads read the caller's rows through it (a
// `thread_local` named inside a task would be the worker's own).
template <int Slot>
inline std::vector<Row>& held_rows() {
    thread_local std::vector<Row> rows;
    return rows;
}

// Where input i of a block of 128 u4 inputs goes. Packed byte j holds inputs 2j (low nibble) and
// 2j + 1 (high nibble); `block_u4` splits a vector of them into the even and odd inputs' bytes
// (e, o) and multiplies each byte by the activation byte in the same place: per vector of packed
// bytes, qh, ql and lo8 = [its even inputs', its odd inputs']. Vectors of 32 bytes (AVX2, AVX-VNNI)
// take a block in two chunks of 64 inputs; a zmm vector takes the whole block.
inline size_t u4_at(size_t i, bool zmm) {
    const size_t chunk = zmm ? 128 : 64;
    return (i & ~(chunk - 1)) + (i & 1) * (chunk / 2) + ((i & (chunk - 1)) >> 1);
}

inline bool use_zmm();

// The low bytes of v's eight int32 lanes, in lane order (each lane's value fits its low byte).
inline __m128i low_bytes(__m256i v) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i b = _mm256_shuffle_epi8(v, pick);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

// x[0, 2, .., 14] and x[1, 3, .., 15] of 16 inputs, each in input order.
inline void even_odd(const float* x, __m256& even, __m256& odd) {
    const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
    const auto order = [](__m256 v) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8)); };
    even = order(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
    odd = order(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Vectorised: a decode step rounds one row per op call on the calling thread while the other
// threads wait, so the scalar form (lrintf per input) cost ~17 us per 2048 inputs. Same values:
// the same f32 products, rounded to nearest even as lrintf does in the default mode. For u4
// weights the inputs are taken as their even and odd halves of each 16, so each run of eight
// lands in its place (`u4_at`) from one vector: 2.3 -> 0.7 us per 2048 inputs (docs/perf-log.md,
// session 37; placing them one by one cost more than the rounding).
inline void quantize(const float* x, size_t K, size_t group, bool nibbles, Row& r, bool residual = true) {
    residual = residual || !nibbles;  // u8 weights keep their int16 residual
    r.residual = residual;
    if (nibbles) {
        r.qh.resize(K);
        r.ql.resize(K);
        r.lo8.resize(residual ? K : 0);
    } else {
        r.q.resize(K);
        r.lo.resize(K);
    }
    r.sx.resize(K / kBlock);
    r.zq.assign(K / group, 0.f);
    const float unit = nibbles ? 256.f : 65536.f;
    const __m256i q_max = _mm256_set1_epi32(32767), q_min = _mm256_set1_epi32(-32767);
    const __m256i l_max = _mm256_set1_epi32(nibbles ? 127 : 32767), l_min = _mm256_set1_epi32(nibbles ? -127 : -32767);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), vunit = _mm256_set1_ps(unit);
    const __m256i byte = _mm256_set1_epi32(0xFF);
    alignas(32) int32_t v[kBlock], l[kBlock];
    const bool zmm = nibbles && use_zmm();
    for (size_t b = 0; b < K / kBlock; ++b) {
        const float* xb = x + b * kBlock;
        __m256 mv = _mm256_setzero_ps();
        for (size_t i = 0; i < kBlock; i += 8)
            mv = _mm256_max_ps(mv, _mm256_and_ps(_mm256_loadu_ps(xb + i), magnitude));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float m = _mm_cvtss_f32(m4);
        const float sx = m / 32767.f;
        const __m256 inv = _mm256_set1_ps(m > 0.f ? 32767.f / m : 0.f);
        __m256i qsum = _mm256_setzero_si256(), lsum = qsum;
        // the two terms of eight inputs (clamped), added to the block's sums
        const auto terms = [&](__m256 xv, __m256i& vi, __m256i& li) {
            const __m256 f = _mm256_mul_ps(xv, inv);
            vi = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(f), q_min), q_max);
            const __m256 res = _mm256_mul_ps(_mm256_sub_ps(f, _mm256_cvtepi32_ps(vi)), vunit);
            li = residual ? _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(res), l_min), l_max) : _mm256_setzero_si256();
            qsum = _mm256_add_epi32(qsum, vi);
            lsum = _mm256_add_epi32(lsum, li);
        };
        if (nibbles) {  // v = 256 * qh + ql, ql in [0, 255]: qh = v >> 8 (floor), ql = v & 255
            int8_t* hb = r.qh.data() + b * kBlock;
            uint8_t* qlb = r.ql.data() + b * kBlock;
            int8_t* lb = residual ? r.lo8.data() + b * kBlock : nullptr;
            for (size_t i = 0; i < kBlock; i += 16) {
                __m256 half[2];
                even_odd(xb + i, half[0], half[1]);
                for (size_t h = 0; h < 2; ++h) {  // inputs i + h, i + h + 2, .. are consecutive from u4_at(i + h)
                    const size_t at = u4_at(i + h, zmm);
                    __m256i vi, li;
                    terms(half[h], vi, li);
                    _mm_storel_epi64(reinterpret_cast<__m128i*>(hb + at), low_bytes(_mm256_srai_epi32(vi, 8)));
                    _mm_storel_epi64(reinterpret_cast<__m128i*>(qlb + at), low_bytes(_mm256_and_si256(vi, byte)));
                    if (lb)
                        _mm_storel_epi64(reinterpret_cast<__m128i*>(lb + at), low_bytes(li));
                }
            }
        } else {
            for (size_t i = 0; i < kBlock; i += 8) {
                __m256i vi, li;
                terms(_mm256_loadu_ps(xb + i), vi, li);
                _mm256_store_si256(reinterpret_cast<__m256i*>(v + i), vi);
                _mm256_store_si256(reinterpret_cast<__m256i*>(l + i), li);
            }
            int16_t* qb = r.q.data() + b * kBlock;
            int16_t* lb = r.lo.data() + b * kBlock;
            for (size_t i = 0; i < kBlock; ++i) {
                qb[i] = static_cast<int16_t>(v[i]);
                lb[i] = static_cast<int16_t>(l[i]);
            }
        }
        alignas(32) int32_t qs[8], ls[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(qs), qsum);
        _mm256_store_si256(reinterpret_cast<__m256i*>(ls), lsum);
        int64_t qt = 0, lt = 0;
        for (int i = 0; i < 8; ++i) {
            qt += qs[i];
            lt += ls[i];
        }
        r.sx[b] = sx;
        r.zq[b * kBlock / group] += static_cast<float>(sx * (static_cast<double>(qt) + static_cast<double>(lt) / unit));
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

// How far ahead in a task's weight rows the products prefetch: u8 rows (the LM head) 8 KB, u4 rows
// 8 KB (docs/perf-log.md, sessions 7, 13, 16 and 48). With the weights on 2 MB pages
// (`anonymous_weights`) 8 KB ahead made the Zen 4 EPYC's decode steps 1-7% shorter than the u8
// rows' earlier 4 KB (paired runs of whole processes; 2 KB: 14-17% longer). `IQ36_U8_AHEAD` and
// `IQ36_U4_AHEAD` (bytes) in the environment override them.
inline const size_t kU8Ahead = env_bytes("IQ36_U8_AHEAD", 8192);
inline const size_t kU4Ahead = env_bytes("IQ36_U4_AHEAD", 8192);

// Which cache the decode products prefetch into: L2 (_MM_HINT_T1). A decode step streams every
// weight byte once, so a line landing in L1 only evicts the activations and tables the loop reuses;
// into L2 the stream kept up better on a Zen 4 EPYC (docs/perf-log.md, session 21: 8192x2048 u4
// 15-19 -> 24-29 GB/s, the whole decode step 33.8 -> 25.0 ms on dev-bench).
#ifndef IQ36_U8_HINT
#define IQ36_U8_HINT _MM_HINT_T1
#endif
#ifndef IQ36_U4_HINT
#define IQ36_U4_HINT _MM_HINT_T1
#endif

// y[n] for one weight row against one rounded row of u8 weights' x.
inline float dot_u8(const Weights& W, size_t n, const Row& r) {
    const size_t groups = W.K / W.group, per = W.group / kBlock;
    const uint8_t* row = W.w + n * W.K;
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
            for (size_t line = 0; line < kBlock; line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(row + b * kBlock + line + kU8Ahead), IQ36_U8_HINT);
            __m256i hi_sum, lo_sum;
            block_u8(row + b * kBlock, q + b * kBlock, lo + b * kBlock, hi_sum, lo_sum);
            const __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo_sum), unit, _mm256_cvtepi32_ps(hi_sum));
            acc = _mm256_fmadd_ps(part, _mm256_set1_ps(s * sx[b]), acc);
        }
        zero_terms += s * static_cast<float>(W.zero(n * groups + g)) * zq[g];
    }
    return hsum(acc) - zero_terms;
}

// The u4 products, in two forms (q16_u4_dot.inc): AVX2, and AVX-VNNI where the CPU has it (the
// target's Panther Lake cores do; so do recent AMD ones). `IQ36_NATIVE_VNNI=0` in the environment
// keeps the AVX2 form (for A/B runs and the bit-identity test).
namespace plain {
#define IQ36_Q16_VNNI 0
#include "q16_u4_dot.inc"
#undef IQ36_Q16_VNNI
}  // namespace plain

#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace vnni {
#define IQ36_Q16_VNNI 1
#include "q16_u4_dot.inc"
#undef IQ36_Q16_VNNI
}  // namespace vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
namespace zmm {
#define IQ36_Q16_VNNI 1
#define IQ36_Q16_ZMM 1
#include "q16_u4_dot.inc"
#undef IQ36_Q16_ZMM
#undef IQ36_Q16_VNNI
}  // namespace zmm
#pragma GCC pop_options

// AVX-VNNI: CPUID leaf 7, sub-leaf 1, EAX bit 4 (GCC 12's __builtin_cpu_supports does not know it).
// `IQ36_NATIVE_VNNI=0` keeps the AVX2 form (and turns the zmm form off too).
inline bool use_vnni() {
    static const bool yes = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 4)))
            return false;
        return !env_off("IQ36_NATIVE_VNNI");
    }();
    return yes;
}

// AVX512-VNNI (and F, BW for the byte ops): the zmm form, on CPUs that have it (this project's
// AVX-512 development machines; not the target's Panther Lake cores, which take `vnni`).
// `IQ36_NATIVE_AVX512=0` keeps the ymm forms.
inline bool use_zmm() {
    static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vnni") && !env_off("IQ36_NATIVE_VNNI") &&
                            !env_off("IQ36_NATIVE_AVX512");
    return yes;
}

// y[0 .. count) for weight rows n to n + count - 1 against one rounded row of x.
inline void dot(const Weights& W, size_t n, size_t count, const Row& r, float* y) {
    if (!W.w4) {
        for (size_t j = 0; j < count; ++j)
            y[j] = dot_u8(W, n + j, r);
    } else if (use_zmm()) {
        r.residual ? zmm::dot_u4_rows<true>(W, n, count, r, y) : zmm::dot_u4_rows<false>(W, n, count, r, y);
    } else if (use_vnni()) {
        r.residual ? vnni::dot_u4_rows<true>(W, n, count, r, y) : vnni::dot_u4_rows<false>(W, n, count, r, y);
    } else {
        r.residual ? plain::dot_u4_rows<true>(W, n, count, r, y) : plain::dot_u4_rows<false>(W, n, count, r, y);
    }
}

}  // namespace q16

namespace experts {
namespace bf16 {
// Rows of x on the routed experts' bf16 tiles: defined in u4_experts_bf16.hpp, which u4_experts.hpp
// includes after this header (one translation unit: iq36_ops.cpp). False where they do not apply.
inline bool dense(const q16::Weights& W, const float* x, size_t M, float* y);
}  // namespace bf16
namespace int8 {
// The same on the int8 tiles (u4_experts_int8.hpp).
inline bool dense(const q16::Weights& W, const float* x, size_t M, float* y);
}  // namespace int8
}  // namespace experts

class Q16Linear final : public ov::op::Op {
public:
    OPENVINO_OP("Q16Linear", "iq36");

    Q16Linear() = default;
    explicit Q16Linear(const ov::OutputVector& args, bool nibbles = false, bool residual = true, int64_t tile_rows = 0,
                       bool tile_int8 = false, bool top = false)
        : Op(args), m_nibbles(nibbles), m_residual(residual), m_tile_rows(tile_rows), m_tile_int8(tile_int8), m_top(top) {
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
        NODE_VALIDATION_CHECK(this, !(m_nibbles || wt == ov::element::u4) || K <= q16::kMaxInputs,
                              "u4 weights take at most 32768 inputs per row");
        const auto& z = get_input_partial_shape(2);
        NODE_VALIDATION_CHECK(this, z.is_static() && ov::shape_size(z.to_shape()) == ws[0] * (K / group),
                              "one zero point per row and group");
        NODE_VALIDATION_CHECK(this, get_input_partial_shape(3).is_static() &&
                                        ov::shape_size(get_input_partial_shape(3).to_shape()) == ws[0] * (K / group),
                              "one scale per row and group");
        auto out = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, out.rank().is_static() && out.rank().get_length() >= 1, "x must have a rank");
        NODE_VALIDATION_CHECK(this, out[out.size() - 1].compatible(static_cast<int64_t>(K)), "x's last dim must be w's K");
        auto rows = out;
        out[out.size() - 1] = static_cast<int64_t>(ws[0]);
        set_output_type(0, ov::element::f32, out);
        if (m_top) {
            rows.resize(rows.size() - 1);
            set_output_type(1, ov::element::i64, rows);
        }
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<Q16Linear>(args, m_nibbles, m_residual, m_tile_rows, m_tile_int8, m_top);
    }

    // nibbles: w is u8 [N, G, g / 2], the packed bytes of u4 weights (the CPU plugin widens a u4
    // constant that none of its own kernels reads to u8; typed u8 the bytes arrive as they are).
    // residual: false rounds x to the int16 term alone for u4 weights (`q16::Row`); u8 weights
    // keep both terms.
    // tile_rows: calls of at least this many rows (0: none) take the routed experts' bf16 tiles
    // (`experts::bf16::dense`) where the CPU has AVX512-BF16 and the weights are u4; the integer
    // products elsewhere. For the plugin's bf16 models: a prefill chunk's last rows past its row
    // blocks (kernels/q16_decode.py: TAIL_ROWS).
    // tile_int8: those rows on the int8 tiles instead (`experts::int8::dense`: activations as int8
    // per 32 inputs, as the plugin quantizes its own compressed matmuls' there) where the CPU has
    // AVX512-VNNI; the bf16 tiles elsewhere.
    // top: a second output, each row's argmax (above).
    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("nibbles", m_nibbles);
        visitor.on_attribute("residual", m_residual);
        visitor.on_attribute("tile_rows", m_tile_rows);
        visitor.on_attribute("tile_int8", m_tile_int8);
        visitor.on_attribute("top", m_top);
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
        std::vector<Top> tops(m_top ? M : 0);
        std::mutex tops_lock;
        if (m_top) {
            ys.pop_back();
            outputs[1].set_shape(ys);
        }
        if (M == 0)
            return true;
        float* y = outputs[0].data<float>();
        if (m_tile_rows > 0 && M >= static_cast<size_t>(m_tile_rows) &&
            ((m_tile_int8 && experts::int8::dense(W, x.data<const float>(), M, y)) ||
             experts::bf16::dense(W, x.data<const float>(), M, y))) {
            for (size_t m = 0; m < tops.size(); ++m)
                tops[m] = top_of(y + m * N, N, 0);
            write_tops(tops, outputs);
            return true;
        }
        std::vector<q16::Row>& rows = q16::held_rows<0>();  // kept at the most rows seen
        rows.resize(std::max(rows.size(), M));
        for (size_t m = 0; m < M; ++m)
            q16::quantize(x.data<const float>() + m * K, K, W.group, W.w4, rows[m], m_residual);
        // Tasks over units of eight weight rows (`dot_u4_8` takes eight at a time), each unit
        // once per row of x while it is in cache.
        constexpr size_t kRows = 8;
        const size_t units = (N + kRows - 1) / kRows, grain = std::max<size_t>(1, N / 64 / kRows);
        tbb::parallel_for(tbb::blocked_range<size_t>(0, units, grain), [&](const tbb::blocked_range<size_t>& r) {
            for (size_t u = r.begin(); u < r.end(); ++u) {
                const size_t n = u * kRows, count = std::min(kRows, N - n);
                for (size_t m = 0; m < M; ++m)
                    q16::dot(W, n, count, rows[m], y + m * N + n);
            }
            if (tops.empty())
                return;
            const size_t n0 = r.begin() * kRows, n1 = std::min(N, r.end() * kRows);
            for (size_t m = 0; m < M; ++m) {
                const Top part = top_of(y + m * N + n0, n1 - n0, static_cast<int64_t>(n0));
                std::lock_guard<std::mutex> hold(tops_lock);
                tops[m].merge(part);
            }
        });
        write_tops(tops, outputs);
        return true;
    }

private:
    static void write_tops(const std::vector<Top>& tops, ov::TensorVector& outputs) {
        if (tops.empty())
            return;
        int64_t* out = outputs[1].data<int64_t>();
        for (size_t m = 0; m < tops.size(); ++m)
            out[m] = tops[m].index;
    }

    // Inputs per row and per group of w [N, K] (one group) or [N, G, g] (g / 2 bytes with nibbles).
    std::pair<size_t, size_t> k_and_group(const ov::Shape& ws) const {
        if (ws.size() == 2)
            return {ws[1], ws[1]};
        const size_t group = ws[2] * (m_nibbles ? 2 : 1);
        return {ws[1] * group, group};
    }

    bool m_nibbles = false;
    bool m_residual = true;
    int64_t m_tile_rows = 0;
    bool m_tile_int8 = false;
    bool m_top = false;
};

}  // namespace iq36
