// Prefill attention over the paged bfloat16 KV cache on CPU with AMX: every chunk of a step (a whole prompt, a
// chunk after cached context, a prefix hit's remainder) attends causally to its keys, read from the cache,
// in one call per layer. See evenflow/worker/attention/cpu_prefill.py for where it runs and what it measured.
//
// Per (chunk, query head, tile of 16 query rows), flash-attention style over blocks of keys: S = Q K^T on AMX
// (Q's rows as A tiles, K as VNNI B tiles), an online softmax in float32 on AVX-512 (exp2 by a polynomial and
// VSCALEFPS), O += P V on AMX (P in bfloat16 as an A tile, V as VNNI B tiles), O kept in float32; the tile
// programs per head size are prefill_tiles.cpp's. Up to four tiles of a head take each block of keys in turn,
// so that it is read from memory once for them.
// A row's running maximum moves only when a block's exceeds it by kSlack (in log2 units): the probabilities
// then stay below 2^kSlack, and O and the sums are rescaled a few times a row instead of every block.
// K and V are packed per (chunk, KV head) first, once for the query heads that share them: K's 16 x 16 blocks
// of bfloat16 pairs transposed (gathers), V's rows interleaved in pairs; keys past the context are zeros.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRows = 16;  // query rows a tile
constexpr float kSlack = 8.f;  // how far (log2) a block's maximum may exceed the running one before a rescale

struct Chunk {
  int64_t q_start, n, ctx, table_row;  // its rows of q; keys = its context (the chunk's own included)
};

struct Args {
  const uint16_t* q;
  int64_t q_stride;
  const uint16_t *k_cache, *v_cache;
  const int32_t* table;
  int64_t table_stride;
  const Chunk* chunks;
  int64_t num_chunks;
  uint16_t* out;
  int64_t out_stride, heads, kv_heads, block_size;
  float scale;
};

#ifdef EVENFLOW_PREFILL_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")

// 2^x in float32 for x <= kSlack, within 5e-5 of it relatively (P is rounded to bfloat16, 2e-3): a degree-4
// polynomial (Taylor's) on the fraction, the exponent by VSCALEFPS. Below 2^-100 (nothing beside the row's
// largest term, 1) x is clamped: no -inf, and no denormal results, which cost the CPU microcode assists.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.618129107628477e-3f);  // ln(2)^k / k!, k = 4..0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 first_lanes(int64_t k) { return k >= 16 ? 0xFFFF : k <= 0 ? 0 : __mmask16((1u << k) - 1); }

// A key's row of one KV head in a cache [blocks, block_size, kv_heads, D].
template <int D>
inline const uint16_t* cache_row(const Args& a, const uint16_t* cache, const int32_t* table, int64_t key, int64_t kvh) {
  const int64_t slot = int64_t(table[key / a.block_size]) * a.block_size + key % a.block_size;
  return cache + (slot * a.kv_heads + kvh) * D;
}

// Columns [16 g, 16 g + 16) of a cache row; zeros for no row (a key past the context).
inline __m256i sixteen(const uint16_t* row, int64_t g) {
  return row ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 16)) : _mm256_setzero_si256();
}

