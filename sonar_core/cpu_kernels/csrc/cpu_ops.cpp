// Sonar's CPU kernels, registered as torch operators in the `sonar` namespace.
//
// * paged_attention: attention of a step's new queries over each sequence's context, read from the
//   paged KV cache where it lies (no gather of the context into a padded copy, no mask tensor).
// * store_kv_: the step's new keys and values into their cache slots, in one pass.
// * rotary_embedding_: RoPE applied in place to a strided [T, heads, head_dim] view.
// * rms_norm, add_rms_norm: RMSNorm, and the residual add fused with the norm after it.
// * silu_and_mul: the gated MLP's activation times the up projection.
// * argmax_rows: each float32 row's greedy pick, as torch.argmax picks it (argmax_rows_top: with
//   the softmax probability of that pick).
//
// Every kernel computes in float32 and rounds to the tensor's dtype exactly where the PyTorch
// operators it replaces round (each PyTorch element-wise op rounds its result), so bfloat16
// results agree with the eager path to the last bit wherever the arithmetic is the same (the
// reductions of the norm and attention may differ by float32 rounding). Each query row of the
// attention gets the same bits whatever else is in the batch: a decode token's row as when decoded
// alone, a verified token's row as in any other verification of its sequence.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "amx.h"
#include "convert.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using sonar::from_f32;
using sonar::rounded;
using sonar::to_f32;
#if defined(__AVX512F__)
using sonar::load16;
using sonar::widen_bfloat16;
#endif

// The dot product of two float32 rows, with one vector accumulator and a shuffle-tree sum at the
// end: compilers turn a plain reduction loop into a chain of dependent scalar adds, which made
// this most of the attention's time. A fixed order for a given build, whatever the batch holds.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  sum = _mm_cvtss_f32(half);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(x[i]);
    sum += v * v;
  }
  return sum;
}

// exp(x) for float32 in a form the compiler vectorises (glibc's expf stays scalar without
// -ffast-math; the comparisons need -fno-trapping-math, see COMPILE_FLAGS): x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error below 2e-7, about one
// float32 ulp), times 2^n built in the exponent bits.
// Inputs below -87 (e^x under float's normal range) give 0, which softmax and SiLU need.
inline float fast_exp(float x) {
  x = std::max(x, -87.3f);
  x = std::min(x, 88.7f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.3f ? 0.f : p * scale;
}

// n elements of working memory, uninitialised (std::vector zero-fills).
template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "sonar CPU kernel: ", name, " must be on the CPU");
}

// ---- attention over the paged cache ---------------------------------------------------------

// Whether keys and queries of type T are multiplied as bfloat16 pairs by AVX512-BF16's dot
// instruction (bfloat16 on a CPU that has it) rather than widened to float32.
template <typename T>
constexpr bool kBf16Pairs =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// Walks the rows of keys first, first + 1, ... of one KV head through the block table, one
// division at the start instead of one per key.
template <typename T>
struct CacheRows {
  const T* base;
  const int64_t* table;
  int64_t block_size, slot_stride, kv_offset, block, offset;
  const T* row;

  CacheRows(const T* base_, const int64_t* table_, int64_t block_size_, int64_t slot_stride_, int64_t kv_offset_,
            int64_t first)
      : base(base_), table(table_), block_size(block_size_), slot_stride(slot_stride_), kv_offset(kv_offset_),
        block(first / block_size_), offset(first % block_size_) {
    row = at_block();
  }
  const T* at_block() const { return base + (table[block] * block_size + offset) * slot_stride + kv_offset; }
  // The current row; moves to the next key.
  const T* next() {
    if (row == nullptr) row = at_block();
    const T* current = row;
    if (++offset == block_size) {
      offset = 0;
      ++block;
      row = nullptr;  // looked up when needed: the table may end with this block
    } else {
      row += slot_stride;
    }
    return current;
  }
};

// ---- attention of a sequence's several queries, sharing each key among them ------------------
// A verification step asks up to k+1 queries per sequence, each with its group's n_rep heads. The
// row-by-row kernel below pays a dot product with a horizontal sum per key and query row; this one
// lays up to 16 query rows of one KV group side by side in the lanes of a vector (the query
// transposed, [head_dim][16]) and scores a key against all of them with head_dim broadcast
// multiply-adds, eight keys at a time to hide their latency, with no horizontal sums (bfloat16 on a
// CPU with AVX512-BF16: the query's pairs of dimensions side by side, [head_dim / 2][16][2], each
// scored against a key's pair by one dot instruction, half the instructions). The softmax runs
// across lanes, and the value sums take one vector of dimensions for all the item's lanes per pass,
// in registers (bfloat16 with AMX: scores and value sums on tiles, amx_lane_scores and
// amx_lane_value_sums). Every lane's arithmetic is its own (masked keys add exact zeros), so a row
// gets the same bits from any step that verifies several tokens of its sequence, whatever the rest
// of the step holds. Prompts take this kernel too, as far as attention.py's in_place_policy says.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;

inline uint32_t bfloat16_bits(c10::BFloat16 x) {
  return x.x;
}

// What one work item needs to find its queries, keys and outputs.
struct LanesItem {
  int64_t seq;        // sequence index
  int64_t group;      // KV head
  int64_t first_row;  // the item's first row among the sequence's query_len * n_rep rows
  int lanes;          // rows in this item (up to 16)
};

// acc[l], l < kPassLanes: lane l's weights (scores[i * kLanes + l]) times the 16 values the rows
// of value_rows hold, summed over `count` rows. A lane's sum is the same whatever kPassLanes.
// Always inlined: called, it kept the sums in memory behind `acc` (a verification step's attention
// 1.3-1.5x slower).
template <typename T, int kPassLanes>
__attribute__((always_inline)) inline void lane_value_sums(CacheRows<T> value_rows, int64_t count, const float* scores,
                                                           __m512* acc) {
  for (int l = 0; l < kPassLanes; ++l) acc[l] = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    const __m512 v = load16(value_rows.next());
    const float* w = scores + i * kLanes;
    for (int l = 0; l < kPassLanes; ++l) acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(w[l]), v, acc[l]);
  }
}

// Key p's scores of the item's lanes, scaled, -inf for the lanes that do not see it, into its row.
inline void store_key_scores(__m512 raw, int64_t p, int64_t lo, __m512i first_v, __m512i last_v, __m512 scale_v,
                             float* scores) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(p));
  const __mmask16 visible = _mm512_cmple_epi32_mask(first_v, key) & _mm512_cmple_epi32_mask(key, last_v);
  _mm512_storeu_ps(scores + (p - lo) * kLanes, _mm512_mask_mul_ps(minus_inf, visible, raw, scale_v));
}

