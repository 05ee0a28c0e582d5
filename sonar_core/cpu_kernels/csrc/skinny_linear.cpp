// Skinny matmuls: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias) for the few rows of a decode or
// verification step.
//
// Why: with a handful of rows a linear layer reads its whole weight to produce a few outputs, so
// its speed is the memory's. oneDNN's and MKL's kernels reach well under half of the read
// bandwidth there (docs/performance.md); these read every weight byte once per call, in the order
// pack_linear_weight lays them out, with every row's accumulators in registers.
//
// Packed layout: output features in blocks of 16 (the last block zero-padded).
//   float32:  [blocks, K, 16]
//   bfloat16: [blocks, K / 2, 16, 2], two neighbouring inputs side by side (the layout AVX512-BF16's
//             pair dot product reads; the other paths split the pairs with two bit operations).
//
// Batch invariance: every output element is accumulated over k in the same order, by the same
// instructions, whatever the number of rows and wherever its row sits, so verifying k drafts in
// one call gives bit for bit what decoding them one at a time gives.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "convert.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using sonar::from_f32;

constexpr int64_t kBlock = 16;  // output features per packed block

// Software prefetch of the weight streams. The hardware prefetchers run too little ahead of these
// loops (AMX tile loads hardly at all), so each loop asks for the lines it reads a fixed distance
// ahead. Measured on SmolLM2's 121 projections (2-core Xeon with AMX, bfloat16, 2 threads, builds
// alternating, 6 rounds each): one row 15.5-18.5 -> 13.1-15.6 ms, six rows (the tiles) 26.1-29.3
// (one round 19.3) -> 18.1-22.0 ms; distances of 8 to 32 rows and of 2 to 4 tiles measured alike.
// Engine steps: docs/performance.md.
constexpr int64_t kPrefetchRows = 16;  // packed rows (one 64-byte line per block) ahead
constexpr int64_t kPrefetchTiles = 4;  // AMX weight tiles (1 KiB per block) ahead

inline void prefetch(const void* address) { __builtin_prefetch(address, 0, 3); }

// M(r) for each row r of a named tile (named_tile below, up to six rows).
#define SONAR_EACH_ROW(M) M(0) M(1) M(2) M(3) M(4) M(5)

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// ---- one instruction set's arithmetic on a block of 16 outputs --------------------------------
// Acc: 16 float32 accumulators. F32 / Bf16: a broadcast input (one float, or one pair of bfloat16
// inputs) and one packed weight row of the block, and the multiply-add of the two into Acc.
// Each path states its register tiles: kTileBlocks x kTileRows for several rows, kPairRowBlocks
// for two rows and kSingleRowBlocks for one (enough independent accumulators to hide the
// multiply-add latency, and enough weight streams in flight to keep the memory busy), and may
// state a second one, kTallTileBlocks x kTallTileRows, for more rows than kTileRows. A path may
// also give its own tiles with every accumulator a named variable (named_tile, up to kNamedBlocks
// blocks by kNamedRows rows): GCC keeps an array of vector accumulators partly in memory once
// registers run short, or reloads the weights row by row.
// AVX-512's 32 registers hold 24 accumulators of 6 blocks x 4 rows, or 16 of 8 blocks x 2 rows
// beside their weight rows. Measured on SmolLM2's 121 projections (2-core Xeon with AMX,
// bfloat16, 2 threads, the two builds alternating in one process, median of 28 rounds, twice):
// 2 / 3 / 4 rows took 13.41-13.79 / 13.96-14.13 / 14.78-14.97 ms with 4 x 4 tiles and
// 12.78-12.96 / 13.45-13.54 / 14.09-14.15 ms with these (one row: 12.3-12.5 ms).

#if defined(__AVX512F__)
constexpr const char* kPath =
#if defined(__AVX512BF16__)
    "avx512_bf16";
#else
    "avx512";
#endif

struct Acc {
  __m512 v;
  static Acc zero() { return {_mm512_setzero_ps()}; }
  void store(float* out) const { _mm512_storeu_ps(out, v); }
};

struct F32 {
  using Weight = float;
  using X = float;  // x's elements as the tile reads them (bfloat16 ones are widened first)
  static constexpr int64_t kInputs = 1;  // inputs per packed row
  static constexpr int kTileBlocks = 6, kTileRows = 4, kPairRowBlocks = 8, kSingleRowBlocks = 8;
  struct Input {
    __m512 v;
  };
  struct Row {
    __m512 v;
  };
  static Input input(const float* x) { return {_mm512_set1_ps(*x)}; }
  static Row row(const float* w) { return {_mm512_loadu_ps(w)}; }
  static void fma(Acc& a, const Input& x, const Row& w) { a.v = _mm512_fmadd_ps(x.v, w.v, a.v); }
};

