// Paged decode attention on CPU: one query token per request, K/V read in place from the
// token pool, with shared-prefix (cascade) attention for rows whose slot rows share a prefix.
//
// Layout (float32, contiguous):
//   q      [B, Hq, D]                 query of each decode row
//   k, v   [num_slots + 1, Hkv, D]    one layer's pool buffers, indexed by slot
//   table  [R, C] int64               req_to_token: table[row, pos] = slot
//
// Work is split into segments, each a set of query rows attending to a slot range:
//
//   phase 1 (shared):  chunk c = (members, prefix_len): every member row's queries against
//                      table[row of members[0], 0:prefix_len), one batched pass over the prefix
//                      (one task per chunk, all KV heads; shaped as small matrix products,
//                      attend_rows, since every member's query heads share each key)
//   phase 2 (own):     row b: its queries against table[rows[b], own_start[b]:seq_lens[b]),
//                      starting from the softmax state phase 1 left for b (if any)
//                      (one task per row, all KV heads: each slot's K/V row is read whole)
//
// Tasks run on torch's intra-op pool (at::parallel_for), so torch.set_num_threads applies.
//
// Both phases run the same online softmax over blocks of keys, keeping per query row
// m (running max of scores), l (sum of exp(score - m)) and acc (sum of exp(score - m) * v).
// Continuing phase 1's (m, l, acc) in phase 2 is exactly the log-sum-exp merge of the two
// partial attentions, so the result equals attention over the whole row.
//
// The entry point is a plain C function over raw pointers (called through ctypes, which also
// releases the GIL); the Python wrapper checks dtypes, shapes and contiguity. Only
// <ATen/Parallel.h> is included: the build takes ~2 s instead of ~8 s with ATen's Tensor and
// the op registry (~26 s with <torch/extension.h>).
#include <ATen/Parallel.h>

#include <algorithm>
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

