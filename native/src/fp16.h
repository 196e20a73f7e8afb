// IEEE half <-> float conversions, written out in integer arithmetic so that results do not depend
// on the compiler or the CPU (no F16C needed). Internal header of libspecter.
#pragma once

#include <cstdint>
#include <cstring>

namespace specter {

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// Exact: every half value is representable as a float. Written with selects instead of branches
// so that loops over it vectorize; no float denormal is ever an input (safe under FTZ/DAZ).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
    const uint32_t infnan = 0x7f800000u | (mant << 13);
    const uint32_t subnormal = float_to_bits(float(int32_t(mant)) * 5.9604644775390625e-8f);  // mant * 2^-24
    const uint32_t mag = exp == 0 ? subnormal : (exp == 0x1f ? infnan : normal);
    return bits_to_float(sign | mag);
}

// Round to nearest, ties to even (what numpy's astype(float16) and CUDA's __float2half_rn do).
inline uint16_t float_to_half(float f) {
    const uint32_t x = float_to_bits(f);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // nan stays nan
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 (and inf) -> inf
    if (ax >= 0x38800000u) {  // normal half range
        const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
        return uint16_t(sign | ((r - (112u << 23)) >> 13));
    }
    // subnormal half (or zero): value / 2^-24 rounded to nearest even
    const int e = int(ax >> 23);
    if (e < 101) return sign;  // below 2^-26: rounds to zero
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const int s = 126 - e;      // 14 .. 25
    uint32_t q = m >> s;
    const uint32_t rem = m & ((1u << s) - 1u);
    const uint32_t half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal: fine
    return uint16_t(sign | q);
}

inline float load_half(const uint8_t * p) { uint16_t h; std::memcpy(&h, p, 2); return half_to_float(h); }

}  // namespace specter
