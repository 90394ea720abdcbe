// The product of a few bfloat16 rows with a 4-bit weight in torch's int4 layout, for CPUs with AVX2 and FMA
// (and no AVX-512 BF16: int4_gemv.cpp's kernel serves those). models/int4_gemv.py says when it runs.
//
// The layout (models/q4_blocks.py): packed [n / T][k][T / 2] bytes, T the tile height torch packs here (32 on
// AVX2, 64 on AVX-512), byte (t, kk, d) holding row t*T + d in its low nibble and row t*T + T/2 + d in its high
// one; scale_zeros [k / 32][n][2] bfloat16, a value being (q - 8) * scale + zero. A tile is read as T / 32
// strips of 16 bytes a column (32 rows: 16 low nibbles, 16 high). Per group of 32 columns,
// sum(x * value) = scale * sum(x * q) + (zero - 8 * scale) * sum(x).
//
// The scales and zeros are read in strip order where the weight has that copy (models/int4_gemv.py's
// ``gemv_layout``: [n / 32 strips][k / 32][32 rows][2], each strip's in one run of memory beside its weight
// bytes). In torch's order a strip's groups lie n * 4 bytes apart, one stream a group (18-48 on SmolLM2's
// shapes) beside the weight's, more than the hardware prefetcher follows: the strip order took a one-row
// product over SmolLM2's projections to 0.90x its time (docs/results/quantization.md).
//
// The products are integers, as llama.cpp's are: x is rounded to 8 bits (x = xs * xq, |xq| <= 127) with a scale
// xs per 16 columns, the even and the odd columns of each group of 32 (the largest |x| of the 16 over 127;
// llama.cpp's Q8_0 takes one per 32, which on SmolLM2 moved its perplexity up to 1.0% from the float32 path's
// on a 108-token text), and VPMADDUBSW
// multiplies the 4-bit values (unsigned bytes) by xq (signed bytes) and adds pairs: one instruction for 16 rows
// and two columns. Four columns are read as two 32-byte vectors (columns c, c+1 and c+2, c+3) whose bytes one
// unpack interleaves, so each 16-bit lane holds one row's values of columns c and c+2 (or c+1 and c+3); a
// group's sums stay exact in 16 bits (8 x 2 x 15 x 128 < 2^15) and are widened once a group. Why: the
// 16-bit rounding (VPMADDWD on values widened to 16 bits) took twice the vector instructions a byte of weight,
// and bound the product to the vector ports below the memory's rate on a 2-core AVX2 EPYC
// (docs/results/quantization.md): 0.90-0.94x its time over SmolLM2's projections.
// The weight is read once for up to kAvx2MaxRows rows of x (docs/results/quantization.md has the timings).

#if defined(__x86_64__)
#include <immintrin.h>
#define EVENFLOW_INT4_AVX2 1
#endif
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kAvx2Group = 32;   // columns per scale/zero
constexpr int64_t kAvx2Strip = 32;   // rows of a strip: 16 bytes a column
constexpr int kAvx2MaxRows = 2;      // rows of x that share one unpacking of the weight
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead of its reads a strip asks for lines (512 B-4 KiB alike)

#ifdef EVENFLOW_INT4_AVX2
#define EVENFLOW_AVX2 "avx2,fma"

