// Every layer of a decode step of few rows in one call: what models/llama.py's layer loop does on the
// narrowing path with the C++ layer glue, with no Python between the ops. It is compiled after
// layer_glue.cpp, attention/paged_decode.cpp and int4_gemv.cpp in one translation unit (models/fused_decode.py
// joins the four), whose loops it calls; the projections are evenflow's int4 GEMV (int4_gemv.cpp, in the same unit),
// torch's int4 kernel, or oneDNN's linear on their dense copies for more rows, as models/int4_linear.py picks
// them, torch's through ATen's dispatcher.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace {

// A projection: the int4 weight, its scales/zeros (torch's order, and the GEMV's strip order where the weight
// has that copy), and the dense bfloat16 copy in oneDNN's layout that steps of more rows read (undefined where
// the model keeps none).
struct Projection {
  at::Tensor packed, scale_zeros, strip_scales, dense;
};

struct FusedLayer {
  Projection qkv, o, gate_up, down;
  at::Tensor input_scaled, post_scaled;  // RMSNorm weights * sqrt(hidden), float32
};

struct FusedModel {
  std::vector<FusedLayer> layers;
  // group: values per int4 scale/zero; tile_rows: the rows of torch's packed int4 tiles here
  int64_t hidden, heads, kv_heads, head_dim, inter, group, tile_rows;
  float eps_root;
};

// By handle. A deque: registering another model (a test's second runner) moves no model a step reads.
std::deque<FusedModel> models;
std::mutex models_mutex;

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<c10::string_view>);

// oneDNN's linear, the op PackedCpuLinear calls (resolved at registration: a torch that moved it fails there).
const c10::TypedOperatorHandle<LinearPointwise>& linear_pointwise() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearPointwise>();
  return op;
}

at::Tensor bf16_rows(int64_t rows, int64_t cols) {
  return at::empty({rows, cols}, at::TensorOptions().dtype(at::kBFloat16));
}

// Which kernel multiplies a step's projections (models/int4_linear.py's ``Int4CpuLinear.kernel``).
enum Kernel { kTorchInt4 = 0, kDense = 1, kGemv = 2 };

// x @ w.T as models/int4_linear.py computes it at this row count: torch's int4 kernel, evenflow's GEMV
// (int4_gemv.cpp, compiled before this file) into ``y`` (the step's buffer for it), or oneDNN's linear on the
// dense copy; torch's kernels return a tensor of their own.
at::Tensor project(const at::Tensor& x, const Projection& w, Kernel kernel, const FusedModel& m, int threads,
                   const at::Tensor& y) {
  const int64_t group = m.group;
  if (kernel == kTorchInt4) return at::_weight_int4pack_mm_for_cpu(x, w.packed, group, w.scale_zeros);
  if (kernel == kGemv) {
    TORCH_CHECK(group == 32, "fused_decode: the int4 GEMV reads groups of 32, not ", group);
    const int64_t n = w.scale_zeros.size(1);
    TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) == n, "fused_decode: no buffer for a ", n, "-row product");
    const auto* strip = w.strip_scales.defined() ? static_cast<const uint16_t*>(w.strip_scales.data_ptr()) : nullptr;
    const int rc = int4_gemv_bf16(static_cast<const uint16_t*>(x.data_ptr()), x.size(0), x.size(1),
                                  w.packed.data_ptr<uint8_t>(), static_cast<const uint16_t*>(w.scale_zeros.data_ptr()),
                                  strip, n, static_cast<uint16_t*>(y.data_ptr()), threads, m.tile_rows);
    TORCH_CHECK(rc == 0, "fused_decode: the int4 GEMV refused a ", n, "x", x.size(1), " weight");
    return y;
  }
  return linear_pointwise().call(x, w.dense, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                                 std::nullopt);
}

// Registers a model; returns its handle. ``weights``: per layer, for qkv, o, gate_up and down, the packed
// int4 weight, its scales/zeros, their strip-order copy and its dense copy (empty tensors for none); ``norms``:
// per layer the two scaled norm weights (float32); ``shape``: hidden, heads, kv_heads, head_dim, intermediate,
// group, tile rows.
int64_t register_model(at::TensorList weights, at::TensorList norms, at::IntArrayRef shape, double eps_root) {
  TORCH_CHECK(shape.size() == 7 && norms.size() % 2 == 0 && weights.size() == 8 * norms.size(),
              "fused_decode: bad registration");
  linear_pointwise();
  FusedModel m{{}, shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], float(eps_root)};
  for (size_t l = 0; l < norms.size() / 2; ++l) {
    Projection p[4];
    for (int j = 0; j < 4; ++j) {
      const at::Tensor* w = &weights[16 * l + 4 * j];
      const auto given = [](const at::Tensor& t) { return t.numel() > 0 ? t : at::Tensor(); };
      p[j] = {w[0], w[1], given(w[2]), given(w[3])};
    }
    TORCH_CHECK(norms[2 * l].scalar_type() == at::kFloat && norms[2 * l + 1].scalar_type() == at::kFloat);
    m.layers.push_back({p[0], p[1], p[2], p[3], norms[2 * l], norms[2 * l + 1]});
  }
  std::lock_guard<std::mutex> lock(models_mutex);
  models.push_back(std::move(m));
  return int64_t(models.size()) - 1;
}

// Drops a model's tensors (its FusedDecode is gone); the handle is not reused.
void release_model(int64_t handle) {
  std::lock_guard<std::mutex> lock(models_mutex);
  models.at(handle) = FusedModel{};
}

TORCH_LIBRARY_FRAGMENT(evenflow_fused_decode, lib) {
  lib.def("register_model(Tensor[] weights, Tensor[] norms, int[] shape, float eps_root) -> int", register_model);
  lib.def("release_model(int handle) -> ()", release_model);
}

