// CUDA side of the CPU experts' hand-off (specter_kernels.h): the post kernel splits a MoE layer's missed experts
// and writes the CPU's pairs into the mailbox in pinned host memory, the collect kernel waits for the worker's
// answer and adds it.
#include <cstdint>

#include "cpu_experts.h"
#include "launch.cuh"
#include "specter_kernels.h"

namespace specter {
namespace cuda {
namespace {

// Up to this many tokens, the post kernel copies the hidden states of the tokens with a pair for the CPU only (a
// short prefill's rows would otherwise all cross PCIe from one CTA); more tokens are copied whole.
constexpr int kPostFlags = 1024;

// One CTA. First the split, a thread per expert: each ranks its own miss among the layer's by (tokens, expert) and
// applies cpu_takes (with spares, over the misses the spare slots do not take: assign_spares, by thread 0);
// then, where the CPU takes any pair, the pairs, the hidden states of the tokens with a pair for the CPU, then the
// header and, last, `request` (a post that hands nothing over writes no host memory).
__global__ void __launch_bounds__(1024) post_kernel(volatile MailboxHeader * h, float * hx, int32_t * hids,
                                                   float * hweights, const float * __restrict__ x,
                                                   const int32_t * __restrict__ ids,
                                                   const float * __restrict__ weights,
                                                   const int64_t * __restrict__ slot_of,
                                                   const int32_t * __restrict__ routed, specter_hybrid_costs costs,
                                                   specter_spare_slots spares, uint8_t * on_cpu,
                                                   int32_t * cpu_routed,
                                                   long long layer, int T, int d, int k, int n_expert) {
    start_after_prior_kernels();
    __shared__ int32_t tokens[1024];  // of each expert's miss; 0: not a miss
    __shared__ unsigned char taken[1024];  // the CPU computes the expert
    __shared__ int n_pairs;
    __shared__ unsigned char needed[kPostFlags];  // token t has a pair for the CPU (T <= kPostFlags)
    const bool flags = T <= kPostFlags;
    const int e = threadIdx.x;
    int32_t mine = 0;
    if (e < n_expert) {
        const int32_t t = routed[e];
        mine = t > 0 && slot_of[e] < 0 ? t : 0;
        tokens[e] = mine;
    }
    if (threadIdx.x == 0) n_pairs = 0;
    for (int t = threadIdx.x; flags && t < T; t += blockDim.x) needed[t] = 0;
    if (spares.n_spare > 0) {  // the spares' misses are the link's
        if (e < n_expert) taken[e] = routed[e] > 0;  // (as assign_spares' `used`)
        __syncthreads();
        if (threadIdx.x == 0) {
            int expert[SPECTER_MAX_SPARES], spare[SPECTER_MAX_SPARES];
            const int n = assign_spares(slot_of, taken, nullptr, n_expert, spares.slots, spares.n_spare, expert,
                                        spare);
            for (int i = 0; i < n; ++i) tokens[expert[i]] = 0;
        }
        __syncthreads();
        if (e < n_expert) mine = tokens[e];
    }
    __syncthreads();
    if (e < n_expert) {
        long long m = 0, rank = 0, before = 0;
        for (int j = 0; j < n_expert; ++j) {
            const int32_t t = tokens[j];
            m += t > 0;
            if (t > 0 && (t < mine || (t == mine && j < e))) ++rank, before += t;
        }
        const bool take = mine > 0 && cpu_takes(rank, before, mine, m, costs);
        taken[e] = take;
        on_cpu[e] = take;
        cpu_routed[e] = take ? mine : 0;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < T * k; p += blockDim.x) {
        if (has_cpu_pair(ids + p, 1, n_expert, taken)) {
            atomicAdd(&n_pairs, 1);
            if (flags) needed[p / k] = 1;
        }
    }
    __syncthreads();
    if (n_pairs == 0) return;  // nothing for the CPU: no write over PCIe
    for (int p = threadIdx.x; p < T * k; p += blockDim.x) {
        hids[p] = has_cpu_pair(ids + p, 1, n_expert, taken) ? ids[p] : -1;
        hweights[p] = weights[p];
    }
    for (int i = threadIdx.x; i < T * d; i += blockDim.x)
        if (!flags || needed[i / d]) hx[i] = x[i];
    __threadfence_system();  // this thread's payload before the header
    __syncthreads();
    if (threadIdx.x != 0) return;
    h->layer = layer;
    h->n_tokens = T;
    const long long seq = h->issued + 1;
    h->issued = seq;
    __threadfence_system();
    h->request = seq;
}

// A CTA per token (striding over them). Which tokens have a pair on the CPU is read from the post's own inputs in
// device memory: a CTA with such a token waits for the worker's answer (its first thread polls) and adds their rows;
// the other rows are zero in the result and are not read over PCIe, and a layer that handed nothing over reads no
// host memory at all. The first CTA waits whenever any does and counts its wait into `waited_ns`. The next kernel
// may launch once this one's waits are over (launch.cuh).
__global__ void collect_kernel(const volatile MailboxHeader * h, const int32_t * __restrict__ ids,
                               const uint8_t * __restrict__ on_cpu, const volatile float * result, float * out,
                               int T, int d, int k, int n_expert, long long timeout_ns,
                               unsigned long long * waited_ns) {
    wait_for_prior_kernels();
    __shared__ bool any;
    if (threadIdx.x == 0) {
        bool mine = false;
        for (int t = blockIdx.x; t < T && !mine; t += gridDim.x)
            mine = has_cpu_pair(ids + size_t(t) * k, k, n_expert, on_cpu);
        const bool first = blockIdx.x == 0;
        if (mine || (first && has_cpu_pair(ids, (long long)T * k, n_expert, on_cpu))) {
            const long long want = h->request;
            const unsigned long long t0 = global_ns();
            unsigned long long now = t0;
            while (h->answer != want) {
                __nanosleep(128);
                now = global_ns();
                if (timeout_ns > 0 && now - t0 > (unsigned long long)timeout_ns) __trap();
            }
            __threadfence_system();
            if (first && waited_ns) atomicAdd(waited_ns, now - t0);
        }
        any = mine;
    }
    __syncthreads();
    let_next_kernel_launch();
    if (!any) return;
    for (int t = blockIdx.x; t < T; t += gridDim.x)
        if (has_cpu_pair(ids + size_t(t) * k, k, n_expert, on_cpu))
            for (int i = threadIdx.x; i < d; i += blockDim.x) out[size_t(t) * d + i] += result[size_t(t) * d + i];
}

}  // namespace
}  // namespace cuda
}  // namespace specter

