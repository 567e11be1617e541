// Skinny-matrix products for decode steps on CPUs with AVX-512 (F, BW, VL) and AVX512-BF16: y = x · Wᵀ for a few
// rows of activations against a whole weight, bfloat16 or unsigned INT8/INT4 with a float32 scale and bias per group
// of input columns (w = u · scale + bias), in one blocked layout the weight is repacked into once at load
// (kernels/cpu_gemv.py packs it):
//
// The weight's output rows go in blocks of 16; each block is one run of 64-byte vectors over the input columns (an INT
// group's vectors followed by a vector of its 16 rows' scales and one of their biases), and in every vector the 16-bit
// lane pair (2j, 2j+1) belongs to output row j. One activation column pair, broadcast to all lanes, meets a vector in
// one _mm512_dpbf16_ps: lane j adds its row's two products, so the sums hold 16 outputs (no horizontal sums) and each
// block is one stream the hardware prefetcher follows (software prefetching measured slower).
//
//   bf16: a vector holds 2 columns (k, k+1) of its 16 rows.
//   INT4: 8 columns; the word of lane (j, p) holds the nibbles of columns 2i + p, i = 0..3 (nibble i at bits 4i).
//   INT8: 4 columns; the word of lane (j, p) holds the bytes of columns 2i + p, i = 0, 1 (byte i at bits 8i).
//
// INT values become bfloat16 exactly, so every product is exact in float32: a nibble indexes a table of the 16 values
// it can take (one permute per 32 weights); a byte, below 8 rows, is its low nibble plus 16 times its high one (two
// permutes into two products), from 8 rows on converted whole once per chunk (through float32, whose upper half is
// then the bfloat16). The group's scale and bias apply once per group: y = scale · Σ u·x + bias · Σ x.
//
// A decode step reads every weight once and does little arithmetic: at one row its limit is memory bandwidth, so 8
// blocks stream at once (8 independent sums); at more rows the products bound it, and a chunk of columns of 4 blocks
// stays in L1 while every row block (6 rows: 24 sums) reads it. Activations are rounded to bfloat16 (exact for a
// bfloat16 model's); float32 ones (`exact`) are split into three bfloat16 parts that sum to them exactly, each its own
// row.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum class Form { kBf16, kInt8, kInt4 };

template <Form F>
constexpr int kCols = F == Form::kBf16 ? 2 : F == Form::kInt8 ? 4 : 8;  // input columns per vector
template <Form F>
constexpr int kPlanes = F == Form::kBf16 ? 1 : 4;  // bfloat16 vectors a weight vector unpacks into

// Block b is groups runs of group_vecs weight vectors, each INT run followed by its 16 rows' scales and biases (a
// vector each): one stream per block.
struct Blocked {
  const uint8_t* data;
  int64_t groups;
  int64_t group_vecs;  // weight vectors per group
  int64_t run_vecs;    // vectors per group in memory: group_vecs, and 2 more (scales, biases) for INT

  const uint8_t* group(int64_t block, int64_t g) const { return data + (block * groups + g) * run_vecs * 64; }
};

// Plane i of an INT weight vector as bfloat16: nibble i of every lane (INT4), or of INT8 bytes the low (i even) and
// high (i odd, worth 16) nibbles of byte i / 2. It meets activation column pair pair_of(i) of the vector.
template <Form F>
inline __m512bh plane(__m512i wv, int i, __m512i nibbles, __m512i sixteens) {
  const __m512i idx = i == 0 ? wv : _mm512_srli_epi16(wv, 4 * i);  // a permute reads each lane's low 5 bits only
  return (__m512bh)_mm512_permutexvar_epi16(idx, F == Form::kInt8 && i % 2 ? sixteens : nibbles);
}

// INT8 plane i (i = 0, 1) with whole bytes: lane (j, p)'s word is byte i of its word, exact in bfloat16 (a byte
// converted to float32 has 16 zero low bits, so its upper half is the bfloat16).
inline __m512bh byte_plane(__m512i wv, int i) {
  const __m512i mask = _mm512_set1_epi32(0xFF), upper = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i even = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(wv, 8 * i), mask)));
  const __m512i odd =
      _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(wv, 16 + 8 * i), mask)));
  return (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(even, 16), odd, upper, 0xF8);  // a | (b & c)
}

template <Form F>
constexpr int pair_of(int i) {
  return F == Form::kInt4 ? i : i / 2;
}

