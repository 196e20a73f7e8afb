// Pieces of the K-quant and IQ4 block layouts that the CPU decoders (dequant_cpu.cpp) and the fused row dots
// (kernels_cpu.cpp) share (internal header of libspecter).
#pragma once

#include <cstdint>

#include "fp16.h"
#include "specter.h"
#include "vectors_cpu.h"

namespace specter {

// The 12-byte packing of eight 6-bit scales and eight 6-bit mins shared by Q4_K and Q5_K: sub-block j's.
inline void k4_scale_min(const uint8_t * s, int j, int & sc, int & m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The 16 levels of an IQ4_NL or IQ4_XS quant (kvalues_iq4nl of ggml-common.h): a non-linear 4-bit code.
alignas(16) inline constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                      1,    13,   25,  38,  53,  69,  89,  113};

// IQ4_XS: sub-block j's scale, d * (ls - 32), ls the 6-bit scale (nibble j of scales_l, low nibble first, with bits
// 2j and 2j + 1 of scales_h above it) of block b.
inline float iq4_xs_scale(const uint8_t * b, float d, int j) {
    const int scales_h = b[2] | (b[3] << 8);
    const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0x0f) | (((scales_h >> (2 * j)) & 3) << 4);
    return d * float(ls - 32);
}

// Calls run(at, qs, scale) for each run of 32 weights of n_blocks IQ4_NL (XS false) or IQ4_XS blocks from b, in
// order: `at` the run's first element, qs its 16 quant bytes (low nibbles elements 0..15, high 16..31), scale its d
// (IQ4_XS: times the sub-block's scale). Always inlined, so that a vector caller's run function inlines too.
template <bool XS, class Run>
__attribute__((always_inline)) inline void iq4_runs(const uint8_t * b, int64_t n_blocks, Run && run) {
    constexpr int64_t kBlock = XS ? 256 : 32, kBytes = XS ? 136 : 18;
    for (int64_t i = 0; i < n_blocks; ++i, b += kBytes) {
        const float d = load_half(b);
        for (int j = 0; j < kBlock / 32; ++j)
            run(i * kBlock + 32 * j, b + (XS ? 8 + 16 * j : 2), XS ? iq4_xs_scale(b, d, j) : d);
    }
}

#ifdef SPECTER_X86_VECTORS
// IQ4_NL / IQ4_XS: the 32 weights of 16 quant bytes (low nibbles elements 0..15, high 16..31), d * level[q] as
// the decoder rounds them (one multiply), in four groups of 8.
__attribute__((target("avx2"))) inline void iq4_weights32(const uint8_t * qs, float d, __m256 (&w)[4]) {
    const __m128i levels = _mm_load_si128(reinterpret_cast<const __m128i *>(kIq4Levels));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs)), low = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_shuffle_epi8(levels, _mm_and_si128(q, low));
    const __m128i hi = _mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(q, 4), low));
    const __m256 dv = _mm256_set1_ps(d);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])), dv);
}

// Q4_K: the scale and the offset of sub-block 2c + h of block b (scales d, dmin) as the decoder computes them.
__attribute__((target("avx2"))) inline void q4_k_sub_block(const uint8_t * b, int c, int h, float d, float dmin,
                                                          __m256 & d1, __m256 & m1) {
    int sc, m;
    k4_scale_min(b + 4, 2 * c + h, sc, m);
    d1 = _mm256_set1_ps(d * float(sc)), m1 = _mm256_set1_ps(dmin * float(m));
}

// Q4_K: weights 8 part .. 8 part + 7 of that sub-block, d1 * q - m1 rounded twice as the decoder does (a multiply,
// then a subtraction).
__attribute__((target("avx2"))) inline __m256 q4_k_weights8(const uint8_t * b, int c, int h, int part, __m256 d1,
                                                           __m256 m1) {
    const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 16 + c * 32 + 8 * part));
    const __m128i q = _mm_and_si128(h ? _mm_srli_epi16(q8, 4) : q8, _mm_set1_epi8(0x0f));
    return _mm256_sub_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q))), m1);
}

