// The small element-wise steps of a Llama layer, fused, for float32 on the CPU.
//
// At decode batch sizes each of these is a few kilobytes of work, and torch spends
// far more dispatching it than doing it: F.rms_norm alone runs as eight ops (pow,
// mean, add, rsqrt, mul, mul, plus conversions), where the fused kernel is one
// pass over the row; rotary embedding is five (slice, neg, cat, mul, add) for
// each of q and k. A decode step of SmolLM2-135M calls them 61 and 30
// times. The arithmetic is transformers' own (LlamaRMSNorm, apply_rotary_pos_emb),
// in float32, so greedy output still matches it.
//
//   rms_norm(x, w, eps) -> y                    y = x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm_(h, x, w, eps) -> y            h += x, then y = rms_norm(h)
//   rope_(qkv, positions, cos, sin, Hq, Hkv)   rotates q and k inside each row of qkv in place
//   silu_mul(gate_up) -> y                      y = silu(gate) * up, gate_up = [gate | up]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "vec.h"

namespace {

// Rows per parallel task: small batches stay on one thread (a task switch costs
// more than the work), large ones split.
inline int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, row_elements)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": float32 CPU tensors only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected [rows, n] with contiguous rows");
}

inline void norm_row(const float* h, const float* w, float eps, int64_t n, float* y) {
  vf acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = load(h + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; i < n; i++) sum += h[i] * h[i];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i + W <= n; i += W) store(y + i, load(w + i) * (load(h + i) * scale));
  for (; i < n; i++) y[i] = w[i] * (h[i] * scale);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "rms_norm: weight must have ", n, " elements");
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) norm_row(xp + r * stride, wp, static_cast<float>(eps), n, yp + r * n);
  });
  return y;
}

at::Tensor add_rms_norm_(at::Tensor hidden, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(hidden, "add_rms_norm_");
  check_rows(x, "add_rms_norm_");
  const int64_t rows = hidden.size(0), n = hidden.size(1);
  TORCH_CHECK(x.size(0) == rows && x.size(1) == n, "add_rms_norm_: hidden and x differ in shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "add_rms_norm_: weight must have ", n, " elements");
  at::Tensor y = at::empty({rows, n}, hidden.options());
  float* hp = hidden.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t h_stride = hidden.stride(0), x_stride = x.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      float* h = hp + r * h_stride;
      const float* xr = xp + r * x_stride;
      int64_t i = 0;
      for (; i + W <= n; i += W) store(h + i, load(h + i) + load(xr + i));
      for (; i < n; i++) h[i] += xr[i];
      norm_row(h, wp, static_cast<float>(eps), n, yp + r * n);
    }
  });
  return y;
}

// transformers' rotate_half: out = x * cos + cat(-x2, x1) * sin, cos and sin being
// cat(freqs, freqs) tables, so both halves of a head read the same row.
inline void rotate(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; i++) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

void rope_(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "rope_");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.dim() == 2 && cos.sizes() == sin.sizes(),
              "rope_: cos and sin must be contiguous float32 [max_position, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == qkv.size(0),
              "rope_: one int64 position per row");
  const int64_t head_dim = cos.size(1), half = head_dim / 2, rows = qkv.size(0);
  TORCH_CHECK(qkv.size(1) >= (num_heads + num_kv_heads) * head_dim && head_dim % 2 == 0,
              "rope_: rows are shorter than the q and k heads");
  float* p = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t stride = qkv.stride(0), heads = num_heads + num_kv_heads, max_position = cos.size(0);
  for (int64_t r = 0; r < rows; r++)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_position, "rope_: position ", pos[r], " is outside the table");
  at::parallel_for(0, rows, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const float* c = cp + pos[r] * head_dim;
      const float* s = sp + pos[r] * head_dim;
      for (int64_t h = 0; h < heads; h++) rotate(p + r * stride + h * head_dim, c, s, half);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: expected [gate | up] rows of even width");
  at::Tensor y = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const float* g = gp + r * stride;
      const float* u = g + n;
      float* out = yp + r * n;
      int64_t i = 0;
      for (; i + NW <= n; i += NW) {  // vn, not vf: on AVX2, GCC spills vf's exp polynomial to the stack
        const vn x = load<vn>(g + i);
        store(out + i, x / (1.f + vexp(-x)) * load<vn>(u + i));
      }
      for (; i < n; i++) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferline, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) hidden, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, &add_rms_norm_);
  m.impl("rope_", c10::DispatchKey::CPU, &rope_);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
}
