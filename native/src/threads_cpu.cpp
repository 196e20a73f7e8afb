// A process-wide pool of worker threads for the CPU kernels (threads_cpu.h).
#include "threads_cpu.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace specter {
namespace {

// How long a thread that ran out of work spins for more before it sleeps: a wake-up from sleep costs tens of
// microseconds (on a 2-core development machine one F16 1024x2048 product for one token took 193-215 us on two
// threads against 152-156 on one while the workers slept between calls; 114-116 spinning), while a MoE layer's
// products follow each other at once.
constexpr auto kSpin = std::chrono::microseconds(200);

// Spins until pred() holds or kSpin has passed; whether it holds.
template <class Pred>
bool spin_until(Pred pred) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (pred()) return true;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
        if (std::chrono::steady_clock::now() >= until) return pred();
    }
}

class Pool {
public:
    // The workers wait for jobs until the process ends (the pool is never destroyed); when no more threads can be
    // started, the pool has the ones it got.
    explicit Pool(int n_workers) {
        for (int i = 0; i < n_workers; ++i) {
            try {
                workers_.emplace_back([this] { work(); });
            } catch (...) {
                break;
            }
        }
    }

    // false when another call holds the pool
    bool try_run(int n_jobs, int max_threads, const std::function<void(int)> & job) {
        std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
        if (!busy.owns_lock()) return false;
        int sleeping, helpers;
        {
            std::lock_guard<std::mutex> lk(m_);
            job_ = &job, n_jobs_ = n_jobs, next_ = 0, error_ = nullptr;
            helpers_allowed_ = helpers = std::max(0, max_threads - 1), helpers_ = 0;
            pending_.store(n_jobs);
            posted_.fetch_add(1);  // what spinning and sleeping workers watch
            sleeping = sleepers_;
        }
        // as many sleeping workers as the call wants (the spinning ones see posted_ move)
        if (helpers >= sleeping)
            wake_.notify_all();
        else
            for (int i = 0; i < helpers; ++i) wake_.notify_one();
        std::unique_lock<std::mutex> lk(m_);
        take_jobs(lk);
        lk.unlock();
        spin_until([this] { return pending_.load() == 0; });
        lk.lock();
        done_.wait(lk, [this] { return pending_.load() == 0; });
        job_ = nullptr;
        if (error_) std::rethrow_exception(error_);
        return true;
    }

private:
    // Runs jobs while there are any left (`lk` held on entry and on return).
    void take_jobs(std::unique_lock<std::mutex> & lk) {
        while (next_ < n_jobs_) {
            const int i = next_++;
            const std::function<void(int)> & job = *job_;
            lk.unlock();
            std::exception_ptr error;
            try {
                job(i);
            } catch (...) {
                error = std::current_exception();
            }
            lk.lock();
            if (error && !error_) error_ = error;
            if (pending_.fetch_sub(1) == 1) done_.notify_all();
        }
    }

    // Waits for a call it has not seen (spinning, then asleep), then helps with its jobs if the call wants another
    // thread (`lk` held throughout but while spinning, asleep or running a job).
    void work() {
        std::unique_lock<std::mutex> lk(m_);
        unsigned long long seen = posted_.load();
        for (;;) {
            lk.unlock();
            spin_until([&] { return posted_.load() != seen; });
            lk.lock();
            ++sleepers_;
            wake_.wait(lk, [&] { return posted_.load() != seen; });
            --sleepers_;
            seen = posted_.load();
            if (helpers_ < helpers_allowed_) {
                ++helpers_;
                take_jobs(lk);
            }
        }
    }

    std::mutex busy_;  // held by the call running its jobs
    std::mutex m_;     // guards everything below; the atomics are written under it and also read without it
    std::condition_variable wake_, done_;
    const std::function<void(int)> * job_ = nullptr;
    int n_jobs_ = 0, next_ = 0, sleepers_ = 0;
    int helpers_allowed_ = 0, helpers_ = 0;  // workers the call wants beside its own thread; those that joined it
    std::atomic<int> pending_{0};
    std::atomic<unsigned long long> posted_{0};  // calls posted so far
    std::exception_ptr error_;
    std::vector<std::thread> workers_;
};

// The pool of this process, made on first use: a child made by fork() has none of its parent's threads, so it
// makes its own (the parent's pool object is left alone there).
Pool * pool() {
    static std::mutex made;
    static Pool * p = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lk(made);
    if (!p || owner != getpid()) {
        try {
            p = new Pool(hardware_threads() - 1);
        } catch (...) {
            return nullptr;  // no threads to be had: the caller runs its jobs itself
        }
        owner = getpid();
    }
    return p;
}

// Jobs on the calling thread, in order.
void run_here(int n_jobs, const std::function<void(int)> & job) {
    for (int i = 0; i < n_jobs; ++i) job(i);
}

}  // namespace

int hardware_threads() {
    static const int n = std::max(1, int(std::thread::hardware_concurrency()));
    return n;
}

void run_jobs(int n_jobs, int max_threads, const std::function<void(int)> & job) {
    if (n_jobs <= 0) return;
    if (n_jobs == 1 || max_threads <= 1) return run_here(n_jobs, job);
    Pool * p = pool();
    // A busy pool means another call (the CPU experts' worker beside a forward on the CPU) has the cores already:
    // threads started for this one would only take turns with the pool's, and starting them costs more than a
    // small product.
    if (!p || !p->try_run(n_jobs, max_threads, job)) run_here(n_jobs, job);
}

}  // namespace specter
