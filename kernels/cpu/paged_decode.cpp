// Paged decode attention on CPU: one query token per request, K/V read in place from the
// token pool, with shared-prefix (cascade) attention for rows whose slot rows share a prefix.
//
// Layout (float32, contiguous):
//   q      [B, Hq, D]                 query of each decode row
//   k, v   [num_slots + 1, Hkv, D]    one layer's pool buffers, indexed by slot
//   table  [R, C] int64               req_to_token: table[row, pos] = slot
//
// Work is split into tasks, taken by torch's intra-op threads (at::parallel_for, so
// torch.set_num_threads applies) one at a time from a shared counter:
//
//   chunk task:  chunk c = (members, prefix_len). Phase 1 (shared): every member row's
//                queries against table[row of members[0], 0:prefix_len), one batched pass over
//                the prefix, all KV heads (attend_rows: K transposed per block, so each loaded
//                key feeds many query rows with no horizontal sums). Phase 2 (own), member by
//                member: its queries against table[rows[b], own_start[b]:seq_lens[b]),
//                starting from the softmax state phase 1 left. The members' own keys are
//                prefetched by one stream a fixed lead ahead, a few keys per QK tile and
//                across members (KeyStream; prefetching a row's first blocks a block's
//                worth at a time left the loads waiting).
//   lone task:   a row in no chunk: phase 2 over its whole sequence.
//
// Phase 2 (attend) handles the G = Hq / Hkv query heads of a KV head together, in tiles of R
// heads x JT keys (qk_tile) and R heads x PC vectors of acc (pv_tile), so every K and V vector
// loaded from the pool feeds R products; each slot's K/V row (all KV heads) is read whole.
//
// Both phases run the same online softmax over blocks of keys, keeping per query row
// m (running max of scores), l (sum of exp(score - m)) and acc (sum of exp(score - m) * v).
// Continuing phase 1's (m, l, acc) in phase 2 is exactly the log-sum-exp merge of the two
// partial attentions, so the result equals attention over the whole row.
//
// A second entry point, prefill_causal, runs fresh prompts' causal attention (prefill) with the
// same batched pass as phase 1, over the new tokens' own q / k / v.
//
// The entry points are plain C functions over raw pointers (called through ctypes, which also
// releases the GIL); the Python wrapper checks dtypes, shapes and contiguity. Only
// <ATen/Parallel.h> is included: the build takes ~2 s instead of ~8 s with ATen's Tensor and
// the op registry (~26 s with <torch/extension.h>).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace {

// 8 floats; with -march=native on AVX2 one ymm register, elsewhere the compiler splits it.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

// Throws std::runtime_error(message) unless cond; caught at the C entry point (also when
// thrown inside at::parallel_for, which rethrows a task's exception on the caller's thread).
template <typename... Args>
inline void check(bool cond, const Args&... args) {
  if (cond) return;
  std::ostringstream msg;
  msg << "paged_decode: ";
  (msg << ... << args);
  throw std::runtime_error(msg.str());
}