// The item's masked, scaled scores of keys lo..hi, scores[(key - lo) * kLanes + lane], from the
// query transposed in qt (float32 [kDim][kLanes], or bfloat16 pairs [kDim / 2][kLanes] in its first
// half where the CPU has AVX512-BF16).
template <typename T, int kVecs>
void vector_lane_scores(const float* qt, const T* k_ptr, const int64_t* table, int64_t block_size,
                        int64_t kv_slot_stride, int64_t kv_offset, int64_t lo, int64_t hi, __m512i first_v,
                        __m512i last_v, __m512 scale_v, float* scores) {
  constexpr int64_t kDim = kVecs * 16;
  constexpr int kKeys = 8;  // keys scored together
  constexpr bool kPairs = kBf16Pairs<T>;
  CacheRows<T> key_rows(k_ptr, table, block_size, kv_slot_stride, kv_offset, lo);
  alignas(64) float keys[kKeys][kDim] = {};
  for (int64_t p0 = lo; p0 <= hi; p0 += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, hi - p0 + 1));
    __m512 acc[kKeys];
    for (int j = 0; j < kKeys; ++j) acc[j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      // The keys' rows copied side by side first (all their cache lines asked for at once), then
      // broadcast a pair at a time from there.
      const uint32_t* const query_pairs = reinterpret_cast<const uint32_t*>(qt);
      alignas(64) uint32_t pairs[kKeys][kDim / 2];
      for (int j = 0; j < n; ++j) {
        const T* krow = key_rows.next();
        for (int64_t d = 0; d < kDim; d += 32) _mm512_store_si512(pairs[j] + d / 2, _mm512_loadu_si512(krow + d));
      }
      for (int j = n; j < kKeys; ++j) std::memset(pairs[j], 0, sizeof(pairs[j]));  // scores unused
      for (int64_t d = 0; d < kDim / 2; ++d) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(query_pairs + d * kLanes);
        for (int j = 0; j < kKeys; ++j) {
          acc[j] = _mm512_dpbf16_ps(acc[j], qd, (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[j][d])));
        }
      }
    }
#endif
    if constexpr (!kPairs) {
      for (int j = 0; j < n; ++j) {
        const T* krow = key_rows.next();
        for (int64_t d = 0; d < kDim; d += 16) _mm512_store_ps(keys[j] + d, load16(krow + d));
      }
      for (int64_t d = 0; d < kDim; ++d) {
        const __m512 qd = _mm512_loadu_ps(qt + d * kLanes);
        for (int j = 0; j < kKeys; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(keys[j][d]), qd, acc[j]);
      }
    }
    for (int j = 0; j < n; ++j) store_key_scores(acc[j], p0 + j, lo, first_v, last_v, scale_v, scores);
  }
}

#if defined(SONAR_AMX)
// vector_lane_scores by AMX tiles, for bfloat16 caches with blocks of a multiple of 16 slots: 16
// keys of a block straight from the cache are an A tile (one tile per 32 dimensions, the cache's
// slot stride as its row stride), the query pairs of up to 16 lanes are the B tiles (the layout
// qt already has: [pair][lane][2]), and one multiply-add of the tiles scores the 16 keys against
// all the lanes, in the [key][lane] layout of the scores. The vector loop pays one multiply-add
// per pair of dimensions and eight keys; this, one per 32 dimensions and 16 keys. Every lane's sum
// is its own, as there. Tile registers are not renamed, so the loop keeps two tiles of keys in
// flight (accumulators 0 and 6, keys 1 and 7; the query in 2-5) and masks and scales one pair of
// tiles' scores while the next pair is multiplied. The calling thread has configured its tiles
// (sonar::configure_tiles).
constexpr int64_t kTileKeys = 16;

// Scores of the 16 keys at `keys` (row stride key_bytes) against the query tiles, into out[key][lane],
// with accumulator tile ACC and key tile KEYS (the tile intrinsics take the numbers as literals).
#define SONAR_AMX_SCORE_TILE(NAME, ACC, KEYS)                                          \
  template <int kDimTiles>                                                             \
  inline void NAME(const c10::BFloat16* keys, int64_t key_bytes, float* out) {         \
    _tile_zero(ACC);                                                                   \
    _tile_loadd(KEYS, keys, key_bytes);                                                \
    _tile_dpbf16ps(ACC, KEYS, 2);                                                      \
    if constexpr (kDimTiles > 1) {                                                     \
      _tile_loadd(KEYS, keys + 32, key_bytes);                                         \
      _tile_dpbf16ps(ACC, KEYS, 3);                                                    \
    }                                                                                  \
    if constexpr (kDimTiles > 2) {                                                     \
      _tile_loadd(KEYS, keys + 64, key_bytes);                                         \
      _tile_dpbf16ps(ACC, KEYS, 4);                                                    \
      _tile_loadd(KEYS, keys + 96, key_bytes);                                         \
      _tile_dpbf16ps(ACC, KEYS, 5);                                                    \
    }                                                                                  \
    _tile_stored(ACC, out, kLanes * int64_t{sizeof(float)});                           \
  }
SONAR_AMX_SCORE_TILE(amx_score_tile_a, 0, 1)
SONAR_AMX_SCORE_TILE(amx_score_tile_b, 6, 7)
#undef SONAR_AMX_SCORE_TILE

template <int kVecs>
void amx_lane_scores(const uint32_t* query_pairs, const c10::BFloat16* k_ptr, const int64_t* table,
                     int64_t block_size, int64_t kv_slot_stride, int64_t kv_offset, int64_t lo, int64_t hi,
                     __m512i first_v, __m512i last_v, __m512 scale_v, float* scores) {
  constexpr int kDimTiles = kVecs * 16 / 32;  // 32 dimensions (64 bytes) per tile row
  static_assert(kDimTiles >= 1 && kDimTiles <= 4);
  constexpr int64_t kPairRows = 16, kStepKeys = 2 * kTileKeys;
  const int64_t key_bytes = kv_slot_stride * int64_t{sizeof(c10::BFloat16)};
  _tile_loadd(2, query_pairs, 64);
  if constexpr (kDimTiles > 1) _tile_loadd(3, query_pairs + kPairRows * kLanes, 64);
  if constexpr (kDimTiles > 2) {
    _tile_loadd(4, query_pairs + 2 * kPairRows * kLanes, 64);
    _tile_loadd(5, query_pairs + 3 * kPairRows * kLanes, 64);
  }
  const auto keys_at = [&](int64_t first) {
    return k_ptr + (table[first / block_size] * block_size + first % block_size) * kv_slot_stride + kv_offset;
  };
  // Two tiles of keys from `first` (the second only where it holds keys up to hi) into buffer.
  alignas(64) float tile_scores[2][kStepKeys * kLanes];
  const auto score_step = [&](int64_t first, float* buffer) {
    amx_score_tile_a<kDimTiles>(keys_at(first), key_bytes, buffer);
    if (first + kTileKeys <= hi) {
      amx_score_tile_b<kDimTiles>(keys_at(first + kTileKeys), key_bytes, buffer + kTileKeys * kLanes);
    }
  };
  const int64_t start = lo / kTileKeys * kTileKeys;
  score_step(start, tile_scores[0]);
  for (int64_t first = start, step = 0; first <= hi; first += kStepKeys, ++step) {
    if (first + kStepKeys <= hi) score_step(first + kStepKeys, tile_scores[(step + 1) & 1]);
    // Keys of the tiles before lo or past hi (slots past the sequence's last key hold anything)
    // are scored too, but their rows are never read.
    const float* step_scores = tile_scores[step & 1];
    const int64_t from = std::max(first, lo), to = std::min(first + kStepKeys - 1, hi);
    for (int64_t p = from; p <= to; ++p) {
      store_key_scores(_mm512_load_ps(step_scores + (p - first) * kLanes), p, lo, first_v, last_v, scale_v, scores);
    }
  }
}

// Sixteen rows of 16 floats transposed in place: rows[i][j] becomes rows[j][i] (unpacks within
// 128-bit lanes, then 128-bit lanes shuffled across rows).
inline void transpose16x16(__m512 rows[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  // u[4 i + c]: rows 4i..4i+3 of columns c, c + 4, c + 8, c + 12, one per 128-bit lane.
  __m512 u[16];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 low_01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
    const __m512 low_23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 high_01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xee);
    const __m512 high_23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xee);
    rows[c] = _mm512_shuffle_f32x4(low_01, low_23, 0x88);
    rows[c + 4] = _mm512_shuffle_f32x4(low_01, low_23, 0xdd);
    rows[c + 8] = _mm512_shuffle_f32x4(high_01, high_23, 0x88);
    rows[c + 12] = _mm512_shuffle_f32x4(high_01, high_23, 0xdd);
  }
}

