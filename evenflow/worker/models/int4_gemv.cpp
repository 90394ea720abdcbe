// The product of a few bfloat16 rows with a 4-bit weight in torch's AVX-512 int4 layout, for CPUs with
// AVX-512 BF16 and VBMI: models/int4_gemv.py says why and when it runs instead of torch's int4 kernel. On other
// x86 CPUs with AVX2 the entry point, int4_gemv_bf16, runs int4_gemv_avx2.cpp's kernel instead.
//
// The layout (models/q4_blocks.py): packed [n / 64][k][32] bytes, byte (t, kk, d) holding row t*64 + d in
// its low nibble and row t*64 + 32 + d in its high one; scale_zeros [k / 32][n][2] bfloat16, a value being
// (q - 8) * scale + zero. Each output lane is one weight row. A 64-byte load holds columns kk and kk + 1 of
// a 64-row tile; a byte permute puts a row's two nibbles in the two halves of its 32-bit lane, and OR-ing
// 0x4300 into each half makes the bfloat16 number 128 + q exactly, so one VDPBF16PS adds
// x[kk] * (128 + q[kk]) + x[kk+1] * (128 + q[kk+1]) for 16 rows in float32. Per group of 32 columns,
// sum(x * value) = scale * dot + (zero - 136 * scale) * sum(x), sum(x) taken once per row of x.
//
// From kAmxFromRows rows on, where the CPU has AMX, the same unpacking feeds AMX instead: a permuted load is
// exactly one row of a VNNI B tile (16 weight rows x a column pair), so a group's 16 loads make four B tiles,
// and one TDPBF16PS per tile multiplies them with up to 16 rows of x. VDPBF16PS's work grows with the rows
// (4 instructions a load a row), AMX's barely: 6 rows cost 0.31-0.51x torch's kernel, 2 rows about what the
// VDPBF16PS path costs (SmolLM2's shapes, 2-core Xeon, docs/results/quantization.md).
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
constexpr int kAmxFromRows = 3;     // products of this many rows or more run on AMX where the CPU has it
constexpr int kAmxMaxRows = 16;     // rows of x in one A tile

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

#define EVENFLOW_AVX512 "avx512f,avx512bw,avx512bf16,avx512vbmi"

// One 64-byte load of a tile (columns kk and kk + 1 of its 64 rows) as four vectors of bfloat16 pairs
// (128 + q[kk], 128 + q[kk + 1]), vector j for rows first_row(t)[j] + [0, 16): two byte permutes give the lanes
// of rows [0, 16) + [32, 48) and of rows [16, 32) + [48, 64), their low and high nibbles the four sets.
struct Unpacker {
  __m512i idx[2], nibble, magic;
  __mmask64 keep = 0x5555555555555555ULL;

  __attribute__((target(EVENFLOW_AVX512))) Unpacker() {
    alignas(64) uint8_t index[2][64];
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16; ++i) {  // lane i: the byte of row h*16 + i at column kk, 0, its byte at kk + 1, 0
        index[h][4 * i] = uint8_t(h * 16 + i);
        index[h][4 * i + 2] = uint8_t(32 + h * 16 + i);
        index[h][4 * i + 1] = index[h][4 * i + 3] = 0;
      }
    idx[0] = _mm512_load_si512(index[0]);
    idx[1] = _mm512_load_si512(index[1]);
    nibble = _mm512_set1_epi32(0x000F000F);
    magic = _mm512_set1_epi32(0x43004300);
  }

  __attribute__((target(EVENFLOW_AVX512))) void operator()(const uint8_t* p, __m512i w[4]) const {
    const __m512i raw = _mm512_loadu_si512(p);
    for (int h = 0; h < 2; ++h) {
      const __m512i pair = _mm512_maskz_permutexvar_epi8(keep, idx[h], raw);
      w[2 * h] = _mm512_ternarylogic_epi32(pair, nibble, magic, 0xEA);  // (a & b) | c
      w[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(pair, 4), nibble, magic, 0xEA);
    }
  }
};

