// MoE top-k routing of one token by one warp (internal header): shared by the top-k kernel and the router kernel
// that computes the logits and their top-k in one launch.
#pragma once

#include <cstdint>

namespace specter {
namespace cuda {

// The top k of E logits `l` by one warp (lane: this thread's lane). Softmax statistics by warp reductions, then k
// rounds: each round takes the best expert ranked after the previous choice in (logit desc, index asc) order, so no
// per-expert state is kept. Writes ids[0..k) and weights[0..k) (renormalized to sum 1 when `normalize`, then times
// `scale` unless it is 0 or 1). Loads bypass L1: the router kernel reads logits other CTAs have just written.
__device__ __forceinline__ void topk_row(const float * l, int E, int K, int normalize, float scale, int32_t * ids,
                                         float * weights, int lane) {
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, __ldcg(l + e));
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) sum += expf(__ldcg(l + e) - mx);
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    float last_v = INFINITY, wsum = 0.0f, mine = 0.0f;  // mine: the weight of this lane's last round (j % 32)
    int last_i = -1;
    for (int j = 0; j < K; ++j) {
        float bv = 0.0f;
        int bi = -1;
        for (int e = lane; e < E; e += 32) {
            const float v = __ldcg(l + e);
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

}  // namespace cuda
}  // namespace specter