// Keys [32 b, 32 b + 32) of one KV head: K as two 16-key tiles of D / 32 VNNI B tiles each (row p: the keys'
// bfloat16 pair p of that tile's 32 columns), V as D / 16 B tiles (row j: keys 2j and 2j + 1 interleaved).
template <int D>
void pack_keys(const Args& a, const Chunk& c, int64_t kvh, int64_t b, uint32_t* kp, uint16_t* vp) {
  const int32_t* table = a.table + c.table_row * a.table_stride;
  const __m512i token = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(int(a.kv_heads * D / 2)));
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t key0 = b * 32 + half * 16;
    const __mmask16 valid = first_lanes(c.ctx - key0);
    uint32_t* dst = kp + (key0 / 16) * (D / 2) * 16;
    if (!valid) {
      std::memset(dst, 0, D / 2 * 16 * sizeof(uint32_t));
      continue;
    }
    const uint16_t* row = cache_row<D>(a, a.k_cache, table, key0, kvh);  // 16 keys of one cache block
    for (int p = 0; p < D / 2; ++p)
      _mm512_store_si512(dst + p * 16,
                         _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, token, row + 2 * p, 4));
  }
  alignas(64) static const uint16_t pairs[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(pairs);
  for (int64_t j = 0; j < 16; ++j) {
    const int64_t key = b * 32 + 2 * j;
    const uint16_t* r0 = key < c.ctx ? cache_row<D>(a, a.v_cache, table, key, kvh) : nullptr;
    const uint16_t* r1 = key + 1 < c.ctx ? cache_row<D>(a, a.v_cache, table, key + 1, kvh) : nullptr;
    for (int64_t g = 0; g < D / 16; ++g) {
      const __m512i v = _mm512_permutex2var_epi16(_mm512_castsi256_si512(sixteen(r0, g)), interleave,
                                                  _mm512_castsi256_si512(sixteen(r1, g)));
      _mm512_store_si512(vp + ((b * (D / 16) + g) * 16 + j) * 32, v);
    }
  }
}

// 16 query rows of one head: their queries, their output so far and their softmax's running maximum and sums.
template <int D>
struct RowTile16 {
  alignas(64) uint16_t q[kRows][D];
  alignas(64) float o[kRows][D];
  __m512 row_sum[kRows];
  float row_max[kRows];
  int64_t first_pos, m;  // row r's position: first_pos + r (it sees keys <= that); rows m on are padding

  void start(const Args& a, const Chunk& c, int64_t hq, int64_t i0) {
    m = std::min(kRows, c.n - i0);
    first_pos = c.ctx - c.n + i0;
    for (int64_t r = 0; r < kRows; ++r) {
      if (r < m) std::memcpy(q[r], a.q + (c.q_start + i0 + r) * a.q_stride + hq * D, D * sizeof(uint16_t));
      else std::memset(q[r], 0, sizeof q[r]);
      row_max[r] = -INFINITY;
      row_sum[r] = _mm512_setzero_ps();
    }
    std::memset(o, 0, sizeof o);
  }

  int64_t keys() const { return first_pos + m; }

