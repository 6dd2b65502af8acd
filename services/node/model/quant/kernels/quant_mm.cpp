// meshnet's CPU product of float32 rows with a quantized matrix: out[B, N] = x[B, K] @ W^T.
//
// Why (services/node/quant_kernel.py has the whole story): torch's _weight_int4pack_mm_for_cpu costs
// nearly one pass over the weights per row; this kernel unpacks each weight tile once and applies it to
// up to 16 rows held in registers, so a batch of decode rows costs little more than one.
//
// Layout (written by services/node/model/quant/packed.py, "native" layout), N a multiple of 16, K of the
// group size G (32, or 16 for GGUF's Q6_K, whose scales are per 16 inputs; G is K / scales.size(1)):
//   packed  int32 [N/16, K*bits/32, 16]: dword [b, c, j] holds 32/bits inputs of row 16b+j:
//           int4: nibble i (bits 4i..4i+3) = q[16b+j, 8c+i] in 0..15;
//           int8: byte i (bits 8i..8i+7) = q[16b+j, 4c+i] as a signed int8;
//           int5 (GGUF's 5-bit types): a group of 32 inputs is 6 dwords of 6 integers each (the last holds 2),
//           bits 5i..5i+4 of dword d of group g = q[16b+j, 32g+6d+i] + 16, q in -16..15 (6 bits a weight).
//   scales  bfloat16 [N/16, K/G, 2, 16]: [b, g, 0, j] = s and [b, g, 1, j] = z of row 16b+j, group g.
//   weight  w = (q - 8) * s + z (int4), w = q * s + z (int8, int5), rounded once (one fused multiply-add).
// Arithmetic: float32 rows and sums. AVX-512 (and the portable paths): each weight (q - 8) s + z in one
// fused multiply-add, each group of G inputs summed in input order, the groups' sums added in order.
// AMX (from kAmxMinRows rows where the CPU has it): each group's sum of the exact products of the row with
// the integers (the row as three bfloat16 pieces that add up to it), then s * sum + z * (the row's sum
// over the group). On one path a row's result is the same bits whatever rows ride with it and whatever
// the thread count (one thread computes an output, in an order that does not depend on the batch).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "meshnet_kernels.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;     // output rows per block: one 16-lane float32 vector
constexpr int64_t kGroup = 32;     // inputs sharing one scale and zero (GGUF's blocks)
constexpr int64_t kSmallGroup = 16;  // Q6_K's sub-blocks: the other group size a matrix may have
constexpr int64_t kMaxChunk = 16;  // rows a pass keeps in registers
constexpr int64_t kGrainWork = 1 << 17;  // multiply-adds below which a thread is not worth waking

// Integers a dword holds, and dwords a group of G inputs takes (5-bit integers: 6 a dword, so one shift and one
// two-table permute give a weight, as one shift and one permute give a nibble).
template <int BITS>
constexpr int kPer = BITS == 5 ? 6 : 32 / BITS;
template <int BITS, int G>
constexpr int kDwordsPerGroup = (G + kPer<BITS> - 1) / kPer<BITS>;

enum Isa : int64_t { kAuto = 0, kGeneric = 1, kAvx2 = 2, kAvx512 = 3, kAmx = 4 };
constexpr int kPieces = 3;  // bfloat16 pieces a float32 row is split into for AMX: exactly its value
// Fewest rows a call takes on AMX when the caller lets the kernel choose: below, unpacking the weights
// into AMX's tiles costs more than the AVX-512 products it saves (measured: benchmarks/kernels.py).
constexpr int64_t kAmxMinRows = 8;
// Bytes of rows' pieces a set of many rows may take (block_amx_rows): well inside a core's L2.
constexpr int64_t kPiecesBudget = 512 * 1024;

