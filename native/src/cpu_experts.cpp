// CPU experts beside a GPU forward (specter_kernels.h): the handle, its worker thread and the CPU entry points.
#include "cpu_experts.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "specter_kernels.h"

namespace specter {

struct LayerExperts {
    std::vector<uint64_t> gate, up, down;
    int gate_type = -1, up_type = -1, down_type = -1;
};

struct CpuExpertsWorker {
    std::vector<LayerExperts> layers;
    std::vector<unsigned char> workspace_bytes;  // specter_moe_ffn's workspace, from the first kWsAlign boundary
    unsigned char * workspace = nullptr;
    size_t workspace_size = 0;
    int n_threads = 0;
    int64_t hot_ns = 0;  // how long the worker polls without pause after a post, an answer or `arm`
    std::atomic<bool> stop{false};
    std::atomic<int64_t> armed_until_ns{0};
    std::atomic<int64_t> busy_ns{0};  // time spent computing answers (specter_cpu_experts_busy_ns)
    std::mutex mutex;
    std::condition_variable wake;
    std::thread thread;
};

namespace {

// A worker that is not hot sleeps between looks at the mailbox (`arm` and a CPU post wake it): kColdPoll at most
// for kIdleAfter after it was last hot (a forward armed earlier can still post: the GPU runs behind the host),
// kIdlePoll at most after that. Polling at kColdPoll for good took 10% of a core in an idle process (2026-12-06,
// 2-core development machine: 16,000 wake-ups in 3 s).
constexpr auto kColdPoll = std::chrono::microseconds(100);
constexpr int64_t kIdleAfterNs = 1'000'000'000;
constexpr std::chrono::microseconds kIdlePoll = std::chrono::milliseconds(10);

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

MailboxHeader * header(const specter_cpu_experts * w) { return reinterpret_cast<MailboxHeader *>(w->mailbox); }

template <class T>
T * at(const specter_cpu_experts * w, size_t offset) {
    return reinterpret_cast<T *>(w->mailbox + offset);
}

int64_t load(const int64_t * p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store(int64_t * p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

void keep_first_error(MailboxHeader * h, int rc) {
    int32_t none = SPECTER_OK;
    __atomic_compare_exchange_n(&h->error, &none, int32_t(rc), false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

// The sum of the post `seq`'s pairs into `result`, then the answer.
void answer(specter_cpu_experts * w, int64_t seq) {
    MailboxHeader * h = header(w);
    CpuExpertsWorker & k = *w->worker;
    const int64_t layer = load(&h->layer), T = load(&h->n_tokens);
    float * result = at<float>(w, w->layout.result);
    int rc = SPECTER_ERR_INVALID_ARG;
    const int64_t t0 = now_ns();
    if (layer >= 0 && layer < w->n_layer && T >= 1 && T <= w->max_tokens) {
        const LayerExperts & e = k.layers[size_t(layer)];
        rc = e.gate_type < 0 ? SPECTER_ERR_INVALID_ARG
                             : specter_moe_ffn(at<float>(w, w->layout.x), T, w->d_model, at<int32_t>(w, w->layout.ids),
                                               at<float>(w, w->layout.weights), w->top_k, w->n_expert, w->d_ff,
                                               e.gate.data(), e.gate_type, e.up.data(), e.up_type, e.down.data(),
                                               e.down_type, k.workspace, k.workspace_size, result, 0, k.n_threads);
    }
    if (rc != SPECTER_OK) {
        std::memset(result, 0, size_t(w->max_tokens * w->d_model) * sizeof(float));
        keep_first_error(h, rc);
    }
    k.busy_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    store(&h->answer, seq);
}

void run(specter_cpu_experts * w) {
    MailboxHeader * h = header(w);
    CpuExpertsWorker & k = *w->worker;
    int64_t answered = load(&h->answer), hot_until = now_ns() + k.hot_ns;
    while (!k.stop.load(std::memory_order_acquire)) {
        const int64_t seq = load(&h->request);
        if (seq != answered) {
            answer(w, seq);
            answered = seq;
            hot_until = now_ns() + k.hot_ns;
            continue;
        }
        const int64_t t = now_ns(), hot = std::max(hot_until, k.armed_until_ns.load(std::memory_order_relaxed));
        if (t < hot) {
            std::this_thread::yield();  // a core short of work (the CPU build's own kernels) gets it back
            continue;
        }
        std::unique_lock<std::mutex> lock(k.mutex);
        k.wake.wait_for(lock, t - hot < kIdleAfterNs ? kColdPoll : kIdlePoll, [&] {
            return k.stop.load() || k.armed_until_ns.load(std::memory_order_relaxed) > now_ns() ||
                   load(&h->request) != answered;
        });
    }
}

}  // namespace
}  // namespace specter

using namespace specter;

extern "C" {

int specter_cpu_experts_mailbox_size(int64_t max_tokens, int64_t top_k, int64_t d_model, size_t * out_bytes) {
    if (!out_bytes || max_tokens < 1 || top_k < 1 || d_model < 1) return SPECTER_ERR_INVALID_ARG;
    *out_bytes = mailbox_layout(max_tokens, top_k, d_model).total;
    return SPECTER_OK;
}

int specter_cpu_experts_new(int64_t n_layer, int64_t n_expert, int64_t d_model, int64_t d_ff, int64_t top_k,
                            int64_t max_tokens, void * mailbox, size_t mailbox_bytes, int n_threads, int64_t hot_ns,
                            specter_cpu_experts ** out) {
    if (!out || !mailbox || n_layer < 1 || n_expert < 1 || d_model < 1 || d_ff < 1 || top_k < 1 || top_k > n_expert ||
        max_tokens < 1 || n_threads < 0 || hot_ns < 0)
        return SPECTER_ERR_INVALID_ARG;
    const MailboxLayout layout = mailbox_layout(max_tokens, top_k, d_model);
    if (mailbox_bytes < layout.total || reinterpret_cast<uintptr_t>(mailbox) % kWsAlign != 0) return SPECTER_ERR_INVALID_ARG;
    size_t workspace = 0;
    int rc = specter_moe_workspace_size(max_tokens, top_k, n_expert, d_model, d_ff, &workspace);
    if (rc != SPECTER_OK) return rc;
    specter_cpu_experts * w = new (std::nothrow) specter_cpu_experts{};
    CpuExpertsWorker * k = w ? new (std::nothrow) CpuExpertsWorker{} : nullptr;
    if (!k) {
        delete w;
        return SPECTER_ERR_OUT_OF_MEMORY;
    }
    *w = specter_cpu_experts{n_layer, n_expert, d_model, d_ff, top_k, max_tokens, static_cast<char *>(mailbox),
                             layout, k};
    std::memset(mailbox, 0, layout.total);
    try {
        k->layers.resize(size_t(n_layer));
        k->workspace_bytes.resize(workspace + kWsAlign);
        const uintptr_t at = reinterpret_cast<uintptr_t>(k->workspace_bytes.data());
        k->workspace = k->workspace_bytes.data() + (kWsAlign - at % kWsAlign) % kWsAlign;
        k->workspace_size = workspace;
        k->n_threads = n_threads;
        k->hot_ns = hot_ns;
        k->thread = std::thread(run, w);
    } catch (...) {
        delete k;
        delete w;
        return SPECTER_ERR_OUT_OF_MEMORY;
    }
    *out = w;
    return SPECTER_OK;
}

int specter_cpu_experts_set_layer(specter_cpu_experts * w, int64_t layer, const uint64_t * gate_ptrs, int gate_type,
                                  const uint64_t * up_ptrs, int up_type, const uint64_t * down_ptrs, int down_type) {
    if (!w || layer < 0 || layer >= w->n_layer || !gate_ptrs || !up_ptrs || !down_ptrs) return SPECTER_ERR_INVALID_ARG;
    const size_t n = size_t(w->n_expert);
    for (int type : {gate_type, up_type, down_type}) {
        int64_t elems = 0;
        const int rc = specter_type_block_size(type, &elems, nullptr);
        if (rc != SPECTER_OK) return rc;
    }
    LayerExperts & e = w->worker->layers[size_t(layer)];
    try {
        e.gate.assign(gate_ptrs, gate_ptrs + n);
        e.up.assign(up_ptrs, up_ptrs + n);
        e.down.assign(down_ptrs, down_ptrs + n);
    } catch (...) {
        return SPECTER_ERR_OUT_OF_MEMORY;
    }
    e.gate_type = gate_type, e.up_type = up_type, e.down_type = down_type;
    return SPECTER_OK;
}

int specter_cpu_experts_free(specter_cpu_experts * w) {
    if (!w) return SPECTER_ERR_INVALID_ARG;
    CpuExpertsWorker * k = w->worker;
    k->stop.store(true, std::memory_order_release);
    k->wake.notify_all();
    k->thread.join();
    delete k;
    delete w;
    return SPECTER_OK;
}

int specter_cpu_experts_status(const specter_cpu_experts * w) {
    if (!w) return SPECTER_ERR_INVALID_ARG;
    return __atomic_load_n(&header(w)->error, __ATOMIC_ACQUIRE);
}

int specter_cpu_experts_busy_ns(const specter_cpu_experts * w, int64_t * out_ns) {
    if (!w || !out_ns) return SPECTER_ERR_INVALID_ARG;
    *out_ns = w->worker->busy_ns.load(std::memory_order_relaxed);
    return SPECTER_OK;
}

int specter_cpu_experts_arm(specter_cpu_experts * w) {
    if (!w) return SPECTER_ERR_INVALID_ARG;
    w->worker->armed_until_ns.store(now_ns() + w->worker->hot_ns, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lock(w->worker->mutex);  // a worker about to sleep sees the post or the wake
    }
    w->worker->wake.notify_one();
    return SPECTER_OK;
}

int specter_cpu_experts_post(specter_cpu_experts * w, int64_t layer, const float * x, const int32_t * ids,
                             const float * weights, int64_t n_tokens, const int64_t * slot_of, const int32_t * routed,
                             const specter_hybrid_costs * costs, const specter_spare_slots * spares,
                             uint8_t * on_cpu, int32_t * cpu_routed, int n_threads) {
    (void)n_threads;
    const int rc = check_post(w, layer, x, ids, weights, n_tokens, slot_of, routed, costs, spares, on_cpu,
                              cpu_routed);
    if (rc != SPECTER_OK) return rc;
    MailboxHeader * h = header(w);
    if (load(&h->answer) != h->issued) return SPECTER_ERR_INVALID_ARG;  // the last post was not collected
    // the split: the misses ranked by (tokens, expert); the CPU takes the prefix cpu_takes accepts
    const int64_t E = w->n_expert;
    std::vector<uint8_t> linked(size_t(E), 0);  // the misses the spare slots take first
    if (spares && spares->n_spare > 0) {
        for (int64_t e = 0; e < E; ++e) linked[size_t(e)] = routed[e] > 0;
        int expert[SPECTER_MAX_SPARES], spare[SPECTER_MAX_SPARES];
        const int n = assign_spares(slot_of, linked.data(), nullptr, E, spares->slots, spares->n_spare, expert,
                                    spare);
        std::fill(linked.begin(), linked.end(), uint8_t(0));
        for (int i = 0; i < n; ++i) linked[size_t(expert[i])] = 1;
    }
    std::vector<std::pair<int32_t, int64_t>> misses;
    for (int64_t e = 0; e < E; ++e) {
        on_cpu[e] = 0, cpu_routed[e] = 0;
        if (routed[e] > 0 && slot_of[e] < 0 && !linked[size_t(e)]) misses.emplace_back(routed[e], e);
    }
    std::sort(misses.begin(), misses.end());
    const int64_t m = int64_t(misses.size());
    int64_t before = 0;
    for (int64_t r = 0; r < m && cpu_takes(r, before, misses[size_t(r)].first, m, *costs); ++r) {
        const auto [tokens, e] = misses[size_t(r)];
        on_cpu[e] = 1, cpu_routed[e] = tokens, before += tokens;
    }
    // the pairs of those experts
    const int64_t P = n_tokens * w->top_k;
    int32_t * pair_ids = at<int32_t>(w, w->layout.ids);
    float * pair_weights = at<float>(w, w->layout.weights);
    int64_t n_pairs = 0;
    for (int64_t p = 0; p < P; ++p) {
        const bool cpu = has_cpu_pair(ids + p, 1, E, on_cpu);
        pair_ids[p] = cpu ? ids[p] : -1;
        pair_weights[p] = weights[p];
        n_pairs += cpu;
    }
    if (n_pairs == 0) return SPECTER_OK;
    std::memcpy(at<float>(w, w->layout.x), x, size_t(n_tokens * w->d_model) * sizeof(float));
    store(&h->layer, layer);
    store(&h->n_tokens, n_tokens);
    h->issued += 1;
    store(&h->request, h->issued);
    return specter_cpu_experts_arm(w);
}

int specter_cpu_experts_collect(specter_cpu_experts * w, float * out, const int32_t * ids, const uint8_t * on_cpu,
                                int64_t n_tokens, int64_t timeout_ns, int64_t * waited_ns, int n_threads) {
    (void)n_threads;
    const int rc = check_collect(w, out, ids, on_cpu, n_tokens);
    if (rc != SPECTER_OK) return rc;
    MailboxHeader * h = header(w);
    const int64_t k = w->top_k, d = w->d_model;
    bool handed = false;  // the post handed pairs over
    for (int64_t t = 0; t < n_tokens && !handed; ++t) handed = has_cpu_pair(ids + t * k, k, w->n_expert, on_cpu);
    if (!handed) return SPECTER_OK;
    if (load(&h->n_tokens) != n_tokens) return SPECTER_ERR_INVALID_ARG;
    const int64_t t0 = now_ns();
    while (load(&h->answer) != h->issued) {
        if (timeout_ns > 0 && now_ns() - t0 > timeout_ns) return SPECTER_ERR_TIMEOUT;
        std::this_thread::yield();
    }
    if (waited_ns) *waited_ns += now_ns() - t0;
    const int error = specter_cpu_experts_status(w);
    if (error != SPECTER_OK) return error;
    const float * result = at<float>(w, w->layout.result);
    for (int64_t t = 0; t < n_tokens; ++t)
        if (has_cpu_pair(ids + t * k, k, w->n_expert, on_cpu))
            for (int64_t i = t * d; i < (t + 1) * d; ++i) out[i] += result[i];
    return SPECTER_OK;
}

}  // extern "C"
