// CPU kernels for bfloat16 decode rows, with AVX-512 (BF16): LoRA shrink/expand, paged decode attention, and the
// model's RMSNorm and SiLU-and-multiply as one pass each (torch ops take 5-8 small kernels for each).
//
// LoRA: each row times its own slot's A and B only.
// A batched matmul computes every row against every slot's weights and throws most of it away, and a matmul call
// costs tens of µs before any arithmetic; here one call per linear does exactly each row's products. Rows of the
// same slot that lie next to each other (a batch sorted by slot) share every load of that slot's weights.
// Products accumulate in float32; h and y round to bfloat16 once, as a float32-accumulating matmul would.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kRowBlock = 4;  // rows of one slot sharing each weight load
constexpr int kWBlock = 4;    // A rows (shrink outputs) computed together, sharing each load of x
constexpr int kColChunks = 4;  // 16-column chunks of y (expand outputs) computed together, sharing each coefficient

using bf16 = uint16_t;

inline __m512 load_bf16x16(const bf16* p, __mmask16 mask) {
  __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline float bf16_to_float(bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline bf16 float_to_bf16(float f) {  // round to nearest even, as _mm512_cvtneps_pbh
  __m128bh v = _mm_cvtneps_pbh(_mm_set1_ps(f));
  bf16 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

// e^x, 16 lanes, x clamped to ±87.3 (float's range): 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, and a
// degree-6 Taylor polynomial for e^r (relative error ~1e-7, below bfloat16's resolution by far).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts: exact n * hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 round_bf16(__m512 v) {  // v rounded to bfloat16 and back: torch's rounding between two ops
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

inline void store_bf16x16(bf16* p, __m512 v, __mmask16 mask) {  // round to nearest even
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// Flush-to-zero and denormals-are-zero while a kernel runs: a decisive attention row has probabilities of e^-80 and
// below, and float math on denormal values takes a microcode assist per operation (a 3x slower kernel, measured).
struct FlushDenormals {
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved); }
};

inline __mmask16 tail_mask16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
inline __mmask32 tail_mask32(int64_t n) { return n >= 32 ? __mmask32(0xFFFFFFFF) : __mmask32((1ull << n) - 1); }

// Runs of consecutive rows with one slot, at most kRowBlock long; rows with slot < 0 are left out.
struct RowRun {
  int64_t first, count, slot;
};

std::vector<RowRun> row_runs(const int64_t* row_slot, int64_t num_rows, int64_t num_slots) {
  std::vector<RowRun> runs;
  for (int64_t row = 0; row < num_rows;) {
    int64_t slot = row_slot[row], end = row + 1;
    TORCH_CHECK(slot < num_slots, "row ", row, " uses slot ", slot, " of a pool of ", num_slots);
    while (end < num_rows && row_slot[end] == slot && end - row < kRowBlock) ++end;
    if (slot >= 0) runs.push_back({row, end - row, slot});
    row = end;
  }
  return runs;
}

}  // namespace

// h[row, s*max_rank + j] = A[slot, s*max_rank + j, :] · x[row, :] for j < rank[slot], 0 past it, for every row with
// row_slot >= 0; rows with row_slot < 0 are all zero.
void shrink(torch::Tensor x, torch::Tensor lora_a, torch::Tensor row_slot, torch::Tensor slot_ranks,
            int64_t num_slices, torch::Tensor h) {
  const int64_t num_rows = x.size(0), in_dim = x.size(1), width = lora_a.size(1), max_rank = width / num_slices;
  const bf16* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  const bf16* ap = reinterpret_cast<const bf16*>(lora_a.data_ptr<at::BFloat16>());
  bf16* hp = reinterpret_cast<bf16*>(h.data_ptr<at::BFloat16>());
  const int64_t* slots = row_slot.data_ptr<int64_t>();
  const int32_t* ranks = slot_ranks.data_ptr<int32_t>();
  const int64_t x_stride = x.stride(0), h_stride = h.stride(0), a_slot_stride = lora_a.stride(0);
  for (int64_t row = 0; row < num_rows; ++row) std::fill_n(hp + row * h_stride, width, bf16(0));
  const std::vector<RowRun> runs = row_runs(slots, num_rows, lora_a.size(0));
  // Sizes and strides by value: read through references, the compiler could not keep them (or acc) in registers.
  const auto body = [&, in_dim, max_rank, x_stride, a_slot_stride](int64_t begin, int64_t end) {
  FlushDenormals flush;  // per thread: MXCSR is per thread
  for (int64_t i = begin; i < end; ++i) {
    const RowRun& run = runs[i];
    const int64_t rank = std::min<int64_t>(ranks[run.slot], max_rank);
    const bf16* a_slot = ap + run.slot * a_slot_stride;
    // Every row of the run reads the same A rows: always kRowBlock row pointers (a short run repeats its last row,
    // whose extra products are not stored), so the loops below have fixed bounds and the accumulators stay in
    // registers.
    const bf16* x_rows[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) x_rows[r] = xp + (run.first + std::min<int64_t>(r, run.count - 1)) * x_stride;
    for (int64_t s = 0; s < num_slices; ++s) {
      for (int64_t j0 = 0; j0 < rank; j0 += kWBlock) {
        const bf16* a_rows[kWBlock];  // kWBlock A rows at once; past the rank, the block repeats its first row
        for (int w = 0; w < kWBlock; ++w) a_rows[w] = a_slot + (s * max_rank + (j0 + w < rank ? j0 + w : j0)) * in_dim;
        __m512 acc[kWBlock][kRowBlock];
        for (int w = 0; w < kWBlock; ++w)
          for (int r = 0; r < kRowBlock; ++r) acc[w][r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < in_dim; k += 32) {
          const __mmask32 mask = tail_mask32(in_dim - k);
          __m512bh a_vec[kWBlock];
          for (int w = 0; w < kWBlock; ++w) a_vec[w] = (__m512bh)_mm512_maskz_loadu_epi16(mask, a_rows[w] + k);
          // The slot's next A rows, one cache line each per step: its weights come from memory (a decode step reads
          // every adapter's once), and a row of a few KB is too short a stream for the hardware prefetcher.
          for (int w = 0; w < kWBlock; ++w)
            _mm_prefetch(reinterpret_cast<const char*>(a_rows[w] + kWBlock * in_dim + k), _MM_HINT_T0);
          for (int r = 0; r < kRowBlock; ++r) {
            const __m512bh x_vec = (__m512bh)_mm512_maskz_loadu_epi16(mask, x_rows[r] + k);
            for (int w = 0; w < kWBlock; ++w) acc[w][r] = _mm512_dpbf16_ps(acc[w][r], a_vec[w], x_vec);
          }
        }
        // Every sum first, then the stores the run needs: reading acc under a run-dependent condition makes the
        // compiler keep acc in memory, a store of each accumulator per step of the loop above.
        float sums[kWBlock][kRowBlock];
        for (int w = 0; w < kWBlock; ++w)
          for (int r = 0; r < kRowBlock; ++r) sums[w][r] = _mm512_reduce_add_ps(acc[w][r]);
        for (int w = 0; w < kWBlock; ++w)
          for (int r = 0; r < kRowBlock; ++r)
            if (j0 + w < rank && r < run.count)
              hp[(run.first + r) * h_stride + s * max_rank + j0 + w] = float_to_bf16(sums[w][r]);
      }
    }
  }
  };
  at::parallel_for(0, static_cast<int64_t>(runs.size()), 1, body);
}

// y[row, cols of slice s] += scale[slot] * h[row, s*max_rank : s*max_rank + rank] @ B[slot, :rank, cols of slice s]
// for every row with row_slot >= 0.
void expand(torch::Tensor y, torch::Tensor h, torch::Tensor lora_b, torch::Tensor row_slot, torch::Tensor slot_ranks,
            torch::Tensor slot_scales, std::vector<int64_t> slice_offsets) {
  const int64_t num_rows = y.size(0), max_rank = lora_b.size(1);
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
  const bf16* hp = reinterpret_cast<const bf16*>(h.data_ptr<at::BFloat16>());
  const bf16* bp = reinterpret_cast<const bf16*>(lora_b.data_ptr<at::BFloat16>());
  const int64_t* slots = row_slot.data_ptr<int64_t>();
  const int32_t* ranks = slot_ranks.data_ptr<int32_t>();
  const float* scales = slot_scales.data_ptr<float>();
  const int64_t y_stride = y.stride(0), h_stride = h.stride(0), b_slot_stride = lora_b.stride(0);
  const int64_t b_rank_stride = lora_b.stride(1);
  const std::vector<RowRun> runs = row_runs(slots, num_rows, lora_b.size(0));
  at::parallel_for(0, static_cast<int64_t>(runs.size()), 1, [&, b_rank_stride, max_rank](int64_t begin, int64_t end) {
  FlushDenormals flush;  // per thread: MXCSR is per thread
  std::vector<float> coef(kRowBlock * max_rank);
  for (int64_t i = begin; i < end; ++i) {
    const RowRun& run = runs[i];
    const int64_t rank = std::min<int64_t>(ranks[run.slot], max_rank);
    const bf16* b_slot = bp + run.slot * b_slot_stride;
    for (int64_t s = 0; s < num_slices; ++s) {
      for (int r = 0; r < kRowBlock; ++r)  // a short run's missing rows get zero coefficients (and are not stored)
        for (int64_t j = 0; j < rank; ++j)
          coef[r * max_rank + j] = r < run.count ? scales[run.slot] *
                                                       bf16_to_float(hp[(run.first + r) * h_stride + s * max_rank + j])
                                                 : 0.0f;
      // kColChunks chunks of 16 columns at once: kRowBlock x kColChunks independent accumulators keep both FMA
      // ports busy (one chain per row would wait on each FMA's latency), and each B row is read a cache line at a time.
      const int64_t slice_end = slice_offsets[s + 1];
      for (int64_t col = slice_offsets[s]; col < slice_end; col += 16 * kColChunks) {
        __mmask16 masks[kColChunks];
        for (int c = 0; c < kColChunks; ++c) masks[c] = tail_mask16(std::max<int64_t>(slice_end - col - 16 * c, 0));
        __m512 acc[kRowBlock][kColChunks];
        for (int r = 0; r < kRowBlock; ++r)
          for (int c = 0; c < kColChunks; ++c) acc[r][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < rank; ++j) {
          const bf16* b_row = b_slot + j * b_rank_stride + col;
          for (int line = 0; line < kColChunks / 2; ++line)  // this B row's lines four column blocks ahead
            _mm_prefetch(reinterpret_cast<const char*>(b_row + 4 * 16 * kColChunks + 32 * line), _MM_HINT_T0);
          __m512 b_vec[kColChunks];
          for (int c = 0; c < kColChunks; ++c) b_vec[c] = load_bf16x16(b_row + 16 * c, masks[c]);
          for (int r = 0; r < kRowBlock; ++r) {
            const __m512 coef_vec = _mm512_set1_ps(coef[r * max_rank + j]);
            for (int c = 0; c < kColChunks; ++c) acc[r][c] = _mm512_fmadd_ps(coef_vec, b_vec[c], acc[r][c]);
          }
        }
        for (int r = 0; r < kRowBlock; ++r) {  // fixed bounds (masks past the slice are empty): acc in registers
          if (r >= run.count) continue;
          bf16* y_row = yp + (run.first + r) * y_stride + col;
          for (int c = 0; c < kColChunks; ++c) {
            const __m512 sum = _mm512_add_ps(load_bf16x16(y_row + 16 * c, masks[c]), acc[r][c]);
            store_bf16x16(y_row + 16 * c, sum, masks[c]);
          }
        }
      }
    }
  }
  });
}

// y += expand(shrink(x)) for every row with row_slot >= 0: one call for a whole LoRA linear (the caller's per-call
// overhead, not the arithmetic, dominates a decode step's small products), h rounded to bfloat16 in between as
// shrink then expand would. The caller's arguments are checked here, where the two calls' checks would have been.
void shrink_expand(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor row_slot,
                   torch::Tensor slot_ranks, torch::Tensor slot_scales, torch::Tensor slice_offsets) {
  const auto bf16_type = at::ScalarType::BFloat16;
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "shrink_expand: x and y must be (rows, features) with contiguous rows of the same count");
  TORCH_CHECK(x.scalar_type() == bf16_type && y.scalar_type() == bf16_type && lora_a.scalar_type() == bf16_type &&
                  lora_b.scalar_type() == bf16_type,
              "shrink_expand: x, y, lora_a and lora_b must be bfloat16");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.is_contiguous() && lora_b.is_contiguous() &&
                  lora_a.size(0) == lora_b.size(0) && lora_a.size(2) == x.size(1) && lora_b.size(2) == y.size(1),
              "shrink_expand: lora_a (slots, width, in) and lora_b (slots, max_rank, out) must match x and y");
  TORCH_CHECK(slice_offsets.dim() == 1 && slice_offsets.scalar_type() == at::ScalarType::Int &&
                  slice_offsets.size(0) >= 2 && lora_a.size(1) == (slice_offsets.size(0) - 1) * lora_b.size(1),
              "shrink_expand: lora_a must hold max_rank rows per slice of slice_offsets");
  TORCH_CHECK(row_slot.dim() == 1 && row_slot.scalar_type() == at::ScalarType::Long && row_slot.size(0) == x.size(0) &&
                  row_slot.is_contiguous(),
              "shrink_expand: row_slot must be (rows,) int64");
  TORCH_CHECK(slot_ranks.dim() == 1 && slot_ranks.scalar_type() == at::ScalarType::Int && slot_ranks.is_contiguous() &&
                  slot_ranks.size(0) == lora_a.size(0) && slot_scales.dim() == 1 &&
                  slot_scales.scalar_type() == at::ScalarType::Float && slot_scales.is_contiguous() &&
                  slot_scales.size(0) == lora_a.size(0),
              "shrink_expand: slot_ranks (slots,) int32 and slot_scales (slots,) float32");
  const auto offsets_tensor = slice_offsets.contiguous();
  const int32_t* offsets_ptr = offsets_tensor.data_ptr<int32_t>();
  std::vector<int64_t> offsets(offsets_ptr, offsets_ptr + offsets_tensor.size(0));
  for (size_t i = 1; i < offsets.size(); ++i)
    TORCH_CHECK(offsets[0] == 0 && offsets[i - 1] <= offsets[i] && offsets.back() == y.size(1),
                "shrink_expand: slice_offsets must rise from 0 to y's width");
  torch::Tensor h = torch::empty({x.size(0), lora_a.size(1)}, x.options());
  shrink(x, lora_a, row_slot, slot_ranks, static_cast<int64_t>(offsets.size()) - 1, h);
  expand(y, h, lora_b, row_slot, slot_ranks, slot_scales, offsets);
}

