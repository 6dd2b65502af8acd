// meshnet's product of int8-quantized rows with a quantized matrix: out[B, N] ~ x[B, K] @ W^T
// (`--activations int8`, services/node/model/quant/quant_kernel.py).
//
// Why: the float32 product (quant_mm.cpp) unpacks every weight to a float and spends one fused multiply-add a
// weight a row; with the rows as int8 (one scale per group, as llama.cpp's Q8 activations) the integers meet
// in integer dot products, four byte pairs an instruction (AVX512-VNNI's vpdpbusd) or a 16x16 tile at once
// (AMX-INT8), so batched decode rows and prompt chunks cost a fraction of their float arithmetic.
//
// Rows (quantize_rows): per row and group of G inputs (the matrix's group, 32 or 16), d = max|x| / 127,
// xq = round-half-even(x * (127 / max|x|)) (0 for an all-zero group), sumq = sum(xq), zx = d * sumq. The xq
// are stored in the order the weights' integers come out of their dwords (the "slots" of a group):
//   int8 (4 a dword):  slot k = input k;
//   int4 (8 a dword, nibble i = input 8c+i): per 8 inputs the slots hold inputs 0,2,4,6,1,3,5,7 (a dword's
//                      low nibbles, then its high ones);
//   int5 (6 a dword): dword d of a group gives 8 slots, inputs 6d..6d+3, 6d+4, 6d+5 and two zero slots, so a
//                      group of 32 takes 48 slots.
// Each group: idot = sum over inputs of (q - c) xq, exact in int32 (c = 8 for int4's nibbles, 0 for int8, int5
// is held as q + 16 and counted from 16), then out += s * (float(idot) * d), then out += z * zx (two fused
// multiply-adds, groups in input order). Every path (generic, AVX2, VNNI, AMX) computes the same integers and
// the same float steps, so its results are the same bits; a row's result does not depend on the other rows or
// the threads. Against the float64 product of the same int8 rows (xq * d) with the dequantized weights, the
// error is float32 rounding only: at most (2 K/G + 4) * 2^-24 * sum_k |xq_k d| (|s (q_k - c)| + |z|)
// (tests/test_q8_kernel.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "meshnet_kernels.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;         // output rows per block (the native layout's)
constexpr int64_t kGroup = 32;         // GGUF's blocks
constexpr int64_t kSmallGroup = 16;    // Q6_K's sub-blocks
constexpr int64_t kVnniChunk = 8;      // rows a VNNI pass keeps in registers (an int32 and a float32 vector each)
constexpr int64_t kAmxChunk = 16;      // rows of one AMX tile
constexpr int64_t kAmxMinRows = 16;    // fewest rows the automatic choice sends to AMX (below: VNNI)
constexpr int64_t kGrainWork = 1 << 17;  // multiply-adds below which a thread is not worth waking
constexpr int64_t kRowsBudget = 256 * 1024;  // bytes of int8 rows an AMX set keeps in L2
constexpr size_t kScratchKeep = 256 * 1024;   // scratch bytes a thread keeps between calls (decode rows' products)
constexpr float kQ8Max = 127.f;

enum Isa : int64_t { kAuto = 0, kGeneric = 1, kAvx2 = 2, kVnni = 3, kAmx = 4 };

// Weight dwords and activation slot dwords of one group.
template <int BITS, int G>
constexpr int kDwg = BITS == 5 ? 6 : G * BITS / 32;
template <int BITS, int G>
constexpr int kSlots = BITS == 5 ? 12 : (BITS == 4 ? 2 * kDwg<BITS, G> : kDwg<BITS, G>);
// The offset the unsigned weight bytes of the generic/VNNI paths carry: int4 nibbles 0..15 stand for q - 8,
// int5 fields for q + 16, int8 bytes are flipped to q + 128.
template <int BITS>
constexpr int32_t kOffset = BITS == 4 ? 8 : (BITS == 5 ? 16 : 128);

std::atomic<int64_t> g_activations{0};  // the process's mode for meshnet::quant_mm: 0 float32, 1 int8

