// CUDA grouped MoE feed-forward (specter_cuda_moe_ffn): experts given by device tables of
// per-expert addresses, routing read from device memory, no host synchronisation.
//
// Launches (all on the caller's stream, fixed workspace, capturable in a CUDA graph):
//   1. route:   group the (token, slot) pairs by expert, deterministically (one CTA);
//   2. gate/up: grid (d_ff rows / 2 or 4, groups); each CTA reads 1 batch (one token) or 4 batches (more) of 2
//               or 1 gate and up rows of its group's expert, each batch once per chunk of <= 8 tokens (a pass
//               sized to the chunk: 1, 2, 4 or 8 X rows), and writes act = silu(gate.x) * (up.x)
//               (gate and up of different types: two launches and an elementwise silu-mul);
//   3. down:    grid (d_model rows / 4 or 8, groups): ypair[pair] = down . act[pair];
//   4. reduce:  out[t] (+)= sum over the token's slots, in slot order, of weight * ypair.
// Every value is computed by a fixed sequence of operations, so results are bitwise reproducible
// and each token's result is independent of the other tokens in the batch.
#include <cstdint>

#include "kernels_common.h"
#include "launch.cuh"
#include "quant.cuh"

namespace specter {
namespace cuda {
namespace {

constexpr int kMaxExperts = 2048;

// Row batches per CTA of a rows launch with passes of M rows of X. One token's CTAs each take one batch: the more
// CTAs in flight the better for a layer that is a few waves of small loads (a Qwen1.5-MoE layer at T = 1: 30.7 us
// with one batch, 45.2 with four). Several tokens' take four, which pays the load chain once per four batches
// (T = 9: 287.6 -> 242.2 us in F16, Qwen3-30B-A3B's Q8_0 345.5 -> 283.8; two batches or ~16 KB of weights per CTA
// were in between). H200, scripts/bench_kernels.py's MoE layer, 2026-12-02.
constexpr int row_batches(int M) { return M == 1 ? 1 : 4; }

__device__ __forceinline__ bool expert_ok(int e, int n_expert, const uint64_t * gp, const uint64_t * up,
                                          const uint64_t * dp) {
    return e >= 0 && e < n_expert && gp[e] != 0 && up[e] != 0 && dp[e] != 0;
}

// meta: group_expert[G], group_off[G + 1], n_groups[1], perm[P]
__global__ void __launch_bounds__(256) route_kernel(const int32_t * __restrict__ ids, int P, int n_expert,
                                                    const uint64_t * __restrict__ gp,
                                                    const uint64_t * __restrict__ up,
                                                    const uint64_t * __restrict__ dp, int * __restrict__ meta,
                                                    int G) {
    start_after_prior_kernels();
    __shared__ int cnt[kMaxExperts];
    __shared__ int start[kMaxExperts];
    int * group_expert = meta;
    int * group_off = meta + G;
    int * n_groups = meta + 2 * G + 1;
    int * perm = meta + 2 * G + 2;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int e = ids[p];
        if (expert_ok(e, n_expert, gp, up, dp)) atomicAdd(&cnt[e], 1);  // counts: order-free
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    // one warp: exclusive scans of the counts (start of each expert's pairs) and of the non-empty experts
    // (group index), 32 experts at a time
    int off = 0, ng = 0;
    for (int base = 0; base < n_expert; base += 32) {
        const int e = base + lane;
        const int c = e < n_expert ? cnt[e] : 0, g = c > 0;
        int sc = c, sg = g;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, sc, o), b = __shfl_up_sync(0xffffffffu, sg, o);
            if (lane >= o) sc += a, sg += b;
        }
        if (e < n_expert) start[e] = off + sc - c;
        if (g) group_expert[ng + sg - 1] = e, group_off[ng + sg - 1] = off + sc - c;
        off += __shfl_sync(0xffffffffu, sc, 31);
        ng += __shfl_sync(0xffffffffu, sg, 31);
    }
    if (lane == 0) group_off[ng] = off, *n_groups = ng;
    __syncwarp();
    // stable placement, 32 pairs at a time
    for (int base = 0; base < P; base += 32) {
        const int p = base + lane;
        const int e = p < P ? ids[p] : -1;
        const bool ok = p < P && expert_ok(e, n_expert, gp, up, dp);
        const unsigned mask = __match_any_sync(0xffffffffu, ok ? e : -1);
        const int lower = __popc(mask & ((1u << lane) - 1u));
        if (ok) perm[start[e] + lower] = p;
        __syncwarp();
        if (ok && lower == 0) start[e] += __popc(mask);
        __syncwarp();
    }
}

// One pass of a CTA over its weight rows for the X rows of pairs perm[q .. q + cnt), cnt <= MP: dst[pair, row]
// = the dot product (FUSED: rows[0..RF) gate, rows[RF..2RF) up, silu(gate) * up).
template <class TT, int MP, int RF, bool FUSED>
__device__ __forceinline__ void rows_pass(const uint8_t * const (&rows)[FUSED ? 2 * RF : RF], int row0, int n_out,
                                          int k, const float * __restrict__ xin, int x_per_pair, int top_k,
                                          const int * __restrict__ perm, int q, int cnt, float * red, float * res,
                                          float * __restrict__ dst) {
    const float * xs[MP];
#pragma unroll
    for (int t = 0; t < MP; ++t) {
        const int pr = perm[q + min(t, cnt - 1)];
        xs[t] = xin + (long long)(x_per_pair ? pr : pr / top_k) * k;
    }
    float s = cta_dot_totals<TT, MP, FUSED ? 2 * RF : RF, float>(rows, xs, k / TT::QK, red);
    if (FUSED) s = swiglu_of_totals<RF * MP>(s, res);
    if (threadIdx.x < RF * MP) {
        const int r = threadIdx.x / MP, t = threadIdx.x % MP;
        if (t < cnt && row0 + r < n_out) dst[(long long)perm[q + t] * n_out + row0 + r] = s;
    }
}

// Batch b of a CTA is rows row0 + r (r < RF), row0 = RF * (batches * blockIdx.x + b):
// FUSED: of tabA (gate) and tabB (up) -> dst[pair, row] = silu(a) * b; else of tabA -> dst[pair, row] = a.
// X row of a pair: xin + (x_per_pair ? pair : pair / top_k) * k.
// A group's tokens go M at a time; a chunk of fewer (with many experts most groups hold one or two tokens) takes
// the pass for the fewest X rows that hold it, with the same results: each (weight row, X row) value is summed
// the same way whatever the pass. A CTA takes `batches` consecutive batches of rows (`row_batches`), so the chain
// of dependent loads before its first weight byte (group -> expert -> its table entry) is paid once for all of
// them.
template <class TT, int M, bool FUSED>
__global__ void __launch_bounds__(256) moe_rows_kernel(const uint64_t * __restrict__ tabA,
                                                       const uint64_t * __restrict__ tabB, long long rb, int n_out,
                                                       int k, const float * __restrict__ xin, int x_per_pair,
                                                       int top_k, const int * __restrict__ meta, int G,
                                                       int batches, float * __restrict__ dst) {
    start_after_prior_kernels();
    constexpr int RF = rows_per_cta(M, FUSED);     // rows per matrix
    constexpr int NR = FUSED ? 2 * RF : RF;    // rows dotted per CTA
    __shared__ float red[8 * NR * M];
    __shared__ float res[FUSED ? NR * M : 1];
    const int gi = blockIdx.y;
    if (gi >= meta[2 * G + 1]) return;  // fewer groups than the grid allows for
    const int e = meta[gi], q0 = meta[G + gi], q1 = meta[G + gi + 1];
    const int * perm = meta + 2 * G + 2;
    const uint8_t * const wa = reinterpret_cast<const uint8_t *>(tabA[e]);
    const uint8_t * const wb = FUSED ? reinterpret_cast<const uint8_t *>(tabB[e]) : nullptr;
    for (int batch = 0; batch < batches; ++batch) {
        const int row0 = (blockIdx.x * batches + batch) * RF;
        if (row0 >= n_out) break;
        const uint8_t * rows[NR];
#pragma unroll
        for (int r = 0; r < RF; ++r) {
            const long long off = (long long)min(row0 + r, n_out - 1) * rb;
            rows[r] = wa + off;
            if (FUSED) rows[RF + r] = wb + off;
        }
        for (int q = q0; q < q1; q += M) {
            const int cnt = min(M, q1 - q);
            const int mp = cnt == 1 ? 1 : cnt == 2 ? 2 : cnt <= 4 ? 4 : 8;
            if constexpr (M > 1)
                if (mp == 1) {
                    rows_pass<TT, 1, RF, FUSED>(rows, row0, n_out, k, xin, x_per_pair, top_k, perm, q, cnt, red, res,
                                                dst);
                    continue;
                }
            if constexpr (M > 2)
                if (mp == 2) {
                    rows_pass<TT, 2, RF, FUSED>(rows, row0, n_out, k, xin, x_per_pair, top_k, perm, q, cnt, red, res,
                                                dst);
                    continue;
                }
            if constexpr (M > 4)
                if (mp == 4) {
                    rows_pass<TT, 4, RF, FUSED>(rows, row0, n_out, k, xin, x_per_pair, top_k, perm, q, cnt, red, res,
                                                dst);
                    continue;
                }
            rows_pass<TT, M, RF, FUSED>(rows, row0, n_out, k, xin, x_per_pair, top_k, perm, q, cnt, red, res, dst);
        }
    }
}

__global__ void silu_mul_kernel(float * __restrict__ act, const float * __restrict__ aux, long long n) {
    start_after_prior_kernels();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) act[i] = silu(act[i]) * aux[i];
}