// The value sums of an item's lanes on AMX tiles, for bfloat16: per 32 keys, the lanes' softmax
// weights as bfloat16 [lane][key] are A tiles (the float32 [key][lane] weights transposed), the
// keys' value rows interleaved in pairs of keys, 16 dimensions a tile, the B tiles, and tiles 0-3
// sum 64 dimensions of all the lanes (tiles 4 and 7 the weights, 5 and 6 the values). The vector
// loop pays a multiply-add per key, lane and 16 dimensions; this, two per 32 keys, 16 lanes and
// 16 dimensions, plus the transposes and interleaves. Each weight goes in as two bfloat16 parts,
// its rounding and the rounding of the rest (tiles 4 and 7), so the sums keep the float32
// weights' precision as the vector loop does: with the weights rounded once (as PyTorch's SDPA
// does for bfloat16), n-gram's greedy outputs on code editing matched plain decoding's in 0 of 8
// requests; with the two parts in 3 of 8 (4 of 8 with the vector loop). Each lane's sums are
// still its own. weights: [count][kLanes];
// weights_t: room for the transposed weights of ceil(count / 32) steps; sums: [kLanes][kDim].
template <int kVecs>
void amx_lane_value_sums(const float* weights, int64_t count, const c10::BFloat16* v_ptr, const int64_t* table,
                         int64_t block_size, int64_t kv_slot_stride, int64_t kv_offset, int64_t lo,
                         uint16_t* weights_t, float* sums) {
  constexpr int64_t kDim = kVecs * 16, kStepKeys = 32, kTileDims = 16;
  constexpr int kGroupTiles = kVecs < 4 ? kVecs : 4;  // accumulator tiles per pass: 64 dimensions
  const int64_t steps = (count + kStepKeys - 1) / kStepKeys;
  for (int64_t step = 0; step < steps; ++step) {
    __m512 halves[2][kLanes];
    for (int half = 0; half < 2; ++half) {
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t key = step * kStepKeys + half * kLanes + i;
        halves[half][i] = key < count ? _mm512_loadu_ps(weights + key * kLanes) : _mm512_setzero_ps();
      }
      transpose16x16(halves[half]);
    }
    for (int l = 0; l < kLanes; ++l) {
      uint16_t* const high = weights_t + (step * 2 * kLanes + l) * kStepKeys;
      uint16_t* const low = high + kLanes * kStepKeys;
      for (int half = 0; half < 2; ++half) {
        const __m256bh rounded = _mm512_cvtneps_pbh(halves[half][l]);
        const __m512 back = widen_bfloat16((__m256i)rounded);
        const __m256bh rest = _mm512_cvtneps_pbh(_mm512_sub_ps(halves[half][l], back));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + half * kLanes), (__m256i)rounded);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + half * kLanes), (__m256i)rest);
      }
    }
  }
  // Element 2n of a value tile's row: dimension n of the pair's first key; 2n + 1: of its second.
  alignas(64) static constexpr int16_t kInterleaveLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,
                                                              37, 6, 38, 7, 39, 8,  40, 9,  41, 10, 42,
                                                              11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kInterleaveHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                               53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                               27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i interleave_low = _mm512_load_si512(kInterleaveLow);
  const __m512i interleave_high = _mm512_load_si512(kInterleaveHigh);
  alignas(64) uint16_t value_tiles[kGroupTiles][kLanes * 32];  // 16 pairs of keys x 16 dimensions x 2
  for (int64_t group = 0; group < kDim; group += kGroupTiles * kTileDims) {
    CacheRows<c10::BFloat16> value_rows(v_ptr, table, block_size, kv_slot_stride, kv_offset + group, lo);
    _tile_zero(0);
    if constexpr (kGroupTiles > 1) _tile_zero(1);
    if constexpr (kGroupTiles > 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t step = 0; step < steps; ++step) {
      for (int64_t pair = 0; pair < kStepKeys / 2; ++pair) {
        const int64_t key = step * kStepKeys + 2 * pair;
        // Keys past the last one weigh zero; their values must be zeros too (0 x NaN is NaN).
        const c10::BFloat16* first = key < count ? value_rows.next() : nullptr;
        const c10::BFloat16* second = key + 1 < count ? value_rows.next() : nullptr;
        for (int64_t half = 0; half < kGroupTiles * kTileDims; half += 32) {
          const __m512i a = first ? _mm512_loadu_si512(first + half) : _mm512_setzero_si512();
          const __m512i b = second ? _mm512_loadu_si512(second + half) : _mm512_setzero_si512();
          const int tile = static_cast<int>(half / kTileDims);
          _mm512_store_si512(value_tiles[tile] + pair * 32, _mm512_permutex2var_epi16(a, interleave_low, b));
          if (tile + 1 < kGroupTiles) {
            _mm512_store_si512(value_tiles[tile + 1] + pair * 32, _mm512_permutex2var_epi16(a, interleave_high, b));
          }
        }
      }
      const uint16_t* const step_weights = weights_t + step * 2 * kLanes * kStepKeys;
      _tile_loadd(4, step_weights, 64);
      _tile_loadd(7, step_weights + kLanes * kStepKeys, 64);
      _tile_loadd(5, value_tiles[0], 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(0, 7, 5);
      if constexpr (kGroupTiles > 1) {
        _tile_loadd(6, value_tiles[1], 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(1, 7, 6);
      }
      if constexpr (kGroupTiles > 2) {
        _tile_loadd(5, value_tiles[2], 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(2, 7, 5);
        _tile_loadd(6, value_tiles[3], 64);
        _tile_dpbf16ps(3, 4, 6);
        _tile_dpbf16ps(3, 7, 6);
      }
    }
    constexpr int64_t sum_bytes = kDim * int64_t{sizeof(float)};
    _tile_stored(0, sums + group, sum_bytes);
    if constexpr (kGroupTiles > 1) _tile_stored(1, sums + group + kTileDims, sum_bytes);
    if constexpr (kGroupTiles > 2) {
      _tile_stored(2, sums + group + 2 * kTileDims, sum_bytes);
      _tile_stored(3, sums + group + 3 * kTileDims, sum_bytes);
    }
  }
}
#endif

template <typename T, int kVecs>
void attend_lanes(const LanesItem& item, const T* q_ptr, int64_t q_token_stride, int64_t q_head_stride, const T* k_ptr,
                  const T* v_ptr, const int64_t* tables, int64_t table_width, const int64_t* lens,
                  const int64_t* starts, int64_t block_size, int64_t kv_slot_stride, int64_t n_rep, int64_t num_heads,
                  bool causal, int64_t window, float scale, bool amx_tiles, float* scores, float* qt,
                  uint16_t* weights_t, T* out_ptr) {
  constexpr int64_t kDim = kVecs * 16;
  constexpr bool kPairs = kBf16Pairs<T>;
  // The transposed query as bfloat16 pairs (kPairs), in the first half of qt.
  uint32_t* const query_pairs = reinterpret_cast<uint32_t*>(qt);
  const int64_t b = item.seq, g = item.group, h0 = g * n_rep;
  const int64_t query_len = starts[b + 1] - starts[b], seq_len = lens[b];
  const int64_t* table = tables + b * table_width;
  const int64_t kv_offset = g * kDim;

  // Lane l: row first_row + l, i.e. query token j = row / n_rep of the sequence, head r = row % n_rep.
  alignas(64) int32_t first_key[kLanes], last_key[kLanes];
  int64_t lo = seq_len, hi = -1;
  for (int l = 0; l < kLanes; ++l) {
    if (l < item.lanes) {
      const int64_t row = item.first_row + l, j = row / n_rep, r = row % n_rep;
      const int64_t pos = seq_len - query_len + j;
      last_key[l] = static_cast<int32_t>(causal ? pos : seq_len - 1);
      first_key[l] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
      lo = std::min<int64_t>(lo, first_key[l]);
      hi = std::max<int64_t>(hi, last_key[l]);
      const T* qrow = q_ptr + (starts[b] + j) * q_token_stride + (h0 + r) * q_head_stride;
      if constexpr (kPairs) {
        for (int64_t d = 0; d < kDim; d += 2) {
          query_pairs[d / 2 * kLanes + l] = bfloat16_bits(qrow[d]) | bfloat16_bits(qrow[d + 1]) << 16;
        }
      } else {
        for (int64_t d = 0; d < kDim; ++d) qt[d * kLanes + l] = to_f32(qrow[d]);
      }
    } else {  // an empty lane: no key is ever its own
      first_key[l] = 1;
      last_key[l] = 0;
      if constexpr (kPairs) {
        for (int64_t d = 0; d < kDim; d += 2) query_pairs[d / 2 * kLanes + l] = 0;
      } else {
        for (int64_t d = 0; d < kDim; ++d) qt[d * kLanes + l] = 0.f;
      }
    }
  }
  const __m512i first_v = _mm512_load_si512(first_key), last_v = _mm512_load_si512(last_key);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale_v = _mm512_set1_ps(scale);
  // Scores of keys lo..hi against every lane: on AMX tiles where this call takes them.
  bool scored = false;
#if defined(SONAR_AMX)
  if constexpr (kPairs) {
    if (amx_tiles) {
      amx_lane_scores<kVecs>(query_pairs, k_ptr, table, block_size, kv_slot_stride, kv_offset, lo, hi, first_v,
                             last_v, scale_v, scores);
      scored = true;
    }
  }
#endif
  if (!scored) {
    vector_lane_scores<T, kVecs>(qt, k_ptr, table, block_size, kv_slot_stride, kv_offset, lo, hi, first_v, last_v,
                                 scale_v, scores);
  }

  // Softmax weights per lane.
  const int64_t count = hi - lo + 1;
  __m512 max_v = minus_inf;
  for (int64_t i = 0; i < count; ++i) max_v = _mm512_max_ps(max_v, _mm512_loadu_ps(scores + i * kLanes));
  alignas(64) float max_score[kLanes], total[kLanes];
  _mm512_store_ps(max_score, max_v);
  __m512 total_v = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    float* w = scores + i * kLanes;
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) w[l] = fast_exp(w[l] - max_score[l]);
    total_v = _mm512_add_ps(total_v, _mm512_loadu_ps(w));
  }
  _mm512_store_ps(total, total_v);

  // Weighted sums of the values, a vector of dimensions per pass for all the item's lanes, their
  // sums in registers and each weight broadcast into its multiply-add (one conversion of a value
  // vector serves up to sixteen multiply-adds).
  // Each lane's output row and the inverse of its softmax total, once for all the passes.
  T* out_rows[kLanes];
  alignas(64) float inverse[kLanes];
  for (int l = 0; l < item.lanes; ++l) {
    const int64_t row = item.first_row + l, j = row / n_rep, r = row % n_rep;
    out_rows[l] = out_ptr + (starts[b] + j) * num_heads * kDim + (h0 + r) * kDim;
    inverse[l] = 1.f / total[l];
  }
#if defined(SONAR_AMX)
  if constexpr (kPairs) {
    if (amx_tiles) {
      alignas(64) float sums[kLanes * kDim];
      amx_lane_value_sums<kVecs>(scores, count, v_ptr, table, block_size, kv_slot_stride, kv_offset, lo, weights_t,
                                 sums);
      for (int l = 0; l < item.lanes; ++l) {
        for (int64_t d = 0; d < kDim; ++d) out_rows[l][d] = from_f32<T>(sums[l * kDim + d] * inverse[l]);
      }
      return;
    }
  }
#endif
  for (int c = 0; c < kVecs; ++c) {
    __m512 acc[kLanes];
    CacheRows<T> value_rows(v_ptr, table, block_size, kv_slot_stride, kv_offset + c * 16, lo);
    // As many multiply-adds per value vector as the item has lanes, to a multiple of four: 12
    // serves three or four tokens of three heads a group (EAGLE-3's k=3 verification on SmolLM2:
    // its attention 7-11% faster than with 16, same bits).
    if (item.lanes <= 4) {
      lane_value_sums<T, 4>(value_rows, count, scores, acc);
    } else if (item.lanes <= 8) {
      lane_value_sums<T, 8>(value_rows, count, scores, acc);
    } else if (item.lanes <= 12) {
      lane_value_sums<T, 12>(value_rows, count, scores, acc);
    } else {
      lane_value_sums<T, kLanes>(value_rows, count, scores, acc);
    }
    for (int l = 0; l < item.lanes; ++l) {
      alignas(64) float values[16];
      _mm512_store_ps(values, _mm512_mul_ps(acc[l], _mm512_set1_ps(inverse[l])));
      for (int d = 0; d < 16; ++d) out_rows[l][c * 16 + d] = from_f32<T>(values[d]);
    }
  }
}
#endif

