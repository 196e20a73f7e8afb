// Which vector instructions the CPU kernels use (internal header of libspecter).
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SPECTER_X86_VECTORS 1
#endif

namespace specter {

enum class Vectors { none, avx2, avx512 };

// The best the CPU has (AVX2 with F16C, or AVX-512F), chosen once; the environment variable
// SPECTER_CPU_VECTORS=avx2|none caps it (the tests run every path).
Vectors cpu_vectors();

}  // namespace specter
