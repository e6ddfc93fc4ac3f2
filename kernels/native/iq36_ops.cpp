// iq36 native ops: OpenVINO extension operations for the CPU device, built by kernels/native.py
// (`make setup` or on first use) from the openvino wheel's own headers and libraries.
//
// The CPU plugin runs an extension op through `evaluate()` on the plugin's thread; the op
// parallelises itself with TBB, the plugin's own threading runtime, so it shares its workers.
//
// The ops: U8Linear (u8_linear.hpp: the int8 LM head's GEMV) and U4Experts (u4_experts.hpp: a
// MoE block's routed experts for a chunk of tokens, on the u4 weights) and GatedDeltaRule
// (gated_delta.hpp: a linear-attention layer's recurrence over a chunk of tokens) and Q16Linear
// (q16_linear.hpp: a compressed-weights matmul for decode rows on int16-rounded activations; its
// u4 products also in an AVX-VNNI form, q16_u4_dot.inc, chosen at run time) and
// CausalConv1d (causal_conv.hpp: a linear-attention layer's short convolution, token-major) and
// CausalAttention (causal_attention.hpp: a full-attention layer's attention over a prefill chunk) and
// DecodeAttention (decode_attention.hpp: its attention for a decode token over a u8 cache of its own,
// which the engine reaches through the `iq36_kv_*` functions below).

#include "u8_linear.hpp"
#include "u4_experts.hpp"
#include "gated_delta.hpp"
#include "q16_linear.hpp"
#include "causal_conv.hpp"
#include "causal_attention.hpp"
#include "decode_attention.hpp"

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<iq36::U8Linear>>(),
    std::make_shared<ov::OpExtension<iq36::U4Experts>>(),
    std::make_shared<ov::OpExtension<iq36::GatedDeltaRule>>(),
    std::make_shared<ov::OpExtension<iq36::Q16Linear>>(),
    std::make_shared<ov::OpExtension<iq36::CausalConv1d>>(),
    std::make_shared<ov::OpExtension<iq36::CausalAttention>>(),
    std::make_shared<ov::OpExtension<iq36::DecodeAttention>>(),
}));

// DecodeAttention's KV stores for the engine (kernels/native_decode_attention.py: KvStore, through
// ctypes on this library, which the process has loaded once for OpenVINO: the same stores). A
// store is named by the engine's id and a layer's slot; rows move as [Hkv, len, W] for K and for
// V. The calls return 0, or -1 where they do not match the store (dims, length), touching nothing.
#define IQ36_API extern "C" __attribute__((visibility("default")))

IQ36_API int64_t iq36_kv_length(int64_t id, int64_t slot) {
    const auto store = iq36::dattn::find_store(id, slot, false);
    return store ? static_cast<int64_t>(store->length()) : 0;
}

IQ36_API int iq36_kv_read(int64_t id, int64_t slot, uint8_t* k, uint8_t* v, int64_t hkv, int64_t len, int64_t W) {
    const auto store = iq36::dattn::find_store(id, slot, false);
    const size_t n = static_cast<size_t>(len), w = static_cast<size_t>(W);
    if (!store)
        return len == 0 ? 0 : -1;
    if (store->length() != n || (n && (store->heads() != static_cast<size_t>(hkv) || store->row_bytes() != w)))
        return -1;
    for (size_t h = 0; h < static_cast<size_t>(hkv) && n; ++h) {
        std::memcpy(k + h * n * w, store->keys(h), n * w);
        std::memcpy(v + h * n * w, store->values(h), n * w);
    }
    return 0;
}

IQ36_API int iq36_kv_write(int64_t id, int64_t slot, const uint8_t* k, const uint8_t* v, int64_t hkv, int64_t len,
                           int64_t W) {
    if (hkv <= 0 || len < 0 || W <= 0)
        return -1;
    const auto store = iq36::dattn::find_store(id, slot, true);
    const size_t n = static_cast<size_t>(len), w = static_cast<size_t>(W);
    // what it held is replaced whole (keep 0 rows), with room for a reply's decode steps past the
    // restored rows before the first doubling copy
    store->reserve(static_cast<size_t>(hkv), w, n + 1024, 0);
    for (size_t h = 0; h < static_cast<size_t>(hkv) && n; ++h) {
        std::memcpy(store->keys(h), k + h * n * w, n * w);
        std::memcpy(store->values(h), v + h * n * w, n * w);
    }
    store->set_length(n);
    return 0;
}

// Set a store from f32 rows [Hkv, len, D] for K and for V (a prefill graph's cache, in the form
// its state holds), each row quantised as the op quantises its own token's rows: the handoff from
// prefill to the decode graph, which numpy's `pack` took ~80 ms for at 4096 tokens (dev-bench).
IQ36_API int iq36_kv_write_f32(int64_t id, int64_t slot, const float* k, const float* v, int64_t hkv, int64_t len,
                               int64_t D) {
    if (hkv <= 0 || len < 0 || D <= 0 || D % 8)
        return -1;
    const auto store = iq36::dattn::find_store(id, slot, true);
    const size_t H = static_cast<size_t>(hkv), n = static_cast<size_t>(len), d = static_cast<size_t>(D);
    const size_t w = d + iq36::dattn::kExtra;
    store->reserve(H, w, n + 1024, 0);  // as iq36_kv_write
    constexpr size_t kRows = 256;       // rows per task
    const size_t blocks = (n + kRows - 1) / kRows;
    tbb::parallel_for(tbb::blocked_range<size_t>(0, 2 * H * blocks), [&](const tbb::blocked_range<size_t>& r) {
        for (size_t i = r.begin(); i != r.end(); ++i) {
            const size_t which = i / (H * blocks), h = i / blocks % H, j0 = i % blocks * kRows;
            const float* src = (which ? v : k) + (h * n + j0) * d;
            uint8_t* dst = (which ? store->values(h) : store->keys(h)) + j0 * w;
            for (size_t j = j0; j < std::min(n, j0 + kRows); ++j, src += d, dst += w)
                iq36::dattn::quantize_row(src, d, dst);
        }
    });
    store->set_length(n);
    return 0;
}

// Forget every store of `id` (their memory included): an engine's reset and close.
IQ36_API void iq36_kv_drop(int64_t id) {
    std::lock_guard<std::mutex> lock(iq36::dattn::registry_lock());
    auto& stores = iq36::dattn::registry();
    stores.erase(stores.lower_bound({id, INT64_MIN}), stores.upper_bound({id, INT64_MAX}));
}

// For tests (tests/test_native.py, through ctypes): out = silu(g) * u on the AVX-512 path (`vector`
// nonzero, where the CPU has it) or the scalar one; and the count of floats x = bits i * step
// (|x| < vexp::kLimit) whose vector expf differs from the scalar expf in any bit.
IQ36_API void iq36_silu_mul(const float* g, const float* u, int64_t n, float* out, int vector) {
    if (vector && iq36::vexp::supported())
        return iq36::vexp::silu_mul_avx512(g, u, static_cast<size_t>(n), out);
    iq36::vexp::silu_mul_scalar(g, u, static_cast<size_t>(n), out);
}

IQ36_API int64_t iq36_expf_mismatches(int64_t step) {
    return iq36::vexp::supported() ? static_cast<int64_t>(iq36::vexp::mismatches(static_cast<uint64_t>(step))) : -1;
}