// The rows of tile t that lane set j of Unpacker holds start at first_row(t)[j].
struct FirstRows {
  int64_t row[4];
  explicit FirstRows(int64_t t) : row{t * kGemvTile, t * kGemvTile + 32, t * kGemvTile + 16, t * kGemvTile + 48} {}
};

// Group g's scale and (zero - 136 * scale) for the 16 rows from ``row``: 136 = 128 of the unpacked values + 8.
__attribute__((target(EVENFLOW_AVX512))) inline void group_scale(const uint16_t* scale_zeros, int64_t g, int64_t n,
                                                                 int64_t row, __m512& scale, __m512& offset) {
  const __m512i sz = _mm512_loadu_si512(scale_zeros + (g * n + row) * 2);
  scale = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
  offset = _mm512_fmadd_ps(scale, _mm512_set1_ps(-136.f),
                           _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(int(0xFFFF0000u)))));
}

// total [rows][4][16] float32 -> y's rows, bfloat16.
__attribute__((target(EVENFLOW_AVX512))) inline void store_rows(const float* total, int rows, const FirstRows& first,
                                                                int64_t n, uint16_t* y) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + first.row[j]),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(total + (r * 4 + j) * 16)));
}

// The 64 output rows of tile ``t`` for R rows of x. R == 1 keeps two accumulators a lane (even and odd
// column pairs) so the adds do not wait on each other; with more rows of x the rows' accumulators are
// independent already. The totals over groups stay in L1, not in registers.
template <int R>
__attribute__((target(EVENFLOW_AVX512))) void gemv_tile(const uint16_t* x, const float* sums, int64_t k, int64_t n,
                                                        const uint8_t* packed, const uint16_t* scale_zeros, int64_t t,
                                                        uint16_t* y) {
  constexpr int A = R == 1 ? 2 : 1;
  const int64_t groups = k / kGemvGroup;
  const Unpacker unpack;
  const FirstRows first(t);
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
      __m512i w[4];
      unpack(p + kk * 32, w);
      const int a = (kk / 2) % A;
      for (int r = 0; r < R; ++r) {
        int32_t xs;
        std::memcpy(&xs, x + r * k + g * kGemvGroup + kk, sizeof xs);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(xs);
        for (int j = 0; j < 4; ++j) acc[r][j][a] = _mm512_dpbf16_ps(acc[r][j][a], (__m512bh)w[j], xb);
      }
    }
    for (int j = 0; j < 4; ++j) {
      __m512 scale, offset;
      group_scale(scale_zeros, g, n, first.row[j], scale, offset);
      for (int r = 0; r < R; ++r) {
        const __m512 dot = A == 1 ? acc[r][j][0] : _mm512_add_ps(acc[r][j][0], acc[r][j][A - 1]);
        __m512 sum = _mm512_fmadd_ps(scale, dot, _mm512_load_ps(total[r][j]));
        _mm512_store_ps(total[r][j], _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * groups + g]), sum));
      }
    }
  }
  store_rows(&total[0][0][0], R, first, n, y);
}

