// Decode attention over the paged KV cache on CPU: one query token per request, bfloat16 K/V read in place
// from their blocks (no gather), float32 math, one pass over K and one over V per (request, KV head).
//
// PyTorch's fused CPU attention is built for many query rows: for a decode's few (the query heads that
// share a KV head) it packs K/V for its matrix kernels on every call, and the step has to gather each
// request's blocks first. See evenflow/worker/attention/cpu_decode.py for where this is used and measured.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using at::vec::Vectorized;
using Vec = Vectorized<float>;
using BVec = Vectorized<c10::BFloat16>;
using bf16 = c10::BFloat16;

constexpr int kMaxGroup = 16;  // query heads per KV head (checked by the caller)
// A step with fewer (request, KV head) pairs than kSplitTasks splits each pair's context into parts of at least
// kMinPartTokens (flash-decoding), so that a lone stream's 3 KV heads do not leave one of 2 threads with two of
// them: one stream's attention at 2048 tokens of context, SmolLM2's 30 layers, took 0.75x its time (2-core AVX2
// EPYC, docs/results/quantization.md). Fixed counts, not the thread count: the bits do not depend on the threads.
constexpr int64_t kSplitTasks = 12;
constexpr int64_t kMinPartTokens = 512;

// A row of D bfloat16 values as D / Vec::size() float vectors.
template <int D>
inline void load_row(const bf16* src, Vec* dst) {
  for (int i = 0; i < D / BVec::size(); ++i) {
    auto [lo, hi] = at::vec::convert_to_float<bf16>(BVec::loadu(src + i * BVec::size()));
    dst[2 * i] = lo;
    dst[2 * i + 1] = hi;
  }
}

// Rows ``ahead`` on into the caches, every cache line of each (past the block too: a request's blocks are
// mostly one range of ids, so its next rows usually follow in memory). A prefetch never faults; the
// address is an integer so that no pointer points past the cache.
template <int D>
inline void prefetch_row(const bf16* row, int64_t ahead, int64_t token_stride) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(row) + uintptr_t(ahead * token_stride) * sizeof(bf16);
  for (uintptr_t line = 0; line < D * sizeof(bf16); line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(p + line));
  }
}

// Calls visit(t, row) for token t = begin..end-1 of one KV head in ``cache``, its row as float vectors, walking the
// request's blocks in order.
template <int D, typename Visit>
inline void for_each_row(const bf16* cache, const int32_t* blocks, int64_t begin, int64_t end, int64_t kv_heads,
                         int64_t kv_head, int64_t block_size, Visit visit) {
  const int64_t token_stride = kv_heads * D;  // one token's row of every KV head
  Vec row[D / Vec::size()];
  for (int64_t t = begin; t < end;) {
    const int64_t b = t / block_size, n = std::min((b + 1) * block_size, end) - t;
    const bf16* first = cache + ((int64_t(blocks[b]) * block_size + t % block_size) * kv_heads + kv_head) * D;
    for (int64_t j = 0; j < n; ++j) {
      prefetch_row<D>(first + j * token_stride, 4, token_stride);
      load_row<D>(first + j * token_stride, row);
      visit(t + j, row);
    }
    t += n;
  }
}

// One part of a (request, KV head) pair's attention, tokens [begin, end): per query head its scores' largest value
// ``top``, the sum of exp(score - top) ``total`` and the values weighted by them ``acc`` (not yet divided).
template <int D>
struct Part {
  float top[kMaxGroup], total[kMaxGroup];
  Vec acc[kMaxGroup][D / Vec::size()];
};

// ``part`` of query heads ``q`` (``group`` of them, already scaled) over tokens [begin, end) (begin < end).
template <int D>
void attend(const Vec (*q)[D / Vec::size()], const bf16* k_cache, const bf16* v_cache, const int32_t* blocks,
            int64_t begin, int64_t end, int64_t group, int64_t kv_heads, int64_t kv_head, int64_t block_size,
            Part<D>& part, std::vector<float>& scores) {
  constexpr int F = D / Vec::size();
  const int64_t len = end - begin;
  scores.resize(group * len);
  float* s = scores.data();
  // Pass 1: every key's score for each query head.
  for_each_row<D>(k_cache, blocks, begin, end, kv_heads, kv_head, block_size, [&](int64_t t, const Vec* row) {
    for (int64_t g = 0; g < group; ++g) {
      Vec acc = q[g][0] * row[0];
      for (int f = 1; f < F; ++f) acc = at::vec::fmadd(q[g][f], row[f], acc);
      s[g * len + t - begin] = acc.reduce_add();
    }
  });
  // exp(s - max) of each head's scores, in place, and their sum.
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * len;
    const float m = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, sg, len);
    int64_t t = 0;
    Vec total(0.f);
    for (; t + Vec::size() <= len; t += Vec::size()) {
      Vec e = (Vec::loadu(sg + t) - Vec(m)).exp_u20();
      e.store(sg + t);
      total = total + e;
    }
    float sum = total.reduce_add();
    if (t < len) {
      const int rest = int(len - t);
      Vec e = (Vec::loadu(sg + t, rest) - Vec(m)).exp_u20();
      e.store(sg + t, rest);
      for (int i = 0; i < rest; ++i) sum += sg[t + i];
    }
    part.top[g] = m;
    part.total[g] = sum;
  }
  // Pass 2: the values, weighted.
  for (int64_t g = 0; g < group; ++g)
    for (int f = 0; f < F; ++f) part.acc[g][f] = Vec(0.f);
  for_each_row<D>(v_cache, blocks, begin, end, kv_heads, kv_head, block_size, [&](int64_t t, const Vec* row) {
    for (int64_t g = 0; g < group; ++g) {
      const Vec p(s[g * len + t - begin]);
      for (int f = 0; f < F; ++f) part.acc[g][f] = at::vec::fmadd(p, row[f], part.acc[g][f]);
    }
  });
}

