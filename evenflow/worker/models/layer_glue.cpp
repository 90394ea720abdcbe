// The elementwise work between a layer's projections for steps of few rows on CPU, one call per group:
// the residual add with the narrowing RMSNorm, the rotary embedding of q and k, and SwiGLU. The math is
// models/compiled_ops.py's (float32, one rounding to bfloat16 at the end); see models/layer_glue.py for
// where it is used and what it saves.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using at::vec::Vectorized;
using Vec = Vectorized<float>;
using BVec = Vectorized<c10::BFloat16>;
using bf16 = c10::BFloat16;

// A step of few rows stays on the calling thread: waking the pool costs more than these loops.
constexpr int64_t kParallelValues = 1 << 16;

// Load n <= BVec::size() bfloat16 values as two float vectors.
inline void load_bf16(const bf16* src, int64_t n, Vec& lo, Vec& hi) {
  const BVec b = n == BVec::size() ? BVec::loadu(src) : BVec::loadu(src, n);
  std::tie(lo, hi) = at::vec::convert_to_float<bf16>(b);
}

inline void store_bf16(bf16* dst, int64_t n, const Vec& lo, const Vec& hi) {
  const BVec b = at::vec::convert_from_float<bf16>(lo, hi);
  if (n == BVec::size())
    b.store(dst);
  else
    b.store(dst, n);
}

// x += delta; out = x * scaled / hypot(|x|, eps_root), as bfloat16 (rms_norm_narrowing).
void add_norm_row(float* x, const bf16* delta, const float* scaled, float eps_root, bf16* out, int64_t h) {
  Vec sq(0.f);
  for (int64_t i = 0; i < h; i += BVec::size()) {
    const int64_t n = std::min<int64_t>(BVec::size(), h - i);
    Vec d0, d1;
    load_bf16(delta + i, n, d0, d1);
    const int64_t n0 = std::min<int64_t>(Vec::size(), n), n1 = n - n0;
    // A partial bfloat16 load need not zero its other lanes (some ATen versions leave them): only the
    // row's own values go into the sum.
    const Vec x0 = Vec::set(Vec(0.f), Vec::loadu(x + i, n0) + d0, n0);
    x0.store(x + i, n0);
    sq = at::vec::fmadd(x0, x0, sq);
    if (n1 > 0) {
      const Vec x1 = Vec::set(Vec(0.f), Vec::loadu(x + i + Vec::size(), n1) + d1, n1);
      x1.store(x + i + Vec::size(), n1);
      sq = at::vec::fmadd(x1, x1, sq);
    }
  }
  const float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sq);
  const Vec inv(1.f / std::sqrt(sum + eps_root * eps_root));
  for (int64_t i = 0; i < h; i += BVec::size()) {
    const int64_t n = std::min<int64_t>(BVec::size(), h - i);
    const int64_t n0 = std::min<int64_t>(Vec::size(), n), n1 = n - n0;
    const Vec y0 = Vec::loadu(x + i, n0) * Vec::loadu(scaled + i, n0) * inv;
    const Vec y1 = n1 > 0 ? Vec::loadu(x + i + Vec::size(), n1) * Vec::loadu(scaled + i + Vec::size(), n1) * inv
                          : Vec(0.f);
    store_bf16(out + i, n, y0, y1);
  }
}

// Rotate-half RoPE of one head: out = x * cos + [x2, x1] * sin (sin signed for the first half).
void rotary_head(const bf16* x, const float* cos, const float* sin, bf16* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += BVec::size()) {
    const int64_t n = std::min<int64_t>(BVec::size(), half - i);
    Vec a0, a1, b0, b1;  // first and second halves
    load_bf16(x + i, n, a0, a1);
    load_bf16(x + half + i, n, b0, b1);
    const int64_t n0 = std::min<int64_t>(Vec::size(), n), n1 = n - n0;
    auto part = [&](const Vec& x_own, const Vec& x_other, int64_t at, int64_t cnt) {
      return at::vec::fmadd(x_other, Vec::loadu(sin + at, cnt), x_own * Vec::loadu(cos + at, cnt));
    };
    const Vec f0 = part(a0, b0, i, n0), s0 = part(b0, a0, half + i, n0);
    const Vec f1 = n1 > 0 ? part(a1, b1, i + Vec::size(), n1) : Vec(0.f);
    const Vec s1 = n1 > 0 ? part(b1, a1, half + i + Vec::size(), n1) : Vec(0.f);
    store_bf16(out + i, n, f0, f1);
    store_bf16(out + half + i, n, s0, s1);
  }
}

// silu(gate) * up, one row of ``inter`` values.
void swiglu_row(const bf16* gate, const bf16* up, bf16* out, int64_t inter) {
  for (int64_t i = 0; i < inter; i += BVec::size()) {
    const int64_t n = std::min<int64_t>(BVec::size(), inter - i);
    Vec g0, g1, u0, u1;
    load_bf16(gate + i, n, g0, g1);
    load_bf16(up + i, n, u0, u1);
    const Vec one(1.f);
    const Vec y0 = g0 / (one + g0.neg().exp_u20()) * u0;
    const Vec y1 = g1 / (one + g1.neg().exp_u20()) * u1;
    store_bf16(out + i, n, y0, y1);
  }
}

}  // namespace

extern "C" {

// x [rows, h] float32 (row stride x_stride, updated in place), delta [rows, h] bfloat16 (row stride
// delta_stride), scaled [h] float32, out [rows, h] bfloat16 contiguous.
void glue_add_norm(void* x, int64_t x_stride, const void* delta, int64_t delta_stride, const float* scaled,
                   float eps_root, void* out, int64_t rows, int64_t h, int threads) {
  auto* xf = static_cast<float*>(x);
  auto* db = static_cast<const bf16*>(delta);
  auto* ob = static_cast<bf16*>(out);
#pragma omp parallel for num_threads(threads) if (rows * h >= kParallelValues)
  for (int64_t r = 0; r < rows; ++r)
    add_norm_row(xf + r * x_stride, db + r * delta_stride, scaled, eps_root, ob + r * h, h);
}

// qkv [rows, >= heads * d] bfloat16 (row stride qkv_stride): its first ``heads`` heads rotated into out
// [rows, heads, d] bfloat16; cos and sin [rows, d] float32 contiguous.
void glue_rotary(const void* qkv, int64_t qkv_stride, const float* cos, const float* sin, void* out, int64_t rows,
                 int64_t heads, int64_t d, int threads) {
  auto* xb = static_cast<const bf16*>(qkv);
  auto* ob = static_cast<bf16*>(out);
#pragma omp parallel for num_threads(threads) if (rows * heads * d >= kParallelValues)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      rotary_head(xb + r * qkv_stride + h * d, cos + r * d, sin + r * d, ob + (r * heads + h) * d, d);
}

// gu [rows, 2 * inter] bfloat16 (row stride gu_stride; gate then up) -> out [rows, inter] bfloat16.
void glue_swiglu(const void* gu, int64_t gu_stride, void* out, int64_t rows, int64_t inter, int threads) {
  auto* gb = static_cast<const bf16*>(gu);
  auto* ob = static_cast<bf16*>(out);
#pragma omp parallel for num_threads(threads) if (rows * inter >= kParallelValues)
  for (int64_t r = 0; r < rows; ++r) swiglu_row(gb + r * gu_stride, gb + r * gu_stride + inter, ob + r * inter, inter);
}

}  // extern "C"
