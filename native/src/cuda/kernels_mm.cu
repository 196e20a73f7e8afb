// CUDA kernels over GGUF-typed matrices: row dequantization / gather, the GEMV (weights decoded in
// registers, fp32 FMA) and the tiled GEMM (a W tile decoded to f16 in shared memory, tensor-core
// mma through WMMA, fp32 accumulation). Entry points of specter_kernels.h.
#include <mma.h>

#include <algorithm>
#include <cstdint>

#include "kernels_common.h"
#include "launch.cuh"
#include "quant.cuh"
#include "topk.cuh"

namespace specter {
namespace cuda {
namespace {

// ---- dequantize (optionally gathered) rows --------------------------------------------------------
template <class TT, bool HALF>
__global__ void dequant_kernel(const uint8_t * __restrict__ src, long long rb, long long n_out_rows, int k,
                               const int32_t * __restrict__ ids, long long n_src_rows, void * __restrict__ dst) {
    start_after_prior_kernels();
    const long long upr = (long long)(k / TT::QK) * TT::NU;  // units per row
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_out_rows * upr) return;
    const long long row = i / upr, rem = i % upr;
    const int b = int(rem / TT::NU), u = int(rem % TT::NU);
    long long sr = row;
    bool bad = false;
    if (ids) {
        sr = ids[row];
        bad = sr < 0 || sr >= n_src_rows;
    }
    float v[TT::E];
    if (bad) {
#pragma unroll
        for (int e = 0; e < TT::E; ++e) v[e] = __int_as_float(0x7fc00000);
    } else {
        TT::template decode<true>(src + sr * rb + (long long)b * TT::BYTES, u, v);
    }
    const long long base = row * k + (long long)b * TT::QK;
#pragma unroll
    for (int g = 0; g < TT::E / TT::G; ++g)
#pragma unroll
        for (int e = 0; e < TT::G; ++e) {
            const long long o = base + TT::xoff(u, g) + e;
            if (HALF)
                static_cast<__half *>(dst)[o] = __float2half_rn(v[g * TT::G + e]);
            else
                static_cast<float *>(dst)[o] = v[g * TT::G + e];
        }
}

int dequant(int type, const void * src, long long n_src_rows, long long row_len, const int32_t * ids, long long n_out,
            void * dst, bool half, void * stream) {
    const TypeInfo * t = nullptr;
    int rc = check_weight(type, n_src_rows, row_len, &t);
    if (rc != SPECTER_OK) return rc;
    if (n_out < 0) return SPECTER_ERR_INVALID_ARG;
    if (n_out == 0 || row_len == 0) return SPECTER_OK;
    if (!src || !dst || !aligned_for(type, uintptr_t(src))) return SPECTER_ERR_INVALID_ARG;
    if (row_len > (1LL << 31) - 256) return SPECTER_ERR_INVALID_ARG;
    const long long rb = row_bytes(*t, row_len);
    cudaGetLastError();
    with_type(type, false, [&](auto tag) {
        using TT = typename decltype(tag)::type;
        const long long total = n_out * (row_len / TT::QK) * TT::NU;
        const unsigned blocks = unsigned((total + 255) / 256);
        auto kern = half ? dequant_kernel<TT, true> : dequant_kernel<TT, false>;
        launch(kern, blocks, 256, cudaStream_t(stream), static_cast<const uint8_t *>(src), rb, n_out, int(row_len),
               ids, n_src_rows, dst);
    });
    return launch_status();
}

// ---- GEMV: NR output rows per CTA, M rows of X per grid.y ------------------------------------------
// More rows per CTA at m = 1 puts more loads in flight per thread; the result of a row does not depend on
// NR (each row's units are split over the threads the same way), so rows stay independent of m bitwise.
// SWIGLU: w is [gate; up] (2n rows); the CTA dots gate row r and up row n + r and writes silu(g) * u.
template <class TT, int M, class XT, bool SWIGLU>
__global__ void __launch_bounds__(256) gemv_kernel(const uint8_t * __restrict__ w, long long rb, int n, int k,
                                                   const XT * __restrict__ x, int m, float * __restrict__ y) {
    start_after_prior_kernels();
    constexpr int NR = rows_per_cta(M, SWIGLU);
    constexpr int ND = SWIGLU ? 2 * NR : NR;  // weight rows dotted
    __shared__ float red[8 * ND * M];
    __shared__ float res[SWIGLU ? ND * M : 1];
    const int row0 = blockIdx.x * NR, t0 = blockIdx.y * M;
    const uint8_t * rows[ND];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const long long row = min(row0 + r, n - 1);
        rows[r] = w + row * rb;
        if (SWIGLU) rows[NR + r] = w + (n + row) * rb;
    }
    const XT * xs[M];
#pragma unroll
    for (int t = 0; t < M; ++t) xs[t] = x + (long long)min(t0 + t, m - 1) * k;
    float s = cta_dot_totals<TT, M, ND, XT>(rows, xs, k / TT::QK, red);
    if (SWIGLU) s = swiglu_of_totals<NR * M>(s, res);
    if (threadIdx.x < NR * M) {
        const int r = threadIdx.x / M, t = threadIdx.x % M;
        if (row0 + r < n && t0 + t < m) y[(long long)(t0 + t) * n + row0 + r] = s;
    }
}

template <class TT, int M, class XT, bool SWIGLU>
void launch_gemv_pass(const uint8_t * w, long long rb, int n, int k, const XT * x, int m, float * y, cudaStream_t st) {
    const int nr = rows_per_cta(M, SWIGLU);
    const dim3 grid(unsigned((n + nr - 1) / nr), unsigned((m + M - 1) / M));
    const int threads = cta_threads((long long)(k / TT::QK) * TT::NU);
    launch(gemv_kernel<TT, M, XT, SWIGLU>, grid, threads, st, w, rb, n, k, x, m, y);
}

// ---- router: logits and their top-k in one launch ------------------------------------------------
// The GEMV pass of M <= 8 rows of X (the same sums as gemv_kernel's: logits equal qmatmul's bitwise); then the last
// CTA to finish, found by a counter in device memory that it resets, takes each token's top-k over the logits the
// others wrote (each CTA's stores fenced before it counts itself). Saves the top-k kernel's launch and its wait for
// the product in every MoE layer of a decode step.
constexpr int kRouterMaxRows = 8;  // rows of X: one GEMV pass

struct RouteArgs {
    int n_expert, top_k, normalize;
    float scale;
    int32_t * ids;
    float * weights;
    unsigned * done;
};

template <class TT, int M>
__global__ void __launch_bounds__(256) router_kernel(const uint8_t * __restrict__ w, long long rb, int n, int k,
                                                     const float * __restrict__ x, int m, float * logits,
                                                     RouteArgs r) {
    start_after_prior_kernels();
    constexpr int NR = rows_per_cta(M, false);
    __shared__ float red[8 * NR * M];
    __shared__ bool last;
    const int row0 = blockIdx.x * NR;
    const uint8_t * rows[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) rows[i] = w + (long long)min(row0 + i, n - 1) * rb;
    const float * xs[M];
#pragma unroll
    for (int t = 0; t < M; ++t) xs[t] = x + (long long)min(t, m - 1) * k;
    const float s = cta_dot_totals<TT, M, NR, float>(rows, xs, k / TT::QK, red);
    if (threadIdx.x < NR * M) {
        const int i = threadIdx.x / M, t = threadIdx.x % M;
        if (row0 + i < n && t < m) logits[(long long)t * n + row0 + i] = s;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(r.done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int t = warp; t < m; t += blockDim.x >> 5)
        topk_row(logits + (long long)t * n, r.n_expert, r.top_k, r.normalize, r.scale, r.ids + (long long)t * r.top_k,
                 r.weights + (long long)t * r.top_k, lane);
    if (threadIdx.x == 0) *r.done = 0;
}

template <class TT>
void launch_router(const uint8_t * w, long long rb, int n, int k, const float * x, int m, float * logits,
                   const RouteArgs & r, cudaStream_t st) {
    const int M = m == 1 ? 1 : m == 2 ? 2 : m <= 4 ? 4 : 8;
    auto kernel = M == 1 ? router_kernel<TT, 1> : M == 2 ? router_kernel<TT, 2>
                : M == 4 ? router_kernel<TT, 4> : router_kernel<TT, 8>;
    const int nr = rows_per_cta(M, false);
    launch(kernel, unsigned((n + nr - 1) / nr), cta_threads((long long)(k / TT::QK) * TT::NU), st, w, rb, n, k, x, m,
           logits, r);
}

// Rows of X 8 at a time, then the rest in one pass of the fewest rows that holds it (a row's result is the same
// in every pass): 9 rows cost a pass of 8 and one of 1, not two of 8.
template <class TT, class XT, bool SWIGLU>
void launch_gemv(const uint8_t * w, long long rb, int n, int k, const XT * x, int m, float * y, cudaStream_t st) {
    const int full = m / 8 * 8, rest = m - full;
    if (full > 0) launch_gemv_pass<TT, 8, XT, SWIGLU>(w, rb, n, k, x, full, y, st);
    if (rest == 0) return;
    x += (long long)full * k;
    y += (long long)full * n;
    if (rest == 1) launch_gemv_pass<TT, 1, XT, SWIGLU>(w, rb, n, k, x, rest, y, st);
    else if (rest == 2) launch_gemv_pass<TT, 2, XT, SWIGLU>(w, rb, n, k, x, rest, y, st);
    else if (rest <= 4) launch_gemv_pass<TT, 4, XT, SWIGLU>(w, rb, n, k, x, rest, y, st);
    else launch_gemv_pass<TT, 8, XT, SWIGLU>(w, rb, n, k, x, rest, y, st);
}

// ALGO_AUTO's GEMV takes up to this many rows of X (a verification, short prompts): the tiled kernel's 64-wide
// output tiles leave most SMs idle on the narrow dense matrices of a MoE model (Qwen3-30B-A3B's attention: 80 and
// 32 CTAs), where it took 190 us a call on average for 9 rows (H200 profile of a verification, 2026-12-01).
constexpr int kGemvMaxRows = 32;

// ---- tiled GEMM: C[64 x 64] per CTA, k in chunks of 128, 4 warps each owning 16 columns of W ------
constexpr int TBM = 64, TBN = 64, TBK = 128, TLD = TBK + 8, CLD = TBN + 4;

template <class TT>
__global__ void __launch_bounds__(128) tiled_kernel(const uint8_t * __restrict__ w, long long rb, int n, int k,
                                                    int x_half, const void * __restrict__ xv, int m,
                                                    float * __restrict__ y) {
    start_after_prior_kernels();
    using namespace nvcuda;
    static_assert(TT::NU * TBK % TT::QK == 0, "a k-chunk must hold whole units");
    constexpr int UPC = TT::NU * TBK / TT::QK;  // units per row per k-chunk
    __shared__ __align__(32) __half smem[2 * TBM * TLD];
    __half * Xs = smem;
    __half * Ws = smem + TBM * TLD;
    float * Cs = reinterpret_cast<float *>(smem);
    const int n0 = blockIdx.x * TBN, m0 = blockIdx.y * TBM, warp = threadIdx.x >> 5;
    const int mrows = min(TBM, m - m0), mfrags = (mrows + 15) / 16;
    const int nblocks = k / TT::QK;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4];
#pragma unroll
    for (int f = 0; f < 4; ++f) wmma::fill_fragment(acc[f], 0.0f);

    for (int k0 = 0; k0 < k; k0 += TBK) {
        const int kvalid = min(TBK, k - k0);
        for (int i = threadIdx.x; i < mfrags * 16 * TBK; i += blockDim.x) {
            const int mi = i / TBK, kk = i % TBK;
            __half h = __float2half_rn(0.0f);
            if (mi < mrows && kk < kvalid) {
                const long long o = (long long)(m0 + mi) * k + k0 + kk;
                h = x_half ? static_cast<const __half *>(xv)[o] : __float2half_rn(static_cast<const float *>(xv)[o]);
            }
            Xs[mi * TLD + kk] = h;
        }
        if (kvalid < TBK)
            for (int i = threadIdx.x; i < TBN * (TBK - kvalid); i += blockDim.x)
                Ws[(i / (TBK - kvalid)) * TLD + kvalid + i % (TBK - kvalid)] = __float2half_rn(0.0f);
        const int c = k0 / TBK;
        for (int i = threadIdx.x; i < TBN * UPC; i += blockDim.x) {
            const int ri = i / UPC, j = i % UPC;
            const int gu = c * UPC + j, b = gu / TT::NU, u = gu % TT::NU;
            if (b >= nblocks) continue;
            const uint8_t * row = w + (long long)min(n0 + ri, n - 1) * rb;
            float v[TT::E];
            TT::template decode<false>(row + (long long)b * TT::BYTES, u, v);
#pragma unroll
            for (int g = 0; g < TT::E / TT::G; ++g)
#pragma unroll
                for (int e = 0; e < TT::G; ++e)
                    Ws[ri * TLD + b * TT::QK + TT::xoff(u, g) + e - k0] = __float2half_rn(v[g * TT::G + e]);
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TBK / 16; ++kk) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> bf;
            wmma::load_matrix_sync(bf, Ws + warp * 16 * TLD + kk * 16, TLD);
#pragma unroll
            for (int f = 0; f < 4; ++f) {
                if (f < mfrags) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> af;
                    wmma::load_matrix_sync(af, Xs + f * 16 * TLD + kk * 16, TLD);
                    wmma::mma_sync(acc[f], af, bf, acc[f]);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int f = 0; f < 4; ++f)
        if (f < mfrags) wmma::store_matrix_sync(Cs + f * 16 * CLD + warp * 16, acc[f], CLD, wmma::mem_row_major);
    __syncthreads();
    for (int i = threadIdx.x; i < mrows * TBN; i += blockDim.x) {
        const int mi = i / TBN, ni = i % TBN;
        if (n0 + ni < n) y[(long long)(m0 + mi) * n + n0 + ni] = Cs[mi * CLD + ni];
    }
}

// y = x . w^T (algo: a specter_qmatmul_algo), or with `swiglu` y = silu(x . gate^T) * (x . up^T), w = [gate; up].
int qmatmul(int w_type, const void * w, int64_t n, int64_t k, int x_type, const void * x, int64_t m, float * y,
            int algo, bool swiglu, cudaStream_t st) {
    const TypeInfo * t = nullptr;
    const int rc = check_qmatmul(w_type, w, swiglu ? 2 * n : n, k, x_type, x, m, y, &t);
    if (rc != SPECTER_OK) return rc;
    if (m == 0 || n == 0) return SPECTER_OK;
    cudaGetLastError();
    if (k == 0) {  // empty dot products: 0 (silu(0) * 0 = 0 too)
        cudaMemsetAsync(y, 0, size_t(m * n) * sizeof(float), st);
        return launch_status();
    }
    if (!aligned_for(w_type, uintptr_t(w)) || uintptr_t(x) % 16 != 0) return SPECTER_ERR_INVALID_ARG;
    const bool tiled = !swiglu && (algo == SPECTER_ALGO_TILED || (algo == SPECTER_ALGO_AUTO && m > kGemvMaxRows));
    if (tiled && m > 65535LL * 64) return SPECTER_ERR_INVALID_ARG;
    const bool vec = vec_ok(w_type, k, uintptr_t(w));
    const long long rb = row_bytes(*t, k);
    const uint8_t * wb = static_cast<const uint8_t *>(w);
    with_type(w_type, vec, [&](auto tag) {
        using TT = typename decltype(tag)::type;
        if (tiled) {
            const dim3 grid(unsigned((n + TBN - 1) / TBN), unsigned((m + TBM - 1) / TBM));
            launch(tiled_kernel<TT>, grid, 128, st, wb, rb, int(n), int(k), x_type == SPECTER_TYPE_F16, x, int(m), y);
        } else if (x_type == SPECTER_TYPE_F16) {
            auto xh = static_cast<const __half *>(x);
            swiglu ? launch_gemv<TT, __half, true>(wb, rb, int(n), int(k), xh, int(m), y, st)
                   : launch_gemv<TT, __half, false>(wb, rb, int(n), int(k), xh, int(m), y, st);
        } else {
            auto xf = static_cast<const float *>(x);
            swiglu ? launch_gemv<TT, float, true>(wb, rb, int(n), int(k), xf, int(m), y, st)
                   : launch_gemv<TT, float, false>(wb, rb, int(n), int(k), xf, int(m), y, st);
        }
    });
    return launch_status();
}

}  // namespace
}  // namespace cuda
}  // namespace specter

