// Skinny-matrix products for decode steps on CPUs with AVX-512 (F, BW, VL) and AVX512-BF16: y = x · Wᵀ for a few
// rows of activations against a whole weight, bfloat16 or unsigned INT8/INT4 with a float32 scale and bias per group
// of input columns (w = u · scale + bias), in one blocked layout the weight is repacked into once at load
// (kernels/cpu_gemv.py packs it):
//
// The weight's output rows go in blocks of 16; each block is one run of 64-byte vectors over the input columns, and in
// every vector the 16-bit lane pair (2j, 2j+1) belongs to output row j. One activation column pair, broadcast to all
// lanes, meets a vector in one _mm512_dpbf16_ps: lane j adds its row's two products, so the sums hold 16 outputs
// (no horizontal sums) and each block is one long stream the hardware prefetcher follows.
//
//   bf16: a vector holds 2 columns (k, k+1) of its 16 rows.
//   INT4: 8 columns; the word of lane (j, p) holds the nibbles of columns 2i + p, i = 0..3 (nibble i at bits 4i).
//   INT8: 4 columns; the word of lane (j, p) holds the bytes of columns 2i + p, i = 0, 1 (byte i at bits 8i).
//
// INT values become bfloat16 exactly, so every product is exact in float32: a nibble indexes a table of the 16 values
// it can take (one permute per 32 weights); a byte, at one or two rows, is its low nibble plus 16 times its high one
// (two permutes into two products), from four rows on the byte converted whole (through float32, whose upper half is
// then the bfloat16). The group's scale and bias apply once per group: y = scale · Σ u·x + bias · Σ x.
//
// A decode step reads every weight once and does little arithmetic: at one row its limit is memory bandwidth, so 8
// blocks stream at once (8 independent sums); at more rows the products bound it, and a chunk of columns of 2-4 blocks
// stays in L1 while every row block reads it. Activations are rounded to bfloat16 (exact for a bfloat16 model's);
// float32 ones (`exact`) are split into three bfloat16 parts that sum to them exactly, each its own row.

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

struct Blocked {
  const uint8_t* data;  // block b, vector v at data + (b * vecs + v) * 64
  int64_t vecs;         // vectors per block
  const float* scales;  // (blocks, groups, 16), INT only
  const float* biases;
  int64_t groups;
  int64_t group_vecs;  // vectors per group
};

// Plane i of an INT weight vector as bfloat16, and the activation column pair (counted in pairs from the vector's
// first column) it meets.
template <Form F>
inline __m512bh plane(__m512i wv, int i, __m512i nibbles, __m512i sixteens) {
  if (F == Form::kInt4) {
    const __m512i idx = i == 0 ? wv : _mm512_srli_epi16(wv, 4 * i);
    return (__m512bh)_mm512_permutexvar_epi16(idx, nibbles);  // the low 5 bits index: the table repeats
  }
  const __m512i idx = i == 0 ? wv : _mm512_srli_epi16(wv, 4 * i);
  return (__m512bh)_mm512_permutexvar_epi16(idx, i % 2 ? sixteens : nibbles);
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

inline __m512i load(const Blocked& w, int64_t block, int64_t v) {
  return _mm512_load_si512(w.data + (block * w.vecs + v) * 64);
}

inline int32_t pair_bits(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return v;
}

// One column chunk of NB blocks against MB activation rows: acc[m][j] += the chunk's products (vectors [v0, v1)).
template <Form F, int MB, int NB>
inline void chunk(const Blocked& w, int64_t b0, int64_t v0, int64_t v1, const uint16_t* xb, int64_t ldx, int64_t m0,
                  float* acc_mem) {
  const __m512i nibbles = _mm512_set_epi16(  // bf16(t & 15) for t = 31..0
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000,
      0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
      0x4040, 0x4000, 0x3F80, 0x0000);
  const __m512i sixteens = _mm512_set_epi16(  // bf16(16 · (t & 15))
      0x4370, 0x4360, 0x4350, 0x4340, 0x4330, 0x4320, 0x4310, 0x4300, 0x42E0, 0x42C0, 0x42A0, 0x4280, 0x4240, 0x4200,
      0x4180, 0x0000, 0x4370, 0x4360, 0x4350, 0x4340, 0x4330, 0x4320, 0x4310, 0x4300, 0x42E0, 0x42C0, 0x42A0, 0x4280,
      0x4240, 0x4200, 0x4180, 0x0000);
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_loadu_ps(acc_mem + ((m0 + m) * NB + j) * 16);
  for (int64_t v = v0; v < v1; ++v) {
    const uint16_t* xv = xb + m0 * ldx + v * kCols<F>;
    if (F == Form::kBf16) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = load(w, b0 + j, v);
      for (int m = 0; m < MB; ++m) {
        const __m512bh x2 = (__m512bh)_mm512_set1_epi32(pair_bits(xv + m * ldx));
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)wv[j], x2);
      }
      continue;
    }
    if (F == Form::kInt8 && MB >= 4) {  // whole bytes: half the products of nibble planes
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        __m512bh p[NB];
        for (int j = 0; j < NB; ++j) p[j] = byte_plane(load(w, b0 + j, v), i);
        for (int m = 0; m < MB; ++m) {
          const __m512bh x2 = (__m512bh)_mm512_set1_epi32(pair_bits(xv + m * ldx + 2 * i));
          for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], p[j], x2);
        }
      }
      continue;
    }
