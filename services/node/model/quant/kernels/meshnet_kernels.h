// What meshnet's kernels offer each other inside the one library they are compiled into
// (services/node/quant_kernel.py): decode_rows.cpp runs whole decoder layers with the product of
// quant_mm.cpp and the attention of row_attention.cpp, without a trip through Python between them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace meshnet {

// x[B, K] float32 @ W^T for a matrix in the native layout (quant_mm.cpp; isa 0 picks the best): float32 rows,
// or int8 rows (quant_mm_q8) where the process chose int8 activations.
at::Tensor quant_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits,
                    int64_t isa);

// x[B, K] float32 @ W^T with the rows quantized to int8 per group (q8_mm.cpp; isa 0 picks the best).
at::Tensor quant_mm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits,
                       int64_t isa);

// Whether this process multiplies quantized matrices with int8 rows (`--activations`, set once at start).
bool int8_activations();

// Whether attend_group takes the AVX-512 path for head dim D (otherwise its portable loops, float32 caches only).
bool row_attention_vectorised(int64_t D);

// One decode row's attention for one KV head: the G query heads q[G, D] (float32, contiguous) against the
// first L positions of keys and values (element type `type`: float32, float16 or bfloat16; position l of
// this head at base + l * row_stride, unit stride along D). `scores` is scratch of G * L floats; the
// result goes to out[G, D]. Softmax: max subtracted, exp, sum, each weight times 1 / sum.
void attend_group(const float* q, int64_t G, int64_t D, const void* keys, const void* values, int64_t row_stride,
                  at::ScalarType type, int64_t L, float scale, float* scores, float* out);

}  // namespace meshnet
