// meshnet's decode rows through a quantized shard's decoder layers, in one call: B sessions' next tokens.
//
// Why (services/node/lean_decode.py): a decode step of a small model is mostly the work between the
// products. Through Python, each of the default model's 30 layers is about 25 torch operations plus
// about 8 per row (the KV-cache append, the attention call and its views): on 2 cores one row's step
// took 16 ms of which the products were 11, eight rows' 41 ms of which the products were 17. Here one
// call runs every layer of the step for all rows; what remains between products is a few loops over
// B x hidden numbers.
//
// Per layer (a Llama-style layer, no biases, as LeanDecoder runs it):
//   h = rms_norm(x) * w_in                  float32 statistics, as transformers' LlamaRMSNorm
//   q, k, v = split(h @ Wqkv^T)             meshnet::quant_mm (quant_mm.cpp)
//   q, k = rope(q), rope(k)                 x * cos + rotate_half(x) * sin, each row at its own position
//   cache[row] <- k, v at its next position (converted to the cache's element type)
//   a = attention of each KV head's query heads over the row's cache (row_attention.cpp's group kernel)
//   x = x + a @ Wo^T
//   x = x + (silu(g) * u) @ Wdown^T  with  g, u = split(rms_norm(x) * w_post @ Wgate_up^T)
// Arithmetic: float32 throughout, as the Python path; sums in a different order than torch's reductions
// (the norms), so results agree with it to float32 rounding, not bit for bit. A row's result does not depend
// on the other rows of the batch beyond what the product's own path does (quant_mm.cpp: AMX from 8 rows).
//
// Arguments: x float32 [B, hidden]; cos and sin float32 [B, head_dim]; per layer (in order) ten tensors
// in `weights` (input norm, post-attention norm, then packed and scales of qkv, o, gate_up, down), four
// `bits` (qkv, o, gate_up, down) and two `eps` (input, post); `keys` and `values` are the cache buffers
// [1, kv_heads, capacity, head_dim] of layer-major (layer, row) pairs, `lengths` the positions each holds
// before this step. The caller has made room for one more position in each and advances its lengths after
// a successful return; a failure writes at most the next position, which the cache does not count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "meshnet_kernels.h"

namespace {

constexpr int64_t kWeightsPerLayer = 10;
constexpr int64_t kBitsPerLayer = 4;
constexpr int64_t kEpsPerLayer = 2;

// transformers' LlamaRMSNorm in float32: w * (x * 1/sqrt(mean(x^2) + eps)).
void rms_norm(const float* x, int64_t B, int64_t H, const float* w, float eps, float* out) {
  for (int64_t b = 0; b < B; ++b) {
    const float* row = x + b * H;
    float squares = 0.0f;
    for (int64_t i = 0; i < H; ++i) squares += row[i] * row[i];
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) out[b * H + i] = w[i] * (row[i] * scale);
  }
}

// x * cos + rotate_half(x) * sin for `heads` heads of D numbers in place; rotate_half(x) = [-x2, x1].
void rope(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  float rotated[512];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t d = 0; d < half; ++d) rotated[d] = -v[d + half];
    for (int64_t d = half; d < D; ++d) rotated[d] = v[d - half];
    for (int64_t d = 0; d < D; ++d) {
      const float a = v[d] * cos[d];
      const float r = rotated[d] * sin[d];
      v[d] = a + r;
    }
  }
}