// ---- attention of a decode token's heads of one KV group, keys in vector lanes --------------
// A decode token asks one query row per head, and its group's n_rep heads share every key. The
// row-by-row kernel below converts a key once but then pays, per key and head, a dot product with
// a horizontal sum, and reads every value row once per head. This one reads each key row once for
// all the group's heads (bfloat16 pairs multiplied by AVX512-BF16's dot instruction where the CPU
// has it, else float32 multiply-adds), sums a vector's width of keys' partial vectors across
// lanes together (a transpose tree instead of a horizontal sum per key), runs the softmax a vector
// of keys at a time, and reads each value row once for as many heads as keep their sums in
// registers. It prefetches rows ahead across cache blocks, where the hardware prefetchers lose
// the trail. A row's arithmetic depends on its own sequence only, so a decode token gets the same
// bits whatever else is in the step. Built for AVX-512 and for AVX2 with FMA and F16C.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define SONAR_DECODE_BUILT 1

#if defined(__AVX512F__)
// 16 float lanes.
struct Wide {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 24;  // vectors of value sums kept in registers at once
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::BFloat16* p) { return load16(p); }
  static V load(const c10::Half* p) { return load16(p); }
  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store_first(float* p, V v, int n) { _mm512_mask_storeu_ps(p, first(n), v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  // Lane j of the result: the sum of v[j]'s lanes.
  static V sum_lanes(const V* v) {
    V pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; ++i) {
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 4; ++i) {
      const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
      quads[i] =
          _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i) {
      halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#else
// 8 float lanes.
struct Wide {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 12;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static V load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static __m256i first(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store_first(float* p, V v, int n) { _mm256_maskstore_ps(p, first(n), v); }
  static float reduce_max(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static V sum_lanes(const V* v) {
    V pairs[4], quads[2];
    for (int i = 0; i < 4; ++i) {
      pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 2; ++i) {
      const __m256d x = _mm256_castps_pd(pairs[2 * i]), y = _mm256_castps_pd(pairs[2 * i + 1]);
      quads[i] =
          _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                         _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
  }
};
#endif

// What a decode item needs: its query rows, its keys and where its output goes.
template <typename T>
struct DecodeItem {
  const T* query;        // the token's first head of the group
  int64_t query_stride;  // between its heads
  const int64_t* table;  // the sequence's block table
  int64_t kv_offset;     // the group's offset in a cache slot
  int64_t first, last;   // the keys it sees
  T* out;                // the output row of its first head (heads contiguous)
};

// A thread's working memory for decode items, sized once per parallel chunk (no allocation per
// item on the step's hot path): per head of the group its query vectors, a vector's width of
// keys' partial score vectors, and its softmax total.
struct DecodeScratch {
  std::vector<Wide::V> query, partial;
  std::vector<float> totals;

  DecodeScratch(int64_t n_rep, int64_t head_dim)
      : query(n_rep * std::max<int64_t>(1, head_dim / Wide::kLanes)), partial(n_rep * Wide::kLanes), totals(n_rep) {}
};

// Prefetches a key row into L1 and the value row at the same place of the value cache into L2.
template <typename T>
inline void prefetch_row(const T* key_row, std::ptrdiff_t value_offset, int64_t dim) {
  const char* k = reinterpret_cast<const char*>(key_row);
  const char* v = reinterpret_cast<const char*>(key_row + value_offset);
  for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(T)); byte += 64) {
    _mm_prefetch(k + byte, _MM_HINT_T0);
    _mm_prefetch(v + byte, _MM_HINT_T1);
  }
}

// The largest of x[0..n), a vector at a time (a scalar std::max loop stays one dependent chain).
inline float max_of(const float* x, int64_t n) {
  const Wide::V minus_inf = Wide::set1(-std::numeric_limits<float>::infinity());
  Wide::V largest = minus_inf;
  int64_t i = 0;
  for (; i + Wide::kLanes <= n; i += Wide::kLanes) largest = Wide::max(largest, Wide::load(x + i));
  if (i < n) {
    float rest[Wide::kLanes];
    Wide::store(rest, minus_inf);
    std::copy(x + i, x + n, rest);
    largest = Wide::max(largest, Wide::load(rest));
  }
  return Wide::reduce_max(largest);
}

// Scores (scaled) of keys first..last against each of the item's n_rep heads, into
// scores[r * score_stride + key - first].
template <typename T, int64_t kDim>
void decode_scores(const DecodeItem<T>& item, const T* k_ptr, const T* v_ptr, int64_t block_size, int64_t slot_stride,
                   int64_t n_rep, float scale, float* scores, int64_t score_stride, DecodeScratch& scratch) {
  constexpr int kLanes = Wide::kLanes;
  const int64_t count = item.last - item.first + 1;
  const Wide::V scale_v = Wide::set1(scale);
  constexpr bool kPairs = kBf16Pairs<T>;
  // The queries: bfloat16 pairs as they are, or float32.
  constexpr int kQueryVecs = kPairs ? kDim / 32 : kDim / kLanes;
  Wide::V* query = scratch.query.data();
  Wide::V* partial = scratch.partial.data();
  for (int64_t r = 0; r < n_rep; ++r) {
    const T* qrow = item.query + r * item.query_stride;
    for (int c = 0; c < kQueryVecs; ++c) {
#if defined(__AVX512BF16__)
      if constexpr (kPairs) {
        query[r * kQueryVecs + c] = _mm512_castsi512_ps(_mm512_loadu_si512(qrow + c * 32));
        continue;
      }
#endif
      query[r * kQueryVecs + c] = Wide::load(qrow + c * kLanes);
    }
  }
  CacheRows<T> rows(k_ptr, item.table, block_size, slot_stride, item.kv_offset, item.first);
  // The rows kAhead keys on: the key row into L1 for this loop, the value row into L2 for the
  // value sums.
  constexpr int64_t kAhead = 8;
  const std::ptrdiff_t v_minus_k = v_ptr - k_ptr;
  CacheRows<T> ahead(k_ptr, item.table, block_size, slot_stride, item.kv_offset, item.first);
  for (int64_t i = 0; i < std::min(kAhead, count); ++i) prefetch_row(ahead.next(), v_minus_k, kDim);
  for (int64_t p0 = 0; p0 < count; p0 += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, count - p0));
    for (int j = 0; j < kLanes; ++j) {
      if (j >= n) {
        for (int64_t r = 0; r < n_rep; ++r) partial[r * kLanes + j] = Wide::zero();
        continue;
      }
      if (p0 + j + kAhead < count) prefetch_row(ahead.next(), v_minus_k, kDim);
      const T* krow = rows.next();
      Wide::V key[kQueryVecs];
      for (int c = 0; c < kQueryVecs; ++c) {
#if defined(__AVX512BF16__)
        if constexpr (kPairs) {
          key[c] = _mm512_castsi512_ps(_mm512_loadu_si512(krow + c * 32));
          continue;
        }
#endif
        key[c] = Wide::load(krow + c * kLanes);
      }
      for (int64_t r = 0; r < n_rep; ++r) {
        const Wide::V* q = query + r * kQueryVecs;
        Wide::V acc = Wide::zero();
        for (int c = 0; c < kQueryVecs; ++c) {
#if defined(__AVX512BF16__)
          if constexpr (kPairs) {
            acc = _mm512_dpbf16_ps(acc, (__m512bh)q[c], (__m512bh)key[c]);
            continue;
          }
#endif
          acc = Wide::fmadd(q[c], key[c], acc);
        }
        partial[r * kLanes + j] = acc;
      }
    }
    for (int64_t r = 0; r < n_rep; ++r) {
      Wide::store_first(scores + r * score_stride + p0, Wide::mul(Wide::sum_lanes(partial + r * kLanes), scale_v), n);
    }
  }
}

template <typename T, int64_t kDim, int kHeads>
void decode_value_sums(const DecodeItem<T>& item, const T* v_ptr, int64_t block_size, int64_t slot_stride,
                       const float* weights, int64_t weight_stride, const float* totals) {
  constexpr int kVecs = kDim / Wide::kLanes;
  Wide::V acc[kHeads][kVecs];
#pragma GCC unroll 32
  for (int r = 0; r < kHeads; ++r)
#pragma GCC unroll 32
    for (int c = 0; c < kVecs; ++c) acc[r][c] = Wide::zero();
  // GCC kept the sums in memory, storing all of them for every key, while the loop looked its
  // block up inside and the loops over heads and vectors were unrolled only after it had placed
  // them: so the keys go block by block, the small loops are unrolled first, and each value
  // vector is loaded where it is used (a whole row loaded first needs kVecs more registers, which
  // AVX2's 16 do not have beside the sums).
  for (int64_t p = item.first; p <= item.last;) {
    const int64_t offset = p % block_size, run = std::min(block_size - offset, item.last - p + 1);
    const T* vrow = v_ptr + (item.table[p / block_size] * block_size + offset) * slot_stride + item.kv_offset;
    const float* key_weights = weights + (p - item.first);
    for (int64_t i = 0; i < run; ++i, vrow += slot_stride) {
      Wide::V w[kHeads];
#pragma GCC unroll 32
      for (int r = 0; r < kHeads; ++r) w[r] = Wide::set1(key_weights[r * weight_stride + i]);
#pragma GCC unroll 32
      for (int c = 0; c < kVecs; ++c) {
        const Wide::V v = Wide::load(vrow + c * Wide::kLanes);
#pragma GCC unroll 32
        for (int r = 0; r < kHeads; ++r) acc[r][c] = Wide::fmadd(w[r], v, acc[r][c]);
      }
    }
    p += run;
  }
  for (int r = 0; r < kHeads; ++r) {
    const Wide::V inv = Wide::set1(1.f / totals[r]);
    float values[kDim];
    for (int c = 0; c < kVecs; ++c) Wide::store(values + c * Wide::kLanes, Wide::mul(acc[r][c], inv));
    T* orow = item.out + r * kDim;
    for (int64_t d = 0; d < kDim; ++d) orow[d] = from_f32<T>(values[d]);
  }
}

// Heads whose value sums stay in registers together.
template <int64_t kDim>
constexpr int kPvHeads = std::max<int>(1, Wide::kRegisters / static_cast<int>(kDim / Wide::kLanes));

// decode_value_sums for `heads` (1..kPvHeads) heads, each count compiled with its sums in registers.
template <typename T, int64_t kDim, int kHeads = 1>
void decode_value_sums_for(int heads, const DecodeItem<T>& item, const T* v_ptr, int64_t block_size,
                           int64_t slot_stride, const float* weights, int64_t weight_stride, const float* totals) {
  if constexpr (kHeads < kPvHeads<kDim>) {
    if (heads != kHeads) {
      decode_value_sums_for<T, kDim, kHeads + 1>(heads, item, v_ptr, block_size, slot_stride, weights, weight_stride,
                                                 totals);
      return;
    }
  }
  decode_value_sums<T, kDim, kHeads>(item, v_ptr, block_size, slot_stride, weights, weight_stride, totals);
}

template <typename T, int64_t kDim>
void attend_decode(const DecodeItem<T>& item, const T* k_ptr, const T* v_ptr, int64_t block_size,
                   int64_t slot_stride, int64_t n_rep, float scale, float* scores, int64_t score_stride,
                   DecodeScratch& scratch) {
  decode_scores<T, kDim>(item, k_ptr, v_ptr, block_size, slot_stride, n_rep, scale, scores, score_stride, scratch);
  const int64_t count = item.last - item.first + 1;
  float* totals = scratch.totals.data();
  for (int64_t r = 0; r < n_rep; ++r) {
    float* w = scores + r * score_stride;
    const float max_score = max_of(w, count);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < count; ++i) {
      w[i] = fast_exp(w[i] - max_score);
      total += w[i];
    }
    totals[r] = total;
  }
  for (int64_t r0 = 0; r0 < n_rep; r0 += kPvHeads<kDim>) {
    const int heads = static_cast<int>(std::min<int64_t>(kPvHeads<kDim>, n_rep - r0));
    DecodeItem<T> pass = item;
    pass.out = item.out + r0 * kDim;
    decode_value_sums_for<T, kDim>(heads, pass, v_ptr, block_size, slot_stride, scores + r0 * score_stride,
                                   score_stride, totals + r0);
  }
}
#endif

// Keys per AMX tile by which bfloat16 rows of several queries are scored and summed, in steps whose
// cache blocks hold whole tiles of keys; 0 where this build or process has no tiles. Such steps
// are faster in place at every row length measured (attention.py).
int64_t attention_tile_keys() {
#if defined(SONAR_AMX) && defined(__AVX512BF16__)
  return sonar::amx_permitted() ? kTileKeys : 0;
#else
  return 0;
#endif
}

// kHeadDim > 0: the head size is known when compiling (the common sizes), so the per-key loops
// have fixed trip counts and their accumulators stay in registers; 0: any head size.
template <typename T, int64_t kHeadDim>
void paged_attention_kernel(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale, bool causal, int64_t window,
    at::Tensor& out) {
  const int64_t num_tokens = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t n_rep = num_heads / kv_heads;
  const int64_t num_seqs = seq_lens.size(0), table_width = block_tables.size(1);
  const int64_t q_token_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t kv_slot_stride = kv_heads * head_dim;

  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();

  std::vector<int64_t> token_seq(num_tokens);
  int64_t longest = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(starts[b] <= starts[b + 1] && starts[b + 1] <= num_tokens, "paged_attention: bad query_start_loc");
    TORCH_CHECK(lens[b] >= starts[b + 1] - starts[b], "paged_attention: seq_lens shorter than the queries");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= table_width, "paged_attention: block table too short");
    for (int64_t t = starts[b]; t < starts[b + 1]; ++t) token_seq[t] = b;
    longest = std::max(longest, lens[b]);
  }
  TORCH_CHECK(starts[num_seqs] == num_tokens, "paged_attention: query_start_loc does not cover the queries");

  // Work items. A sequence verifying several tokens, where attend_lanes is built for this head
  // size, gives items of up to 16 of its rows of one KV group. Every other token (decode steps)
  // gives one item per KV group: the token's n_rep heads of the group, each key and value row
  // read once for all of them (attend_decode where it is built, else the loops below); each such
  // row is computed by the same loops whatever else is in the step.
