// Helpers shared by iq36's native ops.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

namespace iq36 {

// An allocator on cache-line boundaries: an AMX tile row or a zmm load that straddles two lines
// costs two (tile loads measured ~6x slower from a 16-byte aligned buffer).
template <class T>
struct LineAligned {
    using value_type = T;
    static constexpr std::align_val_t kAlign{64};
    LineAligned() = default;
    template <class U>
    LineAligned(const LineAligned<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
    void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
    template <class U>
    bool operator==(const LineAligned<U>&) const { return true; }
    template <class U>
    bool operator!=(const LineAligned<U>&) const { return false; }
};
template <class T>
using AlignedVector = std::vector<T, LineAligned<T>>;

// `IQ36_NATIVE_POISON=1`: every `Scratch` buffer is filled with all-ones bytes (NaN as f32 and
// bf16) at every call, so a test sees any element read before the call wrote it.
inline bool poison_scratch() {
    static const bool yes = [] {
        const char* env = std::getenv("IQ36_NATIVE_POISON");
        return env && std::strcmp(env, "1") == 0;
    }();
    return yes;
}

// A buffer of at least n elements kept between calls, one per calling thread and element type: it grows,
// never shrinks, and holds whatever the last call left. A large std::vector per call is a fresh
// mmap (glibc serves blocks above 32 MB so) whose every page faults in again, zeroed, at each
// call. Should the same thread ask for the same buffer while it is held (a nested call), it gets
// a buffer of its own for that call.
template <class T>
class Scratch {
public:
    explicit Scratch(size_t n) {
        Slot& slot = held();
        if (!slot.busy) {
            slot.busy = true;
            slot_ = &slot;
            buffer_ = &slot.buffer;
        } else {
            buffer_ = &own_;
        }
        if (buffer_->size() < n)
            *buffer_ = AlignedVector<T>(n);
        if (poison_scratch() && n > 0)
            std::memset(static_cast<void*>(buffer_->data()), 0xFF, n * sizeof(T));
    }
    ~Scratch() {
        if (slot_)
            slot_->busy = false;
    }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    T* data() { return buffer_->data(); }

private:
    struct Slot {
        AlignedVector<T> buffer;
        bool busy = false;
    };
    static Slot& held() {
        thread_local Slot slot;
        return slot;
    }
    Slot* slot_ = nullptr;
    AlignedVector<T>* buffer_ = nullptr;
    AlignedVector<T> own_;
};

// True when the environment sets `name` to "0" (the native ops' switches, e.g. IQ36_NATIVE_AVX512).
inline bool env_off(const char* name) {
    const char* env = std::getenv(name);
    return env && std::strcmp(env, "0") == 0;
}

// A byte count from the environment (`name` set to a decimal number, taken as whole cache lines, at
// most 1 MB), else `fallback`: the native ops' tuning knobs, read once, for A/B runs of whole
// processes (tests/bench_env_pair.py).
inline size_t env_bytes(const char* name, size_t fallback) {
    const char* env = std::getenv(name);
    if (!env || !*env)
        return fallback;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    return *end == '\0' && v <= (1u << 20) ? static_cast<size_t>(v) / 64 * 64 : fallback;
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The greedy choice over a vector, as numpy's argmax: the first NaN if there is one, else the
// first of the largest values. Parts of the vector reduce in any order (`merge` is commutative).
struct Top {
    float value = -std::numeric_limits<float>::infinity();
    int64_t index = -1;  // none yet

    void merge(const Top& other) {
        if (other.index < 0)
            return;
        if (index < 0) {
            *this = other;
            return;
        }
        const bool nan = std::isnan(value), other_nan = std::isnan(other.value);
        if (nan != other_nan) {
            if (other_nan)
                *this = other;
        } else if (nan || other.value == value) {
            if (other.index < index)
                *this = other;
        } else if (other.value > value) {
            *this = other;
        }
    }
};

// `Top` of y[0, n), its indices counted from `base`: one vector pass for the maximum (and whether
// any NaN is there), a second up to its first place.
inline Top top_of(const float* y, size_t n, int64_t base) {
    if (n == 0)
        return {};
    __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 unordered = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(y + i);
        mx = _mm256_max_ps(mx, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float best = -std::numeric_limits<float>::infinity();
    bool nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    for (float lane : lanes)
        best = std::max(best, lane);
    for (; i < n; ++i) {
        nan = nan || std::isnan(y[i]);
        best = std::max(best, y[i]);
    }
    const __m256 target = _mm256_set1_ps(best);
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(y + j);
        const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
        if (hits) {
            j += static_cast<size_t>(__builtin_ctz(static_cast<unsigned>(hits)));
            return {y[j], base + static_cast<int64_t>(j)};
        }
    }
    for (; j < n; ++j)
        if (nan ? std::isnan(y[j]) : y[j] == best)
            return {y[j], base + static_cast<int64_t>(j)};
    return {best, base};  // not reached: some value is the maximum
}

}  // namespace iq36
