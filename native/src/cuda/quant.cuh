// Device-side GGUF block decoding shared by libspecter's CUDA kernels (internal header).
//
// A weight row of k elements is cut into blocks of TT::QK elements (TT::BYTES bytes); each block is
// cut into TT::NU "units" of TT::E elements that one thread decodes from a few coalesced loads.
// The E values of a unit are E/G runs of G consecutive elements: run g starts at element
// TT::xoff(u, g) of its block, so X is read as float4 (G = 4) when possible.
// decode<EXACT>: EXACT = true reproduces ggml's float32 dequantization bit for bit (no FMA
// contraction: __fmul_rn/__fsub_rn); EXACT = false (GEMV/GEMM paths) spends two operations per value
// (quants_f4 below): the same weights for types without an offset m, within ~2^-24 of d * 128 with one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "iq_grids.h"
#include "specter.h"

namespace specter {
namespace cuda {

__device__ __forceinline__ float ldh(const uint8_t * p) { return __half2float(*reinterpret_cast<const __half *>(p)); }
__device__ __forceinline__ uint32_t ld32(const uint8_t * p) { return *reinterpret_cast<const uint32_t *>(p); }
// 4 bytes at a 2-byte aligned address
__device__ __forceinline__ uint32_t ld32a2(const uint8_t * p) {
    const uint16_t * h = reinterpret_cast<const uint16_t *>(p);
    return uint32_t(h[0]) | (uint32_t(h[1]) << 16);
}

// Quants to weights w = d * (q - bias) - m, in two steps: quants_f4 turns four quants (the bytes of a word)
// into floats v, an Affine (a, b) per group of quants sharing d and m turns each into a * v - b.
//   EXACT: v = q - bias (0x4B0000qq is the float 2^23 + q), w = d * v - m rounded as ggml rounds it.
//   fast:  v = 2 + q / 64 from one byte permute (0x40qq0000, q < 128), w = 64 d * v - (d (128 + bias) + m) in
//          one FMA: a value costs two operations instead of three. Without m (d (128 + bias) exact: d is an f16,
//          128 + bias a small integer) this is d * (q - bias) rounded once, as in EXACT; with m, b is rounded
//          once more (relative error ~2^-24 of d * 128).
template <bool EXACT>
__device__ __forceinline__ void quants_f4(uint32_t w, float bias, float * o) {
    if (EXACT) {
        const float off = 8388608.0f + bias;
        o[0] = __int_as_float(__byte_perm(w, 0x4B000000u, 0x7440)) - off;
        o[1] = __int_as_float(__byte_perm(w, 0x4B000000u, 0x7441)) - off;
        o[2] = __int_as_float(__byte_perm(w, 0x4B000000u, 0x7442)) - off;
        o[3] = __int_as_float(__byte_perm(w, 0x4B000000u, 0x7443)) - off;
    } else {
        o[0] = __int_as_float(__byte_perm(w, 0x40000000u, 0x7044));
        o[1] = __int_as_float(__byte_perm(w, 0x40000000u, 0x7144));
        o[2] = __int_as_float(__byte_perm(w, 0x40000000u, 0x7244));
        o[3] = __int_as_float(__byte_perm(w, 0x40000000u, 0x7344));
    }
}

struct Affine {
    float a, b;
};

template <bool EXACT>
__device__ __forceinline__ Affine affine(float d, float bias, float m) {
    if (EXACT) return {d, m};
    return {64.0f * d, fmaf(d, 128.0f + bias, m)};
}

template <bool EXACT>
__device__ __forceinline__ float weight(Affine s, float v) {
    if (EXACT) return __fsub_rn(__fmul_rn(s.a, v), s.b);
    return fmaf(s.a, v, -s.b);
}

// Applies one Affine to n values.
template <bool EXACT, int N>
__device__ __forceinline__ void weights(Affine s, float * v) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = weight<EXACT>(s, v[i]);
}

// Scale and min (6 bits each) of sub-block j of a Q4_K/Q5_K block from its 12 scale bytes, read as three words:
// without branches (units of one warp ask for sub-blocks on both sides of j = 4).
__device__ __forceinline__ void k4_scale_min(const uint32_t (&s)[3], int j, int & sc, int & m) {
    const int jj = j & 3;
    const int sel = 0x4440 | jj;  // byte jj, zeros above
    const int a = __byte_perm(s[0], 0, sel), b = __byte_perm(s[1], 0, sel), c = __byte_perm(s[2], 0, sel);
    const int hi = -int(j >= 4);  // all ones for j >= 4: a mask, so that no branch is compiled
    sc = (((c & 0x0f) | ((a >> 6) << 4)) & hi) | (a & 63 & ~hi);
    m = (((c >> 4) | ((b >> 6) << 4)) & hi) | (b & 63 & ~hi);
}

// v[0..16) (quants of sub-block 2c) and v[16..32) (of sub-block 2c + 1) of a Q4_K/Q5_K block (from quants_f4
// with bias 0) to weights: each times its sub-block's scale d * sc, minus its offset dmin * m.
template <bool EXACT>
__device__ __forceinline__ void k4_scale_unit(const uint8_t * b, int c, float * v) {
    const uint32_t s[3] = {ld32(b + 4), ld32(b + 8), ld32(b + 12)};
    int s0, m0, s1, m1;
    k4_scale_min(s, 2 * c, s0, m0);
    k4_scale_min(s, 2 * c + 1, s1, m1);
    const float d = ldh(b), dmin = ldh(b + 2);
    weights<EXACT, 16>(affine<EXACT>(__fmul_rn(d, float(s0)), 0.0f, __fmul_rn(dmin, float(m0))), v);
    weights<EXACT, 16>(affine<EXACT>(__fmul_rn(d, float(s1)), 0.0f, __fmul_rn(dmin, float(m1))), v + 16);
}

// ---- quantized types --------------------------------------------------------------------------

struct TQ8_0 {  // f16 d; int8 qs[32]
    static constexpr int QK = 32, BYTES = 34, NU = 4, E = 8, G = 4;
    __device__ static int xoff(int u, int g) { return 8 * u + 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const float d = ldh(b);
        const uint32_t w0 = ld32a2(b + 2 + 8 * u) ^ 0x80808080u, w1 = ld32a2(b + 6 + 8 * u) ^ 0x80808080u;
        quants_f4<true>(w0, 128.0f, v);  // quants up to 255: the exact conversion in both modes
        quants_f4<true>(w1, 128.0f, v + 4);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(v[i], d);
    }
};

struct TQ4_0 {  // f16 d; uint8 qs[16]: element l low nibble of qs[l], l+16 high nibble
    static constexpr int QK = 32, BYTES = 18, NU = 4, E = 8, G = 4;
    __device__ static int xoff(int u, int g) { return 4 * u + 16 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const float d = ldh(b);
        const uint32_t w = ld32a2(b + 2 + 4 * u);
        // the exact conversion in both modes: with the fast one the 4-row GEMV ran slower on the H200 (2026-11-29)
        quants_f4<true>(w & 0x0f0f0f0fu, 8.0f, v);
        quants_f4<true>((w >> 4) & 0x0f0f0f0fu, 8.0f, v + 4);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(v[i], d);
    }
};

// Spreads bits 0..3 of h to bit 4 of bytes 0..3 (the fifth bit of four Q5_0/Q5_1 quants).
__device__ __forceinline__ uint32_t hbits4(uint32_t h) {
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

struct TQ4_1 {  // f16 d, m; uint8 qs[16]: as Q4_0, value q*d + m
    static constexpr int QK = 32, BYTES = 20, NU = 4, E = 8, G = 4;
    __device__ static int xoff(int u, int g) { return 4 * u + 16 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const float d = ldh(b), m = ldh(b + 2);
        const uint32_t w = ld32(b + 4 + 4 * u);
        quants_f4<true>(w & 0x0f0f0f0fu, 0.0f, v);  // the exact conversion in both modes, as Q4_0
        quants_f4<true>((w >> 4) & 0x0f0f0f0fu, 0.0f, v + 4);
        weights<EXACT, 8>(affine<true>(d, 0.0f, -m), v);
    }
};

struct TQ5_0 {  // f16 d; uint8 qh[4] (uint32: bit j = fifth bit of element j); uint8 qs[16] as Q4_0
    static constexpr int QK = 32, BYTES = 22, NU = 4, E = 8, G = 4;
    __device__ static int xoff(int u, int g) { return 4 * u + 16 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const float d = ldh(b);
        const uint32_t qh = ld32a2(b + 2);
        const uint32_t w = ld32a2(b + 6 + 4 * u);
        quants_f4<EXACT>((w & 0x0f0f0f0fu) | hbits4(qh >> (4 * u)), 16.0f, v);
        quants_f4<EXACT>(((w >> 4) & 0x0f0f0f0fu) | hbits4(qh >> (16 + 4 * u)), 16.0f, v + 4);
        weights<EXACT, 8>(affine<EXACT>(d, 16.0f, 0.0f), v);
    }
};

struct TQ5_1 {  // f16 d, m; uint8 qh[4]; uint8 qs[16]: as Q5_0 without the offset, value q*d + m
    static constexpr int QK = 32, BYTES = 24, NU = 4, E = 8, G = 4;
    __device__ static int xoff(int u, int g) { return 4 * u + 16 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const float d = ldh(b), m = ldh(b + 2);
        const uint32_t qh = ld32(b + 4);
        const uint32_t w = ld32(b + 8 + 4 * u);
        quants_f4<EXACT>((w & 0x0f0f0f0fu) | hbits4(qh >> (4 * u)), 0.0f, v);
        quants_f4<EXACT>(((w >> 4) & 0x0f0f0f0fu) | hbits4(qh >> (16 + 4 * u)), 0.0f, v + 4);
        weights<EXACT, 8>(affine<EXACT>(d, 0.0f, -m), v);
    }
};

struct TQ4_K {  // f16 d, dmin; uint8 scales[12]; uint8 qs[128]
    // unit u: the 16 quant bytes at 32 c + l0 (c = u / 2, l0 = 16 (u % 2)): their low nibbles are elements
    // l0.. of sub-block 2c, their high nibbles the same elements of sub-block 2c + 1 (one scale decode per 32)
    static constexpr int QK = 256, BYTES = 144, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return (u >> 1) * 64 + 16 * (u & 1) + 4 * (g & 3) + 32 * (g >> 2); }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const int c = u >> 1;
        const uint8_t * qs = b + 16 + c * 32 + 16 * (u & 1);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t q = ld32(qs + 4 * i);
            quants_f4<EXACT>(q & 0x0f0f0f0fu, 0.0f, v + 4 * i);
            quants_f4<EXACT>((q >> 4) & 0x0f0f0f0fu, 0.0f, v + 16 + 4 * i);
        }
        k4_scale_unit<EXACT>(b, c, v);
    }
};

