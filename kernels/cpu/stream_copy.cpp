// Byte copy with streaming (non-temporal) stores, for the large one-shot copies of a refit.
//
// A refit writes hundreds of megabytes that nothing reads before the next decode step, far more
// than the caches hold. Ordinary stores first read every destination line into the cache (read
// for ownership) and later write it back: three memory transfers per line. Streaming stores
// write whole lines straight to memory: two transfers. On a 2-core EPYC this copies 221 MB in
// 8-12 ms where torch's copy_ takes 10-19 ms and glibc's memcpy 18 ms (both threads busy).
//
// Built and loaded like the attention kernels (build.build_library), called through
// ctypes, which releases the GIL; rollout_engine_copy_ranges below shares many ranges between
// the calling thread and helper threads of its own (copy_all's path for large copies).

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>   // SSE2: every x86-64 CPU has it, so no runtime dispatch is needed
#define ROLLOUT_ENGINE_STREAMING 1
#else
#define ROLLOUT_ENGINE_STREAMING 0
#endif

extern "C" {

int rollout_engine_stream_copy_abi() { return 2; }

// 1 when the copy streams, 0 when this build is a plain memcpy (not x86-64).
int rollout_engine_stream_copy_streams() { return ROLLOUT_ENGINE_STREAMING; }

void rollout_engine_stream_copy(void* dst, const void* src, int64_t nbytes) {
    if (nbytes <= 0) return;
    auto* d = static_cast<unsigned char*>(dst);
    auto* s = static_cast<const unsigned char*>(src);
    size_t n = static_cast<size_t>(nbytes);
#if ROLLOUT_ENGINE_STREAMING
    // streaming stores need a 16-byte aligned destination: the head is copied plainly
    size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    if (head > n) head = n;
    std::memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {   // one cache line per iteration
        __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
        __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
        __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    _mm_sfence();   // streaming stores are weakly ordered: visible to every thread after this
    std::memcpy(d + i, s + i, n - i);
#else
    std::memcpy(d, s, n);
#endif
}

}  // extern "C"

// Many ranges copied by the calling thread and persistent helper threads together
// (`rollout_engine_copy_ranges`): the ranges are cut into pieces, and every thread takes the next
// piece until none is left. Python's helpers (bucket._share_out) did the same at ~0.1-0.2 ms a
// call (a queue and an event to wake each helper, the GIL between pieces, pieces of 1-4 MB so
// that a thread's last one held the other back): a refit in 16 MB buckets paid that per bucket.
// Here a helper wakes on a condition variable (after a short spin, for calls back to back), a
// piece costs an atomic increment, and pieces are small.
//
// A helper that has not started when the caller finds no piece left is not waited for: it
// notes itself active before it looks whether the job is closed, and the caller closes the job
// before it waits for the active ones, so a helper either takes pieces the caller waits for or
// sees the job closed and touches nothing. One job at a time: a caller that finds the helpers
// busy with another copies its ranges alone.
namespace {

struct Piece {
  unsigned char* dst;
  const unsigned char* src;
  int64_t nbytes;
};

struct Job {
  std::vector<Piece> pieces;
  bool stream = true;
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
  std::atomic<bool> closed{false};

  void work() {
    const int64_t n = static_cast<int64_t>(pieces.size());
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const Piece& p = pieces[static_cast<size_t>(i)];
      if (stream) {
        rollout_engine_stream_copy(p.dst, p.src, p.nbytes);
      } else {
        std::memcpy(p.dst, p.src, static_cast<size_t>(p.nbytes));
      }
    }
  }
};

class Helpers {
 public:
  std::mutex busy;   // held by the caller whose job the helpers serve

  // Hand `job` to the helpers, starting them up to `count`.
  void post(const std::shared_ptr<Job>& job, int count) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (started_ < count) {
      std::thread([this] { serve(); }).detach();
      ++started_;
    }
    current_ = job;
    generation_.fetch_add(1);
    wake_.notify_all();
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    current_.reset();
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  std::shared_ptr<Job> current_;
  std::atomic<uint64_t> generation_{0};
  int started_ = 0;

  void serve() {
    uint64_t seen = generation_.load();
    for (;;) {
      // a short spin first: the next bucket's copy often follows within microseconds
      for (int spin = 0; spin < 2000 && generation_.load() == seen; ++spin) {
#if ROLLOUT_ENGINE_STREAMING
        _mm_pause();
#endif
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        job = current_;
      }
      if (!job) continue;
      job->active.fetch_add(1);
      if (!job->closed.load()) job->work();
      job->active.fetch_sub(1);
    }
  }
};

Helpers& helpers() {
  // threads do not survive a fork: a child starts its own (the parent's are leaked, unused)
  static Helpers* h = nullptr;
  static pid_t owner = -1;
  static std::mutex guard;
  std::lock_guard<std::mutex> lock(guard);
  if (h == nullptr || owner != getpid()) {
    h = new Helpers();
    owner = getpid();
  }
  return *h;
}

}  // namespace

extern "C" {

// dsts[i] <- srcs[i] for nbytes[i] bytes, i < count (the caller owns every range; none
// overlap), cut into pieces of at most piece_bytes, on this thread and up to threads - 1
// helpers; streaming stores if stream (and this build streams), else memcpy. Returns 0.
int rollout_engine_copy_ranges(const int64_t* dsts, const int64_t* srcs, const int64_t* nbytes,
                               int64_t count, int64_t piece_bytes, int64_t threads,
                               int64_t stream) {
  auto job = std::make_shared<Job>();
  job->stream = stream != 0;
  const int64_t piece = piece_bytes > 0 ? piece_bytes : (int64_t(1) << 20);
  for (int64_t i = 0; i < count; ++i) {
    auto* d = reinterpret_cast<unsigned char*>(dsts[i]);
    auto* s = reinterpret_cast<const unsigned char*>(srcs[i]);
    for (int64_t off = 0; off < nbytes[i]; off += piece)
      job->pieces.push_back({d + off, s + off, std::min(piece, nbytes[i] - off)});
  }
  Helpers& h = helpers();
  std::unique_lock<std::mutex> mine(h.busy, std::try_to_lock);
  const bool shared = mine.owns_lock() && threads > 1 && job->pieces.size() > 1;
  if (shared) h.post(job, static_cast<int>(threads - 1));
  job->work();
  job->closed.store(true);
  while (job->active.load() != 0) {
#if ROLLOUT_ENGINE_STREAMING
    _mm_pause();
#endif
  }
  if (shared) h.clear();
  return 0;
}

}  // extern "C"
