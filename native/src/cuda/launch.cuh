// How libspecter's CUDA kernels are launched (internal header).
//
// A decode step is a chain of a thousand kernels of a few microseconds each, every one waiting for the one before
// it. With programmatic dependent launch (sm_90 and later) a kernel may be launched while the kernel before it on
// the stream still runs: its launch and the start of its CTAs overlap that kernel's tail, where a plain launch
// begins only once the previous kernel has ended. It stays ordered after it: every kernel begins with
// `start_after_prior_kernels`, which returns once the previous kernel has ended and its writes are visible, before
// the kernel reads or writes any memory. Works in CUDA graphs (captured as programmatic edges). SPECTER_CUDA_PDL=0
// in the environment launches every kernel the plain way (to compare).
#pragma once

#include <cuda_runtime.h>

#include "specter.h"

namespace specter {
namespace cuda {

// Returns once the previous kernel on the stream has ended and its writes are visible.
__device__ __forceinline__ void wait_for_prior_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the next kernel on the stream begin launching (it waits for this one in its own first statement).
__device__ __forceinline__ void let_next_kernel_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// First statement of every kernel launched by `launch`: wait for the previous kernel, then let the next one begin
// launching. A kernel that may wait for work on another stream or on the host (wait_counter_kernel, the CPU
// experts' collect) lets it launch only once that wait is over: the next kernel's CTAs, resident and waiting,
// could hold the SMs that work needs.
__device__ __forceinline__ void start_after_prior_kernels() {
    wait_for_prior_kernels();
    let_next_kernel_launch();
}

// The GPU's global timer in nanoseconds (the timeouts of kernels that poll).
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Whether launches overlap the previous kernel: a device of compute capability 9.0 or later, unless
// SPECTER_CUDA_PDL=0 (read once per process; device.cu).
bool overlapped_launches();

// kernel<<<grid, block, 0, stream>>>(args...), overlapping the previous kernel where `overlapped_launches`.
// Errors are left for `launch_status`.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args &&... args) {
    cudaLaunchAttribute overlap{};
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.stream = stream;
    config.attrs = &overlap;
    config.numAttrs = overlapped_launches() ? 1 : 0;
    cudaLaunchKernelEx(&config, kernel, static_cast<Args &&>(args)...);
}

inline int launch_status() {
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? SPECTER_OK : SPECTER_ERR_CUDA;
}

}  // namespace cuda
}  // namespace specter
