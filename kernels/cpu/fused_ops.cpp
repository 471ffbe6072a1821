// Fused elementwise ops of the decoder on CPU (float32), each one pass over its rows instead of
// the 4-8 separate torch ops (and temporaries) of the reference (rollout_engine/models/layers):
//
//   rmsnorm          out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps)
//   add_rmsnorm      residual[t] += x[t]; out[t] = rmsnorm(residual[t])   (vLLM's fused_add_rms_norm)
//   rope             q[t, h], k[t, h] rotated in place (neox / HF rotate_half) by cos/sin[t]
//   rope_store       rope of q in place, of k into the KV pool's slot, v copied there (decode)
//   silu_mul         out[t] = silu(gu[t, :I]) * gu[t, I:]
//   sample_rows      per row of logits: the next token (inverse CDF of softmax(x / T) with
//                    min-p, or the argmax) and its logprob log_softmax(x / T)[token], in one
//                    pass over the row and no [B, V] output (rollout_engine/sampler.py)
//
// Rows may be strided (q and k are views into the fused qkv output). Work is split over rows on
// torch's intra-op pool (at::parallel_for). Plain C entry points over raw pointers, called through
// ctypes like paged_decode.cpp; only <ATen/Parallel.h> is included, so the build stays short.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <queue>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16f splat16(float x) {
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = x;
  return v;
}

// exp for x <= 0, Cephes' expf polynomial (~1 ulp; below -87 it gives ~1e-38, not 0). 16 lanes:
// one zmm register with AVX-512 (twice fewer instructions than 8), split by the compiler
// elsewhere.
inline v16f exp16_nonpos(v16f x) {
  const v16f lo = splat16(-87.0f);
  x = x < lo ? lo : x;
  const v16f magic = splat16(12582912.0f);
  v16f n = (x * 1.44269504088896341f + magic) - magic;
  v16f r = x - n * 0.693359375f - n * -2.12194440e-4f;
  v16f p = splat16(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Grain: rows per task, so a task holds at least ~16K elements.
inline int64_t grain(int64_t cols) { return cols >= 16384 ? 1 : 16384 / cols; }

// 1 / sqrt(mean(x^2) + eps): squares summed in 16 float lanes, the lanes added in double.
inline float inv_rms(const float* x, int64_t n, float eps) {
  double s = 0.0;
  int64_t i = 0;
  v8f acc0 = splat(0.0f), acc1 = splat(0.0f);
  for (; i + 16 <= n; i += 16) {
    v8f a = load8(x + i), b = load8(x + i + 8);
    acc0 += a * a;
    acc1 += b * b;
  }
  v8f acc = acc0 + acc1;
  for (int j = 0; j < 8; ++j) s += acc[j];
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(s / static_cast<double>(n));
  return 1.0f / std::sqrt(mean + eps);
}

// out = w * (x * r): the reference rounds x * r to float, then multiplies by w.
inline void scale_row(const float* x, const float* w, float r, float* out, int64_t n) {
  int64_t i = 0;
  const v8f rv = splat(r);
  for (; i + 8 <= n; i += 8) store8(out + i, load8(w + i) * (load8(x + i) * rv));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// out = x rotated by cos/sin (one head of d dims; out may be x): see rollout_engine_rope_f32.
inline void rotate_head(const float* x, const float* c, const float* s, int64_t d, float* out) {
  const int64_t half = d / 2;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const v8f x1 = load8(x + i), x2 = load8(x + half + i), cv = load8(c + i), sv = load8(s + i);
    store8(out + i, x1 * cv - x2 * sv);
    store8(out + half + i, x2 * cv + x1 * sv);
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    out[i] = x1 * c[i] - x2 * s[i];
    out[half + i] = x2 * c[i] + x1 * s[i];
  }
}

}  // namespace

extern "C" {

// Bumped whenever an entry point's arguments change: fused_ops.py refuses a library built from
// another version (a stale cache) instead of calling it with the wrong arguments.
int rollout_engine_fused_ops_abi() { return 5; }

// x [rows, n] (row stride x_stride) -> out [rows, n] contiguous.
int rollout_engine_rmsnorm_f32(const float* x, const float* w, float* out, int64_t rows,
                               int64_t n, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* xr = x + t * x_stride;
      scale_row(xr, w, inv_rms(xr, n, eps), out + t * n, n);
    }
  });
  return 0;
}

