// AMX tiles for the C++ kernels that use them (models/int4_gemv.cpp, attention/paged_prefill.cpp): whether this
// process may use them, and loading a tile configuration. Compiled as the first part of those kernels' sources
// (cpp_kernels.load_cpp_sources), so its names are theirs.
#include <cstdint>

#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define EVENFLOW_AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// The operand of LDTILECFG (palette 1): per tile its rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#ifdef EVENFLOW_AMX_TILES
// AMX-BF16 and AMX-TILE on the CPU, AVX-512 BF16 for the kernels' other half, and the tile registers' state
// granted to this process (Linux 5.16 and later hand it over on request; elsewhere the request fails).
bool amx_allowed() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512dq")) return false;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
    if (!amx_bf16 || !amx_tile) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
}

// Not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes, and the rows and widths set before it
// were dropped as dead stores (the tile loads then faulted).
inline void load_tile_config(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" : : "m"(cfg)); }
#else
bool amx_allowed() { return false; }
#endif

}  // namespace