namespace {

// 16 float8_e4m3fn values -> float32, exactly: each byte's exponent and mantissa placed in a float16's (exponent bias
// 15 against 7), converted by vcvtph2ps, then times 2^8 for the bias. A float8 subnormal lands on a float16 subnormal,
// which vcvtph2ps converts exactly (DAZ applies to float32 inputs only) into a normal float32.
inline __m512 load_fp8x16(const uint8_t* p) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half_bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7),
                                            _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(half_bits), _mm512_set1_ps(256.0f));
}

// decode_attention for kGroup query heads per KV head and head_dim = 32 * kChunks, known at compile time so that
// the per-head accumulators live in registers. kFp8: the cache holds float8_e4m3fn K / k_scale and V / v_scale,
// converted in registers (keys to bfloat16, exactly: 3 mantissa bits fit in 7) and scaled once per score and output.
// sink_logits: (heads,) float32, or nullptr for none.
template <int64_t kGroup, int64_t kChunks, bool kFp8>
void decode_attention_impl(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor read_pages,
                           torch::Tensor kv_lens, int64_t page_size, double scale, int64_t window, int64_t chunk,
                           const float* sink_logits, torch::Tensor out, float k_scale = 1.0f, float v_scale = 1.0f) {
  using Elem = std::conditional_t<kFp8, uint8_t, bf16>;
  const int64_t num_reqs = q.size(0), num_kv_heads = k_cache.size(1);
  const bf16* qp = reinterpret_cast<const bf16*>(q.data_ptr<at::BFloat16>());
  const Elem* kp = reinterpret_cast<const Elem*>(k_cache.data_ptr());
  const Elem* vp = reinterpret_cast<const Elem*>(v_cache.data_ptr());
  const float score_scale = static_cast<float>(scale) * k_scale;
  bf16* op = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  const int64_t* pages = read_pages.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int64_t q_req = q.stride(0), q_head = q.stride(1), o_req = out.stride(0), o_head = out.stride(1);
  const int64_t kv_slot = k_cache.stride(0), kv_head = k_cache.stride(1), pages_stride = read_pages.stride(0);
  const int64_t num_pages = k_cache.size(0) / page_size;
  int64_t max_len = 0;
  for (int64_t n = 0; n < num_reqs; ++n) {
    TORCH_CHECK(0 < lens[n] && lens[n] <= read_pages.size(1) * page_size, "request ", n, ": ", lens[n], " keys");
    for (int64_t i = 0; i * page_size < lens[n]; ++i) {
      const int64_t page = pages[n * pages_stride + i];
      TORCH_CHECK(0 <= page && page < num_pages, "request ", n, " reads page ", page, " of ", num_pages);
    }
    max_len = std::max(max_len, lens[n]);
  }
  const int64_t score_stride = max_len + 16;
  at::parallel_for(0, num_reqs, 1, [&](int64_t begin, int64_t end) {
  FlushDenormals flush;  // per thread: MXCSR is per thread
  std::vector<float> scores(kGroup * score_stride);
  std::vector<int64_t> slots(max_len);
  for (int64_t n = begin; n < end; ++n) {
    const int64_t len = lens[n];
    int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // the window's oldest key
    if (chunk > 0) first = std::max(first, (len - 1) / chunk * chunk);  // the first key of the query's chunk
    for (int64_t t = first; t < len; ++t) slots[t] = pages[n * pages_stride + t / page_size] * page_size + t % page_size;
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      __m512bh q_vec[kGroup][kChunks];
      for (int64_t j = 0; j < kGroup; ++j)
        for (int64_t c = 0; c < kChunks; ++c)
          q_vec[j][c] = (__m512bh)_mm512_loadu_si512(qp + n * q_req + (g * kGroup + j) * q_head + 32 * c);
      // A sink joins the maximum as it joins the softmax: its exp(sink - max) <= 1 is added to the sum below.
      float max_score[kGroup];
      for (int64_t j = 0; j < kGroup; ++j) max_score[j] = sink_logits ? sink_logits[g * kGroup + j] : -INFINITY;
      for (int64_t t = first; t < len; ++t) {
        const Elem* k_row = kp + slots[t] * kv_slot + g * kv_head;
        __m512bh k_vec[kChunks];
        for (int64_t c = 0; c < kChunks; ++c) {
          if constexpr (kFp8)  // _mm512_cvtne2ps_pbh(a, b): b's 16 values first, then a's
            k_vec[c] = _mm512_cvtne2ps_pbh(load_fp8x16(k_row + 32 * c + 16), load_fp8x16(k_row + 32 * c));
          else
            k_vec[c] = (__m512bh)_mm512_loadu_si512(k_row + 32 * c);
        }
        for (int64_t j = 0; j < kGroup; ++j) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t c = 0; c < kChunks; ++c) acc = _mm512_dpbf16_ps(acc, k_vec[c], q_vec[j][c]);
          const float score = score_scale * _mm512_reduce_add_ps(acc);
          scores[j * score_stride + t] = score;
          max_score[j] = std::max(max_score[j], score);
        }
      }
      float inv_sum[kGroup];
      for (int64_t j = 0; j < kGroup; ++j) {
        float* row = scores.data() + j * score_stride;
        __m512 sum_vec = _mm512_setzero_ps();
        for (int64_t t = first; t < len; t += 16) {
          const __mmask16 mask = tail_mask16(len - t);
          const __m512 p = _mm512_maskz_mov_ps(
              mask, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + t), _mm512_set1_ps(max_score[j]))));
          _mm512_mask_storeu_ps(row + t, mask, p);
          sum_vec = _mm512_add_ps(sum_vec, p);
        }
        float sum = _mm512_reduce_add_ps(sum_vec);
        if (sink_logits) sum += std::exp(sink_logits[g * kGroup + j] - max_score[j]);
        inv_sum[j] = v_scale / sum;  // the values' scale folded into the normalization
      }
      __m512 acc[kGroup][2 * kChunks];
      for (int64_t j = 0; j < kGroup; ++j)
        for (int64_t c = 0; c < 2 * kChunks; ++c) acc[j][c] = _mm512_setzero_ps();
      for (int64_t t = first; t < len; ++t) {
        const Elem* v_row = vp + slots[t] * kv_slot + g * kv_head;
        __m512 v_vec[2 * kChunks];
        for (int64_t c = 0; c < 2 * kChunks; ++c) {
          if constexpr (kFp8)
            v_vec[c] = load_fp8x16(v_row + 16 * c);
          else
            v_vec[c] = load_bf16x16(v_row + 16 * c, 0xFFFF);
        }
        for (int64_t j = 0; j < kGroup; ++j) {
          const __m512 p = _mm512_set1_ps(scores[j * score_stride + t]);
          for (int64_t c = 0; c < 2 * kChunks; ++c) acc[j][c] = _mm512_fmadd_ps(p, v_vec[c], acc[j][c]);
        }
      }
      for (int64_t j = 0; j < kGroup; ++j) {
        bf16* o_row = op + n * o_req + (g * kGroup + j) * o_head;
        for (int64_t c = 0; c < 2 * kChunks; ++c)
          store_bf16x16(o_row + 16 * c, _mm512_mul_ps(acc[j][c], _mm512_set1_ps(inv_sum[j])), 0xFFFF);
      }
    }
  }
  });
}

}  // namespace

