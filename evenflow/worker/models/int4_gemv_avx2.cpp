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
// The products are integers: x is rounded to 16 bits per group of 32 columns (x = xs * xq, |xq| <= 32767, xs
// the group's largest |x| / 32767: an error of at most 2^-16 of that largest value, 128x finer than the
// bfloat16 output's rounding), and two columns' bytes are interleaved so that each 32-bit lane holds one row's
// two 4-bit values as 16-bit integers, which VPMADDWD multiplies by the two columns' xq and adds: one
// instruction for eight rows and two columns, summed exactly in 32 bits over the group (at most
// 16 x 2 x 15 x 32767 < 2^31). Why integers: a float32 conversion of every 4-bit value and an FMA per eight
// rows and column take about twice the instructions, and bind a one-row product to the FP ports (~20 GB/s on a
// 2-core AVX2 EPYC, below its memory's rate).
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

// x rounded to 16 bits per group of 32 columns, for rows x k bfloat16 values: ``pairs`` [rows][k / 2] the
// columns (2i, 2i + 1) as two int16 in one word (low: 2i), ``scales`` and ``sums`` [rows][k / 32] each group's
// xs and the sum of its rounded values (xs * sum(xq)), which the zeros multiply. Rounded to nearest (even).
__attribute__((target(EVENFLOW_AVX2))) void round_rows(const uint16_t* x, int64_t rows, int64_t k, int32_t* pairs,
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
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, largest);
      float most = 0.f;
      for (float lane : lanes) most = lane > most ? lane : most;
      if (_mm256_movemask_ps(nan)) most = __builtin_nanf("");  // a NaN in x makes the group's outputs NaN
      const __m256 inverse = _mm256_set1_ps(most > 0.f ? 32767.f / most : 0.f);
      __m256i q[4];  // |v| * 32767 / most <= 32767 and a little: it rounds to 32767 at most
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
      int32_t* out = pairs + r * (k / 2) + g * (kAvx2Group / 2);
      for (int i = 0; i < 4; i += 2)  // packs interleaves the 128-bit lanes: the permute puts them back in order
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4 * i),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(q[i], q[i + 1]), 0xD8));
      alignas(32) int32_t parts[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts),
                         _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      int32_t total = 0;
      for (int32_t part : parts) total += part;
      const float scale = most / 32767.f;
      scales[r * groups + g] = scale;
      sums[r * groups + g] = scale * float(total);
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

// The 32 output rows of strip ``s`` of tile ``t`` (rows t*T + 16s + [0, 16) and t*T + T/2 + 16s + [0, 16)) for R
// rows of x (``round_rows``'s). Accumulator j holds eight rows: j = 0, 1 the low nibbles of bytes [0, 8) and
// [8, 16), j = 2, 3 the high ones; per group, its integer sums are scaled into float32 totals.
template <int R>
__attribute__((target(EVENFLOW_AVX2))) void gemv_strip(const int32_t* pairs, const float* scales, const float* sums,
                                                       int64_t k, int64_t n, int64_t tile_rows, const uint8_t* packed,
                                                       const StripScales& sz_at, int64_t t, int64_t s, uint16_t* y) {
  const int64_t groups = k / kAvx2Group, stride = tile_rows / 2;
  const int64_t first[4] = {t * tile_rows + 16 * s, t * tile_rows + 16 * s + 8, t * tile_rows + stride + 16 * s,
                            t * tile_rows + stride + 16 * s + 8};
  const uint8_t* strip = packed + t * k * stride + 16 * s;
  const __m256i nibble = _mm256_set1_epi16(15);
  alignas(32) float total[R][4][8] = {};  // in memory: touched once a group, and registers are the inner loop's
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_si256();
    const uint8_t* p = strip + g * kAvx2Group * stride;
    const int32_t* xg = pairs + g * (kAvx2Group / 2);
#pragma GCC unroll 4
    for (int c = 0; c < kAvx2Group / 2; ++c) {  // columns 2c and 2c + 1
      _mm_prefetch(reinterpret_cast<const char*>(p + 2 * c * stride + kPrefetchBytes), _MM_HINT_T0);
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * c * stride));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (2 * c + 1) * stride));
      // 16-bit words a0 b0 a1 b1 ...: lane d = byte d of both columns
      const __m256i front = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));
      const __m256i back = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, b));
      __m256i xp[R];
      for (int r = 0; r < R; ++r) xp[r] = _mm256_set1_epi32(xg[r * (k / 2) + c]);
      for (int j = 0; j < 4; ++j) {
        const __m256i half = j % 2 ? back : front;
        const __m256i w = j < 2 ? _mm256_and_si256(half, nibble) : _mm256_srli_epi16(half, 4);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(w, xp[r]));
      }
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i sz =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz_at.first + g * sz_at.group_stride + sz_at.run[j]));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(sz, 16));
      const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(sz, _mm256_set1_epi32(int(0xFFFF0000u))));
      const __m256 offset = _mm256_fmadd_ps(scale, _mm256_set1_ps(-8.f), zero);
      for (int r = 0; r < R; ++r) {
        const __m256 scaled = _mm256_mul_ps(scale, _mm256_set1_ps(scales[r * groups + g]));
        const __m256 sum = _mm256_fmadd_ps(scaled, _mm256_cvtepi32_ps(acc[r][j]), _mm256_load_ps(total[r][j]));
        _mm256_store_ps(total[r][j], _mm256_fmadd_ps(offset, _mm256_set1_ps(sums[r * groups + g]), sum));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * n + first[j]), to_bf16(_mm256_load_ps(total[r][j])));
}

// y [rows, n] = x [rows, k] @ W.T (bfloat16 row-major; x as ``round_rows`` gives it): the tiles' strips split
// between ``threads``, each output computed by one thread in one order, the same for any block of rows.
// ``strip_scales``: the scales and zeros in strip order, or null to read ``scale_zeros`` (torch's order).
void int4_gemv_avx2(const int32_t* pairs, const float* scales, const float* sums, int64_t rows, int64_t k,
                    const uint8_t* packed, const uint16_t* scale_zeros, const uint16_t* strip_scales, int64_t n,
                    int64_t tile_rows, uint16_t* y, int threads) {
  const int64_t strips = tile_rows / kAvx2Strip, groups = k / kAvx2Group, half = tile_rows / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n / kAvx2Strip; ++i) {
    const int64_t t = i / strips, s = i % strips;
    const StripScales sz_at =
        strip_scales ? StripScales{strip_scales + i * groups * kAvx2Strip * 2, kAvx2Strip * 2, {0, 16, 32, 48}}
                     : StripScales{scale_zeros + (t * tile_rows + 16 * s) * 2, 2 * n, {0, 16, 2 * half, 2 * half + 16}};
    for (int64_t r = 0; r < rows; r += kAvx2MaxRows) {
      const int32_t* xr = pairs + r * (k / 2);
      const float *xs = scales + r * groups, *sr = sums + r * groups;
      if (rows - r == 1)
        gemv_strip<1>(xr, xs, sr, k, n, tile_rows, packed, sz_at, t, s, y + r * n);
      else
        gemv_strip<2>(xr, xs, sr, k, n, tile_rows, packed, sz_at, t, s, y + r * n);
    }
  }
}
#else
bool int4_avx2_supported() { return false; }
#endif

}  // namespace