// The token's slots 8 at a time: a chunk's routing, table and result loads are independent of each other, so they
// are in flight together (one after the other, a top-8 token waited on 24 loads in sequence); the sum stays in
// slot order.
__global__ void reduce_kernel(const float * __restrict__ ypair, const int32_t * __restrict__ ids,
                              const float * __restrict__ weights, int top_k, int n_expert,
                              const uint64_t * __restrict__ gp, const uint64_t * __restrict__ up,
                              const uint64_t * __restrict__ dp, long long T, int d, float * __restrict__ out,
                              int accumulate) {
    start_after_prior_kernels();
    constexpr int kChunk = 8;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * d) return;
    const long long t = i / d;
    const int c = int(i % d);
    float s = accumulate ? out[i] : 0.0f;
    for (int j0 = 0; j0 < top_k; j0 += kChunk) {
        bool ok[kChunk];
        float w[kChunk], y[kChunk];
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            const long long p = t * top_k + j0 + j;
            ok[j] = j0 + j < top_k && expert_ok(ids[p], n_expert, gp, up, dp);
            w[j] = j0 + j < top_k ? weights[p] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kChunk; ++j) y[j] = ok[j] ? ypair[(t * top_k + j0 + j) * d + c] : 0.0f;
#pragma unroll
        for (int j = 0; j < kChunk; ++j)
            if (ok[j]) s = fmaf(w[j], y[j], s);
    }
    out[i] = s;
}