bool int4_avx2_supported() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// x rounded to 8 bits, to nearest (even): ``xq`` [rows][k] in column order (gemv_strip spreads each four
// columns into the pairs the weight's unpacked lanes hold); ``scales`` [rows][k / 32][2] each group's xs of its
// even and its odd columns; ``sums`` [rows][k / 32] each group's sum(xs * xq), which the zeros multiply. A NaN in x makes
// its group's scales NaN.
__attribute__((target(EVENFLOW_AVX2))) void round_rows(const uint16_t* x, int64_t rows, int64_t k, int8_t* xq,
                                                       float* scales, float* sums) {
  const int64_t groups = k / kAvx2Group;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* xg = x + r * k + g * kAvx2Group;
      __m256 v[4];
      __m256 largest = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xg + 8 * i));
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
        largest = _mm256_max_ps(largest, _mm256_and_ps(v[i], magnitude));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
      }
      alignas(32) float lanes[8];  // lane i: the largest |x| of the group's columns i mod 8
      _mm256_store_ps(lanes, largest);
      float most[2] = {0.f, 0.f};  // of the even columns, of the odd ones
      for (int i = 0; i < 8; ++i) most[i % 2] = lanes[i] > most[i % 2] ? lanes[i] : most[i % 2];
      if (_mm256_movemask_ps(nan)) most[0] = most[1] = __builtin_nanf("");  // a NaN in x: the group's outputs NaN
      const float even = most[0] > 0.f ? 127.f / most[0] : 0.f, odd = most[1] > 0.f ? 127.f / most[1] : 0.f;
      const __m256 inverse = _mm256_setr_ps(even, odd, even, odd, even, odd, even, odd);
      // |v| * 127 / most <= 127 and a little: it rounds to 127 at most (a NaN converts to -128)
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
      // int32 -> int8 in column order: packs interleave the 128-bit lanes, the permute puts them back
      const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * k + g * kAvx2Group), bytes);
      alignas(32) int32_t parts[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts),
                         _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      int32_t total[2] = {0, 0};
      for (int i = 0; i < 8; ++i) total[i % 2] += parts[i];
      const float scale[2] = {most[0] / 127.f, most[1] / 127.f};
      scales[2 * (r * groups + g)] = scale[0];
      scales[2 * (r * groups + g) + 1] = scale[1];
      sums[r * groups + g] = scale[0] * float(total[0]) + scale[1] * float(total[1]);
    }
}

// float32 -> bfloat16, rounded to nearest even (the values are finite).
__attribute__((target(EVENFLOW_AVX2))) inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i half_up = _mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(half_up, odd), 16);
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);  // per 128-bit lane: 4 values, twice
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // lanes' low halves together
}

// Where a strip's scales and zeros are: run j's (its accumulator j's eight rows) of group g at
// first + g * group_stride + run[j], counted in bfloat16 values.
struct StripScales {
  const uint16_t* first;
  int64_t group_stride;
  int64_t run[4];
};

// A strip's 16 bytes of columns c and c + 1 as one vector, the columns ``kStride`` bytes apart (a tile's half
// height: 16 in 32-row tiles, where they are one 32-byte load).
template <int64_t kStride>
__attribute__((target(EVENFLOW_AVX2))) inline __m256i two_columns(const uint8_t* p) {
  if constexpr (kStride == 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kStride)), 1);
}

// A group's 16-bit sums, lane d holding row d's even columns and lane d + 8 its odd ones, as floats.
__attribute__((target(EVENFLOW_AVX2))) inline __m256 even_sums(__m256i acc) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc)));
}
__attribute__((target(EVENFLOW_AVX2))) inline __m256 odd_sums(__m256i acc) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc, 1)));
}

