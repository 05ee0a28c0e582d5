// Conversions shared by Sonar's CPU kernels: float32 to and from the tensor's dtype.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
// The same conversions sixteen lanes at a time.

// Sixteen bfloat16 bit patterns as float32 (exact).
inline __m512 widen_bfloat16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Sixteen values of T from p, as float32.
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  return widen_bfloat16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// from_f32<c10::BFloat16> of each lane: the bfloat16 bits in the low half of each 32-bit lane.
inline __m512i rounded_bfloat16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i nearest_even = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  return _mm512_mask_mov_epi32(nearest_even, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
#endif

}  // namespace sonar