struct Bf16 {
  using Weight = uint16_t;
  static constexpr int64_t kInputs = 2;
  // Blocks of the one- and two-row tiles. 6 on AVX-512 BF16 without AMX: on an AMD EPYC (2
  // threads, SmolLM2's 120 projections, builds alternating by process) one row took 4.7-4.9 ms
  // against 5.3-5.5 with 8 blocks and 4.9-5.1 with 4, two rows 5.0-5.1 against 5.8-5.9 and 5.5-5.6
  // (the same in a slow hour, when every build took 6.1-6.7). CPUs with AMX keep the 8 blocks
  // measured there (above).
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
  static constexpr int kFewRowBlocks = 6;
#else
  static constexpr int kFewRowBlocks = 8;
#endif
  static constexpr int kTileBlocks = 6, kTileRows = 4, kPairRowBlocks = kFewRowBlocks, kSingleRowBlocks = kFewRowBlocks;
#if defined(__AVX512BF16__)
  using X = uint16_t;
  struct Input {
    __m512bh pair;
  };
  struct Row {
    __m512bh pairs;
  };
  static Input input(const uint16_t* x) {
    uint32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return {(__m512bh)_mm512_set1_epi32(static_cast<int>(pair))};
  }
  static Row row(const uint16_t* w) { return {(__m512bh)_mm512_loadu_si512(w)}; }
  static void fma(Acc& a, const Input& x, const Row& w) { a.v = _mm512_dpbf16_ps(a.v, x.pair, w.pairs); }