struct TQ5_K {  // f16 d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]: units as Q4_K's
    static constexpr int QK = 256, BYTES = 176, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return TQ4_K::xoff(u, g); }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const int c = u >> 1, l0 = 16 * (u & 1);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t q = ld32(b + 48 + c * 32 + l0 + 4 * i), h = ld32(b + 16 + l0 + 4 * i);
            quants_f4<EXACT>((q & 0x0f0f0f0fu) | (((h >> (2 * c)) & 0x01010101u) << 4), 0.0f, v + 4 * i);
            quants_f4<EXACT>(((q >> 4) & 0x0f0f0f0fu) | (((h >> (2 * c + 1)) & 0x01010101u) << 4), 0.0f,
                             v + 16 + 4 * i);
        }
        k4_scale_unit<EXACT>(b, c, v);
    }
};

struct TQ6_K {  // uint8 ql[128]; uint8 qh[64]; int8 scales[16]; f16 d
    // unit u: elements l0 .. l0 + 7 (l0 = 8 (u % 4)) of the four 32-element runs of half j = u / 4, one scale each
    static constexpr int QK = 256, BYTES = 210, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return (u >> 2) * 128 + 8 * (u & 3) + 4 * (g & 1) + 32 * (g >> 1); }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const int j = u >> 2, l0 = 8 * (u & 3), is = j * 8 + (l0 >> 4);
        const int8_t * sc = reinterpret_cast<const int8_t *>(b + 192);
        const float d = ldh(b + 208);
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            const int l = l0 + 4 * w;
            const uint32_t A = ld32a2(b + j * 64 + l), B = ld32a2(b + j * 64 + 32 + l);
            const uint32_t H = ld32a2(b + 128 + j * 32 + l);
            quants_f4<EXACT>((A & 0x0f0f0f0fu) | ((H & 0x03030303u) << 4), 32.0f, v + 4 * w);
            quants_f4<EXACT>((B & 0x0f0f0f0fu) | (((H >> 2) & 0x03030303u) << 4), 32.0f, v + 8 + 4 * w);
            quants_f4<EXACT>(((A >> 4) & 0x0f0f0f0fu) | (((H >> 4) & 0x03030303u) << 4), 32.0f, v + 16 + 4 * w);
            quants_f4<EXACT>(((B >> 4) & 0x0f0f0f0fu) | (((H >> 6) & 0x03030303u) << 4), 32.0f, v + 24 + 4 * w);
        }