// exp(x) for 16 floats: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), e^r by a degree-6 polynomial, times 2^n;
// within 2 ulp of expf over the range silu meets (clamped to +-88, where expf over- or underflows).
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// out = silu(g) * u = g / (1 + exp(-g)) * u over n numbers (vectorised where the CPU has AVX-512).
__attribute__((target("avx512f"))) void silu_times_avx512(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void silu_times(const float* g, const float* u, int64_t n, float* out) {
  static const bool vector = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  if (vector) {
    silu_times_avx512(g, u, n, out);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

template <typename E>
void store(const float* from, int64_t n, void* to) {
  E* out = static_cast<E*>(to);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<E>(from[i]);
}

// The kv_heads x D numbers of one row's keys (or values) into position `at` of a [1, kv, cap, D] buffer.
void append(const float* from, int64_t kv_heads, int64_t D, const at::Tensor& buffer, int64_t pos) {
  const int64_t head_stride = buffer.stride(1), row_stride = buffer.stride(2);
  const int64_t size = buffer.element_size();
  char* base = static_cast<char*>(buffer.data_ptr());
  for (int64_t h = 0; h < kv_heads; ++h) {
    void* to = base + (h * head_stride + pos * row_stride) * size;
    switch (buffer.scalar_type()) {
      case at::kHalf: store<c10::Half>(from + h * D, D, to); break;
      case at::kBFloat16: store<c10::BFloat16>(from + h * D, D, to); break;
      default: store<float>(from + h * D, D, to); break;
    }
  }
}

void check_buffer(const at::Tensor& t, int64_t kv_heads, int64_t D, int64_t needed, at::ScalarType type) {
  TORCH_CHECK(t.dim() == 4 && t.size(0) == 1 && t.size(1) == kv_heads && t.size(3) == D && t.stride(3) == 1,
              "meshnet_quant.decode_rows: a cache buffer must be [1, ", kv_heads, ", capacity, ", D,
              "] with unit stride along the head dim");
  TORCH_CHECK(t.size(2) >= needed, "meshnet_quant.decode_rows: a cache buffer holds ", t.size(2),
              " positions, the step needs ", needed);
  TORCH_CHECK(t.scalar_type() == type && (type == at::kFloat || type == at::kHalf || type == at::kBFloat16),
              "meshnet_quant.decode_rows: the keys and values of a step must share one of float32, float16, "
              "bfloat16");
  TORCH_CHECK(t.device().is_cpu(), "meshnet_quant.decode_rows: caches must be on the CPU");
}

at::Tensor decode_rows(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                       at::IntArrayRef bits, at::ArrayRef<double> eps, at::TensorList keys, at::TensorList values,
                       at::IntArrayRef lengths, double scaling, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "meshnet_quant.decode_rows: x must be float32 [B, hidden] on the CPU");
  const int64_t B = x_in.size(0), H = x_in.size(1);
  const int64_t layers = static_cast<int64_t>(weights.size()) / kWeightsPerLayer;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer &&
                  static_cast<int64_t>(bits.size()) == layers * kBitsPerLayer &&
                  static_cast<int64_t>(eps.size()) == layers * kEpsPerLayer,
              "meshnet_quant.decode_rows: ", kWeightsPerLayer, " weights, ", kBitsPerLayer, " bits and ", kEpsPerLayer,
              " eps per layer");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "meshnet_quant.decode_rows: ", heads,
              " query heads for ", kv_heads, " KV heads");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers * B && static_cast<int64_t>(values.size()) == layers * B &&
                  static_cast<int64_t>(lengths.size()) == layers * B,
              "meshnet_quant.decode_rows: one key buffer, value buffer and length per layer and row");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "meshnet_quant.decode_rows: cos and sin must be float32 [B, head_dim]");
  const int64_t D = cos.size(1), G = heads / kv_heads;
  TORCH_CHECK(D % 2 == 0 && D <= 512, "meshnet_quant.decode_rows: head dim ", D, " (even, at most 512)");
  const int64_t qkv_width = (heads + 2 * kv_heads) * D;
  const at::ScalarType cache_type = keys[0].scalar_type();
  TORCH_CHECK(cache_type == at::kFloat || meshnet::row_attention_vectorised(D),
              "meshnet_quant.decode_rows: a 16-bit cache needs AVX-512");
  int64_t longest = 0;
  for (int64_t i = 0; i < layers * B; ++i) {
    TORCH_CHECK(lengths[i] >= 0, "meshnet_quant.decode_rows: a negative cache length");
    check_buffer(keys[i], kv_heads, D, lengths[i] + 1, cache_type);
    check_buffer(values[i], kv_heads, D, lengths[i] + 1, cache_type);
    TORCH_CHECK(keys[i].strides() == values[i].strides(), "meshnet_quant.decode_rows: keys and values of a "
                "cache must be laid out alike");
    longest = std::max(longest, lengths[i] + 1);
  }
  const at::Tensor cs = cos.contiguous(), sn = sin.contiguous();
  at::Tensor x = x_in.contiguous().clone();
  const at::TensorOptions options = x.options();
  at::Tensor normed = at::empty({B, H}, options);
  at::Tensor attended = at::empty({B, heads * D}, options);
  std::vector<float> scratch(static_cast<size_t>(B * kv_heads * G * longest));
  float* xs = x.data_ptr<float>();
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    const int64_t* wb = bits.data() + layer * kBitsPerLayer;
    const double* we = eps.data() + layer * kEpsPerLayer;
    for (int i = 0; i < 2; ++i)
      TORCH_CHECK(w[i].scalar_type() == at::kFloat && w[i].numel() == H && w[i].is_contiguous(),
                  "meshnet_quant.decode_rows: norms must be contiguous float32 [hidden]");
    rms_norm(xs, B, H, w[0].data_ptr<float>(), static_cast<float>(we[0]), normed.data_ptr<float>());
    at::Tensor qkv = meshnet::quant_mm(normed, w[2], w[3], wb[0], 0);
    TORCH_CHECK(qkv.size(1) == qkv_width, "meshnet_quant.decode_rows: the qkv product has ", qkv.size(1),
                " outputs, the heads need ", qkv_width);
    float* qkvs = qkv.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      float* row = qkvs + b * qkv_width;
      rope(row, heads + kv_heads, D, cs.data_ptr<float>() + b * D, sn.data_ptr<float>() + b * D);
      const int64_t pos = lengths[layer * B + b];
      append(row + heads * D, kv_heads, D, keys[layer * B + b], pos);
      append(row + (heads + kv_heads) * D, kv_heads, D, values[layer * B + b], pos);
    }
    float* att = attended.data_ptr<float>();
    at::parallel_for(0, B * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads, h = task % kv_heads;
        const at::Tensor& k = keys[layer * B + b];
        const at::Tensor& v = values[layer * B + b];
        const int64_t size = k.element_size(), L = lengths[layer * B + b] + 1;
        const char* kbase = static_cast<const char*>(k.data_ptr()) + h * k.stride(1) * size;
        const char* vbase = static_cast<const char*>(v.data_ptr()) + h * v.stride(1) * size;
        meshnet::attend_group(qkvs + b * qkv_width + h * G * D, G, D, kbase, vbase, k.stride(2), cache_type, L,
                              static_cast<float>(scaling), scratch.data() + task * G * longest,
                              att + b * heads * D + h * G * D);
      }
    });
    at::Tensor projected = meshnet::quant_mm(attended, w[4], w[5], wb[1], 0);
    TORCH_CHECK(projected.size(1) == H, "meshnet_quant.decode_rows: o has ", projected.size(1), " outputs");
    const float* ps = projected.data_ptr<float>();
    for (int64_t i = 0; i < B * H; ++i) xs[i] = xs[i] + ps[i];
    rms_norm(xs, B, H, w[1].data_ptr<float>(), static_cast<float>(we[1]), normed.data_ptr<float>());
    at::Tensor gate_up = meshnet::quant_mm(normed, w[6], w[7], wb[2], 0);
    const int64_t inner = gate_up.size(1) / 2;
    at::Tensor act = at::empty({B, inner}, options);
    const float* gu = gate_up.data_ptr<float>();
    float* as = act.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) silu_times(gu + b * 2 * inner, gu + b * 2 * inner + inner, inner, as + b * inner);
    at::Tensor down = meshnet::quant_mm(act, w[8], w[9], wb[3], 0);
    TORCH_CHECK(down.size(1) == H, "meshnet_quant.decode_rows: down has ", down.size(1), " outputs");
    const float* ds = down.data_ptr<float>();
    for (int64_t i = 0; i < B * H; ++i) xs[i] = xs[i] + ds[i];
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(meshnet_quant, m) {
  m.def("decode_rows(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, int[] bits, float[] eps, Tensor[] keys, "
        "Tensor[] values, int[] lengths, float scaling, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshnet_quant, CPU, m) { m.impl("decode_rows", decode_rows); }