  // Five rows or more take tiles of 4 blocks x 6 rows (one pass over the weights up to six rows,
  // two up to twelve, where the 6 x 4 tiles need two and three), with every accumulator a named
  // variable and each block's weight row loaded once a step: from an array tile of 24
  // accumulators GCC reloaded the weight row for every row. Without AMX (AMD EPYC with AVX-512
  // BF16, 2 threads) engine steps of 6 / 8 / 12 / 16 rows took 3-8% less; named 6 x 4 tiles for
  // three or four rows measured no better than the array ones (three rows worse), so named tiles
  // are the tall tile and its edges. docs/performance.md ("On an AMD EPYC with AVX-512 BF16").
  static constexpr int kTallTileBlocks = 4, kTallTileRows = 6;
  static constexpr int kNamedBlocks = kTallTileBlocks, kNamedRows = kTallTileRows;
  template <int kBlocks, int kRows>
  __attribute__((noinline)) static void named_tile(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                                                   int64_t block_stride, int64_t steps, float* acc_out) {
    static_assert(kBlocks >= 1 && kRows >= 1 && kBlocks <= kNamedBlocks && kRows <= kNamedRows);
    constexpr int64_t row_width = kBlock * kInputs;
#define SONAR_EACH_BLOCK(M, r) M(r, 0) M(r, 1) M(r, 2) M(r, 3)
#define SONAR_ZERO_ONE(r, j) Acc a##r##j = Acc::zero();
#define SONAR_ZERO(r) SONAR_EACH_BLOCK(SONAR_ZERO_ONE, r)
#define SONAR_PREFETCH(r, j) \
  if constexpr (j < kBlocks) prefetch(w + j * block_stride + ahead);
#define SONAR_LOAD(r, j) const Row w##j = j < kBlocks ? row(w + j * block_stride + at) : Row{};
#define SONAR_FMA_ONE(r, j) \
  if constexpr (j < kBlocks) fma(a##r##j, b, w##j);
#define SONAR_FMA(r)                                         \
  if constexpr (r < kRows) {                                 \
    const Input b = input(x + r * x_stride + kInputs * s);   \
    SONAR_EACH_BLOCK(SONAR_FMA_ONE, r)                       \
  }
#define SONAR_STORE_ONE(r, j) \
  if constexpr (j < kBlocks) a##r##j.store(acc_out + (r * kBlocks + j) * kBlock);
#define SONAR_STORE(r) \
  if constexpr (r < kRows) { SONAR_EACH_BLOCK(SONAR_STORE_ONE, r) }
    SONAR_EACH_ROW(SONAR_ZERO)
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t at = s * row_width, ahead = (s + kPrefetchRows) * row_width;
      if (s + kPrefetchRows < steps) { SONAR_EACH_BLOCK(SONAR_PREFETCH, 0) }
      SONAR_EACH_BLOCK(SONAR_LOAD, 0)
      SONAR_EACH_ROW(SONAR_FMA)
    }
    SONAR_EACH_ROW(SONAR_STORE)
#undef SONAR_STORE
#undef SONAR_STORE_ONE
#undef SONAR_FMA
#undef SONAR_FMA_ONE
#undef SONAR_LOAD
#undef SONAR_PREFETCH
#undef SONAR_ZERO
#undef SONAR_ZERO_ONE
#undef SONAR_EACH_BLOCK
  }
#else
  using X = float;
  struct Input {
    __m512 even, odd;
  };
  struct Row {
    __m512 even, odd;
  };
  static Input input(const float* x) { return {_mm512_set1_ps(x[0]), _mm512_set1_ps(x[1])}; }
  static Row row(const uint16_t* w) {
    const __m512i pairs = _mm512_loadu_si512(w);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  static void fma(Acc& a, const Input& x, const Row& w) {
    a.v = _mm512_fmadd_ps(x.even, w.even, a.v);
    a.v = _mm512_fmadd_ps(x.odd, w.odd, a.v);
  }
#endif
};

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2's 16 registers: float32 tiles of 2 blocks x 3 rows (12 accumulators), 3 blocks for two
// rows; bfloat16 widens each weight row into four registers, so its tiles are 2 blocks for two
// rows, 4 for one, and one block by up to six rows for more (Bf16::named_tile). Measured on an AMD
// EPYC (AVX2, 2 cores, 2 threads) over SmolLM2's 121 projections, the variants alternating in one
// process (median of 25 rounds): bfloat16 1 / 2 / 4 / 6 rows 11.26 / 14.42 / 12.71 / 18.51 ms with
// the former 1-block tiles and x widened per step, 10.79 / 11.54 / 11.12 / 16.56 with array tiles;
// float32 2 / 3 / 6 rows 19.74 / 22.41 / 28.10 ms with 2 x 2 tiles, 18.94 / 19.62 / 25.67 now.
// Float32 keeps the array tiles: named ones of one block by six rows measured no better there
// (the same EPYC, a stand-alone copy of both tiles alternating in one process, a busy hour: 3 / 4 /
// 6 / 8 rows 32.6 / 38.6 / 39.8 / 47.5 ms for the array tiles, 38.9 / 40.4 / 37.3 / 45.8 named;
// float32 reads twice the bytes, so two weight streams per tile count for more than the spills).
constexpr const char* kPath = "avx2";

struct Acc {
  __m256 lo, hi;
  static Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  void store(float* out) const {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  }
};

struct F32 {
  using Weight = float;
  using X = float;
  static constexpr int64_t kInputs = 1;
  static constexpr int kTileBlocks = 2, kTileRows = 3, kPairRowBlocks = 3, kSingleRowBlocks = 4;
  struct Input {
    __m256 v;
  };
  struct Row {
    __m256 lo, hi;
  };
  static Input input(const float* x) { return {_mm256_set1_ps(*x)}; }
  static Row row(const float* w) { return {_mm256_loadu_ps(w), _mm256_loadu_ps(w + 8)}; }
  static void fma(Acc& a, const Input& x, const Row& w) {
    a.lo = _mm256_fmadd_ps(x.v, w.lo, a.lo);
    a.hi = _mm256_fmadd_ps(x.v, w.hi, a.hi);
  }
};

struct Bf16 {
  using Weight = uint16_t;
  static constexpr int64_t kInputs = 2;
  static constexpr int kTileBlocks = 1, kTileRows = 6, kPairRowBlocks = 2, kSingleRowBlocks = 4;
  using X = float;
  struct Input {
    __m256 even, odd;
  };
  struct Row {
    __m256 even_lo, odd_lo, even_hi, odd_hi;
  };
  static Input input(const float* x) { return {_mm256_broadcast_ss(x), _mm256_broadcast_ss(x + 1)}; }
  static Row row(const uint16_t* w) {
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_and_si256(lo, mask)),
            _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)), _mm256_castsi256_ps(_mm256_and_si256(hi, mask))};
  }
  static void fma(Acc& a, const Input& x, const Row& w) {
    a.lo = _mm256_fmadd_ps(x.even, w.even_lo, a.lo);
    a.hi = _mm256_fmadd_ps(x.even, w.even_hi, a.hi);
    a.lo = _mm256_fmadd_ps(x.odd, w.odd_lo, a.lo);
    a.hi = _mm256_fmadd_ps(x.odd, w.odd_hi, a.hi);
  }

  // One block for up to six rows, every accumulator a named variable. GCC keeps an array of
  // vector accumulators (array_tile) partly in memory at this many rows, storing them back on
  // every step, and Row's four widened weight registers leave too few for six rows. Here the even
  // inputs' weights are widened and used by every row, then the odd ones', so twelve
  // accumulators, two weights and a broadcast fit the sixteen registers; kept out of line, as
  // inlined into tiles() GCC hoists the broadcasts and spills again. Each accumulator takes even
  // then odd, step by step, as fma() does: the same bits as the other tiles. Measured:
  // docs/performance.md ("Verification rows on AVX2").
  static constexpr int kNamedBlocks = 1, kNamedRows = 6;
  template <int kBlocks, int kRows>
  __attribute__((noinline)) static void named_tile(const float* x, int64_t x_stride, const uint16_t* w,
                                                   int64_t /*block_stride: one block*/, int64_t steps,
                                                   float* acc_out) {
    static_assert(kBlocks == 1 && kRows >= 1 && kRows <= kNamedRows);
    const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
#define SONAR_ZERO(r) __m256 lo##r = _mm256_setzero_ps(), hi##r = _mm256_setzero_ps();
#define SONAR_FMA(r, input)                                                   \
  if constexpr (r < kRows) {                                                  \
    const __m256 x_r = _mm256_broadcast_ss(x + r * x_stride + 2 * s + input); \
    lo##r = _mm256_fmadd_ps(x_r, weight_lo, lo##r);                           \
    hi##r = _mm256_fmadd_ps(x_r, weight_hi, hi##r);                           \
  }
#define SONAR_EVEN(r) SONAR_FMA(r, 0)
#define SONAR_ODD(r) SONAR_FMA(r, 1)
#define SONAR_STORE(r)                                 \
  if constexpr (r < kRows) {                           \
    _mm256_storeu_ps(acc_out + r * kBlock, lo##r);     \
    _mm256_storeu_ps(acc_out + r * kBlock + 8, hi##r); \
  }
    SONAR_EACH_ROW(SONAR_ZERO)
    for (int64_t s = 0; s < steps; ++s) {
      if (s + kPrefetchRows < steps) prefetch(w + (s + kPrefetchRows) * kBlock * kInputs);
      const auto* pairs = reinterpret_cast<const __m256i*>(w + s * kBlock * kInputs);
      __m256 weight_lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(pairs), 16));
      __m256 weight_hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(pairs + 1), 16));
      SONAR_EACH_ROW(SONAR_EVEN)
      weight_lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(pairs), odd_mask));
      weight_hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(pairs + 1), odd_mask));
      SONAR_EACH_ROW(SONAR_ODD)
    }
    SONAR_EACH_ROW(SONAR_STORE)