struct Q8Args {
  const int8_t* xa;   // [rows, slots * 4] activation bytes in slot order, rows padded to the path's chunk
  int64_t row_bytes;
  const float* dx;    // [rows, groups]
  const float* zx;    // [rows, groups]
  const int32_t* sumq;  // [rows, groups]
  const int32_t* w;   // packed
  const uint16_t* sz;  // scales (bfloat16 bits)
  int64_t K;
  float* out;
  int64_t ldo;
};

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The slot of input k within its group (see the top of the file).
inline int64_t slot_of(int64_t bits, int64_t k) {
  if (bits == 4) {
    const int64_t i = k % 8;
    return k - i + (i % 2 == 0 ? i / 2 : 4 + i / 2);
  }
  if (bits == 5) return (k / 6) * 8 + k % 6;
  return k;
}

int64_t group_slot_bytes(int64_t bits, int64_t G) { return bits == 5 ? 48 : G; }

// One group of G inputs quantized (scalar): xq in input order into q, and the group's d, sum, zx.
inline void quantize_group_scalar(const float* xg, int64_t G, int8_t* q, float* d, int32_t* sum, float* zx) {
  float amax = 0.f;
  for (int64_t k = 0; k < G; ++k) amax = std::max(amax, std::fabs(xg[k]));
  const float id = amax > 0.f ? kQ8Max / amax : 0.f;
  int32_t total = 0;
  for (int64_t k = 0; k < G; ++k) {
    const int32_t v = std::clamp(static_cast<int32_t>(std::nearbyint(xg[k] * id)), -127, 127);
    q[k] = static_cast<int8_t>(v);
    total += v;
  }
  *d = amax / kQ8Max;
  *sum = total;
  *zx = *d * static_cast<float>(total);
}

// The same with AVX-512 (the same numbers: the product x * id rounded to nearest-even, as nearbyint does under
// the default rounding mode), 16 inputs a vector.
__attribute__((target("avx512f,avx512bw"))) void quantize_group_avx512(const float* xg, int64_t G, int8_t* q,
                                                                       float* d, int32_t* sum, float* zx) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t k = 0; k < G; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xg + k)));
  const float amax = _mm512_reduce_max_ps(m);
  const float id = amax > 0.f ? kQ8Max / amax : 0.f;
  __m512i total = _mm512_setzero_si512();
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t k = 0; k < G; k += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + k), _mm512_set1_ps(id)));
    v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    total = _mm512_add_epi32(total, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(v));
  }
  *d = amax / kQ8Max;
  *sum = _mm512_reduce_add_epi32(total);
  *zx = *d * static_cast<float>(*sum);
}

void quantize_rows(const float* x, int64_t ldx, int64_t B, int64_t K, int64_t bits, int64_t G, int8_t* xa,
                   int64_t row_bytes, float* dx, float* zx, int32_t* sumq) {
  const int64_t groups = K / G, gbytes = group_slot_bytes(bits, G);
  const bool vector = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  at::parallel_for(0, B, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t begin, int64_t end) {
    int8_t q[kGroup];
    for (int64_t r = begin; r < end; ++r) {
      int8_t* row = xa + r * row_bytes;
      if (bits == 5) std::memset(row, 0, static_cast<size_t>(row_bytes));  // its padding slots
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t rg = r * groups + g;
        int8_t* out = row + g * gbytes;
        (vector ? quantize_group_avx512 : quantize_group_scalar)(x + r * ldx + g * G, G, bits == 8 ? out : q,
                                                                 dx + rg, sumq + rg, zx + rg);
        if (bits == 4) {
          for (int64_t k = 0; k < G; k += 8)
            for (int64_t i = 0; i < 8; ++i) out[k + (i % 2 == 0 ? i / 2 : 4 + i / 2)] = q[k + i];
        } else if (bits == 5) {
          for (int64_t k = 0; k < G; ++k) out[slot_of(5, k)] = q[k];
        }
      }
    }
  });
}