  // Keys [kb, kb + kKeys): scores, the online softmax, O += P V; s and p are scratch.
  void attend(const uint32_t* kp, const uint16_t* vp, int64_t kb, float log2_scale, float* s_flat, uint16_t* p_flat) {
    using T = Tiles<D>;
    auto s = reinterpret_cast<float(*)[T::kKeys]>(s_flat);
    auto p = reinterpret_cast<uint16_t(*)[T::kKeys]>(p_flat);
    load_q<D>(&q[0][0]);
    score_block<D>(kp, kb, s_flat);
    const bool masked = kb + T::kKeys > first_pos + 1;
    for (int64_t r = 0; r < kRows; ++r) {
      __mmask16 valid[T::kScores];
      __m512 block_max = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < T::kScores; ++j) {
        valid[j] = masked ? first_lanes(first_pos + r - kb + 1 - j * 16) : 0xFFFF;
        block_max = _mm512_mask_max_ps(block_max, valid[j], block_max, _mm512_load_ps(&s[r][j * 16]));
      }
      // The running maximum moves (a reduction, a rescale) only when some score passes it by kSlack.
      const float bound = (row_max[r] + kSlack) / log2_scale;
      if (row_max[r] == -INFINITY || _mm512_cmp_ps_mask(block_max, _mm512_set1_ps(bound), _CMP_GT_OQ)) {
        const float top = _mm512_reduce_max_ps(block_max) * log2_scale;
        if (row_max[r] != -INFINITY) {
          const float alpha = std::exp2(row_max[r] - top);
          row_sum[r] = _mm512_mul_ps(row_sum[r], _mm512_set1_ps(alpha));
          for (int d = 0; d < D; d += 16)
            _mm512_store_ps(&o[r][d], _mm512_mul_ps(_mm512_load_ps(&o[r][d]), _mm512_set1_ps(alpha)));
        }
        row_max[r] = top;
      }
      const __m512 shift = _mm512_set1_ps(row_max[r]), mul = _mm512_set1_ps(log2_scale);
      for (int j = 0; j < T::kScores; j += 2) {
        const __m512 e0 = _mm512_maskz_mov_ps(
            valid[j], exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(&s[r][j * 16]), mul, shift)));
        const __m512 e1 = _mm512_maskz_mov_ps(
            valid[j + 1], exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(&s[r][j * 16 + 16]), mul, shift)));
        row_sum[r] = _mm512_add_ps(row_sum[r], _mm512_add_ps(e0, e1));
        _mm512_store_si512(&p[r][j * 16], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      }
    }
    add_pv<D>(vp, kb, p_flat, &o[0][0]);
  }

  void finish(const Args& a, const Chunk& c, int64_t hq, int64_t i0) const {
    for (int64_t r = 0; r < m; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(row_sum[r]));
      uint16_t* dst = a.out + (c.q_start + i0 + r) * a.out_stride + hq * D;
      for (int d = 0; d < D; d += 32) {
        const __m512 lo = _mm512_mul_ps(_mm512_load_ps(&o[r][d]), inv);
        const __m512 hi = _mm512_mul_ps(_mm512_load_ps(&o[r][d + 16]), inv);
        _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  }
};

constexpr int64_t kTilesAtOnce = 4;  // row tiles of one head that share each block of keys while it is in L1

// Rows [i0, i0 + 16 * tiles) of chunk c, head hq, against its packed keys (kp, vp): each block of keys is read
// from memory once for all the tiles (at 8,192 keys a tile at a time spent the time reading them).
template <int D>
void attend_rows(const Args& a, const Chunk& c, int64_t hq, int64_t i0, int64_t tiles, const uint32_t* kp,
                 const uint16_t* vp) {
  using T = Tiles<D>;
  RowTile16<D> rows[kTilesAtOnce];
  alignas(64) float s[kRows * T::kKeys];
  alignas(64) uint16_t p[kRows * T::kKeys];
  const float log2_scale = a.scale * 1.4426950408889634f;
  int64_t keys = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    rows[t].start(a, c, hq, i0 + t * kRows);
    keys = std::max(keys, rows[t].keys());
  }
  for (int64_t kb = 0; kb < keys; kb += T::kKeys)
    for (int64_t t = 0; t < tiles; ++t)
      if (kb < rows[t].keys()) rows[t].attend(kp, vp, kb, log2_scale, s, p);
  for (int64_t t = 0; t < tiles; ++t) rows[t].finish(a, c, hq, i0 + t * kRows);
}

struct Work {
  int64_t chunk, head, i0, tiles, keys;  // packing: (chunk, KV head, 32-key block) in the first three
};