#undef SONAR_STORE
#undef SONAR_ODD
#undef SONAR_EVEN
#undef SONAR_FMA
#undef SONAR_ZERO
  }
};

#else
constexpr const char* kPath = "generic";

struct Acc {
  float v[kBlock];
  static Acc zero() { return {}; }
  void store(float* out) const { std::memcpy(out, v, sizeof(v)); }
};

struct F32 {
  using Weight = float;
  using X = float;
  static constexpr int64_t kInputs = 1;
  static constexpr int kTileBlocks = 1, kTileRows = 4, kPairRowBlocks = 1, kSingleRowBlocks = 1;
  struct Input {
    float v;
  };
  struct Row {
    const float* w;
  };
  static Input input(const float* x) { return {*x}; }
  static Row row(const float* w) { return {w}; }
  static void fma(Acc& a, const Input& x, const Row& w) {
    for (int64_t l = 0; l < kBlock; ++l) a.v[l] += x.v * w.w[l];
  }
};

struct Bf16 {
  using Weight = uint16_t;
  static constexpr int64_t kInputs = 2;
  static constexpr int kTileBlocks = 1, kTileRows = 4, kPairRowBlocks = 1, kSingleRowBlocks = 1;
  using X = float;
  struct Input {
    float even, odd;
  };
  struct Row {
    const uint16_t* w;
  };
  static Input input(const float* x) { return {x[0], x[1]}; }
  static Row row(const uint16_t* w) { return {w}; }
  static void fma(Acc& a, const Input& x, const Row& w) {
    for (int64_t l = 0; l < kBlock; ++l) {
      a.v[l] += x.even * bits_to_float(uint32_t{w.w[2 * l]} << 16);
      a.v[l] += x.odd * bits_to_float(uint32_t{w.w[2 * l + 1]} << 16);
    }
  }
};
#endif

// ---- the register tile: kRows rows of x against kBlocks packed blocks --------------------------

// Whether a path has its own named tile (P::named_tile) for kBlocks x kRows.
template <typename P, int kBlocks, int kRows, typename = void>
constexpr bool kNamedTileFits = false;
template <typename P, int kBlocks, int kRows>
constexpr bool kNamedTileFits<P, kBlocks, kRows, std::void_t<decltype(P::kNamedRows)>> =
    kBlocks <= P::kNamedBlocks && kRows <= P::kNamedRows;

// The tile for more rows than P::kTileRows: P::kTallTileBlocks x P::kTallTileRows where the path
// states one, else its kTileBlocks x kTileRows.
template <typename P, typename = void>
struct TallTileOf {
  static constexpr int kBlocks = P::kTileBlocks, kRows = P::kTileRows;
};
template <typename P>
struct TallTileOf<P, std::void_t<decltype(P::kTallTileRows)>> {
  static constexpr int kBlocks = P::kTallTileBlocks, kRows = P::kTallTileRows;
};

