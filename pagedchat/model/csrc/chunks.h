// The library's parallel loops: chunks claimed from a counter, and the caller waits only for chunks taken.
//
// at::parallel_for (OpenMP) splits a loop evenly over its team and ends at a barrier. On a machine where another
// process (the chat app's UI) takes a core now and then, the thread that loses its core finishes its half a
// time slice late, and every barrier waits for it: a decode step, about ten loops a layer, then runs slower
// than on one thread. Here the caller and the pool's workers claim small chunks in turn; a worker that is not
// running claims none, and the caller, having done the rest itself, goes on. It waits only for a chunk some
// worker is in the middle of.
//
// Every chunk is [begin + i * chunk, ...) whoever runs it, and the loops' bodies compute each row the same way
// whatever range they are given, so results are the same bits at any thread count and any claiming order.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEDCHAT_PAUSE() _mm_pause()
#else
#define PAGEDCHAT_PAUSE() std::this_thread::yield()
#endif

namespace chunks {

// Chunks a thread's share is cut into: small enough that a thread losing its core leaves little for the others
// to wait on, few enough that claiming stays a small cost.
constexpr int64_t CHUNKS_PER_THREAD = 8;
// A worker spins this long for the next loop before it sleeps: a step's loops come microseconds apart.
constexpr auto SPIN = std::chrono::microseconds(300);

// The claim counter packs the loop's generation, its chunk count and the next chunk's index, so a worker that
// claims late (its loop done and another begun) gets a valid chunk of the loop it finds, or none.
constexpr int IDX_BITS = 20, COUNT_BITS = 20;
constexpr uint64_t IDX_MASK = (uint64_t(1) << IDX_BITS) - 1;
constexpr int64_t MAX_CHUNKS = int64_t(1) << (IDX_BITS - 1);  // headroom for claims past the end

inline uint64_t generation(uint64_t t) { return t >> (IDX_BITS + COUNT_BITS); }
inline int64_t count_of(uint64_t t) { return int64_t((t >> IDX_BITS) & ((uint64_t(1) << COUNT_BITS) - 1)); }
inline int64_t index_of(uint64_t t) { return int64_t(t & IDX_MASK); }

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: its workers outlive static destruction at exit
    return *pool;
  }

  // f(b0, b1) over [begin, end) in chunks of at least `grain`, on up to `threads` threads (this one included).
  template <typename F>
  void run(int64_t begin, int64_t end, int64_t grain, int threads, const F& f) {
    const int64_t n = end - begin;
    const int64_t chunk = std::max<int64_t>(std::max<int64_t>(grain, 1),
                                            (n + threads * CHUNKS_PER_THREAD - 1) / (threads * CHUNKS_PER_THREAD));
    const int64_t count = (n + chunk - 1) / chunk;
    std::unique_lock<std::mutex> mine(caller_, std::defer_lock);
    if (inside() || count > MAX_CHUNKS || !mine.try_lock()) {  // a loop in a loop, or beside another's: here
      f(begin, end);
      return;
    }
    inside() = true;
    struct Leave { ~Leave() { inside() = false; } } leave;
    grow(threads - 1);
    begin_ = begin, end_ = end, chunk_ = chunk, body_ = &f;
    call_ = [](const void* body, int64_t b0, int64_t b1) { (*static_cast<const F*>(body))(b0, b1); };
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    wanted_.store(threads - 1, std::memory_order_relaxed);
    const uint64_t gen = generation(ticket_.load(std::memory_order_relaxed)) + 1;
    ticket_.store((gen << (IDX_BITS + COUNT_BITS)) | (uint64_t(count) << IDX_BITS));  // seq_cst: see sleep()
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    work();
    for (int spins = 0; done_.load(std::memory_order_acquire) < count; ++spins) {
      if (spins < 2000) PAGEDCHAT_PAUSE();
      else std::this_thread::yield();  // the worker we wait for may need this core
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  Pool() = default;

  // This thread runs a loop's chunk (a worker always does): a loop inside it runs inline.
  static bool& inside() {
    thread_local bool flag = false;
    return flag;
  }

  // Claim and run chunks of the current loop until none are left.
  void work() {
    for (;;) {
      const uint64_t t = ticket_.fetch_add(1, std::memory_order_acq_rel);
      const int64_t i = index_of(t);
      if (i >= count_of(t)) return;
      const int64_t b0 = begin_ + i * chunk_, b1 = std::min(end_, b0 + chunk_);
      try {
        call_(body_, b0, b1);
      } catch (...) {
        std::lock_guard<std::mutex> lock(sleep_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void grow(int workers) {
    while (int(threads_.size()) < workers) {
      const int id = int(threads_.size());
      threads_.emplace_back([this, id] { serve(id); });
      threads_.back().detach();
    }
  }

  bool open(uint64_t seen) const {
    const uint64_t t = ticket_.load();
    return generation(t) != generation(seen) && index_of(t) < count_of(t);
  }

  void serve(int id) {
    inside() = true;
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + SPIN;
      while (!open(seen) && std::chrono::steady_clock::now() < until) PAGEDCHAT_PAUSE();
      if (!open(seen)) sleep(seen);
      seen = ticket_.load();
      if (id < wanted_.load(std::memory_order_relaxed)) work();
    }
  }

  void sleep(uint64_t seen) {
    std::unique_lock<std::mutex> lock(sleep_);
    sleepers_.fetch_add(1);  // seq_cst with the ticket's store: the caller sees a sleeper or the sleeper the loop
    wake_.wait(lock, [&] { return open(seen); });
    sleepers_.fetch_sub(1);
  }

  std::mutex caller_;                   // one loop at a time
  std::vector<std::thread> threads_;
  // Each counter on a cache line of its own: the claims, the completions and the sleepers change apart.
  alignas(64) std::atomic<uint64_t> ticket_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  std::atomic<int> wanted_{0};          // workers that take part in the current loop
  alignas(64) std::atomic<int> sleepers_{0};
  std::mutex sleep_;
  std::condition_variable wake_;
  // The current loop; written before its ticket is published, read by whoever claims one of its chunks.
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  const void* body_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  std::exception_ptr error_;
};

// at::parallel_for's contract (f over [begin, end) in ranges of at least grain; one call inline when it is
// small or there is one thread), scheduled by claiming.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int threads = at::get_num_threads();
  if (end <= begin) return;
  if (threads <= 1 || end - begin <= grain) {
    f(begin, end);
    return;
  }
  Pool::get().run(begin, end, grain, threads, f);
}

}  // namespace chunks