struct Args {
  const float* x;       // [B, K] rows, row stride ldx
  int64_t ldx;
  const int32_t* w;     // packed
  const uint16_t* sz;   // scales (bfloat16 bits)
  int64_t K;
  float* out;           // [B, N], row stride ldo
  int64_t ldo;
  const uint16_t* xp = nullptr;  // AMX: the rows as kPieces bfloat16 pieces, [kPieces][B][K]
  int64_t B = 0;
  const float* xsum = nullptr;   // AMX: each row's sum over each group, [B][K/32]
};

// ----------------------------------------------------------------------------- AVX-512

// R rows by NB consecutive blocks: NB > 1 gives a pass of one to three rows independent sums to overlap
// (one chain a group would wait on the FMA latency); it changes no output's arithmetic.
template <int R, int NB, int BITS, int G>
__attribute__((target("avx512f"))) void block_avx512(const Args& a, int64_t blk0, int64_t row0) {
  constexpr int PER = kPer<BITS>;  // inputs a dword
  constexpr int DWG = kDwordsPerGroup<BITS, G>;
  const int64_t groups = a.K / G;
  const int64_t dwords = groups * DWG;
  const float* x = a.x + row0 * a.ldx;  // each group: s * (sum of the row times q - 8) + z * (sum of the row)
  const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512 lut5 = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512 lut5_hi = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 total[NB][R];
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) total[b][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 s[NB], z[NB], part[NB][R];  // part: this group's sum of each row, one chain in input order
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const uint16_t* sg = a.sz + ((blk0 + b) * groups + g) * 2 * kBlock;
      s[b] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg))), 16));
      z[b] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + kBlock))), 16));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) part[b][r] = _mm512_setzero_ps();
    }
#pragma GCC unroll 8
    for (int64_t d = 0; d < DWG; ++d) {
      const int64_t k0 = g * G + d * PER;
      __m512i v[NB];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b)
        v[b] = _mm512_loadu_si512(a.w + ((blk0 + b) * dwords + g * DWG + d) * kBlock);
#pragma GCC unroll 8
      for (int i = 0; i < PER; ++i) {
        if (d * PER + i >= G) break;  // int5's last dword of a group holds 2
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) {
          __m512 q;
          if constexpr (BITS == 4) {  // the permute reads the low 4 bits of each lane: nibble i, as q - 8
            q = _mm512_permutexvar_ps(i == 0 ? v[b] : _mm512_srli_epi32(v[b], 4 * i), lut);
          } else if constexpr (BITS == 5) {  // the two-table permute reads the low 5 bits: q + 16, as q
            q = _mm512_permutex2var_ps(lut5, i == 0 ? v[b] : _mm512_srli_epi32(v[b], 5 * i), lut5_hi);
          } else {  // byte i, sign-extended
            const __m512i t = i == 3 ? v[b] : _mm512_slli_epi32(v[b], 24 - 8 * i);
            q = _mm512_cvtepi32_ps(_mm512_srai_epi32(t, 24));
          }
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r)
            part[b][r] = _mm512_fmadd_ps(q, _mm512_set1_ps(x[r * a.ldx + k0 + i]), part[b][r]);
        }
      }
    }
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        total[b][r] = _mm512_fmadd_ps(
            s[b], part[b][r], _mm512_fmadd_ps(z[b], _mm512_set1_ps(a.xsum[(row0 + r) * groups + g]), total[b][r]));
  }
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + (row0 + r) * a.ldo + (blk0 + b) * kBlock, total[b][r]);
}