// ----------------------------------------------------------------------------- generic (and AVX2)
// One group's weights of a block as bytes in slot order, the layout of AMX's B tile: tile[k][j][t] is slot
// 4k + t of output j, unsigned (offset kOffset).
template <int BITS, int G>
inline __attribute__((always_inline)) void group_bytes(const int32_t* v, uint8_t (*tile)[kBlock][4]) {
  for (int d = 0; d < kDwg<BITS, G>; ++d)
    for (int j = 0; j < kBlock; ++j) {
      const uint32_t u = uint32_t(v[d * kBlock + j]);
      if constexpr (BITS == 8) {
        for (int t = 0; t < 4; ++t) tile[d][j][t] = uint8_t(((u >> (8 * t)) & 255u) ^ 128u);
      } else if constexpr (BITS == 4) {
        for (int t = 0; t < 4; ++t) {
          tile[2 * d][j][t] = uint8_t((u >> (8 * t)) & 15u);
          tile[2 * d + 1][j][t] = uint8_t((u >> (8 * t + 4)) & 15u);
        }
      } else {
        for (int t = 0; t < 4; ++t) tile[2 * d][j][t] = uint8_t((u >> (5 * t)) & 31u);
        tile[2 * d + 1][j][0] = uint8_t((u >> 20) & 31u);
        tile[2 * d + 1][j][1] = uint8_t((u >> 25) & 31u);
        tile[2 * d + 1][j][2] = tile[2 * d + 1][j][3] = 0;
      }
    }
}

template <int BITS, int G>
inline __attribute__((always_inline)) void block_q8_portable(const Q8Args& a, int64_t blk, int64_t row0,
                                                             int64_t n) {
  constexpr int DWG = kDwg<BITS, G>, SLOTS = kSlots<BITS, G>;
  const int64_t groups = a.K / G;
  uint8_t tile[SLOTS][kBlock][4];
  float total[kVnniChunk][kBlock] = {};
  for (int64_t g = 0; g < groups; ++g) {
    group_bytes<BITS, G>(a.w + (blk * groups * DWG + g * DWG) * kBlock, tile);
    const uint16_t* sg = a.sz + (blk * groups + g) * 2 * kBlock;
    for (int64_t r = 0; r < n; ++r) {
      const int8_t* xr = a.xa + (row0 + r) * a.row_bytes + g * SLOTS * 4;
      const int64_t rg = (row0 + r) * groups + g;
      for (int j = 0; j < kBlock; ++j) {
        int32_t dot = 0;
        for (int k = 0; k < SLOTS; ++k)
          for (int t = 0; t < 4; ++t) dot += int32_t(tile[k][j][t]) * int32_t(xr[4 * k + t]);
        const float f = static_cast<float>(dot - kOffset<BITS> * a.sumq[rg]) * a.dx[rg];
        total[r][j] = std::fma(bf16_to_float(sg[j]), f, total[r][j]);
        total[r][j] = std::fma(bf16_to_float(sg[kBlock + j]), a.zx[rg], total[r][j]);
      }
    }
  }
  for (int64_t r = 0; r < n; ++r)
    for (int j = 0; j < kBlock; ++j) a.out[(row0 + r) * a.ldo + blk * kBlock + j] = total[r][j];
}

template <int BITS, int G>
void block_q8_generic(const Q8Args& a, int64_t blk, int64_t row0, int64_t n) {
  block_q8_portable<BITS, G>(a, blk, row0, n);
}

template <int BITS, int G>
__attribute__((target("avx2,fma"))) void block_q8_avx2(const Q8Args& a, int64_t blk, int64_t row0, int64_t n) {
  block_q8_portable<BITS, G>(a, blk, row0, n);
}

// ----------------------------------------------------------------------------- AVX512-VNNI
// R rows by NB blocks; a dword of weights becomes one (int8) or two (int4, int5) vectors of 64 unsigned bytes,
// each meeting one broadcast dword of a row's slots in one vpdpbusd.

