// Skinny-matrix products for decode steps on CPUs with AVX2/FMA (no AVX-512): y = x · Wᵀ for 1-32 rows of float32
// activations against a whole weight in its stored form, bfloat16 or unsigned INT8/INT4 with a scale and bias per
// group of input columns:
//
//   bf16:  w[n, k] = bits << 16 read as a float
//   INT:   w[n, k] = u[n, k] · scales[n, g] + biases[n, g],  g = k / group_size  (biases = -zero · scale)
//
// A decode step's matmuls read every weight once and do little arithmetic: their limit is memory bandwidth. torch's
// GEMMs tile for large batches and, at a few rows, read the weight (or a converted copy of it) more than once. Here
// each block of kRowsPerBlock weight rows is read from memory once and multiplied against every activation row while
// it sits in cache; the weight's rows are split across threads (at::parallel_for); each weight vector is converted to
// float32 in registers (bf16: a shift; INT: widen, convert, one FMA with the group's scale and bias) and the products
// accumulate in float32, as the reference's dequantized fp32 matmul does.
//
// INT4 packs input columns 2j and 2j+1 into byte j, low nibble first: the 4 bytes of 8 columns are one 32-bit word
// whose lanes shift by 0, 4, ..., 28. Tails (K not a multiple of 8, N not a multiple of the row block) run the same
// arithmetic one element or one row at a time.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kRowsPerBlock = 4;  // weight rows sharing each load of an activation vector
constexpr int kActRows = 3;       // activation rows sharing each converted weight vector (12 accumulators)

enum class Kind { kBf16, kInt8, kInt4 };

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct Weight {
  Kind kind;
  const uint8_t* data;  // row n starts at data + n * row_bytes
  int64_t row_bytes;
  const float* scales;  // (N, groups), INT only
  const float* biases;
  int64_t groups;
  int64_t group_size;
};

// 8 weights of row n from column k (k a multiple of 8), as float32, before the group's scale and bias.
template <Kind KIND>
inline __m256 load8(const Weight& w, int64_t n, int64_t k) {
  const uint8_t* row = w.data + n * w.row_bytes;
  switch (KIND) {
    case Kind::kBf16: {
      __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    }
    case Kind::kInt8: {
      __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k));
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    }
    default: {
      uint32_t word;
      std::memcpy(&word, row + k / 2, 4);
      __m256i nibbles = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)),
                                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
      return _mm256_cvtepi32_ps(_mm256_and_si256(nibbles, _mm256_set1_epi32(0xF)));
    }
  }
}

// One weight (row n, column k), dequantized: the tail columns.
template <Kind KIND>
inline float load1(const Weight& w, int64_t n, int64_t k) {
  const uint8_t* row = w.data + n * w.row_bytes;
  float u;
  switch (KIND) {
    case Kind::kBf16: {
      uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(row)[k]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    case Kind::kInt8:
      u = row[k];
      break;
    default:
      u = (row[k / 2] >> (4 * (k & 1))) & 0xF;
  }
  const int64_t g = n * w.groups + k / w.group_size;
  return u * w.scales[g] + w.biases[g];
}

// y[m, n0:n0+NB] for activation rows m0..m0+MB: every column, group by group. A group's scale and bias turn each
// converted weight vector into its values once, shared by the MB activation rows.
template <Kind KIND, int NB, int MB>
void block(const Weight& w, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t K, int64_t n0, int64_t m0) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  float tail[MB][NB] = {};
  constexpr bool quantized = KIND != Kind::kBf16;
  const int64_t group_size = quantized ? w.group_size : K;
  for (int64_t k0 = 0; k0 < K; k0 += group_size) {
    const int64_t k1 = std::min(K, k0 + group_size);
    const int64_t vec_end = k0 + (k1 - k0) / 8 * 8;
    __m256 scale[NB], bias[NB];
    if (quantized) {
      for (int j = 0; j < NB; ++j) {
        const int64_t g = (n0 + j) * w.groups + k0 / group_size;
        scale[j] = _mm256_set1_ps(w.scales[g]);
        bias[j] = _mm256_set1_ps(w.biases[g]);
      }
    }
    for (int64_t k = k0; k < vec_end; k += 8) {
      __m256 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + (m0 + m) * ldx + k);
      for (int j = 0; j < NB; ++j) {
        __m256 wv = load8<KIND>(w, n0 + j, k);
        if (quantized) wv = _mm256_fmadd_ps(wv, scale[j], bias[j]);
        for (int m = 0; m < MB; ++m) acc[m][j] = _mm256_fmadd_ps(wv, xv[m], acc[m][j]);
      }
    }
    for (int64_t k = vec_end; k < k1; ++k)  // only the last group can be short of a vector (group sizes are 8·i)
      for (int j = 0; j < NB; ++j) {
        const float wk = load1<KIND>(w, n0 + j, k);
        for (int m = 0; m < MB; ++m) tail[m][j] += wk * x[(m0 + m) * ldx + k];
      }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) y[(m0 + m) * ldy + n0 + j] = hsum(acc[m][j]) + tail[m][j];
}

// Several activation rows: the block's weights are converted to float32 once per chunk of kChunk columns into a
// buffer that stays in L1, then every pair of activation rows runs plain FMAs over it (converting per row pair would
// repeat the conversion M / 2 times: at 32 rows that, not memory, bounds the step).
constexpr int64_t kChunk = 512;  // columns per chunk (a group that straddles two takes its scale in each)

