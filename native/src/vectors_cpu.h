// Whether the CPU kernels use vector instructions (internal header of libspecter).
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC 12's AVX-512 headers warn of their own deliberately undefined vectors (`__Y = __Y`, GCC bug 105593)
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#define SPECTER_X86_VECTORS 1
#endif

namespace specter {

// Whether the CPU has AVX2 and F16C, chosen once; the environment variable SPECTER_CPU_VECTORS=none turns the
// vector code off (the tests compare the paths' bits).
bool cpu_avx2();

// Whether the CPU has AVX-512F too, chosen once (SPECTER_CPU_VECTORS=avx2 leaves it out). Only the 4-bit types'
// row dots and decoders use it: their weights come from a 16-value table, one permute a 16-lane step (on an AVX-512
// development machine a Q4_K product with one or two rows of x took a half to two fifths of AVX2's time, 2026-12-07);
// plain widening of the other loops was no faster there (2026-12-01).
bool cpu_avx512();

}  // namespace specter