// Query heads per KV head and head_dims (in chunks of 32) the kernel is built for; the caller checks.
bool decode_attention_supports(int64_t group, int64_t head_dim) {
  return (group == 1 || group == 2 || group == 4 || group == 8) && (head_dim == 64 || head_dim == 128);
}

// One new token per request: out[n, h] = softmax(scale * q[n, h] · K[n]ᵀ) V[n] over the request's first kv_lens[n]
// positions (with window > 0 only the last `window` of them; with chunk > 0 only those of the new token's chunk,
// from p - p % chunk for its position p), K/V read straight from the paged cache through read_pages (no gather); the
// query heads of one KV head share each K/V row load. Scores and probabilities in float32. sinks: (heads,) one
// learned logit per head that joins the softmax's denominator and attends to no value (gpt-oss), or empty for none.
void decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor read_pages,
                      torch::Tensor kv_lens, int64_t page_size, double scale, int64_t window, int64_t chunk,
                      torch::Tensor sinks, torch::Tensor out) {
  const int64_t group = q.size(1) / k_cache.size(1), head_dim = q.size(2);
  TORCH_CHECK(decode_attention_supports(group, head_dim), "decode_attention: unsupported group ", group,
              " or head_dim ", head_dim);
  TORCH_CHECK(sinks.numel() == 0 || (sinks.dim() == 1 && sinks.size(0) == q.size(1) && sinks.is_floating_point()),
              "decode_attention: sinks must be (heads,) floats or empty");
  const torch::Tensor sink_logits = sinks.to(at::kFloat).contiguous();  // (heads,): a copy of a few floats at most
  const float* sink_ptr = sinks.numel() ? sink_logits.data_ptr<float>() : nullptr;
#define LORAPLEX_DISPATCH(G, C)                                                                               \
  if (group == G && head_dim == 32 * C)                                                                       \
    return decode_attention_impl<G, C, false>(q, k_cache, v_cache, read_pages, kv_lens, page_size, scale, window, \
                                              chunk, sink_ptr, out);
  LORAPLEX_DISPATCH(1, 2) LORAPLEX_DISPATCH(2, 2) LORAPLEX_DISPATCH(4, 2) LORAPLEX_DISPATCH(8, 2)
  LORAPLEX_DISPATCH(1, 4) LORAPLEX_DISPATCH(2, 4) LORAPLEX_DISPATCH(4, 4) LORAPLEX_DISPATCH(8, 4)
#undef LORAPLEX_DISPATCH
}

