// CUDA sampling chain (specter_kernels.h: specter_cuda_sample_chain): the chain of speculative sampling in two
// launches where torch took about thirty.
//
// chunk_top_kernel: grid (n_chunks, n_rows), 256 threads. The CTA of a chunk of kSampleChunk logits holds 16 of
//   them per thread as ranking keys (kernels_common.h: sample_key; element e = j * 256 + thread, id = chunk start +
//   e) and leaves the chunk's top C in the workspace (`select_top`).
// row_chain_kernel: one CTA of 256 threads per row. The same selection over the row's n_chunks * C entries gives the
//   row's top C (every one of them is in its chunk's top C); thread i ranks entry i among them, then the float64
//   chain runs with a thread per candidate for the exponentials and divisions and thread 0 for the sums, in the
//   order specter_sample_chain keeps on the CPU; ids and probs are written in ascending id order, and thread 0
//   draws.
// select_top finds the need-th largest key K bit by bit (32 rounds of a block-wide count of the keys >= a
//   candidate, no atomics), then writes the keys above K and the first (need - #above) keys equal to K in element
//   order, at offsets from a scan over (element row j, warp) of ballot counts. Element order is id order in the first
//   kernel, and in the second the chunks' entries are in chunk order with each chunk's ties at K in id order: the
//   ties kept are the lowest ids, as on the CPU. Deterministic: no atomics, fixed orders.
#include <cstdint>

#include "kernels_common.h"
#include "launch.cuh"

namespace specter {
namespace cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kChunkPer = int(kSampleChunk) / kThreads;  // logits per thread in chunk_top_kernel
constexpr int kMaxC = SPECTER_SAMPLE_MAX_CANDIDATES;
static_assert(kMaxC <= kThreads, "row_chain_kernel: a thread per candidate");
// row_chain_kernel holds up to 64 entries per thread (`launch_row_chain`)
static_assert((SPECTER_SAMPLE_MAX_VOCAB + kSampleChunk - 1) / kSampleChunk * kMaxC <= 64 * kThreads,
              "the row's chunk entries must fit 64 per thread");

struct SampleParams {
    const float * logits;
    long long row_stride;
    int n_vocab, C, n_chunks;
    const double * knobs;     // temperature, top_p, log(min_p)
    const double * uniforms;  // NULL: no draw
    long long * ids;
    double * probs;
    long long * tokens;
    unsigned * keys;  // workspace: each (row, chunk)'s top C keys
    int * cand;       // and their ids
};

template <int PER>
struct SelectShared {
    unsigned count[2][kWarps];        // per-warp counts of a round (two buffers: one barrier a round)
    unsigned offsets[PER * kWarps];   // per (j, warp): #above | #ties << 16, then their exclusive prefix sums
    unsigned total;                   // the sums over all: #above | #ties << 16
};

// The `need` best of the block's keys (key[j] of element j * kThreads + thread; 0: no element), ranked by (key desc,
// element asc): put(slot, element, key) for each, slots 0 .. need - 1 (the keys above the need-th first). At least
// `need` keys must be >= 1. Ties are counted in 16 bits: PER * kThreads < 65536.
template <int PER, class Put>
__device__ __forceinline__ void select_top(const unsigned (&key)[PER], unsigned need, SelectShared<PER> & sh, Put put) {
    static_assert(PER % 4 == 0 && PER * kThreads < 65536, "select_top: whole lanes of the scan, 16-bit counts");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned kth = 0;  // the largest k with #{key >= k} >= need
    for (int bit = 31; bit >= 0; --bit) {
        const unsigned cand = kth | (1u << bit);
        unsigned n = 0;
#pragma unroll
        for (int j = 0; j < PER; ++j) n += key[j] >= cand;
        n = __reduce_add_sync(0xffffffffu, n);
        if (lane == 0) sh.count[bit & 1][warp] = n;
        __syncthreads();
        unsigned total = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) total += sh.count[bit & 1][w];
        if (total >= need) kth = cand;
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const unsigned above = __ballot_sync(0xffffffffu, key[j] > kth), tie = __ballot_sync(0xffffffffu, key[j] == kth);
        if (lane == 0) sh.offsets[j * kWarps + warp] = __popc(above) | __popc(tie) << 16;
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the (j, warp) counts in that order: lane l takes E consecutive ones
        constexpr int E = PER * kWarps / 32;
        unsigned v[E], sum = 0;
#pragma unroll
        for (int i = 0; i < E; ++i) sum += v[i] = sh.offsets[lane * E + i];
        unsigned incl = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned t = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += t;
        }
        unsigned run = incl - sum;
#pragma unroll
        for (int i = 0; i < E; ++i) sh.offsets[lane * E + i] = run, run += v[i];
        if (lane == 31) sh.total = incl;
    }
    __syncthreads();
    const unsigned n_above = sh.total & 0xffffu, lower = (1u << lane) - 1;  // n_above < need
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const unsigned above = __ballot_sync(0xffffffffu, key[j] > kth), tie = __ballot_sync(0xffffffffu, key[j] == kth);
        const unsigned off = sh.offsets[j * kWarps + warp];
        const int e = j * kThreads + threadIdx.x;
        if (key[j] > kth) {
            put((off & 0xffffu) + __popc(above & lower), e, key[j]);
        } else if (key[j] == kth) {
            const unsigned slot = n_above + (off >> 16) + __popc(tie & lower);
            if (slot < need) put(slot, e, key[j]);
        }
    }
}

