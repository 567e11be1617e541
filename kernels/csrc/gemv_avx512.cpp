// Skinny-matrix products for decode steps on CPUs with AVX-512 (F, BW, VL) and AVX512-BF16: y = x · Wᵀ for 1-32 rows
// of float32 activations against a whole weight in its stored form, the same forms and layouts as gemv_avx2.cpp:
//
//   bf16:  w[n, k] = bits << 16 read as a float
//   INT:   w[n, k] = u[n, k] · scales[n, g] + biases[n, g],  g = k / group_size  (biases = -zero · scale)
//
// A decode step's matmuls read every weight once and do little arithmetic: their limit is memory bandwidth. Each block
// of kRowsPerBlock weight rows is read from memory once per call and multiplied against every activation row while it
// sits in L1 (kChunk columns at a time); the weight's rows are split across threads (at::parallel_for).
//
// bf16: the activations are rounded to bfloat16 once per call (exact for a bfloat16 model's activations) and every
// 32 weights meet them in one _mm512_dpbf16_ps, which sums the products of each pair of columns into a float32 lane:
// twice the FMA rate of float32, and the weight needs no conversion at all.
// INT: each weight vector is dequantized in registers (INT8: widen, convert, one FMA with its group's scale and bias;
// INT4: one permute from the group's table of its 16 values) and multiplied in float32, as the reference's
// dequantized fp32 matmul does (an int8 VNNI product would need activations
// quantized per row, which the fp32 reference does not). With several activation rows a chunk of the block's weights is
// dequantized once into an L1 buffer that every row then reads.
//
// Tails: the activations are copied once into rows padded with zeros to a whole vector, and the weight's last vector
// in a row is a masked load, so tails run the same instructions; N not a multiple of the block runs a row at a time.
// INT4 packs input columns 2j and 2j+1 into byte j, low nibble first. Groups are multiples of 32 columns, or the row.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kRowsPerBlock = 4;  // weight rows sharing each load of an activation vector
constexpr int kActRows = 4;       // activation rows sharing each weight vector: 16 accumulators
constexpr int kMaxRows = 32;      // activation rows per call (cpu_gemv.MAX_ROWS)
constexpr int64_t kChunk = 256;   // columns of the block's weights held in L1 while every row reads them

enum class Kind { kInt8, kInt4 };

struct IntWeight {
  const uint8_t* data;  // row n starts at data + n * row_bytes
  int64_t row_bytes;
  const float* scales;  // (N, groups)
  const float* biases;
  int64_t groups;
  int64_t group_size;
};

inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}
inline __mmask32 mask32(int64_t left) { return left >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << left) - 1); }

// A group's scale and bias, and for INT4 the 16 values a nibble can take (u · scale + bias): one permute per 16
// weights then dequantizes them, reading only each lane's low 4 bits.
struct Group {
  __m512 scale, bias, table;
};

inline Group group_of(const IntWeight& w, int64_t n, int64_t k) {
  const int64_t g = n * w.groups + k / w.group_size;
  const __m512 scale = _mm512_set1_ps(w.scales[g]), bias = _mm512_set1_ps(w.biases[g]);
  const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return {scale, bias, _mm512_fmadd_ps(nibbles, scale, bias)};
}

// The 32 weights of row n from column k (k a multiple of 32; `left` columns remain in the row), dequantized, in the
// order of the activations' layout (see padded_activations): INT8 columns in order, INT4 the even columns then the
// odd ones (each byte's low nibble, then its high one). Lanes past the row hold the group's bias, met by zeros.
template <Kind KIND, bool WHOLE>
inline void load32_as(const IntWeight& w, int64_t n, int64_t k, int64_t left, const Group& group, __m512& w0,
                      __m512& w1) {
  const uint8_t* row = w.data + n * w.row_bytes;
  if (KIND == Kind::kInt8) {
    const __m128i b0 = WHOLE ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k))
                             : _mm_maskz_loadu_epi8(mask16(left), row + k);
    const __m128i b1 = WHOLE ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16))
                             : _mm_maskz_loadu_epi8(mask16(left - 16), row + k + 16);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b0)), group.scale, group.bias);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b1)), group.scale, group.bias);
  } else {
    const __m128i b = WHOLE ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2))
                            : _mm_maskz_loadu_epi8(mask16((left + 1) / 2), row + k / 2);
    const __m512i bytes = _mm512_cvtepu8_epi32(b);
    w0 = _mm512_permutexvar_ps(bytes, group.table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), group.table);
  }
}