#pragma unroll
        for (int g = 0; g < 4; ++g)
            weights<EXACT, 8>(affine<EXACT>(__fmul_rn(d, float(sc[is + 2 * g])), 32.0f, 0.0f), v + 8 * g);
    }
};

struct TQ3_K {  // uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; f16 d
    static constexpr int QK = 256, BYTES = 110, NU = 16, E = 16, G = 4;
    __device__ static int xoff(int u, int g) { return (u >> 3) * 128 + 4 * (u & 7) + 32 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const int j = u >> 3, l0 = 4 * (u & 7);
        const uint32_t Q = ld32a2(b + 32 + j * 32 + l0), H = ld32a2(b + l0);
        const uint8_t * sc = b + 96;
        const float d = ldh(b + 108);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int is = j * 8 + 2 * s + (l0 >> 4);
            const int lo = is < 8 ? (sc[is] & 0x0f) : (sc[is - 8] >> 4);
            const int hi = (sc[8 + (is & 3)] >> (2 * (is >> 2))) & 3;
            const float dl = __fmul_rn(d, float((lo | (hi << 4)) - 32));
            quants_f4<EXACT>(((Q >> (2 * s)) & 0x03030303u) | (((H >> (4 * j + s)) & 0x01010101u) << 2), 4.0f,
                             v + 4 * s);
            weights<EXACT, 4>(affine<EXACT>(dl, 4.0f, 0.0f), v + 4 * s);
        }
    }
};

