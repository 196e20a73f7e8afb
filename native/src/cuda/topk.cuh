// MoE top-k routing of one token by one warp (internal header): shared by the top-k kernel and the router kernel
// that computes the logits and their top-k in one launch.
#pragma once

#include <cstdint>

namespace specter {
namespace cuda {

// Logits a lane holds in registers: up to 32 * kTopkLane experts (every supported model; more are read from L2 in
// every pass).
constexpr int kTopkLane = 8;

// The top k of E logits `l` by one warp (lane: this thread's lane). Softmax statistics by warp reductions, then k
// rounds: each round takes the best expert ranked after the previous choice in (logit desc, index asc) order, so no
// per-expert state is kept. Writes ids[0..k) and weights[0..k) (renormalized to sum 1 when `normalize`, then times
// `scale` unless it is 0 or 1). Loads bypass L1: the router kernel reads logits other CTAs have just written.
// NL > 0: the lane's logits e = lane + 32 i (i < NL) are loaded once into registers (E <= 32 NL), so the 2 + k
// passes over them wait on no memory; NL = 0: every pass reads them again. Both compare and sum the same values in
// the same order.
template <int NL>
__device__ __forceinline__ void topk_row_held(const float * l, int E, int K, int normalize, float scale,
                                              int32_t * ids, float * weights, int lane) {
    float held[NL > 0 ? NL : 1];
    if constexpr (NL > 0) {
#pragma unroll
        for (int i = 0; i < NL; ++i) held[i] = lane + 32 * i < E ? __ldcg(l + lane + 32 * i) : 0.0f;
    }
    // logit i of this lane (expert lane + 32 i < E)
    auto logit = [&](int i) {
        if constexpr (NL > 0)
            return held[i];
        else
            return __ldcg(l + lane + 32 * i);
    };
    const int n = NL > 0 ? NL : (E + 31) / 32;  // passes over i < n, e = lane + 32 i < E
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < n; ++i)
        if (lane + 32 * i < E) mx = fmaxf(mx, logit(i));
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < n; ++i)
        if (lane + 32 * i < E) sum += expf(logit(i) - mx);
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    float last_v = INFINITY, wsum = 0.0f, mine = 0.0f;  // mine: the weight of this lane's last round (j % 32)
    int last_i = -1;
    for (int j = 0; j < K; ++j) {
        float bv = 0.0f;
        int bi = -1;
#pragma unroll
        for (int i = 0; i < n; ++i) {
            const int e = lane + 32 * i;
            if (e >= E) continue;
            const float v = logit(i);
            if ((v < last_v || (v == last_v && e > last_i)) && (bi < 0 || v > bv)) bv = v, bi = e;
        }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) bv = ov, bi = oi;
        }
        last_v = bv, last_i = bi;
        const float p = bi >= 0 ? expf(bv - mx) / sum : 0.0f;
        wsum += p;
        if (lane == (j & 31)) ids[j] = bi, weights[j] = p, mine = p;
    }
    // each lane rescales its own rounds, the last of them from its register: no lane reads back a row of stores
    if (normalize || (scale != 0.0f && scale != 1.0f))
        for (int j = lane; j < K; j += 32) {
            float w = j + 32 >= K ? mine : weights[j];
            if (normalize) w /= fmaxf(wsum, 6.103515625e-5f);
            if (scale != 0.0f && scale != 1.0f) w *= scale;
            weights[j] = w;
        }
}

__device__ __forceinline__ void topk_row(const float * l, int E, int K, int normalize, float scale, int32_t * ids,
                                         float * weights, int lane) {
    if (E <= 32 * kTopkLane)
        topk_row_held<kTopkLane>(l, E, K, normalize, scale, ids, weights, lane);
    else
        topk_row_held<0>(l, E, K, normalize, scale, ids, weights, lane);
}

}  // namespace cuda
}  // namespace specter
