// CUDA entry points of a CPU-only build of libspecter (compiled only when SPECTER_CUDA is OFF).
#include "specter.h"

extern "C" {

int specter_has_cuda(void) { return 0; }

int specter_cuda_device_count(int * out_count) {
    if (!out_count) return SPECTER_ERR_INVALID_ARG;
    *out_count = 0;
    return SPECTER_OK;
}

}  // extern "C"