constexpr int64_t kBlock = 32;        // keys per online-softmax step (a multiple of 16)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
// A vector loaded once for several FMAs is kept in a register: otherwise GCC folds the load into
// each FMA's memory operand (more loads than FMAs, which then wait on the load ports).
#if defined(__x86_64__) && defined(__AVX512F__)
inline v8f in_reg(v8f v) { asm("" : "+v"(v)); return v; }
#elif defined(__x86_64__)
inline v8f in_reg(v8f v) { asm("" : "+x"(v)); return v; }
#else
inline v8f in_reg(v8f v) { return v; }
#endif
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// Helpers for any vector type V (v8f everywhere; v16f, one zmm register, where AVX-512 is
// there: the products that need no horizontal sums, the prefix phase's Q . Kt and every P . V,
// run on those, twice the lanes per instruction and, on cores with full-width AVX-512 units as
// AMD Zen 5 and Intel's, twice the FLOPs).
#if defined(__AVX512F__)
typedef float v16f __attribute__((vector_size(64)));
inline v16f in_reg(v16f v) { asm("" : "+v"(v)); return v; }
#endif
template <typename V> constexpr int kWidth = int(sizeof(V) / sizeof(float));
template <typename V> inline V loadv(const float* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <typename V> inline void storev(float* p, V v) { std::memcpy(p, &v, sizeof v); }
template <typename V> inline V splatv(float x) { return V{} + x; }

// exp for x <= 0 (scores minus their running max), Cephes' expf polynomial: ~1 ulp, and
// inputs below -87 give ~1e-38 instead of 0, which no output tolerance can see. V: v8f, or
// v16f where AVX-512 is there (half the instructions per score); VI: its int32 lanes.
template <typename V, typename VI>
inline V expv(V x) {
  const V lo = splatv<V>(-87.0f);
  x = x < lo ? lo : x;
  const V magic = splatv<V>(12582912.0f);                // 1.5 * 2^23: round to nearest
  V n = (x * 1.44269504088896341f + magic) - magic;      // n = round(x / ln 2)
  V r = x - n * 0.693359375f - n * -2.12194440e-4f;      // r = x - n ln 2, |r| <= ln 2 / 2
  V p = splatv<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  VI bits = (__builtin_convertvector(n, VI) + 127) << 23;  // 2^n
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
inline v8f exp8(v8f x) { return expv<v8f, v8i>(x); }

#if defined(__AVX512F__)
typedef int32_t v16i __attribute__((vector_size(64)));
inline v16f exp16(v16f x) { return expv<v16f, v16i>(x); }
inline v8f fold16(v16f x) {
  return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline v8f foldmax16(v16f x) {
  const v8f a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8f b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  return a > b ? a : b;
}
#endif

// out[j] = op-reduction of the lanes of a[j] (op: + or max): 8 reductions in one vector.
template <typename Op>
inline v8f reduce8(const v8f* a, Op op) {
  v8f t[4];
  for (int i = 0; i < 4; ++i) {
    t[i] = op(__builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14),
              __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15));
  }
  v8f u = op(__builtin_shufflevector(t[0], t[1], 0, 1, 8, 9, 4, 5, 12, 13),
             __builtin_shufflevector(t[0], t[1], 2, 3, 10, 11, 6, 7, 14, 15));
  v8f w = op(__builtin_shufflevector(t[2], t[3], 0, 1, 8, 9, 4, 5, 12, 13),
             __builtin_shufflevector(t[2], t[3], 2, 3, 10, 11, 6, 7, 14, 15));
  return op(__builtin_shufflevector(u, w, 0, 1, 2, 3, 8, 9, 10, 11),
            __builtin_shufflevector(u, w, 4, 5, 6, 7, 12, 13, 14, 15));
}
inline v8f add8(v8f x, v8f y) { return x + y; }
inline v8f max8(v8f x, v8f y) { return x > y ? x : y; }
inline v8f reduce8(const v8f* a) { return reduce8(a, add8); }

constexpr int64_t kAhead = 2;         // blocks of keys prefetched ahead

// Into L1 (prefetcht0): with prefetcht1 (into L2) the first load of each key row still
// waited (perf: a fifth of the kernel's samples on the QK tile's first FMAs); GRPO step at
// batch 256, own 16 / 64 / 128: 3-9% less a layer.
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// Prefetches one key's K and V rows (all KV heads) at `slot`.
inline void prefetch_key(const float* kbuf, const float* vbuf, int64_t slot,
                         int64_t slot_stride, int64_t row_bytes) {
  prefetch_row(kbuf + slot * slot_stride, row_bytes);
  prefetch_row(vbuf + slot * slot_stride, row_bytes);
}

// The own keys of a chunk's members, in the order one thread attends to them, prefetched
// (K and V rows) a fixed lead ahead of use, a few keys per QK tile: spread over the
// arithmetic rather than a block of 32 keys (512 prefetches) at a time, and across members
// (a member's own keys are a few blocks, so a per-row prefetch would start each row cold).
struct KeyStream {
  static constexpr int64_t kLead = 48;   // keys (16 / 32 / 64 measured slower or no better)
  const int64_t *table, *rows, *seq_lens, *own_start, *members;
  int64_t C, num_members, num_slots, slot_stride, row_bytes;
  const float *kbuf, *vbuf;
  int64_t m = 0, j = 0;                  // the next key to prefetch: member m's own key j

  void advance(int64_t keys) {
    while (keys > 0 && m < num_members) {
      const int64_t b = members[m], n = seq_lens[b] - own_start[b];
      if (j >= n) {
        ++m;
        j = 0;
        // the member after next: its table entries on the way (the slot loads below
        // waited on a cold table row for each new member; with this, 2-7% less a layer)
        if (m + 1 < num_members) {
          const int64_t b2 = members[m + 1];
          prefetch_row(table + rows[b2] * C + own_start[b2],
                       (seq_lens[b2] - own_start[b2]) * int64_t(sizeof(int64_t)));
        }
        continue;
      }
      const int64_t slot = std::min(std::max<int64_t>(
          table[rows[b] * C + own_start[b] + j], 0), num_slots - 1);
      prefetch_key(kbuf, vbuf, slot, slot_stride, row_bytes);
      ++j;
      --keys;
    }
  }
};

// Online-softmax state of query rows: m[r], l[r], acc[r * D].
struct State {
  float* m;
  float* l;
  float* acc;
};

// The keys of block j0 (at most kBlock): their K and V row pointers (tail entries alias key
// 0; their scores are masked), slots checked; prefetches the block kAhead blocks on
// (on entry, also the blocks before it; a prefetch never faults). Returns the block's size.
inline int64_t key_block(const int64_t* slots, int64_t n, int64_t j0, const float* kbuf,
                         const float* vbuf, int64_t num_slots, int64_t slot_stride,
                         int64_t row_bytes, const float** kp, const float** vp,
                         bool prefetch = true) {
  const int64_t bk = std::min(kBlock, n - j0);
  for (int64_t j = 0; j < kBlock; ++j) {
    const int64_t slot = slots[j0 + (j < bk ? j : 0)];
    check(slot >= 0 && slot < num_slots, "slot ", slot, " out of range");
    kp[j] = kbuf + slot * slot_stride;
    vp[j] = vbuf + slot * slot_stride;
  }
  if (!prefetch) return bk;
  for (int64_t j = j0 == 0 ? 0 : j0 + kAhead * kBlock;
       j < std::min(n, j0 + (kAhead + 1) * kBlock); ++j)
    prefetch_key(kbuf, vbuf, slots[j], slot_stride, row_bytes);
  return bk;
}

// Rescale each row's state to its new running max; S [rows, kBlock] (scores, masked tail
// -inf) becomes the weights exp(s - m). Rows go eight at a time: their maxima, the factors
// alpha = exp(m_old - m_new) and the sums are vectors over the rows (no scalar chains).
template <int NC>
inline void rescale(int64_t rows, State st, float* S) {
  constexpr int64_t D = NC * 8;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t nr = std::min<int64_t>(8, rows - r0);
    v8f part[8];
    for (int64_t i = 0; i < 8; ++i) {      // rows past the end repeat the last one
      const float* sr = S + (r0 + std::min(i, nr - 1)) * kBlock;
#if defined(__AVX512F__)
      v16f mv = loadv<v16f>(sr);
      for (int64_t c = 16; c < kBlock; c += 16) {
        const v16f x = loadv<v16f>(sr + c);
        mv = mv > x ? mv : x;
      }
      part[i] = foldmax16(mv);
#else
      v8f mv = load8(sr);
      for (int64_t c = 8; c < kBlock; c += 8) mv = max8(mv, load8(sr + c));
      part[i] = mv;
#endif
    }
    float m_old[8], l_old[8], m_new[8], alpha[8], sums[8];
    for (int64_t i = 0; i < 8; ++i) {
      m_old[i] = st.m[r0 + std::min(i, nr - 1)];
      l_old[i] = st.l[r0 + std::min(i, nr - 1)];
    }
    const v8f mo = load8(m_old), mn = max8(mo, reduce8(part, max8));
    // m_old = -inf (no keys yet): exp8 gives ~1e-38, times l = 0 and acc = 0
    store8(alpha, exp8(mo - mn));
    store8(m_new, mn);
    for (int64_t i = 0; i < nr; ++i) {
      float* sr = S + (r0 + i) * kBlock;
#if defined(__AVX512F__)
      const v16f mx = splatv<v16f>(m_new[i]);
      v16f sum = splatv<v16f>(0.0f);
      for (int64_t c = 0; c < kBlock; c += 16) {
        const v16f p = exp16(loadv<v16f>(sr + c) - mx);
        storev<v16f>(sr + c, p);
        sum += p;  // masked tail keys add ~1e-38 each: below any tolerance
      }
      part[i] = fold16(sum);
#else
      const v8f mx = splat(m_new[i]);
      v8f sum = splat(0.0f);
      for (int64_t c = 0; c < kBlock; c += 8) {
        const v8f p = exp8(load8(sr + c) - mx);
        store8(sr + c, p);
        sum += p;  // masked tail keys add ~1e-38 each: below any tolerance
      }
      part[i] = sum;
#endif
    }
    for (int64_t i = nr; i < 8; ++i) part[i] = splat(0.0f);
    store8(sums, load8(l_old) * load8(alpha) + reduce8(part));
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t r = r0 + i;
      st.m[r] = m_new[i];
      st.l[r] = sums[i];
      if (alpha[i] != 1.0f) {
        float* ar = st.acc + r * D;
        const v8f a = splat(alpha[i]);
        for (int c = 0; c < NC; ++c) store8(ar + 8 * c, load8(ar + 8 * c) * a);
      }
    }
  }
}