#if defined(__AVX512F__)
  constexpr bool kLanesBuilt =
      (kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 128) && !std::is_same_v<T, double>;
  std::vector<LanesItem> lane_items;
#else
  constexpr bool kLanesBuilt = false;
#endif
#if defined(SONAR_DECODE_BUILT)
  constexpr bool kDecodeBuilt =
      (kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 128) && !std::is_same_v<T, double>;
#endif
  std::vector<int64_t> row_tokens;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t query_len = starts[b + 1] - starts[b];
    if (kLanesBuilt && query_len > 1) {
#if defined(__AVX512F__)
      const int64_t rows = query_len * n_rep;
      for (int64_t g = 0; g < kv_heads; ++g) {
        for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
          lane_items.push_back({b, g, r0, static_cast<int>(std::min(kLanes, rows - r0))});
        }
      }
#endif
    } else {
      for (int64_t t = starts[b]; t < starts[b + 1]; ++t) row_tokens.push_back(t);
    }
  }
#if defined(__AVX512F__)
  const int64_t num_lane_items = static_cast<int64_t>(lane_items.size());
#else
  const int64_t num_lane_items = 0;
#endif
  const int64_t items = num_lane_items + static_cast<int64_t>(row_tokens.size()) * kv_heads;
  // One item reads its whole context; below a few thousand multiply-adds per item the threads
  // would cost more than they save.
  const int64_t grain = longest * head_dim * n_rep >= 4096 ? 1 : std::max<int64_t>(items, 1);
  const float fscale = static_cast<float>(scale);

