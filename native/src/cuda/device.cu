// CUDA entry points of libspecter (compiled only when SPECTER_CUDA is ON). Kernels live next to
// this file; this unit answers what the build and the machine offer.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "launch.cuh"
#include "specter.h"

namespace specter {
namespace cuda {

bool overlapped_launches() {
    static const bool on = [] {
        const char * env = std::getenv("SPECTER_CUDA_PDL");
        if (env && std::strcmp(env, "0") == 0) return false;
        int device = 0, major = 0;
        const bool known = cudaGetDevice(&device) == cudaSuccess &&
                           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess;
        cudaGetLastError();
        return known && major >= 9;
    }();
    return on;
}

}  // namespace cuda
}  // namespace specter

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