// The 64 output rows of tile ``t`` for ``rows`` (<= 16) rows of x, by AMX: per group of 32 columns the 16
// unpacked loads are stored as four B tiles (one a lane set), each multiplied with x's 32 columns into a fresh
// C tile (the group's dot products), then scaled into the totals as in gemv_tile. Tiles: 0 x, 1 and 6 B,
// 2-5 C (amx_configure).
__attribute__((target(EVENFLOW_AVX512 ",amx-tile,amx-bf16"))) void amx_tile(
    const uint16_t* x, int rows, const float* sums, int64_t k, int64_t n, const uint8_t* packed,
    const uint16_t* scale_zeros, int64_t t, uint16_t* y) {
  const int64_t groups = k / kGemvGroup;
  const Unpacker unpack;
  const FirstRows first(t);
  const uint8_t* tile = packed + t * k * 32;
  alignas(64) float total[kAmxMaxRows][4][16] = {};
  alignas(64) __m512i b[4][16];  // B tile j: row kk / 2 = lane set j's vector of columns kk, kk + 1
  alignas(64) float c[4][kAmxMaxRows][16];
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = tile + g * kGemvGroup * 32;
#pragma GCC unroll 16
    for (int kk = 0; kk < kGemvGroup; kk += 2) {
      __m512i w[4];
      unpack(p + kk * 32, w);
      for (int j = 0; j < 4; ++j) b[j][kk / 2] = w[j];
    }
    _tile_loadd(0, x + g * kGemvGroup, k * 2);
    _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
    _tile_loadd(1, b[0], 64); _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(6, b[1], 64); _tile_dpbf16ps(3, 0, 6);
    _tile_loadd(1, b[2], 64); _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(6, b[3], 64); _tile_dpbf16ps(5, 0, 6);
    _tile_stored(2, c[0], 64); _tile_stored(3, c[1], 64); _tile_stored(4, c[2], 64); _tile_stored(5, c[3], 64);
    for (int j = 0; j < 4; ++j) {
      __m512 scale, offset;
      group_scale(scale_zeros, g, n, first.row[j], scale, offset);
      for (int r = 0; r < rows; ++r) {
        __m512 sum = _mm512_fmadd_ps(scale, _mm512_load_ps(c[j][r]), _mm512_load_ps(total[r][j]));
        _mm512_store_ps(total[r][j], _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * groups + g]), sum));
      }
    }
  }
  store_rows(&total[0][0][0], rows, first, n, y);
}

__attribute__((target("amx-tile"))) void amx_configure(int rows) {
  TileConfig cfg;
  cfg.rows[0] = rows; cfg.colsb[0] = 64;              // A: rows of x, 32 columns
  cfg.rows[1] = cfg.rows[6] = 16; cfg.colsb[1] = cfg.colsb[6] = 64;  // B: 16 column pairs x 16 weight rows
  for (int j = 2; j < 6; ++j) { cfg.rows[j] = rows; cfg.colsb[j] = 64; }  // C: rows x 16 float32
  load_tile_config(cfg);
}

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

bool int4_gemv_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
  return ok;
}
#else
bool int4_gemv_supported() { return false; }
#endif

#ifdef EVENFLOW_INT4_GEMV
// int4_gemv_bf16 on 64-row tiles with AVX-512 BF16 (and AMX from kAmxFromRows rows where the CPU has it).
void int4_gemv_avx512(const uint16_t* x, int64_t rows, int64_t k, const uint8_t* packed, const uint16_t* scale_zeros,
                      int64_t n, uint16_t* y, int threads) {
  thread_local std::vector<float> sums;  // the calling thread's, kept across calls
  sums.resize(rows * (k / kGemvGroup));
  group_sums(x, rows, k, sums.data());
  if (rows >= kAmxFromRows && amx_allowed()) {
#pragma omp parallel num_threads(threads)
    {
      int configured = 0;  // the A and C tiles' rows this thread's tile configuration has
#pragma omp for schedule(static)
      for (int64_t t = 0; t < n / kGemvTile; ++t)
        for (int64_t r = 0; r < rows; r += kAmxMaxRows) {
          const int block = rows - r < kAmxMaxRows ? int(rows - r) : kAmxMaxRows;
          if (block != configured) amx_configure(configured = block);
          amx_tile(x + r * k, block, sums.data() + r * (k / kGemvGroup), k, n, packed, scale_zeros, t, y + r * n);
        }
      if (configured) amx_release();
    }
    return;
  }
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
}
#endif