// decode_attention over an FP8 cache: k_cache and v_cache float8_e4m3fn holding K / k_scale and V / v_scale,
// kv_scales (2,) float32 [k_scale, v_scale] (a tensor: the cache's own, set after start by --calculate-kv-scales).
void decode_attention_fp8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor read_pages,
                          torch::Tensor kv_lens, int64_t page_size, double scale, int64_t window, int64_t chunk,
                          torch::Tensor sinks, torch::Tensor kv_scales, torch::Tensor out) {
  const int64_t group = q.size(1) / k_cache.size(1), head_dim = q.size(2);
  TORCH_CHECK(decode_attention_supports(group, head_dim), "decode_attention_fp8: unsupported group ", group,
              " or head_dim ", head_dim);
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat8_e4m3fn && v_cache.scalar_type() == at::kFloat8_e4m3fn,
              "decode_attention_fp8: the caches must be float8_e4m3fn");
  TORCH_CHECK(kv_scales.scalar_type() == at::kFloat && kv_scales.numel() == 2 && kv_scales.is_contiguous(),
              "decode_attention_fp8: kv_scales must be (2,) float32");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.dim() == 1 && sinks.size(0) == q.size(1) && sinks.is_floating_point()),
              "decode_attention_fp8: sinks must be (heads,) floats or empty");
  const torch::Tensor sink_logits = sinks.to(at::kFloat).contiguous();
  const float* sink_ptr = sinks.numel() ? sink_logits.data_ptr<float>() : nullptr;
  const float k_scale = kv_scales.data_ptr<float>()[0], v_scale = kv_scales.data_ptr<float>()[1];