// residual [rows, n] += x [rows, n]; out = rmsnorm(residual). All contiguous.
int rollout_engine_add_rmsnorm_f32(const float* x, float* residual, const float* w, float* out,
                                   int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* xr = x + t * n;
      float* rr = residual + t * n;
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) store8(rr + i, load8(xr + i) + load8(rr + i));
      for (; i < n; ++i) rr[i] = xr[i] + rr[i];
      scale_row(rr, w, inv_rms(rr, n, eps), out + t * n, n);
    }
  });
  return 0;
}

// Rotate heads [t, h, 0:D) of q (hq heads) and k (hk heads) in place; token t of q starts at
// q + t * q_stride, head h at + h * D (likewise k). cos/sin [T, D] (contiguous; HF's
// cat(freqs, freqs), so only the first half is read):
//   x'[i] = x[i] cos[i] - x[i + D/2] sin[i];  x'[i + D/2] = x[i + D/2] cos[i] + x[i] sin[i]
int rollout_engine_rope_f32(float* q, float* k, const float* cos, const float* sin,
                            int64_t tokens, int64_t hq, int64_t hk, int64_t d,
                            int64_t q_stride, int64_t k_stride) {
  at::parallel_for(0, tokens, grain((hq + hk) * d), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t h = 0; h < hq + hk; ++h) {
        float* x = h < hq ? q + t * q_stride + h * d : k + t * k_stride + (h - hq) * d;
        rotate_head(x, cos + t * d, sin + t * d, d, x);
      }
    }
  });
  return 0;
}

// A decode step's rope and KV write in one pass: q rotated in place as rope does; k rotated
// into k_pool[loc[t]] and v copied into v_pool[loc[t]] (pools [num_slots, hk, D] contiguous),
// which is what rope then KVPool.set_kv leave there (k in qkv is left unrotated: the caller
// reads K only from the pool). Returns 1 with nothing written if a loc is out of range.
int rollout_engine_rope_store_f32(float* q, const float* k, const float* v, const float* cos,
                                  const float* sin, int64_t tokens, int64_t hq, int64_t hk,
                                  int64_t d, int64_t stride, const int64_t* loc, float* k_pool,
                                  float* v_pool, int64_t num_slots) {
  for (int64_t t = 0; t < tokens; ++t)
    if (loc[t] < 0 || loc[t] >= num_slots) return 1;
  const int64_t row = hk * d;
  at::parallel_for(0, tokens, grain((hq + 2 * hk) * d), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* c = cos + t * d;
      const float* s = sin + t * d;
      for (int64_t h = 0; h < hq; ++h) {
        float* x = q + t * stride + h * d;
        rotate_head(x, c, s, d, x);
      }
      float* kd = k_pool + loc[t] * row;
      for (int64_t h = 0; h < hk; ++h) rotate_head(k + t * stride + h * d, c, s, d, kd + h * d);
      std::memcpy(v_pool + loc[t] * row, v + t * stride, row * sizeof(float));
    }
  });
  return 0;
}

