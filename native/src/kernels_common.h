// Pieces shared by the CPU and CUDA kernel entry points (libspecter internal): argument checks,
// the layouts of the MoE, decode attention and sampling chain workspaces, and the sampling chain's ranking key.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dequant_cpu.h"
#include "specter_kernels.h"

#ifdef __CUDACC__
#define SPECTER_HOST_DEVICE __host__ __device__
#else
#define SPECTER_HOST_DEVICE
#endif

namespace specter {

// Bytes of one row of k elements of type t (k a multiple of the block, checked by the caller).
inline int64_t row_bytes(const TypeInfo & t, int64_t k) { return k / t.block_elems * t.block_bytes; }

// SPECTER_OK or the error for a weight matrix [n, k] of `type` (type known, k a block multiple).
inline int check_weight(int type, int64_t n, int64_t k, const TypeInfo ** out) {
    const TypeInfo * t = find_type(type);
    if (!t) return SPECTER_ERR_UNSUPPORTED_TYPE;
    if (n < 0 || k < 0) return SPECTER_ERR_INVALID_ARG;
    if (k % t->block_elems != 0) return SPECTER_ERR_BAD_SHAPE;
    *out = t;
    return SPECTER_OK;
}

inline int check_qmatmul(int w_type, const void * w, int64_t n, int64_t k, int x_type, const void * x,
                         int64_t m, const float * y, const TypeInfo ** t) {
    const int rc = check_weight(w_type, n, k, t);
    if (rc != SPECTER_OK) return rc;
    if (x_type != SPECTER_TYPE_F32 && x_type != SPECTER_TYPE_F16) return SPECTER_ERR_UNSUPPORTED_TYPE;
    if (m < 0) return SPECTER_ERR_INVALID_ARG;
    if (m > 0 && n > 0 && (!y || (k > 0 && (!w || !x)))) return SPECTER_ERR_INVALID_ARG;
    if (m > (int64_t(1) << 31) || n > (int64_t(1) << 31) || k > (int64_t(1) << 31)) return SPECTER_ERR_INVALID_ARG;
    return SPECTER_OK;
}

inline int check_rms_norm(const float * x, const float * delta, const float * shared, const float * gate,
                          int64_t gate_stride, const float * weight, int64_t n_rows, int64_t n, float eps,
                          const float * y) {
    if (n_rows < 0 || n < 1 || !(eps >= 0.0f) || n_rows * n >= (int64_t(1) << 40)) return SPECTER_ERR_INVALID_ARG;
    if ((shared && !delta) || (gate && !shared) || (gate && n_rows > 1 && gate_stride < 1))
        return SPECTER_ERR_INVALID_ARG;
    if (n_rows > 0 && (!x || !weight || !y)) return SPECTER_ERR_INVALID_ARG;
    return SPECTER_OK;
}

inline int check_topk(const float * logits, int64_t n_tokens, int64_t n_expert, int64_t row_stride, int64_t top_k,
                      const int32_t * ids, const float * weights) {
    if (n_tokens < 0 || n_expert < 1 || top_k < 1 || top_k > n_expert || row_stride < n_expert)
        return SPECTER_ERR_INVALID_ARG;
    if (n_tokens > (int64_t(1) << 30) || n_expert > (int64_t(1) << 24)) return SPECTER_ERR_INVALID_ARG;
    if (n_tokens > 0 && (!logits || !ids || !weights)) return SPECTER_ERR_INVALID_ARG;
    return SPECTER_OK;
}

inline int check_expert_table(const int64_t * slot_of, const int64_t * host_ptrs, const specter_slot_pool * pool,
                              int64_t n_expert, const int32_t * ids, int64_t n_pairs,
                              const specter_spare_slots * spares, const int64_t * ptrs) {
    if (!slot_of || !host_ptrs || !pool || !ptrs || n_expert < 1 || n_expert > (int64_t(1) << 24) || n_pairs < 0 ||
        n_pairs > (int64_t(1) << 30) || pool->slot_bytes < 0)
        return SPECTER_ERR_INVALID_ARG;
    if (n_pairs > 0 && !ids) return SPECTER_ERR_INVALID_ARG;
    if (spares) {
        if (spares->n_spare < 0 || spares->n_spare > SPECTER_MAX_SPARES ||
            (spares->n_spare > 0 && (!spares->slots || !spares->fetched || !spares->arrivals)))
            return SPECTER_ERR_INVALID_ARG;
        for (int part = 0; part < 3; ++part)
            if (pool->part_bytes[part] < 0 || pool->part_offset[part] < 0 ||
                pool->part_offset[part] + pool->part_bytes[part] > pool->slot_bytes)
                return SPECTER_ERR_INVALID_ARG;
    }
    return SPECTER_OK;
}

// specter_expert_table's entry of expert e, part `part`: 0 for an expert the CPU computes (`skip`), its slot's
// part, or its record's part in host memory.
SPECTER_HOST_DEVICE inline int64_t expert_address(const int64_t * slot_of, const int64_t * host_ptrs,
                                                  const specter_slot_pool & pool, const uint8_t * skip,
                                                  int64_t n_expert, int part, int64_t e) {
    if (skip && skip[e]) return 0;
    const int64_t slot = slot_of[e];
    return slot >= 0 ? pool.base + slot * pool.slot_bytes + pool.part_offset[part] : host_ptrs[part * n_expert + e];
}

// Which missed experts specter_expert_table copies into which spare slots: of the experts the call routes (used[e]
// != 0), the missed ones (slot_of[e] == -1) that the CPU does not compute (`skip`, may be NULL) in ascending order
// take the usable spares (slots[j] >= 0) in ascending j. Writes expert[i] and spare[i] (the index j) of each,
// returns how many (at most n_spare).
SPECTER_HOST_DEVICE inline int assign_spares(const int64_t * slot_of, const uint8_t * used, const uint8_t * skip,
                                             int64_t n_expert, const int64_t * slots, int64_t n_spare, int * expert,
                                             int * spare) {
    int n = 0, j = 0;
    for (int64_t e = 0; e < n_expert; ++e) {
        if (!used[e] || slot_of[e] != -1 || (skip && skip[e])) continue;
        while (j < n_spare && slots[j] < 0) ++j;
        if (j == n_spare) break;
        expert[n] = int(e), spare[n] = j++, ++n;
    }
    return n;
}

// specter_moe_route: the product's (x float32, logits [n_tokens, n_rows]) and the top-k's of its first n_expert columns.
inline int check_route(int w_type, const void * w, int64_t n_rows, int64_t k, const float * x, int64_t n_tokens,
                       int64_t n_expert, int64_t top_k, const float * logits, const int32_t * ids,
                       const float * weights, const TypeInfo ** t) {
    const int rc = check_qmatmul(w_type, w, n_rows, k, SPECTER_TYPE_F32, x, n_tokens, logits, t);
    if (rc != SPECTER_OK) return rc;
    if (n_expert > n_rows) return SPECTER_ERR_INVALID_ARG;
    return check_topk(logits, n_tokens, n_expert, n_rows, top_k, ids, weights);
}

// The arguments of specter_rope_kv / specter_cuda_rope_kv (one struct for the checks and the kernels).
struct RopeKvArgs {
    const float *q, *k, *v;
    int64_t q_stride, k_stride, v_stride;
    const float *q_bias, *k_bias, *v_bias;
    const float *q_norm, *k_norm;  // per-head RMS norm weights [head_dim] (NULL: none)
    float norm_eps;
    int64_t n_tokens, n_head, n_head_kv, head_dim, rope_dim;
    int neox;
    const float *cos, *sin;
    int64_t n_pos;
    const int64_t * pos;
    int out_type;
    void *q_out, *k_cache, *v_cache;
    int64_t capacity;
};

inline int check_rope_kv(const RopeKvArgs & a) {
    if (a.out_type != SPECTER_TYPE_F32 && a.out_type != SPECTER_TYPE_F16) return SPECTER_ERR_UNSUPPORTED_TYPE;
    if (a.n_tokens < 0 || a.n_head < 0 || a.n_head_kv < 0 || a.head_dim < 0 || a.n_pos < 0 || a.capacity < 0)
        return SPECTER_ERR_INVALID_ARG;
    if ((a.q_norm || a.k_norm) && !(a.norm_eps >= 0.0f)) return SPECTER_ERR_INVALID_ARG;
    if (a.head_dim % 2 || a.rope_dim < 0 || a.rope_dim % 2 || a.rope_dim > a.head_dim) return SPECTER_ERR_INVALID_ARG;
    if (a.q_stride < a.n_head * a.head_dim || a.k_stride < a.n_head_kv * a.head_dim ||
        a.v_stride < a.n_head_kv * a.head_dim)
        return SPECTER_ERR_INVALID_ARG;
    const int64_t big = int64_t(1) << 31;
    if (a.n_tokens * a.q_stride >= big || a.n_head * a.n_tokens * a.head_dim >= big ||
        a.n_head_kv * a.capacity * a.head_dim >= big)
        return SPECTER_ERR_INVALID_ARG;
    if (a.n_tokens == 0) return SPECTER_OK;
    if (!a.pos || (a.n_head > 0 && (!a.q || !a.q_out)) ||
        (a.n_head_kv > 0 && (!a.k || !a.v || !a.k_cache || !a.v_cache)))
        return SPECTER_ERR_INVALID_ARG;
    if (a.rope_dim > 0 && (!a.cos || !a.sin)) return SPECTER_ERR_INVALID_ARG;
    return SPECTER_OK;
}

constexpr size_t kWsAlign = 256;
inline size_t ws_round(size_t b) { return (b + kWsAlign - 1) / kWsAlign * kWsAlign; }

// Decode attention's key splits and workspace (specter_decode_attention). A split holds split_len keys: 32 up
// to n_keys = 2048 (64 splits), then more per split up to kAttnMaxSplit (n_keys > 16384: more than 64 splits).
// Depends on n_keys alone, so a token's result depends on nothing but its own inputs.
//   float m:   [n_head, n_tokens, n_splits]           each split's maximum score (-inf: no key seen)
//   float l:   [n_head, n_tokens, n_splits]           sum of exp(score - m) over the split's seen keys
//   float acc: [n_head, n_tokens, n_splits, head_dim] sum of exp(score - m) v (unwritten where m = -inf)
constexpr int64_t kAttnSplitUnit = 32;
constexpr int64_t kAttnMaxSplit = 256;
constexpr int64_t kAttnTargetSplits = 64;

struct AttnLayout {
    int64_t split_len, n_splits;
    size_t m, l, acc, total;  // byte offsets of the regions, total size
};

inline bool attn_layout(int64_t n_tokens, int64_t n_head, int64_t head_dim, int64_t n_keys, AttnLayout * L) {
    if (n_tokens < 0 || n_tokens > SPECTER_DECODE_ATTN_MAX_TOKENS || n_head < 1 || n_head > 65535 ||
        head_dim < 1 || head_dim > SPECTER_DECODE_ATTN_MAX_HEAD_DIM || n_keys < 1 || n_keys >= (int64_t(1) << 31))
        return false;
    const int64_t units = (n_keys + kAttnSplitUnit * kAttnTargetSplits - 1) / (kAttnSplitUnit * kAttnTargetSplits);
    L->split_len = kAttnSplitUnit * std::min<int64_t>(std::max<int64_t>(units, 1), kAttnMaxSplit / kAttnSplitUnit);
    L->n_splits = (n_keys + L->split_len - 1) / L->split_len;
    const size_t stats = size_t(n_head * n_tokens * L->n_splits) * 4;
    L->m = 0;
    L->l = ws_round(stats);
    L->acc = L->l + ws_round(stats);
    L->total = L->acc + ws_round(stats * size_t(head_dim));
    return true;
}

struct AttnArgs {
    int kv_type;
    const void *q, *k, *v;
    int64_t n_tokens, n_head, n_head_kv, head_dim, n_keys, capacity;
    const int64_t * pos;
    float scale;
    void * workspace;
    size_t workspace_bytes;
    void * out;
};

inline int check_attention(const AttnArgs & a, AttnLayout * L) {
    if (a.kv_type != SPECTER_TYPE_F32 && a.kv_type != SPECTER_TYPE_F16) return SPECTER_ERR_UNSUPPORTED_TYPE;
    if (a.head_dim % 32 || a.head_dim < 32 || a.head_dim > SPECTER_DECODE_ATTN_MAX_HEAD_DIM)
        return SPECTER_ERR_BAD_SHAPE;
    if (a.n_head_kv < 1 || a.n_head % a.n_head_kv || a.capacity < a.n_keys ||
        !attn_layout(a.n_tokens, a.n_head, a.head_dim, a.n_keys, L))
        return SPECTER_ERR_INVALID_ARG;
    if (a.n_head_kv * a.capacity * a.head_dim >= (int64_t(1) << 40)) return SPECTER_ERR_INVALID_ARG;
    if (a.n_tokens == 0) return SPECTER_OK;
    if (!a.q || !a.k || !a.v || !a.pos || !a.out || !a.workspace || a.workspace_bytes < L->total)
        return SPECTER_ERR_INVALID_ARG;
    return SPECTER_OK;
}

// MoE workspace: P = n_tokens * top_k (token, slot) pairs, G = min(P, n_expert) groups.
//   int32 meta:  group_expert[G], group_off[G + 1], n_groups[1], perm[P]
//   float act:   [P, d_ff]     silu(gate x) * up x
//   float aux:   [P, d_ff]     up x, when gate and up have different types
//   float ypair: [P, d_model]  down(act) per pair, reduced per token in slot order
struct MoeLayout {
    int64_t P, G;
    size_t meta, act, aux, ypair, total;  // byte offsets of the regions, total size
};

inline bool moe_layout(int64_t n_tokens, int64_t top_k, int64_t n_expert, int64_t d_model, int64_t d_ff,
                       MoeLayout * L) {
    if (n_tokens < 0 || top_k < 0 || n_expert < 0 || d_model < 0 || d_ff < 0) return false;
    if (n_tokens > (int64_t(1) << 24) || top_k > 1024 || n_expert > (int64_t(1) << 20) ||
        d_model > (int64_t(1) << 24) || d_ff > (int64_t(1) << 24))
        return false;
    L->P = n_tokens * top_k;
    L->G = L->P < n_expert ? L->P : n_expert;
    L->meta = 0;
    L->act = ws_round(size_t(L->G + (L->G + 1) + 1 + L->P) * 4);
    L->aux = L->act + ws_round(size_t(L->P * d_ff) * 4);
    L->ypair = L->aux + ws_round(size_t(L->P * d_ff) * 4);
    L->total = L->ypair + ws_round(size_t(L->P * d_model) * 4);
    return true;
}

struct MoeArgs {
    const float * x;
    int64_t n_tokens, d_model;
    const int32_t * ids;
    const float * weights;
    int64_t top_k, n_expert, d_ff;
    const uint64_t *gate_ptrs, *up_ptrs, *down_ptrs;
    int gate_type, up_type, down_type;
    void * workspace;
    size_t workspace_bytes;
    float * out;
    int accumulate;
};

inline int check_moe(const MoeArgs & a, MoeLayout * L, const TypeInfo ** tg, const TypeInfo ** tu,
                     const TypeInfo ** td) {
    int rc = check_weight(a.gate_type, a.d_ff, a.d_model, tg);
    if (rc == SPECTER_OK) rc = check_weight(a.up_type, a.d_ff, a.d_model, tu);
    if (rc == SPECTER_OK) rc = check_weight(a.down_type, a.d_model, a.d_ff, td);
    if (rc != SPECTER_OK) return rc;
    if (!moe_layout(a.n_tokens, a.top_k, a.n_expert, a.d_model, a.d_ff, L)) return SPECTER_ERR_INVALID_ARG;
    if (a.n_tokens == 0 || a.d_model == 0) return SPECTER_OK;
    if (!a.x || !a.out) return SPECTER_ERR_INVALID_ARG;
    if (L->P > 0 && (!a.ids || !a.weights)) return SPECTER_ERR_INVALID_ARG;
    if (a.n_expert > 0 && (!a.gate_ptrs || !a.up_ptrs || !a.down_ptrs)) return SPECTER_ERR_INVALID_ARG;
    if (L->P > 0 && (!a.workspace || a.workspace_bytes < L->total)) return SPECTER_ERR_INVALID_ARG;
    return SPECTER_OK;
}

// ---- the sampling chain (specter_sample_chain) ---------------------------------------------------------------
// Candidates are ranked by (key desc, id asc), the key of a logit being its float32 bits mapped to an unsigned
// integer of the same order (-0.0 as +0.0, so that they tie; NaNs land past the infinities), at least 1: 0 marks
// "no logit" in the CUDA kernels (a chunk's tail), so that it never ties with a real one. The CPU and CUDA rank
// with this one function, so they take the same candidates whatever the logits hold.
SPECTER_HOST_DEVICE inline uint32_t sample_key(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    if ((b & 0x7fffffffu) == 0) b = 0;
    const uint32_t k = b ^ (uint32_t(int32_t(b) >> 31) | 0x80000000u);  // ~b when negative: no branch on the sign
    return k > 1u ? k : 1u;
}

// The logit of a key (a NaN for the keys NaNs gave; +0.0 for -0.0).
SPECTER_HOST_DEVICE inline float sample_logit(uint32_t k) {
    const uint32_t b = (k & 0x80000000u) ? k & 0x7fffffffu : ~k;
    float x;
    memcpy(&x, &b, 4);
    return x;
}

// The CUDA workspace: each (row, chunk of kSampleChunk logits)'s top C as keys and ids, chunk c of row r at
// (r * n_chunks + c) * C; a chunk of n < C logits fills its first n slots.
//   uint32 keys: [n_rows, n_chunks, C]
//   int32  ids:  [n_rows, n_chunks, C]
constexpr int64_t kSampleChunk = 4096;

struct SampleLayout {
    int64_t n_chunks;
    size_t keys, ids, total;  // byte offsets of the regions, total size
};

inline bool sample_layout(int64_t n_rows, int64_t n_vocab, int64_t n_candidates, SampleLayout * L) {
    if (n_rows < 0 || n_rows > 65535 || n_candidates < 1 || n_candidates > SPECTER_SAMPLE_MAX_CANDIDATES ||
        n_vocab < n_candidates || n_vocab > SPECTER_SAMPLE_MAX_VOCAB)
        return false;
    L->n_chunks = (n_vocab + kSampleChunk - 1) / kSampleChunk;
    const size_t n = size_t(n_rows * L->n_chunks * n_candidates) * 4;
    L->keys = 0;
    L->ids = ws_round(n);
    L->total = L->ids + ws_round(n);
    return true;
}

struct SampleArgs {
    const float * logits;
    int64_t n_rows, n_vocab, row_stride, n_candidates;
    const double *knobs, *uniforms;
    int64_t * ids;
    double * probs;
    int64_t * tokens;
    void * workspace;
    size_t workspace_bytes;
};

inline int check_sample_chain(const SampleArgs & a, SampleLayout * L) {
    if (!sample_layout(a.n_rows, a.n_vocab, a.n_candidates, L) || a.row_stride < a.n_vocab ||
        a.n_rows * a.row_stride >= (int64_t(1) << 40))
        return SPECTER_ERR_INVALID_ARG;
    if (a.n_rows == 0) return SPECTER_OK;
    if (!a.logits || !a.knobs || !a.ids || !a.probs || (a.uniforms && !a.tokens) || !a.workspace ||
        a.workspace_bytes < L->total)
        return SPECTER_ERR_INVALID_ARG;
    return SPECTER_OK;
}

}  // namespace specter