#if defined(__AVX512F__)
  // The lanes' scores and value sums by AMX tiles (amx_lane_scores, amx_lane_value_sums) where the
  // cache's blocks hold whole tiles of keys.
  const int64_t tile_keys = std::is_same_v<T, c10::BFloat16> && num_lane_items > 0 ? attention_tile_keys() : 0;
  const bool amx_tiles = tile_keys > 0 && block_size % tile_keys == 0;
#endif

  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
#if defined(SONAR_AMX)
    if (amx_tiles) sonar::configure_tiles();
#endif
    std::vector<float> query(n_rep * head_dim), row(head_dim), sums(kHeadDim > 0 ? 0 : head_dim);
    std::vector<float> scores(n_rep * longest);
#if defined(__AVX512F__)
    // Written before they are read, so left uninitialised: zero-filled per call, four and six
    // queries over 1,200 cached tokens took 58.7-59.1 / 84.4-87.6 us a layer against 53.5-55.1 /
    // 80.9-82.7 (SmolLM2's shape, bfloat16, Xeon with AMX, 2 threads, builds alternated).
    const auto lane_scores = scratch<float>(kLanesBuilt && num_lane_items ? longest * kLanes : 0);
    const auto lane_queries = scratch<float>(kLanesBuilt && num_lane_items ? head_dim * kLanes : 0);
    const auto lane_weights_t = scratch<uint16_t>(amx_tiles ? (longest + 31) / 32 * 2 * kLanes * 32 : 0);
#endif
#if defined(SONAR_DECODE_BUILT)
    DecodeScratch decode_scratch(kDecodeBuilt ? n_rep : 0, head_dim);