// The instructions that multiply a weight packed in ``tile_rows``-row tiles on this CPU (and compiler): 64-row
// tiles with AVX-512 BF16 and VBMI; 32- or 64-row ones with AVX2 and FMA (int4_gemv_avx2.cpp, compiled before
// this); none.
enum class GemvPath { kNone = 0, kAvx2 = 1, kAvx512 = 2 };

GemvPath gemv_path(int64_t tile_rows) {
  if (tile_rows == kGemvTile && int4_gemv_supported()) return GemvPath::kAvx512;
  if ((tile_rows == 32 || tile_rows == 64) && int4_avx2_supported()) return GemvPath::kAvx2;
  return GemvPath::kNone;
}

// y [rows, n] = x [rows, k] @ W.T, all bfloat16 row-major, W packed in ``tile_rows``-row tiles, its scales and zeros
// in ``scale_zeros`` (torch's order) and, for the AVX2 path, in ``strip_scales`` where not null (its strip order,
// int4_gemv_avx2.cpp; the AVX-512 path reads torch's); 0, or -1 where
// the CPU (or the compiler) or the shape is not one this kernel takes (n a multiple of the tile, k of 32). The
// tiles of W are split between ``threads``; each output is computed by one thread in one order, so the result
// does not depend on the thread count (on the AVX-512 path it does on how many rows of x are multiplied at
// once: a row alone sums in two accumulators a lane, blocks of rows in one, from kAmxFromRows rows AMX sums
// each group in its own order; the AVX2 path sums every row in one order).
int int4_gemv_bf16(const uint16_t* x, int64_t rows, int64_t k, const uint8_t* packed, const uint16_t* scale_zeros,
                   const uint16_t* strip_scales, int64_t n, uint16_t* y, int threads, int64_t tile_rows) {
  if (rows == 0) return 0;
  const GemvPath path = gemv_path(tile_rows);
  if (path == GemvPath::kNone || rows < 0 || k % kGemvGroup || n % tile_rows) return -1;
#ifdef EVENFLOW_INT4_GEMV
  if (path == GemvPath::kAvx512) {
    int4_gemv_avx512(x, rows, k, packed, scale_zeros, n, y, threads);
    return 0;
  }
#endif
#ifdef EVENFLOW_INT4_AVX2
  // The calling thread's, kept across calls: a decode step's products allocate nothing once warm.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> scales, sums;
  xq.resize(rows * k);
  scales.resize(2 * rows * (k / kGemvGroup));
  sums.resize(rows * (k / kGemvGroup));
  round_rows(x, rows, k, xq.data(), scales.data(), sums.data());
  int4_gemv_avx2(xq.data(), scales.data(), sums.data(), rows, k, packed, scale_zeros, strip_scales, n, tile_rows, y,
                 threads);
#endif
  return 0;
}

}  // namespace

extern "C" {

// ``int4_gemv_bf16`` for ctypes (models/int4_gemv.py).
int evenflow_int4_gemv(const void* x, int64_t rows, int64_t k, const void* packed, const void* scale_zeros,
                       const void* strip_scales, int64_t n, void* y, int threads, int64_t tile_rows) {
  return int4_gemv_bf16(static_cast<const uint16_t*>(x), rows, k, static_cast<const uint8_t*>(packed),
                        static_cast<const uint16_t*>(scale_zeros), static_cast<const uint16_t*>(strip_scales), n,
                        static_cast<uint16_t*>(y), threads, tile_rows);
}

// Which instructions multiply weights packed in ``tile_rows``-row tiles here: 2 AVX-512 BF16, 1 AVX2, 0 none.
int evenflow_int4_gemv_isa(int64_t tile_rows) { return static_cast<int>(gemv_path(tile_rows)); }

// The fewest rows AMX multiplies here; 0 where the CPU, the kernel or the compiler has no AMX.
int evenflow_int4_amx_from_rows() { return int4_gemv_supported() && amx_allowed() ? kAmxFromRows : 0; }

}  // extern "C"