thread_local std::string last_error;  // the message of the calling thread's last step that threw (returned -1)

int step(int64_t handle, float* x, const void* h0, const float* cos, const float* sin, const int64_t* slots,
         int64_t num_slots, const int32_t* table, int64_t table_stride, const int32_t* lens, const int64_t* kv,
         int64_t num_kv, int64_t block_size, int64_t rows, float scale, int threads, Kernel kernel) {
  TORCH_CHECK(handle >= 0 && handle < int64_t(models.size()), "fused_decode: no model ", handle);
  const FusedModel& m = models[handle];
  TORCH_CHECK(!m.layers.empty() && num_kv == 2 * int64_t(m.layers.size()), "fused_decode: ", num_kv,
              " caches for ", m.layers.size(), " layers");
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "fused_decode: slot ", slots[r], " outside the cache");
  const int64_t d = m.head_dim, qk_heads = m.heads + m.kv_heads, qk_end = qk_heads * d, kv_row = m.kv_heads * d;
  at::Tensor h = at::from_blob(const_cast<void*>(h0), {rows, m.hidden}, at::TensorOptions().dtype(at::kBFloat16));
  // Every layer's activations in the same buffers, allocated once a step (a layer's ops read each before the
  // next op writes it): nine allocations a layer were about half of a one-row step's glue time.
  const int64_t qkv_n = (m.heads + 2 * m.kv_heads) * d;
  const at::Tensor normed = bf16_rows(rows, m.hidden), qkv_out = bf16_rows(rows, qkv_n), qk = bf16_rows(rows, qk_end),
                   o = bf16_rows(rows, m.heads * d), delta_out = bf16_rows(rows, m.hidden),
                   gu_out = bf16_rows(rows, 2 * m.inter), a = bf16_rows(rows, m.inter);
  at::Tensor delta;
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const FusedLayer& w = m.layers[l];
    if (l > 0) {
      h = normed;
      glue_add_norm(x, m.hidden, delta.data_ptr(), m.hidden, w.input_scaled.data_ptr<float>(), m.eps_root,
                    h.data_ptr(), rows, m.hidden, threads);
    }
    const at::Tensor qkv = project(h, w.qkv, kernel, m, threads, qkv_out);
    const int64_t qkv_stride = qkv.size(1);
    glue_rotary(qkv.data_ptr(), qkv_stride, cos, sin, qk.data_ptr(), rows, qk_heads, d, threads);
    auto* k_cache = reinterpret_cast<bf16*>(kv[2 * l]);
    auto* v_cache = reinterpret_cast<bf16*>(kv[2 * l + 1]);
    const auto* qk_b = static_cast<const bf16*>(qk.data_ptr());
    const auto* qkv_b = static_cast<const bf16*>(qkv.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {  // write_kv: this step's K and V at their slots
      std::memcpy(k_cache + slots[r] * kv_row, qk_b + r * qk_end + m.heads * d, kv_row * sizeof(bf16));
      std::memcpy(v_cache + slots[r] * kv_row, qkv_b + r * qkv_stride + qk_end, kv_row * sizeof(bf16));
    }
    const int rc = paged_decode_bf16(qk_b, qk_end, k_cache, v_cache, table, table_stride, lens, o.data_ptr(),
                                     m.heads * d, rows, m.heads, m.kv_heads, d, block_size, scale, threads);
    TORCH_CHECK(rc == 0, "fused_decode: the attention kernel refused the heads (code ", rc, ")");
    delta = project(o, w.o, kernel, m, threads, delta_out);
    h = normed;
    glue_add_norm(x, m.hidden, delta.data_ptr(), m.hidden, w.post_scaled.data_ptr<float>(), m.eps_root,
                  h.data_ptr(), rows, m.hidden, threads);
    const at::Tensor gu = project(h, w.gate_up, kernel, m, threads, gu_out);
    glue_swiglu(gu.data_ptr(), gu.size(1), a.data_ptr(), rows, m.inter, threads);
    delta = project(a, w.down, kernel, m, threads, delta_out);
  }
  const auto* db = static_cast<const bf16*>(delta.data_ptr());
  for (int64_t i = 0; i < rows * m.hidden; ++i) x[i] += float(db[i]);
  return 0;
}

}  // namespace

extern "C" {

// One decode step of ``rows`` requests through every layer. x [rows, hidden] float32 contiguous (the residual
// stream, updated in place to the last layer's output), h0 [rows, hidden] bfloat16 (layer 0's normed input),
// cos/sin [rows, head_dim] float32, slots [rows] int64 (where each row's K/V goes, below num_slots), table
// [rows, >= blocks] int32 (row stride table_stride), lens [rows] int32, kv [num_kv] the K and V caches of each
// layer ([blocks, block_size, kv_heads, head_dim] bfloat16); kernel: what multiplies the projections (``Kernel``).
// Returns 0, or -1 with fused_decode_error() saying why (an exception must not cross into ctypes).
int fused_decode_step(int64_t handle, float* x, const void* h0, const float* cos, const float* sin,
                      const int64_t* slots, int64_t num_slots, const int32_t* table, int64_t table_stride,
                      const int32_t* lens, const int64_t* kv, int64_t num_kv, int64_t block_size, int64_t rows,
                      float scale, int threads, int kernel) {
  try {
    TORCH_CHECK(kernel >= kTorchInt4 && kernel <= kGemv, "fused_decode: no kernel ", kernel);
    return step(handle, x, h0, cos, sin, slots, num_slots, table, table_stride, lens, kv, num_kv, block_size, rows,
                scale, threads, static_cast<Kernel>(kernel));
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

const char* fused_decode_error() { return last_error.c_str(); }

}  // extern "C"