#define MESHNET_Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

template <int BITS>
MESHNET_Q8_TARGET inline void unpack_dword(__m512i v, __m512i* lo, __m512i* hi) {
  if constexpr (BITS == 8) {
    *lo = _mm512_xor_si512(v, _mm512_set1_epi32(int32_t(0x80808080u)));
  } else if constexpr (BITS == 4) {
    const __m512i m = _mm512_set1_epi32(0x0F0F0F0F);
    *lo = _mm512_and_si512(v, m);
    *hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), m);
  } else {  // bits 5t..5t+4 to byte t (t < 4), bits 20.. and 25.. to bytes 0 and 1 of the second
    const __m512i f0 = _mm512_set1_epi32(0x1F), f1 = _mm512_set1_epi32(0x1F00);
    const __m512i f2 = _mm512_set1_epi32(0x1F0000), f3 = _mm512_set1_epi32(0x1F000000);
    const __m512i a = _mm512_or_si512(_mm512_and_si512(v, f0), _mm512_and_si512(_mm512_slli_epi32(v, 3), f1));
    const __m512i b = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(v, 6), f2),
                                      _mm512_and_si512(_mm512_slli_epi32(v, 9), f3));
    *lo = _mm512_or_si512(a, b);
    *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v, 20), f0),
                          _mm512_and_si512(_mm512_srli_epi32(v, 17), f1));
  }
}

template <int R, int NB, int BITS, int G>
MESHNET_Q8_TARGET void block_vnni(const Q8Args& a, int64_t blk0, int64_t row0) {
  constexpr int DWG = kDwg<BITS, G>, SLOTS = kSlots<BITS, G>;
  const int64_t groups = a.K / G, dwords = groups * DWG;
  const int64_t row_dwords = a.row_bytes / 4;
  const int32_t* xa = reinterpret_cast<const int32_t*>(a.xa) + row0 * row_dwords;
  __m512 total[NB][R];
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) total[b][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[NB][R];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int d = 0; d < DWG; ++d) {
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        __m512i lo, hi;
        unpack_dword<BITS>(_mm512_loadu_si512(a.w + ((blk0 + b) * dwords + g * DWG + d) * kBlock), &lo, &hi);
        const int slot = BITS == 8 ? d : 2 * d;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* xr = xa + r * row_dwords + g * SLOTS;
          acc[b][r] = _mm512_dpbusd_epi32(acc[b][r], lo, _mm512_set1_epi32(xr[slot]));
          if constexpr (BITS != 8)
            if (BITS == 4 || d + 1 < DWG)  // int5's last dword holds 2 integers: its second vector is empty
              acc[b][r] = _mm512_dpbusd_epi32(acc[b][r], hi, _mm512_set1_epi32(xr[slot + 1]));
        }
      }
    }
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const uint16_t* sg = a.sz + ((blk0 + b) * groups + g) * 2 * kBlock;
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg))), 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + kBlock))), 16));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (row0 + r) * groups + g;
        const __m512i idot = _mm512_sub_epi32(acc[b][r], _mm512_set1_epi32(kOffset<BITS> * a.sumq[rg]));
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(idot), _mm512_set1_ps(a.dx[rg]));
        total[b][r] = _mm512_fmadd_ps(z, _mm512_set1_ps(a.zx[rg]), _mm512_fmadd_ps(s, f, total[b][r]));
      }
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + (row0 + r) * a.ldo + (blk0 + b) * kBlock, total[b][r]);
}

// Blocks a VNNI pass takes at once for n rows (independent chains for few rows; no arithmetic changes).
int64_t vnni_blocks(int64_t n) { return n == 1 ? 4 : (n <= 3 ? 2 : 1); }