inline __m512i load(const uint8_t* run, int64_t v) { return _mm512_load_si512(run + v * 64); }

inline int32_t pair_bits(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return v;
}

// The 32 bfloat16 values of bf16(t & 15) and bf16(16 · (t & 15)), t = 0..31: a nibble's value and a byte's high
// nibble's (the low 5 bits of a lane index a permute, so the tables repeat).
inline __m512i nibble_table() {
  return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                          0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                          0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
}
inline __m512i sixteens_table() {
  return _mm512_set_epi16(0x4370, 0x4360, 0x4350, 0x4340, 0x4330, 0x4320, 0x4310, 0x4300, 0x42E0, 0x42C0, 0x42A0,
                          0x4280, 0x4240, 0x4200, 0x4180, 0x0000, 0x4370, 0x4360, 0x4350, 0x4340, 0x4330, 0x4320,
                          0x4310, 0x4300, 0x42E0, 0x42C0, 0x42A0, 0x4280, 0x4240, 0x4200, 0x4180, 0x0000);
}

// acc[m][j] += NB runs of bfloat16 vectors [0, n) (vector v meets activation column pair v: x2[m * ldx + 2 v]) for MB
// rows: the product loop every form ends in.
template <int MB, int NB>
inline void bf16_rows(const uint8_t* const* run, int64_t n, const uint16_t* x2, int64_t ldx, __m512 (&acc)[MB][NB]) {
  for (int64_t v = 0; v < n; ++v) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load(run[j], v);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair_bits(x2 + m * ldx + 2 * v));
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)wv[j], xv);
    }
  }
}

// acc[m][j] += NB runs of INT vectors [0, n), each unpacked in registers into its bfloat16 planes (one row: the
// weight streams from memory and nothing is worth keeping).
template <Form F, int MB, int NB>
inline void int_rows(const uint8_t* const* run, int64_t n, const uint16_t* x, int64_t ldx, __m512 (&acc)[MB][NB]) {
  const __m512i nibbles = nibble_table(), sixteens = sixteens_table();
  for (int64_t v = 0; v < n; ++v) {
    const uint16_t* xv = x + v * kCols<F>;
#pragma GCC unroll 4
    for (int i = 0; i < kPlanes<F>; ++i) {
      __m512bh p[NB];
      for (int j = 0; j < NB; ++j) p[j] = plane<F>(load(run[j], v), i, nibbles, sixteens);
      for (int m = 0; m < MB; ++m) {
        const __m512bh x2 = (__m512bh)_mm512_set1_epi32(pair_bits(xv + m * ldx + 2 * pair_of<F>(i)));
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], p[j], x2);
      }
    }
  }
}

// INT8 vectors [0, n) of one run unpacked into whole-byte bfloat16 vectors, in column-pair order (the bf16 form's
// layout).
inline void unpack_bytes(const uint8_t* run, int64_t n, uint8_t* out) {
  for (int64_t v = 0; v < n; ++v)
    for (int i = 0; i < 2; ++i) _mm512_store_si512(out + (2 * v + i) * 64, (__m512i)byte_plane(load(run, v), i));
}

constexpr int64_t kChunkCols = 128;  // columns of NB blocks' weights kept in L1 while every row block reads them
// From this many rows an INT8 chunk is unpacked once into whole-byte bfloat16 vectors for all of them (one product
// per weight instead of two); INT4's nibble planes cost less to unpack in registers than to read back (measured).
constexpr int64_t kUnpackRows = 8;
constexpr int64_t kSlabRows = 48;  // activation rows whose sums stay in L1 while a unit of blocks streams past them