template <int BITS, int G>
__attribute__((target("avx512f"))) void rows_avx512(const Args& a, int64_t blk, int64_t nb, int64_t row0,
                                                    int64_t n) {
  if (nb == 4 && n == 1) return block_avx512<1, 4, BITS, G>(a, blk, row0);
  if (nb == 2 && n == 2) return block_avx512<2, 2, BITS, G>(a, blk, row0);
  if (nb == 2 && n == 3) return block_avx512<3, 2, BITS, G>(a, blk, row0);
  TORCH_CHECK(nb == 1, "meshnet_quant: no pass of ", n, " rows by ", nb, " blocks");
  switch (n) {
#define MESHNET_CASE(R) \
  case R:               \
    return block_avx512<R, 1, BITS, G>(a, blk, row0);
    MESHNET_CASE(1) MESHNET_CASE(2) MESHNET_CASE(3) MESHNET_CASE(4) MESHNET_CASE(5) MESHNET_CASE(6)
    MESHNET_CASE(7) MESHNET_CASE(8) MESHNET_CASE(9) MESHNET_CASE(10) MESHNET_CASE(11) MESHNET_CASE(12)
    MESHNET_CASE(13) MESHNET_CASE(14) MESHNET_CASE(15) MESHNET_CASE(16)
#undef MESHNET_CASE
    default:
      TORCH_CHECK(false, "meshnet_quant: a pass takes 1..16 rows, not ", n);
  }
}

// Blocks a pass takes at once for a batch of n rows (the AVX-512 path; 1 elsewhere).
int64_t blocks_per_pass(int64_t n) { return n == 1 ? 4 : (n <= 3 ? 2 : 1); }

// ----------------------------------------------------------------------------- portable
// The same arithmetic in plain loops the compiler vectorises; compiled twice (baseline x86-64 or any
// other CPU, and AVX2+FMA), the right one picked at run time. The block's weights of one group are
// unpacked to floats once and applied to every row of the pass. a * b + c contracts to a fused
// multiply-add where the target has one (GCC's default -ffp-contract=fast), as the AVX-512 path computes.

#define MESHNET_GENERIC_BODY                                                                         \
  {                                                                                                  \
    constexpr int PER = kPer<BITS>;                                                                  \
    constexpr int DWG = kDwordsPerGroup<BITS, G>;                                                    \
    const int64_t groups = a.K / G;                                                                  \
    const int32_t* w = a.w + blk * groups * DWG * kBlock;                                            \
    const uint16_t* sz = a.sz + blk * groups * 2 * kBlock;                                           \
    float acc[kMaxChunk][kBlock];                                                                    \
    float wf[G][kBlock];                                                                             \
    for (int64_t r = 0; r < n; ++r)                                                                  \
      for (int j = 0; j < kBlock; ++j) acc[r][j] = 0.f;                                              \
    for (int64_t g = 0; g < groups; ++g) {                                                           \
      float s[kBlock], z[kBlock];                                                                    \
      for (int j = 0; j < kBlock; ++j) {                                                             \
        uint32_t sb = uint32_t(sz[(g * 2) * kBlock + j]) << 16, zb = uint32_t(sz[(g * 2 + 1) * kBlock + j]) << 16; \
        std::memcpy(&s[j], &sb, 4);                                                                  \
        std::memcpy(&z[j], &zb, 4);                                                                  \
      }                                                                                              \
      for (int d = 0; d < DWG; ++d) {                                                                \
        const int32_t* v = w + (g * DWG + d) * kBlock;                                               \
        for (int i = 0; i < PER && d * PER + i < G; ++i)                                             \
          for (int j = 0; j < kBlock; ++j) {                                                         \
            float q = BITS == 4   ? float(int32_t((uint32_t(v[j]) >> (4 * i)) & 15u) - 8)            \
                      : BITS == 5 ? float(int32_t((uint32_t(v[j]) >> (5 * i)) & 31u) - 16)           \
                                  : float(int32_t(uint32_t(v[j]) << (24 - 8 * i)) >> 24);            \
            wf[d * PER + i][j] = q * s[j] + z[j];                                                   \
          }                                                                                          \
      }                                                                                              \
      const float* x = a.x + row0 * a.ldx + g * G;                                                   \
      for (int64_t r = 0; r < n; ++r) {                                                              \
        float part[kBlock] = {};                                                                     \
        for (int k = 0; k < G; ++k) {                                                                \
          const float xv = x[r * a.ldx + k];                                                         \
          for (int j = 0; j < kBlock; ++j) part[j] += wf[k][j] * xv;                                  \
        }                                                                                            \
        for (int j = 0; j < kBlock; ++j) acc[r][j] += part[j];                                       \
      }                                                                                              \
    }                                                                                                \
    for (int64_t r = 0; r < n; ++r)                                                                  \
      for (int j = 0; j < kBlock; ++j) a.out[(row0 + r) * a.ldo + blk * kBlock + j] = acc[r][j];    \
  }

