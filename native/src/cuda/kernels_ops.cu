// CUDA versions of the small fused ops of a decode step (specter_kernels.h): the residual add and its norm, MoE
// top-k routing and the attention inputs (biases, RoPE, KV cache store). Each replaces several framework kernels with one launch.
// Also the wait on a counter that orders a graph's kernels after copies issued on another stream.
#include <algorithm>
#include <cstdint>

#include "kernels_common.h"
#include "launch.cuh"
#include "quant.cuh"
#include "topk.cuh"

namespace specter {
namespace cuda {
namespace {

// One CTA of 256 threads per row: s = x + d (specter_rms_norm's d) kept in registers (n <= 256 * kNormPerThread)
// or re-read.
constexpr int kNormPerThread = 16;

// Threads of a rope_kv CTA at most (one head): pairs beyond them are strided.
constexpr int kRopeMaxThreads = 256;

// The sum over the CTA of one value per thread, in every thread: warp shuffles, then the warps' sums in order.
// `red` holds a float per warp; call once per kernel (no barrier after the reads).
__device__ __forceinline__ float cta_total(float v, float * red) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) total += red[w];
    return total;
}

// Element i of row sum s = x + d, the shared expert scaled by g (1 when ungated).
__device__ __forceinline__ float residual_sum(const float * x, const float * delta, const float * shared, float g,
                                              long long i) {
    return !delta ? x[i] : x[i] + (shared ? delta[i] + shared[i] * g : delta[i]);
}

__global__ void __launch_bounds__(256) rms_norm_kernel(const float * x, const float * delta,  // y or sum may alias
                                                       const float * shared, const float * __restrict__ gate,
                                                       long long gate_stride, const float * __restrict__ weight,
                                                       const float * __restrict__ bias, long long n, float eps,
                                                       float * sum, float * y) {
    start_after_prior_kernels();
    __shared__ float red[8];
    const long long base = (long long)blockIdx.x * n;
    const float g = gate ? 1.0f / (1.0f + expf(-gate[blockIdx.x * gate_stride])) : 1.0f;
    float s[kNormPerThread], wt[kNormPerThread], bs[kNormPerThread];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kNormPerThread; ++j) {  // weight and bias loaded with x: no second wait after the sum
        const long long i = threadIdx.x + (long long)j * blockDim.x;
        s[j] = i < n ? residual_sum(x, delta, shared, g, base + i) : 0.0f;
        wt[j] = i < n ? weight[i] : 0.0f;
        bs[j] = i < n && bias ? bias[i] : 0.0f;
        ss = fmaf(s[j], s[j], ss);
    }
    for (long long i = threadIdx.x + (long long)kNormPerThread * blockDim.x; i < n; i += blockDim.x) {
        const float v = residual_sum(x, delta, shared, g, base + i);
        ss = fmaf(v, v, ss);
    }
    const float scale = rsqrtf(cta_total(ss, red) / float(n) + eps);
#pragma unroll
    for (int j = 0; j < kNormPerThread; ++j) {
        const long long i = threadIdx.x + (long long)j * blockDim.x;
        if (i < n) {
            if (sum) sum[base + i] = s[j];
            y[base + i] = s[j] * scale * wt[j] + bs[j];
        }
    }
    for (long long i = threadIdx.x + (long long)kNormPerThread * blockDim.x; i < n; i += blockDim.x) {
        const float v = residual_sum(x, delta, shared, g, base + i);
        if (sum) sum[base + i] = v;
        y[base + i] = v * scale * weight[i] + (bias ? bias[i] : 0.0f);
    }
}

// One warp per token (topk_row).
__global__ void topk_kernel(const float * __restrict__ logits, int T, int E, long long stride, int K, int normalize,
                            float scale, int32_t * __restrict__ ids, float * __restrict__ weights) {
    start_after_prior_kernels();
    const int t = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (t >= T) return;
    topk_row(logits + t * stride, E, K, normalize, scale, ids + (long long)t * K, weights + (long long)t * K, lane);
}