struct TQ2_K {  // uint8 scales[16]; uint8 qs[64]; f16 d, dmin
    static constexpr int QK = 256, BYTES = 84, NU = 16, E = 16, G = 4;
    __device__ static int xoff(int u, int g) { return (u >> 3) * 128 + 4 * (u & 7) + 32 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const int j = u >> 3, l0 = 4 * (u & 7);
        const uint32_t Q = ld32(b + 16 + j * 32 + l0);
        const float d = ldh(b + 80), dmin = ldh(b + 82);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int sc = b[j * 8 + 2 * s + (l0 >> 4)];
            quants_f4<EXACT>((Q >> (2 * s)) & 0x03030303u, 0.0f, v + 4 * s);
            weights<EXACT, 4>(affine<EXACT>(__fmul_rn(d, float(sc & 0x0f)), 0.0f, __fmul_rn(dmin, float(sc >> 4))),
                              v + 4 * s);
        }
    }
};

// The 16 levels of an IQ4_NL / IQ4_XS quant (kvalues_iq4nl of ggml-common.h), each plus 128 as a byte (1..241),
// four to a word.
constexpr uint32_t iq4_word(int a, int b, int c, int d) {
    return uint32_t(a + 128) | uint32_t(b + 128) << 8 | uint32_t(c + 128) << 16 | uint32_t(d + 128) << 24;
}
constexpr uint32_t kIq4Levels0 = iq4_word(-127, -104, -83, -65), kIq4Levels1 = iq4_word(-49, -35, -22, -10);
constexpr uint32_t kIq4Levels2 = iq4_word(1, 13, 25, 38), kIq4Levels3 = iq4_word(53, 69, 89, 113);

// The levels of the eight IQ4 quants of w, the nibbles of four quant bytes (low nibbles elements 0..3 of a run, high
// nibbles elements 16..19), as floats: lo[i] of low nibble i, hi[i] of high nibble i. Per two bytes, the four nibbles
// select among levels 0..7 and 8..15 by their low three bits and a third permute picks by the fourth bit; two more
// permutes sort low from high nibbles. The biased bytes convert exactly (quants_f4).
__device__ __forceinline__ void iq4_levels_f8(uint32_t w, float * lo, float * hi) {
    uint32_t two[2];  // bytes: element 2h's level, element 2h + 16's, 2h + 1's, 2h + 17's
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t s = w >> (16 * h), low3 = s & 0x7777u;
        const uint32_t a = __byte_perm(kIq4Levels0, kIq4Levels1, low3), b = __byte_perm(kIq4Levels2, kIq4Levels3, low3);
        two[h] = __byte_perm(a, b, 0x3210u | ((s & 0x8888u) >> 1));
    }
    quants_f4<true>(__byte_perm(two[0], two[1], 0x6420), 128.0f, lo);
    quants_f4<true>(__byte_perm(two[0], two[1], 0x7531), 128.0f, hi);
}

struct TIQ4_NL {  // f16 d; uint8 qs[16] laid out as Q4_0's, units as Q4_0's: value d * level[q]
    static constexpr int QK = 32, BYTES = 18, NU = 4, E = 8, G = 4;
    __device__ static int xoff(int u, int g) { return TQ4_0::xoff(u, g); }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const float d = ldh(b);
        iq4_levels_f8(ld32a2(b + 2 + 4 * u), v, v + 4);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(d, v[i]);
    }
};

struct TIQ4_XS {  // f16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]
    // unit u: sub-block u of 32 elements, its 16 quant bytes at 16 u: low nibbles elements 0..15, high 16..31;
    // value (d * (ls - 32)) * level[q], ls the sub-block's 6-bit scale (nibble u of scales_l, bits 2u.. of scales_h)
    static constexpr int QK = 256, BYTES = 136, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return 32 * u + 4 * (g & 3) + 16 * (g >> 2); }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const uint8_t * qs = b + 8 + 16 * u;
#pragma unroll
        for (int i = 0; i < 4; ++i) iq4_levels_f8(ld32(qs + 4 * i), v + 4 * i, v + 16 + 4 * i);
        const int scales_h = *reinterpret_cast<const uint16_t *>(b + 2);
        const int ls = ((b[4 + u / 2] >> (4 * (u & 1))) & 0x0f) | (((scales_h >> (2 * u)) & 3) << 4);
        const float dl = __fmul_rn(ldh(b), float(ls - 32));
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = __fmul_rn(dl, v[i]);
    }
};

// ---- IQ1/IQ2/IQ3: weights as points of a codebook (iq_grids.h; the layouts are iq_groups_cpu.h's) ----------
// A unit is one sub-block of 32 weights: four groups of 8, each one 8-coordinate point (IQ3: two of 4 side by side)
// times the sub-block's scale, each weight's sign from a sign byte (IQ1: a shift of +-1/8 instead). Every operation
// is the CPU decoder's, in both modes.