constexpr int64_t kBlock = 32;        // keys per online-softmax step (a multiple of 8)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// exp for x <= 0 (scores minus their running max), Cephes' expf polynomial: ~1 ulp, and
// inputs below -87 give ~1e-38 instead of 0, which no output tolerance can see.
inline v8f exp8(v8f x) {
  const v8f lo = splat(-87.0f);
  x = x < lo ? lo : x;
  const v8f magic = splat(12582912.0f);                  // 1.5 * 2^23: round to nearest
  v8f n = (x * 1.44269504088896341f + magic) - magic;    // n = round(x / ln 2)
  v8f r = x - n * 0.693359375f - n * -2.12194440e-4f;    // r = x - n ln 2, |r| <= ln 2 / 2
  v8f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;  // 2^n
  v8f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// sums[j] = sum of the lanes of a[j]: the 8 dot products of 8 keys in one vector.
inline v8f reduce8(const v8f* a) {
  v8f t[4];
  for (int i = 0; i < 4; ++i) {
    t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  v8f u = __builtin_shufflevector(t[0], t[1], 0, 1, 8, 9, 4, 5, 12, 13) +
          __builtin_shufflevector(t[0], t[1], 2, 3, 10, 11, 6, 7, 14, 15);
  v8f w = __builtin_shufflevector(t[2], t[3], 0, 1, 8, 9, 4, 5, 12, 13) +
          __builtin_shufflevector(t[2], t[3], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(u, w, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u, w, 4, 5, 6, 7, 12, 13, 14, 15);
}

constexpr int64_t kAhead = 2;         // blocks of keys prefetched ahead

inline void prefetch_row(const float* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// Online-softmax state of query rows: m[r], l[r], acc[r * D].
struct State {
  float* m;
  float* l;
  float* acc;
};

// The keys of block j0 (at most kBlock): their K and V row pointers (tail entries alias key
// 0; their scores are masked), slots checked; prefetches (into L2) the block kAhead blocks on
// (on entry, also the blocks before it; a prefetch never faults). Returns the block's size.
inline int64_t key_block(const int64_t* slots, int64_t n, int64_t j0, const float* kbuf,
                         const float* vbuf, int64_t num_slots, int64_t slot_stride,
                         int64_t row_bytes, const float** kp, const float** vp) {
  const int64_t bk = std::min(kBlock, n - j0);
  for (int64_t j = 0; j < kBlock; ++j) {
    const int64_t slot = slots[j0 + (j < bk ? j : 0)];
    check(slot >= 0 && slot < num_slots, "slot ", slot, " out of range");
    kp[j] = kbuf + slot * slot_stride;
    vp[j] = vbuf + slot * slot_stride;
  }
  for (int64_t j = j0 == 0 ? 0 : j0 + kAhead * kBlock;
       j < std::min(n, j0 + (kAhead + 1) * kBlock); ++j) {
    prefetch_row(kbuf + slots[j] * slot_stride, row_bytes);
    prefetch_row(vbuf + slots[j] * slot_stride, row_bytes);
  }
  return bk;
}

// Rescale each row's state to its new running max; S [rows, kBlock] (scores, masked tail
// -inf) becomes the weights exp(s - m).
template <int NC>
inline void rescale(int64_t rows, State st, float* S) {
  constexpr int64_t D = NC * 8;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = S + r * kBlock;
    v8f mv = load8(sr);
    for (int64_t c = 8; c < kBlock; c += 8) {
      const v8f x = load8(sr + c);
      mv = mv > x ? mv : x;
    }
    float mx = st.m[r];
    for (int j = 0; j < 8; ++j) mx = std::max(mx, mv[j]);
    const float alpha = st.m[r] == kNegInf ? 0.0f : std::exp(st.m[r] - mx);
    v8f sum = splat(0.0f);
    for (int64_t c = 0; c < kBlock; c += 8) {
      const v8f p = exp8(load8(sr + c) - mx);
      store8(sr + c, p);
      sum += p;  // masked tail keys add ~1e-38 each: below any tolerance
    }
    st.m[r] = mx;
    st.l[r] = st.l[r] * alpha + hsum(sum);
    if (alpha != 1.0f) {
      float* ar = st.acc + r * D;
      for (int c = 0; c < NC; ++c) store8(ar + 8 * c, load8(ar + 8 * c) * alpha);
    }
  }
}

// Attend the query rows Q [nh, nq, D] (already multiplied by the softmax scale; row (h, i)
// reads KV head h) over the keys at slots[0:n), updating st (rows in the same order).
// A slot's K (and V) row holds all nh heads, slot_stride = nh * D floats; the whole row is
// used by one task, so whole rows are prefetched (into L2), kAhead blocks ahead.
template <int NC>
void attend(const float* Q, int64_t nh, int64_t nq, const int64_t* slots, int64_t n,
            const float* kbuf, const float* vbuf, int64_t num_slots, int64_t slot_stride,
            State st, float* S) {
  constexpr int64_t D = NC * 8;
  const int64_t rows = nh * nq, row_bytes = slot_stride * int64_t(sizeof(float));
  const float* kp[kBlock];
  const float* vp[kBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t bk = key_block(slots, n, j0, kbuf, vbuf, num_slots, slot_stride, row_bytes,
                                 kp, vp);
    // S[r, j] = q_r . k_j, eight keys at a time
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = Q + r * D;
      const int64_t koff = (r / nq) * D;
      v8f qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = load8(qr + 8 * c);
      float* sr = S + r * kBlock;
      for (int64_t j8 = 0; j8 < bk; j8 += 8) {
        v8f a[8];
        for (int j = 0; j < 8; ++j) {
          const float* kj = kp[j8 + j] + koff;
          a[j] = qv[0] * load8(kj);
          for (int c = 1; c < NC; ++c) a[j] += qv[c] * load8(kj + 8 * c);
        }
        store8(sr + j8, reduce8(a));
      }
      for (int64_t j = bk; j < kBlock; ++j) sr[j] = kNegInf;
    }
    rescale<NC>(rows, st, S);
    // acc_r += sum_j p_rj v_j, eight vectors of acc_r in registers at a time
    for (int64_t r = 0; r < rows; ++r) {
      const float* pr = S + r * kBlock;
      const int64_t voff = (r / nq) * D;
      float* ar = st.acc + r * D;
      for (int c0 = 0; c0 < NC; c0 += 8) {
        constexpr int W = NC < 8 ? NC : 8;
        v8f a[W];
        for (int c = 0; c < W; ++c) a[c] = load8(ar + 8 * (c0 + c));
        for (int64_t j = 0; j < bk; ++j) {
          const v8f p = splat(pr[j]);
          const float* vj = vp[j] + voff + 8 * c0;
          for (int c = 0; c < W; ++c) a[c] += p * load8(vj + 8 * c);
        }
        for (int c = 0; c < W; ++c) store8(ar + 8 * (c0 + c), a[c]);
      }
    }
  }
}

// attend for many query rows per KV head (a cascade chunk: every member's heads of one KV
// head against the shared prefix), shaped as small matrix products so each loaded key or
// value feeds kRows query rows: per block, K is transposed into Kt [D, kBlock] (scratch) and
// S[r, :] = sum_d q[r, d] * Kt[d, :], kRows rows x kBlock keys of accumulators; then
// acc[r, :] += sum_j p[r, j] * v[j, :], kRows rows x 32 lanes of acc at a time.
constexpr int64_t kRows = 4;

template <int NC>
void attend_rows(const float* Q, int64_t nh, int64_t nq, const int64_t* slots, int64_t n,
                 const float* kbuf, const float* vbuf, int64_t num_slots, int64_t slot_stride,
                 State st, float* S, float* Kt) {
  constexpr int64_t D = NC * 8, KV8 = kBlock / 8;
  constexpr int W = NC < 4 ? NC : 4;   // acc vectors per row held at once
  const int64_t rows = nh * nq, row_bytes = slot_stride * int64_t(sizeof(float));
  const float* kp[kBlock];
  const float* vp[kBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t bk = key_block(slots, n, j0, kbuf, vbuf, num_slots, slot_stride, row_bytes,
                                 kp, vp);
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t koff = h * D;
      for (int64_t j = 0; j < kBlock; ++j) {
        const float* kj = kp[j] + koff;
        for (int64_t d = 0; d < D; ++d) Kt[d * kBlock + j] = kj[d];
      }
      for (int64_t r0 = h * nq; r0 < (h + 1) * nq; r0 += kRows) {
        const int64_t nr = std::min(kRows, (h + 1) * nq - r0);
        v8f a[kRows][KV8];
        for (int64_t r = 0; r < kRows; ++r)
          for (int64_t i = 0; i < KV8; ++i) a[r][i] = splat(0.0f);
        for (int64_t d = 0; d < D; ++d) {
          v8f kt[KV8];
          for (int64_t i = 0; i < KV8; ++i) kt[i] = load8(Kt + d * kBlock + 8 * i);
          for (int64_t r = 0; r < kRows; ++r) {
            const v8f qs = splat(Q[(r0 + (r < nr ? r : 0)) * D + d]);
            for (int64_t i = 0; i < KV8; ++i) a[r][i] += qs * kt[i];
          }
        }
        for (int64_t r = 0; r < nr; ++r) {
          float* sr = S + (r0 + r) * kBlock;
          for (int64_t i = 0; i < KV8; ++i) store8(sr + 8 * i, a[r][i]);
          for (int64_t j = bk; j < kBlock; ++j) sr[j] = kNegInf;
        }
      }
    }
    rescale<NC>(rows, st, S);
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t voff = h * D;
      for (int64_t r0 = h * nq; r0 < (h + 1) * nq; r0 += kRows) {
        const int64_t nr = std::min(kRows, (h + 1) * nq - r0);
        for (int c0 = 0; c0 < NC; c0 += W) {
          v8f a[kRows][W];
          for (int64_t r = 0; r < kRows; ++r)
            for (int c = 0; c < W; ++c)
              a[r][c] = r < nr ? load8(st.acc + (r0 + r) * D + 8 * (c0 + c)) : splat(0.0f);
          for (int64_t j = 0; j < bk; ++j) {
            const float* vj = vp[j] + voff + 8 * c0;
            v8f vv[W];
            for (int c = 0; c < W; ++c) vv[c] = load8(vj + 8 * c);
            for (int64_t r = 0; r < kRows; ++r) {
              const v8f ps = splat(S[(r0 + (r < nr ? r : 0)) * kBlock + j]);
              for (int c = 0; c < W; ++c) a[r][c] += ps * vv[c];
            }
          }
          for (int64_t r = 0; r < nr; ++r)
            for (int c = 0; c < W; ++c) store8(st.acc + (r0 + r) * D + 8 * (c0 + c), a[r][c]);
        }
      }
    }
  }
}