// One CTA per head of one token (heads [0, H) are q's, [H, H + Hkv) k's, [H + Hkv, H + 2 Hkv) v's), one thread per
// feature pair of the head (strided when the head has more pairs than the CTA threads). Pair i < rope_dim/2 is
// rotated (q, k); the others pass through as (2i, 2i+1). A head's RMS norm sums its squares across the CTA (each
// thread its own pairs, then warp shuffles and a shared-memory step), so no thread reads the whole head.
template <class OUT>
__global__ void __launch_bounds__(kRopeMaxThreads) rope_kv_kernel(RopeKvArgs a) {
    start_after_prior_kernels();
    __shared__ float red[kRopeMaxThreads / 32];
    const long long half_dim = a.head_dim / 2, heads = a.n_head + 2 * a.n_head_kv;
    const long long hh = blockIdx.x % heads, t = blockIdx.x / heads;
    const long long p = a.pos[t];
    if (p < 0 || p >= a.n_pos || p >= a.capacity) return;  // the whole CTA
    const float * x;
    const float * bias;
    const float * norm;
    OUT * out;
    long long hd;
    bool rotate = true;
    if (hh < a.n_head) {
        hd = hh, x = a.q + t * a.q_stride, bias = a.q_bias, norm = a.q_norm;
        out = static_cast<OUT *>(a.q_out) + (hd * a.n_tokens + t) * a.head_dim;
    } else if (hh < a.n_head + a.n_head_kv) {
        hd = hh - a.n_head, x = a.k + t * a.k_stride, bias = a.k_bias, norm = a.k_norm;
        out = static_cast<OUT *>(a.k_cache) + (hd * a.capacity + p) * a.head_dim;
    } else {
        hd = hh - a.n_head - a.n_head_kv, x = a.v + t * a.v_stride, bias = a.v_bias, norm = nullptr, rotate = false;
        out = static_cast<OUT *>(a.v_cache) + (hd * a.capacity + p) * a.head_dim;
    }
    x += hd * a.head_dim;
    if (bias) bias += hd * a.head_dim;
    const long long half = a.rope_dim / 2;
    // element indices of pair i: (i, i + half) for a rotated NeoX pair, else (2i, 2i + 1)
    auto first = [&](long long i) { return rotate && i < half && a.neox ? i : 2 * i; };
    auto second = [&](long long i) { return rotate && i < half && a.neox ? i + half : 2 * i + 1; };
    auto value = [&](long long e) { return bias ? x[e] + bias[e] : x[e]; };
    float scale = 1.0f;
    if (norm) {
        float ss = 0.0f;
        for (long long i = threadIdx.x; i < half_dim; i += blockDim.x) {
            const float va = value(first(i)), vb = value(second(i));
            ss = fmaf(va, va, fmaf(vb, vb, ss));
        }
        scale = rsqrtf(cta_total(ss, red) / float(a.head_dim) + a.norm_eps);
    }
    for (long long i = threadIdx.x; i < half_dim; i += blockDim.x) {
        const long long ia = first(i), ib = second(i);
        float xa = value(ia), xb = value(ib);
        if (norm) xa = xa * scale * norm[ia], xb = xb * scale * norm[ib];
        if (rotate && i < half) {
            const float c = a.cos[p * half + i], s = a.sin[p * half + i];
            const float ra = __fsub_rn(__fmul_rn(xa, c), __fmul_rn(xb, s));  // no FMA: the CPU's rounding
            xb = __fadd_rn(__fmul_rn(xb, c), __fmul_rn(xa, s));
            xa = ra;
        }
        if constexpr (sizeof(OUT) == 2) {
            out[ia] = __float2half_rn(xa), out[ib] = __float2half_rn(xb);
        } else {
            out[ia] = xa, out[ib] = xb;
        }
    }
}

// One thread: the kernels after it on the stream start once the counter has reached its value. The counter is
// read volatile (it changes under us); the writes it announces were complete before it was raised (stream order
// on the raising side) and the next kernel's loads see them.
__global__ void wait_counter_kernel(const volatile long long * counter, const long long * base, long long offset,
                                    long long timeout_ns, unsigned long long * waited_ns) {
    wait_for_prior_kernels();  // and no early launch of the next kernel (launch.cuh)
    const long long want = *base + offset;
    if (*counter >= want) return;
    const unsigned long long t0 = global_ns();
    unsigned long long now = t0;
    while (*counter < want) {
        __nanosleep(256);
        now = global_ns();
        if (timeout_ns > 0 && now - t0 > (unsigned long long)timeout_ns) __trap();
    }
    if (waited_ns) atomicAdd(waited_ns, now - t0);
}

// One thread: the kernels after it start once the bytes' time has passed. It only waits, as wait_counter_kernel.
__global__ void pace_kernel(const long long * n_bytes, long long extra_bytes, double ns_per_byte) {
    wait_for_prior_kernels();
    const double ns = double((n_bytes ? *n_bytes : 0) + extra_bytes) * ns_per_byte;
    const unsigned long long t0 = global_ns();
    while (double(global_ns() - t0) < ns) __nanosleep(256);
}

}  // namespace
}  // namespace cuda
}  // namespace specter