static __device__ const uint64_t kIq2XxsGrid[256] = SPECTER_IQ2_XXS_GRID;
static __device__ const uint64_t kIq2XsGrid[512] = SPECTER_IQ2_XS_GRID;
static __device__ const uint64_t kIq2SGrid[1024] = SPECTER_IQ2_S_GRID;
static __device__ const uint32_t kIq3XxsGrid[256] = SPECTER_IQ3_XXS_GRID;
static __device__ const uint32_t kIq3SGrid[512] = SPECTER_IQ3_S_GRID;
static __device__ const uint64_t kIq1SGrid[2048] = SPECTER_IQ1_S_GRID;

__device__ __forceinline__ uint32_t ld16(const uint8_t * p) { return *reinterpret_cast<const uint16_t *>(p); }

// The sign byte of a 7-bit sign index: its bits, and an eighth that makes the count of negated weights even.
__device__ __forceinline__ uint32_t iq_signs8(uint32_t index7) { return index7 | ((__popc(index7) & 1u) << 7); }

// v[0..8) = db * coordinate, negated where the sign byte's bit is set (coordinates from quants_f4, exact).
__device__ __forceinline__ void iq_scale_signed8(float db, uint32_t signs, float * v) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
        v[j] = __int_as_float(__float_as_int(__fmul_rn(db, v[j])) ^ int(((signs >> j) & 1u) << 31));
}

// IQ2/IQ3: a point of 8 byte coordinates as 8 weights, each db * coordinate with its sign.
__device__ __forceinline__ void iq_signed_group(uint64_t point, uint32_t signs, float db, float * v) {
    quants_f4<true>(uint32_t(point), 0.0f, v);
    quants_f4<true>(uint32_t(point >> 32), 0.0f, v + 4);
    iq_scale_signed8(db, signs, v);
}

// IQ3's two points of 4 coordinates as one of 8.
__device__ __forceinline__ uint64_t iq3_pair(uint32_t p0, uint32_t p1) { return p0 | uint64_t(p1) << 32; }

// IQ1: a point of 8 int8 coordinates (-1, 0, 1) as 8 weights dl * (coordinate + delta).
__device__ __forceinline__ void iq_shifted_group(uint64_t point, float dl, float delta, float * v) {
    quants_f4<true>(uint32_t(point) ^ 0x80808080u, 128.0f, v);
    quants_f4<true>(uint32_t(point >> 32) ^ 0x80808080u, 128.0f, v + 4);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(dl, __fadd_rn(v[j], delta));
}

// d * (0.5 + s) * f, the IQ2/IQ3 sub-block scales
__device__ __forceinline__ float iq_half_step(float d, uint32_t s, float f) {
    return __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, float(s))), f);
}

struct TIQ2_XXS {  // f16 d; per sub-block: four grid index bytes, a word of four 7-bit sign indices and a 4-bit scale
    static constexpr int QK = 256, BYTES = 66, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return 32 * u + 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const uint32_t idx = ld32a2(b + 2 + 8 * u), aux = ld32a2(b + 6 + 8 * u);
        const float db = iq_half_step(ldh(b), aux >> 28, 0.25f);
#pragma unroll
        for (int l = 0; l < 4; ++l)
            iq_signed_group(kIq2XxsGrid[(idx >> (8 * l)) & 0xff], iq_signs8((aux >> (7 * l)) & 127), db, v + 8 * l);
    }
};

struct TIQ2_XS {  // f16 d; uint16 qs[32] (9-bit index, 7-bit sign index); uint8 scales[8] (a nibble per 16)
    static constexpr int QK = 256, BYTES = 74, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return 32 * u + 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const float d = ldh(b);
        const uint32_t sc = b[66 + u];
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const uint32_t q = ld16(b + 2 + 8 * u + 2 * l);
            const float db = iq_half_step(d, (sc >> (4 * (l / 2))) & 0x0f, 0.25f);
            iq_signed_group(kIq2XsGrid[q & 511], iq_signs8(q >> 9), db, v + 8 * l);
        }
    }
};

struct TIQ2_S {  // f16 d; uint8 qs[32]; uint8 signs[32]; uint8 qh[8] (two high index bits each); uint8 scales[8]
    static constexpr int QK = 256, BYTES = 82, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return 32 * u + 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const float d = ldh(b);
        const uint32_t qs = ld32a2(b + 2 + 4 * u), signs = ld32a2(b + 34 + 4 * u), qh = b[66 + u], sc = b[74 + u];
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const uint32_t idx = ((qs >> (8 * l)) & 0xff) | (((qh >> (2 * l)) & 3) << 8);
            const float db = iq_half_step(d, (sc >> (4 * (l / 2))) & 0x0f, 0.25f);
            iq_signed_group(kIq2SGrid[idx], (signs >> (8 * l)) & 0xff, db, v + 8 * l);
        }
    }
};

