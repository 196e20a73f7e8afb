// The CPU kernels' threads (internal header of libspecter).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>

namespace specter {

// Runs job(i) for i in [0, n_jobs) on up to max_threads threads, the calling thread among them, and returns when all
// are done; an exception of a job is rethrown here (once every job has ended, or at once when the caller runs them
// all). The jobs go to a pool of worker threads started once per process (starting threads in every call cost tens
// of µs a call), each taking the next job as it comes free; a call made while another holds the pool (another
// thread's, or from inside a job) runs its jobs on the calling thread, in order: the pool's threads have the cores
// already.
void run_jobs(int n_jobs, int max_threads, const std::function<void(int)> & job);

// The most jobs a call hands to the pool (more run on the calling thread).
constexpr int kMaxJobs = 0xffff;

// The cores the pool is sized for (at least 1).
int hardware_threads();

// Jobs a parallel_for makes per thread: the pool hands them out as threads come free, so a thread that starts late
// (woken from sleep, or sharing its core) takes fewer and the others take the rest, where one share per thread left
// the call waiting for the last one.
constexpr int64_t kJobsPerThread = 4;

// Split [0, n) into contiguous jobs of at least `min_per` items, up to kJobsPerThread for each of n_threads threads
// (n_threads <= 0: every core); fn(begin, end) runs each job, in parallel.
template <class Fn>
void parallel_for(int64_t n, int n_threads, int64_t min_per, Fn fn) {
    if (n <= 0) return;
    const int64_t nt = n_threads > 0 ? n_threads : hardware_threads();
    const int64_t jobs = std::min<int64_t>({nt > 1 ? nt * kJobsPerThread : 1, int64_t(kMaxJobs),
                                            std::max<int64_t>(1, n / std::max<int64_t>(1, min_per))});
    if (jobs <= 1) {
        fn(int64_t(0), n);
        return;
    }
    const int64_t per = n / jobs, extra = n % jobs;
    run_jobs(int(jobs), int(std::min(nt, jobs)), [&](int i) {
        const int64_t b = i * per + std::min<int64_t>(i, extra);
        fn(b, b + per + (i < extra ? 1 : 0));
    });
}

}  // namespace specter