using namespace specter;
using namespace specter::cuda;

extern "C" {

int specter_cuda_rms_norm(const float * x, const float * delta, const float * shared, const float * gate,
                          int64_t gate_stride, const float * weight, const float * bias, int64_t n_rows, int64_t n,
                          float eps, float * sum, float * y, void * stream) {
    const int rc = check_rms_norm(x, delta, shared, gate, gate_stride, weight, n_rows, n, eps, y);
    if (rc != SPECTER_OK || n_rows == 0) return rc;
    if (n_rows > 0x7fffffffLL) return SPECTER_ERR_INVALID_ARG;
    cudaGetLastError();
    launch(rms_norm_kernel, unsigned(n_rows), 256, cudaStream_t(stream), x, delta, shared, gate,
           (long long)gate_stride, weight, bias, n, eps, sum, y);
    return launch_status();
}

int specter_cuda_moe_topk(const float * logits, int64_t n_tokens, int64_t n_expert, int64_t row_stride,
                          int64_t top_k, int normalize, float scale, int32_t * ids, float * weights, void * stream) {
    const int rc = check_topk(logits, n_tokens, n_expert, row_stride, top_k, ids, weights);
    if (rc != SPECTER_OK || n_tokens == 0) return rc;
    cudaGetLastError();
    const unsigned blocks = unsigned((n_tokens + 3) / 4);  // 4 warps of 32 threads per CTA
    launch(topk_kernel, blocks, 128, cudaStream_t(stream), logits, int(n_tokens), int(n_expert), row_stride,
           int(top_k), normalize, scale, ids, weights);
    return launch_status();
}

int specter_cuda_rope_kv(const float * q, int64_t q_stride, const float * k, int64_t k_stride, const float * v,
                         int64_t v_stride, const float * q_bias, const float * k_bias, const float * v_bias,
                         const float * q_norm, const float * k_norm, float norm_eps, int64_t n_tokens,
                         int64_t n_head, int64_t n_head_kv, int64_t head_dim, int64_t rope_dim, int neox,
                         const float * cos, const float * sin, int64_t n_pos, const int64_t * pos, int out_type,
                         void * q_out, void * k_cache, void * v_cache, int64_t capacity, void * stream) {
    const RopeKvArgs a{q, k, v, q_stride, k_stride, v_stride, q_bias, k_bias, v_bias, q_norm, k_norm, norm_eps,
                       n_tokens, n_head, n_head_kv, head_dim, rope_dim, neox, cos, sin, n_pos, pos, out_type, q_out,
                       k_cache, v_cache, capacity};
    const int rc = check_rope_kv(a);
    if (rc != SPECTER_OK) return rc;
    const long long blocks = n_tokens * (n_head + 2 * n_head_kv);
    if (blocks == 0 || head_dim == 0) return SPECTER_OK;
    cudaGetLastError();
    const long long pairs = head_dim / 2;
    const int threads = int(std::min<long long>(kRopeMaxThreads, (pairs + 31) / 32 * 32));
    if (out_type == SPECTER_TYPE_F16)
        launch(rope_kv_kernel<__half>, unsigned(blocks), threads, cudaStream_t(stream), a);
    else
        launch(rope_kv_kernel<float>, unsigned(blocks), threads, cudaStream_t(stream), a);
    return launch_status();
}

int specter_cuda_pace(const int64_t * n_bytes, int64_t extra_bytes, double ns_per_byte, void * stream) {
    if (extra_bytes < 0 || !(ns_per_byte >= 0.0)) return SPECTER_ERR_INVALID_ARG;
    cudaGetLastError();
    launch(pace_kernel, 1, 1, cudaStream_t(stream), reinterpret_cast<const long long *>(n_bytes),
           (long long)extra_bytes, ns_per_byte);
    return launch_status();
}

int specter_cuda_wait_counter(const int64_t * counter, const int64_t * base, int64_t offset, int64_t timeout_ns,
                              int64_t * waited_ns, void * stream) {
    if (!counter || !base) return SPECTER_ERR_INVALID_ARG;
    cudaGetLastError();
    launch(wait_counter_kernel, 1, 1, cudaStream_t(stream), reinterpret_cast<const volatile long long *>(counter),
           reinterpret_cast<const long long *>(base), offset, timeout_ns,
           reinterpret_cast<unsigned long long *>(waited_ns));
    return launch_status();
}

}  // extern "C"