struct TIQ3_XXS {  // f16 d; uint8 qs[64] (8 grid indices per sub-block); a word per sub-block: signs and scale
    static constexpr int QK = 256, BYTES = 98, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return 32 * u + 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const uint32_t i0 = ld32a2(b + 2 + 8 * u), i1 = ld32a2(b + 6 + 8 * u), aux = ld32a2(b + 66 + 4 * u);
        const float db = iq_half_step(ldh(b), aux >> 28, 0.5f);
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const uint32_t w = l < 2 ? i0 : i1, sh = 16 * (l & 1);
            iq_signed_group(iq3_pair(kIq3XxsGrid[(w >> sh) & 0xff], kIq3XxsGrid[(w >> (sh + 8)) & 0xff]),
                            iq_signs8((aux >> (7 * l)) & 127), db, v + 8 * l);
        }
    }
};

struct TIQ3_S {  // f16 d; uint8 qs[64]; uint8 qh[8] (ninth index bits); uint8 signs[32]; uint8 scales[4]
    static constexpr int QK = 256, BYTES = 110, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return 32 * u + 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const uint32_t i0 = ld32a2(b + 2 + 8 * u), i1 = ld32a2(b + 6 + 8 * u), qh = b[66 + u];
        const uint32_t signs = ld32a2(b + 74 + 4 * u);
        const float db = __fmul_rn(ldh(b), float(1 + 2 * ((b[106 + u / 2] >> (4 * (u & 1))) & 0x0f)));
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const uint32_t w = l < 2 ? i0 : i1, sh = 16 * (l & 1);
            const uint32_t a = ((w >> sh) & 0xff) | (((qh >> (2 * l)) & 1) << 8);
            const uint32_t c = ((w >> (sh + 8)) & 0xff) | (((qh >> (2 * l + 1)) & 1) << 8);
            iq_signed_group(iq3_pair(kIq3SGrid[a], kIq3SGrid[c]), (signs >> (8 * l)) & 0xff, db, v + 8 * l);
        }
    }
};

struct TIQ1_S {  // f16 d; uint8 qs[32]; uint16 qh[8]: three high bits per index, 3-bit scale at 12, delta sign at 15
    static constexpr int QK = 256, BYTES = 50, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return 32 * u + 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const uint32_t qs = ld32a2(b + 2 + 4 * u), qh = ld16(b + 34 + 2 * u);
        const float dl = __fmul_rn(ldh(b), float(2 * ((qh >> 12) & 7) + 1));
        const float delta = qh & 0x8000 ? -0.125f : 0.125f;
#pragma unroll
        for (int l = 0; l < 4; ++l)
            iq_shifted_group(kIq1SGrid[((qs >> (8 * l)) & 0xff) | (((qh >> (3 * l)) & 7) << 8)], dl, delta, v + 8 * l);
    }
};

struct TIQ1_M {  // uint8 qs[32]; uint8 qh[16] (a nibble per index); uint16 scales[4] (3-bit scales; d in top nibbles)
    static constexpr int QK = 256, BYTES = 56, NU = 8, E = 32, G = 4;
    __device__ static int xoff(int u, int g) { return 32 * u + 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int u, float * v) {
        const uint32_t s01 = ld32a2(b + 48), s23 = ld32a2(b + 52);
        const uint32_t dh =
            ((s01 >> 12) & 0x000f) | ((s01 >> 24) & 0x00f0) | ((s23 >> 4) & 0x0f00) | ((s23 >> 16) & 0xf000);
        const float d = __half2float(__ushort_as_half(uint16_t(dh)));
        const uint32_t sc = ((u < 4 ? s01 : s23) >> (16 * ((u >> 1) & 1) + 6 * (u & 1))) & 0x3f;
        const uint32_t qs = ld32a2(b + 4 * u), qh = ld16(b + 32 + 2 * u);
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const uint32_t h = (qh >> (4 * l)) & 0x0f;
            const float dl = __fmul_rn(d, float(2 * ((sc >> (3 * (l / 2))) & 7) + 1));
            iq_shifted_group(kIq1SGrid[((qs >> (8 * l)) & 0xff) | ((h & 7) << 8)], dl, h & 8 ? -0.125f : 0.125f,
                             v + 8 * l);
        }
    }
};

// ---- float types: vector variants (k a multiple of the unit, 16-byte aligned rows) and scalar -----

__device__ __forceinline__ float bf16f(uint32_t h) { return __uint_as_float(h << 16); }

