#include "zeroinfer/parallel.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace zi {
namespace {

class Pool {
 public:
  explicit Pool(int n) : size_(n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { worker_loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return size_; }

  // Returns false (and does nothing) if another caller holds the pool.
  bool try_run(int64_t n_chunks, const std::function<void(int64_t)>& chunk_fn) {
    std::unique_lock<std::mutex> busy(busy_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &chunk_fn;
      n_chunks_ = n_chunks;
      next_.store(0);
      pending_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    drain();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return pending_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  void drain() {
    for (;;) {
      const int64_t c = next_.fetch_add(1);
      if (c >= n_chunks_) return;
      try {
        (*job_)(c);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_chunks_);  // stop handing out work
      }
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain();
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  const int size_;
  std::vector<std::thread> workers_;
  std::mutex busy_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t n_chunks_ = 0;
  std::atomic<int64_t> next_{0};
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

int configured_threads() {
  if (const char* env = std::getenv("ZEROINFER_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  // A forked child inherits the pool object but not its threads: build a fresh one there
  // (the parent's is leaked on purpose; its threads do not exist in the child).
  static pid_t owner = 0;
  static Pool* p = nullptr;
  static std::mutex mu;
  std::lock_guard<std::mutex> lk(mu);
  if (p == nullptr || owner != getpid()) {
    p = new Pool(configured_threads());
    owner = getpid();
  }
  return *p;
}

}  // namespace

int num_threads() { return pool().size(); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t n_chunks = (n + grain - 1) / grain;
  if (n_chunks == 1) {
    fn(0, n);
    return;
  }
  Pool& p = pool();
  if (p.size() == 1) {
    fn(0, n);
    return;
  }
  const std::function<void(int64_t)> chunk = [&](int64_t c) {
    fn(c * grain, std::min(n, (c + 1) * grain));
  };
  if (!p.try_run(n_chunks, chunk)) fn(0, n);
}

}  // namespace zi
