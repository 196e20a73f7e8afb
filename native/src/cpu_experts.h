// The mailbox of specter_cpu_experts (libspecter internal): where a forward hands a MoE layer's CPU experts to the
// host's worker thread and finds their sum. Shared by the CPU entry points (cpu_experts.cpp) and the CUDA kernels
// (cuda/kernels_cpu_experts.cu), which read and write it in place over PCIe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels_common.h"
#include "specter_kernels.h"

namespace specter {

// The mailbox's first 256 bytes. `request` and `answer` are the handshake: the poster writes the payload, then
// `request` = its sequence number; the worker computes, writes `result`, then `answer` = that number. A post that
// hands no pair over writes nothing here: its collect knows it from the routing and adds nothing.
struct MailboxHeader {
    int64_t request;   // sequence number of the last post that handed pairs over
    int64_t answer;    // sequence number of the last post the worker answered
    int64_t issued;    // the poster's count of such posts (read and written by the poster only)
    int64_t layer;     // of the last post
    int64_t n_tokens;  // of the last post
    int32_t error;     // the first error the worker met (SPECTER_OK while none)
};

// Byte offsets of the payload: x [max_tokens, d_model] f32, ids [max_tokens, top_k] int32 (-1: not the CPU's),
// weights [max_tokens, top_k] f32, result [max_tokens, d_model] f32; aligned as workspaces are (kWsAlign).
struct MailboxLayout {
    size_t x, ids, weights, result, total;
};

inline MailboxLayout mailbox_layout(int64_t max_tokens, int64_t top_k, int64_t d_model) {
    MailboxLayout L{};
    L.x = ws_round(sizeof(MailboxHeader));
    L.ids = L.x + ws_round(size_t(max_tokens * d_model) * sizeof(float));
    L.weights = L.ids + ws_round(size_t(max_tokens * top_k) * sizeof(int32_t));
    L.result = L.weights + ws_round(size_t(max_tokens * top_k) * sizeof(float));
    L.total = L.result + ws_round(size_t(max_tokens * d_model) * sizeof(float));
    return L;
}

struct CpuExpertsWorker;  // the thread and the experts' tables (cpu_experts.cpp)

}  // namespace specter

// The handle: what the CUDA entry points read is here, the worker behind a pointer.
struct specter_cpu_experts {
    int64_t n_layer, n_expert, d_model, d_ff, top_k, max_tokens;
    char * mailbox;
    specter::MailboxLayout layout;
    specter::CpuExpertsWorker * worker;
};

namespace specter {

// The arguments of a post and of a collect (both the CPU's and the CUDA entry points).
inline int check_post(const specter_cpu_experts * w, int64_t layer, const float * x, const int32_t * ids,
                      const float * weights, int64_t n_tokens, const int64_t * slot_of, const int32_t * routed,
                      const specter_hybrid_costs * costs, const specter_spare_slots * spares,
                      const uint8_t * on_cpu, const int32_t * cpu_routed) {
    if (!w || !x || !ids || !weights || !slot_of || !routed || !costs || !on_cpu || !cpu_routed)
        return SPECTER_ERR_INVALID_ARG;
    if (spares &&
        (spares->n_spare < 0 || spares->n_spare > SPECTER_MAX_SPARES || (spares->n_spare > 0 && !spares->slots)))
        return SPECTER_ERR_INVALID_ARG;
    if (layer < 0 || layer >= w->n_layer || n_tokens < 1 || n_tokens > w->max_tokens || w->n_expert > 1024)
        return SPECTER_ERR_INVALID_ARG;
    return costs->cpu_ns_per_expert < 0 || costs->cpu_ns_per_token < 0 || costs->link_ns < 1 ? SPECTER_ERR_INVALID_ARG
                                                                                              : SPECTER_OK;
}

inline int check_collect(const specter_cpu_experts * w, const float * out, const int32_t * ids, const uint8_t * on_cpu,
                         int64_t n_tokens) {
    return !w || !out || !ids || !on_cpu || n_tokens < 1 || n_tokens > w->max_tokens ? SPECTER_ERR_INVALID_ARG
                                                                                      : SPECTER_OK;
}

// Whether a token's pairs (ids[0..k), -1: none) include one of an expert on_cpu marks.
SPECTER_HOST_DEVICE inline bool has_cpu_pair(const int32_t * ids, int64_t k, int64_t n_expert,
                                             const uint8_t * on_cpu) {
    for (int64_t j = 0; j < k; ++j)
        if (ids[j] >= 0 && ids[j] < n_expert && on_cpu[ids[j]]) return true;
    return false;
}

// The split's rule (specter_cpu_experts_post) for one missed expert: with the m misses ranked by (tokens, expert)
// ascending, the one of rank r (`tokens` of them; `before`: the tokens of those ranked before it) goes to the CPU
// when the later of the CPU's finish (cpu_ns_per_expert + tokens * cpu_ns_per_token for each it takes) and the
// link's is earlier with it on the CPU than without. The CPU's time grows and the link's shrinks along the ranks,
// so the ones that go form a prefix. In integers: the CPU and CUDA versions decide alike. The post runs before
// specter_expert_table copies misses into spare slots and leaves the spares' misses out of the split. Whether a
// layer has spares, and whether the CPU's experts are brought into the cache afterwards, is the host's choice
// (specter_gguf/runtime/hybrid.py). No future hits are weighed.
SPECTER_HOST_DEVICE inline bool cpu_takes(int64_t r, int64_t before, int64_t tokens, int64_t m,
                                          const specter_hybrid_costs & c) {
    const int64_t cpu_without = r * c.cpu_ns_per_expert + before * c.cpu_ns_per_token;
    const int64_t link_without = (m - r) * c.link_ns;
    const int64_t cpu_with = cpu_without + c.cpu_ns_per_expert + tokens * c.cpu_ns_per_token;
    const int64_t link_with = link_without - c.link_ns;
    return (cpu_with > link_with ? cpu_with : link_with) < (cpu_without > link_without ? cpu_without : link_without);
}

}  // namespace specter