// The rows launch of one matrix (or of gate and up, FUSED) over the groups: grid (CTAs of the rows, G).
template <class TT, bool FUSED>
void launch_rows(int M, int G, cudaStream_t st, const uint64_t * tabA, const uint64_t * tabB, long long rb, int n_out,
                 int k, const float * xin, int x_per_pair, int top_k, const int * meta, float * dst) {
    auto kernel = moe_rows_kernel<TT, 8, FUSED>;
    switch (M) {
        case 1: kernel = moe_rows_kernel<TT, 1, FUSED>; break;
        case 2: kernel = moe_rows_kernel<TT, 2, FUSED>; break;
        case 4: kernel = moe_rows_kernel<TT, 4, FUSED>; break;
    }
    const int rpb = rows_per_cta(M, FUSED);
    const int batches = row_batches(M);
    const int n_batches = (n_out + rpb - 1) / rpb;
    const dim3 grid(unsigned((n_batches + batches - 1) / batches), unsigned(G));
    launch(kernel, grid, cta_threads((long long)(k / TT::QK) * TT::NU), st, tabA, tabB, rb, n_out, k, xin, x_per_pair,
           top_k, meta, G, batches, dst);
}

// dst[pair, rows] for one projection (single matrix per expert)
void project(int type, const TypeInfo & t, const uint64_t * tab, int n_out, int k, const float * xin, int x_per_pair,
             int top_k, const int * meta, int G, int M, float * dst, cudaStream_t st) {
    with_type(type, vec_ok(type, k, 0), [&](auto tag) {
        using TT = typename decltype(tag)::type;
        launch_rows<TT, false>(M, G, st, tab, nullptr, row_bytes(t, k), n_out, k, xin, x_per_pair, top_k, meta, dst);
    });
}

// specter_expert_table's CTAs: enough to keep PCIe busy with 16-byte loads from host memory while copying missed
// experts into spare slots (an H100 or H200 has 132 SMs); with nothing to copy all but the first exit at once.
constexpr int kTableCtas = 256;