#pragma GCC unroll 4
    for (int i = 0; i < kPlanes<F>; ++i) {
      __m512bh p[NB];
      for (int j = 0; j < NB; ++j) p[j] = plane<F>(load(w, b0 + j, v), i, nibbles, sixteens);
      for (int m = 0; m < MB; ++m) {
        const __m512bh x2 = (__m512bh)_mm512_set1_epi32(pair_bits(xv + m * ldx + 2 * pair_of<F>(i)));
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], p[j], x2);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(acc_mem + ((m0 + m) * NB + j) * 16, acc[m][j]);
}

constexpr int64_t kChunkCols = 128;  // columns of NB blocks' weights kept in L1 while every row block reads them

// y[:, 16 b0 : 16 (b0 + NB)] for all M rows: chunk by chunk, every row block per chunk.
template <Form F, int NB>
void unit(const Blocked& w, int64_t b0, const uint16_t* xb, int64_t ldx, const float* sx, int64_t M, float* y,
          int64_t N) {
  constexpr int MB = NB >= 8 ? 1 : NB >= 4 ? 6 : 8;  // 8 rows x 2 blocks, 6 x 4: 16, 24 sums
  std::vector<float> acc(M * NB * 16), out(M * NB * 16, 0.0f);
  const int64_t chunk_vecs = std::min<int64_t>(w.group_vecs, kChunkCols / kCols<F>);
  for (int64_t g = 0; g < w.groups; ++g) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const int64_t g1 = std::min(w.vecs, (g + 1) * w.group_vecs);
    for (int64_t v0 = g * w.group_vecs; v0 < g1; v0 += chunk_vecs) {
      const int64_t v1 = std::min(g1, v0 + chunk_vecs);
      int64_t m0 = 0;
      for (; m0 + MB <= M; m0 += MB) chunk<F, MB, NB>(w, b0, v0, v1, xb, ldx, m0, acc.data());
      for (; m0 + 2 <= M; m0 += 2) chunk<F, 2, NB>(w, b0, v0, v1, xb, ldx, m0, acc.data());
      for (; m0 < M; ++m0) chunk<F, 1, NB>(w, b0, v0, v1, xb, ldx, m0, acc.data());
    }
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < NB; ++j) {
        float* o = out.data() + (m * NB + j) * 16;
        const __m512 sums = _mm512_loadu_ps(acc.data() + (m * NB + j) * 16);
        if (F == Form::kBf16) {
          _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), sums));
          continue;
        }
        const int64_t at = ((b0 + j) * w.groups + g) * 16;
        __m512 v = _mm512_fmadd_ps(_mm512_load_ps(w.biases + at), _mm512_set1_ps(sx[m * w.groups + g]),
                                   _mm512_loadu_ps(o));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_load_ps(w.scales + at), sums, v));
      }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) {
      const int64_t n0 = (b0 + j) * 16;
      const __mmask16 tail = N - n0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
      _mm512_mask_storeu_ps(y + m * N + n0, tail, _mm512_loadu_ps(out.data() + (m * NB + j) * 16));
    }
}