// acc_out[r][j * 16 + l]: row r, output l of block j, for rows 0..kRows-1 (x's row stride is
// x_stride inputs; a block is block_stride weights apart from the next).
template <typename P, int kBlocks, int kRows>
inline void array_tile(const typename P::X* x, int64_t x_stride, const typename P::Weight* w, int64_t block_stride,
                       int64_t steps, float* acc_out) {
  Acc acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kBlocks; ++j) acc[r][j] = Acc::zero();
  constexpr int64_t row_width = kBlock * P::kInputs;  // weights per packed row
  for (int64_t s = 0; s < steps; ++s) {
    if (s + kPrefetchRows < steps)
      for (int j = 0; j < kBlocks; ++j) prefetch(w + j * block_stride + (s + kPrefetchRows) * row_width);
    typename P::Row rows[kBlocks];
    for (int j = 0; j < kBlocks; ++j) rows[j] = P::row(w + j * block_stride + s * row_width);
    for (int r = 0; r < kRows; ++r) {
      const typename P::Input input = P::input(x + r * x_stride + s * P::kInputs);
      for (int j = 0; j < kBlocks; ++j) P::fma(acc[r][j], input, rows[j]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kBlocks; ++j) acc[r][j].store(acc_out + (r * kBlocks + j) * kBlock);
}

template <typename P, int kBlocks, int kRows>
inline void tile(const typename P::X* x, int64_t x_stride, const typename P::Weight* w, int64_t block_stride,
                 int64_t steps, float* acc_out) {
  if constexpr (kNamedTileFits<P, kBlocks, kRows>) {
    P::template named_tile<kBlocks, kRows>(x, x_stride, w, block_stride, steps, acc_out);
  } else {
    array_tile<P, kBlocks, kRows>(x, x_stride, w, block_stride, steps, acc_out);
  }
}

// The same tile for the rows and blocks actually left (fewer at the edges): the compiled tile
// sizes count down to the requested ones, so every tile keeps its accumulators in registers.
template <typename P, int kBlocks, int kRows>
inline void edge_tile(int blocks, int rows, const typename P::X* x, int64_t x_stride,
                      const typename P::Weight* w, int64_t block_stride, int64_t steps, float* acc_out) {
  if constexpr (kBlocks > 1) {
    if (blocks < kBlocks) return edge_tile<P, kBlocks - 1, kRows>(blocks, rows, x, x_stride, w, block_stride, steps, acc_out);
  }
  if constexpr (kRows > 1) {
    if (rows < kRows) return edge_tile<P, kBlocks, kRows - 1>(blocks, rows, x, x_stride, w, block_stride, steps, acc_out);
  }
  tile<P, kBlocks, kRows>(x, x_stride, w, block_stride, steps, acc_out);
}

// One output of write_rows: acc's sum with the bias added, as O.
template <typename T, typename O>
inline O output_value(float sum, const T* bias, int64_t n) {
  const float value = bias ? sum + sonar::to_f32(bias[n]) : sum;
  if constexpr (std::is_same_v<O, T>) {
    return from_f32<T>(value);
  } else {
    return sonar::rounded<T>(value);
  }
}

// A whole block's 16 outputs (output_value for each; bias points at the block's own), in vector
// registers where the CPU has AVX-512: SmolLM2's 121 projections at six rows (2-core Xeon with
// AMX, 2 threads, builds alternating) took 12.0-12.5 ms a pass with the scalar loop and 11.6-11.7
// with this, a 225-token prefill 64.0-64.2 and 62.0-62.6 ms. bfloat16 rounding is from_f32's,
// lane by lane (sonar::rounded_bfloat16_bits), so the bits are the scalar loop's.
template <typename T, typename O>
inline void write_block(const float* sums, const T* bias, O* out) {
#if defined(__AVX512F__)
  __m512 value = _mm512_loadu_ps(sums);
  if (bias) value = _mm512_add_ps(value, sonar::load16(bias));
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, value);
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    const __m512i bits = sonar::rounded_bfloat16_bits(value);
    if constexpr (std::is_same_v<O, float>) {
      _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(bits));
    }
  }
#else
  for (int64_t l = 0; l < kBlock; ++l) out[l] = output_value<T, O>(sums[l], bias, l);
#endif
}

// Rounds nr rows of a tile's accumulators (acc[r][j * 16 + l], nb blocks wide) to T with the bias
// added, into out's rows (row stride `outputs`) at the outputs of blocks b0 onwards. O: T, or
// float for a float32 copy of the rounded values (what casting the T output gives).
template <typename T, typename O>
inline void write_rows(const float* acc, int nb, int nr, int64_t b0, const T* bias, O* out, int64_t outputs) {
  for (int r = 0; r < nr; ++r) {
    O* orow = out + r * outputs;
    for (int j = 0; j < nb; ++j) {
      const float* a = acc + (r * nb + j) * kBlock;
      const int64_t n0 = (b0 + j) * kBlock, count = std::min(kBlock, outputs - n0);
      if (count == kBlock) {
        write_block<T, O>(a, bias ? bias + n0 : bias, orow + n0);
      } else {
        for (int64_t l = 0; l < count; ++l) orow[n0 + l] = output_value<T, O>(a[l], bias, n0 + l);
      }
    }
  }
}

// All rows times blocks [begin, end), in tiles of kBlocks x kRows.
template <typename T, typename P, int kBlocks, int kRows, typename O>
void tiles(const typename P::X* x, const typename P::Weight* w, const T* bias, O* out, int64_t rows,
           int64_t begin, int64_t end, int64_t inputs, int64_t outputs, int64_t steps) {
  const int64_t block_stride = steps * kBlock * P::kInputs;
  float acc[kRows * kBlocks * kBlock];
  for (int64_t b0 = begin; b0 < end; b0 += kBlocks) {
    const int nb = static_cast<int>(std::min<int64_t>(kBlocks, end - b0));
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      edge_tile<P, kBlocks, kRows>(nb, nr, x + r0 * inputs, inputs, w + b0 * block_stride, block_stride, steps, acc);
      write_rows(acc, nb, nr, b0, bias, out + r0 * outputs, outputs);
    }
  }
}