// Raw arguments of one call (see paged_decode in cpu_kernels.py for their meaning).
struct Args {
  const float *q, *k, *v;
  const int64_t *table, *rows, *seq_lens, *own_start, *members, *chunk_offsets, *chunk_lens;
  int64_t B, Hq, Hkv, num_slots, R, C, num_members, num_chunks;
  float scale;
  float* out;
};

template <int NC>
void run(const Args& a) {
  constexpr int64_t D = NC * 8;
  const int64_t B = a.B, Hq = a.Hq, Hkv = a.Hkv, G = Hq / Hkv, C = a.C, R = a.R;
  const int64_t slot_stride = Hkv * D, S_total = a.num_slots, num_chunks = a.num_chunks;
  const float *qd = a.q, *kd = a.k, *vd = a.v;
  const int64_t *td = a.table, *rd = a.rows, *ld = a.seq_lens, *od = a.own_start;
  const int64_t *md = a.members, *cod = a.chunk_offsets, *cld = a.chunk_lens;
  float* outd = a.out;
  const float sc = a.scale;

  // The plan is checked before any pointer is formed from it (O(B) work): every row has
  // 1..C slots in a real table row, and a row starts its own part past a prefix exactly when
  // it is a member of one chunk of that prefix length.
  std::vector<int64_t> prefix_of(B, 0);
  check(cod[0] == 0 && cod[num_chunks] == a.num_members, "chunk offsets");
  for (int64_t c = 0; c < num_chunks; ++c) {
    check(cod[c] < cod[c + 1], "empty chunk ", c);
    for (int64_t i = cod[c]; i < cod[c + 1]; ++i) {
      check(md[i] >= 0 && md[i] < B && prefix_of[md[i]] == 0 && cld[c] > 0,
            "bad chunk member ", md[i]);
      prefix_of[md[i]] = cld[c];
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    check(rd[b] >= 0 && rd[b] < R && ld[b] >= 1 && ld[b] <= C && od[b] == prefix_of[b] &&
              od[b] <= ld[b],
          "bad row, length or own_start for batch row ", b);
  }

  // Phase 1 leaves each grouped row's (m, l) here and its unnormalised acc in out.
  std::vector<float> m_part(num_chunks ? B * Hq : 0), l_part(num_chunks ? B * Hq : 0);

  // Phase 1: one task per chunk. Its nm members' queries form Q [Hkv, nm * G, D]: KV head
  // h's block holds query heads h*G .. h*G+G-1 of every member, all against the shared prefix.
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Q, m, l, acc, S, Kt;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t m0 = cod[c], nm = cod[c + 1] - m0, nq = nm * G, rows_q = Hkv * nq;
      Q.resize(rows_q * D);
      m.assign(rows_q, kNegInf);
      l.assign(rows_q, 0.0f);
      acc.assign(rows_q * D, 0.0f);
      S.resize(rows_q * kBlock);
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t a = 0; a < nm; ++a) {
          const float* src = qd + (md[m0 + a] * Hq + h * G) * D;
          float* dst = Q.data() + (h * nq + a * G) * D;
          for (int64_t x = 0; x < G * D; ++x) dst[x] = src[x] * sc;
        }
      }
      Kt.resize(D * kBlock);
      attend_rows<NC>(Q.data(), Hkv, nq, td + rd[md[m0]] * C, cld[c], kd, vd, S_total,
                      slot_stride, State{m.data(), l.data(), acc.data()}, S.data(), Kt.data());
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t a = 0; a < nm; ++a) {
          const int64_t src = h * nq + a * G, dst = md[m0 + a] * Hq + h * G;
          std::memcpy(&m_part[dst], &m[src], G * sizeof(float));
          std::memcpy(&l_part[dst], &l[src], G * sizeof(float));
          std::memcpy(outd + dst * D, &acc[src * D], G * D * sizeof(float));
        }
      }
    }
  });

  // Phase 2: one task per row over its own slots (Q [Hkv, G, D] is q[b] as laid out), then
  // normalise.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Q(Hq * D), m(Hq), l(Hq), acc(Hq * D), S(Hq * kBlock);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t base = b * Hq, start = od[b], len = ld[b];
      const float* src = qd + base * D;
      for (int64_t x = 0; x < Hq * D; ++x) Q[x] = src[x] * sc;
      if (start > 0) {
        std::memcpy(m.data(), &m_part[base], Hq * sizeof(float));
        std::memcpy(l.data(), &l_part[base], Hq * sizeof(float));
        std::memcpy(acc.data(), outd + base * D, Hq * D * sizeof(float));
      } else {
        std::fill(m.begin(), m.end(), kNegInf);
        std::fill(l.begin(), l.end(), 0.0f);
        std::fill(acc.begin(), acc.end(), 0.0f);
      }
      attend<NC>(Q.data(), Hkv, G, td + rd[b] * C + start, len - start, kd, vd, S_total,
                 slot_stride, State{m.data(), l.data(), acc.data()}, S.data());
      for (int64_t r = 0; r < Hq; ++r) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float* dst = outd + (base + r) * D;
        for (int64_t x = 0; x < D; ++x) dst[x] = acc[r * D + x] * inv;
      }
    }
  });
}

}  // namespace

