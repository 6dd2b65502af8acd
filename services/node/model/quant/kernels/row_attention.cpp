// meshnet's CPU attention of decode rows: each KV head's query heads (one token each) against its cache.
//
// Why (services/node/lean_decode.py): a decode row's attention reads every cached key and value once,
// and that read is all it should cost. torch's CPU flash attention is blocked for long runs of queries;
// for the handful a decode row has (the query heads of one KV head) it took twice the read (the default
// model, 2,048 cached positions, 30 layers, one thread: 10.2 ms against 6.0 to read the keys and values).
// Here each key and each value is loaded once, for all the group's queries:
//   pass 1  s[g, l] = scale * (q[g] . k[l])          one key row in registers, every query of the group
//   softmax over l (ATen's vectorised softmax)
//   pass 2  o[g] = sum_l p[g, l] v[l]                one value row in registers, every query's sums
// Arithmetic: float32 products and sums; a dot product sums its 16-lane pieces, then the lanes (pairwise).
//
// Shapes: q float32 [H, G, D] (contiguous), k and v [H, L, D] with unit stride along D (a cache's slice of
// its first L positions is fine), result float32 [H, G, D]. Keys and values may be kept in float32, float16
// or bfloat16 (a node's --kv-dtype): each is widened to float32 as it is loaded, so a 16-bit cache costs
// half the read and nothing else. The heads run in parallel
// (at::parallel_for), so torch.set_num_threads bounds it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/softmax.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "meshnet_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