// Accumulator registers a tile may hold: 16 where AVX-512 gives 32 vector registers (also
// for these 8-lane vectors, via AVX-512VL), else 8 of AVX2's 16.
#if defined(__AVX512F__)
constexpr int kAccRegs = 16;
#else
constexpr int kAccRegs = 8;
#endif

// S[r, j] = q_r . k_j for R query rows (Q, row stride D) and JT keys (kp, each already at the
// head's offset), written at S + r * kBlock + j. Each loaded K vector feeds R products and
// each Q vector JT; the R * JT lane-wise sums are reduced eight at a time (reduce8).
template <int NC, int R, int JT>
inline void qk_tile(const float* Q, const float* const* kp, int64_t koff, float* S) {
  constexpr int64_t D = NC * 8;
  static_assert((R * JT) % 8 == 0, "a tile reduces whole groups of 8 sums");
  v8f a[R * JT];
  for (int i = 0; i < R * JT; ++i) a[i] = splat(0.0f);
  for (int c = 0; c < NC; ++c) {
    v8f kv[JT];
    for (int j = 0; j < JT; ++j) kv[j] = load8(kp[j] + koff + 8 * c);
    for (int r = 0; r < R; ++r) {
      const v8f qv = in_reg(load8(Q + r * D + 8 * c));
      for (int j = 0; j < JT; ++j) a[r * JT + j] += qv * kv[j];
    }
  }
  for (int g = 0; g < R * JT / 8; ++g) {
    const v8f s = reduce8(a + 8 * g);   // lane i: sum of a[8g + i] = (r, j) = divmod(8g + i, JT)
    if constexpr (JT >= 8) {
      store8(S + (8 * g / JT) * kBlock + (8 * g) % JT, s);
    } else {
      float t[8];
      store8(t, s);
      for (int u = 0; u < 8 / JT; ++u)
        std::memcpy(S + (8 * g / JT + u) * kBlock, t + u * JT, JT * sizeof(float));
    }
  }
}