// Every row's products with group g's vectors [v0, v1) of NB blocks, MB rows at a time: acc_mem (M, NB, 16) +=.
// Enough rows of an INT8 weight unpack the chunk once into `buffer` (bfloat16 vectors, read by every row block).
template <Form F, int MB, int NB>
void chunk(const Blocked& w, int64_t b0, int64_t g, int64_t v0, int64_t v1, const uint16_t* xb, int64_t ldx,
           int64_t M, float* acc_mem, uint8_t* buffer) {
  const uint8_t* run[NB];
  for (int j = 0; j < NB; ++j) run[j] = w.group(b0 + j, g) + v0 * 64;
  const int64_t n = v1 - v0;
  const uint16_t* x = xb + (g * w.group_vecs + v0) * kCols<F>;
  const bool unpacked = F == Form::kInt8 && M >= kUnpackRows;
  if (unpacked)
    for (int j = 0; j < NB; ++j) {
      unpack_bytes(run[j], n, buffer + j * n * 2 * 64);
      run[j] = buffer + j * n * 2 * 64;
    }
  auto rows = [&](int64_t m0, auto mb) {
    constexpr int R = decltype(mb)::value;
    __m512 acc[R][NB];
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_loadu_ps(acc_mem + ((m0 + m) * NB + j) * 16);
    if (F == Form::kBf16 || unpacked)
      bf16_rows<R, NB>(run, unpacked ? 2 * n : n, x + m0 * ldx, ldx, acc);
    else
      int_rows<F, R, NB>(run, n, x + m0 * ldx, ldx, acc);
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < NB; ++j) _mm512_storeu_ps(acc_mem + ((m0 + m) * NB + j) * 16, acc[m][j]);
  };
  int64_t m0 = 0;
  for (; m0 + MB <= M; m0 += MB) rows(m0, std::integral_constant<int, MB>{});
  for (; m0 + 2 <= M; m0 += 2) rows(m0, std::integral_constant<int, 2>{});
  for (; m0 < M; ++m0) rows(m0, std::integral_constant<int, 1>{});
}

// y[:, 16 b0 : 16 (b0 + NB)] for M rows (at most kSlabRows): group by group, chunk by chunk, every row per chunk; at
// a group's end its sums take the group's scales and biases (INT).
template <Form F, int NB>
void slab(const Blocked& w, int64_t b0, const uint16_t* xb, int64_t ldx, const float* sx, int64_t M, float* y,
          int64_t N) {
  constexpr int MB = NB >= 8 ? 1 : 6;  // 6 rows x 4 blocks: 24 sums (1 block: the last few)
  const int64_t chunk_vecs = std::min<int64_t>(w.group_vecs, kChunkCols / kCols<F>);
  alignas(64) float acc[kSlabRows * NB * 16], out[kSlabRows * NB * 16];
  alignas(64) uint8_t buffer[NB * (kChunkCols / 2) * 64];  // an INT8 chunk of NB blocks as bfloat16 vectors
  std::fill(out, out + M * NB * 16, 0.0f);
  for (int64_t g = 0; g < w.groups; ++g) {
    std::fill(acc, acc + M * NB * 16, 0.0f);
    for (int64_t v0 = 0; v0 < w.group_vecs; v0 += chunk_vecs)
      chunk<F, MB, NB>(w, b0, g, v0, std::min(w.group_vecs, v0 + chunk_vecs), xb, ldx, M, acc, buffer);
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < NB; ++j) {
        float* o = out + (m * NB + j) * 16;
        const __m512 sums = _mm512_load_ps(acc + (m * NB + j) * 16);
        if (F == Form::kBf16) {
          _mm512_store_ps(o, _mm512_add_ps(_mm512_load_ps(o), sums));
          continue;
        }
        const float* scales = reinterpret_cast<const float*>(w.group(b0 + j, g) + w.group_vecs * 64);
        const __m512 v = _mm512_fmadd_ps(_mm512_load_ps(scales + 16), _mm512_set1_ps(sx[m * w.groups + g]),
                                         _mm512_load_ps(o));  // the biases follow the scales
        _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(scales), sums, v));
      }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) {
      const int64_t n0 = (b0 + j) * 16;
      const __mmask16 tail = N - n0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
      _mm512_mask_storeu_ps(y + m * N + n0, tail, _mm512_load_ps(out + (m * NB + j) * 16));
    }
}

// y[:, 16 b0 : 16 (b0 + NB)] for all M rows, a slab of rows at a time (the NB blocks' weights stay in L2 meanwhile).
template <Form F, int NB>
void unit(const Blocked& w, int64_t b0, const uint16_t* xb, int64_t ldx, const float* sx, int64_t M, float* y,
          int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += kSlabRows)
    slab<F, NB>(w, b0, xb + m0 * ldx, ldx, sx + m0 * w.groups, std::min(kSlabRows, M - m0), y + m0 * N, N);
}