// out[b] = attention of q[b] over its slots, per the plan; returns 0, or 1 with a message in
// err (at most err_len bytes, NUL-terminated) when the head_dim or the plan is unsupported.
extern "C" int rollout_engine_paged_decode_f32(
    const float* q, const float* k, const float* v, const int64_t* table, const int64_t* rows,
    const int64_t* seq_lens, const int64_t* own_start, const int64_t* members,
    const int64_t* chunk_offsets, const int64_t* chunk_lens, int64_t batch, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t table_rows,
    int64_t table_cols, int64_t num_members, int64_t num_chunks, float scale, float* out,
    char* err, int64_t err_len) {
  const Args a{q, k, v, table, rows, seq_lens, own_start, members, chunk_offsets, chunk_lens,
               batch, num_heads, num_kv_heads, num_slots, table_rows, table_cols, num_members,
               num_chunks, scale, out};
  try {
    check(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "head counts disagree");
    switch (head_dim) {
      case 16: run<2>(a); break;
      case 32: run<4>(a); break;
      case 64: run<8>(a); break;
      case 128: run<16>(a); break;
      case 256: run<32>(a); break;
      default: check(false, "head_dim must be 16, 32, 64, 128 or 256");
    }
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, static_cast<size_t>(err_len), "%s", e.what());
    return 1;
  }
}