template <int BITS, int G>
void block_generic(const Args& a, int64_t blk, int64_t row0, int64_t n) MESHNET_GENERIC_BODY

template <int BITS, int G>
__attribute__((target("avx2,fma"))) void block_avx2(const Args& a, int64_t blk, int64_t row0,
                                                    int64_t n) MESHNET_GENERIC_BODY

template <int BITS, int G>
void rows_generic(const Args& a, int64_t blk, int64_t nb, int64_t row0, int64_t n) {
  for (int64_t b = 0; b < nb; ++b) block_generic<BITS, G>(a, blk + b, row0, n);
}

template <int BITS, int G>
__attribute__((target("avx2,fma"))) void rows_avx2(const Args& a, int64_t blk, int64_t nb, int64_t row0,
                                                   int64_t n) {
  for (int64_t b = 0; b < nb; ++b) block_avx2<BITS, G>(a, blk + b, row0, n);
}

#undef MESHNET_GENERIC_BODY

// ----------------------------------------------------------------------------- AMX
// Per block of 16 output rows and group of 32 inputs: the integers (q - 8, or q) as an exact bfloat16
// tile (pairs of inputs side by side, AMX's layout), multiplied by the rows' three exact bfloat16 pieces
// (hi + mid + lo = the float32 row), float32 sums in the tile; then out += s * sum + z * (sum of the
// row's inputs in the group). A row's arithmetic does not depend on how many rows share the tile.

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0 the sums (R rows of 16 floats), 1 the weights (G/2 pairs of inputs by 16 outputs), 2.. the pieces
// (R rows of G bfloat16 inputs).
__attribute__((target("amx-tile"))) void configure_tiles(int64_t R, int64_t G) {
  TileConfig c{};
  c.palette_id = 1;
  c.rows[0] = uint8_t(R);
  c.colsb[0] = 64;
  c.rows[1] = uint8_t(G / 2);
  c.colsb[1] = 64;
  for (int p = 0; p < kPieces; ++p) {
    c.rows[2 + p] = uint8_t(R);
    c.colsb[2 + p] = uint16_t(G * 2);
  }
  asm volatile("" : : "r"(&c) : "memory");  // GCC does not see ldtilecfg read c: keep its stores
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

bool amx_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool has = (d & (1u << 22)) && (d & (1u << 24)) && (b & (1u << 16)) && (b & (1u << 30));
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: ask for AMX state
    return has && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// One group's weights of a block as AMX's weight tile: the integers (q - 8, or q) as exact bfloat16, pairs of
// inputs side by side; and the group's scales s and zeros z of the block's 16 outputs.
template <int BITS, int G>
__attribute__((target("avx512f,avx512bw"))) inline void group_tile(const Args& a, int64_t blk, int64_t g,
                                                                   int32_t (*tile_w)[kBlock], __m512* s, __m512* z) {
  constexpr int PER = kPer<BITS>;
  constexpr int DWG = kDwordsPerGroup<BITS, G>;
  const int64_t groups = a.K / G;
  const int64_t dwords = groups * DWG;
  const __m512 lut5_lo = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512 lut5_hi = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // bfloat16 of -8..7 (the table repeats: vpermw reads 5 bits of each index, our words are 0..15)
  const __m512i lut16 = _mm512_set_epi16(
      0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, int16_t(0xBF80), int16_t(0xC000),
      int16_t(0xC040), int16_t(0xC080), int16_t(0xC0A0), int16_t(0xC0C0), int16_t(0xC0E0), int16_t(0xC100),
      0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, int16_t(0xBF80), int16_t(0xC000),
      int16_t(0xC040), int16_t(0xC080), int16_t(0xC0A0), int16_t(0xC0C0), int16_t(0xC0E0), int16_t(0xC100));
  const __m512i high_half = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const uint16_t* sg = a.sz + (blk * groups + g) * 2 * kBlock;
  *s = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg))), 16));
  *z = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + kBlock))), 16));