// acc[r, c0 * W : (c0 + PC) * W] += sum_j p[r, j] v_j[...] for R rows over bk keys (W lanes
// of V): R * PC accumulators stay in registers while the keys stream by.
template <typename V, int NV, int R, int PC>
inline void pv_tile(const float* P, const float* const* vp, int64_t voff, int64_t bk, int c0,
                    float* acc) {
  constexpr int W = kWidth<V>;
  constexpr int64_t D = NV * W;
  V a[R][PC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PC; ++c) a[r][c] = loadv<V>(acc + r * D + W * (c0 + c));
  for (int64_t j = 0; j < bk; ++j) {
    const float* vj = vp[j] + voff + W * c0;
    V vv[PC];
    for (int c = 0; c < PC; ++c) vv[c] = loadv<V>(vj + W * c);
    for (int r = 0; r < R; ++r) {
      const V p = splatv<V>(P[r * kBlock + j]);
      for (int c = 0; c < PC; ++c) a[r][c] += p * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PC; ++c) storev<V>(acc + r * D + W * (c0 + c), a[r][c]);
}

// acc[r, :] += sum_j p[r, j] v_j for R rows (R <= 4) over bk keys, the whole head: in passes
// of at most 16 accumulator registers of 16 lanes where AVX-512 is there, else of Regs
// registers of 8 lanes (attend_rows keeps the 16 it always used on AVX2).
template <int NC, int R, int Regs = kAccRegs>
inline void pv_rows(const float* P, const float* const* vp, int64_t voff, int64_t bk,
                    float* acc) {
#if defined(__AVX512F__)
  if constexpr (NC % 2 == 0) {
    constexpr int NV = NC / 2, PC = NV < 16 / R ? NV : 16 / R;
    static_assert(NV % PC == 0, "PV passes cover the head");
    for (int c0 = 0; c0 < NV; c0 += PC) pv_tile<v16f, NV, R, PC>(P, vp, voff, bk, c0, acc);
    return;
  }
#endif
  constexpr int PC = NC < Regs / R ? NC : Regs / R;
  static_assert(NC % PC == 0, "PV passes cover the head");
  for (int c0 = 0; c0 < NC; c0 += PC) pv_tile<v8f, NC, R, PC>(P, vp, voff, bk, c0, acc);
}

// Attend the query rows Q [nh, G, D] (already multiplied by the softmax scale; row (h, i)
// reads KV head h) over the keys at slots[0:n), updating st (rows in the same order).
// Tiles of R query rows of one KV head (R divides G) share every K and V vector they load.
// A slot's K (and V) row holds all nh heads, slot_stride = nh * D floats; the whole row is
// used by one task, so whole rows are prefetched, kAhead blocks ahead.
template <int NC, int R>
void attend(const float* Q, int64_t nh, int64_t G, const int64_t* slots, int64_t n,
            const float* kbuf, const float* vbuf, int64_t num_slots, int64_t slot_stride,
            State st, float* S, KeyStream* stream) {
  constexpr int64_t D = NC * 8;
  constexpr int JT = kAccRegs / R;                      // keys per QK tile
  const int64_t rows = nh * G, row_bytes = slot_stride * int64_t(sizeof(float));
  const float* kp[kBlock];
  const float* vp[kBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t bk = key_block(slots, n, j0, kbuf, vbuf, num_slots, slot_stride, row_bytes,
                                 kp, vp, stream == nullptr);
    // the stream moves on as many keys as this block uses, a share after each tile
    const int64_t tiles = rows / R * ((bk + JT - 1) / JT);
    const int64_t per_tile = (bk + tiles - 1) / tiles;
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t r0 = h * G; r0 < (h + 1) * G; r0 += R) {
        for (int64_t j = 0; j < bk; j += JT) {  // tail keys alias key 0: masked below
          qk_tile<NC, R, JT>(Q + r0 * D, kp + j, h * D, S + r0 * kBlock + j);
          if (stream != nullptr) stream->advance(per_tile);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = bk; j < kBlock; ++j) S[r * kBlock + j] = kNegInf;
    rescale<NC>(rows, st, S);
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t r0 = h * G; r0 < (h + 1) * G; r0 += R)
        pv_rows<NC, R>(S + r0 * kBlock, vp, h * D, bk, st.acc + r0 * D);
    }
  }
}