// The 32 output rows of strip ``s`` of tile ``t`` (rows t*T + 16s + [0, 16) and t*T + T/2 + 16s + [0, 16)) for R
// rows of x (``round_rows``'s). Each four columns of a row of xq are read as one 4-byte broadcast and spread
// into (xq[4c], xq[4c + 2]) eight times, then (xq[4c + 1], xq[4c + 3]) eight times, so x stays a byte a value
// and a step of hundreds of rows keeps it in L2. Accumulator j holds eight rows: j = 0, 1 the low nibbles of
// bytes [0, 8) and [8, 16), j = 2, 3 the high ones; per group, its integer sums are scaled into float32 totals.
template <int R, int64_t kStride>
__attribute__((target(EVENFLOW_AVX2))) void gemv_strip(const int8_t* xq, const float* scales, const float* sums,
                                                       int64_t k, int64_t n, int64_t tile_rows, const uint8_t* packed,
                                                       const StripScales& sz_at, int64_t t, int64_t s, uint16_t* y) {
  const int64_t groups = k / kAvx2Group;
  const int64_t first[4] = {t * tile_rows + 16 * s, t * tile_rows + 16 * s + 8, t * tile_rows + kStride + 16 * s,
                            t * tile_rows + kStride + 16 * s + 8};
  const uint8_t* strip = packed + t * k * kStride + 16 * s;
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i spread = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                          1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
  alignas(32) float total[R][4][8] = {};  // in memory: touched once a group, and registers are the inner loop's
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_si256();
    const uint8_t* p = strip + g * kAvx2Group * kStride;
#pragma GCC unroll 8
    for (int c = 0; c < kAvx2Group / 4; ++c) {  // columns 4c .. 4c + 3
      _mm_prefetch(reinterpret_cast<const char*>(p + 4 * c * kStride + kPrefetchBytes), _MM_HINT_T0);
      const __m256i a = two_columns<kStride>(p + 4 * c * kStride);
      const __m256i b = two_columns<kStride>(p + (4 * c + 2) * kStride);
      // per 128-bit lane, 16-bit words (byte d of column c or c + 1, byte d of column c + 2 or c + 3)
      const __m256i front = _mm256_unpacklo_epi8(a, b), back = _mm256_unpackhi_epi8(a, b);
      const __m256i w[4] = {_mm256_and_si256(front, nibble), _mm256_and_si256(back, nibble),
                            _mm256_and_si256(_mm256_srli_epi16(front, 4), nibble),
                            _mm256_and_si256(_mm256_srli_epi16(back, 4), nibble)};
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * k + g * kAvx2Group + 4 * c, sizeof four);
        const __m256i xr = _mm256_shuffle_epi8(_mm256_set1_epi32(four), spread);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_maddubs_epi16(w[j], xr));
      }
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i sz =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz_at.first + g * sz_at.group_stride + sz_at.run[j]));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(sz, 16));
      const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(sz, _mm256_set1_epi32(int(0xFFFF0000u))));
      const __m256 offset = _mm256_fmadd_ps(scale, _mm256_set1_ps(-8.f), zero);
      for (int r = 0; r < R; ++r) {
        const float* xs = scales + 2 * (r * groups + g);
        __m256 sum = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xs[0])), even_sums(acc[r][j]),
                                     _mm256_load_ps(total[r][j]));
        sum = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xs[1])), odd_sums(acc[r][j]), sum);
        _mm256_store_ps(total[r][j], _mm256_fmadd_ps(offset, _mm256_set1_ps(sums[r * groups + g]), sum));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * n + first[j]), to_bf16(_mm256_load_ps(total[r][j])));
}

// int4_gemv_avx2 for tiles whose columns are ``kStride`` bytes apart.
template <int64_t kStride>
void strips(const int8_t* xq, const float* scales, const float* sums, int64_t rows, int64_t k,
            const uint8_t* packed, const uint16_t* scale_zeros, const uint16_t* strip_scales, int64_t n,
            int64_t tile_rows, uint16_t* y, int threads) {
  const int64_t per_tile = tile_rows / kAvx2Strip, groups = k / kAvx2Group;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n / kAvx2Strip; ++i) {
    const int64_t t = i / per_tile, s = i % per_tile;
    const StripScales sz_at =
        strip_scales ? StripScales{strip_scales + i * groups * kAvx2Strip * 2, kAvx2Strip * 2, {0, 16, 32, 48}}
                     : StripScales{scale_zeros + (t * tile_rows + 16 * s) * 2, 2 * n, {0, 16, 2 * kStride, 2 * kStride + 16}};
    for (int64_t r = 0; r < rows; r += kAvx2MaxRows) {
      const int8_t* xr = xq + r * k;
      const float *xs = scales + 2 * r * groups, *sr = sums + r * groups;
      if (rows - r == 1)
        gemv_strip<1, kStride>(xr, xs, sr, k, n, tile_rows, packed, sz_at, t, s, y + r * n);
      else
        gemv_strip<2, kStride>(xr, xs, sr, k, n, tile_rows, packed, sz_at, t, s, y + r * n);
    }
  }
}

// y [rows, n] = x [rows, k] @ W.T (bfloat16 row-major; x as ``round_rows`` gives it): the tiles' strips split
// between ``threads``, each output computed by one thread in one order, the same for any block of rows.
// ``strip_scales``: the scales and zeros in strip order, or null to read ``scale_zeros`` (torch's order).
void int4_gemv_avx2(const int8_t* xq, const float* scales, const float* sums, int64_t rows, int64_t k,
                    const uint8_t* packed, const uint16_t* scale_zeros, const uint16_t* strip_scales, int64_t n,
                    int64_t tile_rows, uint16_t* y, int threads) {
  if (tile_rows == 32)
    strips<16>(xq, scales, sums, rows, k, packed, scale_zeros, strip_scales, n, tile_rows, y, threads);
  else
    strips<32>(xq, scales, sums, rows, k, packed, scale_zeros, strip_scales, n, tile_rows, y, threads);
}
#else
bool int4_avx2_supported() { return false; }
#endif

}  // namespace