template <typename T, typename P, typename O>
void skinny_linear_kernel(const at::Tensor& x, const at::Tensor& packed, const at::Tensor* bias, at::Tensor& out) {
  const int64_t rows = x.size(0), inputs = x.size(1), outputs = out.size(1);
  const int64_t blocks = packed.size(0), steps = packed.size(1);
  // Where the CPU has no bfloat16 multiply, x is widened to float32 once per call (exactly), so
  // that a tile broadcasts each input with one load instead of a shift and a move per row and step.
  std::vector<float> widened;
  const typename P::X* xp;
  if constexpr (std::is_same_v<typename P::X, float> && !std::is_same_v<T, float>) {
    const T* source = x.data_ptr<T>();
    widened.resize(rows * inputs);
    for (int64_t i = 0; i < rows * inputs; ++i) widened[i] = sonar::to_f32(source[i]);
    xp = widened.data();
  } else {
    xp = reinterpret_cast<const typename P::X*>(x.data_ptr<T>());
  }
  const auto* wp = reinterpret_cast<const typename P::Weight*>(packed.data_ptr<T>());
  const T* bp = bias ? bias->data_ptr<T>() : nullptr;
  O* op = out.data_ptr<O>();
  // Below ~64k multiply-adds a second thread costs more than it saves.
  const int64_t grain = rows * outputs * inputs < (int64_t{1} << 16) ? blocks : P::kTileBlocks;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    if (rows == 1) {
      tiles<T, P, P::kSingleRowBlocks, 1>(xp, wp, bp, op, 1, begin, end, inputs, outputs, steps);
    } else if (rows == 2) {
      tiles<T, P, P::kPairRowBlocks, 2>(xp, wp, bp, op, 2, begin, end, inputs, outputs, steps);
    } else if (rows <= P::kTileRows) {
      tiles<T, P, P::kTileBlocks, P::kTileRows>(xp, wp, bp, op, rows, begin, end, inputs, outputs, steps);
    } else {
      using Tall = TallTileOf<P>;
      tiles<T, P, Tall::kBlocks, Tall::kRows>(xp, wp, bp, op, rows, begin, end, inputs, outputs, steps);
    }
  });
}

// ---- AMX: bfloat16 tiles of 16 rows x 16 outputs ------------------------------------------------
// Where the CPU has AMX, bfloat16 calls of at least kAmxMinRows rows take it: a tile
// multiply-add costs the same for 1 row as for 16, so it stays ahead of oneDNN up to prefill sizes
// (512 rows measured), while the vector path becomes compute-bound as rows grow. Measured on
// SmolLM2's projections (2-core Xeon, 2 threads, milliseconds per pass over all of them, the two
// builds alternating): vector 12.6-13.8 / 13.5-15.7 / 15.1-16.5 / 18.4-19.3 / 22.9-23.5 at
// 1 / 2 / 4 / 6 / 8 rows, tiles 14.5-15.0 / 14.4-15.9 / 13.7-16.6 / 15.5-17.2 / 14.1-15.0. So one
// to four rows (decoding a few requests, verifying up to 3 drafts) stream on the vector path and
// get the same bits as one row alone; from 5 rows the tiles take over, every row again computed
// alike whatever else is in the call, but rounded apart from the vector path's sums.
// A call of fewer than 16 rows configures its row tiles that high and reads its rows in place;
// larger calls pad a last partial tile in a scratch copy. Measured on SmolLM2's 120 projections
// of a step (2-core Xeon with AMX, 2 threads, one process): 13 and 15 rows cost 1.21x one row's
// vector pass with the padded copy (16 rows, no copy: 1.11x), 1.05-1.09x in place.
// The packed layout is the vector path's: 16 pairs of inputs of one block are one B tile.

#if defined(SONAR_AMX)
constexpr int64_t kAmxRows = 16, kAmxInputs = 32, kAmxBlocks = 4, kAmxMinRows = 5;

constexpr int64_t kAmxTileWeights = kAmxInputs * kBlock;  // 16 pairs x 16 outputs x 2: one B tile

// Prefetches one B tile (1 KiB, 16 lines).
inline void prefetch_weight_tile(const uint16_t* tile) {
  const auto* bytes = reinterpret_cast<const char*>(tile);
  for (int64_t line = 0; line < kAmxTileWeights * int64_t{sizeof(uint16_t)}; line += 64) prefetch(bytes + line);
}

