// CUDA entry points of libspecter (compiled only when SPECTER_CUDA is ON). Kernels live next to
// this file; this unit answers what the build and the machine offer.
#include <cuda_runtime.h>

#include "specter.h"

extern "C" {

int specter_has_cuda(void) { return 1; }

int specter_cuda_device_count(int * out_count) {
    if (!out_count) return SPECTER_ERR_INVALID_ARG;
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
        cudaGetLastError();  // clear the (non-sticky) error so later calls start clean
        *out_count = 0;
        return SPECTER_OK;
    }
    if (err != cudaSuccess) {
        cudaGetLastError();
        return SPECTER_ERR_CUDA;
    }
    *out_count = n;
    return SPECTER_OK;
}

}  // extern "C"
