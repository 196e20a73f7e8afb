// The CPU kernels' threads (internal header of libspecter).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>

namespace specter {

// Runs job(i) for i in [0, n_jobs), the calling thread taking jobs too, and returns when all are done; an
// exception of a job is rethrown here (once every job has ended, or at once when the caller runs them all). The
// jobs go to a pool of worker threads started once per process (starting threads in every call cost tens of µs a
// call); a call made while another holds the pool (another thread's, or from inside a job) runs its jobs on the
// calling thread, in order: the pool's threads have the cores already.
void run_jobs(int n_jobs, const std::function<void(int)> & job);

// The cores the pool is sized for (at least 1).
int hardware_threads();

// Split [0, n) into up to n_threads shares (n_threads <= 0: every core) of at least `min_per` items;
// fn(begin, end) runs each share, in parallel.
template <class Fn>
void parallel_for(int64_t n, int n_threads, int64_t min_per, Fn fn) {
    if (n <= 0) return;
    int64_t nt = n_threads > 0 ? n_threads : hardware_threads();
    nt = std::min<int64_t>(nt, std::max<int64_t>(1, n / std::max<int64_t>(1, min_per)));
    if (nt <= 1) {
        fn(int64_t(0), n);
        return;
    }
    const int64_t per = n / nt, extra = n % nt;
    run_jobs(int(nt), [&](int i) {
        const int64_t b = i * per + std::min<int64_t>(i, extra);
        fn(b, b + per + (i < extra ? 1 : 0));
    });
}

}  // namespace specter