// The masked loads only at a row's last, short step: plain loads everywhere else.
template <Kind KIND>
inline void load32(const IntWeight& w, int64_t n, int64_t k, int64_t left, const Group& group, __m512& w0,
                   __m512& w1) {
  if (left >= 32)
    load32_as<KIND, true>(w, n, k, left, group, w0, w1);
  else
    load32_as<KIND, false>(w, n, k, left, group, w0, w1);
}

// Row n's columns [k0, k1) dequantized into out (k1 - k0 rounded up to 32 floats), in the activations' order.
template <Kind KIND>
inline void dequantize(const IntWeight& w, int64_t n, int64_t k0, int64_t k1, int64_t K, float* out) {
  Group group{};
  for (int64_t k = k0; k < k1; k += 32) {
    if (k == k0 || k % w.group_size == 0) group = group_of(w, n, k);
    __m512 w0, w1;
    load32<KIND>(w, n, k, K - k, group, w0, w1);
    _mm512_store_ps(out + (k - k0), w0);
    _mm512_store_ps(out + (k - k0) + 16, w1);
  }
}

// One activation row against NB weight rows' columns [k0, k1): dequantized in registers, straight from memory.
template <Kind KIND, int NB>
inline void one_row(const IntWeight& w, int64_t K, int64_t n0, const float* x, int64_t k0, int64_t k1, __m512* acc) {
  __m512 a0[NB], a1[NB];
  Group group[NB];
  for (int j = 0; j < NB; ++j) a0[j] = acc[j], a1[j] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 32) {
    if (k == k0 || k % w.group_size == 0)
      for (int j = 0; j < NB; ++j) group[j] = group_of(w, n0 + j, k);
    const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
    for (int j = 0; j < NB; ++j) {
      // the block after next's rows, as far ahead: NB short interleaved streams defeat the hardware prefetcher
      _mm_prefetch(reinterpret_cast<const char*>(w.data + (n0 + j + 2 * NB) * w.row_bytes + k * w.row_bytes / K),
                   _MM_HINT_T0);
      __m512 w0, w1;
      load32<KIND>(w, n0 + j, k, K - k, group[j], w0, w1);
      a0[j] = _mm512_fmadd_ps(w0, x0, a0[j]);
      a1[j] = _mm512_fmadd_ps(w1, x1, a1[j]);
    }
  }
  for (int j = 0; j < NB; ++j) acc[j] = _mm512_add_ps(a0[j], a1[j]);
}

// acc[m][j] += Σ_k buf[j][k] · x[m0 + m][k] over one chunk (len a multiple of 16), MB activation rows.
template <int NB, int MB>
inline void fma_rows(const float* const* wrow, int64_t len, const float* x, int64_t ldx, int64_t m0, __m512* acc) {
  __m512 a[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) a[m][j] = acc[(m0 + m) * NB + j];
  for (int64_t k = 0; k < len; k += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(wrow[j] + k);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + m) * ldx + k);
      for (int j = 0; j < NB; ++j) a[m][j] = _mm512_fmadd_ps(wv[j], xv, a[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[(m0 + m) * NB + j] = a[m][j];
}

template <int NB, int MB>
inline void dpbf16_rows(const uint16_t* const* wrow, int64_t k0, int64_t k1, int64_t K, const uint16_t* x, int64_t ldx,
                        int64_t m0, __m512* acc, int64_t ldw = 0) {
  __m512 a[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) a[m][j] = acc[(m0 + m) * NB + j];
  for (int64_t k = k0; k < k1; k += 32) {
    __m512bh wv[NB];
    const __mmask32 mask = mask32(K - k);
    for (int j = 0; j < NB; ++j) {
      if (m0 == 0 && ldw)  // the first rows read the weight from memory: fetch the block after next meanwhile
        _mm_prefetch(reinterpret_cast<const char*>(wrow[j] + 2 * NB * ldw + k), _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wrow[j] + k);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + m) * ldx + k);
      for (int j = 0; j < NB; ++j) a[m][j] = _mm512_dpbf16_ps(a[m][j], wv[j], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[(m0 + m) * NB + j] = a[m][j];
}

// Every activation row against the rows of one chunk: kActRows at a time, then the rest.
template <int NB, typename Rows>
inline void all_rows(int64_t M, Rows rows) {
  int64_t m0 = 0;
  for (; m0 + kActRows <= M; m0 += kActRows) rows(m0, std::integral_constant<int, kActRows>{});
  switch (M - m0) {
    case 3:
      return rows(m0, std::integral_constant<int, 3>{});
    case 2:
      return rows(m0, std::integral_constant<int, 2>{});
    case 1:
      return rows(m0, std::integral_constant<int, 1>{});
  }
}

template <int NB>
inline void store(const __m512* acc, int64_t M, float* y, int64_t ldy, int64_t n0) {
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) y[m * ldy + n0 + j] = _mm512_reduce_add_ps(acc[m * NB + j]);
}

// y[:, n0:n0+NB] for the bf16 weight (rows of K bfloat16), xb: (M, ldx) bfloat16 activations padded with zeros.
template <int NB>
void bf16_block(const uint16_t* w, int64_t K, int64_t n0, const uint16_t* xb, int64_t ldx, int64_t M, float* y,
                int64_t N) {
  alignas(64) __m512 acc[kMaxRows * NB];
  for (int64_t i = 0; i < M * NB; ++i) acc[i] = _mm512_setzero_ps();
  const uint16_t* wrow[NB];
  for (int j = 0; j < NB; ++j) wrow[j] = w + (n0 + j) * K;
  const int64_t chunk = M <= kActRows ? K : kChunk;  // one pass of rows: nothing to keep in L1
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    all_rows<NB>(M, [&](int64_t m0, auto mb) {
      dpbf16_rows<NB, decltype(mb)::value>(wrow, k0, k1, K, xb, ldx, m0, acc, K);  // rows of K in memory
    });
  }
  store<NB>(acc, M, y, N, n0);
}

