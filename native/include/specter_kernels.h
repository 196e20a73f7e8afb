/*
 * specter_kernels.h - matrix kernels over GGUF-typed weights, and the small fused ops around them in a
 * decode step (the residual add and its norm, MoE routing, RoPE + KV cache store, attention of a few queries, the
 * sampling chain), and a wait on a counter that orders them after copies (libspecter).
 *
 * Every operation has a CPU entry point (specter_*) and a CUDA one (specter_cuda_*) with the same
 * data arguments; the last argument differs: `n_threads` (CPU threads, <= 0: all cores) for the
 * CPU, `stream` (a cudaStream_t, NULL = the legacy default stream) for CUDA. CUDA entry points take
 * device pointers, enqueue work on `stream` and never synchronize the host (so they can be captured
 * in a CUDA graph); they return SPECTER_ERR_NO_CUDA in a CPU-only build. Argument errors are found
 * on the host before anything is enqueued; a kernel launch failure gives SPECTER_ERR_CUDA.
 *
 * Weights are in GGUF block layout exactly as stored in the file: a matrix W [n, k] is n rows of
 * k elements each, row r at byte offset r * row_size(type, k). k must be a multiple of the type's
 * block (SPECTER_ERR_BAD_SHAPE otherwise). Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q2_K..Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS.
 * All accumulation is float32.
 */
#ifndef SPECTER_KERNELS_H
#define SPECTER_KERNELS_H

#include "specter.h"