#define LORAPLEX_DISPATCH(G, C)                                                                              \
  if (group == G && head_dim == 32 * C)                                                                      \
    return decode_attention_impl<G, C, true>(q, k_cache, v_cache, read_pages, kv_lens, page_size, scale, window, \
                                             chunk, sink_ptr, out, k_scale, v_scale);
  LORAPLEX_DISPATCH(1, 2) LORAPLEX_DISPATCH(2, 2) LORAPLEX_DISPATCH(4, 2) LORAPLEX_DISPATCH(8, 2)
  LORAPLEX_DISPATCH(1, 4) LORAPLEX_DISPATCH(2, 4) LORAPLEX_DISPATCH(4, 4) LORAPLEX_DISPATCH(8, 4)
#undef LORAPLEX_DISPATCH
}

// out = weight * bf16(x * rsqrt(mean(x²) + eps)) per row, statistics in float32: the torch reference's rounding.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: x must be (rows, dim) with unit stride in dim and weight (dim,)");
  const int64_t num_rows = x.size(0), dim = x.size(1), x_stride = x.stride(0);
  torch::Tensor out = torch::empty({num_rows, dim}, x.options());
  const bf16* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  const bf16* wp = reinterpret_cast<const bf16*>(weight.data_ptr<at::BFloat16>());
  bf16* op = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    for (int64_t row = begin; row < end; ++row) {
      const bf16* x_row = xp + row * x_stride;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = 0; k < dim; k += 16) {
        const __m512 v = load_bf16x16(x_row + k, tail_mask16(dim - k));
        sum = _mm512_fmadd_ps(v, v, sum);
      }
      const __m512 inv_rms = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sum) / dim + static_cast<float>(eps)));
      for (int64_t k = 0; k < dim; k += 16) {
        const __mmask16 mask = tail_mask16(dim - k);
        const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16x16(x_row + k, mask), inv_rms));
        store_bf16x16(op + row * dim + k, _mm512_mul_ps(load_bf16x16(wp + k, mask), normed), mask);
      }
    }
  });
  return out;
}

