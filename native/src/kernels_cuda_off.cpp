// CUDA entry points of specter_kernels.h in a CPU-only build: all answer SPECTER_ERR_NO_CUDA.
#include "specter_kernels.h"

extern "C" {

int specter_cuda_dequantize_rows(int, const void *, float *, int64_t, int64_t, void *) { return SPECTER_ERR_NO_CUDA; }
int specter_cuda_dequantize_rows_f16(int, const void *, uint16_t *, int64_t, int64_t, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_get_rows(int, const void *, int64_t, int64_t, const int32_t *, int64_t, float *, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_qmatmul(int, const void *, int64_t, int64_t, int, const void *, int64_t, float *, int, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_qmatmul_swiglu(int, const void *, int64_t, int64_t, int, const void *, int64_t, float *, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_rms_norm(const float *, const float *, const float *, const float *, int64_t, const float *,
                          const float *, int64_t, int64_t, float, float *, float *, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_moe_topk(const float *, int64_t, int64_t, int64_t, int64_t, int, float, int32_t *, float *, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_moe_route(int, const void *, int64_t, int64_t, const float *, int64_t, int64_t, int64_t, int, float,
                           float *, int32_t *, float *, uint32_t *, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_rope_kv(const float *, int64_t, const float *, int64_t, const float *, int64_t, const float *,
                         const float *, const float *, const float *, const float *, float, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int, const float *, const float *, int64_t, const int64_t *, int, void *,
                         void *, void *, int64_t, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_decode_attention(int, const void *, const void *, const void *, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, const int64_t *, float, void *, size_t, void *, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_moe_ffn(const float *, int64_t, int64_t, const int32_t *, const float *, int64_t, int64_t, int64_t,
                         const uint64_t *, int, const uint64_t *, int, const uint64_t *, int, void *, size_t, float *,
                         int, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_sample_chain(const float *, int64_t, int64_t, int64_t, int64_t, const double *, const double *,
                              int64_t *, double *, int64_t *, void *, size_t, void *) {
    return SPECTER_ERR_NO_CUDA;
}

int specter_cuda_expert_table(int64_t *, const int64_t *, const specter_slot_pool *, int64_t, const int32_t *, int64_t,
                              const uint8_t *, const specter_spare_slots *, int32_t *, int64_t *, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_wait_counter(const int64_t *, const int64_t *, int64_t, int64_t, int64_t *, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_pace(const int64_t *, int64_t, double, void *) { return SPECTER_ERR_NO_CUDA; }
int specter_cuda_cpu_experts_post(specter_cpu_experts *, int64_t, const float *, const int32_t *, const float *,
                                  int64_t, const int64_t *, const int32_t *, const specter_hybrid_costs *,
                                  const specter_spare_slots *, uint8_t *, int32_t *, void *) {
    return SPECTER_ERR_NO_CUDA;
}
int specter_cuda_cpu_experts_collect(specter_cpu_experts *, float *, const int32_t *, const uint8_t *, int64_t,
                                     int64_t, int64_t *, void *) {
    return SPECTER_ERR_NO_CUDA;
}

}  // extern "C"