template <int BITS, int G>
void rows_vnni(const Q8Args& a, int64_t blk, int64_t nb, int64_t row0, int64_t n) {
  if (nb == 4 && n == 1) return block_vnni<1, 4, BITS, G>(a, blk, row0);
  if (nb == 2 && n == 2) return block_vnni<2, 2, BITS, G>(a, blk, row0);
  if (nb == 2 && n == 3) return block_vnni<3, 2, BITS, G>(a, blk, row0);
  TORCH_CHECK(nb == 1, "meshnet_quant: no int8 pass of ", n, " rows by ", nb, " blocks");
  switch (n) {
    case 1: return block_vnni<1, 1, BITS, G>(a, blk, row0);
    case 2: return block_vnni<2, 1, BITS, G>(a, blk, row0);
    case 3: return block_vnni<3, 1, BITS, G>(a, blk, row0);
    case 4: return block_vnni<4, 1, BITS, G>(a, blk, row0);
    case 5: return block_vnni<5, 1, BITS, G>(a, blk, row0);
    case 6: return block_vnni<6, 1, BITS, G>(a, blk, row0);
    case 7: return block_vnni<7, 1, BITS, G>(a, blk, row0);
    case 8: return block_vnni<8, 1, BITS, G>(a, blk, row0);
    default: TORCH_CHECK(false, "meshnet_quant: an int8 pass takes 1..8 rows, not ", n);
  }
}

template <int BITS, int G>
void rows_portable(const Q8Args& a, int64_t blk, int64_t nb, int64_t row0, int64_t n, bool avx2) {
  for (int64_t b = 0; b < nb; ++b)
    avx2 ? block_q8_avx2<BITS, G>(a, blk + b, row0, n) : block_q8_generic<BITS, G>(a, blk + b, row0, n);
}

// ----------------------------------------------------------------------------- AMX-INT8
// Per block: its weights as signed bytes once (int8: the matrix itself), then per chunk of 16 rows and group one
// tile product (tdpbssd) of the rows' slots and the group's weights, then the epilogue above (no offset: the
// tile's integers are q - 8, q).

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

__attribute__((target("amx-tile"))) void configure_int8_tiles(int64_t slots) {
  TileConfig c{};
  c.palette_id = 1;
  c.rows[0] = kAmxChunk;  // the products: 16 rows of 16 int32
  c.colsb[0] = 64;
  c.rows[1] = uint8_t(slots);  // the weights: a row per slot dword, 16 outputs of 4 bytes
  c.colsb[1] = 64;
  c.rows[2] = kAmxChunk;  // the activations: 16 rows of the group's slots
  c.colsb[2] = uint16_t(slots * 4);
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile"))) void release_int8_tiles() { _tile_release(); }

bool amx_int8_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    // AMX-TILE (edx 24), AMX-INT8 (edx 25), AVX512F (ebx 16), AVX512BW (ebx 30), AVX512-VNNI (ecx 11)
    const bool has = (d & (1u << 24)) && (d & (1u << 25)) && (b & (1u << 16)) && (b & (1u << 30)) &&
                     (c & (1u << 11));
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return has && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// One block's weights for AMX, every group: signed bytes in slot order (int4's nibbles as q - 8, int5's fields as
// q), [groups][SLOTS][16] dwords, so the tile's products need no offset. int8 tiles load straight from the matrix.
template <int BITS, int G>
__attribute__((target("avx512f,avx512bw"))) void block_weights_amx(const Q8Args& a, int64_t blk, int32_t* wbuf) {
  constexpr int DWG = kDwg<BITS, G>, SLOTS = kSlots<BITS, G>;
  const int64_t groups = a.K / G, dwords = groups * DWG;
  const __m512i off = _mm512_set1_epi8(static_cast<char>(kOffset<BITS>));
  for (int64_t g = 0; g < groups; ++g)
#pragma GCC unroll 8
    for (int d = 0; d < DWG; ++d) {
      __m512i lo, hi;
      unpack_dword<BITS>(_mm512_loadu_si512(a.w + (blk * dwords + g * DWG + d) * kBlock), &lo, &hi);
      int32_t* t = wbuf + (g * SLOTS + 2 * d) * kBlock;
      _mm512_store_si512(t, _mm512_sub_epi8(lo, off));
      // int5's last dword holds 2 integers: its second vector's slots meet zero activations; keep them zero
      _mm512_store_si512(t + kBlock, BITS == 4 || d + 1 < DWG ? _mm512_sub_epi8(hi, off) : _mm512_setzero_si512());
    }
}

// Rows [first, first + 16 * chunks) by one block: per chunk of 16 rows, per group, one tile product of the rows'
// slots and the group's weights, then the epilogue with the chunk's running sums in registers.
template <int BITS, int G>
__attribute__((target("avx512f,avx512bw,avx512vnni,amx-tile,amx-int8"))) void block_amx8(
    const Q8Args& a, int64_t blk, int64_t first, int64_t chunks, int64_t rows, const int32_t* wbuf) {
  constexpr int DWG = kDwg<BITS, G>, SLOTS = kSlots<BITS, G>;
  const int64_t groups = a.K / G, dwords = groups * DWG;
  alignas(64) int32_t sums[kAmxChunk][kBlock];
  const uint16_t* sz = a.sz + blk * groups * 2 * kBlock;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t row0 = first + c * kAmxChunk;
    __m512 total[kAmxChunk];
#pragma GCC unroll 16
    for (int r = 0; r < kAmxChunk; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      _tile_zero(0);
      _tile_loadd(2, a.xa + row0 * a.row_bytes + g * SLOTS * 4, a.row_bytes);
      if constexpr (BITS == 8) {
        _tile_loadd(1, a.w + (blk * dwords + g * DWG) * kBlock, 64);
      } else {
        _tile_loadd(1, wbuf + g * SLOTS * kBlock, 64);
      }
      _tile_dpbssd(0, 2, 1);
      _tile_stored(0, sums, 64);
      asm volatile("" : : : "memory");  // GCC 12's tile intrinsics are asm without a memory clobber
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * 2 * kBlock))), 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * 2 * kBlock + kBlock))), 16));
      const float* dx = a.dx + row0 * groups + g;
      const float* zx = a.zx + row0 * groups + g;