#pragma GCC unroll 8
  for (int d = 0; d < DWG; ++d) {
    const __m512i v = _mm512_loadu_si512(a.w + (blk * dwords + g * DWG + d) * kBlock);
    if constexpr (BITS == 4) {
      // byte b of each lane holds inputs 2p (low nibble) and 2p+1 (high), p = 4d + b: spread them into
      // the lane's two 16-bit words and look both up as the bfloat16 of q - 8
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512i t = b == 0 ? v : _mm512_srli_epi32(v, 8 * b);
        // low word: t (the permute reads its low 5 bits: the low nibble and a bit choosing the table's
        // repeat); high word: t << 12 (its low 5 bits: the high nibble and again a repeat bit)
        const __m512i words = _mm512_ternarylogic_epi32(_mm512_slli_epi32(t, 12), t, high_half, 0xE4);
        _mm512_store_si512(tile_w[d * 4 + b], _mm512_permutexvar_epi16(words, lut16));
      }
    } else {
#pragma GCC unroll 2
      for (int i = 0; i < PER; i += 2) {
        if (d * PER + i >= G) break;  // int5's last dword of a group holds 2
        __m512 q[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const int e = i + h;
          if constexpr (BITS == 5) {
            q[h] = _mm512_permutex2var_ps(lut5_lo, e == 0 ? v : _mm512_srli_epi32(v, 5 * e), lut5_hi);
          } else {
            const __m512i t = e == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * e);
            q[h] = _mm512_cvtepi32_ps(_mm512_srai_epi32(t, 24));
          }
        }
        // small integers: their bfloat16 is the float32's high half, exactly; input 2p low, 2p+1 high
        const __m512i pair = _mm512_ternarylogic_epi32(_mm512_castps_si512(q[1]),
                                                       _mm512_srli_epi32(_mm512_castps_si512(q[0]), 16),
                                                       high_half, 0xE4);
        _mm512_store_si512(tile_w[(d * PER + i) / 2], pair);
      }
    }
  }
}