// gu [rows, 2 * n] -> out [rows, n] = silu(gu[:, :n]) * gu[:, n:]; silu(g) = g / (1 + e^-g),
// computed from e = e^-|g| <= 1 so the exponent never overflows.
int rollout_engine_silu_mul_f32(const float* gu, float* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(n), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* g = gu + t * 2 * n;
      const float* u = g + n;
      float* o = out + t * n;
      int64_t i = 0;
      const v16f one = splat16(1.0f), zero = splat16(0.0f);
      for (; i + 16 <= n; i += 16) {
        v16f x, up;
        std::memcpy(&x, g + i, sizeof x);
        std::memcpy(&up, u + i, sizeof up);
        v16f neg = x < zero ? x : -x;                     // -|x|
        v16f e = exp16_nonpos(neg);
        v16f num = x < zero ? x * e : x;                  // x e^x / (1 + e^x) for x < 0
        v16f res = (num / (one + e)) * up;
        std::memcpy(o + i, &res, sizeof res);
      }
      for (; i < n; ++i) {
        const float x = g[i];
        const float e = std::exp(-std::fabs(x));
        o[i] = ((x < 0.0f ? x * e : x) / (1.0f + e)) * u[i];
      }
    }
  });
  return 0;
}

}  // extern "C"

namespace {

// One row of sample_rows. x: the row's logits (vocab v); t > 0 its temperature (1 for greedy
// rows: their logprob is then log_softmax(x)); u in [0, 1) its uniform; e: scratch of v floats
// (written for top-k rows only: the others compute their target's block again); blocks: of
// v / kBlock + 1. The main pass is specialised on the row's options (MainPass: a plain row runs
// no min-p / top-k selects) and keeps four running maxima. The logprob is computed as torch's
// log_softmax does, (x/t - max) - log(sum exp(x/t - max)). Sampling is by inverse CDF over e_i = exp(x_i/t - max)
// (the unnormalised softmax; min-p drops e_i < min_p, the max being e = 1) in vocabulary order:
// float sums of kBlock entries, added in double, so the target u * total lands on a kept token.
constexpr int64_t kBlock = 256;   // entries per float partial sum of the inverse CDF

inline double hsum16(v16f a) {
  double s = 0.0;
  for (int j = 0; j < 16; ++j) s += a[j];
  return s;
}

// The k-th largest of x[0:v) (with multiplicity) and how many of the k largest equal it: a
// min-heap of the k largest so far, touched only by entries above its minimum (for unsorted
// logits, ~k ln(v / k) of them), the rest skipped 16 at a time.
void kth_largest(const float* x, int64_t v, int64_t k, float* tau, int64_t* ties) {
  std::priority_queue<float, std::vector<float>, std::greater<float>> heap;
  const int64_t full = v / 16 * 16;
  for (int64_t i = 0; i < v; i += 16) {
    if (i < full && static_cast<int64_t>(heap.size()) == k) {
      v16f xi;
      std::memcpy(&xi, x + i, sizeof xi);
      const v16i above = xi > splat16(heap.top());
      int32_t any = 0;
      for (int j = 0; j < 16; ++j) any |= above[j];
      if (any == 0) continue;
    }
    const int64_t end = i + 16 < v ? i + 16 : v;
    for (int64_t j = i; j < end; ++j) {
      if (static_cast<int64_t>(heap.size()) < k) {
        heap.push(x[j]);
      } else if (x[j] > heap.top()) {
        heap.pop();
        heap.push(x[j]);
      }
    }
  }
  *tau = heap.top();
  int64_t equal = 0;
  while (!heap.empty() && heap.top() == *tau) {
    ++equal;
    heap.pop();
  }
  *ties = equal;
}

// sample_row's pass over x[0:full) (whole vectors): e_i = exp(x_i / t - m), 0 for a -inf
// entry; returns their sum (float within a block of kBlock, double across blocks). A sampled
// row (kSampled) also sums, per block, the entries it keeps into blocks[0:*nb): those not cut
// by min-p (kCut) nor by top-k (kTopk: those rows' kept entries stored in e, for the tied
// entries to come back). The row's options are template arguments so that a plain row
// (T = 1, no min-p, no top-k: a GRPO rollout's) runs none of their per-entry selects, and its
// kept sums are its sums (the same vector): the same values as with every select in place.
// *tail: the kept entries of the last, partial block (float).
struct MainPass {
  const float* x;
  int64_t full;
  float t, m, cut, tau;
  float* e;
  float* blocks;
  const float* next;   // the next row: into L2 one cache line per 16 entries (may be null)