#pragma GCC unroll 16
      for (int r = 0; r < kAmxChunk; ++r) {
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[r])), _mm512_set1_ps(dx[r * groups]));
        total[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(zx[r * groups]), _mm512_fmadd_ps(s, f, total[r]));
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < kAmxChunk; ++r)
      if (row0 + r < rows) _mm512_storeu_ps(a.out + (row0 + r) * a.ldo + blk * kBlock, total[r]);
  }
}

// ----------------------------------------------------------------------------- dispatch

int64_t q8_best_isa() {
  __builtin_cpu_init();
  if (amx_int8_ready()) return kAmx;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return kVnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kGeneric;
}

using RowsFn = void (*)(const Q8Args&, int64_t, int64_t, int64_t, int64_t);
using AmxFn = void (*)(const Q8Args&, int64_t, int64_t, int64_t, int64_t, const int32_t*);
using WeightsFn = void (*)(const Q8Args&, int64_t, int32_t*);

template <int BITS, int G>
std::tuple<RowsFn, AmxFn, WeightsFn> fns(int64_t isa) {
  RowsFn rows = isa >= kVnni ? rows_vnni<BITS, G>
                : isa == kAvx2
                    ? +[](const Q8Args& a, int64_t b, int64_t nb, int64_t r, int64_t n) {
                        rows_portable<BITS, G>(a, b, nb, r, n, true);
                      }
                    : +[](const Q8Args& a, int64_t b, int64_t nb, int64_t r, int64_t n) {
                        rows_portable<BITS, G>(a, b, nb, r, n, false);
                      };
  return {rows, block_amx8<BITS, G>, block_weights_amx<BITS, G>};
}

std::tuple<RowsFn, AmxFn, WeightsFn> pick(int64_t bits, int64_t G, int64_t isa) {
  if (bits == 5) return fns<5, kGroup>(isa);
  if (G == kGroup) return bits == 4 ? fns<4, kGroup>(isa) : fns<8, kGroup>(isa);
  return bits == 4 ? fns<4, kSmallGroup>(isa) : fns<8, kSmallGroup>(isa);
}

