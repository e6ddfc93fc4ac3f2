// U4Experts' bf16 lane-form products on AMX tiles (`tdpbf16ps`), where the CPU has AMX-BF16 and
// the kernel grants the process its tile state.
//
// The operands already have AMX's layouts: the decompressed tile (n weight rows x kn inputs,
// bf16 (q - z), row-major) is the A operand, 16 rows x 32 inputs per tile; the token columns as
// input pairs (xp[k / 2][t] = bf16 x[t][k] | bf16 x[t][k + 1] << 16) are the B operand in its
// pair-interleaved form, 16 pairs x 16 tokens per tile. So nothing is repacked. One tdpbf16ps is
// 16 x 16 x 32 multiply-adds, 16x those of a zmm vdpbf16ps.
//
// Numerics as the vdpbf16ps tiles: every product (q - z) * x is exact in f32, each group's sum
// is an f32 sum in the unit's order (tile C, zeroed per group), the group's scale multiplies the
// group's sum (the tile stored, scaled and added in f32 vectors). Only the order of the f32 sums
// differs from the vector tiles.
//
// Tile state is per thread and shared with the CPU plugin's own AMX kernels on the same threads:
// `TileScope` saves the thread's tile configuration, loads ours and restores the saved one (or
// releases the tiles) when it ends, so a kernel of the plugin that keeps its configuration loaded
// between calls finds it as it left it.
//
// `IQ36_AMX=0` in the environment keeps these products on the vector tiles (A/B timings, tests).
#pragma once

#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#define IQ36_AMX_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