// This CTA's share of copying n bytes from src (host memory) to dst: 16-byte words where both ends and n allow,
// kUnroll loads in flight per thread, else bytes.
__device__ void copy_share(uint8_t * __restrict__ dst, const uint8_t * __restrict__ src, long long n) {
    constexpr int kUnroll = 4;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x, nt = (long long)gridDim.x * blockDim.x;
    if ((uintptr_t(dst) | uintptr_t(src) | uintptr_t(n)) % 16 != 0) {
        for (long long i = tid; i < n; i += nt) dst[i] = src[i];
        return;
    }
    const uint4 * s = reinterpret_cast<const uint4 *>(src);
    uint4 * d = reinterpret_cast<uint4 *>(dst);
    const long long words = n / 16;
    long long i = tid;
    for (; i + (kUnroll - 1) * nt < words; i += kUnroll * nt) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = s[i + u * nt];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) d[i + u * nt] = v[u];
    }
    for (; i < words; i += nt) d[i] = s[i];
}

// The pointer table and the routing counts (where `routed` is given) of specter_expert_table: one CTA, a thread per
// expert, a thread per pair.
__device__ void write_table(const int64_t * slot_of, const int64_t * host_ptrs, const specter_slot_pool & pool,
                            const uint8_t * skip, int n_expert, const int32_t * ids, int n_pairs, int32_t * routed,
                            int64_t * ptrs) {
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x)
        for (int part = 0; part < 3; ++part)
            ptrs[size_t(part) * n_expert + e] = expert_address(slot_of, host_ptrs, pool, skip, n_expert, part, e);
    for (int p = threadIdx.x; routed && p < n_pairs; p += blockDim.x)
        if (ids[p] >= 0 && ids[p] < n_expert) atomicAdd(routed + ids[p], 1);
}

// specter_expert_table. Every CTA works out the same copies (assign_spares) from the routing and the residency row,
// which no CTA changes before all have finished copying: the last CTA to arrive publishes the copied experts, then
// writes the table. Without copies the first CTA writes the table alone.
__global__ void __launch_bounds__(256) expert_table_kernel(int64_t * slot_of, const int64_t * __restrict__ host_ptrs,
                                                           specter_slot_pool pool, int n_expert,
                                                           const int32_t * __restrict__ ids, int n_pairs,
                                                           const uint8_t * __restrict__ skip,
                                                           specter_spare_slots spares, int32_t * routed,
                                                           int64_t * ptrs) {
    start_after_prior_kernels();
    __shared__ uint8_t used[kMaxExperts];
    __shared__ int expert[SPECTER_MAX_SPARES], spare[SPECTER_MAX_SPARES];
    __shared__ int n_copy;
    __shared__ bool last;
    if (threadIdx.x == 0) n_copy = 0;
    if (spares.n_spare > 0) {
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) used[e] = 0;
        __syncthreads();
        for (int p = threadIdx.x; p < n_pairs; p += blockDim.x)
            if (ids[p] >= 0 && ids[p] < n_expert) used[ids[p]] = 1;
        __syncthreads();
        if (threadIdx.x == 0)
            n_copy = assign_spares(slot_of, used, skip, n_expert, spares.slots, spares.n_spare, expert, spare);
    }
    __syncthreads();
    if (n_copy == 0) {
        if (blockIdx.x == 0) write_table(slot_of, host_ptrs, pool, skip, n_expert, ids, n_pairs, routed, ptrs);
        return;
    }
    for (int i = 0; i < n_copy; ++i) {
        const int64_t slot = spares.slots[spare[i]];
        for (int part = 0; part < 3; ++part)
            copy_share(reinterpret_cast<uint8_t *>(pool.base + slot * pool.slot_bytes + pool.part_offset[part]),
                       reinterpret_cast<const uint8_t *>(host_ptrs[size_t(part) * n_expert + expert[i]]),
                       pool.part_bytes[part]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // this CTA's copies and reads are done before it is counted
        last = atomicAdd(spares.arrivals, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) {
        __threadfence();
        for (int i = 0; i < n_copy; ++i) {
            const int64_t slot = spares.slots[spare[i]];
            slot_of[expert[i]] = slot;
            spares.fetched[expert[i]] = int32_t(slot + 1);
            spares.slots[spare[i]] = -1;
        }
        *spares.arrivals = 0;
    }
    __syncthreads();
    write_table(slot_of, host_ptrs, pool, skip, n_expert, ids, n_pairs, routed, ptrs);
}

}  // namespace
}  // namespace cuda
}  // namespace specter

using namespace specter;
using namespace specter::cuda;

