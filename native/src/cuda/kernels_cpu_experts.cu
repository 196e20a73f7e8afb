// CUDA side of the CPU experts' hand-off (specter_kernels.h): the post kernel writes a MoE layer's pairs for the
// CPU into the mailbox in pinned host memory, the collect kernels wait for the worker's answer and add it.
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

// One CTA: the pairs, the hidden states of the tokens with a pair for the CPU, then the header and, last,
// `request`.
__global__ void __launch_bounds__(1024) post_kernel(volatile MailboxHeader * h, float * hx, int32_t * hids,
                                                   float * hweights, const float * __restrict__ x,
                                                   const int32_t * __restrict__ ids,
                                                   const float * __restrict__ weights,
                                                   const uint8_t * __restrict__ on_cpu, long long layer, int T, int d,
                                                   int k, int n_expert) {
    start_after_prior_kernels();
    __shared__ int n_pairs;
    __shared__ unsigned char needed[kPostFlags];  // token t has a pair for the CPU (T <= kPostFlags)
    const bool flags = T <= kPostFlags;
    if (threadIdx.x == 0) n_pairs = 0;
    for (int t = threadIdx.x; flags && t < T; t += blockDim.x) needed[t] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < T * k; p += blockDim.x) {
        const int e = ids[p];
        const bool cpu = e >= 0 && e < n_expert && on_cpu[e];
        hids[p] = cpu ? e : -1;
        hweights[p] = weights[p];
        if (cpu) {
            atomicAdd(&n_pairs, 1);
            if (flags) needed[p / k] = 1;
        }
    }
    __syncthreads();
    const int pairs = n_pairs;
    if (pairs > 0)
        for (int i = threadIdx.x; i < T * d; i += blockDim.x)
            if (!flags || needed[i / d]) hx[i] = x[i];
    __threadfence_system();  // this thread's payload before the header
    __syncthreads();
    if (threadIdx.x != 0) return;
    h->n_pairs = pairs;
    if (pairs == 0) return;
    h->layer = layer;
    h->n_tokens = T;
    const long long seq = h->issued + 1;
    h->issued = seq;
    __threadfence_system();
    h->request = seq;
}

// One thread: returns once the worker answered the last post (at once when it handed nothing over). It only waits
// (no early launch of the next kernel), as wait_counter_kernel does.
__global__ void await_kernel(const volatile MailboxHeader * h, long long timeout_ns) {
    wait_for_prior_kernels();
    if (h->n_pairs == 0) return;
    const long long want = h->issued;
    const unsigned long long t0 = global_ns();
    while (h->answer != want) {
        __nanosleep(128);
        if (timeout_ns > 0 && global_ns() - t0 > (unsigned long long)timeout_ns) __trap();
    }
    __threadfence_system();
}

// A CTA per token (striding over them): the row of a token with a pair on the CPU is added; the others' rows are
// zero in the result and are not read over PCIe.
__global__ void add_kernel(const volatile MailboxHeader * h, const volatile int32_t * hids,
                           const volatile float * result, float * out, int T, int d, int k) {
    start_after_prior_kernels();
    if (h->n_pairs == 0) return;
    __shared__ bool needed;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        if (threadIdx.x == 0) {
            bool any = false;
            for (int j = 0; j < k; ++j) any |= hids[t * k + j] >= 0;
            needed = any;
        }
        __syncthreads();
        if (needed)
            for (int i = threadIdx.x; i < d; i += blockDim.x) out[size_t(t) * d + i] += result[size_t(t) * d + i];
        __syncthreads();
    }
}