// Kt[d * kBlock + j] = k_j[d] for 8 keys j (kp, at head offset koff) and all D dims: 8 x 8
// tiles transposed in registers (three rounds of shuffles).
template <int NC>
inline void transpose_keys(const float* const* kp, int64_t koff, float* Kt) {
  for (int c = 0; c < NC; ++c) {
    v8f r[8], t[8], u[8];
    for (int j = 0; j < 8; ++j) r[j] = load8(kp[j] + koff + 8 * c);
    for (int i = 0; i < 8; i += 2) {
      t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
      t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) {
      u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
      u[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
      u[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    // u[i] (i < 4) holds dims i and i + 4 of keys 0-3, u[i + 4] the same of keys 4-7
    for (int i = 0; i < 4; ++i) {
      store8(Kt + (8 * c + i) * kBlock,
             __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11));
      store8(Kt + (8 * c + i + 4) * kBlock,
             __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15));
    }
  }
}

// S = Q . Kt for KV head h (rows h*nq .. h*nq+nq-1, masked past bk): tiles of 16 * W / kBlock
// rows x kBlock keys (16 accumulator registers of W lanes), each Kt vector loaded feeding
// every row of the tile.
template <typename V, int NC>
inline void qk_rows(const float* Q, int64_t h, int64_t nq, int64_t bk, const float* Kt,
                    float* S) {
  constexpr int W = kWidth<V>;
  constexpr int64_t D = NC * 8, KV = kBlock / W, kRows = 16 / KV;
  static_assert(kBlock % W == 0, "a block of keys is whole vectors");
  for (int64_t r0 = h * nq; r0 < (h + 1) * nq; r0 += kRows) {
    const int64_t nr = std::min(kRows, (h + 1) * nq - r0);
    V a[kRows][KV];
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t i = 0; i < KV; ++i) a[r][i] = splatv<V>(0.0f);
    for (int64_t d = 0; d < D; ++d) {
      V kt[KV];
      for (int64_t i = 0; i < KV; ++i) kt[i] = in_reg(loadv<V>(Kt + d * kBlock + W * i));
      for (int64_t r = 0; r < kRows; ++r) {   // rows past the end repeat row r0
        const V qs = splatv<V>(Q[(r0 + (r < nr ? r : 0)) * D + d]);
        for (int64_t i = 0; i < KV; ++i) a[r][i] += qs * kt[i];
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      float* sr = S + (r0 + r) * kBlock;
      for (int64_t i = 0; i < KV; ++i) storev<V>(sr + W * i, a[r][i]);
      for (int64_t j = bk; j < kBlock; ++j) sr[j] = kNegInf;
    }
  }
}

// attend for many query rows per KV head (a cascade chunk: every member's heads of one KV
// head against the shared prefix), shaped as small matrix products so each loaded key or
// value feeds a tile of query rows: per block, K is transposed into Kt [D, kBlock] (scratch)
// and S[r, :] = sum_d q[r, d] * Kt[d, :] (qk_rows); then acc[r, :] += sum_j p[r, j] * v[j, :],
// 4 rows at a time (pv_rows).
template <int NC>
void attend_rows(const float* Q, int64_t nh, int64_t nq, const int64_t* slots, int64_t n,
                 const float* kbuf, const float* vbuf, int64_t num_slots, int64_t slot_stride,
                 State st, float* S, float* Kt) {
  constexpr int64_t D = NC * 8;
  const int64_t rows = nh * nq, row_bytes = slot_stride * int64_t(sizeof(float));
  const float* kp[kBlock];
  const float* vp[kBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t bk = key_block(slots, n, j0, kbuf, vbuf, num_slots, slot_stride, row_bytes,
                                 kp, vp);
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t koff = h * D;
      for (int64_t j = 0; j < kBlock; j += 8) transpose_keys<NC>(kp + j, koff, Kt + j);
#if defined(__AVX512F__)
      qk_rows<v16f, NC>(Q, h, nq, bk, Kt, S);
#else
      qk_rows<v8f, NC>(Q, h, nq, bk, Kt, S);
#endif
    }
    rescale<NC>(rows, st, S);
    for (int64_t h = 0; h < nh; ++h) {
      int64_t r0 = h * nq;
      for (; r0 + 4 <= (h + 1) * nq; r0 += 4)
        pv_rows<NC, 4, 16>(S + r0 * kBlock, vp, h * D, bk, st.acc + r0 * D);
      for (; r0 < (h + 1) * nq; ++r0)
        pv_rows<NC, 1, 4>(S + r0 * kBlock, vp, h * D, bk, st.acc + r0 * D);
    }
  }
}

