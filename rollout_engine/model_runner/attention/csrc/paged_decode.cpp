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
//   phase 2 (own):     row b: its queries against table[rows[b], own_start[b]:seq_lens[b]),
//                      starting from the softmax state phase 1 left for b (if any)
//
// Both phases run the same online softmax over blocks of keys, keeping per query row
// m (running max of scores), l (sum of exp(score - m)) and acc (sum of exp(score - m) * v).
// Continuing phase 1's (m, l, acc) in phase 2 is exactly the log-sum-exp merge of the two
// partial attentions, so the result equals attention over the whole row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// 8 floats; with -march=native on AVX2 one ymm register, elsewhere the compiler splits it.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

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

// Online-softmax state of nq query rows: m[nq], l[nq], acc[nq * D].
struct State {
  float* m;
  float* l;
  float* acc;
};

// Attend nq query rows Q [nq, D] (already multiplied by the softmax scale) over the keys at
// slots[0:n), updating st. NC = D / 8 vectors per head row.
template <int NC>
void attend(const float* Q, int64_t nq, const int64_t* slots, int64_t n, const float* kbuf,
            const float* vbuf, int64_t slot_stride, State st, float* S) {
  constexpr int64_t D = NC * 8;
  const float* kp[kBlock];
  const float* vp[kBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t bk = std::min(kBlock, n - j0);
    for (int64_t j = 0; j < bk; ++j) {
      kp[j] = kbuf + slots[j0 + j] * slot_stride;
      vp[j] = vbuf + slots[j0 + j] * slot_stride;
    }
    // S[i, j] = q_i . k_j
    for (int64_t i = 0; i < nq; ++i) {
      const float* qi = Q + i * D;
      v8f qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = load8(qi + 8 * c);
      float* si = S + i * kBlock;
      for (int64_t j = 0; j < bk; ++j) {
        v8f a0 = qv[0] * load8(kp[j]), a1 = splat(0.0f);
        for (int c = 1; c < NC; c += 2) {
          a1 += qv[c] * load8(kp[j] + 8 * c);
          if (c + 1 < NC) a0 += qv[c + 1] * load8(kp[j] + 8 * (c + 1));
        }
        si[j] = hsum(a0 + a1);
      }
      for (int64_t j = bk; j < kBlock; ++j) si[j] = kNegInf;
    }
    // rescale the state to the new running max; S becomes the weights exp(s - m)
    for (int64_t i = 0; i < nq; ++i) {
      float* si = S + i * kBlock;
      float mx = st.m[i];
      for (int64_t j = 0; j < bk; ++j) mx = std::max(mx, si[j]);
      const float alpha = st.m[i] == kNegInf ? 0.0f : std::exp(st.m[i] - mx);
      float sum = 0.0f;
      for (int64_t c = 0; c < kBlock; c += 8) store8(si + c, exp8(load8(si + c) - mx));
      for (int64_t j = 0; j < bk; ++j) sum += si[j];
      st.m[i] = mx;
      st.l[i] = st.l[i] * alpha + sum;
      if (alpha != 1.0f) {
        float* ai = st.acc + i * D;
        for (int c = 0; c < NC; ++c) store8(ai + 8 * c, load8(ai + 8 * c) * alpha);
      }
    }
    // acc_i += sum_j p_ij v_j, eight vectors of acc_i in registers at a time
    for (int64_t i = 0; i < nq; ++i) {
      const float* pi = S + i * kBlock;
      float* ai = st.acc + i * D;
      for (int c0 = 0; c0 < NC; c0 += 8) {
        constexpr int W = NC < 8 ? NC : 8;
        v8f a[W];
        for (int c = 0; c < W; ++c) a[c] = load8(ai + 8 * (c0 + c));
        for (int64_t j = 0; j < bk; ++j) {
          const v8f p = splat(pi[j]);
          const float* vj = vp[j] + 8 * c0;
          for (int c = 0; c < W; ++c) a[c] += p * load8(vj + 8 * c);
        }
        for (int c = 0; c < W; ++c) store8(ai + 8 * (c0 + c), a[c]);
      }
    }
  }
}

