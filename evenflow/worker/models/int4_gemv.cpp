// The product of a few bfloat16 rows with a 4-bit weight in torch's AVX-512 int4 layout, for CPUs with
// AVX-512 BF16 and VBMI: models/int4_gemv.py says why and when it runs instead of torch's int4 kernel.
//
// The layout (models/q4_blocks.py): packed [n / 64][k][32] bytes, byte (t, kk, d) holding row t*64 + d in
// its low nibble and row t*64 + 32 + d in its high one; scale_zeros [k / 32][n][2] bfloat16, a value being
// (q - 8) * scale + zero. Each output lane is one weight row. A 64-byte load holds columns kk and kk + 1 of
// a 64-row tile; a byte permute puts a row's two nibbles in the two halves of its 32-bit lane, and OR-ing
// 0x4300 into each half makes the bfloat16 number 128 + q exactly, so one VDPBF16PS adds
// x[kk] * (128 + q[kk]) + x[kk+1] * (128 + q[kk+1]) for 16 rows in float32. Per group of 32 columns,
// sum(x * value) = scale * dot + (zero - 136 * scale) * sum(x), sum(x) taken once per row of x.
#include <cstdint>
#include <cstring>
#include <vector>

// Compilers that know the instructions (GCC 11 and clang 12 name avx512bf16 in target attributes and
// __builtin_cpu_supports); elsewhere the kernel refuses every call and torch's int4 kernel serves, and the
// library it is part of (models/fused_decode.py's) still builds.
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define EVENFLOW_INT4_GEMV 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGemvGroup = 32;  // columns per scale/zero
constexpr int64_t kGemvTile = 64;   // rows per packed tile
constexpr int kGemvMaxRows = 4;     // rows of x that share one unpacking of the weight

#ifdef EVENFLOW_INT4_GEMV
// Row sums of x per group, in float32 (the bfloat16 values are exact in it).
void group_sums(const uint16_t* x, int64_t rows, int64_t k, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / kGemvGroup; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < kGemvGroup; ++i) {
        const uint32_t bits = uint32_t(x[r * k + g * kGemvGroup + i]) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        s += f;
      }
      out[r * (k / kGemvGroup) + g] = s;
    }
}

// The 64 output rows of tile ``t`` for R rows of x. One 64-byte load holds two columns of the tile; two
// byte permutes give the lanes of rows [0, 16) + [32, 48) and of rows [16, 32) + [48, 64). R == 1 keeps two
// accumulators a lane (even and odd column pairs) so the adds do not wait on each other; with more rows of x
// the rows' accumulators are independent already. The totals over groups stay in L1, not in registers.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vbmi"))) void gemv_tile(
    const uint16_t* x, const float* sums, int64_t k, int64_t n, const uint8_t* packed, const uint16_t* scale_zeros,
    int64_t t, uint16_t* y) {
  constexpr int A = R == 1 ? 2 : 1;
  const int64_t groups = k / kGemvGroup;
  alignas(64) uint8_t index[2][64];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 16; ++i) {  // lane i: the byte of row h*16 + i at column kk, 0, its byte at kk + 1, 0
      index[h][4 * i] = uint8_t(h * 16 + i);
      index[h][4 * i + 2] = uint8_t(32 + h * 16 + i);
      index[h][4 * i + 1] = index[h][4 * i + 3] = 0;
    }
  const __m512i idx[2] = {_mm512_load_si512(index[0]), _mm512_load_si512(index[1])};
  const __m512i nibble = _mm512_set1_epi32(0x000F000F), magic = _mm512_set1_epi32(0x43004300);
  const __m512i high_half = _mm512_set1_epi32(int(0xFFFF0000u));
  const __mmask64 keep = 0x5555555555555555ULL;
  // The 16 rows of lane set j: low nibbles of permute 0, high of 0, low of 1, high of 1.
  const int64_t first_row[4] = {t * kGemvTile, t * kGemvTile + 32, t * kGemvTile + 16, t * kGemvTile + 48};
  const uint8_t* tile = packed + t * k * 32;
  alignas(64) float total[R][4][16] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R][4][A];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j)
        for (int a = 0; a < A; ++a) acc[r][j][a] = _mm512_setzero_ps();
    const uint8_t* p = tile + g * kGemvGroup * 32;