// Raw arguments of one call (see paged_decode in paged_decode.py for their meaning).
struct Args {
  const float *q, *k, *v;
  const int64_t *table, *rows, *seq_lens, *own_start, *members, *chunk_offsets, *chunk_lens;
  int64_t B, Hq, Hkv, num_slots, R, C, num_members, num_chunks;
  int64_t q_stride;       // floats from q's row b to row b + 1 (q may be a view into qkv)
  float scale;
  float* out;
};

// Phase 2 for batch row b: Q [Hkv, G, D] (scaled) over its own slots, continuing the state
// (m, l, acc) it holds, then out[b] = acc / l.
template <int NC>
void attend_own(const Args& a, int64_t b, const float* Q, State st, float* S, float* out,
                KeyStream* stream = nullptr) {
  constexpr int64_t D = NC * 8;
  const int64_t G = a.Hq / a.Hkv, start = a.own_start[b], n = a.seq_lens[b] - start;
  const int64_t* slots = a.table + a.rows[b] * a.C + start;
  const int64_t stride = a.Hkv * D;
  if (G % 4 == 0)
    attend<NC, 4>(Q, a.Hkv, G, slots, n, a.k, a.v, a.num_slots, stride, st, S, stream);
  else if (G % 2 == 0)
    attend<NC, 2>(Q, a.Hkv, G, slots, n, a.k, a.v, a.num_slots, stride, st, S, stream);
  else
    attend<NC, 1>(Q, a.Hkv, G, slots, n, a.k, a.v, a.num_slots, stride, st, S, stream);
  for (int64_t r = 0; r < a.Hq; ++r) {
    const v8f inv = splat(st.l[r] > 0.0f ? 1.0f / st.l[r] : 0.0f);
    for (int c = 0; c < NC; ++c) store8(out + r * D + 8 * c, load8(st.acc + r * D + 8 * c) * inv);
  }
}

// Runs task(i, scratch) for i in [0, n) on torch's intra-op threads, each thread taking the
// next task when it finishes one (tasks differ in size, and on a shared machine so do threads).
template <typename Scratch, typename F>
void parallel_tasks(int64_t n, const F& task) {
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) task(i, scratch);
  });
}

struct Scratch {
  std::vector<float> Q, m, l, acc, S, Kt, rq, rm, rl, racc;
};

template <int NC>
void run(const Args& a) {
  constexpr int64_t D = NC * 8;
  const int64_t B = a.B, Hq = a.Hq, Hkv = a.Hkv, G = Hq / Hkv, C = a.C, R = a.R;
  const int64_t slot_stride = Hkv * D, num_chunks = a.num_chunks;
  const int64_t *rd = a.rows, *ld = a.seq_lens, *od = a.own_start;
  const int64_t *md = a.members, *cod = a.chunk_offsets, *cld = a.chunk_lens;
  const float sc = a.scale;

  // The plan is checked before any pointer is formed from it (O(B) work): every row has
  // 1..C slots in a real table row, and a row starts its own part past a prefix exactly when
  // it is a member of one chunk of that prefix length.
  std::vector<int64_t> prefix_of(B, 0);
  check(cod[0] == 0 && cod[num_chunks] == a.num_members, "chunk offsets");
  int64_t max_members = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    check(cod[c] < cod[c + 1], "empty chunk ", c);
    max_members = std::max(max_members, cod[c + 1] - cod[c]);
    for (int64_t i = cod[c]; i < cod[c + 1]; ++i) {
      check(md[i] >= 0 && md[i] < B && prefix_of[md[i]] == 0 && cld[c] > 0,
            "bad chunk member ", md[i]);
      prefix_of[md[i]] = cld[c];
    }
  }
  std::vector<int64_t> lone;         // rows in no chunk: one task each, after the chunks
  for (int64_t b = 0; b < B; ++b) {
    check(rd[b] >= 0 && rd[b] < R && ld[b] >= 1 && ld[b] <= C && od[b] == prefix_of[b] &&
              od[b] <= ld[b],
          "bad row, length or own_start for batch row ", b);
    if (prefix_of[b] == 0) lone.push_back(b);
  }

  // Task c < num_chunks: chunk c's shared prefix for all its members at once (phase 1: its
  // nm members' queries form Q [Hkv, nm * G, D], KV head h's block holding query heads
  // h*G .. h*G+G-1 of every member), then each member's own slots from the state phase 1
  // left (phase 2). Later tasks: one lone row's whole sequence.
  parallel_tasks<Scratch>(num_chunks + int64_t(lone.size()), [&](int64_t t, Scratch& s) {
    s.rq.resize(Hq * D);
    s.rm.resize(Hq);
    s.rl.resize(Hq);
    s.racc.resize(Hq * D);
    s.S.resize(std::max(Hq, Hkv * max_members * G) * kBlock);
    const State row{s.rm.data(), s.rl.data(), s.racc.data()};
    auto scaled_q = [&](int64_t b) {
      const float* src = a.q + b * a.q_stride;
      for (int64_t x = 0; x < Hq * D; ++x) s.rq[x] = src[x] * sc;
    };
    if (t >= num_chunks) {
      const int64_t b = lone[t - num_chunks];
      scaled_q(b);
      std::fill(s.rm.begin(), s.rm.end(), kNegInf);
      std::fill(s.rl.begin(), s.rl.end(), 0.0f);
      std::fill(s.racc.begin(), s.racc.end(), 0.0f);
      attend_own<NC>(a, b, s.rq.data(), row, s.S.data(), a.out + b * Hq * D);
      return;
    }
    const int64_t m0 = cod[t], nm = cod[t + 1] - m0, nq = nm * G, rows_q = Hkv * nq;
    s.Q.resize(rows_q * D);
    s.m.assign(rows_q, kNegInf);
    s.l.assign(rows_q, 0.0f);
    s.acc.assign(rows_q * D, 0.0f);
    s.Kt.resize(D * kBlock);
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t i = 0; i < nm; ++i) {
        const float* src = a.q + md[m0 + i] * a.q_stride + h * G * D;
        float* dst = s.Q.data() + (h * nq + i * G) * D;
        for (int64_t x = 0; x < G * D; ++x) dst[x] = src[x] * sc;
      }
    }
    attend_rows<NC>(s.Q.data(), Hkv, nq, a.table + rd[md[m0]] * C, cld[t], a.k, a.v,
                    a.num_slots, slot_stride, State{s.m.data(), s.l.data(), s.acc.data()},
                    s.S.data(), s.Kt.data());
    KeyStream stream{a.table, rd, ld, od, md + m0, C, nm, a.num_slots, slot_stride,
                     slot_stride * int64_t(sizeof(float)), a.k, a.v};
    stream.advance(KeyStream::kLead);
    for (int64_t i = 0; i < nm; ++i) {
      const int64_t b = md[m0 + i];
      scaled_q(b);
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t src = h * nq + i * G, dst = h * G;
        std::memcpy(&s.rm[dst], &s.m[src], G * sizeof(float));
        std::memcpy(&s.rl[dst], &s.l[src], G * sizeof(float));
        std::memcpy(&s.racc[dst * D], &s.acc[src * D], G * D * sizeof(float));
      }
      attend_own<NC>(a, b, s.rq.data(), row, s.S.data(), a.out + b * Hq * D, &stream);
    }
  });
}