using namespace specter;
using namespace specter::cuda;

extern "C" {

int specter_cuda_dequantize_rows(int type, const void * src, float * dst, int64_t n_rows, int64_t row_len,
                                 void * stream) {
    return dequant(type, src, n_rows, row_len, nullptr, n_rows, dst, false, stream);
}

int specter_cuda_dequantize_rows_f16(int type, const void * src, uint16_t * dst, int64_t n_rows, int64_t row_len,
                                     void * stream) {
    return dequant(type, src, n_rows, row_len, nullptr, n_rows, dst, true, stream);
}

int specter_cuda_get_rows(int type, const void * src, int64_t n_rows, int64_t row_len, const int32_t * ids,
                          int64_t n_ids, float * dst, void * stream) {
    if (n_ids > 0 && row_len > 0 && !ids) return SPECTER_ERR_INVALID_ARG;
    return dequant(type, src, n_rows, row_len, ids, n_ids, dst, false, stream);
}

int specter_cuda_qmatmul(int w_type, const void * w, int64_t n, int64_t k, int x_type, const void * x, int64_t m,
                         float * y, int algo, void * stream) {
    if (algo < SPECTER_ALGO_AUTO || algo > SPECTER_ALGO_TILED) return SPECTER_ERR_INVALID_ARG;
    return qmatmul(w_type, w, n, k, x_type, x, m, y, algo, false, cudaStream_t(stream));
}

int specter_cuda_moe_route(int w_type, const void * w, int64_t n_rows, int64_t k, const float * x, int64_t n_tokens,
                           int64_t n_expert, int64_t top_k, int normalize, float scale, float * logits, int32_t * ids,
                           float * weights, uint32_t * done, void * stream) {
    const TypeInfo * t = nullptr;
    int rc = check_route(w_type, w, n_rows, k, x, n_tokens, n_expert, top_k, logits, ids, weights, &t);
    if (rc != SPECTER_OK || n_tokens == 0) return rc;
    const cudaStream_t st = cudaStream_t(stream);
    if (n_tokens > kRouterMaxRows || k == 0) {  // the product and the top-k as two launches
        rc = qmatmul(w_type, w, n_rows, k, SPECTER_TYPE_F32, x, n_tokens, logits, SPECTER_ALGO_AUTO, false, st);
        return rc != SPECTER_OK ? rc : specter_cuda_moe_topk(logits, n_tokens, n_expert, n_rows, top_k, normalize,
                                                             scale, ids, weights, stream);
    }
    if (!done || !aligned_for(w_type, uintptr_t(w)) || uintptr_t(x) % 16 != 0) return SPECTER_ERR_INVALID_ARG;
    cudaGetLastError();
    const RouteArgs r{int(n_expert), int(top_k), normalize, scale, ids, weights, done};
    with_type(w_type, vec_ok(w_type, k, uintptr_t(w)), [&](auto tag) {
        using TT = typename decltype(tag)::type;
        launch_router<TT>(static_cast<const uint8_t *>(w), row_bytes(*t, k), int(n_rows), int(k), x, int(n_tokens),
                          logits, r, st);
    });
    return launch_status();
}

int specter_cuda_qmatmul_swiglu(int w_type, const void * w, int64_t n, int64_t k, int x_type, const void * x,
                                int64_t m, float * y, void * stream) {
    return qmatmul(w_type, w, n, k, x_type, x, m, y, SPECTER_ALGO_GEMV, true, cudaStream_t(stream));
}

}  // extern "C"
