// Shared helpers of the CPU test build: bf16 / fp8 / fp4 conversions that match the jnp
// references bit for bit, buffer access and error messages.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace deepinfer {

namespace ffi = xla::ffi;

inline float bits_to_f32(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// bf16 <-> f32 with round-to-nearest-even, as XLA converts (NaN kept quiet).
inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t b = f32_to_bits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// fp8 e4m3fn code -> f32 (bias 7, no infinities, 0x7F/0xFF = NaN).
inline float e4m3_to_f32(uint8_t c) {
  const int sign = c >> 7, exp = (c >> 3) & 0xF, man = c & 0x7;
  float v;
  if (exp == 0xF && man == 0x7) v = NAN;
  else if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);
  else v = std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -v : v;
}

// fp8 e5m2 code -> f32 (the top byte of an f16).
inline float e5m2_to_f32(uint8_t c) {
  const int sign = c >> 7, exp = (c >> 2) & 0x1F, man = c & 0x3;
  float v;
  if (exp == 0x1F) v = man ? NAN : INFINITY;
  else if (exp == 0) v = std::ldexp(static_cast<float>(man), -16);
  else v = std::ldexp(1.0f + man / 4.0f, exp - 15);
  return sign ? -v : v;
}

// f32 -> nearest e4m3fn value (round-to-nearest-even), for |v| <= 448 (callers clip first).
inline float round_e4m3(float v) {
  const float a = std::fabs(v);
  if (a < 0.015625f) return std::nearbyint(v * 512.0f) / 512.0f;  // subnormal grid 2^-9
  uint32_t b = f32_to_bits(v);
  b += 0x7FFFFu + ((b >> 20) & 1u);  // keep 3 mantissa bits
  return bits_to_f32(b & ~0xFFFFFu);
}

// ue8m0 scale byte -> 2^(e-127) as the reference builds it (the byte shifted into the exponent).
inline float e8m0_to_f32(uint8_t e) { return bits_to_f32(static_cast<uint32_t>(e) << 23); }

// e2m1 code (bit 3 = sign) -> f32.
inline float e2m1_to_f32(uint8_t c) {
  static const float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (c & 8) ? -kGrid[c & 7] : kGrid[c & 7];
}

// 2^ceil(log2(x)) from the bits of x > 0 (quant.pow2_ceil_scale).
inline float pow2_ceil(float x) {
  const uint32_t b = f32_to_bits(x);
  const int32_t exp = static_cast<int32_t>((b >> 23) & 0xFF);
  const int32_t log2c = exp - 127 + ((b & 0x7FFFFFu) != 0);
  return bits_to_f32(static_cast<uint32_t>(log2c + 127) << 23);
}

// fp8 e4m3 QDQ of one block of bf16-valued floats in place (quant.act_quant_fp8).
inline void qdq_fp8_block(float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  amax = std::fmax(amax, 1e-4f);
  const float s = pow2_ceil(amax * (1.0f / 448.0f));
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::fmin(std::fmax(x[i] / s, -448.0f), 448.0f);
    x[i] = round_bf16(round_e4m3(q) * s);
  }
}

// fp32 dot with 8 partial sums (the summation order differs from XLA's: tests allow for it).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Load n elements of a bf16 or f32 buffer starting at element `off` into f32.
inline void load_f32(const ffi::AnyBuffer& buf, int64_t off, int64_t n, float* out) {
  if (buf.element_type() == ffi::DataType::BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(buf.untyped_data()) + off;
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(p[i]);
  } else {
    const float* p = static_cast<const float*>(buf.untyped_data()) + off;
    std::memcpy(out, p, n * sizeof(float));
  }
}

inline bool is_bf16_or_f32(const ffi::AnyBuffer& buf) {
  return buf.element_type() == ffi::DataType::BF16 || buf.element_type() == ffi::DataType::F32;
}

inline ffi::Error bad(const std::string& op, const std::string& what) {
  return ffi::Error::InvalidArgument("deepinfer " + op + ": " + what);
}

}  // namespace deepinfer