// Causal attention of freshly prefilled prompts (no cached prefix): n prompts of e tokens each,
// token i of a prompt over keys 0..i of the same prompt. q [n * e, Hq, D] (rows q_stride floats
// apart), k and v [n * e, Hkv, D] (rows kv_stride apart), out [n * e, Hq, D] contiguous.
// A task is one prompt's KV head h and a tile of kBlock tokens [t0, t1): their G query heads
// form nq = (t1 - t0) * G rows (row i * G + g: token t0 + i, head h * G + g) against the key
// blocks up to the tile's own, the same batched pass as a decode chunk's shared prefix
// (transpose_keys, qk_rows, rescale, pv_rows); only the tile's own block is masked (key j > i).
struct CausalArgs {
  const float *q, *k, *v;
  int64_t n, e, Hq, Hkv, q_stride, kv_stride;
  float scale;
  float* out;
};

template <int NC>
void prefill_causal(const CausalArgs& a) {
  constexpr int64_t D = NC * 8;
  const int64_t G = a.Hq / a.Hkv, tiles = (a.e + kBlock - 1) / kBlock;
  parallel_tasks<Scratch>(a.n * a.Hkv * tiles, [&](int64_t task, Scratch& s) {
    // the longest tiles first: task 0 is the last tile of prompt 0, head 0
    const int64_t tile = tiles - 1 - task % tiles, h = task / tiles % a.Hkv;
    const int64_t p = task / tiles / a.Hkv;
    const int64_t t0 = tile * kBlock, t1 = std::min(t0 + kBlock, a.e), nq = (t1 - t0) * G;
    const int64_t base = p * a.e;
    s.Q.resize(nq * D);
    s.m.assign(nq, kNegInf);
    s.l.assign(nq, 0.0f);
    s.acc.assign(nq * D, 0.0f);
    s.S.resize(nq * kBlock);
    s.Kt.resize(D * kBlock);
    for (int64_t i = 0; i < t1 - t0; ++i) {
      const float* src = a.q + (base + t0 + i) * a.q_stride + h * G * D;
      float* dst = s.Q.data() + i * G * D;
      for (int64_t x = 0; x < G * D; ++x) dst[x] = src[x] * a.scale;
    }
    const State st{s.m.data(), s.l.data(), s.acc.data()};
    const float* kp[kBlock];
    const float* vp[kBlock];
    for (int64_t j0 = 0; j0 < t1; j0 += kBlock) {
      for (int64_t j = 0; j < kBlock; ++j) {   // past the prompt: key 0 again, masked below
        const int64_t key = base + (j0 + j < t1 ? j0 + j : 0);
        kp[j] = a.k + key * a.kv_stride;
        vp[j] = a.v + key * a.kv_stride;
      }
      for (int64_t j = 0; j < kBlock; j += 8) transpose_keys<NC>(kp + j, h * D, s.Kt.data() + j);
      const int64_t bk = std::min(kBlock, t1 - j0);
#if defined(__AVX512F__)
      qk_rows<v16f, NC>(s.Q.data(), 0, nq, bk, s.Kt.data(), s.S.data());
#else
      qk_rows<v8f, NC>(s.Q.data(), 0, nq, bk, s.Kt.data(), s.S.data());
#endif
      if (j0 + kBlock > t0) {   // the tile's own block: token t0 + i sees keys up to itself
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t last = t0 + r / G - j0;   // the row's last visible key in the block
          for (int64_t j = last + 1; j < kBlock; ++j) s.S[r * kBlock + j] = kNegInf;
        }
      }
      rescale<NC>(nq, st, s.S.data());
      int64_t r0 = 0;
      for (; r0 + 4 <= nq; r0 += 4)
        pv_rows<NC, 4, 16>(s.S.data() + r0 * kBlock, vp, h * D, bk, st.acc + r0 * D);
      for (; r0 < nq; ++r0)
        pv_rows<NC, 1, 4>(s.S.data() + r0 * kBlock, vp, h * D, bk, st.acc + r0 * D);
    }
    for (int64_t r = 0; r < nq; ++r) {
      const v8f inv = splat(1.0f / st.l[r]);   // l >= 1: the row's max key counts e^0
      float* dst = a.out + ((base + t0 + r / G) * a.Hq + h * G + r % G) * D;
      for (int c = 0; c < NC; ++c) store8(dst + 8 * c, load8(st.acc + r * D + 8 * c) * inv);
    }
  });
}