template <int NB, int MB>
void chunk_rows(const float (*buf)[kChunk], int64_t len, const float* x, int64_t ldx, int64_t m0, float* sums) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const int64_t vec_end = len / 8 * 8;
  for (int64_t k = 0; k < vec_end; k += 8) {
    __m256 xv[MB];
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + (m0 + m) * ldx + k);
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const __m256 wv = _mm256_loadu_ps(buf[j] + k);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) acc[m][j] = _mm256_fmadd_ps(wv, xv[m], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      float tail = 0;
      for (int64_t k = vec_end; k < len; ++k) tail += buf[j][k] * x[(m0 + m) * ldx + k];
      sums[(m0 + m) * NB + j] += hsum(acc[m][j]) + tail;
    }
}

template <Kind KIND, int NB>
void rows_block(const Weight& w, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t M, int64_t K,
                int64_t n0) {
  if (M == 1) {  // one row: convert in registers, straight from memory
    block<KIND, NB, 1>(w, x, ldx, y, ldy, K, n0, 0);
    return;
  }
  alignas(32) float buf[NB][kChunk];
  std::vector<float> sums(M * NB, 0.0f);
  constexpr bool quantized = KIND != Kind::kBf16;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int j = 0; j < NB; ++j) {
      const int64_t n = n0 + j;
      for (int64_t start = k0; start < k1;) {  // group by group (a chunk holds whole groups but for the last)
        const int64_t end = quantized ? std::min(k1, (start / w.group_size + 1) * w.group_size) : k1;
        const int64_t g = quantized ? n * w.groups + start / w.group_size : 0;
        const __m256 scale = _mm256_set1_ps(quantized ? w.scales[g] : 1.0f);
        const __m256 bias = _mm256_set1_ps(quantized ? w.biases[g] : 0.0f);
        int64_t k = start;
        for (; k + 8 <= end; k += 8) {
          __m256 wv = load8<KIND>(w, n, k);
          if (quantized) wv = _mm256_fmadd_ps(wv, scale, bias);
          _mm256_store_ps(buf[j] + (k - k0), wv);
        }
        for (; k < end; ++k) buf[j][k - k0] = load1<KIND>(w, n, k);
        start = end;
      }
    }
    int64_t m0 = 0;
    for (; m0 + kActRows <= M; m0 += kActRows) chunk_rows<NB, kActRows>(buf, k1 - k0, x + k0, ldx, m0, sums.data());
    if (M - m0 == 2) chunk_rows<NB, 2>(buf, k1 - k0, x + k0, ldx, m0, sums.data());
    if (M - m0 == 1) chunk_rows<NB, 1>(buf, k1 - k0, x + k0, ldx, m0, sums.data());
  }
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) y[m * ldy + n0 + j] = sums[m * NB + j];
}

template <Kind KIND>
void run_kind(const Weight& w, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  const int64_t num_blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  // Grain: enough weight rows per task that a thread streams a long run of memory (~64 KiB at least).
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, kRowsPerBlock * w.row_bytes));
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRowsPerBlock;
      if (n0 + kRowsPerBlock <= N) {
        rows_block<KIND, kRowsPerBlock>(w, x, K, y, N, M, K, n0);
      } else {
        for (int64_t n = n0; n < N; ++n) rows_block<KIND, 1>(w, x, K, y, N, M, K, n);
      }
    }
  });
}

void run(const Weight& w, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  switch (w.kind) {  // once per call: the kind is a constant inside the loops
    case Kind::kBf16:
      return run_kind<Kind::kBf16>(w, x, M, K, y, N);
    case Kind::kInt8:
      return run_kind<Kind::kInt8>(w, x, M, K, y, N);
    default:
      return run_kind<Kind::kInt4>(w, x, M, K, y, N);
  }
}

}  // namespace

// Plain C entry points on contiguous buffers (kernels/cpu_gemv.py checks shapes and dtypes): no torch/pybind headers
// but ATen/Parallel.h, so the library compiles in ~2 s where a torch extension takes a minute.
extern "C" {

// y (M, N) = x (M, K) · w (N, K)ᵀ, w bfloat16 bits.
void loraplex_gemv_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  const Weight weight{Kind::kBf16, reinterpret_cast<const uint8_t*>(w), 2 * K, nullptr, nullptr, 1, K};
  run(weight, x, M, K, y, N);
}

// y (M, N) = x (M, K) · wᵀ, w from q: (N, K) uint8 (bits 8) or (N, ceil(K / 2)) (bits 4, low nibble first), and
// scales, biases: (N, ceil(K / group_size)) float32; group_size a multiple of 8, or K.
void loraplex_gemv_int(const float* x, int64_t M, int64_t K, const uint8_t* q, int64_t N, const float* scales,
                       const float* biases, int64_t group_size, int64_t bits, float* y) {
  const Weight weight{bits == 8 ? Kind::kInt8 : Kind::kInt4, q, bits == 8 ? K : (K + 1) / 2, scales, biases,
                      (K + group_size - 1) / group_size, group_size};
  run(weight, x, M, K, y, N);
}

}  // extern "C"