// One CTA, a thread per expert: each ranks its own miss among the layer's by (tokens, expert) and applies cpu_takes.
__global__ void __launch_bounds__(1024) split_kernel(const int64_t * __restrict__ slot_of,
                                                    const int32_t * __restrict__ routed, int n_expert,
                                                    long long cpu_ns_per_expert, long long cpu_ns_per_token,
                                                    long long link_ns, uint8_t * on_cpu, int32_t * cpu_routed) {
    start_after_prior_kernels();
    __shared__ int32_t tokens[1024];  // of each expert's miss; 0: not a miss
    const int e = threadIdx.x;
    int32_t mine = 0;
    if (e < n_expert) {
        const int32_t t = routed[e];
        mine = t > 0 && slot_of[e] < 0 ? t : 0;
        tokens[e] = mine;
    }
    __syncthreads();
    if (e >= n_expert) return;
    long long m = 0, rank = 0, before = 0;
    for (int j = 0; j < n_expert; ++j) {
        const int32_t t = tokens[j];
        m += t > 0;
        if (t > 0 && (t < mine || (t == mine && j < e))) ++rank, before += t;
    }
    const bool take = mine > 0 && cpu_takes(rank, before, mine, m, cpu_ns_per_expert, cpu_ns_per_token, link_ns);
    on_cpu[e] = take;
    cpu_routed[e] = take ? mine : 0;
}

}  // namespace
}  // namespace cuda
}  // namespace specter

using namespace specter;
using namespace specter::cuda;

extern "C" {

int specter_cuda_hybrid_split(const int64_t * slot_of, const int32_t * routed, int64_t n_expert,
                              int64_t cpu_ns_per_expert, int64_t cpu_ns_per_token, int64_t link_ns, uint8_t * on_cpu,
                              int32_t * cpu_routed, void * stream) {
    const int rc =
        check_split(slot_of, routed, n_expert, cpu_ns_per_expert, cpu_ns_per_token, link_ns, on_cpu, cpu_routed);
    if (rc != SPECTER_OK) return rc;
    cudaGetLastError();
    launch(split_kernel, 1, unsigned((n_expert + 31) / 32 * 32), cudaStream_t(stream), slot_of, routed,
           int(n_expert), (long long)cpu_ns_per_expert, (long long)cpu_ns_per_token, (long long)link_ns, on_cpu,
           cpu_routed);
    return launch_status();
}

int specter_cuda_cpu_experts_post(specter_cpu_experts * w, int64_t layer, const float * x, const int32_t * ids,
                                  const float * weights, int64_t n_tokens, const uint8_t * on_cpu, void * stream) {
    const int rc = check_post(w, layer, x, ids, weights, n_tokens, on_cpu);
    if (rc != SPECTER_OK) return rc;
    char * m = w->mailbox;
    cudaGetLastError();
    launch(post_kernel, 1, 1024, cudaStream_t(stream), reinterpret_cast<volatile MailboxHeader *>(m),
           reinterpret_cast<float *>(m + w->layout.x), reinterpret_cast<int32_t *>(m + w->layout.ids),
           reinterpret_cast<float *>(m + w->layout.weights), x, ids, weights, on_cpu, (long long)layer,
           int(n_tokens), int(w->d_model), int(w->top_k), int(w->n_expert));
    return launch_status();
}

int specter_cuda_cpu_experts_collect(specter_cpu_experts * w, float * out, int64_t n_tokens, int64_t timeout_ns,
                                     void * stream) {
    const int rc = check_collect(w, out, n_tokens);
    if (rc != SPECTER_OK) return rc;
    const auto * h = reinterpret_cast<const volatile MailboxHeader *>(w->mailbox);
    const int T = int(n_tokens);
    cudaGetLastError();
    launch(await_kernel, 1, 1, cudaStream_t(stream), h, (long long)timeout_ns);
    launch(add_kernel, unsigned(T < 64 ? T : 64), 256, cudaStream_t(stream), h,
           reinterpret_cast<const volatile int32_t *>(w->mailbox + w->layout.ids),
           reinterpret_cast<const volatile float *>(w->mailbox + w->layout.result), out, T, int(w->d_model),
           int(w->top_k));
    return launch_status();
}

}  // extern "C"