template <Form F>
void blocked_all(const Blocked& w, int64_t blocks, const uint16_t* xb, int64_t ldx, const float* sx, int64_t M,
                 float* y, int64_t N) {
  // one row: 8 blocks' streams at once (8 independent sums); more rows: 4 blocks against 6 rows (24 sums)
  const int64_t nb = M == 1 ? 8 : F == Form::kBf16 ? 4 : 2;
  const int64_t units = (blocks + nb - 1) / nb;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b0 = u * nb;
      if (b0 + nb <= blocks) {
        if (nb == 8)
          unit<F, 8>(w, b0, xb, ldx, sx, M, y, N);
        else if (nb == 4)
          unit<F, 4>(w, b0, xb, ldx, sx, M, y, N);
        else
          unit<F, 2>(w, b0, xb, ldx, sx, M, y, N);
      } else {
        for (int64_t b = b0; b < blocks; ++b) unit<F, 1>(w, b, xb, ldx, sx, M, y, N);
      }
    }
  });
}

}  // namespace

// A plain C entry point on contiguous buffers (kernels/cpu_gemv.py checks shapes and dtypes).
extern "C" {

// y (M, N) = x (M, K) · Wᵀ for W in the blocked layout (`bits` 16: bfloat16, 8 or 4: INT with (blocks, groups, 16)
// float32 scales and biases, groups of group_size columns). x is rounded to bfloat16; with `exact`, x is instead split
// into three bfloat16 parts that sum to it exactly (a float32 model's activations), each its own product.
void loraplex_gemv_blocked(const float* x, int64_t M, int64_t K, const uint8_t* wdata, int64_t N, const float* scales,
                           const float* biases, int64_t group_size, int64_t bits, int64_t exact, float* y) {
  const int cols = bits == 16 ? 2 : bits == 8 ? 4 : 8;
  const int64_t kp = (K + cols - 1) / cols * cols, blocks = (N + 15) / 16;
  const int64_t parts = exact ? 3 : 1, R = M * parts, ldx = kp;
  const int64_t gs = bits == 16 || group_size >= K ? kp : group_size;
  const int64_t groups = kp / gs;
  std::vector<uint16_t> xb(R * ldx, 0);
  std::vector<float> sx(R * groups, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    __m512 group_sums[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 16) {  // gs is a multiple of 16 or the whole row
      const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      __m512 rest = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int64_t p = 0; p < parts; ++p) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(rest);
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
  const Blocked w{wdata, kp / cols, scales, biases, groups, gs / cols};
  std::vector<float> yp(parts > 1 ? R * N : 0);
  float* out = parts > 1 ? yp.data() : y;
  if (bits == 16)
    blocked_all<Form::kBf16>(w, blocks, xb.data(), ldx, sx.data(), R, out, N);
  else if (bits == 8)
    blocked_all<Form::kInt8>(w, blocks, xb.data(), ldx, sx.data(), R, out, N);
  else
    blocked_all<Form::kInt4>(w, blocks, xb.data(), ldx, sx.data(), R, out, N);
  if (parts > 1)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float* part = yp.data() + m * 3 * N + n;
        y[m * N + n] = part[0] + part[N] + part[2 * N];
      }
}

}  // extern "C"