namespace {

constexpr int64_t kLanes = 16;       // float32 lanes of an AVX-512 vector
constexpr int64_t kMaxVectors = 8;   // head dims up to 128 take the vector path
constexpr int64_t kQueryTile = 4;
constexpr int64_t kPrefetchKeys = 32;  // cached positions read ahead of the one being multiplied    // queries whose sums pass 2 keeps in registers at once

struct View {
  const void* data;
  int64_t head_stride;
  int64_t row_stride;
};

// ----------------------------------------------------------------------------- AVX-512

// 16 cached numbers widened to float32.
template <typename E>
__attribute__((target("avx512f"))) inline __m512 load16(const E* p);
template <>
__attribute__((target("avx512f"))) inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
__attribute__((target("avx512f"))) inline __m512 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
__attribute__((target("avx512f"))) inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The lane sums of 16 vectors as one vector (lane i: the sum of a[i]'s lanes): pairs interleaved and added
// within 128-bit quarters, then the quarters added across; 45 operations where 16 separate reductions
// take about 130.
__attribute__((target("avx512f"))) inline __m512 sum_lanes16(const __m512* a) {
  __m512 x[8], z[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    z[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // quarter c: keys 4i..4i+3, part c
  }
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x88), _mm512_shuffle_f32x4(z[2], z[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

template <int NV, typename E>
__attribute__((target("avx512f"))) void scores_avx512(const float* q, int64_t G, View k, int64_t h, int64_t L,
                                                      float scale, float* s) {
  const E* keys = static_cast<const E*>(k.data) + h * k.head_stride;
  const __m512 scaling = _mm512_set1_ps(scale);
  int64_t l = 0;
  for (; l + kLanes <= L; l += kLanes) {  // 16 keys at a time, their 16 dot products summed together
    const E* block = keys + l * k.row_stride;
    if (l + kPrefetchKeys < L)
      for (int i = 0; i < kLanes; ++i)
        for (int64_t b = 0; b < NV * kLanes * static_cast<int64_t>(sizeof(E)); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(block + (kPrefetchKeys + i) * k.row_stride) + b, _MM_HINT_T0);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * NV * kLanes;
      __m512 qv[NV], acc[kLanes];
      for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qg + j * kLanes);
      for (int i = 0; i < kLanes; ++i) {
        const E* row = block + i * k.row_stride;
        acc[i] = _mm512_mul_ps(load16(row), qv[0]);
        for (int j = 1; j < NV; ++j) acc[i] = _mm512_fmadd_ps(load16(row + j * kLanes), qv[j], acc[i]);
      }
      _mm512_storeu_ps(s + g * L + l, _mm512_mul_ps(sum_lanes16(acc), scaling));
    }
  }
  for (; l < L; ++l) {
    const E* row = keys + l * k.row_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * NV * kLanes;
      __m512 acc = _mm512_mul_ps(load16(row), _mm512_loadu_ps(qg));
      for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(load16(row + j * kLanes), _mm512_loadu_ps(qg + j * kLanes), acc);
      s[g * L + l] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

template <int NV, int T, typename E>
__attribute__((target("avx512f"))) void values_tile_avx512(const float* p, int64_t L, View v, int64_t h,
                                                           float* out) {
  const E* values = static_cast<const E*>(v.data) + h * v.head_stride;
  __m512 acc[T][NV];
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < NV; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; ++l) {
    const E* row = values + l * v.row_stride;
    if (l + kPrefetchKeys < L)
      for (int64_t b = 0; b < NV * kLanes * static_cast<int64_t>(sizeof(E)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchKeys * v.row_stride) + b, _MM_HINT_T0);
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load16(row + j * kLanes);
    for (int t = 0; t < T; ++t) {
      const __m512 weight = _mm512_set1_ps(p[t * L + l]);
      for (int j = 0; j < NV; ++j) acc[t][j] = _mm512_fmadd_ps(weight, vv[j], acc[t][j]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + t * NV * kLanes + j * kLanes, acc[t][j]);
}

template <int NV, typename E>
void values_avx512(const float* p, int64_t G, int64_t L, View v, int64_t h, float* out) {
  const int64_t D = NV * kLanes;
  int64_t g = 0;
  for (; g + kQueryTile <= G; g += kQueryTile) values_tile_avx512<NV, kQueryTile, E>(p + g * L, L, v, h, out + g * D);
  switch (G - g) {
    case 3:
      values_tile_avx512<NV, 3, E>(p + g * L, L, v, h, out + g * D);
      break;
    case 2:
      values_tile_avx512<NV, 2, E>(p + g * L, L, v, h, out + g * D);
      break;
    case 1:
      values_tile_avx512<NV, 1, E>(p + g * L, L, v, h, out + g * D);
      break;
    default:
      break;
  }
}

using ScoresFn = void (*)(const float*, int64_t, View, int64_t, int64_t, float, float*);
using ValuesFn = void (*)(const float*, int64_t, int64_t, View, int64_t, float*);

template <int NV, typename E>
constexpr std::pair<ScoresFn, ValuesFn> avx512_pair() {
  return {scores_avx512<NV, E>, values_avx512<NV, E>};
}

template <typename E>
std::pair<ScoresFn, ValuesFn> avx512_fns_of(int64_t vectors) {
  switch (vectors) {
    case 1: return avx512_pair<1, E>();
    case 2: return avx512_pair<2, E>();
    case 3: return avx512_pair<3, E>();
    case 4: return avx512_pair<4, E>();
    case 5: return avx512_pair<5, E>();
    case 6: return avx512_pair<6, E>();
    case 7: return avx512_pair<7, E>();
    default: return avx512_pair<8, E>();
  }
}

std::pair<ScoresFn, ValuesFn> avx512_fns(at::ScalarType type, int64_t vectors) {
  switch (type) {
    case at::kHalf: return avx512_fns_of<at::Half>(vectors);
    case at::kBFloat16: return avx512_fns_of<at::BFloat16>(vectors);
    default: return avx512_fns_of<float>(vectors);
  }
}

// ----------------------------------------------------------------------------- portable

void scores_generic(const float* q, int64_t G, int64_t D, View k, int64_t h, int64_t L, float scale, float* s) {
  const float* keys = static_cast<const float*>(k.data) + h * k.head_stride;
  for (int64_t l = 0; l < L; ++l) {
    const float* row = keys + l * k.row_stride;
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * row[d];
      s[g * L + l] = acc * scale;
    }
  }
}

void values_generic(const float* p, int64_t G, int64_t D, int64_t L, View v, int64_t h, float* out) {
  const float* values = static_cast<const float*>(v.data) + h * v.head_stride;
  std::fill(out, out + G * D, 0.0f);
  for (int64_t l = 0; l < L; ++l) {
    const float* row = values + l * v.row_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float weight = p[g * L + l];
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += weight * row[d];
    }
  }
}

bool vector_path(int64_t D) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && D % kLanes == 0 && D / kLanes <= kMaxVectors;
}

View view_of(const at::Tensor& t) { return View{t.data_ptr(), t.stride(0), t.stride(1)}; }

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "meshnet_quant.row_attention: q must be contiguous float32 [H, G, D]");
  const int64_t H = q.size(0), G = q.size(1), D = q.size(2);
  const at::ScalarType type = k.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16,
              "meshnet_quant.row_attention: keys must be float32, float16 or bfloat16, not ", type);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == type && t->size(0) == H && t->size(2) == D &&
                    t->stride(2) == 1,
                "meshnet_quant.row_attention: keys and values must be [", H, ", L, ", D,
                "] of one type with unit stride along the head dim");
  }
  const int64_t L = k.size(1);
  TORCH_CHECK(v.size(1) == L && L > 0, "meshnet_quant.row_attention: ", L, " keys but ", v.size(1), " values");
  at::Tensor scores = at::empty({H, G, L}, q.options());
  at::Tensor out = at::empty({H, G, D}, q.options());
  const float* qd = q.data_ptr<float>();
  float* sd = scores.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const bool vec = vector_path(D);
  // The portable loops read float32: a 16-bit cache is widened first there (a CPU without AVX-512).
  const at::Tensor keys = vec || type == at::kFloat ? k : k.to(at::kFloat);
  const at::Tensor vals = vec || type == at::kFloat ? v : v.to(at::kFloat);
  const View kv = view_of(keys), vv = view_of(vals);
  const float sc = static_cast<float>(scale);
  const auto fns = avx512_fns(type, D / kLanes);
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      if (vec) fns.first(qd + h * G * D, G, kv, h, L, sc, sd + h * G * L);
      else scores_generic(qd + h * G * D, G, D, kv, h, L, sc, sd + h * G * L);
    }
  });
  const at::Tensor weights = at::softmax(scores, -1);
  const float* pd = weights.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      if (vec) fns.second(pd + h * G * L, G, L, vv, h, od + h * G * D);
      else values_generic(pd + h * G * L, G, D, L, vv, h, od + h * G * D);
    }
  });
  return out;
}

}  // namespace

