// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]): a float32 linear layer for the few rows of a
// decode step (up to a few hundred), reading the weight in place, in torch's [N, K] layout.
//
// oneDNN (torch's mkldnn linear) reorders a plain [N, K] weight into its blocked layout on every
// call, which a decode step's few rows cannot amortize (55M shapes, 64 rows: 280-350 GFLOP/s
// against ~430 with the weight prepacked). Prepacking the weight would need a second copy of it
// (or a layout of our own) that every refit, disk load and sleep must keep in step. This kernel
// needs neither: it computes the transposed product, out^T = w . x^T, vectorized over the rows
// of x instead of over the weight's outputs:
//
//   xt [K, Mp]   x transposed (Mp = M rounded up to kLanes, zero rows past M), packed per call:
//                M * K floats, small next to the weight;
//   tile         NR weight rows (outputs n .. n+NR) x kLanes * MV rows of x: per k, NR scalars of
//                the weight broadcast (each weight row is read along k, so NR sequential
//                streams) against MV vectors of xt, NR * MV accumulators in registers over all
//                of K; the tile is then transposed through a small buffer into out's rows.
//
// Every output is one sequential sum over k (one accumulator, fused multiply-adds in k order),
// so a row's result does not depend on the batch it is in or on the thread count.
//
// Threads (torch's intra-op pool, at::parallel_for) split the transpose by k and the product by
// ranges of weight rows. Plain C entry points over raw pointers, called through ctypes (which
// releases the GIL); the Python side (small_gemm.py) checks shapes and strides. Fast where
// AVX-512 is there (32 vector registers of 16 lanes, the sizes below); elsewhere the same code
// runs on 8-lane vectors, correct but not faster than oneDNN, and fast() says 0 so the caller
// keeps oneDNN.
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// One vector of kLanes floats: a zmm register where AVX-512 is there (the build this kernel is
// used in: `fast`), else 8 lanes (AVX2's ymm, or the compiler's split elsewhere): the same code,
// correct everywhere and tested everywhere, but not faster than oneDNN there.
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
constexpr int kLanes = 16, kFast = 1;
// a broadcast (vbroadcastss); `vf{} + x` would add 0 first (its -0.0 rule keeps the add)
inline vf splat(float x) { return vf(_mm512_set1_ps(x)); }
inline vf in_reg(vf v) { asm("" : "+v"(v)); return v; }
#else
typedef float vf __attribute__((vector_size(32)));
constexpr int kLanes = 8, kFast = 0;
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }
#if defined(__x86_64__)
inline vf in_reg(vf v) { asm("" : "+x"(v)); return v; }
#else
inline vf in_reg(vf v) { return v; }
#endif
#endif
// (in_reg: a vector loaded once for several FMAs stays in a register; else GCC folds the load
// into each FMA)
inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

constexpr int kMaxMV = 4;    // vectors of x rows per tile (64 rows with AVX-512)

// xt, blocked by BW = kLanes * kMaxMV rows of x: xt[(b * K + k) * BW + j] = x[(BW b + j) * ldx
// + k] for k in
// [k0, k1), zero past row M (each block's columns over all of K are one contiguous run).
#if defined(__AVX512F__)
// 16 x 16 blocks in registers: at width w = 8, 4, 2, 1, each pair of rows (i, i + w) trades
// the off-diagonal w x w blocks (bit w of the row index swapped with bit w of the column's);
// after the four rounds row c holds column c. Against the element loop below (which the
// compiler does not vectorize across rows), a one-output product, i.e. the call and the
// transpose, of 64 x 1408 / 128 x 1408 rows took 18.7 / 30.0 us instead of 24.2 / 43.5.
struct Swaps {
  __m512i lo[4], hi[4];   // per round: lanes of the pair's first row, of its second
  Swaps() {
    for (int r = 0, w = 8; r < 4; ++r, w /= 2) {
      alignas(64) int32_t l[16], h[16];
      for (int j = 0; j < 16; ++j) {
        l[j] = (j & w) ? 16 + j - w : j;   // 16 + i: lane i of the second row
        h[j] = (j & w) ? 16 + j : j + w;
      }
      lo[r] = _mm512_load_si512(l);
      hi[r] = _mm512_load_si512(h);
    }
  }
};

