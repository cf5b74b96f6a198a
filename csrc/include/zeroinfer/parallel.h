// parallel_for over a persistent thread pool, for the CPU twins of the kernels.
//
// Why not OpenMP: the torch CPU wheel ships its own libgomp, and two OpenMP runtimes in one
// process fight over threads. A small pool of our own has no such coupling.
//
// Work is split into chunks handed out by an atomic counter (dynamic scheduling), the calling
// thread takes chunks too, and a call made while the pool is busy (another Python thread, a
// nested call) simply runs inline. The chunk partition never changes results: every kernel
// computes each output element entirely inside one chunk.
#pragma once

#include <cstdint>
#include <functional>

namespace zi {

// Number of threads the pool uses (ZEROINFER_NUM_THREADS, else the hardware concurrency).
int num_threads();

// Calls fn(begin, end) over disjoint ranges covering [0, n), each at most `grain` long
// (grain >= 1). Blocks until all ranges are done; rethrows the first exception.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace zi