  template <bool kScale, bool kSampled, bool kCut, bool kTopk>
  double run(int64_t* nb, float* tail) const {
    const v16f mv = splat16(m), tv = splat16(t), cutv = splat16(cut), tauv = splat16(tau);
    const v16f zero = splat16(0.0f), ninf = splat16(-INFINITY);
    constexpr bool kSeparate = kCut || kTopk;   // else the kept entries are all of them
    v16f acc = zero, kept = zero;
    double sum = 0.0;
    for (int64_t i = 0; i < full; i += 16) {
      if (next) __builtin_prefetch(next + i, 0, 2);
      v16f xi;
      std::memcpy(&xi, x + i, sizeof xi);
      const v16f raw = xi;
      if constexpr (kScale) xi = xi / tv;
      v16f ei = exp16_nonpos(xi - mv);
      ei = xi == ninf ? zero : ei;   // a banned (-inf) token: probability 0, not ~1e-38
      acc += ei;
      if constexpr (kSeparate) {
        if constexpr (kCut) ei = ei < cutv ? zero : ei;
        if constexpr (kTopk) {
          ei = raw > tauv ? ei : zero;   // the tied entries come back in sample_row
          std::memcpy(e + i, &ei, sizeof ei);
        }
        kept += ei;
      }
      if ((i + 16) % kBlock == 0) {
        const double s = hsum16(acc);
        sum += s;
        acc = zero;
        if constexpr (kSampled) {
          blocks[(*nb)++] = static_cast<float>(kSeparate ? hsum16(kept) : s);
          kept = zero;
        }
      }
    }
    const double s = hsum16(acc);
    *tail = static_cast<float>(kSeparate ? hsum16(kept) : s);
    return sum + s;
  }
};

// Top-k (tau > -inf): only entries x > tau are sampled, and the first `ties` entries x == tau
// in id order (tau the k-th largest logit: the set a stable descending sort keeps).
// m_out / sum_out (may be null): the row's max(x / t) and sum of exp(x / t - max).
void sample_row(const float* x, int64_t v, float t, float min_p, double u, bool greedy,
                float* e, float* blocks, int64_t* token, float* logprob, float tau = -INFINITY,
                int64_t ties = 0, float* m_out = nullptr, double* sum_out = nullptr,
                const float* next = nullptr) {
  const bool topk = tau > -INFINITY && !greedy;
  const v16f tauv = splat16(tau);
  const bool scale = t != 1.0f;
  const int64_t full = v / 16 * 16;
  // the raw max (four running maxima: one would wait on its own latency at every vector),
  // then its first index (ties: the lowest id, as torch.argmax)
  v16f mx4[4] = {splat16(-INFINITY), splat16(-INFINITY), splat16(-INFINITY),
                 splat16(-INFINITY)};
  int64_t i4 = 0;
  for (; i4 + 64 <= full; i4 += 64) {
    for (int k = 0; k < 4; ++k) {
      v16f xi;
      std::memcpy(&xi, x + i4 + 16 * k, sizeof xi);
      mx4[k] = xi > mx4[k] ? xi : mx4[k];
    }
  }
  for (; i4 < full; i4 += 16) {
    v16f xi;
    std::memcpy(&xi, x + i4, sizeof xi);
    mx4[0] = xi > mx4[0] ? xi : mx4[0];
  }
  v16f mx16 = mx4[0];
  for (int k = 1; k < 4; ++k) mx16 = mx4[k] > mx16 ? mx4[k] : mx16;
  float mx = -INFINITY;
  for (int j = 0; j < 16; ++j) mx = mx16[j] > mx ? mx16[j] : mx;
  for (int64_t i = full; i < v; ++i) mx = x[i] > mx ? x[i] : mx;
  // the argmax: the greedy token, and a sampled row's fallback (rare: only when rounding
  // leaves no token past the target), so sampled rows look for it only then
  auto argmax = [&]() {
    int64_t arg = 0;
    const v16f mxv = splat16(mx);
    while (arg + 16 <= full) {   // the first block of 16 holding the max, then its entry
      v16f xi;
      std::memcpy(&xi, x + arg, sizeof xi);
      v16i eq = xi == mxv;
      bool any = false;
      for (int j = 0; j < 16; ++j) any |= eq[j] != 0;
      if (any) break;
      arg += 16;
    }
    while (arg < v - 1 && !(x[arg] == mx)) ++arg;
    return arg;
  };
  const float m = scale ? mx / t : mx;   // x / t is monotonic: max(x / t) == max(x) / t
  const float cut = min_p > 0.0f ? min_p : 0.0f;
  const v16f mv = splat16(m), tv = splat16(t), cutv = splat16(cut), zero = splat16(0.0f);
  const v16f ninf = splat16(-INFINITY);
  double sum = 0.0;   // of every e_i: float within a block of kBlock, double across blocks
  int64_t nb = 0;
  float tail;
  const MainPass pass{x, full, t, m, cut, tau, e, blocks, next};
  if (greedy)
    sum = scale ? pass.run<true, false, false, false>(&nb, &tail)
                : pass.run<false, false, false, false>(&nb, &tail);
  else if (topk)
    sum = scale ? pass.run<true, true, true, true>(&nb, &tail)
                : pass.run<false, true, true, true>(&nb, &tail);
  else if (cut > 0.0f)
    sum = scale ? pass.run<true, true, true, false>(&nb, &tail)
                : pass.run<false, true, true, false>(&nb, &tail);
  else
    sum = scale ? pass.run<true, true, false, false>(&nb, &tail)
                : pass.run<false, true, false, false>(&nb, &tail);
  for (int64_t i = full; i < v; ++i) {
    const float ei = x[i] == -INFINITY ? 0.0f : std::exp((scale ? x[i] / t : x[i]) - m);
    sum += ei;
    const float kept_i = ei < cut || (topk && !(x[i] > tau)) ? 0.0f : ei;
    if (topk) e[i] = kept_i;
    tail += kept_i;
  }
  if (nb * kBlock < v) blocks[nb++] = tail;
  // top-k: the first `ties` entries equal to tau, in id order, are kept too
  for (int64_t i = 0; topk && ties > 0 && i < v; i += 16) {
    const int64_t end = i + 16 < v ? i + 16 : v;
    if (end - i == 16) {
      v16f xi;
      std::memcpy(&xi, x + i, sizeof xi);
      const v16i eq = xi == tauv;
      int32_t any = 0;
      for (int j = 0; j < 16; ++j) any |= eq[j];
      if (any == 0) continue;
    }
    for (int64_t j = i; j < end && ties > 0; ++j) {
      if (!(x[j] == tau)) continue;
      --ties;
      const float ej = std::exp((scale ? x[j] / t : x[j]) - m);
      e[j] = ej < cut ? 0.0f : ej;
      blocks[j / kBlock] += e[j];
    }
  }
  int64_t tok = greedy ? argmax() : -1;
  if (!greedy) {
    double total = 0.0;
    for (int64_t b = 0; b < nb; ++b) total += blocks[b];
    const double target = u * total;
    double run = 0.0;
    for (int64_t b = 0; b < nb; ++b) {
      if (run + blocks[b] > target) {
        const int64_t lo = b * kBlock, hi = lo + kBlock < v ? lo + kBlock : v;
        // without top-k the entries were not stored: the target's block is computed again,
        // lane for lane as above (lo is a multiple of 16), so to the same values
        float again[kBlock];
        const float* eb = e + lo;
        if (!topk) {
          int64_t i = lo;
          for (; i < hi && i < full; i += 16) {
            v16f xi;
            std::memcpy(&xi, x + i, sizeof xi);
            if (scale) xi = xi / tv;
            v16f ei = exp16_nonpos(xi - mv);
            ei = xi == ninf ? zero : ei;
            ei = ei < cutv ? zero : ei;
            std::memcpy(again + (i - lo), &ei, sizeof ei);
          }
          for (; i < hi; ++i) {
            const float ei = x[i] == -INFINITY ? 0.0f : std::exp((scale ? x[i] / t : x[i]) - m);
            again[i - lo] = ei < cut ? 0.0f : ei;
          }
          eb = again;
        }
        double inner = run;
        int64_t last = -1;
        tok = -1;
        for (int64_t j = lo; j < hi && tok < 0; ++j) {
          const float ej = eb[j - lo];
          if (ej > 0.0f) last = j;
          inner += ej;
          if (ej > 0.0f && inner > target) tok = j;
        }
        if (tok < 0) tok = last;   // float rounding inside the block: its last kept token
        break;
      }
      run += blocks[b];
    }
    if (tok < 0) tok = argmax();   // u * total past every block (rounding): the most likely
  }
  const float xt = scale ? x[tok] / t : x[tok];
  *token = tok;
  *logprob = (xt - m) - static_cast<float>(std::log(sum));
  if (m_out) *m_out = m;
  if (sum_out) *sum_out = sum;
}

// log_softmax(x / t)[tok], computed as sample_row computes it.
float logprob_of(const float* x, int64_t v, float t, int64_t tok) {
  const bool scale = t != 1.0f;
  float mx = -INFINITY;
  for (int64_t i = 0; i < v; ++i) mx = x[i] > mx ? x[i] : mx;
  const float m = scale ? mx / t : mx;
  const int64_t full = v / 16 * 16;
  const v16f mv = splat16(m), tv = splat16(t), zero = splat16(0.0f), ninf = splat16(-INFINITY);
  double sum = 0.0;
  v16f acc = zero;
  for (int64_t i = 0; i < full; i += 16) {
    v16f xi;
    std::memcpy(&xi, x + i, sizeof xi);
    if (scale) xi = xi / tv;
    const v16f ei = exp16_nonpos(xi - mv);
    acc += xi == ninf ? zero : ei;
    if ((i + 16) % kBlock == 0) {
      sum += hsum16(acc);
      acc = zero;
    }
  }
  sum += hsum16(acc);
  for (int64_t i = full; i < v; ++i)
    sum += x[i] == -INFINITY ? 0.0f : std::exp((scale ? x[i] / t : x[i]) - m);
  return ((scale ? x[tok] / t : x[tok]) - m) - static_cast<float>(std::log(sum));
}

}  // namespace