void transpose_rows(const float* x, int64_t M, int64_t ldx, int64_t K, int64_t k0, int64_t k1,
                    float* xt) {
  constexpr int64_t T = 16, BW = kLanes * kMaxMV;
  static const Swaps swaps;
  for (int64_t kb = k0; kb < k1; kb += T) {
    const int64_t cols = std::min(k1, kb + T) - kb;
    const __mmask16 cm = __mmask16((1u << cols) - 1);
    for (int64_t mb = 0; mb < M; mb += T) {
      const int64_t rows = std::min(M, mb + T) - mb;
      __m512 r[T];
      for (int64_t i = 0; i < T; ++i)
        r[i] = i < rows ? _mm512_maskz_loadu_ps(cm, x + (mb + i) * ldx + kb) : _mm512_setzero_ps();
      for (int round = 0, w = 8; round < 4; ++round, w /= 2) {
        for (int i = 0; i < T; ++i) {
          if (i & w) continue;
          const __m512 a = r[i], b = r[i + w];
          r[i] = _mm512_permutex2var_ps(a, swaps.lo[round], b);
          r[i + w] = _mm512_permutex2var_ps(a, swaps.hi[round], b);
        }
      }
      float* dst = xt + (mb / BW) * K * BW + mb % BW + kb * BW;
      for (int64_t c = 0; c < cols; ++c) _mm512_storeu_ps(dst + c * BW, r[c]);
    }
  }
}
#else
void transpose_rows(const float* x, int64_t M, int64_t ldx, int64_t K, int64_t k0, int64_t k1,
                    float* xt) {
  constexpr int64_t T = 16, BW = kLanes * kMaxMV;
  for (int64_t kb = k0; kb < k1; kb += T) {
    const int64_t ke = std::min(k1, kb + T);
    for (int64_t mb = 0; mb < M; mb += T) {
      float tile[T][T];
      const int64_t me = std::min(M, mb + T);
      for (int64_t m = mb; m < mb + T; ++m) {
        if (m < me) {
          for (int64_t k = kb; k < ke; ++k) tile[k - kb][m - mb] = x[m * ldx + k];
        } else {
          for (int64_t k = kb; k < ke; ++k) tile[k - kb][m - mb] = 0.0f;
        }
      }
      float* dst = xt + (mb / BW) * K * BW + mb % BW;
      for (int64_t k = kb; k < ke; ++k) std::memcpy(dst + k * BW, tile[k - kb], sizeof tile[0]);
    }
  }
}
#endif

// out rows [m0, m0 + rows) x columns [n, n + NR): the product of weight rows w[n .. n+NR) and
// xt's columns [m0, m0 + 16 * MV), over all K.
template <int NR, int MV>
void tile(const float* w, int64_t ldw, const float* xt, int64_t K, int64_t m0,
          int64_t rows, int64_t n, const float* bias, float* out, int64_t ldo) {
  vf acc[NR][MV];
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < MV; ++v) acc[i][v] = splat(0.0f);
  const float* wr[NR];
  for (int i = 0; i < NR; ++i) wr[i] = w + (n + i) * ldw;
  const float* xk = xt + m0 * K;   // block m0 / 64, contiguous over k
  // the next tile's weight rows (contiguous when ldw == K), a line every other k, into L1;
  // where there is nothing to fetch (later blocks of x rows: the rows are in L1 already) the
  // prefetches walk this tile's own first row instead
  const char* pf = reinterpret_cast<const char*>(
      m0 == 0 && ldw == K ? w + (n + NR) * ldw : w + n * ldw);
  const int64_t pf_lines = m0 == 0 && ldw == K ? (NR * K * 4 + 63) / 64 : (K * 4 + 63) / 64;
  auto step = [&](int64_t k) {
    vf xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = in_reg(loadv(xk + kLanes * kMaxMV * k + kLanes * v));
    for (int i = 0; i < NR; ++i) {
      const vf s = splat(wr[i][k]);
      for (int v = 0; v < MV; ++v) acc[i][v] += s * xv[v];
    }
  };
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    __builtin_prefetch(pf + std::min((k >> 1), pf_lines - 1) * 64, 0, 3);
    step(k);
    step(k + 1);
  }
  if (k < K) step(k);
  alignas(64) float buf[NR][kLanes * MV];
  for (int i = 0; i < NR; ++i) {
    const vf b = splat(bias ? bias[n + i] : 0.0f);
    for (int v = 0; v < MV; ++v) storev(&buf[i][kLanes * v], acc[i][v] + b);
  }
  for (int64_t m = 0; m < rows; ++m) {
    float* o = out + (m0 + m) * ldo + n;
    for (int i = 0; i < NR; ++i) o[i] = buf[i][m];
  }
}

