// Whether the CPU kernels use vector instructions (internal header of libspecter).
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SPECTER_X86_VECTORS 1
#endif

namespace specter {

// Whether the CPU has AVX2 and F16C, chosen once; the environment variable SPECTER_CPU_VECTORS=none turns the
// vector code off (the tests compare both paths' bits). One vector width only: AVX-512 versions of these loops
// were no faster on an AVX-512 development machine (2026-12-01, one thread, Qwen3-sized experts).
bool cpu_avx2();

}  // namespace specter