namespace iq36 {
namespace experts {
namespace amx {

// Whether this process may use AMX-BF16: the CPU has it, the kernel grants the tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM; idempotent, the plugin asks too) and IQ36_AMX is not "0".
inline bool supported() {
    static const bool yes = [] {
        const char* env = std::getenv("IQ36_AMX");
        if (env && std::strcmp(env, "0") == 0)
            return false;
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
            return false;
        const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
        if (!tile || !bf16)
            return false;
        constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
    }();
    return yes;
}

// ldtilecfg's 64-byte block: palette 1, every tile 16 rows of 64 bytes.
struct alignas(64) Config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// ldtilecfg / sttilecfg with their whole 64 bytes as the asm's operand (GCC's intrinsics name
// only the first 8, so the compiler may drop the stores that fill a block before it is loaded).
inline void load_config(const Config& c) {
    asm volatile("ldtilecfg %0" ::"m"(*reinterpret_cast<const uint8_t(*)[64]>(&c)));
}
inline void store_config(Config& c) {
    asm volatile("sttilecfg %0" : "=m"(*reinterpret_cast<uint8_t(*)[64]>(&c)));
}

inline const Config& ours() {
    static const Config config = [] {
        Config c{};
        c.palette = 1;
        for (int t = 0; t < 8; ++t) {
            c.colsb[t] = 64;
            c.rows[t] = 16;
        }
        return c;
    }();
    return config;
}

// Our configuration loaded for the scope's lifetime; the thread's previous one restored after.
class TileScope {
public:
    IQ36_AMX_FN TileScope() {
        store_config(saved_);  // all zeros when the thread's tiles are not configured
        load_config(ours());
    }
    IQ36_AMX_FN ~TileScope() {
        if (saved_.palette != 0)
            load_config(saved_);
        else
            _tile_release();
    }
    TileScope(const TileScope&) = delete;
    TileScope& operator=(const TileScope&) = delete;

private:
    Config saved_;
};

// GCC's tile intrinsics are asm statements that do not tell the compiler which memory they read
// or write: a barrier before tile loads (the operands were just written) and after tile stores.
inline void barrier() { asm volatile("" ::: "memory"); }

// o (RB * 16 rows x VB * 16 tokens, ldo apart) (+)= the tile's rows [0, RB * 16) . the pairs'
// tokens [0, VB * 16). Tiles: C 0-3 (row block rb, token block vb at 2 rb + vb), A 4-5, B 6-7.
// Each group's sums go through `c` (4 x 16 x 16 floats) to be scaled into o.
template <int RB, int VB>
IQ36_AMX_FN inline void block(const uint16_t* w, size_t ldw, const float* s, size_t lds, size_t group, size_t kn,
                              const uint32_t* xp, size_t ldx, float* o, size_t ldo, bool add, float* c) {
    const size_t wstride = ldw * sizeof(uint16_t), xstride = ldx * sizeof(uint32_t);
    for (size_t g0 = 0; g0 < kn; g0 += group) {
        _tile_zero(0);
        if (VB > 1)
            _tile_zero(1);
        if (RB > 1) {
            _tile_zero(2);
            if (VB > 1)
                _tile_zero(3);
        }
        barrier();
        for (size_t k = g0; k < g0 + group; k += 32) {
            _tile_loadd(4, w + k, wstride);
            if (RB > 1)
                _tile_loadd(5, w + 16 * ldw + k, wstride);
            _tile_loadd(6, xp + (k / 2) * ldx, xstride);
            if (VB > 1)
                _tile_loadd(7, xp + (k / 2) * ldx + 16, xstride);
            _tile_dpbf16ps(0, 4, 6);
            if (VB > 1)
                _tile_dpbf16ps(1, 4, 7);
            if (RB > 1) {
                _tile_dpbf16ps(2, 5, 6);
                if (VB > 1)
                    _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c, 64);
        if (VB > 1)
            _tile_stored(1, c + 256, 64);
        if (RB > 1) {
            _tile_stored(2, c + 512, 64);
            if (VB > 1)
                _tile_stored(3, c + 768, 64);
        }
        barrier();
        const bool first = g0 == 0 && !add;
        const size_t g = g0 / group;
        for (int rb = 0; rb < RB; ++rb)
            for (int r = 0; r < 16; ++r) {
                const size_t row = rb * 16 + r;
                const __m512 sc = _mm512_set1_ps(s[row * lds + g]);
#pragma GCC unroll 2
                for (int vb = 0; vb < VB; ++vb) {
                    const __m512 sum = _mm512_load_ps(c + (2 * rb + vb) * 256 + r * 16);
                    float* dst = o + row * ldo + vb * 16;
                    _mm512_storeu_ps(dst, first ? _mm512_mul_ps(sum, sc) : _mm512_fmadd_ps(sum, sc, _mm512_loadu_ps(dst)));
                }
            }
    }
}

// Whether `gemm` below can take a tile of this group (whole tdpbf16ps steps of 32 inputs).
inline bool fits(size_t group) { return group % 32 == 0 && supported(); }

// As bf16::gemm for the rows [0, n - n % 16); the caller takes the remaining rows. Must run
// inside a TileScope.
IQ36_AMX_FN inline void gemm(const uint16_t* w, const float* s, size_t group, size_t n, size_t kn, const uint32_t* xp,
                             size_t ldx, size_t vecs, float* o, size_t ldo, bool add) {
    alignas(64) float c[4 * 256];
    const size_t gn = kn / group, rows = n / 16 * 16;
    for (size_t r = 0; r < rows; r += 32) {
        const bool two = r + 32 <= rows;
        const uint16_t* wr = w + r * kn;
        for (size_t v = 0; v < vecs; v += 2) {
            const bool pair = v + 2 <= vecs;
            float* dst = o + r * ldo + v * 16;
            const uint32_t* x = xp + v * 16;
            if (two && pair)
                block<2, 2>(wr, kn, s + r * gn, gn, group, kn, x, ldx, dst, ldo, add, c);
            else if (two)
                block<2, 1>(wr, kn, s + r * gn, gn, group, kn, x, ldx, dst, ldo, add, c);
            else if (pair)
                block<1, 2>(wr, kn, s + r * gn, gn, group, kn, x, ldx, dst, ldo, add, c);
            else
                block<1, 1>(wr, kn, s + r * gn, gn, group, kn, x, ldx, dst, ldo, add, c);
        }
    }
}

}  // namespace amx
}  // namespace experts
}  // namespace iq36