__global__ void __launch_bounds__(kThreads) chunk_top_kernel(SampleParams a) {
    start_after_prior_kernels();
    __shared__ SelectShared<kChunkPer> sh;
    const int chunk = blockIdx.x, row = blockIdx.y;
    const int base = chunk * int(kSampleChunk), len = min(int(kSampleChunk), a.n_vocab - base);
    const float * x = a.logits + row * a.row_stride + base;
    unsigned key[kChunkPer];
#pragma unroll
    for (int j = 0; j < kChunkPer; ++j) {
        const int e = j * kThreads + threadIdx.x;
        key[j] = e < len ? sample_key(x[e]) : 0u;
    }
    const long long out = ((long long)row * a.n_chunks + chunk) * a.C;
    select_top(key, unsigned(min(a.C, len)), sh, [&](unsigned slot, int e, unsigned k) {
        a.keys[out + slot] = k;
        a.cand[out + slot] = base + e;
    });
}

template <int PER>
__global__ void __launch_bounds__(kThreads) row_chain_kernel(SampleParams a) {
    start_after_prior_kernels();
    __shared__ SelectShared<PER> sh;
    __shared__ unsigned top_key[kMaxC];
    __shared__ int top_id[kMaxC], ranked_id[kMaxC], asc_id[kMaxC];
    __shared__ double v[kMaxC], w[kMaxC], asc_p[kMaxC];
    __shared__ double sum;
    const int row = blockIdx.x, tid = threadIdx.x, C = a.C, n = a.n_chunks * C;
    const int tail = n - C, tail_n = min(C, a.n_vocab - (a.n_chunks - 1) * int(kSampleChunk));  // the last chunk's
    const long long in = (long long)row * n;
    unsigned key[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int e = j * kThreads + tid;
        key[j] = e < tail || (e < n && e - tail < tail_n) ? a.keys[in + e] : 0u;
    }
    select_top(key, unsigned(C), sh, [&](unsigned slot, int e, unsigned k) {
        top_key[slot] = k;
        top_id[slot] = a.cand[in + e];
    });
    __syncthreads();

    // the candidates ranked by (key desc, id asc): v_0 >= v_1 >= ...
    const bool mine = tid < C;
    if (mine) {
        const unsigned k = top_key[tid];
        const int id = top_id[tid];
        int r = 0;
        for (int i = 0; i < C; ++i) r += top_key[i] > k || (top_key[i] == k && top_id[i] < id);
        v[r] = double(sample_logit(k));
        ranked_id[r] = id;
    }
    __syncthreads();

    // the chain (specter_kernels.h), candidate tid in this thread, the sums in thread 0 in ascending order
    const double temperature = a.knobs[0], top_p = a.knobs[1], log_min_p = a.knobs[2], v0 = v[0];
    const double d = mine ? v[tid] - v0 : 0.0;
    if (mine) w[tid] = exp(d);
    __syncthreads();
    if (tid == 0) {
        double z = 0.0;
        for (int i = 0; i < C; ++i) z += w[i];
        sum = z;
    }
    __syncthreads();
    if (mine) w[tid] /= sum;
    __syncthreads();
    if (tid == 0) {
        double c = 0.0;
        for (int i = 0; i < C; ++i) w[i] = c += w[i];
    }
    __syncthreads();
    const int n_p = __syncthreads_count(mine && w[tid] < top_p) + 1;
    const int n_m = max(1, __syncthreads_count(mine && v[tid] >= v0 + log_min_p));
    const int m = min(C, min(n_p, n_m));
    const double f = tid < m ? exp(d / temperature) : 0.0;
    if (mine) w[tid] = f;
    __syncthreads();
    if (tid == 0) {
        double z = 0.0;
        for (int i = 0; i < m; ++i) z += w[i];
        sum = z;
    }
    __syncthreads();
    if (mine) {
        const double p = f / sum;
        const int id = ranked_id[tid];
        int r = 0;
        for (int i = 0; i < C; ++i) r += ranked_id[i] < id;
        a.ids[(long long)row * C + r] = id;
        a.probs[(long long)row * C + r] = p;
        asc_id[r] = id;
        asc_p[r] = p;
    }
    if (!a.uniforms) return;  // the same for the whole CTA
    __syncthreads();
    if (tid == 0) {  // the draw: the first cumulative sum past u * total (w: the sums), else the last positive
        double s = 0.0;
        int last = 0, at = 0;
        for (int i = 0; i < C; ++i) {
            w[i] = s += asc_p[i];
            if (asc_p[i] > 0.0) last = i;
        }
        const double t = a.uniforms[row] * s;
        for (int i = 0; i < C; ++i) at += w[i] <= t;
        a.tokens[row] = asc_id[min(at, last)];
    }
}