extern "C" int specter_cuda_moe_ffn(const float * x, int64_t n_tokens, int64_t d_model, const int32_t * ids,
                                    const float * weights, int64_t top_k, int64_t n_expert, int64_t d_ff,
                                    const uint64_t * gate_ptrs, int gate_type, const uint64_t * up_ptrs, int up_type,
                                    const uint64_t * down_ptrs, int down_type, void * workspace,
                                    size_t workspace_bytes, float * out, int accumulate, void * stream) {
    const MoeArgs a{x, n_tokens, d_model, ids, weights, top_k, n_expert, d_ff, gate_ptrs, up_ptrs, down_ptrs,
                    gate_type, up_type, down_type, workspace, workspace_bytes, out, accumulate};
    MoeLayout L;
    const TypeInfo *tg = nullptr, *tu = nullptr, *td = nullptr;
    const int rc = check_moe(a, &L, &tg, &tu, &td);
    if (rc != SPECTER_OK) return rc;
    if (n_tokens == 0 || d_model == 0) return SPECTER_OK;
    if (n_expert > kMaxExperts || L.P >= (int64_t(1) << 31) / (d_ff > d_model ? d_ff + 1 : d_model + 1))
        return SPECTER_ERR_INVALID_ARG;
    if (uintptr_t(x) % 16 != 0 || uintptr_t(workspace) % kWsAlign != 0) return SPECTER_ERR_INVALID_ARG;
    const cudaStream_t st = cudaStream_t(stream);
    cudaGetLastError();
    char * ws = static_cast<char *>(workspace);
    int * meta = reinterpret_cast<int *>(ws + L.meta);
    float * act = reinterpret_cast<float *>(ws + L.act);
    float * aux = reinterpret_cast<float *>(ws + L.aux);
    float * ypair = reinterpret_cast<float *>(ws + L.ypair);
    const int P = int(L.P), G = int(L.G), T = int(n_tokens), K = int(top_k), E = int(n_expert);
    const int D = int(d_model), F = int(d_ff);
    if (P > 0 && E > 0) {
        launch(route_kernel, 1, 256, st, ids, P, E, gate_ptrs, up_ptrs, down_ptrs, meta, G);
        const int M = T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8;  // rows of X per pass (<= tokens per group)
        if (F == 0) {
            cudaMemsetAsync(ypair, 0, size_t(P) * D * sizeof(float), st);
        } else {
            const bool vec = vec_ok(gate_type, D, 0);
            if (gate_type == up_type) {
                with_type(gate_type, vec, [&](auto tag) {
                    using TT = typename decltype(tag)::type;
                    launch_rows<TT, true>(M, G, st, gate_ptrs, up_ptrs, row_bytes(*tg, D), F, D, x, 0, K, meta, act);
                });
            } else {
                project(gate_type, *tg, gate_ptrs, F, D, x, 0, K, meta, G, M, act, st);
                project(up_type, *tu, up_ptrs, F, D, x, 0, K, meta, G, M, aux, st);
                const long long n = (long long)P * F;
                launch(silu_mul_kernel, unsigned((n + 255) / 256), 256, st, act, aux, n);
            }
            project(down_type, *td, down_ptrs, D, F, act, 1, K, meta, G, M, ypair, st);
        }
    }
    const long long n = (long long)T * D;
    launch(reduce_kernel, unsigned((n + 255) / 256), 256, st, ypair, ids, weights, K, E, gate_ptrs, up_ptrs,
           down_ptrs, T, D, out, accumulate);
    return launch_status();
}

extern "C" int specter_cuda_expert_table(int64_t * slot_of, const int64_t * host_ptrs, const specter_slot_pool * pool,
                                         int64_t n_expert, const int32_t * ids, int64_t n_pairs,
                                         const uint8_t * skip, const specter_spare_slots * spares, int32_t * routed,
                                         int64_t * ptrs, void * stream) {
    const int rc = check_expert_table(slot_of, host_ptrs, pool, n_expert, ids, n_pairs, spares, ptrs);
    if (rc != SPECTER_OK) return rc;
    if (n_expert > kMaxExperts) return SPECTER_ERR_INVALID_ARG;
    const specter_spare_slots none{nullptr, 0, nullptr, nullptr};
    const specter_spare_slots & sp = spares ? *spares : none;
    cudaGetLastError();
    launch(expert_table_kernel, sp.n_spare > 0 ? kTableCtas : 1, 256, cudaStream_t(stream), slot_of, host_ptrs, *pool,
           int(n_expert), ids, int(n_pairs), skip, sp, routed, ptrs);
    return launch_status();
}
