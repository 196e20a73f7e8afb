// A process-wide pool of worker threads for the CPU kernels (threads_cpu.h).
#include "threads_cpu.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
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

// The state word of the pool's current call: its number (32 bits), the jobs not yet taken and the workers it still
// lets join (16 bits each: kMaxJobs). Jobs are taken and workers join by compare-and-swap on it, so no thread waits
// for a lock to start or take a job: a contended mutex passes from thread to thread through the kernel, each
// hand-off a wake-up, so threads that all come for work at once would start one after another.
struct CallState {
    uint32_t call;
    int left, helpers;
};
inline uint64_t pack(CallState s) { return uint64_t(s.call) << 32 | uint64_t(s.left) << 16 | uint64_t(s.helpers); }
inline CallState unpack(uint64_t v) { return {uint32_t(v >> 32), int((v >> 16) & 0xffff), int(v & 0xffff)}; }

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
        const int helpers = std::min(std::max(0, max_threads - 1), kMaxJobs);
        job_.store(&job, std::memory_order_relaxed), n_jobs_.store(n_jobs, std::memory_order_relaxed);
        error_ = nullptr;
        pending_.store(n_jobs, std::memory_order_relaxed);
        const uint32_t call = unpack(state_.load(std::memory_order_relaxed)).call + 1;
        state_.store(pack({call, n_jobs, helpers}), std::memory_order_release);
        int sleeping;
        {
            // under the lock a worker going to sleep checks the state: it sees this call or is woken below
            std::lock_guard<std::mutex> lk(m_);
            sleeping = sleepers_;
        }
        // as many sleeping workers as the call wants (the spinning ones see the state change)
        if (helpers >= sleeping)
            wake_.notify_all();
        else
            for (int i = 0; i < helpers; ++i) wake_.notify_one();
        take_jobs(call, false);
        if (!spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
            std::unique_lock<std::mutex> lk(m_);
            done_.wait(lk, [this] { return pending_.load(std::memory_order_acquire) == 0; });
        }
        if (error_) std::rethrow_exception(error_);
        return true;
    }

private:
    // Takes and runs jobs of call `call` while it has any left; a worker (`join`) first takes one of the call's
    // helper places, and takes nothing if none is left. The job and its count are read between a load of the state
    // and the swap that takes a job of that call: the swap succeeds only while the call has jobs left, so it has not
    // ended and its caller has not yet written the next call's over them.
    void take_jobs(uint32_t call, bool join) {
        uint64_t v = state_.load(std::memory_order_acquire);
        for (;;) {
            CallState s = unpack(v);
            if (s.call != call || s.left == 0 || (join && s.helpers == 0)) return;
            const std::function<void(int)> * job = job_.load(std::memory_order_relaxed);
            const int i = n_jobs_.load(std::memory_order_relaxed) - s.left;
            --s.left;
            if (join) --s.helpers;
            if (!state_.compare_exchange_weak(v, pack(s), std::memory_order_acq_rel, std::memory_order_acquire))
                continue;  // v holds the state now
            join = false;
            try {
                (*job)(i);
            } catch (...) {
                std::lock_guard<std::mutex> lk(m_);
                if (!error_) error_ = std::current_exception();
            }
            if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lk(m_);  // the caller may be about to sleep on done_
                done_.notify_all();
            }
            v = state_.load(std::memory_order_acquire);
        }
    }

    // Waits for a call it has not seen (spinning, then asleep), then helps with its jobs if the call wants another
    // thread.
    void work() {
        uint32_t seen = unpack(state_.load(std::memory_order_acquire)).call;
        for (;;) {
            const auto posted = [&] { return unpack(state_.load(std::memory_order_acquire)).call != seen; };
            if (!spin_until(posted)) {
                std::unique_lock<std::mutex> lk(m_);
                ++sleepers_;
                wake_.wait(lk, posted);
                --sleepers_;
            }
            seen = unpack(state_.load(std::memory_order_acquire)).call;
            take_jobs(seen, true);
        }
    }

    std::mutex busy_;  // held by the call running its jobs
    std::mutex m_;     // guards sleepers_ and error_, and orders sleeping against waking
    std::condition_variable wake_, done_;
    std::atomic<uint64_t> state_{0};  // CallState
    // the current call's job and its count, written before its state (atomics: a worker may read them while the
    // next call writes them, and then fails to take a job with what it read)
    std::atomic<const std::function<void(int)> *> job_{nullptr};
    std::atomic<int> n_jobs_{0};
    int sleepers_ = 0;
    std::atomic<int> pending_{0};  // the current call's jobs not yet ended
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
    if (n_jobs == 1 || max_threads <= 1 || n_jobs > kMaxJobs) return run_here(n_jobs, job);
    Pool * p = pool();
    // A busy pool means another call (the CPU experts' worker beside a forward on the CPU) has the cores already:
    // threads started for this one would only take turns with the pool's, and starting them costs more than a
    // small product.
    if (!p || !p->try_run(n_jobs, max_threads, job)) run_here(n_jobs, job);
}

}  // namespace specter
