// W8A8 int8 linear: out[m, n] = (float(acc[m, n]) * s_x[m]) * s_w[n] (+ bias[n]), where
// acc[m, n] = sum_k q_x[m, k] * q_w[n, k] in int32, q_w the int8 weight ([N, K], torch's
// layout, read in place), and each row of x quantized here per token: s_x = amax(|x_m|) / 127
// (1 for a zero row), q_x = round_half_even(x / s_x) clamped to [-127, 127].
//
// Every step is the definition's (int8_gemm.py int8_linear_ref, quantization/int8.py): the
// same float32 division and rounding, an exact int32 sum, the same float32 products in the
// same order, so the result equals the reference bit for bit, whatever the batch or the
// thread count.
//
// The product, AVX2: no VNNI here, and vpmaddubsw (u8 x s8 pairs summed into a saturating
// int16) can clip; instead the weight's int8 is widened to int16 as it is loaded
// (vpmovsxbw) and vpmaddwd sums pairs of int16 products into int32, exact. The activations are
// quantized once per call into int16 rows padded to 16. A tile is NR = 2 weight rows x MR = 5
// tokens: 10 accumulators, per 16 k: 2 widened weight loads, 5 token loads, 10 vpmaddwd. The
// 2 weight rows (2 K bytes) stay in L1 while every group of 5 tokens passes, so the weight is
// read from memory once per call. Against 4 rows x 2 tokens (one thread, Qwen2.5-0.5B's and
// [2048 x 2048] shapes, best of 9): 1.2-1.6x at 16-256 tokens, 0.8-0.9x at one. Threads (at::parallel_for) take ranges of weight rows. Without
// AVX2 the same sums run in scalar code (correct, not fast: fast() says 0).
#include <ATen/Parallel.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX2__)
constexpr int kFast = 1;
#else
constexpr int kFast = 0;
#endif
constexpr int NR = 2, MR = 5;   // tile_rows names each token count up to MR

// q rows (row stride kp >= k, zeros past k) and scales of x [M, K] (row stride ldx): a
// token's activations (int16, for the product) or a weight's rows (int8, at load and refit)
template <typename Q>
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t ldx, int64_t kp,
                   Q* q, float* scale, int64_t grain) {
  at::parallel_for(0, m, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0; i < m1; ++i) {
      const float* row = x + i * ldx;
      float amax = 0.f;
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(row[j]));
      float s = amax > 0.f ? amax / 127.f : 1.f;
      scale[i] = s;
      Q* qi = q + i * kp;
      for (int64_t j = 0; j < k; ++j) {
        float v = std::nearbyint(row[j] / s);
        qi[j] = static_cast<Q>(std::min(127.f, std::max(-127.f, v)));
      }
      for (int64_t j = k; j < kp; ++j) qi[j] = 0;
    }
  });
}

inline int32_t dot_tail(const int8_t* w, const int16_t* q, int64_t k0, int64_t k) {
  int32_t s = 0;
  for (int64_t j = k0; j < k; ++j) s += int32_t(w[j]) * int32_t(q[j]);
  return s;
}

#if defined(__AVX2__)
inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_hadd_epi32(s, s);
  s = _mm_hadd_epi32(s, s);
  return _mm_cvtsi128_si32(s);
}