// Q6_K: the 8 weights of quants q (the low 8 bytes) in a sub-block of scale d * sc: dl * (q - 32), one multiply.
__attribute__((target("avx2"))) inline __m256 q6_k_weights8(__m128i q, float dl) {
    const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_set1_ps(dl), _mm256_cvtepi32_ps(v));
}

// Q6_K: the quants q_0..q_3 of l .. l + 7 in half block j of block b: bytes l of ql, ql + 32 and qh.
inline void q6_quants(const uint8_t * b, int j, int l, __m128i * q) {
    const uint8_t * ql = b + j * 64 + l;
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(ql));
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(ql + 32));
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 128 + j * 32 + l));
    const __m128i low = _mm_set1_epi8(0x0f);
    q[0] = _mm_or_si128(_mm_and_si128(a, low), _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi8(0x03)), 4));
    q[1] = _mm_or_si128(_mm_and_si128(c, low), _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi8(0x0c)), 2));
    q[2] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low), _mm_and_si128(h, _mm_set1_epi8(0x30)));
    q[3] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(c, 4), low),
                        _mm_and_si128(_mm_srli_epi16(h, 2), _mm_set1_epi8(0x30)));
}

// ---- AVX-512: a run of 32 weights of Q4_K (a sub-block), IQ4_NL or IQ4_XS takes one of 16 values, rounded as the
// decoder rounds each weight; a permute of them by the run's quants gives 16 of its weights.

// The 16 bytes at p, one a lane.
__attribute__((target("avx512f"))) inline __m512i bytes16_avx512(const uint8_t * p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}

// Calls run(at, values, q0, q1) for each run of 32 weights of n_blocks blocks of TYPE (Q4_K, IQ4_NL or IQ4_XS) from
// b, in order: `at` the run's first element, values its 16 values (Q4_K: d1 * q - m1, a multiply, then a
// subtraction; IQ4: d * level, one multiply), q0 and q1 the quants of its elements 0..15 and 16..31 (the low 4 bits
// of each lane). Always inlined, so that the caller's run function inlines too.
template <int TYPE, class Run>
__attribute__((target("avx512f"), always_inline)) inline void runs16_avx512(const uint8_t * b, int64_t n_blocks,
                                                                           Run && run) {
    if constexpr (TYPE == SPECTER_TYPE_Q4_K) {
        const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int64_t i = 0; i < n_blocks; ++i, b += 144) {
            const float d = load_half(b), dmin = load_half(b + 2);
            for (int c = 0; c < 4; ++c) {
                // sub-block 2c + h: the low (h = 0) or high nibbles of the 32 quant bytes of chunk c
                const __m512i lo = bytes16_avx512(b + 16 + c * 32), hi = bytes16_avx512(b + 32 + c * 32);
                for (int h = 0; h < 2; ++h) {
                    int sc, m;
                    k4_scale_min(b + 4, 2 * c + h, sc, m);
                    const __m512 values = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(d * float(sc)), q),
                                                        _mm512_set1_ps(dmin * float(m)));
                    run(i * 256 + c * 64 + h * 32, values, h ? _mm512_srli_epi32(lo, 4) : lo,
                        h ? _mm512_srli_epi32(hi, 4) : hi);
                }
            }
        }
    } else {
        static_assert(TYPE == SPECTER_TYPE_IQ4_NL || TYPE == SPECTER_TYPE_IQ4_XS, "a 4-bit type of 16 values");
        const __m512 levels = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_load_si128(reinterpret_cast<const __m128i *>(kIq4Levels))));
        iq4_runs<TYPE == SPECTER_TYPE_IQ4_XS>(b, n_blocks, [&run, levels](int64_t at, const uint8_t * qs, float d)
                                                               __attribute__((target("avx512f"))) {
            const __m512i q = bytes16_avx512(qs);
            run(at, _mm512_mul_ps(_mm512_set1_ps(d), levels), q, _mm512_srli_epi32(q, 4));
        });
    }
}
#endif

}  // namespace specter