struct TF32V {
    static constexpr int QK = 4, BYTES = 16, NU = 1, E = 4, G = 4;
    __device__ static int xoff(int, int) { return 0; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int, float * v) {
        const float4 f = *reinterpret_cast<const float4 *>(b);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    }
};
struct TF16V {
    static constexpr int QK = 8, BYTES = 16, NU = 1, E = 8, G = 4;
    __device__ static int xoff(int, int g) { return 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int, float * v) {
        const uint4 w = *reinterpret_cast<const uint4 *>(b);
        const uint32_t a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&a[i]));
            v[2 * i] = f.x, v[2 * i + 1] = f.y;
        }
    }
};
struct TBF16V {
    static constexpr int QK = 8, BYTES = 16, NU = 1, E = 8, G = 4;
    __device__ static int xoff(int, int g) { return 4 * g; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int, float * v) {
        const uint4 w = *reinterpret_cast<const uint4 *>(b);
        const uint32_t a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) v[2 * i] = bf16f(a[i] & 0xffffu), v[2 * i + 1] = bf16f(a[i] >> 16);
    }
};
struct TF32S {
    static constexpr int QK = 1, BYTES = 4, NU = 1, E = 1, G = 1;
    __device__ static int xoff(int, int) { return 0; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int, float * v) { v[0] = *reinterpret_cast<const float *>(b); }
};
struct TF16S {
    static constexpr int QK = 1, BYTES = 2, NU = 1, E = 1, G = 1;
    __device__ static int xoff(int, int) { return 0; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int, float * v) { v[0] = ldh(b); }
};
struct TBF16S {
    static constexpr int QK = 1, BYTES = 2, NU = 1, E = 1, G = 1;
    __device__ static int xoff(int, int) { return 0; }
    template <bool EXACT>
    __device__ static void decode(const uint8_t * b, int, float * v) {
        v[0] = bf16f(*reinterpret_cast<const uint16_t *>(b));
    }
};

// ---- X loads ----------------------------------------------------------------------------------

template <int G>
__device__ __forceinline__ void load_x(const float * p, float * o) {
    if (G == 4) {
        const float4 f = *reinterpret_cast<const float4 *>(p);
        o[0] = f.x, o[1] = f.y, o[2] = f.z, o[3] = f.w;
    } else {
#pragma unroll
        for (int i = 0; i < G; ++i) o[i] = p[i];
    }
}
template <int G>
__device__ __forceinline__ void load_x(const __half * p, float * o) {
    if (G == 4) {
        const uint2 w = *reinterpret_cast<const uint2 *>(p);
        const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&w.x));
        const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&w.y));
        o[0] = a.x, o[1] = a.y, o[2] = b.x, o[3] = b.y;
    } else {
#pragma unroll
        for (int i = 0; i < G; ++i) o[i] = __half2float(p[i]);
    }
}

// ---- the CTA dot product: NR weight rows . M rows of X, partial sums per thread ------------------
// All threads of the CTA stride over the units of the rows (unit i = block i / NU, unit i % NU).
// Each thread's partial sums are a fixed sequence of FMAs: results depend only on blockDim.x.
template <class TT, int M, int NR, class XT>
__device__ __forceinline__ void cta_dot(const uint8_t * const (&rows)[NR], const XT * const (&xs)[M], int nblocks,
                                        float (&acc)[NR][M]) {
    const int nunits = nblocks * TT::NU;
    for (int i = threadIdx.x; i < nunits; i += blockDim.x) {
        const int b = i / TT::NU, u = i % TT::NU;
        float v[NR][TT::E];
#pragma unroll
        for (int r = 0; r < NR; ++r) TT::template decode<false>(rows[r] + size_t(b) * TT::BYTES, u, v[r]);
#pragma unroll
        for (int g = 0; g < TT::E / TT::G; ++g) {
            const int off = b * TT::QK + TT::xoff(u, g);
#pragma unroll
            for (int t = 0; t < M; ++t) {
                float xv[TT::G];
                load_x<TT::G>(xs[t] + off, xv);
#pragma unroll
                for (int r = 0; r < NR; ++r)
#pragma unroll
                    for (int e = 0; e < TT::G; ++e) acc[r][t] = fmaf(v[r][g * TT::G + e], xv[e], acc[r][t]);
            }
        }
    }
}

// Sum N per-thread values over the CTA (blockDim.x a multiple of 32, <= 256) in a fixed order;
// the totals are valid in threads 0 .. N-1 (thread i returns total i). `red` holds 8*N floats.
template <int N>
__device__ __forceinline__ float cta_sum(float (&v)[N], float * red) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < N; ++i) red[warp * N + i] = v[i];
    __syncthreads();
    float s = 0.0f;
    if (threadIdx.x < N)
        for (int w = 0; w < nw; ++w) s += red[w * N + threadIdx.x];
    __syncthreads();  // `red` may be reused by the next call
    return s;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// The CTA's dot products of ND weight rows with M rows of X, summed over the CTA: thread i < ND * M returns
// the total of weight row i / M with X row i % M. `red` holds 8 * ND * M floats.
template <class TT, int M, int ND, class XT>
__device__ __forceinline__ float cta_dot_totals(const uint8_t * const (&rows)[ND], const XT * const (&xs)[M],
                                                int nblocks, float * red) {
    float acc[ND][M];
#pragma unroll
    for (int r = 0; r < ND; ++r)
#pragma unroll
        for (int t = 0; t < M; ++t) acc[r][t] = 0.0f;
    cta_dot<TT, M, ND, XT>(rows, xs, nblocks, acc);
    float flat[ND * M];
#pragma unroll
    for (int r = 0; r < ND; ++r)
#pragma unroll
        for (int t = 0; t < M; ++t) flat[r * M + t] = acc[r][t];
    return cta_sum<ND * M>(flat, red);
}

