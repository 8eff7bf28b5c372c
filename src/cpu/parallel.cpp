// src/cpu/parallel.cpp — parallel_for: one atomic task counter shared by short-lived std::threads.
#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace flashattn::cpu {

int parallel_workers(std::int64_t num_tasks, int num_threads) {
  return int(std::max<std::int64_t>(1, std::min<std::int64_t>(num_threads, num_tasks)));
}

int threads_for_work(double flops, int num_threads) {
  const double worth = flops / kMinFlopsPerThread;
  if (!(worth >= 1.0)) return 1;  // also NaN
  return worth >= double(num_threads) ? std::max(1, num_threads) : std::max(1, int(worth));
}

void parallel_for(std::int64_t num_tasks, int num_threads,
                  const std::function<void(std::int64_t task, int worker)>& fn) {
  if (num_tasks <= 0) return;
  const int workers = parallel_workers(num_tasks, num_threads);
  std::atomic<std::int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  const auto work = [&](int worker) {
    for (;;) {
      const std::int64_t task = next.fetch_add(1, std::memory_order_relaxed);
      if (task >= num_tasks) return;
      try {
        fn(task, worker);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next.store(num_tasks, std::memory_order_relaxed);  // hand out no further tasks
        return;
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(std::size_t(workers - 1));
  for (int w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(work, w);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the workers already running share the tasks
    }
  }
  work(0);
  for (std::thread& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace flashattn::cpu