#pragma GCC unroll 16
    for (int kk = 0; kk < kGemvGroup; kk += 2) {
      const __m512i raw = _mm512_loadu_si512(p + kk * 32);
      __m512bh w[4];
      for (int h = 0; h < 2; ++h) {
        const __m512i pair = _mm512_maskz_permutexvar_epi8(keep, idx[h], raw);
        w[2 * h] = (__m512bh)_mm512_ternarylogic_epi32(pair, nibble, magic, 0xEA);  // (a & b) | c
        w[2 * h + 1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(pair, 4), nibble, magic, 0xEA);
      }
      const int a = (kk / 2) % A;
      for (int r = 0; r < R; ++r) {
        int32_t xs;
        std::memcpy(&xs, x + r * k + g * kGemvGroup + kk, sizeof xs);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(xs);
        for (int j = 0; j < 4; ++j) acc[r][j][a] = _mm512_dpbf16_ps(acc[r][j][a], w[j], xb);
      }
    }
    const __m512 minus136 = _mm512_set1_ps(-136.f);
    for (int j = 0; j < 4; ++j) {
      const __m512i sz = _mm512_loadu_si512(scale_zeros + (g * n + first_row[j]) * 2);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
      const __m512 offset = _mm512_fmadd_ps(scale, minus136, _mm512_castsi512_ps(_mm512_and_si512(sz, high_half)));
      for (int r = 0; r < R; ++r) {
        const __m512 dot = A == 1 ? acc[r][j][0] : _mm512_add_ps(acc[r][j][0], acc[r][j][A - 1]);
        __m512 sum = _mm512_fmadd_ps(scale, dot, _mm512_load_ps(total[r][j]));
        _mm512_store_ps(total[r][j], _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * groups + g]), sum));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + first_row[j]),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(total[r][j])));
}

bool int4_gemv_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
  return ok;
}
#else
bool int4_gemv_supported() { return false; }
#endif

// y [rows, n] = x [rows, k] @ W.T, all bfloat16 row-major; 0, or -1 where the CPU (or the compiler) or the
// shape is not one this kernel takes (n a multiple of 64, k of 32). The tiles of W are split between
// ``threads``; each output is computed by one thread in one order, so the result does not depend on the
// thread count (it does on how many rows of x are multiplied at once: a row alone sums in two accumulators
// a lane, blocks of rows in one).
int int4_gemv_bf16(const uint16_t* x, int64_t rows, int64_t k, const uint8_t* packed, const uint16_t* scale_zeros,
                   int64_t n, uint16_t* y, int threads) {
  if (rows == 0) return 0;
  if (!int4_gemv_supported() || rows < 0 || k % kGemvGroup || n % kGemvTile) return -1;
#ifdef EVENFLOW_INT4_GEMV
  std::vector<float> sums(rows * (k / kGemvGroup));
  group_sums(x, rows, k, sums.data());
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < n / kGemvTile; ++t) {
    for (int64_t r = 0; r < rows; r += kGemvMaxRows) {
      const int64_t block = rows - r < kGemvMaxRows ? rows - r : kGemvMaxRows;
      const uint16_t* xr = x + r * k;
      const float* sr = sums.data() + r * (k / kGemvGroup);
      uint16_t* yr = y + r * n;
      switch (block) {
        case 1: gemv_tile<1>(xr, sr, k, n, packed, scale_zeros, t, yr); break;
        case 2: gemv_tile<2>(xr, sr, k, n, packed, scale_zeros, t, yr); break;
        case 3: gemv_tile<3>(xr, sr, k, n, packed, scale_zeros, t, yr); break;
        default: gemv_tile<4>(xr, sr, k, n, packed, scale_zeros, t, yr); break;
      }
    }
  }
#endif
  return 0;
}

}  // namespace

extern "C" {

// ``int4_gemv_bf16`` for ctypes (models/int4_gemv.py).
int evenflow_int4_gemv(const void* x, int64_t rows, int64_t k, const void* packed, const void* scale_zeros, int64_t n,
                       void* y, int threads) {
  return int4_gemv_bf16(static_cast<const uint16_t*>(x), rows, k, static_cast<const uint8_t*>(packed),
                        static_cast<const uint16_t*>(scale_zeros), n, static_cast<uint16_t*>(y), threads);
}

int evenflow_int4_gemv_supported() { return int4_gemv_supported() ? 1 : 0; }

}  // extern "C"
