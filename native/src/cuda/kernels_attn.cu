// CUDA attention of a few queries over the KV cache (specter_kernels.h: specter_cuda_decode_attention), as
// flash-decoding: the keys are cut into splits (kernels_common.h: attn_layout, a split length that depends on
// n_keys only) so that a single query still spreads over many CTAs, and a second kernel combines the splits.
//
// attn_split_kernel: grid (n_splits, n_head), head_dim threads (head_dim / 32 warps). The CTA of split s and
// query head h reads keys j0 = s * split_len .. j0 + n - 1 of KV head h / group, n reaching no further than the
// last position any token of the call sees (a CUDA graph's window past the positions costs no reads), and for
// every token t:
//   1. score_j = scale * q[h, t] . k_j: kParts threads per key, each a contiguous part of the features (16-byte
//      loads), the parts summed by a butterfly; a key after the token's position is -inf (a select, never
//      arithmetic: a NaN in a row not written yet stays out);
//   2. one warp per token: m = max score, e_j = exp(score_j - m) with e = 0 for a -inf score (so a token that
//      sees no key of the split gets m = -inf, l = 0 and never computes exp(-inf - -inf)), l = sum e_j;
//   3. acc[c] = sum_j e_j v_j[c], thread c for feature c, over the token's seen keys only (a select again);
//   writes m, l and acc to the workspace. A split past every token's position writes m = -inf, l = 0 and no
//   acc; a token that sees none of a split's keys writes m = -inf, l = 0, acc = 0.
// attn_combine_kernel: grid (n_tokens, n_head), head_dim threads: M = max_s m_s, out = sum_s e^(m_s - M) acc_s /
//   sum_s e^(m_s - M) l_s over the splits in ascending order, skipping every split with m_s = -inf (its acc may
//   be unwritten). The clamped positions are >= 0, so split 0 always holds a key a token sees: the sum is > 0.
// Determinism: a fixed split of the keys and fixed reduction orders, no atomics. A token's result does not
// depend on the others: their positions only change how far n reaches, and the keys it adds to a token's
// reductions are -inf (to a max) or are left out by a select (sums), identities of each operation.
#include <cstdint>

#include "kernels_common.h"
#include "launch.cuh"
#include "quant.cuh"

namespace specter {
namespace cuda {
namespace {

constexpr int kSplitMax = int(kAttnMaxSplit);

struct AttnParams {
    const void * q;
    const void * k;
    const void * v;
    void * out;
    const long long * pos;
    float scale;
    int T, group, S, split_len, n_splits;
    long long capacity;
    float * m;    // workspace: [n_head, T, n_splits]
    float * l;    // [n_head, T, n_splits]
    float * acc;  // [n_head, T, n_splits, head_dim]
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float * p, float x) { *p = x; }
__device__ __forceinline__ void store(__half * p, float x) { *p = __float2half_rn(x); }

// Features [0, N) of a key or value row to float registers, 16 bytes a load (rows and parts 16-byte aligned: a
// head_dim that is a multiple of 32, parts of head_dim / kParts).
template <int N>
__device__ __forceinline__ void load_row(const __half * p, float (&f)[N]) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
        const uint4 u = reinterpret_cast<const uint4 *>(p)[i];
        const __half2 * h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 x = __half22float2(h[j]);
            f[8 * i + 2 * j] = x.x, f[8 * i + 2 * j + 1] = x.y;
        }
    }
}
template <int N>
__device__ __forceinline__ void load_row(const float * p, float (&f)[N]) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        const float4 u = reinterpret_cast<const float4 *>(p)[i];
        f[4 * i] = u.x, f[4 * i + 1] = u.y, f[4 * i + 2] = u.z, f[4 * i + 3] = u.w;
    }
}

constexpr int kParts = 4;                 // threads per key in the scores: each dots head_dim / kParts features
constexpr int kValuesAhead = int(kAttnSplitUnit);  // value rows loaded before the scores (a short split's all)