// From totals s of 2 * NM values (thread i holds total i: gate totals first, then up totals), thread i < NM
// returns silu(gate total i) * (up total i). `res` holds 2 * NM floats; ends with a barrier (res reusable).
template <int NM>
__device__ __forceinline__ float swiglu_of_totals(float s, float * res) {
    if (threadIdx.x < 2 * NM) res[threadIdx.x] = s;
    __syncthreads();
    const float y = threadIdx.x < NM ? silu(res[threadIdx.x]) * res[NM + threadIdx.x] : 0.0f;
    __syncthreads();
    return y;
}

// Output rows per CTA of the GEMV-style kernels at M rows of X (per matrix when a CTA dots two, gate and up):
// four weight rows dotted at M = 1 (more loads in flight; on the H200 faster than 1, 2 or 8 for Qwen1.5-MoE's
// shapes), two above. A row's result does not depend on it.
__host__ __device__ constexpr int rows_per_cta(int M, bool pair) {
    return pair ? (M == 1 ? 2 : 1) : (M == 1 ? 4 : 2);
}

// Threads per CTA for rows of `nunits` units: enough to give each thread ~2+ units, 32..256.
inline int cta_threads(long long nunits) {
    int t = 32;
    while (t < 256 && t * 2 <= nunits) t *= 2;
    return t;
}

// ---- type dispatch on the host ------------------------------------------------------------------
template <class T>
struct Tag {
    using type = T;
};

// Calls fn(Tag<TT>{}) for the device type of ggml type `type`. `vec`: rows of float types are
// k % 8 == 0 (F16/BF16) / k % 4 == 0 (F32) and 16-byte aligned. false for an unknown type.
template <class Fn>
bool with_type(int type, bool vec, Fn && fn) {
    switch (type) {
        case SPECTER_TYPE_Q8_0: fn(Tag<TQ8_0>{}); return true;
        case SPECTER_TYPE_Q4_0: fn(Tag<TQ4_0>{}); return true;
        case SPECTER_TYPE_Q4_1: fn(Tag<TQ4_1>{}); return true;
        case SPECTER_TYPE_Q5_0: fn(Tag<TQ5_0>{}); return true;
        case SPECTER_TYPE_Q5_1: fn(Tag<TQ5_1>{}); return true;
        case SPECTER_TYPE_Q2_K: fn(Tag<TQ2_K>{}); return true;
        case SPECTER_TYPE_Q3_K: fn(Tag<TQ3_K>{}); return true;
        case SPECTER_TYPE_Q4_K: fn(Tag<TQ4_K>{}); return true;
        case SPECTER_TYPE_Q5_K: fn(Tag<TQ5_K>{}); return true;
        case SPECTER_TYPE_Q6_K: fn(Tag<TQ6_K>{}); return true;
        case SPECTER_TYPE_IQ4_NL: fn(Tag<TIQ4_NL>{}); return true;
        case SPECTER_TYPE_IQ4_XS: fn(Tag<TIQ4_XS>{}); return true;
        case SPECTER_TYPE_IQ2_XXS: fn(Tag<TIQ2_XXS>{}); return true;
        case SPECTER_TYPE_IQ2_XS: fn(Tag<TIQ2_XS>{}); return true;
        case SPECTER_TYPE_IQ2_S: fn(Tag<TIQ2_S>{}); return true;
        case SPECTER_TYPE_IQ3_XXS: fn(Tag<TIQ3_XXS>{}); return true;
        case SPECTER_TYPE_IQ3_S: fn(Tag<TIQ3_S>{}); return true;
        case SPECTER_TYPE_IQ1_S: fn(Tag<TIQ1_S>{}); return true;
        case SPECTER_TYPE_IQ1_M: fn(Tag<TIQ1_M>{}); return true;
        case SPECTER_TYPE_F32: vec ? fn(Tag<TF32V>{}) : fn(Tag<TF32S>{}); return true;
        case SPECTER_TYPE_F16: vec ? fn(Tag<TF16V>{}) : fn(Tag<TF16S>{}); return true;
        case SPECTER_TYPE_BF16: vec ? fn(Tag<TBF16V>{}) : fn(Tag<TBF16S>{}); return true;
        default: return false;
    }
}

// Whether the float-type vector variant applies to rows of k elements at address `p` (0: unknown).
inline bool vec_ok(int type, long long k, uintptr_t p) {
    const long long unit = type == SPECTER_TYPE_F32 ? 4 : 8;
    return k % unit == 0 && (p % 16) == 0;
}

// Quantized types whose decoders use 4-byte loads need 4-byte aligned rows.
inline bool aligned_for(int type, uintptr_t p) {
    if (type == SPECTER_TYPE_Q4_K || type == SPECTER_TYPE_Q5_K || type == SPECTER_TYPE_Q2_K ||
        type == SPECTER_TYPE_Q4_1 || type == SPECTER_TYPE_Q5_1 || type == SPECTER_TYPE_IQ4_XS ||
        type == SPECTER_TYPE_F32)
        return p % 4 == 0;
    return p % 2 == 0;
}

}  // namespace cuda
}  // namespace specter
