// Conversions shared by Sonar's CPU kernels: float32 to and from the tensor's dtype.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace sonar {

// float32 <-> the tensor's dtype. bfloat16 by bit operations, rounding to nearest even as c10 does
// (NaN to the canonical NaN) but without c10's branch, which keeps loops from vectorising.
template <typename T>
inline float to_f32(T x) {
  return static_cast<float>(x);
}

inline float to_f32(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_f32(float x) {
  return static_cast<T>(x);
}

template <>
inline c10::BFloat16 from_f32<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t nearest_even = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint16_t bits = x != x ? uint16_t{0x7fc0} : static_cast<uint16_t>(nearest_even);
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}

// Rounds to T and back: the value a PyTorch op of dtype T would hand to the next op.
template <typename T>
inline float rounded(float x) {
  return to_f32(from_f32<T>(x));
}

}  // namespace sonar