// Chunks of rows from `first` (`chunks` of `per` rows; only those below `rows` are written out): each group's
// weight tile is unpacked once and applied to every chunk in turn. With one chunk this is block_amx; with many
// (a prompt chunk, from mm, `total` then scratch of chunks * 16 * 16 floats) the rows are padded with zero
// rows to whole chunks of 16 and `first` walks sets of chunks whose pieces stay in L2. A row's arithmetic is
// the same either way.
template <int BITS, int G>
__attribute__((target("avx512f,avx512bw,amx-tile,amx-bf16"))) void block_amx_rows(const Args& a, int64_t blk,
                                                                                    int64_t first, int64_t chunks,
                                                                                    int64_t per, int64_t rows,
                                                                                    float* total = nullptr) {
  const int64_t groups = a.K / G;
  alignas(64) int32_t tile_w[16][kBlock];
  alignas(64) float sums[kMaxChunk][kBlock];
  alignas(64) float local[kMaxChunk][kBlock];
  float* totals = total != nullptr ? total : &local[0][0];
  for (int64_t r = 0; r < chunks * per; ++r) _mm512_store_ps(totals + r * kBlock, _mm512_setzero_ps());
  const int64_t piece_stride = a.B * a.K;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 s, z;
    group_tile<BITS, G>(a, blk, g, tile_w, &s, &z);
    asm volatile("" : : : "memory");  // GCC 12's tile intrinsics are asm without a memory clobber
    _tile_loadd(1, tile_w, 64);
    for (int64_t c = 0; c < chunks; ++c) {
      const uint16_t* xp = a.xp + (first + c * per) * a.K;
      _tile_zero(0);
      _tile_loadd(2, xp + g * G, a.K * 2);
      _tile_dpbf16ps(0, 2, 1);
      _tile_loadd(3, xp + piece_stride + g * G, a.K * 2);
      _tile_dpbf16ps(0, 3, 1);
      _tile_loadd(4, xp + 2 * piece_stride + g * G, a.K * 2);
      _tile_dpbf16ps(0, 4, 1);
      _tile_stored(0, sums, 64);
      asm volatile("" : : : "memory");
      float* chunk_total = totals + c * per * kBlock;
      const float* chunk_sums = a.xsum + (first + c * per) * groups + g;
      for (int64_t r = 0; r < per; ++r) {
        const __m512 with_zero = _mm512_fmadd_ps(z, _mm512_set1_ps(chunk_sums[r * groups]),
                                                 _mm512_load_ps(chunk_total + r * kBlock));
        _mm512_store_ps(chunk_total + r * kBlock, _mm512_fmadd_ps(s, _mm512_load_ps(sums[r]), with_zero));
      }
    }
  }
  for (int64_t r = 0; r < chunks * per && first + r < rows; ++r)
    _mm512_storeu_ps(a.out + (first + r) * a.ldo + blk * kBlock, _mm512_load_ps(totals + r * kBlock));
}

// R rows (at most 16) from row0: each group's tile times the rows' three pieces, then the group's scaling.
template <int BITS, int G>
__attribute__((target("avx512f,avx512bw,amx-tile,amx-bf16"))) void block_amx(const Args& a, int64_t blk,
                                                                               int64_t row0, int64_t R) {
  block_amx_rows<BITS, G>(a, blk, row0, 1, R, row0 + R);
}

template <int BITS, int G>
void rows_amx(const Args& a, int64_t blk, int64_t nb, int64_t row0, int64_t n) {
  for (int64_t b = 0; b < nb; ++b) block_amx<BITS, G>(a, blk + b, row0, n);
}

// Each row as kPieces bfloat16 pieces that add up to it exactly (hi = RNE(x), mid = RNE(x - hi), lo = the
// rest), and its sum over each group (in input order).
void split_rows(const float* x, int64_t ldx, int64_t B, int64_t K, int64_t G, uint16_t* pieces, float* xsum,
                int64_t padded) {
  auto bf16 = [](float f) -> uint16_t {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  };
  auto widen = [](uint16_t h) -> float {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  for (int64_t r = 0; r < B; ++r) {
    for (int64_t k = 0; pieces != nullptr && k < K; ++k) {
      float rest = x[r * ldx + k];
      for (int p = 0; p < kPieces; ++p) {
        const uint16_t h = bf16(rest);
        pieces[(p * padded + r) * K + k] = h;
        rest -= widen(h);
      }
    }
    for (int64_t g = 0; g < K / G; ++g) {
      float sum = 0.f;
      for (int64_t k = 0; k < G; ++k) sum += x[r * ldx + g * G + k];
      xsum[r * (K / G) + g] = sum;
    }
  }
}

// ----------------------------------------------------------------------------- dispatch

int64_t best_isa() {
  __builtin_cpu_init();
  if (amx_ready()) return kAmx;
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kGeneric;
}

using RowsFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t);

template <int BITS, int G>
RowsFn rows_fn(int64_t isa) {
  switch (isa) {
    case kAmx:
      return rows_amx<BITS, G>;
    case kAvx512:
      return rows_avx512<BITS, G>;
    case kAvx2:
      return rows_avx2<BITS, G>;
    default:
      return rows_generic<BITS, G>;
  }
}

