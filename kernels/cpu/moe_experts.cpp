// The experts of a mixture-of-experts layer on a decode step's few rows per expert, float32:
//
//   act[r, j] = silu(x[r] . w13[e, j]) * (x[r] . w13[e, I + j])      j in [0, I)
//   y[r, n]   = act[r] . w2[e, n]                                     n in [0, H)
//
// for every row r of expert e's run [offsets[e], offsets[e + 1]) of x (rows sorted by expert).
// At a decode step each expert sees a few rows, so the work is reading every used expert's
// weights once: one call runs all experts, the weights read in place in torch's [N, K] layout
// (w13 [E, 2I, H], w2 [E, H, I]), threads (torch's intra-op pool) over (expert, block of
// outputs) tasks, in two phases (gate/up, then down). Per task, a block of up to kRows rows of x
// against two weight rows at once (gate/up: row j and row I + j, so silu * up is written at
// once; down: two outputs): per k-vector two weight loads and kRows x loads for 2 kRows fused
// multiply-adds, every accumulator in a register (at 16 rows an expert, a batch of 256 tokens,
// 15% faster than one weight row a pass; at a batch of 64 the weights' reads set the time).
//
// Every output is one sum in a fixed order: lane l of the accumulator sums k = l, l + L, ...
// in k order, the lanes are added in a fixed tree, then the K % L tail in k order. So a row's
// result does not depend on how many rows its expert has, on the other rows, or on threads.
//
// Plain C entry points over raw pointers, called through ctypes (which releases the GIL); the
// Python side (moe_experts.py) checks shapes.
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
constexpr int kLanes = 16;
#else
typedef float vf __attribute__((vector_size(32)));
constexpr int kLanes = 8;
#endif
constexpr int kRows = 4;          // rows of x per pass over the weight rows
constexpr int64_t kBlock = 32;    // outputs per task

inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }

// a * b + c, fused where the CPU has it. The library is built with -ffp-contract=off: the
// compiler would otherwise fuse some of the expressions and not others depending on how a
// loop was unrolled, and a row's bits would follow its expert's row count.
inline vf fma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return vf(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(__FMA__)
  return vf(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  return a * b + c;
#endif
}

inline float hsum(vf v) {   // a fixed tree: halves added until one lane is left
  float a[kLanes];
  std::memcpy(a, &v, sizeof v);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

// out_j[r] = x[r] . w_j for the N rows of x (row stride ldx) and the J weight rows w_j, over
// K, in one pass: per k-vector J weight loads and N x loads for J * N fused multiply-adds, every
// accumulator in a register (N and J are compile-time, so the loops unroll fully). Each output
// is the same sum whatever N and J are: lanes in k order, the fixed tree, the tail in k order.
template <int N, int J>
inline void dots_nj(const float* x, int64_t ldx, const float* const* w, int64_t K,
                    float* const* out) {
  vf acc[J][N] = {};
  const int64_t kv = K - K % kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    vf wv[J];
    for (int j = 0; j < J; ++j) wv[j] = loadv(w[j] + k);
    for (int r = 0; r < N; ++r) {
      const vf xv = loadv(x + r * ldx + k);
      for (int j = 0; j < J; ++j) acc[j][r] = fma(wv[j], xv, acc[j][r]);
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int r = 0; r < N; ++r) {
      float sum = hsum(acc[j][r]);
      for (int64_t k = kv; k < K; ++k) sum += x[r * ldx + k] * w[j][k];
      out[j][r] = sum;
    }
  }
}

// dots_nj for a run of n <= kRows rows.
template <int J>
inline void dots(const float* x, int64_t ldx, int n, const float* const* w, int64_t K,
                 float* const* out) {
  switch (n) {
    case 1: dots_nj<1, J>(x, ldx, w, K, out); break;
    case 2: dots_nj<2, J>(x, ldx, w, K, out); break;
    case 3: dots_nj<3, J>(x, ldx, w, K, out); break;
    default: dots_nj<4, J>(x, ldx, w, K, out); break;
  }
}

struct Task { int64_t expert, first; };

// Tasks of blocks of `outputs` for every expert with rows.
std::vector<Task> tasks_of(const int64_t* offsets, int64_t E, int64_t outputs) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < E; ++e)
    if (offsets[e + 1] > offsets[e])
      for (int64_t j = 0; j < outputs; j += kBlock) tasks.push_back({e, j});
  return tasks;
}

}  // namespace

extern "C" {

int rollout_engine_moe_experts_abi() { return 3; }

// out[i] = 1 / (1 + exp(-x[i])), each element by the same scalar code (torch's elementwise
// sigmoid takes whole vectors and leaves the remainder to scalar code that rounds differently,
// so an element's bits follow its position in the tensor).
void rollout_engine_moe_sigmoid_f32(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = 1.0f / (1.0f + std::exp(-x[i]));
}

// xs [R, H] rows sorted by expert, offsets [E + 1]; act [R, I] scratch; ys [R, H] out.
int rollout_engine_moe_experts_f32(const float* xs, int64_t H, const float* w13,
                                   const float* w2, int64_t I, const int64_t* offsets,
                                   int64_t E, float* act, float* ys) {
  const std::vector<Task> up = tasks_of(offsets, E, I);
  at::parallel_for(0, (int64_t)up.size(), 1, [&](int64_t t0, int64_t t1) {
    float g[kRows], u[kRows];
    for (int64_t t = t0; t < t1; ++t) {
      const Task task = up[t];
      const float* we = w13 + task.expert * 2 * I * H;
      const int64_t j1 = std::min(I, task.first + kBlock);
      for (int64_t r0 = offsets[task.expert]; r0 < offsets[task.expert + 1]; r0 += kRows) {
        const int n = (int)std::min<int64_t>(kRows, offsets[task.expert + 1] - r0);
        for (int64_t j = task.first; j < j1; ++j) {
          const float* rows[2] = {we + j * H, we + (I + j) * H};
          float* outs[2] = {g, u};
          dots<2>(xs + r0 * H, H, n, rows, H, outs);
          for (int r = 0; r < n; ++r)
            act[(r0 + r) * I + j] = g[r] / (1.0f + std::exp(-g[r])) * u[r];
        }
      }
    }
  });
  const std::vector<Task> down = tasks_of(offsets, E, H);
  at::parallel_for(0, (int64_t)down.size(), 1, [&](int64_t t0, int64_t t1) {
    float y0[kRows], y1[kRows];
    for (int64_t t = t0; t < t1; ++t) {
      const Task task = down[t];
      const float* we = w2 + task.expert * H * I;
      const int64_t n1 = std::min(H, task.first + kBlock);
      for (int64_t r0 = offsets[task.expert]; r0 < offsets[task.expert + 1]; r0 += kRows) {
        const int n = (int)std::min<int64_t>(kRows, offsets[task.expert + 1] - r0);
        int64_t o = task.first;
        for (; o + 1 < n1; o += 2) {   // two outputs a pass
          const float* rows[2] = {we + o * I, we + (o + 1) * I};
          float* outs[2] = {y0, y1};
          dots<2>(act + r0 * I, I, n, rows, I, outs);
          for (int r = 0; r < n; ++r) {
            ys[(r0 + r) * H + o] = y0[r];
            ys[(r0 + r) * H + o + 1] = y1[r];
          }
        }
        if (o < n1) {
          const float* rows[1] = {we + o * I};
          float* outs[1] = {y0};
          dots<1>(act + r0 * I, I, n, rows, I, outs);
          for (int r = 0; r < n; ++r) ys[(r0 + r) * H + o] = y0[r];
        }
      }
    }
  });
  return 0;
}

}  // extern "C"