// TM: the most tokens this instantiation takes (T <= TM): 1 for a decode / draft step, kMaxTokens otherwise.
// Memory latency, not bandwidth, bounds a split of a few dozen keys: every key's row is loaded at once (kParts
// threads a key, 16-byte loads), and the first kValuesAhead value rows before the scores are computed.
template <int D, int TM, class KV>
__global__ void __launch_bounds__(D) attn_split_kernel(AttnParams a) {
    start_after_prior_kernels();
    constexpr int FP = D / kParts, KPR = D / kParts, NW = D / 32, QW = D + kParts;  // QW: a padded q row
    __shared__ float q_s[TM * QW];         // q[h, t, :] as float32: token t at t * QW, part p at p * (FP + 1)
    __shared__ float p_s[TM * kSplitMax];  // token t's scores at t * kSplitMax, then exp(score - m)
    __shared__ int pos_s[TM];              // positions clamped into [0, S - 1]; -1 for t >= T
    const int s = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int T = a.T, NS = a.n_splits, j0 = s * a.split_len;
    if (tid < TM) {
        int p = -1;
        if (tid < T) {
            const long long pp = a.pos[tid];
            p = pp < 0 ? 0 : (pp >= a.S ? a.S - 1 : int(pp));
        }
        pos_s[tid] = p;
    }
    const KV * q = static_cast<const KV *>(a.q) + (long long)h * T * D;
    for (int i = tid; i < T * D; i += D) {
        const int t = i / D, c = i % D;
        q_s[t * QW + (c / FP) * (FP + 1) + c % FP] = to_float(q[i]);  // padded: the parts' reads hit four banks
    }
    __syncthreads();
    int last = 0;
    for (int t = 0; t < T; ++t) last = max(last, pos_s[t]);
    const int n = min(a.split_len, last + 1 - j0);  // keys j0 .. j0 + n - 1; j0 + n <= last + 1 <= S
    const long long row = (long long)h * T * NS + s;  // token t's entry: row + t * NS
    if (n <= 0) {  // the same for the whole CTA: no __syncthreads is skipped by part of it
        if (tid < T) a.m[row + (long long)tid * NS] = -INFINITY, a.l[row + (long long)tid * NS] = 0.0f;
        return;
    }
    const long long kv = ((long long)(h / a.group) * a.capacity + j0) * D;
    const KV * vb = static_cast<const KV *>(a.v) + kv + tid;
    float ahead[kValuesAhead];
#pragma unroll
    for (int jj = 0; jj < kValuesAhead; ++jj) ahead[jj] = jj < n ? to_float(vb[(long long)jj * D]) : 0.0f;

    // 1. scores: thread tid dots part tid % kParts of key tid / kParts (+ KPR a round), then the parts are summed
    const int part = tid % kParts;
    const KV * kb = static_cast<const KV *>(a.k) + kv + part * FP;
    for (int base = 0; base < n; base += KPR) {  // n is the same for the CTA: the shuffles see whole warps
        const int jj = base + tid / kParts;
        float kr[FP];
        if (jj < n) {
            load_row<FP>(kb + (long long)jj * D, kr);
        } else {
#pragma unroll
            for (int i = 0; i < FP; ++i) kr[i] = 0.0f;
        }
#pragma unroll
        for (int t = 0; t < TM; ++t) {
            if (t >= T) break;
            const float * qt = q_s + t * QW + part * (FP + 1);
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < FP; ++i) dot = fmaf(qt[i], kr[i], dot);
            dot += __shfl_xor_sync(0xffffffffu, dot, 1);
            dot += __shfl_xor_sync(0xffffffffu, dot, 2);
            if (part == 0 && jj < n) p_s[t * kSplitMax + jj] = j0 + jj <= pos_s[t] ? dot * a.scale : -INFINITY;
        }
    }
    __syncthreads();

    // 2. the split's softmax statistics per token
    for (int t = warp; t < T; t += NW) {
        float * pt = p_s + t * kSplitMax;
        float mx = -INFINITY;
        for (int jj = lane; jj < n; jj += 32) mx = fmaxf(mx, pt[jj]);
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float sum = 0.0f;
        for (int jj = lane; jj < n; jj += 32) {
            const float sc = pt[jj];
            const float e = sc == -INFINITY ? 0.0f : expf(sc - mx);  // mx > -inf wherever sc is
            pt[jj] = e;
            sum += e;
        }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) a.m[row + (long long)t * NS] = mx, a.l[row + (long long)t * NS] = sum;
    }
    __syncthreads();

    // 3. weighted values, feature tid of every token
    int lim[TM];  // token t sees split key jj iff jj <= lim[t] (t >= T: none)
    float acc[TM];
#pragma unroll
    for (int t = 0; t < TM; ++t) lim[t] = pos_s[t] - j0, acc[t] = 0.0f;
#pragma unroll
    for (int jj = 0; jj < kValuesAhead; ++jj) {
        if (jj >= n) break;
#pragma unroll
        for (int t = 0; t < TM; ++t)
            if (jj <= lim[t]) acc[t] = fmaf(p_s[t * kSplitMax + jj], ahead[jj], acc[t]);
    }