#ifdef __cplusplus
extern "C" {
#endif

/* SPECTER_CDEF_BEGIN */

/* Algorithm choice of specter_cuda_qmatmul (the CPU has one algorithm and ignores it). */
enum specter_qmatmul_algo {
    SPECTER_ALGO_AUTO  = 0, /* GEMV for m <= 32, the tiled f16 tensor-core kernel above           */
    SPECTER_ALGO_GEMV  = 1, /* weights dequantized in registers, fp32 FMA, 8 rows of X per pass    */
    SPECTER_ALGO_TILED = 2  /* W tile dequantized to f16 in shared memory, X rounded to f16, mma  */
};

/* ---- row dequantization on the GPU -------------------------------------------------------- */

/* Same contract as specter_dequantize_rows(_f16) (bit-exact with ggml), device pointers. */
SPECTER_API int specter_cuda_dequantize_rows(int type, const void * src, float * dst,
                                             int64_t n_rows, int64_t row_len, void * stream);
SPECTER_API int specter_cuda_dequantize_rows_f16(int type, const void * src, uint16_t * dst,
                                                 int64_t n_rows, int64_t row_len, void * stream);

/* Gather and dequantize rows: dst[i, :] = row ids[i] of the [n_rows, row_len] matrix src
 * (embedding lookup). An id outside [0, n_rows) gives a row of NaN. */
SPECTER_API int specter_get_rows(int type, const void * src, int64_t n_rows, int64_t row_len,
                                 const int32_t * ids, int64_t n_ids, float * dst, int n_threads);
SPECTER_API int specter_cuda_get_rows(int type, const void * src, int64_t n_rows, int64_t row_len,
                                      const int32_t * ids, int64_t n_ids, float * dst, void * stream);

/* ---- Y[m, n] = X[m, k] . W[n, k]^T ------------------------------------------------------- */

/* x: m rows of k elements, x_type SPECTER_TYPE_F32 or SPECTER_TYPE_F16, contiguous. y: float32,
 * m rows of n, contiguous. m >= 1 (any m; m <= 64 is the intended range). `algo` is a
 * specter_qmatmul_algo (CUDA only). With the GEMV algorithm each row of y depends only on the
 * same row of x (bitwise the same result whatever m is). */
SPECTER_API int specter_qmatmul(int w_type, const void * w, int64_t n, int64_t k,
                                int x_type, const void * x, int64_t m, float * y,
                                int algo, int n_threads);
SPECTER_API int specter_cuda_qmatmul(int w_type, const void * w, int64_t n, int64_t k,
                                     int x_type, const void * x, int64_t m, float * y,
                                     int algo, void * stream);

/* Y[m, n] = silu(X . G^T) * (X . U^T), the SwiGLU of a feed-forward in one pass over the weights: w is [2n, k],
 * the gate's n rows followed by the up projection's n rows (stacked once at load). Otherwise as specter_qmatmul
 * with the GEMV algorithm (any m; each row of y depends only on the same row of x). */
SPECTER_API int specter_qmatmul_swiglu(int w_type, const void * w, int64_t n, int64_t k,
                                       int x_type, const void * x, int64_t m, float * y, int n_threads);
SPECTER_API int specter_cuda_qmatmul_swiglu(int w_type, const void * w, int64_t n, int64_t k,
                                            int x_type, const void * x, int64_t m, float * y, void * stream);

/* ---- RMS norm, optionally of a residual sum ---------------------------------------------------- */

/* For each of n_rows rows of n float32 values (contiguous): s = x + d, where d = delta + shared * sigmoid(gate[r *
 * gate_stride]) for row r (a MoE layer's routed sum plus its shared expert behind the gate's logit, qwen2moe), d =
 * delta + shared with gate NULL (an ungated shared expert), d = delta with shared NULL, and s = x with delta NULL
 * (shared must be NULL then, gate NULL when shared is). s is written to `sum` unless it is NULL; y = s /
 * sqrt(mean(s^2) + eps) * weight [n] (+ bias [n], NULL: none). The residual add and the norm of a transformer block
 * in one pass. y may alias x, delta or shared; sum may too. */
SPECTER_API int specter_rms_norm(const float * x, const float * delta, const float * shared, const float * gate,
                                 int64_t gate_stride, const float * weight, const float * bias, int64_t n_rows,
                                 int64_t n, float eps, float * sum, float * y, int n_threads);
SPECTER_API int specter_cuda_rms_norm(const float * x, const float * delta, const float * shared,
                                      const float * gate, int64_t gate_stride, const float * weight,
                                      const float * bias, int64_t n_rows, int64_t n, float eps, float * sum,
                                      float * y, void * stream);

/* ---- MoE routing: softmax over the experts, top-k ------------------------------------------ */

/* For each of the n_tokens rows of `logits` (row t at logits + t * row_stride, n_expert float32 values): the
 * top_k experts by logit in descending order (ties: lower index first) -> ids [n_tokens, top_k]; their softmax
 * probabilities over all n_expert -> weights [n_tokens, top_k], divided by their sum (at least
 * 6.103515625e-5, as llama.cpp) when `normalize`, then multiplied by `scale` unless it is 0 or 1.
 * 1 <= top_k <= n_expert. NaN logits are never chosen: a slot left without a candidate gets id -1, weight 0. */
SPECTER_API int specter_moe_topk(const float * logits, int64_t n_tokens, int64_t n_expert, int64_t row_stride,
                                 int64_t top_k, int normalize, float scale, int32_t * ids, float * weights,
                                 int n_threads);
SPECTER_API int specter_cuda_moe_topk(const float * logits, int64_t n_tokens, int64_t n_expert,
                                      int64_t row_stride, int64_t top_k, int normalize, float scale,
                                      int32_t * ids, float * weights, void * stream);

/* The router's product and its top-k in one call: logits = x . w^T ([n_tokens, n_rows] float32, w [n_rows, k] of
 * ggml type w_type, x [n_tokens, k] float32), then specter_moe_topk over the first n_expert (<= n_rows) columns of
 * each row of logits (rows past n_expert, e.g. a shared expert's gate stacked under the router, are products only).
 * The logits are those of specter_qmatmul (CUDA: bitwise). CUDA: up to 8 tokens in one launch, whose last CTA to
 * finish takes the top-k; `done` is a uint32 in device memory, 0 before the first call, that the call leaves at 0
 * (calls that share one must not run at the same time); more tokens take two launches. The CPU build does not use
 * `done` (it may be NULL). */
SPECTER_API int specter_moe_route(int w_type, const void * w, int64_t n_rows, int64_t k, const float * x,
                                  int64_t n_tokens, int64_t n_expert, int64_t top_k, int normalize, float scale,
                                  float * logits, int32_t * ids, float * weights, uint32_t * done, int n_threads);
SPECTER_API int specter_cuda_moe_route(int w_type, const void * w, int64_t n_rows, int64_t k, const float * x,
                                       int64_t n_tokens, int64_t n_expert, int64_t top_k, int normalize, float scale,
                                       float * logits, int32_t * ids, float * weights, uint32_t * done,
                                       void * stream);

/* ---- attention inputs: biases, RoPE, the KV cache ------------------------------------------ */

/* For n_tokens tokens: q [T, n_head * head_dim], k and v [T, n_head_kv * head_dim], float32, token t's row at
 * q + t * q_stride (k_stride, v_stride); biases q_bias [n_head * head_dim], k_bias, v_bias (NULL: none) are added
 * first. Then each head of q is RMS-normalized when q_norm [head_dim] is not NULL: h / sqrt(mean(h^2) + norm_eps)
 * * q_norm (Qwen3's per-head norms; k_norm likewise for k; the CPU sums the squares in double, as specter_rms_norm).
 * The first rope_dim features (even, <= head_dim) of every head of q and k are rotated by the angles of
 * the token's position p = pos[t]: pairs (i, i + rope_dim/2) when `neox`, else (2i, 2i+1), pair i by angle i
 * with cos[p * rope_dim/2 + i] and sin[...] (float32 tables of n_pos positions); the other features pass
 * through. Writes q to q_out [n_head, T, head_dim] and k, v to row p of k_cache and v_cache
 * [n_head_kv, capacity, head_dim]; q_out and the caches are of out_type, SPECTER_TYPE_F32 or SPECTER_TYPE_F16
 * (rounded to nearest). pos: int64 [T]. A position outside [0, min(n_pos, capacity)) is
 * SPECTER_ERR_INVALID_ARG on the CPU; on CUDA (pos in device memory, unread by the host) nothing of that
 * token is written. */
SPECTER_API int specter_rope_kv(const float * q, int64_t q_stride, const float * k, int64_t k_stride,
                                const float * v, int64_t v_stride, const float * q_bias, const float * k_bias,
                                const float * v_bias, const float * q_norm, const float * k_norm, float norm_eps,
                                int64_t n_tokens, int64_t n_head, int64_t n_head_kv,
                                int64_t head_dim, int64_t rope_dim, int neox, const float * cos,
                                const float * sin, int64_t n_pos, const int64_t * pos, int out_type,
                                void * q_out, void * k_cache, void * v_cache, int64_t capacity, int n_threads);
SPECTER_API int specter_cuda_rope_kv(const float * q, int64_t q_stride, const float * k, int64_t k_stride,
                                     const float * v, int64_t v_stride, const float * q_bias,
                                     const float * k_bias, const float * v_bias, const float * q_norm,
                                     const float * k_norm, float norm_eps, int64_t n_tokens,
                                     int64_t n_head, int64_t n_head_kv, int64_t head_dim, int64_t rope_dim,
                                     int neox, const float * cos, const float * sin, int64_t n_pos,
                                     const int64_t * pos, int out_type, void * q_out, void * k_cache,
                                     void * v_cache, int64_t capacity, void * stream);

/* ---- attention of a few queries over the KV cache (decode, draft and verification steps) ---------------- */

enum specter_decode_attention_limits {
    SPECTER_DECODE_ATTN_MAX_TOKENS   = 16, /* n_tokens of one call, at most                     */
    SPECTER_DECODE_ATTN_MAX_HEAD_DIM = 256 /* head_dim: a multiple of 32 from 32 up to this      */
};

/* out[h, t] = sum_j softmax_j(scale * q[h, t] . k[g, j]) v[g, j] over the keys j <= pos[t] of the first n_keys
 * positions of the cache, g = h / (n_head / n_head_kv) (grouped-query attention); float32 arithmetic.
 * q and out [n_head, n_tokens, head_dim] contiguous, k_cache and v_cache [n_head_kv, capacity, head_dim] (the
 * KV cache storage that specter_rope_kv writes; positions 0 .. n_keys-1 are read, n_keys <= capacity), all of
 * kv_type, SPECTER_TYPE_F32 or SPECTER_TYPE_F16 (out rounded to nearest); out must not overlap q. pos: int64
 * [n_tokens], the tokens' positions: query t sees key j iff j <= pos[t] (a single query seeing the whole window
 * has pos = n_keys - 1). 0 <= n_tokens <= SPECTER_DECODE_ATTN_MAX_TOKENS (0: nothing to do); head_dim a multiple
 * of 32 in [32, SPECTER_DECODE_ATTN_MAX_HEAD_DIM] (SPECTER_ERR_BAD_SHAPE otherwise); n_head a multiple of
 * n_head_kv. A position outside [0, n_keys) is SPECTER_ERR_INVALID_ARG on the CPU; on CUDA (pos in device
 * memory, unread by the host) it is clamped into [0, n_keys - 1]: past the window a token sees every key (what
 * the mask would say), below 0 it sees key 0 alone. Keys after a token's position never enter its result (cache
 * rows not written yet may hold anything, NaN included).
 * CUDA (flash-decoding): the keys are cut into splits of a length that depends on n_keys only; one kernel, one
 * CTA per (query head, split), leaves every token's partial maximum, exponential sum and weighted values in the
 * workspace, a second one per (head, token) combines the splits in ascending order. CPU: one softmax per (head,
 * token), threads over the heads. Deterministic: the same inputs give bitwise the same out, and each token's
 * result does not depend on the other tokens of the call. The workspace (any alignment >= 256 bytes; device
 * memory for CUDA) must hold specter_decode_attention_workspace_size bytes on both (the CPU uses none of it). */
SPECTER_API int specter_decode_attention_workspace_size(int64_t n_tokens, int64_t n_head, int64_t head_dim,
                                                        int64_t n_keys, size_t * out_bytes);
SPECTER_API int specter_decode_attention(int kv_type, const void * q, const void * k_cache, const void * v_cache,
                                         int64_t n_tokens, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                                         int64_t n_keys, int64_t capacity, const int64_t * pos, float scale,
                                         void * workspace, size_t workspace_bytes, void * out, int n_threads);
SPECTER_API int specter_cuda_decode_attention(int kv_type, const void * q, const void * k_cache,
                                              const void * v_cache, int64_t n_tokens, int64_t n_head,
                                              int64_t n_head_kv, int64_t head_dim, int64_t n_keys,
                                              int64_t capacity, const int64_t * pos, float scale, void * workspace,
                                              size_t workspace_bytes, void * out, void * stream);

/* ---- grouped MoE feed-forward ------------------------------------------------------------ */

/* out[t] (+)= sum_j weights[t, j] * down_e( silu(gate_e x[t]) * up_e x[t] ),  e = ids[t, j]
 *
 * x [n_tokens, d_model] f32; ids [n_tokens, top_k] int32; weights [n_tokens, top_k] f32;
 * out [n_tokens, d_model] f32 (overwritten, or added to when `accumulate` is non-zero).
 * Experts are given by pointer tables: gate_ptrs/up_ptrs/down_ptrs are arrays of n_expert uint64
 * addresses (device memory for CUDA, host memory for the CPU); address e points at expert e's
 * matrix in its GGUF type: gate and up [d_ff, d_model], down [d_model, d_ff]. Expert storage is
 * thus free: contiguous (base + e * stride), cache slots anywhere, a quantized copy ...
 * A slot whose id is outside [0, n_expert), or whose expert has a zero address in any of the
 * three tables, contributes nothing (lets a caller run only the experts that are resident).
 * Deterministic: the same inputs give bitwise the same out, and each token's result does not
 * depend on the other tokens of the batch. The workspace (any alignment >= 256 bytes) must hold
 * specter_moe_workspace_size bytes; it is scratch (device memory for CUDA). */
SPECTER_API int specter_moe_workspace_size(int64_t n_tokens, int64_t top_k, int64_t n_expert,
                                           int64_t d_model, int64_t d_ff, size_t * out_bytes);
SPECTER_API int specter_moe_ffn(const float * x, int64_t n_tokens, int64_t d_model,
                                const int32_t * ids, const float * weights, int64_t top_k,
                                int64_t n_expert, int64_t d_ff,
                                const uint64_t * gate_ptrs, int gate_type,
                                const uint64_t * up_ptrs, int up_type,
                                const uint64_t * down_ptrs, int down_type,
                                void * workspace, size_t workspace_bytes,
                                float * out, int accumulate, int n_threads);
SPECTER_API int specter_cuda_moe_ffn(const float * x, int64_t n_tokens, int64_t d_model,
                                     const int32_t * ids, const float * weights, int64_t top_k,
                                     int64_t n_expert, int64_t d_ff,
                                     const uint64_t * gate_ptrs, int gate_type,
                                     const uint64_t * up_ptrs, int up_type,
                                     const uint64_t * down_ptrs, int down_type,
                                     void * workspace, size_t workspace_bytes,
                                     float * out, int accumulate, void * stream);

/* ---- a MoE layer's pointer table from the residency table ------------------------------------------------ */

/* Where an offloaded model's expert slots lie on the device: the pool starts at `base`, each slot is `slot_bytes`
 * long and holds one expert's record, whose gate, up and down parts start `part_offset[0|1|2]` bytes into it and
 * are `part_bytes[0|1|2]` long. */
typedef struct specter_slot_pool {
    int64_t base;
    int64_t slot_bytes;
    int64_t part_offset[3];
    int64_t part_bytes[3];
} specter_slot_pool;

enum specter_spare_limits {
    SPECTER_MAX_SPARES = 8 /* n_spare of one call, at most */
};

/* Free slots a MoE layer's table call copies missed experts into (device memory on CUDA): `slots[j]` (int64
 * [n_spare]) is a free slot of the pool, or -1 (none: used, not yet replaced by the host); `fetched` (int32
 * [n_expert]) receives slot + 1 for each expert copied; `arrivals` (uint32, one) is 0 between calls (the CUDA
 * kernel's CTAs count themselves on it and the last one sets it back). */
typedef struct specter_spare_slots {
    int64_t * slots;
    int64_t n_spare;
    int32_t * fetched;
    uint32_t * arrivals;
} specter_spare_slots;

/* One MoE layer's pointer tables for specter_moe_ffn and its routing counted, in one call (one kernel on CUDA): for
 * each expert e < n_expert, ptrs[part * n_expert + e] (int64 [3, n_expert]) = 0 where skip[e] != 0 (uint8
 * [n_expert], may be NULL: an expert the CPU computes, which the kernel then skips), else pool->base + slot_of[e] *
 * pool->slot_bytes + pool->part_offset[part] where slot_of[e] >= 0 (int64 [n_expert]: the expert's slot; -1: none;
 * below -1: none yet, a copy into slot -2 - slot_of[e] is on its way), else host_ptrs[part * n_expert + e] (the
 * record's parts in host memory, read in place by the kernel); and, where `routed` is given (NULL: not counted),
 * routed[e] += how many of the n_pairs ids (int32) are e (ids outside [0, n_expert) are not counted).
 * With `spares` (NULL: none), first the missed experts (routed by `ids`, slot_of[e] == -1, not skipped), in
 * ascending order, are copied from host memory into the spare slots whose slots[j] >= 0, in ascending j, as many as
 * there are: each such expert gets slot_of[e] = its slot, fetched[e] = slot + 1 and slots[j] = -1, and its pointers
 * are its slot's. The copies cross PCIe once (a miss read in place is read again in every forward until the host
 * copies it in).
 * Device memory for CUDA, except `pool` and `spares`: host memory, read by the call (a CUDA graph keeps the
 * values it was captured with). */
SPECTER_API int specter_expert_table(int64_t * slot_of, const int64_t * host_ptrs, const specter_slot_pool * pool,
                                     int64_t n_expert, const int32_t * ids, int64_t n_pairs, const uint8_t * skip,
                                     const specter_spare_slots * spares, int32_t * routed, int64_t * ptrs,
                                     int n_threads);
SPECTER_API int specter_cuda_expert_table(int64_t * slot_of, const int64_t * host_ptrs, const specter_slot_pool * pool,
                                          int64_t n_expert, const int32_t * ids, int64_t n_pairs,
                                          const uint8_t * skip, const specter_spare_slots * spares, int32_t * routed,
                                          int64_t * ptrs, void * stream);

/* ---- the sampling chain (speculative sampling on the device) ------------------------------------------------ */

enum specter_sample_chain_limits {
    SPECTER_SAMPLE_MAX_CANDIDATES = 256,   /* n_candidates (top_k) of one call, at most */
    SPECTER_SAMPLE_MAX_VOCAB      = 262144 /* n_vocab, at most                          */
};

/* llama.cpp's sampling chain top_k -> top_p -> min_p -> temperature -> softmax (no penalties) for each of the n_rows
 * rows of `logits` (row r at logits + r * row_stride, n_vocab float32 values), over its top C = n_candidates
 * candidates only, in float64:
 *   1. the candidates: the C largest logits, ranked by (logit desc, id asc): ties at the top_k boundary and among
 *      the candidates go to the lower id (-0.0 ties with +0.0); v_0 >= v_1 >= ... their logits in that order;
 *   2. e_i = exp(v_i - v_0), z = e_0 + e_1 + ... (in order), c_i = e_0 / z + ... + e_i / z (in order);
 *      top_p keeps n_p = #{i : c_i < top_p} + 1, min_p keeps n_m = max(1, #{i : v_i >= v_0 + log_min_p});
 *   3. the first m = min(C, n_p, n_m) candidates get f_i = exp((v_i - v_0) / temperature), the others 0;
 *      p_i = f_i / (f_0 + ... + f_{m-1}) (in order).
 * knobs = double[3]: temperature (> 0), top_p (2.0: off), log(min_p) (-inf: off); read by the kernels (device
 * memory for CUDA, so that one captured call serves every setting), not checked. Writes ids [n_rows, C] (int64,
 * ascending) and probs [n_rows, C] (float64, p of each id; 0 for the candidates the filters dropped). When
 * `uniforms` (double [n_rows] in [0, 1)) is not NULL, also draws tokens [n_rows] (int64): with the cumulative sums
 * s_j = probs[r, 0] + ... + probs[r, j] (ascending ids, in order), the first id whose s_j > uniforms[r] * s_{C-1},
 * or the last id of positive probability when rounding puts no s_j past it.
 * 1 <= n_candidates <= min(n_vocab, SPECTER_SAMPLE_MAX_CANDIDATES), n_vocab <= SPECTER_SAMPLE_MAX_VOCAB,
 * row_stride >= n_vocab, 0 <= n_rows <= 65535 (0: nothing to do). NaN logits never make a call read or write out
 * of bounds; its results are then unspecified (callers check finiteness separately). Deterministic; the CPU and
 * CUDA take the same candidates, run the same float64 operations in the same order (exp may differ by an ulp) and
 * draw the same tokens.
 * CUDA: two kernels. The first, one CTA per (chunk of 4096 logits, row), leaves each chunk's top C (ranked as
 * above) in the workspace; the second, one CTA per row, takes the top C of those, runs the chain and draws. The
 * CPU ranks each row in one pass. The workspace (any alignment >= 256 bytes; device memory for CUDA) must hold
 * specter_sample_chain_workspace_size bytes on both (the CPU uses none of it). */
SPECTER_API int specter_sample_chain_workspace_size(int64_t n_rows, int64_t n_vocab, int64_t n_candidates,
                                                    size_t * out_bytes);
SPECTER_API int specter_sample_chain(const float * logits, int64_t n_rows, int64_t n_vocab, int64_t row_stride,
                                     int64_t n_candidates, const double * knobs, const double * uniforms,
                                     int64_t * ids, double * probs, int64_t * tokens, void * workspace,
                                     size_t workspace_bytes, int n_threads);
SPECTER_API int specter_cuda_sample_chain(const float * logits, int64_t n_rows, int64_t n_vocab, int64_t row_stride,
                                          int64_t n_candidates, const double * knobs, const double * uniforms,
                                          int64_t * ids, double * probs, int64_t * tokens, void * workspace,
                                          size_t workspace_bytes, void * stream);

/* ---- ordering: work that waits for a counter ------------------------------------------------ */

/* Work enqueued after this call runs once *counter >= *base + offset (int64 values; on CUDA in device memory,
 * the counter raised by other work - e.g. a fill after copies on another stream - and the base written before
 * this wait runs). Lets a captured CUDA graph wait for copies issued after its capture, wherever it reaches the
 * wait: one graph, the values of each replay. The nanoseconds spent waiting are added to *waited_ns (NULL: not
 * counted). CUDA: one thread polls the counter; past timeout_ns (> 0) it traps, a CUDA error at the caller's
 * next synchronisation (the counter was never raised: a bug), rather than hang the device. CPU: nothing runs
 * meanwhile, so the condition must already hold: SPECTER_ERR_NOT_READY otherwise. */
SPECTER_API int specter_wait_counter(const int64_t * counter, const int64_t * base, int64_t offset,
                                     int64_t timeout_ns, int64_t * waited_ns, int n_threads);
SPECTER_API int specter_cuda_wait_counter(const int64_t * counter, const int64_t * base, int64_t offset,
                                          int64_t timeout_ns, int64_t * waited_ns, void * stream);

/* ---- a slower PCIe link, for benchmarks ------------------------------------------------------------------- */

/* Work enqueued after this call on `stream` starts ((n_bytes ? *n_bytes : 0) + extra_bytes) * ns_per_byte
 * nanoseconds after it would have (n_bytes: int64 in device memory, read when the wait runs): a benchmark that
 * stands for a slower PCIe link than the machine's puts it after each transfer of expert bytes (scripts/bench.py
 * --pcie-gbps). One thread polls the GPU's timer. CUDA only. */
SPECTER_API int specter_cuda_pace(const int64_t * n_bytes, int64_t extra_bytes, double ns_per_byte, void * stream);

/* ---- CPU experts beside a GPU forward -------------------------------------------------------------------- */

/* A worker thread on the host that computes the routed experts a forward hands it, one MoE layer at a time, and
 * gives back their weighted sum, without a host synchronisation or a host node: it works inside a CUDA graph.
 * A MoE layer's hand-off is two calls, each one kernel on CUDA. specter_cuda_cpu_experts_post chooses which of the
 * layer's missed experts the CPU computes (the split below; specter_expert_table's `skip` then takes them out of
 * the GPU's pointer table and of its copies into spare slots), and writes the layer's hidden states, its routing
 * (the pairs of those experts; the others -1) and a sequence number into a mailbox in pinned host memory; the worker, polling the mailbox, runs specter_moe_ffn over the experts' host
 * copies into the mailbox and answers with the same number; specter_cuda_cpu_experts_collect waits for the answer
 * (one thread a CTA polls; past timeout_ns it traps, a CUDA error at the caller's next synchronisation) and adds
 * the sum into the rows of the layer's output whose tokens have a pair on the CPU. Work enqueued between the two
 * (the GPU's own experts) runs meanwhile. A post that gives the CPU no pair hands nothing over, and its collect
 * reads only device memory and adds nothing. The CPU entry points do the same from the calling thread (host
 * memory).
 *
 * Layout: the mailbox holds specter_cpu_experts_mailbox_size bytes (pinned and mapped for CUDA: under unified
 * addressing any cudaHostAlloc'd memory is), owned by the caller and kept alive until specter_cpu_experts_free.
 * Posts and collects alternate, in stream order (CUDA) or from one thread (CPU); set every layer before the first
 * post. The experts are those of specter_moe_ffn: per-layer tables of n_expert host addresses and their types.
 * The worker's sums equal specter_moe_ffn's over the same pairs bitwise (it is that function, n_threads threads).
 * A worker error (a type it cannot run) is kept: the answer is then zeros and specter_cpu_experts_status returns
 * the error until the handle is freed. */
typedef struct specter_cpu_experts specter_cpu_experts;

/* The costs (ns) by which a post splits a layer's missed experts between the CPU and the link: an expert of t
 * tokens takes the CPU cpu_ns_per_expert + t * cpu_ns_per_token, one expert read over the link link_ns (>= 1).
 * {0, 0, 1} gives the CPU every miss. */
typedef struct specter_hybrid_costs {
    int64_t cpu_ns_per_expert;
    int64_t cpu_ns_per_token;
    int64_t link_ns;
} specter_hybrid_costs;

SPECTER_API int specter_cpu_experts_mailbox_size(int64_t max_tokens, int64_t top_k, int64_t d_model,
                                                 size_t * out_bytes);
SPECTER_API int specter_cpu_experts_new(int64_t n_layer, int64_t n_expert, int64_t d_model, int64_t d_ff,
                                        int64_t top_k, int64_t max_tokens, void * mailbox, size_t mailbox_bytes,
                                        int n_threads, int64_t hot_ns, specter_cpu_experts ** out);
SPECTER_API int specter_cpu_experts_set_layer(specter_cpu_experts * w, int64_t layer,
                                              const uint64_t * gate_ptrs, int gate_type,
                                              const uint64_t * up_ptrs, int up_type,
                                              const uint64_t * down_ptrs, int down_type);
/* Stops the worker (after the answer it is computing) and frees the handle; the mailbox stays the caller's. */
SPECTER_API int specter_cpu_experts_free(specter_cpu_experts * w);
/* SPECTER_OK, or the first error the worker met. */
SPECTER_API int specter_cpu_experts_status(const specter_cpu_experts * w);
/* *out_ns = the time the worker has spent computing answers since it started (a utilisation figure). */
SPECTER_API int specter_cpu_experts_busy_ns(const specter_cpu_experts * w, int64_t * out_ns);
/* Keep the worker polling without pause for the next hot_ns (specter_cpu_experts_new's; call before enqueueing
 * forwards that post; a post, and an answer, keep it so as long again). A worker that is not hot sleeps: it looks
 * every 100 us for a second, then every 10 ms (a forward should arm it, not rely on that); `arm` and a CPU post
 * wake it. hot_ns = 0 for a forward on the CPU itself, whose products need every core. */
SPECTER_API int specter_cpu_experts_arm(specter_cpu_experts * w);
/* Hand the CPU a MoE layer's pairs (ids [n_tokens, top_k] int32, weights f32, x [n_tokens, d_model] f32;
 * 1 <= n_tokens <= max_tokens) whose experts it computes: of the experts the layer routes tokens to
 * (routed[e] > 0, int32 [n_expert]) that have no slot on the device (slot_of[e] < 0, int64), the ones with the
 * fewest tokens, as many as make the later of the CPU's finish and the link's the earliest by `costs` (the two
 * work at the same time); ties rank by expert id, and the CPU and CUDA versions choose alike (integer costs).
 * Writes on_cpu[e] = 1 for those, else 0 (uint8 [n_expert]), cpu_routed[e] = routed[e] for those, else 0.
 * With `spares` (NULL: none; the layer's spare slots, as specter_expert_table takes them), the misses those
 * spares will take (the routed experts with slot_of[e] == -1 in ascending order, one for each usable spare) are
 * the link's before the split, which weighs only the rest: a spare caches a miss at once, and the host keeps
 * spares only where routing repeats from forward to forward.
 * n_expert <= 1024. Device memory for CUDA, except `costs` and `spares`: host memory, read by the call (a CUDA
 * graph keeps the values it was captured with). */
SPECTER_API int specter_cpu_experts_post(specter_cpu_experts * w, int64_t layer, const float * x, const int32_t * ids,
                                         const float * weights, int64_t n_tokens, const int64_t * slot_of,
                                         const int32_t * routed, const specter_hybrid_costs * costs,
                                         const specter_spare_slots * spares, uint8_t * on_cpu, int32_t * cpu_routed,
                                         int n_threads);
SPECTER_API int specter_cuda_cpu_experts_post(specter_cpu_experts * w, int64_t layer, const float * x,
                                              const int32_t * ids, const float * weights, int64_t n_tokens,
                                              const int64_t * slot_of, const int32_t * routed,
                                              const specter_hybrid_costs * costs,
                                              const specter_spare_slots * spares, uint8_t * on_cpu,
                                              int32_t * cpu_routed, void * stream);
/* out [n_tokens, d_model] f32 += the worker's answer to the last post, once it has come, in the rows of the tokens
 * with a pair on the CPU (ids and on_cpu: the post's, on_cpu as it wrote it). Where waited_ns is not NULL (int64,
 * device memory for CUDA), the nanoseconds spent waiting for the answer are added to it (on CUDA those of the first
 * CTA, which waits whenever any does). CPU: waits up to timeout_ns (SPECTER_ERR_TIMEOUT past it) and returns the
 * worker's error if it met one. */
SPECTER_API int specter_cpu_experts_collect(specter_cpu_experts * w, float * out, const int32_t * ids,
                                            const uint8_t * on_cpu, int64_t n_tokens, int64_t timeout_ns,
                                            int64_t * waited_ns, int n_threads);
SPECTER_API int specter_cuda_cpu_experts_collect(specter_cpu_experts * w, float * out, const int32_t * ids,
                                                 const uint8_t * on_cpu, int64_t n_tokens, int64_t timeout_ns,
                                                 int64_t * waited_ns, void * stream);

/* SPECTER_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* SPECTER_KERNELS_H */