int64_t chosen_isa(int64_t isa, int64_t B) {
  const int64_t best = q8_best_isa();
  if (isa == kAuto) return best == kAmx && B < kAmxMinRows ? kVnni : best;
  TORCH_CHECK(isa >= kGeneric && isa <= best, "meshnet_quant.mm8: instruction set ", isa,
              " is not available here (best ", best, ")");
  return isa;
}

// The group size of a matrix (its scales' shape), checked as quant_mm.cpp checks it.
int64_t check_matrix(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "meshnet_quant.mm8: bits must be 4, 5 or 8, not ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "meshnet_quant.mm8: x must be float32 [B, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.size(2) == kBlock &&
                  packed.is_contiguous(),
              "meshnet_quant.mm8: packed must be contiguous int32 [N/16, dwords, 16]");
  const int64_t K = x.size(1), blocks = packed.size(0);
  const int64_t dwords_per_32 = bits == 5 ? 6 : bits;
  TORCH_CHECK(K % kGroup == 0 && packed.size(1) * kGroup == K * dwords_per_32, "meshnet_quant.mm8: x has ", K,
              " inputs, the packed matrix ", packed.size(1) * kGroup / dwords_per_32);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == blocks && scales.size(1) > 0 &&
                  (K == scales.size(1) * kGroup || K == scales.size(1) * kSmallGroup) && scales.size(2) == 2 &&
                  scales.size(3) == kBlock,
              "meshnet_quant.mm8: scales must be contiguous bfloat16 [N/16, K/G, 2, 16], G 32 or 16");
  const int64_t G = K / scales.size(1);
  TORCH_CHECK(bits != 5 || G == kGroup, "meshnet_quant.mm8: 5-bit integers come in groups of ", kGroup);
  return G;
}

at::Tensor mm8(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales, int64_t bits,
               int64_t isa) {
  const int64_t G = check_matrix(x_in, packed, scales, bits);
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t K = x.size(1), B = x.size(0), blocks = packed.size(0), N = blocks * kBlock, groups = K / G;
  at::Tensor out = at::empty({B, N}, x.options());
  if (B == 0) return out;
  isa = chosen_isa(isa, B);
  const bool amx = isa == kAmx && B >= kAmxChunk;  // fewer rows than a tile: VNNI
  const int64_t padded = amx ? (B + kAmxChunk - 1) / kAmxChunk * kAmxChunk : B;
  const int64_t row_bytes = groups * group_slot_bytes(bits, G);
  // The rows' int8 slots and per-group d, zx and sumq in one scratch block: a thread's own, kept between calls
  // up to kScratchKeep bytes (a decode step makes about 120 products: allocating three tensors each cost as much
  // as a small product), a fresh one beyond.
  const size_t stat_bytes = static_cast<size_t>(3 * padded * groups) * sizeof(float);
  const size_t need = stat_bytes + static_cast<size_t>(padded * row_bytes);
  thread_local std::vector<uint8_t> kept;
  std::vector<uint8_t> owned;
  uint8_t* base;
  if (need <= kScratchKeep) {
    if (kept.size() < kScratchKeep) kept.resize(kScratchKeep);
    base = kept.data();
  } else {
    owned.resize(need);
    base = owned.data();
  }
  float* dx = reinterpret_cast<float*>(base);
  float* zx = dx + padded * groups;
  int32_t* sumq = reinterpret_cast<int32_t*>(zx + padded * groups);
  int8_t* xa = reinterpret_cast<int8_t*>(base + stat_bytes);
  if (padded > B) {  // AMX's padding rows: zero (the others are written whole)
    std::memset(xa + B * row_bytes, 0, static_cast<size_t>((padded - B) * row_bytes));
    for (int64_t i = B * groups; i < padded * groups; ++i) dx[i] = zx[i] = 0.f, sumq[i] = 0;
  }
  quantize_rows(x.data_ptr<float>(), x.stride(0), B, K, bits, G, xa, row_bytes, dx, zx, sumq);
  Q8Args a{xa, row_bytes, dx, zx, sumq, packed.data_ptr<int32_t>(),
           reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()), K, out.data_ptr<float>(), N};
  const auto [rows_fn, amx_fn, weights_fn] = pick(bits, G, isa);
  if (amx) {
    const int64_t slots = bits == 5 ? 12 : G / 4;  // slot dwords of a group (kSlots)
    const int64_t set_chunks = std::max<int64_t>(1, kRowsBudget / (row_bytes * kAmxChunk));
    const int64_t grain = std::max<int64_t>(1, kGrainWork / (kBlock * K * padded));
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      // each thread's unpacked weights of one block (int4, int5): groups * slots * 16 dwords, 64-byte aligned
      std::vector<int32_t> scratch(static_cast<size_t>(groups * slots * kBlock) + 16);
      int32_t* wbuf = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
      configure_int8_tiles(slots);
      for (int64_t first = 0; first < padded; first += set_chunks * kAmxChunk) {
        const int64_t chunks = std::min(set_chunks, (padded - first) / kAmxChunk);
        for (int64_t blk = begin; blk < end; ++blk) {
          if (bits != 8) weights_fn(a, blk, wbuf);
          amx_fn(a, blk, first, chunks, B, wbuf);
        }
      }
      release_int8_tiles();
    });
    return out;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainWork / (kBlock * K * std::min(B, kVnniChunk)));
  const int64_t step = isa >= kVnni ? vnni_blocks(B) : 1;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end;) {
      const int64_t nb = blk + step <= end ? step : 1;
      for (int64_t row0 = 0; row0 < B; row0 += kVnniChunk) rows_fn(a, blk, nb, row0, std::min(kVnniChunk, B - row0));
      blk += nb;
    }
  });
  return out;
}