#pragma unroll 8
    for (int jj = kValuesAhead; jj < n; ++jj) {
        const float v = to_float(vb[(long long)jj * D]);
#pragma unroll
        for (int t = 0; t < TM; ++t)
            if (jj <= lim[t]) acc[t] = fmaf(p_s[t * kSplitMax + jj], v, acc[t]);
    }
    float * out = a.acc + row * D + tid;
#pragma unroll
    for (int t = 0; t < TM; ++t)
        if (t < T) out[(long long)t * NS * D] = acc[t];
}

template <class KV>
__global__ void attn_combine_kernel(AttnParams a, int D) {
    start_after_prior_kernels();
    const int t = blockIdx.x, h = blockIdx.y, c = threadIdx.x, NS = a.n_splits;
    const long long r = (long long)h * a.T + t;  // (head, token): row of out, of m and l
    const float * m = a.m + r * NS;
    const float * l = a.l + r * NS;
    const float * acc = a.acc + r * NS * D + c;
    float mx = -INFINITY;
    for (int s = 0; s < NS; ++s) mx = fmaxf(mx, m[s]);
    float sum = 0.0f, y = 0.0f;
    for (int s = 0; s < NS; ++s) {
        const float ms = m[s];
        if (ms == -INFINITY) continue;  // no key seen (acc unwritten); otherwise mx is finite too
        const float w = expf(ms - mx);
        sum = fmaf(w, l[s], sum);
        y = fmaf(w, acc[(long long)s * D], y);
    }
    store(static_cast<KV *>(a.out) + r * D + c, sum > 0.0f ? y / sum : 0.0f);
}

template <int D, class KV>
void launch_attention(const AttnParams & p, unsigned n_head, cudaStream_t stream) {
    const dim3 grid(unsigned(p.n_splits), n_head);
    if (p.T == 1)
        launch(attn_split_kernel<D, 1, KV>, grid, D, stream, p);
    else
        launch(attn_split_kernel<D, SPECTER_DECODE_ATTN_MAX_TOKENS, KV>, grid, D, stream, p);
    launch(attn_combine_kernel<KV>, dim3(unsigned(p.T), n_head), D, stream, p, D);
}

template <class KV>
void launch_attention(const AttnParams & p, int64_t head_dim, unsigned n_head, cudaStream_t stream) {
    switch (head_dim) {  // check_attention allows the multiples of 32 up to SPECTER_DECODE_ATTN_MAX_HEAD_DIM
    case 32: launch_attention<32, KV>(p, n_head, stream); break;
    case 64: launch_attention<64, KV>(p, n_head, stream); break;
    case 96: launch_attention<96, KV>(p, n_head, stream); break;
    case 128: launch_attention<128, KV>(p, n_head, stream); break;
    case 160: launch_attention<160, KV>(p, n_head, stream); break;
    case 192: launch_attention<192, KV>(p, n_head, stream); break;
    case 224: launch_attention<224, KV>(p, n_head, stream); break;
    case 256: launch_attention<256, KV>(p, n_head, stream); break;
    default: break;
    }
}

static_assert(SPECTER_DECODE_ATTN_MAX_HEAD_DIM == 256, "launch_attention instantiates head_dim 32 .. 256");

}  // namespace
}  // namespace cuda
}  // namespace specter

using namespace specter;
using namespace specter::cuda;

extern "C" {

int specter_cuda_decode_attention(int kv_type, const void * q, const void * k_cache, const void * v_cache,
                                  int64_t n_tokens, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                                  int64_t n_keys, int64_t capacity, const int64_t * pos, float scale,
                                  void * workspace, size_t workspace_bytes, void * out, void * stream) {
    const AttnArgs a{kv_type, q, k_cache, v_cache, n_tokens, n_head, n_head_kv, head_dim, n_keys, capacity,
                     pos, scale, workspace, workspace_bytes, out};
    AttnLayout L;
    const int rc = check_attention(a, &L);
    if (rc != SPECTER_OK || n_tokens == 0) return rc;
    char * ws = static_cast<char *>(workspace);
    const AttnParams p{q, k_cache, v_cache, out, reinterpret_cast<const long long *>(pos), scale, int(n_tokens),
                       int(n_head / n_head_kv), int(n_keys), int(L.split_len), int(L.n_splits), capacity,
                       reinterpret_cast<float *>(ws + L.m), reinterpret_cast<float *>(ws + L.l),
                       reinterpret_cast<float *>(ws + L.acc)};
    cudaGetLastError();
    const cudaStream_t st = cudaStream_t(stream);
    if (kv_type == SPECTER_TYPE_F16)
        launch_attention<__half>(p, head_dim, unsigned(n_head), st);
    else
        launch_attention<float>(p, head_dim, unsigned(n_head), st);
    return launch_status();
}

}  // extern "C"
