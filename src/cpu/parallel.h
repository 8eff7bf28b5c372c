// src/cpu/parallel.h — a minimal std::thread parallel_for for the CPU flash backend.
#pragma once

#include <cstdint>
#include <functional>

namespace flashattn::cpu {

// How many workers parallel_for(num_tasks, num_threads, …) runs: min(num_threads, num_tasks),
// at least 1. Callers size per-worker scratch with it.
int parallel_workers(std::int64_t num_tasks, int num_threads);

// Threads worth starting for `flops` of work: num_threads, but no more than one per
// kMinFlopsPerThread (at least 1). Starting a thread costs tens of microseconds, and far more when
// the machine's cores are busy; a small call (short sequences, decoding) runs faster on fewer.
inline constexpr double kMinFlopsPerThread = 4e6;
int threads_for_work(double flops, int num_threads);

// Runs fn(task, worker) once for every task in [0, num_tasks), on parallel_workers(…) workers;
// the calling thread is worker 0. Tasks are handed out one at a time in increasing index order
// (dynamic scheduling), so a task may wait for a lower-numbered task to make progress: that task
// has already started on another worker, or finished. Which worker runs a task is not
// deterministic, so results must not depend on `worker` (use it only to pick scratch memory).
// The first exception a task throws is rethrown after every worker has stopped; the remaining
// tasks are then skipped.
void parallel_for(std::int64_t num_tasks, int num_threads,
                  const std::function<void(std::int64_t task, int worker)>& fn);

}  // namespace flashattn::cpu
