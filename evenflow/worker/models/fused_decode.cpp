// Every layer of a decode step of few rows in one call: what models/llama.py's layer loop does on the
// narrowing path with the C++ layer glue, with no Python between the ops. It is compiled after
// layer_glue.cpp and attention/paged_decode.cpp in one translation unit (models/fused_decode.py joins the
// three), whose loops it calls; the projections are torch's int4 kernel, called through ATen.
#include <ATen/ATen.h>

#include <cstring>
#include <vector>

namespace {

struct FusedLayer {
  at::Tensor qkv, qkv_sz, o, o_sz, gate_up, gate_up_sz, down, down_sz;  // packed int4 and its scales/zeros
  const float* input_scaled;  // RMSNorm weights * sqrt(hidden), float32
  const float* post_scaled;
};

struct FusedModel {
  std::vector<FusedLayer> layers;
  int64_t hidden, heads, kv_heads, head_dim, inter;
  float eps_root;
};

std::vector<FusedModel> models;  // by handle; a worker registers its model once

constexpr int64_t kGroup = 32;  // values per int4 scale/zero (Q4 blocks)

// A view of a tensor the caller keeps alive (the model's weights).
at::Tensor view_of(int64_t ptr, const int64_t* shape, int64_t dims, at::ScalarType dtype) {
  return at::from_blob(reinterpret_cast<void*>(ptr), at::IntArrayRef(shape, dims), at::TensorOptions().dtype(dtype));
}

at::Tensor bf16_rows(int64_t rows, int64_t cols) {
  return at::empty({rows, cols}, at::TensorOptions().dtype(at::kBFloat16));
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz) {
  return at::_weight_int4pack_mm_for_cpu(x, w, kGroup, sz);
}

}  // namespace

extern "C" {

// Registers a model; returns its handle. Per layer, 8 tensors (qkv, its scales/zeros, o, ..., down's) as
// (pointer, 3 dims) with dims[2] = 0 for a 2-D packed weight, and the two norms' scaled weights.
int64_t fused_register(int64_t num_layers, const int64_t* ptrs, const int64_t* dims, const int64_t* norm_ptrs,
                       int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                       float eps_root) {
  FusedModel m{{}, hidden, heads, kv_heads, head_dim, inter, eps_root};
  for (int64_t l = 0; l < num_layers; ++l) {
    at::Tensor t[8];
    for (int j = 0; j < 8; ++j) {
      const int64_t* d = dims + (l * 8 + j) * 3;
      const bool scales = j % 2 == 1;
      t[j] = view_of(ptrs[l * 8 + j], d, scales ? 3 : 2, scales ? at::kBFloat16 : at::kByte);
    }
    m.layers.push_back({t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7],
                        reinterpret_cast<const float*>(norm_ptrs[2 * l]),
                        reinterpret_cast<const float*>(norm_ptrs[2 * l + 1])});
  }
  models.push_back(std::move(m));
  return int64_t(models.size()) - 1;
}

// One decode step of ``rows`` requests through every layer. x [rows, hidden] float32 contiguous (the residual
// stream, updated in place to the last layer's output), h0 [rows, hidden] bfloat16 (layer 0's normed input),
// cos/sin [rows, head_dim] float32, slots [rows] int64 (where each row's K/V goes), table [rows, >= blocks]
// int32 (row stride table_stride), lens [rows] int32, kv [2 * layers] the K and V caches of each layer
// ([blocks, block_size, kv_heads, head_dim] bfloat16). Returns paged_decode_bf16's code (0: done).
int fused_decode_step(int64_t handle, float* x, const void* h0, const float* cos, const float* sin,
                      const int64_t* slots, const int32_t* table, int64_t table_stride, const int32_t* lens,
                      const int64_t* kv, int64_t block_size, int64_t rows, float scale, int threads) {
  const FusedModel& m = models[handle];
  const int64_t d = m.head_dim, qk_heads = m.heads + m.kv_heads, qk_end = qk_heads * d, kv_row = m.kv_heads * d;
  at::Tensor h = view_of(reinterpret_cast<int64_t>(h0), std::vector<int64_t>{rows, m.hidden}.data(), 2,
                         at::kBFloat16);
  at::Tensor delta;
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const FusedLayer& w = m.layers[l];
    if (l > 0) {
      h = bf16_rows(rows, m.hidden);
      glue_add_norm(x, m.hidden, delta.data_ptr(), m.hidden, w.input_scaled, m.eps_root, h.data_ptr(), rows, m.hidden,
                    threads);
    }
    const at::Tensor qkv = int4_mm(h, w.qkv, w.qkv_sz);
    const int64_t qkv_stride = qkv.size(1);
    const at::Tensor qk = bf16_rows(rows, qk_end);
    glue_rotary(qkv.data_ptr(), qkv_stride, cos, sin, qk.data_ptr(), rows, qk_heads, d, threads);
    auto* k_cache = reinterpret_cast<bf16*>(kv[2 * l]);
    auto* v_cache = reinterpret_cast<bf16*>(kv[2 * l + 1]);
    const auto* qk_b = static_cast<const bf16*>(qk.data_ptr());
    const auto* qkv_b = static_cast<const bf16*>(qkv.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {  // write_kv: this step's K and V at their slots
      std::memcpy(k_cache + slots[r] * kv_row, qk_b + r * qk_end + m.heads * d, kv_row * sizeof(bf16));
      std::memcpy(v_cache + slots[r] * kv_row, qkv_b + r * qkv_stride + qk_end, kv_row * sizeof(bf16));
    }
    const at::Tensor o = bf16_rows(rows, m.heads * d);
    const int rc = paged_decode_bf16(qk_b, qk_end, k_cache, v_cache, table, table_stride, lens, o.data_ptr(),
                                     m.heads * d, rows, m.heads, m.kv_heads, d, block_size, scale, threads);
    if (rc) return rc;
    delta = int4_mm(o, w.o, w.o_sz);
    h = bf16_rows(rows, m.hidden);
    glue_add_norm(x, m.hidden, delta.data_ptr(), m.hidden, w.post_scaled, m.eps_root, h.data_ptr(), rows, m.hidden,
                  threads);
    const at::Tensor gu = int4_mm(h, w.gate_up, w.gate_up_sz);
    const at::Tensor a = bf16_rows(rows, m.inter);
    glue_swiglu(gu.data_ptr(), gu.size(1), a.data_ptr(), rows, m.inter, threads);
    delta = int4_mm(a, w.down, w.down_sz);
  }
  const auto* db = static_cast<const bf16*>(delta.data_ptr());
  for (int64_t i = 0; i < rows * m.hidden; ++i) x[i] += float(db[i]);
  return 0;
}

}  // extern "C"