template <Kind KIND, int NB>
void int_block(const IntWeight& w, int64_t K, int64_t n0, const float* x, int64_t ldx, int64_t M, float* y,
               int64_t N) {
  alignas(64) __m512 acc[kMaxRows * NB];
  for (int64_t i = 0; i < M * NB; ++i) acc[i] = _mm512_setzero_ps();
  alignas(64) float buf[NB][kChunk];
  const float* wrow[NB];
  for (int j = 0; j < NB; ++j) wrow[j] = buf[j];
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    if (M == 1) {
      one_row<KIND, NB>(w, K, n0, x, k0, k1, acc);
      continue;
    }
    // several rows: the chunk dequantized once into L1, then read by every row
    for (int j = 0; j < NB; ++j) dequantize<KIND>(w, n0 + j, k0, k1, K, buf[j]);
    const int64_t len = (k1 - k0 + 31) / 32 * 32;
    all_rows<NB>(M, [&](int64_t m0, auto mb) { fma_rows<NB, decltype(mb)::value>(wrow, len, x + k0, ldx, m0, acc); });
  }
  store<NB>(acc, M, y, N, n0);
}

// bfloat16 activations (a bf16 model's), several rows: the chunk dequantized once and rounded to bfloat16, as torch's
// path for a bf16 model dequantizes its tiles, then every row meets it in _mm512_dpbf16_ps (twice float32's FMA rate:
// at 32 rows the products, not the weight's bytes, bound the step).
template <Kind KIND, int NB>
void int_block_bf16(const IntWeight& w, int64_t K, int64_t n0, const uint16_t* xb, int64_t ldx, int64_t M, float* y,
                    int64_t N) {
  alignas(64) __m512 acc[kMaxRows * NB];
  for (int64_t i = 0; i < M * NB; ++i) acc[i] = _mm512_setzero_ps();
  alignas(64) uint16_t buf[NB][kChunk];
  const uint16_t* wrow[NB];
  for (int j = 0; j < NB; ++j) wrow[j] = buf[j];
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int j = 0; j < NB; ++j) {
      Group group{};
      for (int64_t k = k0; k < k1; k += 32) {
        if (k == k0 || k % w.group_size == 0) group = group_of(w, n0 + j, k);
        __m512 w0, w1;
        load32<KIND>(w, n0 + j, k, K - k, group, w0, w1);
        _mm512_store_si512(buf[j] + (k - k0), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));  // w0's 16 first
      }
    }
    const int64_t len = (k1 - k0 + 31) / 32 * 32;
    all_rows<NB>(M, [&](int64_t m0, auto mb) {
      dpbf16_rows<NB, decltype(mb)::value>(wrow, 0, len, len, xb + k0, ldx, m0, acc);
    });
  }
  store<NB>(acc, M, y, N, n0);
}