#endif
    for (int64_t index = begin; index < end; ++index) {
#if defined(__AVX512F__)
      if constexpr (kLanesBuilt) {
        if (index < num_lane_items) {
          attend_lanes<T, (kLanesBuilt ? kHeadDim : 16) / 16>(
              lane_items[index], q_ptr, q_token_stride, q_head_stride, k_ptr, v_ptr, tables, table_width, lens,
              starts, block_size, kv_slot_stride, n_rep, num_heads, causal, window, fscale, amx_tiles,
              lane_scores.get(), lane_queries.get(), lane_weights_t.get(), out_ptr);
          continue;
        }
      }
#endif
      const int64_t item = index - num_lane_items;
      const int64_t t = row_tokens[item / kv_heads], g = item % kv_heads, h0 = g * n_rep;
      const int64_t b = token_seq[t];
      const int64_t query_len = starts[b + 1] - starts[b];
      const int64_t seq_len = lens[b];
      const int64_t pos = seq_len - query_len + (t - starts[b]);
      const int64_t last = causal ? pos : seq_len - 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t count = last - first + 1;
      const int64_t* table = tables + b * table_width;
      const int64_t kv_offset = g * head_dim;
#if defined(SONAR_DECODE_BUILT)
      if constexpr (kDecodeBuilt) {
        const DecodeItem<T> decode{q_ptr + t * q_token_stride + h0 * q_head_stride, q_head_stride, table, kv_offset,
                                   first, last, out_ptr + t * num_heads * head_dim + h0 * head_dim};
        attend_decode<T, kDecodeBuilt ? kHeadDim : 32>(decode, k_ptr, v_ptr, block_size, kv_slot_stride, n_rep,
                                                       fscale, scores.data(), longest, decode_scratch);
        continue;
      }
#endif

      for (int64_t r = 0; r < n_rep; ++r) {
        const T* qrow = q_ptr + t * q_token_stride + (h0 + r) * q_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) query[r * head_dim + d] = to_f32(qrow[d]);
      }
      // Keys first..last, walked block by block (no division per key).
      for (int64_t p = first; p <= last;) {
        const int64_t block = table[p / block_size], offset = p % block_size;
        const int64_t run = std::min(block_size - offset, last - p + 1);
        const T* krow = k_ptr + (block * block_size + offset) * kv_slot_stride + kv_offset;
        for (int64_t i = 0; i < run; ++i, krow += kv_slot_stride) {
          for (int64_t d = 0; d < head_dim; ++d) row[d] = to_f32(krow[d]);
          for (int64_t r = 0; r < n_rep; ++r) {
            scores[r * longest + p - first + i] = dot(query.data() + r * head_dim, row.data(), head_dim) * fscale;
          }
        }
        p += run;
      }
      // Per head: softmax weights, then the weighted sum of values in a local array that the
      // compiler keeps in registers when the head size is fixed (no store and reload per key).
      for (int64_t r = 0; r < n_rep; ++r) {
        float* w = scores.data() + r * longest;
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < count; ++i) max_score = std::max(max_score, w[i]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < count; ++i) {
          w[i] = fast_exp(w[i] - max_score);
          total += w[i];
        }
        float local[kHeadDim > 0 ? kHeadDim : 1];
        float* a = kHeadDim > 0 ? local : sums.data();
        std::fill(a, a + head_dim, 0.f);
        for (int64_t p = first; p <= last;) {
          const int64_t block = table[p / block_size], offset = p % block_size;
          const int64_t run = std::min(block_size - offset, last - p + 1);
          const T* vrow = v_ptr + (block * block_size + offset) * kv_slot_stride + kv_offset;
          for (int64_t i = 0; i < run; ++i, vrow += kv_slot_stride) {
            const float wp = w[p - first + i];
            for (int64_t d = 0; d < head_dim; ++d) a[d] += wp * to_f32(vrow[d]);
          }
          p += run;
        }
        T* orow = out_ptr + t * num_heads * head_dim + (h0 + r) * head_dim;
        const float inv = 1.f / total;
        for (int64_t d = 0; d < head_dim; ++d) orow[d] = from_f32<T>(a[d] * inv);
      }
    }
#if defined(SONAR_AMX)
    if (amx_tiles) _tile_release();
#endif
  });
}

at::Tensor paged_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale, bool causal, int64_t window) {
  for (const auto* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens, &query_start_loc}) check_cpu(*t, "input");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, heads, head_dim], last dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "paged_attention: caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_attention: q and the caches must share a dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "paged_attention: head_dim or head counts do not match the cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "paged_attention: metadata must be int64");
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto starts = query_start_loc.contiguous();
  TORCH_CHECK(starts.numel() == lens.numel() + 1 && tables.size(0) == lens.numel(),
              "paged_attention: metadata sizes do not agree");
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    switch (q.size(2)) {
      case 32:
        paged_attention_kernel<scalar_t, 32>(q, k_cache, v_cache, tables, lens, starts, scale, causal, window, out);
        break;
      case 64:
        paged_attention_kernel<scalar_t, 64>(q, k_cache, v_cache, tables, lens, starts, scale, causal, window, out);
        break;
      case 128:
        paged_attention_kernel<scalar_t, 128>(q, k_cache, v_cache, tables, lens, starts, scale, causal, window, out);
        break;
      default:
        paged_attention_kernel<scalar_t, 0>(q, k_cache, v_cache, tables, lens, starts, scale, causal, window, out);
    }
  });
  return out;
}

// ---- cache writes and rotary ----------------------------------------------------------------

template <typename T>
void store_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t num_tokens) {
  const int64_t heads = src.size(1), head_dim = src.size(2);
  const int64_t slot_stride = heads * head_dim;
  const T* s = src.data_ptr<T>();
  T* c = cache.data_ptr<T>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      std::copy_n(s + t * src.stride(0) + h * src.stride(1), head_dim, c + slots[t] * slot_stride + h * head_dim);
    }
  }
}

void store_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
               const at::Tensor& slot_mapping) {
  for (const at::Tensor* t : {&k, &v, &slot_mapping}) check_cpu(*t, "input");
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv_: k and v must be [T, kv_heads, head_dim], last dim contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kv_: caches must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "store_kv_: dtypes of k/v and the caches differ");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2) && v_cache.size(2) == v.size(1) &&
                  v_cache.size(3) == v.size(2),
              "store_kv_: head shapes do not match the caches");
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t num_tokens = k.size(0);
  TORCH_CHECK(slots.numel() == num_tokens && v.size(0) == num_tokens, "store_kv_: one slot per token");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < capacity, "store_kv_: slot ", s[t], " outside the cache");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kv_", [&] {
    store_rows<scalar_t>(k, k_cache, s, num_tokens);
    store_rows<scalar_t>(v, v_cache, s, num_tokens);
  });
}

template <typename T>
void rotary_kernel(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t num_tokens = x.size(0), heads = x.size(1), rotary_dim = cos.size(1), half = rotary_dim / 2;
  T* base = x.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    // A token's tables serve all its heads: converted once, then each head is one vector loop over
    // its two halves (distinct pointers, so the compiler need not fear they overlap).
    std::vector<float> tables(2 * rotary_dim);
    float* const cf = tables.data();
    float* const sf = cf + rotary_dim;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < rotary_dim; ++i) {
        cf[i] = to_f32(c[t * rotary_dim + i]);
        sf[i] = to_f32(s[t * rotary_dim + i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* __restrict lo = base + t * token_stride + h * head_stride;
        T* __restrict hi = lo + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f32(lo[i]), x2 = to_f32(hi[i]);
          // x * cos rounds (one op), then + rotate_half(x) * signed_sin rounds (addcmul).
          const float a1 = rounded<T>(x1 * cf[i]);
          const float a2 = rounded<T>(x2 * cf[i + half]);
          lo[i] = from_f32<T>(a1 + x2 * sf[i]);
          hi[i] = from_f32<T>(a2 + x1 * sf[i + half]);
        }
      }
    }
  });
}