// gate_up (rows, 2 * d) = [gate | up] -> bf16(silu(gate)) * up, (rows, d): torch's F.silu(gate) * up, rounding included.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be (rows, 2 * dim) with unit stride in its last dim");
  const int64_t num_rows = gate_up.size(0), dim = gate_up.size(1) / 2, in_stride = gate_up.stride(0);
  torch::Tensor out = torch::empty({num_rows, dim}, gate_up.options());
  const bf16* ip = reinterpret_cast<const bf16*>(gate_up.data_ptr<at::BFloat16>());
  bf16* op = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, num_rows, 8, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    for (int64_t row = begin; row < end; ++row) {
      const bf16* gate = ip + row * in_stride;
      const bf16* up = gate + dim;
      for (int64_t k = 0; k < dim; k += 16) {
        const __mmask16 mask = tail_mask16(dim - k);
        const __m512 g = load_bf16x16(gate + k, mask);
        const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        store_bf16x16(op + row * dim + k, _mm512_mul_ps(silu, load_bf16x16(up + k, mask)), mask);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("shrink", &shrink, "LoRA shrink of bfloat16 rows, each against its own slot");
  m.def("expand", &expand, "LoRA expand of bfloat16 rows, each against its own slot, added to y");
  m.def("shrink_expand", &shrink_expand, "LoRA shrink then expand of bfloat16 rows in one call, added to y");
  m.def("rms_norm", &rms_norm, "RMSNorm of bfloat16 rows, statistics in float32");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of bfloat16 [gate | up] rows");
  m.def("decode_attention_supports", &decode_attention_supports, "query heads per KV head and head_dim built for");
  m.def("decode_attention", &decode_attention, "attention of one new bfloat16 token per request over the paged cache");
  m.def("decode_attention_fp8", &decode_attention_fp8, "decode_attention over a float8_e4m3fn cache with its scales");
}