// Tiles 0-3: accumulators of four blocks; 4: 16 rows of x; 5, 6: weights, alternately.
// acc[r][j * 16 + l] for the 16 rows at x (row stride x_bytes) and kBlocks blocks at w.
// The look-ahead runs on into the next_blocks blocks at next (nullptr: none), which the caller
// computes next: with 18 input tiles a block (SmolLM2's width of 576), the 4 tiles of each group
// that its own look-ahead never covered were a fifth of all its weight loads. Measured on
// SmolLM2's 121 projections (2-core Xeon with AMX, 2 threads, builds alternating, 4 rounds):
// 5 / 6 / 8 rows 12.3-12.9 / 12.4-12.9 / 12.5-12.7 ms -> 11.5-12.0 / 11.5-12.1 / 11.6-11.9; the
// next group's first tiles prefetched all at once before a group measured no better than none.
template <int kBlocks>
inline void amx_tile(const uint16_t* x, int64_t x_bytes, const uint16_t* w, int64_t block_stride, int64_t input_tiles,
                     float* acc, const uint16_t* next, int next_blocks) {
  _tile_zero(0);
  if constexpr (kBlocks > 1) _tile_zero(1);
  if constexpr (kBlocks > 2) _tile_zero(2);
  if constexpr (kBlocks > 3) _tile_zero(3);
  for (int64_t t = 0; t < input_tiles; ++t) {
    const uint16_t* wt = w + t * kAmxTileWeights;
    if (t + kPrefetchTiles < input_tiles) {
      for (int j = 0; j < kBlocks; ++j) prefetch_weight_tile(wt + kPrefetchTiles * kAmxTileWeights + j * block_stride);
    } else if (next != nullptr) {
      const uint16_t* next_tile = next + (t + kPrefetchTiles - input_tiles) * kAmxTileWeights;
      for (int j = 0; j < next_blocks; ++j) prefetch_weight_tile(next_tile + j * block_stride);
    }
    _tile_loadd(4, x + t * kAmxInputs, x_bytes);
    _tile_loadd(5, wt, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (kBlocks > 1) {
      _tile_loadd(6, wt + block_stride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (kBlocks > 2) {
      _tile_loadd(5, wt + 2 * block_stride, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (kBlocks > 3) {
      _tile_loadd(6, wt + 3 * block_stride, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  constexpr int64_t acc_bytes = kBlocks * kBlock * sizeof(float);
  _tile_stored(0, acc, acc_bytes);
  if constexpr (kBlocks > 1) _tile_stored(1, acc + kBlock, acc_bytes);
  if constexpr (kBlocks > 2) _tile_stored(2, acc + 2 * kBlock, acc_bytes);
  if constexpr (kBlocks > 3) _tile_stored(3, acc + 3 * kBlock, acc_bytes);
}

template <int kBlocks>
inline void amx_edge_tile(int blocks, const uint16_t* x, int64_t x_bytes, const uint16_t* w, int64_t block_stride,
                          int64_t input_tiles, float* acc, const uint16_t* next, int next_blocks) {
  if constexpr (kBlocks > 1) {
    if (blocks < kBlocks) {
      return amx_edge_tile<kBlocks - 1>(blocks, x, x_bytes, w, block_stride, input_tiles, acc, next, next_blocks);
    }
  }
  amx_tile<kBlocks>(x, x_bytes, w, block_stride, input_tiles, acc, next, next_blocks);
}

bool amx_takes(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 && x.size(0) >= kAmxMinRows && x.size(1) % kAmxInputs == 0 &&
         sonar::amx_permitted();
}

template <typename O>
void amx_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor* bias, at::Tensor& out) {
  const int64_t rows = x.size(0), inputs = x.size(1), outputs = out.size(1);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  // Fewer than kAmxRows rows (verification steps) fit one tile of that height, read in place.
  // Otherwise a last tile of fewer rows is read from a copy padded with zero rows, kept by the
  // calling thread between calls: no allocation and no ATen ops per call (zeros, narrow and copy
  // took about 3 ms of a batch-8 decode step across its 121 projections).
  const bool one_short_tile = rows < kAmxRows;
  const int64_t full_rows = one_short_tile ? rows : rows / kAmxRows * kAmxRows;
  static thread_local std::vector<uint16_t> tail_tile;
  const uint16_t* tail = nullptr;
  if (full_rows != rows) {
    tail_tile.resize(kAmxRows * inputs);
    std::memcpy(tail_tile.data(), xp + full_rows * inputs, (rows - full_rows) * inputs * sizeof(uint16_t));
    std::fill(tail_tile.begin() + (rows - full_rows) * inputs, tail_tile.end(), uint16_t{0});
    tail = tail_tile.data();
  }
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const c10::BFloat16* bp = bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  O* op = out.data_ptr<O>();
  const int64_t blocks = packed.size(0), block_stride = packed.size(1) * kBlock * 2;
  const int64_t input_tiles = inputs / kAmxInputs, x_bytes = inputs * 2;
  const int64_t grain = rows * outputs * inputs < (int64_t{1} << 16) ? blocks : kAmxBlocks;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    sonar::configure_tiles(one_short_tile ? static_cast<int>(rows) : kAmxRows);
    alignas(64) float acc[kAmxRows * kAmxBlocks * kBlock];
    for (int64_t b0 = begin; b0 < end; b0 += kAmxBlocks) {
      const int nb = static_cast<int>(std::min<int64_t>(kAmxBlocks, end - b0));
      for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
        const uint16_t* tile_rows = r0 < full_rows ? xp + r0 * inputs : tail;
        // The next group's weights follow this group's last row tile.
        const int64_t next_b0 = b0 + kAmxBlocks;
        const bool next_follows = r0 + kAmxRows >= rows && next_b0 < end;
        const uint16_t* next = next_follows ? wp + next_b0 * block_stride : nullptr;
        const int next_nb = next_follows ? static_cast<int>(std::min<int64_t>(kAmxBlocks, end - next_b0)) : 0;
        amx_edge_tile<kAmxBlocks>(nb, tile_rows, x_bytes, wp + b0 * block_stride, block_stride, input_tiles, acc, next,
                                  next_nb);
        write_rows(acc, nb, static_cast<int>(std::min(kAmxRows, rows - r0)), b0, bp, op + r0 * outputs, outputs);
      }
    }
    _tile_release();
  });
}
#else
bool amx_takes(const at::Tensor&) { return false; }
template <typename O>
void amx_linear(const at::Tensor&, const at::Tensor&, const at::Tensor*, at::Tensor&) {}
#endif

// ---- operators --------------------------------------------------------------------------------

bool packable(const at::Tensor& weight) {
  return weight.scalar_type() == at::kFloat || (weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0);
}

// Packs whole blocks (into uninitialised memory): for each packed row (kPairs inputs of 16 outputs), the 16 source rows are
// read side by side, so that writes are sequential and reads are 16 sequential streams.
template <typename T, int64_t kPairs>
void pack_kernel(const at::Tensor& weight, at::Tensor& packed) {
  const int64_t outputs = weight.size(0), inputs = weight.size(1), steps = packed.size(1);
  const T* src = weight.data_ptr<T>();
  T* dst = packed.data_ptr<T>();
  at::parallel_for(0, packed.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t rows = std::min(kBlock, outputs - b * kBlock);
      const T* block_src = src + b * kBlock * inputs;
      T* out = dst + b * steps * kBlock * kPairs;
      for (int64_t s = 0; s < steps; ++s, out += kBlock * kPairs) {
        for (int64_t l = 0; l < rows; ++l) {
          for (int64_t i = 0; i < kPairs; ++i) out[l * kPairs + i] = block_src[l * inputs + s * kPairs + i];
        }
        std::fill(out + rows * kPairs, out + kBlock * kPairs, T(0));  // the last block's padding
      }
    }
  });
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "pack_linear_weight: weight must be a [out, in] CPU tensor");
  TORCH_CHECK(packable(weight), "pack_linear_weight: float32 weights, or bfloat16 with an even input width");
  const auto dense = weight.contiguous();
  const int64_t blocks = (dense.size(0) + kBlock - 1) / kBlock;
  const bool pairs = dense.scalar_type() == at::kBFloat16;
  auto packed = pairs ? at::empty({blocks, dense.size(1) / 2, kBlock, 2}, dense.options())
                      : at::empty({blocks, dense.size(1), kBlock}, dense.options());
  if (pairs) {
    pack_kernel<c10::BFloat16, 2>(dense, packed);
  } else {
    pack_kernel<float, 1>(dense, packed);
  }
  return packed;
}

// A bfloat16 call into an output of O (bfloat16, or float32 for float_out): AMX tiles where they
// take it, else the vector path.
template <typename O>
void bf16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor* bias, at::Tensor& out) {
  if (amx_takes(x)) {
    amx_linear<O>(x, packed, bias, out);
  } else {
    skinny_linear_kernel<c10::BFloat16, Bf16, O>(x, packed, bias, out);
  }
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features, bool float_out) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "skinny_linear: tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == packed.scalar_type(), "skinny_linear: x must be [rows, in] of the packed weight's dtype");
  const bool pairs = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == (pairs ? 4 : 3) && packed.size(2) == kBlock && packed.is_contiguous(),
              "skinny_linear: packed must come from pack_linear_weight");
  TORCH_CHECK(x.size(1) == packed.size(1) * (pairs ? 2 : 1), "skinny_linear: x's width does not match the weight");
  TORCH_CHECK(out_features > 0 && (out_features + kBlock - 1) / kBlock == packed.size(0),
              "skinny_linear: out_features does not match the packed weight");
  const at::Tensor* bias_ptr = nullptr;
  at::Tensor bias_dense;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features && bias->scalar_type() == x.scalar_type(),
                "skinny_linear: bias must be [out_features] of x's dtype");
    bias_dense = bias->contiguous();
    bias_ptr = &bias_dense;
  }
  const auto xc = x.contiguous();
  auto out = at::empty({x.size(0), out_features}, float_out ? x.options().dtype(at::kFloat) : x.options());
  if (!pairs) {
    skinny_linear_kernel<float, F32, float>(xc, packed, bias_ptr, out);
  } else if (float_out) {
    bf16_linear<float>(xc, packed, bias_ptr, out);
  } else {
    bf16_linear<c10::BFloat16>(xc, packed, bias_ptr, out);
  }
  return out;
}

// The code path a dtype's calls take on this machine (for benchmarks and tests).
std::string skinny_linear_path(at::ScalarType dtype) {
#if defined(SONAR_AMX)
  if (dtype == at::kBFloat16 && sonar::amx_permitted()) return "amx";
#endif
  return dtype == at::kBFloat16 || std::string(kPath) != "avx512_bf16" ? kPath : "avx512";
}

#undef SONAR_EACH_ROW

}  // namespace

TORCH_LIBRARY_FRAGMENT(sonar, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  // float_out: the output as float32, each value rounded to x's dtype first (the cast of the
  // x-dtype output, without that output and the second pass over it: an LM head's logits).
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, bool float_out=False) -> Tensor");
  m.def("skinny_linear_path(ScalarType dtype) -> str", &skinny_linear_path);
}

TORCH_LIBRARY_IMPL(sonar, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("skinny_linear", &skinny_linear);
}