template <int D>
void prefill(const Args& a, int threads) {
  constexpr int64_t kPad = Tiles<D>::kKeys;
  std::vector<int64_t> offset(a.num_chunks + 1, 0);  // each chunk's packed K and V, per KV head
  for (int64_t c = 0; c < a.num_chunks; ++c)
    offset[c + 1] = offset[c] + a.kv_heads * ((a.chunks[c].ctx + kPad - 1) / kPad * kPad) * D * 2;
  thread_local std::vector<uint16_t> scratch;  // one layer's packing, kept for the caller's next layer
  if (scratch.size() < size_t(offset.back() + 32)) scratch.resize(offset.back() + 32);
  uint16_t* base = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  auto packed = [&](int64_t c, int64_t kvh, uint32_t*& kp, uint16_t*& vp) {
    const int64_t keys = (a.chunks[c].ctx + kPad - 1) / kPad * kPad;
    kp = reinterpret_cast<uint32_t*>(base + offset[c] + kvh * keys * D * 2);
    vp = base + offset[c] + kvh * keys * D * 2 + keys * D;
  };
  int64_t row_tiles = 0;
  for (int64_t c = 0; c < a.num_chunks; ++c) row_tiles += a.heads * ((a.chunks[c].n + kRows - 1) / kRows);
  // Tiles that share blocks of keys, where that still leaves every thread several items.
  const int64_t at_once = row_tiles >= 8 * kTilesAtOnce * threads ? kTilesAtOnce : 1;
  std::vector<Work> packs, tiles;
  for (int64_t c = 0; c < a.num_chunks; ++c) {
    const Chunk& ch = a.chunks[c];
    for (int64_t kvh = 0; kvh < a.kv_heads; ++kvh)
      for (int64_t b = 0; b < (ch.ctx + kPad - 1) / kPad * kPad / 32; ++b) packs.push_back({c, kvh, b, 0, 0});
    for (int64_t h = 0; h < a.heads; ++h)
      for (int64_t i0 = 0; i0 < ch.n; i0 += kRows * at_once) {
        const int64_t n = std::min(kRows * at_once, ch.n - i0);
        tiles.push_back({c, h, i0, (n + kRows - 1) / kRows, ch.ctx - ch.n + i0 + n});
      }
  }
  std::sort(tiles.begin(), tiles.end(),
            [](const Work& x, const Work& y) { return x.keys * x.tiles > y.keys * y.tiles; });
  const int64_t group = a.heads / a.kv_heads;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (size_t i = 0; i < packs.size(); ++i) {
      uint32_t* kp;
      uint16_t* vp;
      packed(packs[i].chunk, packs[i].head, kp, vp);
      pack_keys<D>(a, a.chunks[packs[i].chunk], packs[i].head, packs[i].i0, kp, vp);
    }
    configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tiles.size(); ++i) {
      uint32_t* kp;
      uint16_t* vp;
      packed(tiles[i].chunk, tiles[i].head / group, kp, vp);
      attend_rows<D>(a, a.chunks[tiles[i].chunk], tiles[i].head, tiles[i].i0, tiles[i].tiles, kp, vp);
    }
    _tile_release();
  }
}

#pragma GCC pop_options
#endif

}  // namespace

extern "C" {

// 1 where this CPU and build run the kernel (AMX, AVX-512 BF16), else 0.
int evenflow_paged_prefill_supported() {
#ifdef EVENFLOW_PREFILL_AMX
  return amx_allowed() ? 1 : 0;
#else
  return 0;
#endif
}

// out[chunk rows, head * D ...] for every chunk; chunks: [num_chunks][4] int64 (q_start, n, ctx, table_row).
// 0, or -1 for a CPU or shape it does not take (D 64 or 128, block_size a multiple of 16, heads % kv_heads 0).
int evenflow_paged_prefill_bf16(const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                                const int32_t* table, int64_t table_stride, const int64_t* chunks, int64_t num_chunks,
                                void* out, int64_t out_stride, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                int64_t block_size, float scale, int threads) {
  if (!evenflow_paged_prefill_supported() || block_size % 16 || kv_heads <= 0 || heads % kv_heads) return -1;
#ifdef EVENFLOW_PREFILL_AMX
  const Args a{static_cast<const uint16_t*>(q), q_stride, static_cast<const uint16_t*>(k_cache),
               static_cast<const uint16_t*>(v_cache), table, table_stride, reinterpret_cast<const Chunk*>(chunks),
               num_chunks, static_cast<uint16_t*>(out), out_stride, heads, kv_heads, block_size, scale};
  if (head_dim == 64) prefill<64>(a, threads);
  else if (head_dim == 128) prefill<128>(a, threads);
  else return -1;
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"