// 16 values (masked) from element `at` of a float32 array, or of a bfloat16 one with `bf16`, as float32.
inline __m512 load16(const void* data, bool bf16, int64_t at, __mmask16 mask) {
  if (!bf16) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(data) + at);
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(data) + at);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <Form F>
void blocked_all(const Blocked& w, int64_t blocks, const uint16_t* xb, int64_t ldx, const float* sx, int64_t M,
                 float* y, int64_t N) {
  // one row: 8 blocks' streams at once (8 independent sums); more rows: 4 blocks against 6 rows (24 sums)
  const int64_t nb = M == 1 ? 8 : 4;
  const int64_t units = (blocks + nb - 1) / nb;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b0 = u * nb;
      if (b0 + nb <= blocks) {
        if (nb == 8)
          unit<F, 8>(w, b0, xb, ldx, sx, M, y, N);
        else
          unit<F, 4>(w, b0, xb, ldx, sx, M, y, N);
      } else {
        for (int64_t b = b0; b < blocks; ++b) unit<F, 1>(w, b, xb, ldx, sx, M, y, N);
      }
    }
  });
}

}  // namespace

// A plain C entry point on contiguous buffers (kernels/cpu_gemv.py checks shapes and dtypes).
extern "C" {

// y (M, N) = x (M, K) · Wᵀ (+ bias) for W in the blocked layout (`bits` 16: bfloat16, 8 or 4: INT in groups of
// group_size columns, each group's vectors followed by its scales and biases). x and y are float32, or bfloat16 bits
// with `bf16` (a bfloat16 model's: no conversions around the call); bias (N) likewise, or null, added to the float32
// sums before y's one rounding. float32 x is rounded to bfloat16, or with `exact` split into three bfloat16 parts that
// sum to it exactly (a float32 model's activations), each its own product.
void loraplex_gemv_blocked(const void* x, int64_t M, int64_t K, const uint8_t* wdata, int64_t N, int64_t group_size,
                           int64_t bits, int64_t exact, int64_t bf16, const void* bias, void* y) {
  const int cols = bits == 16 ? 2 : bits == 8 ? 4 : 8;
  const int64_t kp = (K + cols - 1) / cols * cols, blocks = (N + 15) / 16;
  const int64_t parts = exact && !bf16 ? 3 : 1, R = M * parts, ldx = kp;
  const int64_t gs = bits == 16 || group_size >= K ? kp : group_size;
  const int64_t groups = kp / gs;
  std::vector<uint16_t> xb(R * ldx, 0);
  std::vector<float> sx(R * groups, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    __m512 group_sums[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 16) {  // gs is a multiple of 16 or the whole row
      const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      __m512 rest = load16(x, bf16, m * K + k, mask);
      for (int64_t p = 0; p < parts; ++p) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(rest);  // exact for bfloat16 x
        const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm256_mask_storeu_epi16(xb.data() + (m * parts + p) * ldx + k, mask, h);
        group_sums[p] = _mm512_add_ps(group_sums[p], hf);
        rest = _mm512_sub_ps(rest, hf);
      }
      if ((k + 16) % gs == 0 || k + 16 >= K)
        for (int64_t p = 0; p < parts; ++p) {
          sx[(m * parts + p) * groups + k / gs] = _mm512_reduce_add_ps(group_sums[p]);
          group_sums[p] = _mm512_setzero_ps();
        }
    }
  }
  const Blocked w{wdata, groups, gs / cols, gs / cols + (bits == 16 ? 0 : 2)};
  const bool direct = parts == 1 && !bf16 && bias == nullptr;  // the kernel's float32 sums are y
  std::vector<float> sums(direct ? 0 : R * N);
  float* out = direct ? static_cast<float*>(y) : sums.data();
  if (bits == 16)
    blocked_all<Form::kBf16>(w, blocks, xb.data(), ldx, sx.data(), R, out, N);
  else if (bits == 8)
    blocked_all<Form::kInt8>(w, blocks, xb.data(), ldx, sx.data(), R, out, N);
  else
    blocked_all<Form::kInt4>(w, blocks, xb.data(), ldx, sx.data(), R, out, N);
  if (direct) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 mask = N - n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - n)) - 1);
      const float* part = sums.data() + m * parts * N + n;
      __m512 v = _mm512_maskz_loadu_ps(mask, part);
      for (int64_t p = 1; p < parts; ++p) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, part + p * N));
      if (bias != nullptr) v = _mm512_add_ps(v, load16(bias, bf16, n, mask));
      if (bf16)
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + m * N + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
      else
        _mm512_mask_storeu_ps(static_cast<float*>(y) + m * N + n, mask, v);
    }
}

}  // extern "C"