template <int NR>
void tile_any(int mv, const float* w, int64_t ldw, const float* xt, int64_t K,
              int64_t m0, int64_t rows, int64_t n, const float* bias, float* out, int64_t ldo) {
  switch (mv) {
    case 4: tile<NR, 4>(w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
    case 3: tile<NR, 3>(w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
    case 2: tile<NR, 2>(w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
    default: tile<NR, 1>(w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
  }
}

constexpr int kNR = 6;       // weight rows per tile: 6 x 4 = 24 accumulators of 32 registers

// Weight rows [n0, n1): tiles of kNR rows (a narrower one at the end), each over every block
// of 64 x rows (the weight rows stay in L1 while xt's blocks stream from L2).
void rows_range(const float* w, int64_t ldw, const float* xt, int64_t M, int64_t Mp, int64_t K,
                int64_t n0, int64_t n1, const float* bias, float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; n += kNR) {
    const int64_t nr = std::min<int64_t>(kNR, n1 - n);
    for (int64_t m0 = 0; m0 < M; m0 += kLanes * kMaxMV) {
      const int mv = int(std::min<int64_t>(kMaxMV, (Mp - m0) / kLanes));
      const int64_t rows = std::min<int64_t>(kLanes * kMaxMV, M - m0);
      switch (nr) {
        case 6: tile_any<6>(mv, w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
        case 5: tile_any<5>(mv, w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
        case 4: tile_any<4>(mv, w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
        case 3: tile_any<3>(mv, w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
        case 2: tile_any<2>(mv, w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
        default: tile_any<1>(mv, w, ldw, xt, K, m0, rows, n, bias, out, ldo); break;
      }
    }
  }
}

}  // namespace

// 1 where this build is the fast one (AVX-512): the caller uses it only then
extern "C" int rollout_engine_small_gemm_fast() { return kFast; }

// x [M, K] (row stride ldx), w [N, K] (row stride ldw), bias [N] or null, out [M, N] (row
// stride ldo); the caller checks M, N, K > 0 and the strides. Returns 0.
extern "C" int rollout_engine_small_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx,
                                             const float* w, int64_t N, int64_t ldw,
                                             const float* bias, float* out, int64_t ldo) {
  const int64_t BW = kLanes * kMaxMV, Mp = (M + kLanes - 1) / kLanes * kLanes;
  static thread_local std::vector<float> xt_buf;
  if (int64_t(xt_buf.size()) < K * (Mp + BW)) xt_buf.resize(K * (Mp + BW));
  float* xt = xt_buf.data();
  at::parallel_for(0, K, 64, [&](int64_t k0, int64_t k1) {
    transpose_rows(x, M, ldx, K, k0, k1, xt);
  });
  const int64_t tiles = (N + kNR - 1) / kNR;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    rows_range(w, ldw, xt, M, Mp, K, t0 * kNR, std::min(N, t1 * kNR), bias, out, ldo);
  });
  return 0;
}

extern "C" int rollout_engine_small_gemm_abi() { return 2; }