// The second kernel with PER entries per thread, the fewest that hold the row's n_chunks * C entries.
void launch_row_chain(const SampleParams & p, unsigned n_rows, cudaStream_t stream) {
    const int n = p.n_chunks * p.C;
    if (n <= 4 * kThreads)
        launch(row_chain_kernel<4>, n_rows, kThreads, stream, p);
    else if (n <= 8 * kThreads)
        launch(row_chain_kernel<8>, n_rows, kThreads, stream, p);
    else if (n <= 16 * kThreads)
        launch(row_chain_kernel<16>, n_rows, kThreads, stream, p);
    else if (n <= 32 * kThreads)
        launch(row_chain_kernel<32>, n_rows, kThreads, stream, p);
    else
        launch(row_chain_kernel<64>, n_rows, kThreads, stream, p);
}

}  // namespace
}  // namespace cuda
}  // namespace specter

using namespace specter;
using namespace specter::cuda;

extern "C" {

int specter_cuda_sample_chain(const float * logits, int64_t n_rows, int64_t n_vocab, int64_t row_stride,
                              int64_t n_candidates, const double * knobs, const double * uniforms, int64_t * ids,
                              double * probs, int64_t * tokens, void * workspace, size_t workspace_bytes,
                              void * stream) {
    const SampleArgs a{logits, n_rows, n_vocab, row_stride, n_candidates, knobs, uniforms, ids, probs, tokens,
                       workspace, workspace_bytes};
    SampleLayout L;
    const int rc = check_sample_chain(a, &L);
    if (rc != SPECTER_OK || n_rows == 0) return rc;
    char * ws = static_cast<char *>(workspace);
    const SampleParams p{logits, row_stride, int(n_vocab), int(n_candidates), int(L.n_chunks), knobs, uniforms,
                         reinterpret_cast<long long *>(ids), probs, reinterpret_cast<long long *>(tokens),
                         reinterpret_cast<unsigned *>(ws + L.keys), reinterpret_cast<int *>(ws + L.ids)};
    cudaGetLastError();
    const cudaStream_t st = cudaStream_t(stream);
    launch(chunk_top_kernel, dim3(unsigned(L.n_chunks), unsigned(n_rows)), kThreads, st, p);
    launch_row_chain(p, unsigned(n_rows), st);
    return launch_status();
}

}  // extern "C"