void rotary_embedding_(at::Tensor x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  check_cpu(x, "x");
  check_cpu(cos, "cos");
  check_cpu(signed_sin, "signed_sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_embedding_: x must be [T, heads, head_dim], last dim contiguous");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.sizes() == signed_sin.sizes() && cos.dim() == 2,
              "rotary_embedding_: cos and sin must be contiguous [T, rotary_dim]");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) <= x.size(2) && cos.size(1) % 2 == 0,
              "rotary_embedding_: tables do not fit x");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && signed_sin.scalar_type() == x.scalar_type(),
              "rotary_embedding_: tables and x must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding_", [&] {
    rotary_kernel<scalar_t>(x, cos, signed_sin);
  });
}

// ---- norms and the MLP activation -----------------------------------------------------------

// out = weight * round(x / rms(x)), the order of sonar_core.layers.norms.RMSNorm; with `residual`,
// x = round(x + residual) first and is returned too. A [groups, width] weight takes row r's from
// its row r % groups: the norms of a row's consecutive groups (rms_norm_per_group) in one call.
template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                     at::Tensor& out, at::Tensor* summed) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* weights = weight.data_ptr<T>();
  const int64_t groups = weight.dim() == 2 ? weight.size(0) : 1;
  T* op = out.data_ptr<T>();
  T* sp = summed ? summed->data_ptr<T>() : nullptr;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * width;
      const T* w = weights + (r % groups) * width;
      if (rp) {
        T* srow = sp + r * width;
        const T* rrow = rp + r * width;
        for (int64_t i = 0; i < width; ++i) srow[i] = from_f32<T>(to_f32(row[i]) + to_f32(rrow[i]));
        row = srow;
      }
      const float inv = 1.f / std::sqrt(sum_of_squares(row, width) / static_cast<float>(width) + feps);
      T* orow = op + r * width;
      for (int64_t i = 0; i < width; ++i) {
        orow[i] = from_f32<T>(to_f32(w[i]) * rounded<T>(to_f32(row[i]) * inv));
      }
    }
  });
}

void check_norm_inputs(const at::Tensor& x, const at::Tensor& weight) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be contiguous [rows, width]");
  TORCH_CHECK((weight.dim() == 1 || weight.dim() == 2) && weight.is_contiguous() &&
                  weight.size(-1) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [width] or [groups, width] of x's dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_inputs(x, weight);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x, nullptr, weight, eps, out, nullptr);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, double eps) {
  check_norm_inputs(x, weight);
  check_cpu(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous and shaped like x");
  auto out = at::empty_like(x);
  auto summed = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x, &residual, weight, eps, out, &summed);
  });
  return {out, summed};
}

template <typename T>
void silu_and_mul_kernel(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), width = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Shares of at least 4,096 outputs: SmolLM2's four-row verification splits 2 + 2 (4.7 us a call
  // against 5.7 on one thread, AMD EPYC), a decode row stays on one thread.
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * width;
      const T* up = gate + width;
      T* orow = op + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = to_f32(gate[i]);
        orow[i] = from_f32<T>(rounded<T>(g / (1.f + fast_exp(-g))) * to_f32(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x must be contiguous [rows, 2 * width] (gate then up)");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(x, out);
  });
  return out;
}

// ---- greedy picks ----------------------------------------------------------------------------
// The index of each row's largest value, the first one on ties, a NaN counting as the largest:
// what torch.argmax returns. PyTorch's CPU argmax walks a row element by element carrying the
// index (0.1 ms a row of a 49k vocabulary, 3 ms for the 48 rows of a verification step); this finds
// the maximum a vector at a time, then the first element equal to it.
int64_t first_equal(const float* x, int64_t n, float value) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(value);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(value);
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    if (x[i] == value) return i;
  }
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  int64_t i = 0;
  // A NaN lane may drop the lane's maximum; the row's answer is then its first NaN anyway.
#if defined(__AVX512F__)
  __m512 largest = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    largest = _mm512_max_ps(largest, v);
  }
  best = _mm512_reduce_max_ps(largest);
  has_nan = unordered != 0;
#elif defined(__AVX2__)
  __m256 largest = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    largest = _mm256_max_ps(largest, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  for (float lane : lanes) best = std::max(best, lane);
  has_nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    if (x[i] != x[i]) {
      has_nan = true;
    } else {
      best = std::max(best, x[i]);
    }
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (x[j] != x[j]) return j;
    }
  }
  return std::max<int64_t>(first_equal(x, n, best), 0);
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows: x must be contiguous float32 [rows, n] with n > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* picks = out.data_ptr<int64_t>();
  // A row is a few microseconds: threads only pay off for several rows of a large vocabulary.
  const int64_t grain = std::max<int64_t>(1, 65536 / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) picks[r] = argmax_row(data + r * n, n);
  });
  return out;
}

// Each row's argmax and the softmax probability (temperature 1) of that maximum, 1 / sum(e^(x - max)):
// how sure a draft head is of its greedy pick, in the same call as the pick (a softmax, a max and
// their tensors cost a draft pass more than this sweep over a row it has just read). A row whose
// pick is a NaN gets a NaN probability.
std::tuple<at::Tensor, at::Tensor> argmax_rows_top(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows_top: x must be contiguous float32 [rows, n] with n > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  auto picks = at::empty({rows}, x.options().dtype(at::kLong));
  auto top = at::empty({rows}, x.options());
  const float* data = x.data_ptr<float>();
  int64_t* pick = picks.data_ptr<int64_t>();
  float* probability = top.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 65536 / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * n;
      pick[r] = argmax_row(row, n);
      const float largest = row[pick[r]];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += fast_exp(row[i] - largest);
      probability[r] = largest != largest ? largest : 1.f / sum;
    }
  });
  return {picks, top};
}

// Whether paged_attention is the faster path for verification steps (several queries per
// sequence) too, not only for decode steps. AVX-512 builds share each key among a sequence's
// queries (attend_lanes). AVX2 builds attend query by query (attend_decode), which still beats
// gathering the context for PyTorch's SDPA there: on an AMD EPYC (AVX2, 2 threads, SmolLM2 over
// 256 cached tokens) a whole step of 4 / 6 tokens took 30.7 / 32.1 ms gathered and 16.0 / 21.1 in
// place in bfloat16, 39.3 / 43.8 and 27.9 / 29.6 in float32 (decode: 13.1 and 21.9).
bool attention_verifies_in_place() {
#if defined(__AVX512F__) || defined(SONAR_DECODE_BUILT)
  return true;
#else
  return false;
#endif
}

// Whether this build scores each key once for all of a sequence's queries (attend_lanes, AVX-512
// builds) rather than query by query: only then do prompts gain from attending in place.
bool attention_shares_keys() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(sonar, m) {
  m.def("attention_verifies_in_place() -> bool", &attention_verifies_in_place);
  m.def("attention_shares_keys() -> bool", &attention_shares_keys);
  m.def("attention_tile_keys() -> int", &attention_tile_keys);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, bool causal, int window) -> Tensor");
  m.def("store_kv_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("argmax_rows_top(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sonar, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kv_", &store_kv_);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("argmax_rows_top", &argmax_rows_top);
}