using namespace specter;
using namespace specter::cuda;

extern "C" {

int specter_cuda_cpu_experts_post(specter_cpu_experts * w, int64_t layer, const float * x, const int32_t * ids,
                                  const float * weights, int64_t n_tokens, const int64_t * slot_of,
                                  const int32_t * routed, const specter_hybrid_costs * costs,
                                  const specter_spare_slots * spares, uint8_t * on_cpu, int32_t * cpu_routed,
                                  void * stream) {
    const int rc = check_post(w, layer, x, ids, weights, n_tokens, slot_of, routed, costs, spares, on_cpu,
                              cpu_routed);
    if (rc != SPECTER_OK) return rc;
    char * m = w->mailbox;
    cudaGetLastError();
    launch(post_kernel, 1, 1024, cudaStream_t(stream), reinterpret_cast<volatile MailboxHeader *>(m),
           reinterpret_cast<float *>(m + w->layout.x), reinterpret_cast<int32_t *>(m + w->layout.ids),
           reinterpret_cast<float *>(m + w->layout.weights), x, ids, weights, slot_of, routed, *costs,
           spares ? *spares : specter_spare_slots{nullptr, 0, nullptr, nullptr}, on_cpu, cpu_routed,
           (long long)layer, int(n_tokens), int(w->d_model), int(w->top_k), int(w->n_expert));
    return launch_status();
}

int specter_cuda_cpu_experts_collect(specter_cpu_experts * w, float * out, const int32_t * ids,
                                     const uint8_t * on_cpu, int64_t n_tokens, int64_t timeout_ns, int64_t * waited_ns,
                                     void * stream) {
    const int rc = check_collect(w, out, ids, on_cpu, n_tokens);
    if (rc != SPECTER_OK) return rc;
    const int T = int(n_tokens);
    cudaGetLastError();
    launch(collect_kernel, unsigned(T < 64 ? T : 64), 256, cudaStream_t(stream),
           reinterpret_cast<const volatile MailboxHeader *>(w->mailbox), ids, on_cpu,
           reinterpret_cast<const volatile float *>(w->mailbox + w->layout.result), out, T, int(w->d_model),
           int(w->top_k), int(w->n_expert), (long long)timeout_ns, reinterpret_cast<unsigned long long *>(waited_ns));
    return launch_status();
}

}  // extern "C"