// The query heads' outputs from the ``count`` parts of their tokens: each part's sums rescaled to the largest
// score of all (a part with no tokens has none).
template <int D>
void finish(const Part<D>* parts, int64_t count, int64_t group, bf16* out) {
  constexpr int F = D / Vec::size();
  for (int64_t g = 0; g < group; ++g) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < count; ++i) top = std::max(top, parts[i].top[g]);
    Vec acc[F];
    for (int f = 0; f < F; ++f) acc[f] = Vec(0.f);
    float total = 0.f;
    for (int64_t i = 0; i < count; ++i) {
      if (parts[i].total[g] == 0.f) continue;
      const float w = count == 1 ? 1.f : std::exp(parts[i].top[g] - top);
      total += w * parts[i].total[g];
      for (int f = 0; f < F; ++f) acc[f] = at::vec::fmadd(parts[i].acc[g][f], Vec(w), acc[f]);
    }
    const Vec inverse(1.f / total);
    for (int i = 0; i < D / BVec::size(); ++i)
      at::vec::convert_from_float<bf16>(acc[2 * i] * inverse, acc[2 * i + 1] * inverse).store(out + g * D + i * BVec::size());
  }
}

template <int D>
void run(const bf16* q, int64_t q_row_stride, const bf16* k_cache, const bf16* v_cache, const int32_t* table,
         int64_t table_stride, const int32_t* lens, bf16* out, int64_t out_row_stride, int64_t num_reqs, int64_t heads,
         int64_t kv_heads, int64_t block_size, float scale, int threads) {
  constexpr int F = D / Vec::size();
  const int64_t group = heads / kv_heads, pairs = num_reqs * kv_heads;
  int64_t longest = 0;
  for (int64_t r = 0; r < num_reqs; ++r) longest = std::max<int64_t>(longest, lens[r]);
  const int64_t split =
      pairs >= kSplitTasks ? 1 : std::max<int64_t>(1, std::min(kSplitTasks / pairs, longest / kMinPartTokens));
  // The calling thread's, kept across calls; the pool's threads fill it through ``all`` (inside the parallel
  // region the name would be each thread's own).
  thread_local std::vector<Part<D>> parts;
  parts.resize(pairs * split);
  Part<D>* const all = parts.data();
#pragma omp parallel num_threads(threads)
  {
    // Per pool thread, kept across calls: a call allocates nothing once the longest context has been seen.
    thread_local std::vector<float> scores;
    // Contiguous runs of tasks: a request's KV heads mostly on one thread, which reads its blocks' memory in
    // order (tasks dealt one at a time round the threads measured up to 1.3x slower, sorted contexts too).
#pragma omp for schedule(static)
    for (int64_t task = 0; task < pairs * split; ++task) {
      const int64_t pair = task / split, i = task % split, r = pair / kv_heads, h = pair % kv_heads;
      const int64_t len = lens[r], begin = len * i / split, end = len * (i + 1) / split;
      Part<D>& part = all[task];
      bf16* o = out + r * out_row_stride + h * group * D;
      if (begin >= end) {  // no keys here: a decode's context holds its own token, so never all of them
        for (int64_t g = 0; g < group; ++g) part.top[g] = -std::numeric_limits<float>::infinity(), part.total[g] = 0.f;
        if (split == 1)
          for (int64_t j = 0; j < group * D; ++j) o[j] = bf16(0.f);
        continue;
      }
      Vec qv[kMaxGroup][F];
      for (int64_t g = 0; g < group; ++g) {
        load_row<D>(q + r * q_row_stride + (h * group + g) * D, qv[g]);
        for (int f = 0; f < F; ++f) qv[g][f] = qv[g][f] * Vec(scale);
      }
      attend<D>(qv, k_cache, v_cache, table + r * table_stride, begin, end, group, kv_heads, h, block_size, part,
                scores);
      if (split == 1) finish<D>(&part, 1, group, o);
    }
    if (split > 1) {
#pragma omp for schedule(static)
      for (int64_t pair = 0; pair < pairs; ++pair) {
        const int64_t r = pair / kv_heads, h = pair % kv_heads;
        bf16* o = out + r * out_row_stride + h * group * D;
        if (lens[r] <= 0)
          for (int64_t j = 0; j < group * D; ++j) o[j] = bf16(0.f);
        else
          finish<D>(all + pair * split, split, group, o);
      }
    }
  }
}

}  // namespace

// Returns 0; 1 when head_dim is not one this build serves, 2 when the query heads are not a whole number of
// at most kMaxGroup a KV head (the caller checks first).
extern "C" int paged_decode_bf16(const void* q, int64_t q_row_stride, const void* k_cache, const void* v_cache,
                                 const int32_t* table, int64_t table_stride, const int32_t* lens, void* out,
                                 int64_t out_row_stride, int64_t num_reqs, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int threads) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > kMaxGroup) return 2;
  auto* qb = static_cast<const bf16*>(q);
  auto* kb = static_cast<const bf16*>(k_cache);
  auto* vb = static_cast<const bf16*>(v_cache);
  auto* ob = static_cast<bf16*>(out);
  switch (head_dim) {
    case 64:
      run<64>(qb, q_row_stride, kb, vb, table, table_stride, lens, ob, out_row_stride, num_reqs, heads, kv_heads,
              block_size, scale, threads);
      return 0;
    case 128:
      run<128>(qb, q_row_stride, kb, vb, table, table_stride, lens, ob, out_row_stride, num_reqs, heads, kv_heads,
               block_size, scale, threads);
      return 0;
    default:
      return 1;
  }
}

extern "C" int paged_decode_max_group() { return kMaxGroup; }