template <int NC>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
         const at::Tensor& rows, const at::Tensor& seq_lens, const at::Tensor& own_start,
         const at::Tensor& members, const at::Tensor& chunk_offsets,
         const at::Tensor& chunk_lens, double scale, at::Tensor& out) {
  constexpr int64_t D = NC * 8;
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = k.size(1), G = Hq / Hkv;
  const int64_t C = table.size(1), slot_stride = Hkv * D;
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const int64_t* td = table.data_ptr<int64_t>();
  const int64_t* rd = rows.data_ptr<int64_t>();
  const int64_t* ld = seq_lens.data_ptr<int64_t>();
  const int64_t* od = own_start.data_ptr<int64_t>();
  const int64_t* md = members.data_ptr<int64_t>();
  const int64_t* cod = chunk_offsets.data_ptr<int64_t>();
  const int64_t* cld = chunk_lens.data_ptr<int64_t>();
  float* outd = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t num_chunks = chunk_lens.size(0);

  // Phase 1 leaves each grouped row's (m, l) here and its unnormalised acc in out.
  std::vector<float> m_part(num_chunks ? B * Hq : 0), l_part(num_chunks ? B * Hq : 0);

  // Phase 1: one task per (chunk, kv head); the chunk's members' G query heads each form
  // one block of queries Q [members * G, D] against the shared prefix.
  at::parallel_for(0, num_chunks * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Q, m, l, acc, S;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t / Hkv, h = t % Hkv;
      const int64_t m0 = cod[c], nm = cod[c + 1] - m0, nq = nm * G;
      Q.resize(nq * D);
      m.assign(nq, kNegInf);
      l.assign(nq, 0.0f);
      acc.assign(nq * D, 0.0f);
      S.resize(nq * kBlock);
      for (int64_t a = 0; a < nm; ++a) {
        const float* src = qd + (md[m0 + a] * Hq + h * G) * D;
        for (int64_t x = 0; x < G * D; ++x) Q[a * G * D + x] = src[x] * sc;
      }
      const int64_t* slots = td + rd[md[m0]] * C;
      attend<NC>(Q.data(), nq, slots, cld[c], kd + h * D, vd + h * D, slot_stride,
                 State{m.data(), l.data(), acc.data()}, S.data());
      for (int64_t a = 0; a < nm; ++a) {
        const int64_t base = md[m0 + a] * Hq + h * G;
        std::memcpy(&m_part[base], &m[a * G], G * sizeof(float));
        std::memcpy(&l_part[base], &l[a * G], G * sizeof(float));
        std::memcpy(outd + base * D, &acc[a * G * D], G * D * sizeof(float));
      }
    }
  });

  // Phase 2: one task per (row, kv head) over the row's own slots, then normalise.
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Q(G * D), m(G), l(G), acc(G * D), S(G * kBlock);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / Hkv, h = t % Hkv, base = b * Hq + h * G;
      const int64_t start = od[b], len = ld[b];
      const float* src = qd + base * D;
      for (int64_t x = 0; x < G * D; ++x) Q[x] = src[x] * sc;
      if (start > 0) {
        std::memcpy(m.data(), &m_part[base], G * sizeof(float));
        std::memcpy(l.data(), &l_part[base], G * sizeof(float));
        std::memcpy(acc.data(), outd + base * D, G * D * sizeof(float));
      } else {
        std::fill(m.begin(), m.end(), kNegInf);
        std::fill(l.begin(), l.end(), 0.0f);
        std::fill(acc.begin(), acc.end(), 0.0f);
      }
      attend<NC>(Q.data(), G, td + rd[b] * C + start, len - start, kd + h * D, vd + h * D,
                 slot_stride, State{m.data(), l.data(), acc.data()}, S.data());
      for (int64_t r = 0; r < G; ++r) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float* dst = outd + (base + r) * D;
        for (int64_t x = 0; x < D; ++x) dst[x] = acc[r * D + x] * inv;
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& table, const at::Tensor& rows,
                        const at::Tensor& seq_lens, const at::Tensor& own_start,
                        const at::Tensor& members, const at::Tensor& chunk_offsets,
                        const at::Tensor& chunk_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "bad q/k/v shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "paged_decode supports float32 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
                  table.is_contiguous(), "paged_decode needs contiguous q, k, v, table");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0, "head shapes disagree");
  TORCH_CHECK(chunk_offsets.size(0) == chunk_lens.size(0) + 1, "chunk_offsets size");
  for (const at::Tensor* t : {&table, &rows, &seq_lens, &own_start, &members, &chunk_offsets,
                              &chunk_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors: int64");
  }
  at::Tensor out = at::empty_like(q);
#define PAGED_DECODE_CASE(NC)                                                                  \
  case NC * 8:                                                                               \
    run<NC>(q, k, v, table, rows, seq_lens, own_start, members, chunk_offsets, chunk_lens,   \
            scale, out);                                                                     \
    break;
  switch (q.size(2)) {
    PAGED_DECODE_CASE(2)
    PAGED_DECODE_CASE(4)
    PAGED_DECODE_CASE(8)
    PAGED_DECODE_CASE(16)
    PAGED_DECODE_CASE(32)
    default: TORCH_CHECK(false, "paged_decode: head_dim must be 16, 32, 64, 128 or 256");
  }
#undef PAGED_DECODE_CASE
  return out;
}

}  // namespace

TORCH_LIBRARY(rollout_engine_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor table, Tensor rows, Tensor seq_lens, "
        "Tensor own_start, Tensor members, Tensor chunk_offsets, Tensor chunk_lens, "
        "float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
}