extern "C" {

// logits [rows, v] (row stride ld) -> tokens [rows] int64, logprobs [rows] float32; per row its
// temperature t (> 0), min-p, uniform u (double) and greedy flag (uint8). Penalties (pen_offsets
// null: none): row r samples from its logits with entries pen_ids[k] set to pen_values[k] for k
// in [pen_offsets[r], pen_offsets[r + 1]) (penalised logits; -inf bans), later entries winning;
// its logprob stays that of the unpenalised row. Top-k (top_ks null: none; k >= v: none; a
// penalised row must have none): only row r's top_ks[r] largest logits, ties by lowest id.
int rollout_engine_sample_rows_f32(const float* logits, int64_t rows, int64_t v, int64_t ld,
                                   const float* temps, const float* min_ps,
                                   const double* uniforms, const uint8_t* greedy,
                                   const int64_t* pen_offsets, const int64_t* pen_ids,
                                   const float* pen_values, const int64_t* top_ks,
                                   int64_t* tokens, float* logprobs) {
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch(static_cast<size_t>(v));
    std::vector<float> blocks(static_cast<size_t>(v / kBlock + 1));
    std::vector<float> patched;
    for (int64_t r = lo; r < hi; ++r) {
      const float* x = logits + r * ld;
      const int64_t p0 = pen_offsets ? pen_offsets[r] : 0;
      const int64_t p1 = pen_offsets ? pen_offsets[r + 1] : 0;
      if (p0 == p1) {
        float tau = -INFINITY;
        int64_t ties = 0;
        if (top_ks && top_ks[r] < v && greedy[r] == 0) kth_largest(x, v, top_ks[r], &tau, &ties);
        sample_row(x, v, temps[r], min_ps[r], uniforms[r], greedy[r] != 0, scratch.data(),
                   blocks.data(), tokens + r, logprobs + r, tau, ties, nullptr, nullptr,
                   r + 1 < hi ? logits + (r + 1) * ld : nullptr);
        continue;
      }
      patched.assign(x, x + v);
      for (int64_t k = p0; k < p1; ++k) patched[static_cast<size_t>(pen_ids[k])] = pen_values[k];
      float unused, m;
      double sum;
      sample_row(patched.data(), v, temps[r], min_ps[r], uniforms[r], greedy[r] != 0,
                 scratch.data(), blocks.data(), tokens + r, &unused, -INFINITY, 0, &m, &sum);
      // the unpenalised normaliser from the penalised one: swap each patched entry's term
      // back (relative to the same m); a full pass only if that would cancel badly
      const float t = temps[r];
      auto term = [&](float value) {
        return value == -INFINITY ? 0.0 : std::exp(static_cast<double>(value / t - m));
      };
      double removed = 0.0, added = 0.0;
      for (int64_t k = p0; k < p1; ++k) {
        const size_t id = static_cast<size_t>(pen_ids[k]);
        if (patched[id] == x[id]) continue;   // unchanged, or already swapped back
        removed += term(patched[id]);
        added += term(x[id]);
        patched[id] = x[id];
      }
      const double s_orig = sum - removed + added;
      const int64_t tok = tokens[r];
      const double lp = static_cast<double>(x[tok] / t - m) - std::log(s_orig);
      logprobs[r] = removed < 0.5 * sum && s_orig > 0.0 ? static_cast<float>(lp)
                                                        : logprob_of(x, v, t, tok);
    }
  });
  return 0;
}