// Weight rows split across threads, kRowsPerBlock at a time, the last few one by one.
template <typename Block>
void over_rows(int64_t N, int64_t row_bytes, Block block) {
  const int64_t num_blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  // Grain: enough weight rows per task that a thread streams a long run of memory (~64 KiB at least).
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, kRowsPerBlock * row_bytes));
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRowsPerBlock;
      if (n0 + kRowsPerBlock <= N) {
        block(n0, std::integral_constant<int, kRowsPerBlock>{});
      } else {
        for (int64_t n = n0; n < N; ++n) block(n, std::integral_constant<int, 1>{});
      }
    }
  });
}

// x (M, K) float32 copied into rows of ldx columns (a multiple of 32), zeros past K; `pairs_split`: each 32 columns
// reordered as their 16 even columns then their 16 odd ones (the order load32 dequantizes INT4 in).
std::vector<float> padded_activations(const float* x, int64_t M, int64_t K, int64_t ldx, bool pairs_split) {
  std::vector<float> out(M * ldx, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    float* row = out.data() + m * ldx;
    if (!pairs_split) {
      std::memcpy(row, x + m * K, K * sizeof(float));
      continue;
    }
    for (int64_t k = 0; k < K; ++k) row[k / 32 * 32 + (k % 2) * 16 + (k % 32) / 2] = x[m * K + k];
  }
  return out;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {  // x.size() a multiple of 16
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data() + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x.data() + i)));
  return out;
}

}  // namespace

// Plain C entry points on contiguous buffers (kernels/cpu_gemv.py checks shapes and dtypes), the AVX2 library's
// signatures: M at most 32.
extern "C" {

// y (M, N) = bf16(x) (M, K) · w (N, K)ᵀ, w bfloat16 bits; x rounded to bfloat16 (to nearest even) once here.
void loraplex_gemv_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  const int64_t ldx = (K + 31) / 32 * 32;
  const std::vector<uint16_t> xb = to_bf16(padded_activations(x, M, K, ldx, false));
  over_rows(N, 2 * K, [&](int64_t n0, auto nb) {
    bf16_block<decltype(nb)::value>(w, K, n0, xb.data(), ldx, M, y, N);
  });
}

// y (M, N) = x (M, K) · wᵀ, w from q: (N, K) uint8 (bits 8) or (N, ceil(K / 2)) (bits 4, low nibble first), and
// scales, biases: (N, ceil(K / group_size)) float32; group_size a multiple of 32, or K.
void loraplex_gemv_int(const float* x, int64_t M, int64_t K, const uint8_t* q, int64_t N, const float* scales,
                       const float* biases, int64_t group_size, int64_t bits, float* y) {
  const IntWeight w{q, bits == 8 ? K : (K + 1) / 2, scales, biases, (K + group_size - 1) / group_size, group_size};
  const int64_t ldx = (K + 31) / 32 * 32;
  std::vector<float> xp = padded_activations(x, M, K, ldx, bits == 4);
  over_rows(N, w.row_bytes, [&](int64_t n0, auto nb) {
    if (bits == 8)
      int_block<Kind::kInt8, decltype(nb)::value>(w, K, n0, xp.data(), ldx, M, y, N);
    else
      int_block<Kind::kInt4, decltype(nb)::value>(w, K, n0, xp.data(), ldx, M, y, N);
  });
}

// loraplex_gemv_int with x and the dequantized weight rounded to bfloat16 (products and sums in float32), M at least 2.
void loraplex_gemv_int_bf16(const float* x, int64_t M, int64_t K, const uint8_t* q, int64_t N, const float* scales,
                            const float* biases, int64_t group_size, int64_t bits, float* y) {
  const IntWeight w{q, bits == 8 ? K : (K + 1) / 2, scales, biases, (K + group_size - 1) / group_size, group_size};
  const int64_t ldx = (K + 31) / 32 * 32;
  const std::vector<uint16_t> xb = to_bf16(padded_activations(x, M, K, ldx, bits == 4));
  over_rows(N, w.row_bytes, [&](int64_t n0, auto nb) {
    if (bits == 8)
      int_block_bf16<Kind::kInt8, decltype(nb)::value>(w, K, n0, xb.data(), ldx, M, y, N);
    else
      int_block_bf16<Kind::kInt4, decltype(nb)::value>(w, K, n0, xb.data(), ldx, M, y, N);
  });
}

}  // extern "C"
