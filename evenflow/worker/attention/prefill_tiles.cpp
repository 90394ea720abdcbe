// The AMX tile programs of the prefill attention kernel (paged_prefill.cpp, compiled after this file, and
// amx_tiles.cpp before it) for head sizes 64 and 128: one block of keys' scores, and its P V added to O.
#include <cstdint>

// GCC 11 and later (the target pragma gives every function of the kernel, lambdas included, the instructions);
// elsewhere the kernel refuses every call and PyTorch's attention serves.
#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 11
#define EVENFLOW_PREFILL_AMX 1
#include <immintrin.h>
#endif

namespace {

#ifdef EVENFLOW_PREFILL_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")

// Tiles for head size D: Q's D / 32 A tiles stay loaded; one B tile (K, then V), one A tile (P), the rest C.
// GCC's tile intrinsics paste the tile number into their assembly, so the ids are literals in the
// specializations below.
template <int D>
struct Tiles {
  static constexpr int kKeys = D == 64 ? 64 : 32;  // keys a block: one C tile of scores per 16
  static constexpr int kScores = kKeys / 16;
};

// D = 64: Q 0-1, B 2, P 3, C 4-7 (four of scores; then four of O, all 64 columns in one pass).
#define EVENFLOW_SCORE_64(C, st)                                   \
  _tile_zero(C);                                                   \
  _tile_loadd(2, kp + ((kb / 16 + st) * 2 + 0) * 256, 64);         \
  _tile_dpbf16ps(C, 0, 2);                                         \
  _tile_loadd(2, kp + ((kb / 16 + st) * 2 + 1) * 256, 64);         \
  _tile_dpbf16ps(C, 1, 2);                                         \
  _tile_stored(C, &s[st * 16], 64 * 4);
#define EVENFLOW_PV_64(C, g)                                       \
  _tile_loadd(2, vp + ((kb / 32 + h) * 4 + g) * 512, 64);          \
  _tile_dpbf16ps(C, 3, 2);

template <int D>
void load_q(const uint16_t* q);
template <int D>
void score_block(const uint32_t* kp, int64_t kb, float* s);
template <int D>
void add_pv(const uint16_t* vp, int64_t kb, const uint16_t* p, float* o);

template <>
void load_q<64>(const uint16_t* q) {
  _tile_loadd(0, q, 64 * 2);
  _tile_loadd(1, q + 32, 64 * 2);
}
template <>
void score_block<64>(const uint32_t* kp, int64_t kb, float* s) {
  EVENFLOW_SCORE_64(4, 0) EVENFLOW_SCORE_64(5, 1) EVENFLOW_SCORE_64(6, 2) EVENFLOW_SCORE_64(7, 3)
}
template <>
void add_pv<64>(const uint16_t* vp, int64_t kb, const uint16_t* p, float* o) {
  _tile_loadd(4, o, 64 * 4); _tile_loadd(5, o + 16, 64 * 4); _tile_loadd(6, o + 32, 64 * 4); _tile_loadd(7, o + 48, 64 * 4);
  for (int64_t h = 0; h < 2; ++h) {
    _tile_loadd(3, p + h * 32, 64 * 2);
    EVENFLOW_PV_64(4, 0) EVENFLOW_PV_64(5, 1) EVENFLOW_PV_64(6, 2) EVENFLOW_PV_64(7, 3)
  }
  _tile_stored(4, o, 64 * 4); _tile_stored(5, o + 16, 64 * 4); _tile_stored(6, o + 32, 64 * 4); _tile_stored(7, o + 48, 64 * 4);
}

// D = 128: Q 0-3, B 4, P 5, C 6-7 (two of scores; then two of O, four passes over the 128 columns).
#define EVENFLOW_SCORE_128(C, st)                                  \
  _tile_zero(C);                                                   \
  _tile_loadd(4, kp + ((kb / 16 + st) * 4 + 0) * 256, 64);         \
  _tile_dpbf16ps(C, 0, 4);                                         \
  _tile_loadd(4, kp + ((kb / 16 + st) * 4 + 1) * 256, 64);         \
  _tile_dpbf16ps(C, 1, 4);                                         \
  _tile_loadd(4, kp + ((kb / 16 + st) * 4 + 2) * 256, 64);         \
  _tile_dpbf16ps(C, 2, 4);                                         \
  _tile_loadd(4, kp + ((kb / 16 + st) * 4 + 3) * 256, 64);         \
  _tile_dpbf16ps(C, 3, 4);                                         \
  _tile_stored(C, &s[st * 16], 32 * 4);

template <>
void load_q<128>(const uint16_t* q) {
  _tile_loadd(0, q, 128 * 2); _tile_loadd(1, q + 32, 128 * 2); _tile_loadd(2, q + 64, 128 * 2); _tile_loadd(3, q + 96, 128 * 2);
}
template <>
void score_block<128>(const uint32_t* kp, int64_t kb, float* s) {
  EVENFLOW_SCORE_128(6, 0) EVENFLOW_SCORE_128(7, 1)
}
template <>
void add_pv<128>(const uint16_t* vp, int64_t kb, const uint16_t* p, float* o) {
  _tile_loadd(5, p, 32 * 2);
  for (int64_t g = 0; g < 8; g += 2) {
    _tile_loadd(6, o + g * 16, 128 * 4); _tile_loadd(7, o + g * 16 + 16, 128 * 4);
    _tile_loadd(4, vp + ((kb / 32) * 8 + g) * 512, 64); _tile_dpbf16ps(6, 5, 4);
    _tile_loadd(4, vp + ((kb / 32) * 8 + g + 1) * 512, 64); _tile_dpbf16ps(7, 5, 4);
    _tile_stored(6, o + g * 16, 128 * 4); _tile_stored(7, o + g * 16 + 16, 128 * 4);
  }
}

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {  // every tile here is 16 rows of 64 bytes
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

#pragma GCC pop_options
#endif

}  // namespace
