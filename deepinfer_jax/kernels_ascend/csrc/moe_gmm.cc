// Routed-expert FFN on CPU (kernels_pallas/moe_gmm_ref.py): per (token, slot) routed to expert
// e with weight g, y = W2_e(QDQ(silu(min(W1_e a, L)) * clip(W3_e a, -L, L) * g)), a = QDQ(x).
// Weights stay in storage format (bf16, fp8 e4m3 + ue8m0 32x32 scales, or fp4 e2m1 packed two
// a byte + ue8m0 scale per 32 inputs) and are dequantized one expert at a time.
#include <vector>

#include "common.h"

namespace deepinfer {

enum Fmt : int64_t { kBf16 = 0, kFp8 = 1, kFp4 = 2 };

// Expert e of stacked weights [E, out, in(/2)] -> f32 [out, in] (bf16-exact values).
static void DequantExpert(const ffi::AnyBuffer& w, const ffi::AnyBuffer& s, int64_t fmt, int64_t e, int64_t out,
                          int64_t in, float* dst) {
  if (fmt == kBf16) {
    load_f32(w, e * out * in, out * in, dst);
  } else if (fmt == kFp8) {
    const uint8_t* v = static_cast<const uint8_t*>(w.untyped_data()) + e * out * in;
    const int64_t so = (out + 31) / 32, si = (in + 31) / 32;
    const uint8_t* sc = static_cast<const uint8_t*>(s.untyped_data()) + e * so * si;
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i)
        dst[o * in + i] = round_bf16(e4m3_to_f32(v[o * in + i]) * e8m0_to_f32(sc[(o / 32) * si + i / 32]));
  } else {
    const uint8_t* v = static_cast<const uint8_t*>(w.untyped_data()) + e * out * (in / 2);
    const uint8_t* sc = static_cast<const uint8_t*>(s.untyped_data()) + e * out * (in / 32);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        const uint8_t b = v[o * (in / 2) + i / 2];
        const uint8_t code = (i & 1) ? (b >> 4) : (b & 0xF);  // even element in the low nibble
        dst[o * in + i] = round_bf16(e2m1_to_f32(code) * e8m0_to_f32(sc[o * (in / 32) + i / 32]));
      }
  }
}

static ffi::Error MoeImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> gate_w,
                          ffi::AnyBuffer w1, ffi::AnyBuffer s1, ffi::AnyBuffer w2, ffi::AnyBuffer s2, ffi::AnyBuffer w3,
                          ffi::AnyBuffer s3, ffi::ResultBuffer<ffi::BF16> out, int64_t fmt, float limit,
                          int64_t n_experts) {
  const std::string op = "moe_experts";
  if (x.dimensions().size() != 2 || idx.dimensions().size() != 2 || w1.dimensions().size() != 3 ||
      w2.dimensions().size() != 3)
    return bad(op, "expected x [T, D], idx [T, X], weights [E, out, in]");
  const int64_t T = x.dimensions()[0], D = x.dimensions()[1], X = idx.dimensions()[1];
  const int64_t E = w1.dimensions()[0], F = w1.dimensions()[1];
  const int64_t in1 = fmt == kFp4 ? w1.dimensions()[2] * 2 : w1.dimensions()[2];
  const int64_t in2 = fmt == kFp4 ? w2.dimensions()[2] * 2 : w2.dimensions()[2];
  if (in1 != D || in2 != F || w2.dimensions()[1] != D) return bad(op, "weight shapes do not match x [T, D]");
  const bool quantized = fmt != kBf16;
  if (quantized && (D % 32 || F % 32)) return bad(op, "quantized experts need D and F multiples of 32");
  // a = QDQ(x) once per token.
  std::vector<float> a(T * D);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  for (int64_t i = 0; i < T * D; ++i) a[i] = bf16_to_f32(xp[i]);
  if (quantized)
    for (int64_t i = 0; i < T * D; i += 32) qdq_fp8_block(&a[i], 32);
  // Rows routed to each expert (counting sort); others stay zero.
  std::vector<std::vector<int64_t>> rows(E);
  const int32_t* ip = idx.typed_data();
  uint16_t* op_ = reinterpret_cast<uint16_t*>(out->typed_data());
  std::fill(op_, op_ + T * X * D, 0);
  for (int64_t r = 0; r < T * X; ++r)
    if (ip[r] >= 0 && ip[r] < n_experts && ip[r] < E) rows[ip[r]].push_back(r);
  std::vector<float> W1(F * D), W3(F * D), W2(D * F), h(F);
  for (int64_t e = 0; e < E; ++e) {
    if (rows[e].empty()) continue;
    DequantExpert(w1, s1, fmt, e, F, D, W1.data());
    DequantExpert(w3, s3, fmt, e, F, D, W3.data());
    DequantExpert(w2, s2, fmt, e, D, F, W2.data());
    for (int64_t r : rows[e]) {
      const float* ar = &a[(r / X) * D];
      const float g = gate_w.typed_data()[r];
      for (int64_t f = 0; f < F; ++f) {
        float gate = round_bf16(dot_f32(ar, &W1[f * D], D));
        float up = round_bf16(dot_f32(ar, &W3[f * D], D));
        if (limit > 0) {
          up = std::fmin(std::fmax(up, -limit), limit);
          gate = std::fmin(gate, limit);
        }
        const float silu = gate * (1.0f / (1.0f + std::exp(-gate)));
        h[f] = round_bf16(silu * up * g);
      }
      if (quantized)
        for (int64_t f = 0; f < F; f += 32) qdq_fp8_block(&h[f], 32);
      for (int64_t d = 0; d < D; ++d) op_[r * D + d] = f32_to_bf16(dot_f32(h.data(), &W2[d * F], F));
    }
  }
  return ffi::Error::Success();
}

}  // namespace deepinfer

namespace xf = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferMoeExpertsCpu, deepinfer::MoeImpl,
                              xf::Ffi::Bind()
                                  .Arg<xf::Buffer<xf::BF16>>()
                                  .Arg<xf::Buffer<xf::S32>>()
                                  .Arg<xf::Buffer<xf::F32>>()
                                  .Arg<xf::AnyBuffer>()
                                  .Arg<xf::AnyBuffer>()
                                  .Arg<xf::AnyBuffer>()
                                  .Arg<xf::AnyBuffer>()
                                  .Arg<xf::AnyBuffer>()
                                  .Arg<xf::AnyBuffer>()
                                  .Ret<xf::Buffer<xf::BF16>>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<float>("limit")
                                  .Attr<int64_t>("n_experts"));
