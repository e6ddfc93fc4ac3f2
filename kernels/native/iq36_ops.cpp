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
// DecodeAttention (decode_attention.hpp: its attention for a decode token over a u8 cache of its own).

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
