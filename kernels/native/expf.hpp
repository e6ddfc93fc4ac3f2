// expf on 16 floats at a time (AVX-512F), giving glibc's expf bit for bit where |x| < 87, and the
// experts' silu(g) * u on it.
//
// glibc's expf (2.28 on; the one the ops' scalar `std::exp(float)` calls) evaluates in double:
// k = round(x 32 / ln 2), r = x 32 / ln 2 - k, 2^(k / 32) from a table of 32 doubles by k % 32
// with k / 32 added to the exponent, times a cubic in r, rounded to float once. Done here on 8
// doubles a vector with the same constants and operations (whether the compiler fused a
// multiply-add moves the double by a few units of 2^-52, far below the float's rounding step):
// every float with |x| < 87 gives the platform's expf bits, with and without those fusions
// (2,237,399,040 inputs, docs/perf-log.md, session 45; tests/test_native.py checks a sample on
// the machine it runs on). Inputs past that (overflow, underflow to subnormals, infinities, NaN)
// go to the scalar expf.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#define IQ36_EXPF __attribute__((target("avx512f,avx512dq")))

namespace iq36 {
namespace vexp {

constexpr int kTableBits = 5, kTable = 1 << kTableBits;

inline bool supported() {
    static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return yes;
}

// t[i] = bits(2^(i / 32)) - (i << 47): adding k << 47 to t[k % 32] makes the bits of 2^(k / 32)
// (the exponent takes k / 32, the table's mantissa the rest).
struct Table {
    alignas(64) uint64_t t[kTable];
    Table() {
        for (int i = 0; i < kTable; ++i) {
            const double v = static_cast<double>(std::exp2l(static_cast<long double>(i) / kTable));
            uint64_t bits;
            std::memcpy(&bits, &v, sizeof bits);
            t[i] = bits - (static_cast<uint64_t>(i) << (52 - kTableBits));
        }
    }
};
inline const Table& table() {
    static const Table t;
    return t;
}

constexpr double kInvLn2N = 0x1.71547652b82fep+0 * kTable;  // 32 / ln 2
constexpr double kShift = 0x1.8p+52;                        // rounds to an integer in the low bits
constexpr double kC0 = 0x1.c6af84b912394p-5 / kTable / kTable / kTable;
constexpr double kC1 = 0x1.ebfce50fac4f3p-3 / kTable / kTable;
constexpr double kC2 = 0x1.62e42ff0c52d6p-1 / kTable;
constexpr float kLimit = 87.0f;  // |x| below: the vector path

struct Tables {
    __m512d t0, t1, t2, t3;  // entries 0-7, 8-15, 16-23, 24-31
};

IQ36_EXPF inline Tables load_tables() {
    const double* t = reinterpret_cast<const double*>(table().t);
    return {_mm512_load_pd(t), _mm512_load_pd(t + 8), _mm512_load_pd(t + 16), _mm512_load_pd(t + 24)};
}

IQ36_EXPF inline __m512d exp_pd(__m512d x, const Tables& T) {
    const __m512d shift = _mm512_set1_pd(kShift);
    const __m512d z = _mm512_mul_pd(_mm512_set1_pd(kInvLn2N), x);
    const __m512d kd = _mm512_add_pd(z, shift);  // k in the low bits
    const __m512d r = _mm512_sub_pd(z, _mm512_sub_pd(kd, shift));
    const __m512i k = _mm512_castpd_si512(kd);
    const __m512d low = _mm512_permutex2var_pd(T.t0, k, T.t1), high = _mm512_permutex2var_pd(T.t2, k, T.t3);  // k % 16
    const __m512d t = _mm512_mask_blend_pd(_mm512_test_epi64_mask(k, _mm512_set1_epi64(16)), low, high);
    const __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(_mm512_castpd_si512(t), _mm512_slli_epi64(k, 52 - kTableBits)));
    const __m512d p = _mm512_fmadd_pd(_mm512_set1_pd(kC0), r, _mm512_set1_pd(kC1));
    const __m512d q = _mm512_fmadd_pd(_mm512_set1_pd(kC2), r, _mm512_set1_pd(1.0));
    return _mm512_mul_pd(_mm512_fmadd_pd(p, _mm512_mul_pd(r, r), q), s);
}

// expf of 16 floats, each |x| < kLimit.
IQ36_EXPF inline __m512 exp16(__m512 x, const Tables& T) {
    const __m512d a = exp_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), T);
    const __m512d b = exp_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))), T);
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(a)), _mm512_cvtpd_ps(b), 1);
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// out[i] = silu(g[i]) * u[i] for i < n, one at a time.
inline void silu_mul_scalar(const float* g, const float* u, size_t n, float* out) {
    for (size_t i = 0; i < n; ++i)
        out[i] = silu(g[i]) * u[i];
}

IQ36_EXPF inline void silu_mul_avx512(const float* g, const float* u, size_t n, float* out) {
    const Tables T = load_tables();
    const __m512 limit = _mm512_set1_ps(kLimit), sign = _mm512_set1_ps(-0.0f), one = _mm512_set1_ps(1.0f);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(g + i);
        if (_mm512_cmp_ps_mask(_mm512_andnot_ps(sign, v), limit, _CMP_LT_OQ) != 0xFFFF) {  // a large |v| or a NaN
            silu_mul_scalar(g + i, u + i, 16, out + i);
            continue;
        }
        const __m512 e = exp16(_mm512_xor_ps(v, sign), T);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
    silu_mul_scalar(g + i, u + i, n - i, out + i);
}

// Of in[0 .. n) (n <= 16, 16 readable), how many exp16 gives other bits than std::exp.
IQ36_EXPF inline uint64_t differing(const float* in, int n, const Tables& T) {
    alignas(64) float got[16];
    _mm512_store_ps(got, exp16(_mm512_loadu_ps(in), T));
    uint64_t bad = 0;
    for (int i = 0; i < n; ++i) {
        const float want = std::exp(in[i]);
        bad += std::memcmp(&want, &got[i], sizeof want) != 0;
    }
    return bad;
}

// The floats x with bits i * step (i = 0, 1, ...; |x| < kLimit) whose exp16 differs from std::exp.
IQ36_EXPF inline uint64_t mismatches(uint64_t step) {
    const Tables T = load_tables();
    float in[16] = {};
    uint64_t bad = 0;
    int n = 0;
    for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += step) {
        const uint32_t b = static_cast<uint32_t>(bits);
        float x;
        std::memcpy(&x, &b, sizeof x);
        if (!(std::fabs(x) < kLimit))
            continue;
        in[n++] = x;
        if (n == 16) {
            bad += differing(in, n, T);
            n = 0;
        }
    }
    return n > 0 ? bad + differing(in, n, T) : bad;
}

// out[i] = silu(g[i]) * u[i] for i < n, the bits of the scalar expression (`silu`); out may be g or u.
inline void silu_mul(const float* g, const float* u, size_t n, float* out) {
    if (supported())
        return silu_mul_avx512(g, u, n, out);
    silu_mul_scalar(g, u, n, out);
}

}  // namespace vexp
}  // namespace iq36