// The logprob sample_rows returns for row r had it drawn tokens[r]: the same pass over the row
// (sample_row with the row's temperature, min-p, greedy flag and top-k), the same max m and
// normaliser, the same final expression, so bit for bit the engine's (no penalties here).
// A trainer scores the sampled tokens with it (trainer_bridge/on_policy.py).
int rollout_engine_token_logprobs_f32(const float* logits, int64_t rows, int64_t v, int64_t ld,
                                      const float* temps, const float* min_ps,
                                      const uint8_t* greedy, const int64_t* top_ks,
                                      const int64_t* tokens, float* logprobs) {
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch(static_cast<size_t>(v));
    std::vector<float> blocks(static_cast<size_t>(v / kBlock + 1));
    for (int64_t r = lo; r < hi; ++r) {
      const float* x = logits + r * ld;
      float tau = -INFINITY;
      int64_t ties = 0;
      if (top_ks && top_ks[r] < v && greedy[r] == 0) kth_largest(x, v, top_ks[r], &tau, &ties);
      int64_t drawn;
      float unused, m;
      double sum;
      const float t = temps[r];
      sample_row(x, v, t, min_ps[r], 0.5, greedy[r] != 0, scratch.data(), blocks.data(), &drawn,
                 &unused, tau, ties, &m, &sum);
      const float xt = t != 1.0f ? x[tokens[r]] / t : x[tokens[r]];
      logprobs[r] = (xt - m) - static_cast<float>(std::log(sum));
    }
  });
  return 0;
}

}  // extern "C"
