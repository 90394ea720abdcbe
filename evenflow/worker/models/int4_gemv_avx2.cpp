// The product of a few bfloat16 rows with a 4-bit weight in torch's int4 layout, for CPUs with AVX2 and FMA
// (and no AVX-512 BF16: int4_gemv.cpp's kernel serves those). models/int4_gemv.py says when it runs.
//
// The layout (models/q4_blocks.py): packed [n / T][k][T / 2] bytes, T the tile height torch packs here (32 on
// AVX2, 64 on AVX-512), byte (t, kk, d) holding row t*T + d in its low nibble and row t*T + T/2 + d in its high
// one; scale_zeros [k / 32][n][2] bfloat16, a value being (q - 8) * scale + zero. A tile is read as T / 32
// strips of 16 bytes a column (32 rows: 16 low nibbles, 16 high). Eight bytes zero-extend into eight 32-bit
// lanes (VPMOVZXBD from memory), whose low and high nibbles become two vectors of eight float32 values q, and
// one FMA each adds x[kk] * q for eight rows. Per group of 32 columns,
// sum(x * value) = scale * sum(x * q) + (zero - 8 * scale) * sum(x), sum(x) taken once per row of x.
//
// Torch's kernel turns each value into a float32 number too, but per row of x and through more steps; this
// one reads the weight once for up to kAvx2MaxRows rows (docs/results/quantization.md has the timings).

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

#ifdef EVENFLOW_INT4_AVX2
#define EVENFLOW_AVX2 "avx2,fma"

bool int4_avx2_supported() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// bfloat16 -> float32 for rows x k values (exact), and the rows' sums per group of 32 columns.
void widen_rows(const uint16_t* x, int64_t rows, int64_t k, float* xf, float* sums) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / kAvx2Group; ++g) {
      float s = 0.f;
      for (int64_t i = g * kAvx2Group; i < (g + 1) * kAvx2Group; ++i) {
        const uint32_t bits = uint32_t(x[r * k + i]) << 16;
        std::memcpy(&xf[r * k + i], &bits, sizeof(float));
        s += xf[r * k + i];
      }
      sums[r * (k / kAvx2Group) + g] = s;
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

// The 32 output rows of strip ``s`` of tile ``t`` (rows t*T + 16s + [0, 16) and t*T + T/2 + 16s + [0, 16)) for R
// rows of x. Accumulator j holds eight rows: j = 0, 1 the low nibbles of bytes [0, 8) and [8, 16), j = 2, 3 the
// high ones. One accumulator a lane even for one row: the four are independent chains already, and a second set
// (the AVX-512 path's even and odd columns) spilled registers here and ran 1.6x slower.
template <int R>
__attribute__((target(EVENFLOW_AVX2))) void gemv_strip(const float* xf, const float* sums, int64_t k, int64_t n,
                                                       int64_t tile_rows, const uint8_t* packed,
                                                       const uint16_t* scale_zeros, int64_t t, int64_t s,
                                                       uint16_t* y) {
  const int64_t groups = k / kAvx2Group, stride = tile_rows / 2;
  const int64_t first[4] = {t * tile_rows + 16 * s, t * tile_rows + 16 * s + 8, t * tile_rows + stride + 16 * s,
                            t * tile_rows + stride + 16 * s + 8};
  const uint8_t* strip = packed + t * k * stride + 16 * s;
  const __m256i nibble = _mm256_set1_epi32(15);
  alignas(32) float total[R][4][8] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    const uint8_t* p = strip + g * kAvx2Group * stride;
    const float* xg = xf + g * kAvx2Group;
#pragma GCC unroll 8
    for (int kk = 0; kk < kAvx2Group; ++kk) {
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kk * stride)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kk * stride + 8)));
      const __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, nibble)),
                           _mm256_cvtepi32_ps(_mm256_and_si256(b1, nibble)),
                           _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(xg + r * k + kk);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(w[j], xb, acc[r][j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i sz = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale_zeros + (g * n + first[j]) * 2));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(sz, 16));
      const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(sz, _mm256_set1_epi32(int(0xFFFF0000u))));
      const __m256 offset = _mm256_fmadd_ps(scale, _mm256_set1_ps(-8.f), zero);
      for (int r = 0; r < R; ++r) {
        const __m256 sum = _mm256_fmadd_ps(scale, acc[r][j], _mm256_load_ps(total[r][j]));
        _mm256_store_ps(total[r][j], _mm256_fmadd_ps(offset, _mm256_set1_ps(sums[r * groups + g]), sum));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * n + first[j]), to_bf16(_mm256_load_ps(total[r][j])));
}

// y [rows, n] = x [rows, k] @ W.T (bfloat16 row-major; ``xf`` and ``sums`` from widen_rows): the tiles' strips
// split between ``threads``, each output computed by one thread in one order, the same for any block of rows.
void int4_gemv_avx2(const float* xf, const float* sums, int64_t rows, int64_t k, const uint8_t* packed,
                    const uint16_t* scale_zeros, int64_t n, int64_t tile_rows, uint16_t* y, int threads) {
  const int64_t strips = tile_rows / kAvx2Strip, groups = k / kAvx2Group;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n / kAvx2Strip; ++i) {
    const int64_t t = i / strips, s = i % strips;
    for (int64_t r = 0; r < rows; r += kAvx2MaxRows) {
      const float* xr = xf + r * k;
      const float* sr = sums + r * groups;
      if (rows - r == 1)
        gemv_strip<1>(xr, sr, k, n, tile_rows, packed, scale_zeros, t, s, y + r * n);
      else
        gemv_strip<2>(xr, sr, k, n, tile_rows, packed, scale_zeros, t, s, y + r * n);
    }
  }
}
#else
bool int4_avx2_supported() { return false; }
#endif

}  // namespace
