// The IQ1/IQ2/IQ3 block layouts as groups of 8 weights, for the CPU decoders (dequant_cpu.cpp) and the fused row
// dots (kernels_cpu.cpp) (internal header of libspecter).
//
// Every block holds 256 weights, eight sub-blocks of 32; each group of 8 weights is one point of a codebook
// (iq_grids.h; IQ3: two points of 4 side by side) times a scale. Group g (weights 8g .. 8g + 7) is
//     weight j = sign_j(scale * (coordinate_j + delta)),
// the coordinates int8 (IQ2/IQ3 coordinates are below 128). IQ2/IQ3 have a sign per weight and delta 0, IQ1 a
// delta of +-1/8 and no signs: the float operations of ggml's reference decoders (adding 0 and negating are exact).
#pragma once

#include <cstdint>
#include <cstring>

#include "fp16.h"
#include "iq_grids.h"
#include "specter.h"
#include "vectors_cpu.h"

namespace specter {

inline const uint64_t kIq2XxsGrid[256] = SPECTER_IQ2_XXS_GRID;
inline const uint64_t kIq2XsGrid[512] = SPECTER_IQ2_XS_GRID;
inline const uint64_t kIq2SGrid[1024] = SPECTER_IQ2_S_GRID;
inline const uint32_t kIq3XxsGrid[256] = SPECTER_IQ3_XXS_GRID;
inline const uint32_t kIq3SGrid[512] = SPECTER_IQ3_S_GRID;
inline const uint64_t kIq1SGrid[2048] = SPECTER_IQ1_S_GRID;

struct IqGroup {
    uint64_t point;  // 8 int8 coordinates, the first lowest
    int signs;       // bit j negates weight j
    float scale, delta;
};

// Bytes of a block of TYPE (256 weights).
constexpr int64_t iq_block_bytes(int type) {
    return type == SPECTER_TYPE_IQ2_XXS ? 66 : type == SPECTER_TYPE_IQ2_XS ? 74 : type == SPECTER_TYPE_IQ2_S ? 82
         : type == SPECTER_TYPE_IQ3_XXS ? 98 : type == SPECTER_TYPE_IQ3_S ? 110 : type == SPECTER_TYPE_IQ1_S ? 50
         : type == SPECTER_TYPE_IQ1_M ? 56 : 0;
}

// The sign byte of a 7-bit sign index: its bits, and an eighth that makes the count of negated weights even.
inline int iq_signs8(uint32_t index7) { return int(index7 | (uint32_t(__builtin_popcount(index7) & 1) << 7)); }

inline uint32_t iq_u32(const uint8_t * p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}
inline int iq_u16(const uint8_t * p) { return p[0] | (p[1] << 8); }

// d * (0.5 + s) * f: the IQ2/IQ3_XXS sub-block scales
inline float iq_half_step(float d, uint32_t s, float f) { return d * (0.5f + float(s)) * f; }

// Calls group(g, IqGroup) for the 32 groups of block b of TYPE, in order. Always inlined: an AVX2 caller's group
// function inlines only into an inlined walk (out of line, each group was a call: 2-4x slower GEMVs).
template <int TYPE, class Group>
__attribute__((always_inline)) inline void iq_groups(const uint8_t * b, Group && group) {
    if constexpr (TYPE == SPECTER_TYPE_IQ2_XXS) {
        // f16 d; per sub-block two words: four grid index bytes, then four 7-bit sign indices and a 4-bit scale s
        const float d = load_half(b);
        for (int ib = 0; ib < 8; ++ib) {
            const uint8_t * q = b + 2 + 8 * ib;
            const uint32_t aux = iq_u32(q + 4);
            const float db = iq_half_step(d, aux >> 28, 0.25f);
            for (int l = 0; l < 4; ++l)
                group(4 * ib + l, IqGroup{kIq2XxsGrid[q[l]], iq_signs8((aux >> (7 * l)) & 127), db, 0.0f});
        }
    } else if constexpr (TYPE == SPECTER_TYPE_IQ2_XS) {
        // f16 d; uint16 qs[32] (9-bit grid index, 7-bit sign index above it); uint8 scales[8] (a nibble per 16)
        const float d = load_half(b);
        for (int ib = 0; ib < 8; ++ib) {
            const int sc = b[66 + ib];
            const float db[2] = {iq_half_step(d, sc & 0x0f, 0.25f), iq_half_step(d, sc >> 4, 0.25f)};
            for (int l = 0; l < 4; ++l) {
                const int q = iq_u16(b + 2 + 8 * ib + 2 * l);
                group(4 * ib + l, IqGroup{kIq2XsGrid[q & 511], iq_signs8(uint32_t(q) >> 9), db[l / 2], 0.0f});
            }
        }
    } else if constexpr (TYPE == SPECTER_TYPE_IQ2_S) {
        // f16 d; uint8 qs[32] (grid index low bytes); uint8 signs[32]; uint8 qh[8] (two high index bits each);
        // uint8 scales[8] as IQ2_XS's
        const float d = load_half(b);
        const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *scales = b + 74;
        for (int ib = 0; ib < 8; ++ib) {
            const float db[2] = {iq_half_step(d, scales[ib] & 0x0f, 0.25f), iq_half_step(d, scales[ib] >> 4, 0.25f)};
            for (int l = 0; l < 4; ++l) {
                const int idx = qs[4 * ib + l] | (((qh[ib] >> (2 * l)) & 3) << 8);
                group(4 * ib + l, IqGroup{kIq2SGrid[idx], signs[4 * ib + l], db[l / 2], 0.0f});
            }
        }
    } else if constexpr (TYPE == SPECTER_TYPE_IQ3_XXS) {
        // f16 d; uint8 qs[64] (eight grid indices per sub-block); then a word per sub-block: four 7-bit sign
        // indices and a 4-bit scale s
        const float d = load_half(b);
        for (int ib = 0; ib < 8; ++ib) {
            const uint8_t * q = b + 2 + 8 * ib;
            const uint32_t aux = iq_u32(b + 66 + 4 * ib);
            const float db = iq_half_step(d, aux >> 28, 0.5f);
            for (int l = 0; l < 4; ++l) {
                const uint64_t point = kIq3XxsGrid[q[2 * l]] | uint64_t(kIq3XxsGrid[q[2 * l + 1]]) << 32;
                group(4 * ib + l, IqGroup{point, iq_signs8((aux >> (7 * l)) & 127), db, 0.0f});
            }
        }
    } else if constexpr (TYPE == SPECTER_TYPE_IQ3_S) {
        // f16 d; uint8 qs[64] (grid index low bytes); uint8 qh[8] (bit k of qh[ib]: index k's ninth bit);
        // uint8 signs[32]; uint8 scales[4] (a nibble per sub-block, low first); db = d * (1 + 2 s)
        const float d = load_half(b);
        const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
        for (int ib = 0; ib < 8; ++ib) {
            const float db = d * float(1 + 2 * ((scales[ib / 2] >> (4 * (ib & 1))) & 0x0f));
            for (int l = 0; l < 4; ++l) {
                const int k = 8 * ib + 2 * l;
                const int i0 = qs[k] | (((qh[ib] >> (2 * l)) & 1) << 8);
                const int i1 = qs[k + 1] | (((qh[ib] >> (2 * l + 1)) & 1) << 8);
                group(4 * ib + l, IqGroup{kIq3SGrid[i0] | uint64_t(kIq3SGrid[i1]) << 32, signs[4 * ib + l], db, 0.0f});
            }
        }
    } else if constexpr (TYPE == SPECTER_TYPE_IQ1_S) {
        // f16 d; uint8 qs[32] (grid index low bytes); uint16 qh[8], per sub-block: three high bits per index (index
        // l's at 3 l), a 3-bit scale s at 12 and the delta's sign at 15; dl = d * (2 s + 1)
        const float d = load_half(b);
        for (int ib = 0; ib < 8; ++ib) {
            const int qh = iq_u16(b + 34 + 2 * ib);
            const float dl = d * float(2 * ((qh >> 12) & 7) + 1), delta = qh & 0x8000 ? -0.125f : 0.125f;
            for (int l = 0; l < 4; ++l)
                group(4 * ib + l, IqGroup{kIq1SGrid[b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)], 0, dl, delta});
        }
    } else if constexpr (TYPE == SPECTER_TYPE_IQ1_M) {
        // uint8 qs[32] (grid index low bytes); uint8 qh[16] (a nibble per index: three high bits, then the delta's
        // sign); uint16 scales[4]: a 3-bit scale per 16 weights (four to a word, at 0, 3, 6, 9) and, in the words'
        // top nibbles (the first word's lowest), the f16 d; dl = d * (2 s + 1)
        int sc[4];
        for (int i = 0; i < 4; ++i) sc[i] = iq_u16(b + 48 + 2 * i);
        const float d = half_to_float(uint16_t((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                               (sc[3] & 0xf000)));
        for (int ib = 0; ib < 8; ++ib) {
            const int s6 = sc[ib / 2] >> (6 * (ib & 1));
            const float dl[2] = {d * float(2 * (s6 & 7) + 1), d * float(2 * ((s6 >> 3) & 7) + 1)};
            for (int l = 0; l < 4; ++l) {
                const int h = (b[32 + 2 * ib + l / 2] >> (4 * (l & 1))) & 0x0f;
                group(4 * ib + l,
                      IqGroup{kIq1SGrid[b[4 * ib + l] | ((h & 7) << 8)], 0, dl[l / 2], h & 8 ? -0.125f : 0.125f});
            }
        }
    } else {
        static_assert(TYPE == SPECTER_TYPE_IQ2_XXS, "not an IQ1/IQ2/IQ3 type");
    }
}

// The 8 weights of a group, as the reference decoders round them.
inline void iq_weights8(const IqGroup & q, float * y) {
    for (int j = 0; j < 8; ++j) {
        const float v = q.scale * (float(int8_t(uint8_t(q.point >> (8 * j)))) + q.delta);
        y[j] = (q.signs >> j) & 1 ? -v : v;
    }
}

#ifdef SPECTER_X86_VECTORS
__attribute__((target("avx2"))) inline __m256 iq_weights8_avx2(const IqGroup & q) {
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(int64_t(q.point))));
    const __m256 v = _mm256_mul_ps(_mm256_set1_ps(q.scale), _mm256_add_ps(c, _mm256_set1_ps(q.delta)));
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i negate = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(q.signs), bit), bit);
    return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(negate, 31)));
}
#endif

}  // namespace specter
