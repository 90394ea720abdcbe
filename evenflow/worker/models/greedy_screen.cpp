// The second half of the LM head's greedy screen (models/lm_head.py, ``ScreenedHead._greedy``) in one pass a
// row: from the 4-bit screen's bfloat16 logits to float32 logits whose argmax is the float32 table's. The
// screen's leader is recomputed in float32 (the argmax is at least that value, the floor), and so is every
// token whose screen logit plus ``sigmas`` of its error scale (|x| * the table row's rounding RMS) reaches
// the floor. In PyTorch these were ~8 ops over the whole vocabulary (argmax, addcmul, compare, nonzero,
// gathers), ~0.45 ms a one-row step on SmolLM2's 49152 tokens. Each row's vocabulary is split between the
// threads: alone, the pass was ~0.25 ms of a one-row step's ~5 ms, with the other thread waiting.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

float screen_value(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// Sixteen partial sums, so the compiler vectorizes the loop without reassociating a float sum itself.
float row_dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += a[i + j] * b[i + j];
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) sum += part[j];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

extern "C" {

// screen [rows, >= vocab] bfloat16 (row stride screen_stride), x [rows, hidden] float32, table [vocab, hidden]
// float32, row_error [vocab] float32; out [rows, vocab] float32 (row stride out_stride); on up to ``threads``
// threads. Returns 0.
int greedy_screen(const uint16_t* screen, int64_t screen_stride, int64_t rows, int64_t vocab, const float* x,
                  int64_t hidden, const float* table, const float* row_error, float sigmas, float* out,
                  int64_t out_stride, int threads) {
  threads = threads < 1 ? 1 : threads;
  std::vector<float> bests(threads);
  std::vector<int64_t> leads(threads);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* s = screen + r * screen_stride;
    const float* xr = x + r * hidden;
    float* o = out + r * out_stride;
    const float margin = sigmas * std::sqrt(row_dot(xr, xr, hidden));
    int64_t lead = 0;
    float lead_value = 0.f;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
      const int team = omp_get_num_threads(), me = omp_get_thread_num();
#else
      const int team = 1, me = 0;
#endif
      const int64_t begin = vocab * me / team, end = vocab * (me + 1) / team;
      // The first of equal maxima, as torch's argmax: each thread's first in its part, the parts in order. A
      // NaN is passed over here (torch's would take it), and stays NaN in the logits, where the sampler's
      // argmax finds it all the same.
      int64_t mine = begin;
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t v = begin; v < end; ++v) {
        o[v] = screen_value(s[v]);
        if (o[v] > best) best = o[v], mine = v;
      }
      bests[me] = best, leads[me] = mine;
#pragma omp barrier
#pragma omp single
      {
        int first = 0;
        for (int t = 1; t < team; ++t)
          if (bests[t] > bests[first]) first = t;
        lead = leads[first];
        lead_value = row_dot(table + lead * hidden, xr, hidden);
      }  // the single's barrier: every thread sees the lead
      for (int64_t v = begin; v < end; ++v)
        if (o[v] + margin * row_error[v] >= lead_value) o[v] = row_dot(table + v * hidden, xr, hidden);
    }
    o[lead] = lead_value;
  }
  return 0;
}

}  // extern "C"