bool meshnet::row_attention_vectorised(int64_t D) { return vector_path(D); }

void meshnet::attend_group(const float* q, int64_t G, int64_t D, const void* keys, const void* values,
                           int64_t row_stride, at::ScalarType type, int64_t L, float scale, float* scores,
                           float* out) {
  const View kv{keys, 0, row_stride}, vv{values, 0, row_stride};
  const bool vec = vector_path(D);
  TORCH_CHECK(vec || type == at::kFloat, "meshnet_quant: a 16-bit cache needs the AVX-512 path");
  const auto fns = avx512_fns(type, D / kLanes);
  if (vec) fns.first(q, G, kv, 0, L, scale, scores);
  else scores_generic(q, G, D, kv, 0, L, scale, scores);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * L;
    const float top = *std::max_element(s, s + L);
    float sum = 0.0f;
    for (int64_t l = 0; l < L; ++l) {
      s[l] = std::exp(s[l] - top);
      sum += s[l];
    }
    const float inverse = 1.0f / sum;
    for (int64_t l = 0; l < L; ++l) s[l] *= inverse;
  }
  if (vec) fns.second(scores, G, L, vv, 0, out);
  else values_generic(scores, G, D, L, vv, 0, out);
}

TORCH_LIBRARY_FRAGMENT(meshnet_quant, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshnet_quant, CPU, m) { m.impl("row_attention", row_attention); }