RowsFn pick_rows_fn(int64_t bits, int64_t G, int64_t isa) {
  if (bits == 5) return rows_fn<5, kGroup>(isa);  // GGUF's 5-bit types: groups of 32 only (mm checks)
  if (G == kGroup) return bits == 4 ? rows_fn<4, kGroup>(isa) : rows_fn<8, kGroup>(isa);
  return bits == 4 ? rows_fn<4, kSmallGroup>(isa) : rows_fn<8, kSmallGroup>(isa);
}

using ManyFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t, int64_t, float*);

ManyFn pick_many_fn(int64_t bits, int64_t G) {
  if (bits == 5) return block_amx_rows<5, kGroup>;
  if (G == kGroup) return bits == 4 ? block_amx_rows<4, kGroup> : block_amx_rows<8, kGroup>;
  return bits == 4 ? block_amx_rows<4, kSmallGroup> : block_amx_rows<8, kSmallGroup>;
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits,
              int64_t isa) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "meshnet_quant.mm: bits must be 4, 5 or 8, not ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "meshnet_quant.mm: x must be float32 [B, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.size(2) == kBlock &&
                  packed.is_contiguous(),
              "meshnet_quant.mm: packed must be contiguous int32 [N/16, dwords, 16]");
  const int64_t K = x.size(1), B = x.size(0), blocks = packed.size(0), N = blocks * kBlock;
  const int64_t dwords_per_32 = bits == 5 ? kDwordsPerGroup<5, kGroup> : bits;  // dwords a row takes for 32 inputs
  TORCH_CHECK(K % kGroup == 0 && packed.size(1) * kGroup == K * dwords_per_32,
              "meshnet_quant.mm: x has ", K, " inputs, the packed matrix ", packed.size(1) * kGroup / dwords_per_32);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == blocks && scales.size(1) > 0 &&
                  (K == scales.size(1) * kGroup || K == scales.size(1) * kSmallGroup) && scales.size(2) == 2 &&
                  scales.size(3) == kBlock,
              "meshnet_quant.mm: scales must be contiguous bfloat16 [N/16, K/G, 2, 16], G 32 or 16");
  const int64_t G = K / scales.size(1);
  TORCH_CHECK(bits != 5 || G == kGroup, "meshnet_quant.mm: 5-bit integers come in groups of ", kGroup);
  const int64_t best = best_isa();
  if (isa == kAuto) isa = best == kAmx && B < kAmxMinRows ? kAvx512 : best;
  TORCH_CHECK(isa >= kGeneric && isa <= best, "meshnet_quant.mm: instruction set ", isa,
              " is not available here (best ", best, ")");
  const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({B, N}, x.options());
  if (B == 0) return out;
  Args a{rows.data_ptr<float>(), rows.stride(0), packed.data_ptr<int32_t>(),
         reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()), K, out.data_ptr<float>(), N};
  at::Tensor pieces, sums;
  // More rows than one pass keeps: on AMX, every group's weight tile serves every 16-row chunk
  // (block_amx_rows), the rows padded with zeros to whole chunks.
  const bool many = isa == kAmx && B > kMaxChunk;
  const int64_t padded = many ? (B + kMaxChunk - 1) / kMaxChunk * kMaxChunk : B;
  if (isa == kAmx || isa == kAvx512) {
    sums = at::empty({padded, K / G}, x.options());
    if (isa == kAmx) pieces = at::empty({kPieces, padded, K}, x.options().dtype(at::kShort));
    uint16_t* piece_data = isa == kAmx ? reinterpret_cast<uint16_t*>(pieces.data_ptr<int16_t>()) : nullptr;
    split_rows(a.x, a.ldx, B, K, G, piece_data, sums.data_ptr<float>(), padded);
    if (padded > B) {  // the padding rows are zero (only they: zeroing every piece cost 5% of a prompt's step)
      for (int p = 0; p < kPieces; ++p)
        std::memset(piece_data + (p * padded + B) * K, 0, static_cast<size_t>((padded - B) * K) * sizeof(uint16_t));
      std::memset(sums.data_ptr<float>() + B * (K / G), 0,
                  static_cast<size_t>((padded - B) * (K / G)) * sizeof(float));
    }
    a.xp = isa == kAmx ? reinterpret_cast<const uint16_t*>(pieces.data_ptr<int16_t>()) : nullptr;
    a.B = padded;
    a.xsum = sums.data_ptr<float>();
  }
  if (many) {
    // Rows in sets whose pieces stay in a core's L2 while every block of outputs passes over them (else
    // each block streams all the pieces from memory again: 2.4 MB for 256 rows of K = 1536).
    const int64_t set_chunks = std::max<int64_t>(1, kPiecesBudget / (kPieces * K * 2 * kMaxChunk));
    const int64_t grain_many = std::max<int64_t>(1, kGrainWork / (kBlock * K * padded));
    const ManyFn many_fn = pick_many_fn(bits, G);
    at::parallel_for(0, blocks, grain_many, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(static_cast<size_t>(set_chunks * kMaxChunk * kBlock) + 16);
      float* total = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
      configure_tiles(kMaxChunk, G);
      for (int64_t first = 0; first < padded; first += set_chunks * kMaxChunk) {
        const int64_t chunks = std::min(set_chunks, (padded - first) / kMaxChunk);
        for (int64_t blk = begin; blk < end; ++blk) many_fn(a, blk, first, chunks, kMaxChunk, B, total);
      }
      release_tiles();
    });
    return out;
  }
  const RowsFn fn = pick_rows_fn(bits, G, isa);
  const int64_t grain = std::max<int64_t>(1, kGrainWork / (kBlock * K * std::min(B, kMaxChunk)));
  const int64_t step = isa == kAvx512 ? blocks_per_pass(B) : 1;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    int64_t configured = 0;
    for (int64_t blk = begin; blk < end;) {
      const int64_t nb = blk + step <= end ? step : 1;
      for (int64_t row0 = 0; row0 < B; row0 += kMaxChunk) {
        const int64_t n = std::min(kMaxChunk, B - row0);
        if (isa == kAmx && n != configured) {  // each thread its own tile shapes
          configure_tiles(n, G);
          configured = n;
        }
        fn(a, blk, nb, row0, n);
      }
      blk += nb;
    }
    if (configured) release_tiles();
  });
  return out;
}

}  // namespace