// The rows as the int8 product sees them: xq int8 [B, K] in input order and d float32 [B, K/G] (for tests).
std::tuple<at::Tensor, at::Tensor> q8_rows(const at::Tensor& x_in, int64_t G) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && (G == kGroup || G == kSmallGroup) &&
                  x_in.size(1) % G == 0,
              "meshnet_quant.q8_rows: x must be float32 [B, K], K a multiple of G (32 or 16)");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), K = x.size(1), groups = K / G;
  at::Tensor xq = at::empty({B, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({B, groups}, x.options());
  at::Tensor zx = at::empty({B, groups}, x.options());
  at::Tensor sumq = at::empty({B, groups}, x.options().dtype(at::kInt));
  quantize_rows(x.data_ptr<float>(), K, B, K, 8, G, xq.data_ptr<int8_t>(), K, d.data_ptr<float>(),
                zx.data_ptr<float>(), sumq.data_ptr<int32_t>());
  return {xq, d};
}

void set_activations(int64_t mode) {
  TORCH_CHECK(mode == 0 || mode == 1, "meshnet_quant.set_activations: 0 (float32) or 1 (int8), not ", mode);
  g_activations.store(mode);
}

int64_t activations() { return g_activations.load(); }

}  // namespace

bool meshnet::int8_activations() { return g_activations.load() == 1; }

at::Tensor meshnet::quant_mm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                int64_t bits, int64_t isa) {
  return mm8(x, packed, scales, bits, isa);
}

TORCH_LIBRARY_FRAGMENT(meshnet_quant, m) {
  m.def("mm8(Tensor x, Tensor packed, Tensor scales, int bits, int isa=0) -> Tensor");
  m.def("q8_rows(Tensor x, int G) -> (Tensor, Tensor)", &q8_rows);
  m.def("q8_best_isa() -> int", &q8_best_isa);
  m.def("set_activations(int mode) -> ()", &set_activations);
  m.def("activations() -> int", &activations);
}

TORCH_LIBRARY_IMPL(meshnet_quant, CPU, m) { m.impl("mm8", mm8); }