// K::go<NC>(a) for head_dim = 8 * NC (K: a struct with `template <int NC> static void go`).
template <typename K, typename A>
void by_head_dim(int64_t head_dim, const A& a) {
  switch (head_dim) {
    case 16: K::template go<2>(a); break;
    case 32: K::template go<4>(a); break;
    case 64: K::template go<8>(a); break;
    case 128: K::template go<16>(a); break;
    case 256: K::template go<32>(a); break;
    default: check(false, "head_dim must be 16, 32, 64, 128 or 256");
  }
}

struct Decode {
  template <int NC> static void go(const Args& a) { run<NC>(a); }
};
struct Causal {
  template <int NC> static void go(const CausalArgs& a) { prefill_causal<NC>(a); }
};

// body(), returning 0; or 1 with its exception's message in err (at most err_len bytes,
// NUL-terminated): nothing is thrown across the C entry points.
template <typename Body>
int guarded(char* err, int64_t err_len, const Body& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& ex) {
    std::snprintf(err, static_cast<size_t>(err_len), "%s", ex.what());
    return 1;
  }
}

}  // namespace

// Bumped whenever the entry point's arguments change: paged_decode.py refuses a library built
// from another version (a stale cache) instead of calling it with the wrong arguments.
extern "C" int rollout_engine_paged_decode_abi() { return 2; }

// out[b] = attention of q[b] over its slots, per the plan; returns 0, or 1 with a message in
// err (at most err_len bytes, NUL-terminated) when the head_dim or the plan is unsupported.
extern "C" int rollout_engine_paged_decode_f32(
    const float* q, const float* k, const float* v, const int64_t* table, const int64_t* rows,
    const int64_t* seq_lens, const int64_t* own_start, const int64_t* members,
    const int64_t* chunk_offsets, const int64_t* chunk_lens, int64_t batch, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t table_rows,
    int64_t table_cols, int64_t num_members, int64_t num_chunks, int64_t q_stride, float scale,
    float* out, char* err, int64_t err_len) {
  const Args a{q, k, v, table, rows, seq_lens, own_start, members, chunk_offsets, chunk_lens,
               batch, num_heads, num_kv_heads, num_slots, table_rows, table_cols, num_members,
               num_chunks, q_stride, scale, out};
  return guarded(err, err_len, [&] {
    check(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "head counts disagree");
    by_head_dim<Decode>(head_dim, a);
  });
}

// Causal attention of n fresh prompts of e tokens each (see prefill_causal); returns 0, or 1
// with a message in err when the head_dim or the head counts are unsupported.
extern "C" int rollout_engine_prefill_causal_f32(const float* q, const float* k, const float* v,
                                                 int64_t n, int64_t e, int64_t num_heads,
                                                 int64_t num_kv_heads, int64_t head_dim,
                                                 int64_t q_stride, int64_t kv_stride,
                                                 float scale, float* out, char* err,
                                                 int64_t err_len) {
  const CausalArgs a{q, k, v, n, e, num_heads, num_kv_heads, q_stride, kv_stride, scale, out};
  return guarded(err, err_len, [&] {
    check(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && n >= 0 && e >= 1,
          "head counts or shape disagree");
    by_head_dim<Causal>(head_dim, a);
  });
}