inline __m256i widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load16(const int16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// acc[r][t] for weight rows w[r] (r < nr) and token rows q[t] (t < mr), k16 = K rounded down
template <int R, int T>
void tile(const int8_t* const* w, const int16_t* const* q, int64_t k16, int64_t k,
          int32_t acc[NR][MR]) {
  __m256i a[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) a[r][t] = _mm256_setzero_si256();
  for (int64_t j = 0; j < k16; j += 16) {
    __m256i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen(w[r] + j);
    for (int t = 0; t < T; ++t) {
      __m256i xv = load16(q[t] + j);
      for (int r = 0; r < R; ++r)
        a[r][t] = _mm256_add_epi32(a[r][t], _mm256_madd_epi16(wv[r], xv));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = hsum(a[r][t]) + dot_tail(w[r], q[t], k16, k);
}
#else
template <int R, int T>
void tile(const int8_t* const* w, const int16_t* const* q, int64_t, int64_t k,
          int32_t acc[NR][MR]) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = dot_tail(w[r], q[t], 0, k);
}
#endif

template <int R>
void tile_rows(const int8_t* const* w, const int16_t* const* q, int mr, int64_t k16, int64_t k,
               int32_t acc[NR][MR]) {
  switch (mr) {
    case 1: return tile<R, 1>(w, q, k16, k, acc);
    case 2: return tile<R, 2>(w, q, k16, k, acc);
    case 3: return tile<R, 3>(w, q, k16, k, acc);
    case 4: return tile<R, 4>(w, q, k16, k, acc);
    case 5: return tile<R, 5>(w, q, k16, k, acc);
  }
}

void tile_any(const int8_t* const* w, int nr, const int16_t* const* q, int mr, int64_t k,
              int32_t acc[NR][MR]) {
  int64_t k16 = k & ~int64_t(15);
  if (nr == NR) return tile_rows<NR>(w, q, mr, k16, k, acc);
  for (int r = 0; r < nr; ++r) {
    const int8_t* wr[NR] = {w[r]};
    int32_t one[NR][MR];
    tile_rows<1>(wr, q, mr, k16, k, one);
    for (int t = 0; t < mr; ++t) acc[r][t] = one[0][t];
  }
}

}  // namespace

extern "C" {

int rollout_engine_int8_gemm_abi() { return 3; }

// A weight's rows quantized: w [N, K] float32 (row stride ldw) -> q [N, K] int8 (contiguous)
// and scale [N] float32, by the rule the activations follow. Returns 0.
int rollout_engine_int8_quantize_rows(const float* w, int64_t n, int64_t k, int64_t ldw,
                                      int8_t* q, float* scale) {
  quantize_rows<int8_t>(w, n, k, ldw, k, q, scale, 64);
  return 0;
}
int rollout_engine_int8_gemm_fast() { return kFast; }

// x [M, K] float32 (row stride ldx), w [N, K] int8 (row stride ldw), w_scale [N] float32,
// bias [N] float32 or null, out [M, N] float32 (row stride ldo). Returns 0.
int rollout_engine_int8_linear(const float* x, int64_t m, int64_t k, int64_t ldx,
                               const int8_t* w, int64_t n, int64_t ldw, const float* w_scale,
                               const float* bias, float* out, int64_t ldo) {
  const int64_t kp = (k + 15) & ~int64_t(15);
  static thread_local std::vector<int16_t> q_buf;
  static thread_local std::vector<float> s_buf;
  q_buf.resize(static_cast<size_t>(m * kp));
  s_buf.resize(static_cast<size_t>(m));
  int16_t* q = q_buf.data();
  float* xs = s_buf.data();
  quantize_rows<int16_t>(x, m, k, ldx, kp, q, xs, 16);
  const int64_t blocks = (n + NR - 1) / NR;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NR;
      const int nr = static_cast<int>(std::min<int64_t>(NR, n - n0));
      const int8_t* wr[NR];
      for (int r = 0; r < nr; ++r) wr[r] = w + (n0 + r) * ldw;
      for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, m - m0));
        const int16_t* qt[MR];
        for (int t = 0; t < mr; ++t) qt[t] = q + (m0 + t) * kp;
        int32_t acc[NR][MR];
        tile_any(wr, nr, qt, mr, k, acc);
        for (int t = 0; t < mr; ++t) {
          float* o = out + (m0 + t) * ldo + n0;
          const float sx = xs[m0 + t];
          for (int r = 0; r < nr; ++r) {
            float v = (static_cast<float>(acc[r][t]) * sx) * w_scale[n0 + r];
            o[r] = bias != nullptr ? v + bias[n0 + r] : v;
          }
        }
      }
    }
  });
  return 0;
}

}  // extern "C"