// The process's product (decode_rows.cpp's, and mm's by default): int8 rows (q8_mm.cpp) where the node chose
// int8 activations, else float32 rows on instruction set `isa`.
at::Tensor meshnet::quant_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits,
                             int64_t isa) {
  if (meshnet::int8_activations()) return meshnet::quant_mm_q8(x, packed, scales, bits, 0);
  return mm(x, packed, scales, bits, isa);
}

namespace {

// `act`: 0 float32 rows, 1 int8 rows (q8_mm.cpp, its own choice of instruction set), -1 the process's mode.
at::Tensor mm_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits, int64_t isa,
                 int64_t act) {
  TORCH_CHECK(act >= -1 && act <= 1, "meshnet_quant.mm: act must be -1, 0 or 1, not ", act);
  if (act == 1 || (act == -1 && meshnet::int8_activations())) return meshnet::quant_mm_q8(x, packed, scales, bits, 0);
  return mm(x, packed, scales, bits, isa);
}

}  // namespace

TORCH_LIBRARY(meshnet_quant, m) {
  m.def("mm(Tensor x, Tensor packed, Tensor scales, int bits, int isa=0, int act=-1) -> Tensor");
  m.def("best_isa() -> int", &best_isa);
}

TORCH_LIBRARY_IMPL(meshnet_quant, CPU, m) { m.impl("mm", mm_op); }
