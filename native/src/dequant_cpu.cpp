// CPU dequantization of GGUF/ggml block formats, written from the block layouts (ggml-common.h).
// Each decoder turns one block into floats with the same float32 operations, in the same order,
// as ggml's reference C code, so results are bit-identical (the build turns FMA contraction off).
#include "dequant_cpu.h"

#include <cstdlib>
#include <cstring>

#include "fp16.h"
#include "iq_grids.h"
#include "kquants_cpu.h"
#include "vectors_cpu.h"

namespace specter {

bool cpu_avx2() {
#ifdef SPECTER_X86_VECTORS
    static const bool v = [] {
        const char * cap = std::getenv("SPECTER_CPU_VECTORS");
        if (cap && std::strcmp(cap, "none") == 0) return false;
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }();
    return v;
#else
    return false;
#endif
}

namespace {

constexpr int QK_K = 256;

// ---- F16, Q8_0, Q4_K, Q6_K and IQ4 rows with AVX2 where the CPU has it (cpu_avx2) --------------------
// The conversions are exact (half to float, int8 to float) and each weight takes the scalar decoder's float
// operations: the same bits, several times faster (the scalar half conversion is a dozen integer operations).

#ifdef SPECTER_X86_VECTORS
// The instructions quiet a signalling NaN; a vector holding a NaN takes the scalar conversion, which keeps the
// payload as numpy (and gguf's reference) does.
__attribute__((target("avx2,f16c"))) int64_t halfs_avx2(const uint16_t * h, float * y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(h + i)));
        if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)))
            for (int j = 0; j < 8; ++j) y[i + j] = half_to_float(h[i + j]);
        else
            _mm256_storeu_ps(y + i, f);
    }
    return i;
}

__attribute__((target("avx2"))) void q8_0_avx2(const uint8_t * src, float * y, int64_t n_blocks) {
    for (int64_t b = 0; b < n_blocks; ++b, src += 34, y += 32) {
        const __m256 d = _mm256_set1_ps(load_half(src));
        for (int j = 0; j < 4; ++j) {
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(src + 2 + 8 * j));
            _mm256_storeu_ps(y + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
        }
    }
}
#endif

// Converts n halfs: the vector path takes whole vectors, the scalar loop the rest.
void halfs_to_floats(const uint16_t * h, float * y, int64_t n) {
    int64_t i = 0;
#ifdef SPECTER_X86_VECTORS
    if (cpu_avx2()) i = halfs_avx2(h, y, n);
#endif
    for (; i < n; ++i) y[i] = half_to_float(h[i]);
}

void dec_f32(const uint8_t * b, float * y) { std::memcpy(y, b, 4); }

void dec_f16(const uint8_t * b, float * y) { y[0] = load_half(b); }

void dec_bf16(const uint8_t * b, float * y) {
    uint16_t h;
    std::memcpy(&h, b, 2);
    y[0] = bits_to_float(uint32_t(h) << 16);
}

// block_q4_0: f16 d; uint8 qs[16]. Element l in low nibbles, l+16 in high nibbles.
void dec_q4_0(const uint8_t * b, float * y) {
    const float d = load_half(b);
    const uint8_t * qs = b + 2;
    for (int l = 0; l < 16; ++l) {
        y[l] = d * float(int(qs[l] & 0x0f) - 8);
        y[l + 16] = d * float(int(qs[l] >> 4) - 8);
    }
}

// block_q4_1: f16 d; f16 m; uint8 qs[16]. As Q4_0, value q*d + m (q unsigned).
void dec_q4_1(const uint8_t * b, float * y) {
    const float d = load_half(b);
    const float m = load_half(b + 2);
    const uint8_t * qs = b + 4;
    for (int l = 0; l < 16; ++l) {
        y[l] = float(qs[l] & 0x0f) * d + m;
        y[l + 16] = float(qs[l] >> 4) * d + m;
    }
}

// block_q5_0: f16 d; uint8 qh[4] (a little-endian uint32: bit j is the fifth bit of element j);
// uint8 qs[16] as Q4_0. Value (q - 16) * d.
void dec_q5_0(const uint8_t * b, float * y) {
    const float d = load_half(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t * qs = b + 6;
    for (int l = 0; l < 16; ++l) {
        const int h0 = int((qh >> l) & 1) << 4, h1 = int((qh >> (l + 16)) & 1) << 4;
        y[l] = float(int((qs[l] & 0x0f) | h0) - 16) * d;
        y[l + 16] = float(int((qs[l] >> 4) | h1) - 16) * d;
    }
}

// block_q5_1: f16 d; f16 m; uint8 qh[4]; uint8 qs[16]. As Q5_0 without the offset, value q*d + m.
void dec_q5_1(const uint8_t * b, float * y) {
    const float d = load_half(b);
    const float m = load_half(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const uint8_t * qs = b + 8;
    for (int l = 0; l < 16; ++l) {
        const int h0 = int((qh >> l) & 1) << 4, h1 = int((qh >> (l + 16)) & 1) << 4;
        y[l] = float((qs[l] & 0x0f) | h0) * d + m;
        y[l + 16] = float((qs[l] >> 4) | h1) * d + m;
    }
}

// block_q8_0: f16 d; int8 qs[32].
void dec_q8_0(const uint8_t * b, float * y) {
    const float d = load_half(b);
    const int8_t * qs = reinterpret_cast<const int8_t *>(b + 2);
    for (int l = 0; l < 32; ++l) y[l] = float(qs[l]) * d;
}

// block_iq4_nl: f16 d; uint8 qs[16] laid out as Q4_0's. Value d * level[q] (kIq4Levels).
void dec_iq4_nl(const uint8_t * b, float * y) {
    const float d = load_half(b);
    const uint8_t * qs = b + 2;
    for (int l = 0; l < 16; ++l) {
        y[l] = d * float(kIq4Levels[qs[l] & 0x0f]);
        y[l + 16] = d * float(kIq4Levels[qs[l] >> 4]);
    }
}

// block_iq4_xs: f16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]. Sub-block j of 32 elements: its quants the
// 16 bytes at 16 j laid out as IQ4_NL's, value iq4_xs_scale(j) * level[q].
void dec_iq4_xs(const uint8_t * b, float * y) {
    const float d = load_half(b);
    for (int j = 0; j < QK_K / 32; ++j) {
        const float dl = iq4_xs_scale(b, d, j);
        const uint8_t * qs = b + 8 + 16 * j;
        for (int l = 0; l < 16; ++l) {
            y[32 * j + l] = dl * float(kIq4Levels[qs[l] & 0x0f]);
            y[32 * j + l + 16] = dl * float(kIq4Levels[qs[l] >> 4]);
        }
    }
}

// ---- IQ1/IQ2/IQ3: weights as points of a codebook (iq_grids.h) -------------------------------------------------
// Every block holds 256 weights in eight sub-blocks of 32; groups of 8 (IQ3: 4) weights are one grid point each,
// times a sub-block scale, with a sign per weight (IQ1: plus a shift of +-1/8 instead of signs).

const uint64_t kIq2XxsGrid[256] = SPECTER_IQ2_XXS_GRID;
const uint64_t kIq2XsGrid[512] = SPECTER_IQ2_XS_GRID;
const uint64_t kIq2SGrid[1024] = SPECTER_IQ2_S_GRID;
const uint32_t kIq3XxsGrid[256] = SPECTER_IQ3_XXS_GRID;
const uint32_t kIq3SGrid[512] = SPECTER_IQ3_S_GRID;
const uint64_t kIq1SGrid[2048] = SPECTER_IQ1_S_GRID;
constexpr float kIq1Delta = 0.125f;

// Coordinate j of a grid point (a word of byte coordinates, lowest first).
inline int coord(uint64_t point, int j) { return int((point >> (8 * j)) & 0xff); }
inline int coord_s8(uint64_t point, int j) { return int(int8_t(uint8_t(point >> (8 * j)))); }

// The 8 signs of a 7-bit sign index: bit j of the index negates weight j, and weight 7 takes the bit that makes the
// number of negated weights even.
inline int signs8(uint32_t index7) { return int(index7 | (uint32_t(__builtin_popcount(index7) & 1) << 7)); }

inline float with_sign(float v, int signs, int j) { return (signs >> j) & 1 ? -v : v; }

inline uint32_t load_u32(const uint8_t * p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}
inline int load_u16(const uint8_t * p) { return p[0] | (p[1] << 8); }

// 8 weights db * point * sign (IQ2 types).
inline void iq2_group(uint64_t point, int signs, float db, float * y) {
    for (int j = 0; j < 8; ++j) y[j] = with_sign(db * float(coord(point, j)), signs, j);
}

// block_iq2_xxs: f16 d; then per sub-block two words: four grid indices (bytes), and four 7-bit sign indices with
// the 4-bit scale s on top; db = d * (0.5 + s) / 4.
void dec_iq2_xxs(const uint8_t * b, float * y) {
    const float d = load_half(b);
    for (int ib = 0; ib < 8; ++ib) {
        const uint8_t * q = b + 2 + 8 * ib;
        const uint32_t aux = load_u32(q + 4);
        const float db = d * (0.5f + float(aux >> 28)) * 0.25f;
        for (int l = 0; l < 4; ++l) iq2_group(kIq2XxsGrid[q[l]], signs8((aux >> (7 * l)) & 127), db, y + 32 * ib + 8 * l);
    }
}

// block_iq2_xs: f16 d; uint16 qs[32] (9-bit grid index, 7-bit sign index above it); uint8 scales[8] (a nibble
// per 16 weights, low first); db = d * (0.5 + s) / 4.
void dec_iq2_xs(const uint8_t * b, float * y) {
    const float d = load_half(b);
    for (int ib = 0; ib < 8; ++ib) {
        const int sc = b[66 + ib];
        const float db[2] = {d * (0.5f + float(sc & 0x0f)) * 0.25f, d * (0.5f + float(sc >> 4)) * 0.25f};
        for (int l = 0; l < 4; ++l) {
            const int q = load_u16(b + 2 + 2 * (4 * ib + l));
            iq2_group(kIq2XsGrid[q & 511], signs8(uint32_t(q) >> 9), db[l / 2], y + 32 * ib + 8 * l);
        }
    }
}

// block_iq2_s: f16 d; uint8 qs[32] (grid index low bytes); uint8 signs[32] (a byte per 8 weights); uint8 qh[8]
// (two high bits per index); uint8 scales[8] as IQ2_XS's.
void dec_iq2_s(const uint8_t * b, float * y) {
    const float d = load_half(b);
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *scales = b + 74;
    for (int ib = 0; ib < 8; ++ib) {
        const float db[2] = {d * (0.5f + float(scales[ib] & 0x0f)) * 0.25f, d * (0.5f + float(scales[ib] >> 4)) * 0.25f};
        for (int l = 0; l < 4; ++l) {
            const int idx = qs[4 * ib + l] | (((qh[ib] >> (2 * l)) & 3) << 8);
            iq2_group(kIq2SGrid[idx], signs[4 * ib + l], db[l / 2], y + 32 * ib + 8 * l);
        }
    }
}

// 8 weights db * point * sign from two 4-coordinate points (IQ3 types).
inline void iq3_group(uint32_t p0, uint32_t p1, int signs, float db, float * y) {
    for (int j = 0; j < 4; ++j) {
        y[j] = with_sign(db * float(coord(p0, j)), signs, j);
        y[j + 4] = with_sign(db * float(coord(p1, j)), signs, j + 4);
    }
}

// block_iq3_xxs: f16 d; uint8 qs[64] (grid indices, 8 per sub-block); then a word per sub-block: four 7-bit sign
// indices and the 4-bit scale s on top; db = d * (0.5 + s) / 2.
void dec_iq3_xxs(const uint8_t * b, float * y) {
    const float d = load_half(b);
    for (int ib = 0; ib < 8; ++ib) {
        const uint8_t * q = b + 2 + 8 * ib;
        const uint32_t aux = load_u32(b + 66 + 4 * ib);
        const float db = d * (0.5f + float(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; ++l)
            iq3_group(kIq3XxsGrid[q[2 * l]], kIq3XxsGrid[q[2 * l + 1]], signs8((aux >> (7 * l)) & 127), db,
                      y + 32 * ib + 8 * l);
    }
}

// block_iq3_s: f16 d; uint8 qs[64] (grid index low bytes); uint8 qh[8] (bit k of qh[ib]: index k's ninth bit);
// uint8 signs[32]; uint8 scales[4] (a nibble per sub-block, low first); db = d * (1 + 2 s).
void dec_iq3_s(const uint8_t * b, float * y) {
    const float d = load_half(b);
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
    for (int ib = 0; ib < 8; ++ib) {
        const float db = d * float(1 + 2 * ((scales[ib / 2] >> (4 * (ib & 1))) & 0x0f));
        for (int l = 0; l < 4; ++l) {
            const int k = 8 * ib + 2 * l;
            const int i0 = qs[k] | (((qh[ib] >> (2 * l)) & 1) << 8), i1 = qs[k + 1] | (((qh[ib] >> (2 * l + 1)) & 1) << 8);
            iq3_group(kIq3SGrid[i0], kIq3SGrid[i1], signs[4 * ib + l], db, y + 32 * ib + 8 * l);
        }
    }
}

// 8 weights dl * (point + delta), the point's coordinates -1, 0, 1 (IQ1 types).
inline void iq1_group(uint64_t point, float dl, float delta, float * y) {
    for (int j = 0; j < 8; ++j) y[j] = dl * (float(coord_s8(point, j)) + delta);
}

// block_iq1_s: f16 d; uint8 qs[32] (grid index low bytes); uint16 qh[8], per sub-block: three high bits per index
// (index l's at 3 l), the 3-bit scale s at 12 and the delta's sign at 15; dl = d * (2 s + 1).
void dec_iq1_s(const uint8_t * b, float * y) {
    const float d = load_half(b);
    for (int ib = 0; ib < 8; ++ib) {
        const int qh = load_u16(b + 34 + 2 * ib);
        const float dl = d * float(2 * ((qh >> 12) & 7) + 1);
        const float delta = qh & 0x8000 ? -kIq1Delta : kIq1Delta;
        for (int l = 0; l < 4; ++l)
            iq1_group(kIq1SGrid[b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)], dl, delta, y + 32 * ib + 8 * l);
    }
}

// block_iq1_m: uint8 qs[32] (grid index low bytes); uint8 qh[16] (a nibble per index: three high bits and the
// delta's sign); uint16 scales[4]: a 3-bit scale per 16 weights (four to a word, at 0, 3, 6, 9) and, in the top
// nibbles of the four words (first word's lowest), the f16 d. dl = d * (2 s + 1).
void dec_iq1_m(const uint8_t * b, float * y) {
    int sc[4];
    for (int i = 0; i < 4; ++i) sc[i] = load_u16(b + 48 + 2 * i);
    const uint16_t dh = uint16_t((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
    const float d = half_to_float(dh);
    for (int ib = 0; ib < 8; ++ib) {
        for (int l = 0; l < 4; ++l) {
            const int h = (b[32 + 2 * ib + l / 2] >> (4 * (l & 1))) & 0x0f;
            const float dl = d * float(2 * ((sc[ib / 2] >> (6 * (ib & 1) + 3 * (l / 2))) & 7) + 1);
            iq1_group(kIq1SGrid[b[4 * ib + l] | ((h & 7) << 8)], dl, h & 8 ? -kIq1Delta : kIq1Delta, y + 32 * ib + 8 * l);
        }
    }
}

// block_q2_K: uint8 scales[16] (low nibble scale, high nibble min); uint8 qs[64]; f16 d; f16 dmin.
// Element j*128 + s*32 + l is bits 2s..2s+1 of qs[j*32 + l]; sub-block of 16 = element / 16.
void dec_q2_k(const uint8_t * b, float * y) {
    const uint8_t * sc = b;
    const uint8_t * qs = b + 16;
    const float d = load_half(b + 80);
    const float dmin = load_half(b + 82);
    float dl[16], ml[16];
    for (int i = 0; i < 16; ++i) {
        dl[i] = d * float(sc[i] & 0x0f);
        ml[i] = dmin * float(sc[i] >> 4);
    }
    for (int j = 0; j < 2; ++j)
        for (int s = 0; s < 4; ++s)
            for (int l = 0; l < 32; ++l) {
                const int idx = j * 128 + s * 32 + l;
                const int q = (qs[j * 32 + l] >> (2 * s)) & 3;
                y[idx] = dl[idx >> 4] * float(q) - ml[idx >> 4];
            }
}

// block_q3_K: uint8 hmask[32]; uint8 qs[64]; uint8 scales[12] (16 packed 6-bit scales); f16 d.
// Element j*128 + s*32 + l: low 2 bits from qs[j*32 + l] at bit 2s, high bit from hmask[l] at bit
// j*4 + s; a clear high bit subtracts 4.
void dec_q3_k(const uint8_t * b, float * y) {
    const uint8_t * hm = b;
    const uint8_t * qs = b + 32;
    const uint8_t * sc = b + 96;
    const float d = load_half(b + 108);
    float dl[16];
    for (int i = 0; i < 16; ++i) {
        const int lo = i < 8 ? (sc[i] & 0x0f) : (sc[i - 8] >> 4);
        const int hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        dl[i] = d * float((lo | (hi << 4)) - 32);
    }
    for (int j = 0; j < 2; ++j)
        for (int s = 0; s < 4; ++s)
            for (int l = 0; l < 32; ++l) {
                const int idx = j * 128 + s * 32 + l;
                const int lo = (qs[j * 32 + l] >> (2 * s)) & 3;
                const int hb = (hm[l] >> (j * 4 + s)) & 1;
                y[idx] = dl[idx >> 4] * float(lo - (hb ? 0 : 4));
            }
}

// block_q4_K: f16 d; f16 dmin; uint8 scales[12]; uint8 qs[128].
// Element c*64 + h*32 + l is nibble h of qs[c*32 + l]; sub-block of 32 = 2c + h.
void dec_q4_k(const uint8_t * b, float * y) {
    const float d = load_half(b);
    const float dmin = load_half(b + 2);
    const uint8_t * sc = b + 4;
    const uint8_t * qs = b + 16;
    for (int c = 0; c < 4; ++c)
        for (int h = 0; h < 2; ++h) {
            int s, m;
            k4_scale_min(sc, 2 * c + h, s, m);
            const float d1 = d * float(s);
            const float m1 = dmin * float(m);
            for (int l = 0; l < 32; ++l)
                y[c * 64 + h * 32 + l] = d1 * float((qs[c * 32 + l] >> (4 * h)) & 0x0f) - m1;
        }
}

#ifdef SPECTER_X86_VECTORS
// Q4_K blocks: per sub-block the scale and offset as dec_q4_k computes them, then d1 * q - m1 rounded twice as
// there (a multiply, then a subtraction).
__attribute__((target("avx2"))) void q4_k_avx2(const uint8_t * b, float * y, int64_t n_blocks) {
    for (int64_t i = 0; i < n_blocks; ++i, b += 144, y += QK_K) {
        const float d = load_half(b), dmin = load_half(b + 2);
        for (int c = 0; c < 4; ++c)
            for (int h = 0; h < 2; ++h) {
                __m256 d1, m1;
                q4_k_sub_block(b, c, h, d, dmin, d1, m1);
                for (int part = 0; part < 4; ++part)
                    _mm256_storeu_ps(y + c * 64 + h * 32 + 8 * part, q4_k_weights8(b, c, h, part, d1, m1));
            }
    }
}
#endif

// block_q5_K: f16 d; f16 dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128].
// As Q4_K, plus a fifth bit for sub-block g from bit g of qh[l].
void dec_q5_k(const uint8_t * b, float * y) {
    const float d = load_half(b);
    const float dmin = load_half(b + 2);
    const uint8_t * sc = b + 4;
    const uint8_t * qh = b + 16;
    const uint8_t * qs = b + 48;
    for (int c = 0; c < 4; ++c)
        for (int h = 0; h < 2; ++h) {
            const int g = 2 * c + h;
            int s, m;
            k4_scale_min(sc, g, s, m);
            const float d1 = d * float(s);
            const float m1 = dmin * float(m);
            for (int l = 0; l < 32; ++l) {
                const int q = ((qs[c * 32 + l] >> (4 * h)) & 0x0f) | (((qh[l] >> g) & 1) << 4);
                y[c * 64 + h * 32 + l] = d1 * float(q) - m1;
            }
        }
}

// block_q6_K: uint8 ql[128]; uint8 qh[64]; int8 scales[16]; f16 d.
// In each half j of 128 elements, byte l (0..31) of qh[j*32..] and bytes l, l+32 of ql[j*64..]
// make the four elements l, l+32, l+64, l+96: low 4 bits from the low nibble of ql[l], ql[l+32],
// then the high nibbles; high 2 bits from qh[l] bits 0-1, 2-3, 4-5, 6-7. Value minus 32;
// sub-block of 16 = element / 16.
void dec_q6_k(const uint8_t * b, float * y) {
    const int8_t * sc = reinterpret_cast<const int8_t *>(b + 192);
    const float d = load_half(b + 208);
    float dl[16];
    for (int i = 0; i < 16; ++i) dl[i] = d * float(sc[i]);
    for (int j = 0; j < 2; ++j) {
        const uint8_t * ql = b + j * 64;
        const uint8_t * qh = b + 128 + j * 32;
        float * yj = y + j * 128;
        const float * dj = dl + j * 8;
        for (int l = 0; l < 32; ++l) {
            const int g = l >> 4;
            yj[l] = dj[g] * float(((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32);
            yj[l + 32] = dj[g + 2] * float(((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32);
            yj[l + 64] = dj[g + 4] * float(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            yj[l + 96] = dj[g + 6] * float(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

#ifdef SPECTER_X86_VECTORS
// Q6_K blocks: the four 6-bit quants of each byte triple as dec_q6_k assembles them, each weight the sub-block's
// d * scale times (q - 32), one float multiply as there. A step takes 8 consecutive l of a half block, within one
// sub-block.
__attribute__((target("avx2"))) void q6_k_avx2(const uint8_t * b, float * y, int64_t n_blocks) {
    for (int64_t i = 0; i < n_blocks; ++i, b += 210, y += QK_K) {
        const int8_t * sc = reinterpret_cast<const int8_t *>(b + 192);
        const float d = load_half(b + 208);
        for (int j = 0; j < 2; ++j)
            for (int l = 0; l < 32; l += 8) {
                __m128i q[4];
                q6_quants(b, j, l, q);
                for (int k = 0; k < 4; ++k) {
                    const float dl = d * float(sc[j * 8 + (l >> 4) + 2 * k]);
                    _mm256_storeu_ps(y + j * 128 + k * 32 + l, q6_k_weights8(q[k], dl));
                }
            }
    }
}

// IQ4_NL and IQ4_XS blocks (kBlock elements, kBytes bytes): the decoders' weights, 32 at a time (iq4_weights32).
template <bool XS>
__attribute__((target("avx2"))) void iq4_avx2(const uint8_t * src, float * y, int64_t n_blocks) {
    constexpr int kBlock = XS ? QK_K : 32, kBytes = XS ? 136 : 18;
    for (int64_t b = 0; b < n_blocks; ++b, src += kBytes, y += kBlock) {
        const float d = load_half(src);
        for (int j = 0; j < kBlock / 32; ++j) {
            __m256 w[4];
            iq4_weights32(src + (XS ? 8 + 16 * j : 2), XS ? iq4_xs_scale(src, d, j) : d, w);
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 32 * j + 8 * i, w[i]);
        }
    }
}
#endif

const TypeInfo kTypes[] = {
    {SPECTER_TYPE_F32, 1, 4, dec_f32},
    {SPECTER_TYPE_F16, 1, 2, dec_f16},
    {SPECTER_TYPE_BF16, 1, 2, dec_bf16},
    {SPECTER_TYPE_Q4_0, 32, 18, dec_q4_0},
    {SPECTER_TYPE_Q4_1, 32, 20, dec_q4_1},
    {SPECTER_TYPE_Q5_0, 32, 22, dec_q5_0},
    {SPECTER_TYPE_Q5_1, 32, 24, dec_q5_1},
    {SPECTER_TYPE_Q8_0, 32, 34, dec_q8_0},
    {SPECTER_TYPE_Q2_K, QK_K, 84, dec_q2_k},
    {SPECTER_TYPE_Q3_K, QK_K, 110, dec_q3_k},
    {SPECTER_TYPE_Q4_K, QK_K, 144, dec_q4_k},
    {SPECTER_TYPE_Q5_K, QK_K, 176, dec_q5_k},
    {SPECTER_TYPE_Q6_K, QK_K, 210, dec_q6_k},
    {SPECTER_TYPE_IQ4_NL, 32, 18, dec_iq4_nl},
    {SPECTER_TYPE_IQ4_XS, QK_K, 136, dec_iq4_xs},
    {SPECTER_TYPE_IQ2_XXS, QK_K, 66, dec_iq2_xxs},
    {SPECTER_TYPE_IQ2_XS, QK_K, 74, dec_iq2_xs},
    {SPECTER_TYPE_IQ2_S, QK_K, 82, dec_iq2_s},
    {SPECTER_TYPE_IQ3_XXS, QK_K, 98, dec_iq3_xxs},
    {SPECTER_TYPE_IQ3_S, QK_K, 110, dec_iq3_s},
    {SPECTER_TYPE_IQ1_S, QK_K, 50, dec_iq1_s},
    {SPECTER_TYPE_IQ1_M, QK_K, 56, dec_iq1_m},
};

}  // namespace

const TypeInfo * find_type(int type) {
    for (const TypeInfo & t : kTypes)
        if (t.type == type) return &t;
    return nullptr;
}

void dequantize_rows_f32(const TypeInfo & t, const uint8_t * src, float * dst, int64_t n_rows,
                         int64_t row_len) {
    const int64_t n = n_rows * row_len;
    if (t.type == SPECTER_TYPE_F32) {
        std::memcpy(dst, src, size_t(n) * 4);
        return;
    }
    if (t.type == SPECTER_TYPE_F16 || t.type == SPECTER_TYPE_BF16) {  // tight loops, no per-element call
        const bool bf = t.type == SPECTER_TYPE_BF16;
        constexpr int64_t kChunk = 4096;
        uint16_t h[kChunk];
        for (int64_t e0 = 0; e0 < n; e0 += kChunk) {
            const int64_t ne = n - e0 < kChunk ? n - e0 : kChunk;
            std::memcpy(h, src + e0 * 2, size_t(ne) * 2);
            if (bf)
                for (int64_t i = 0; i < ne; ++i) dst[e0 + i] = bits_to_float(uint32_t(h[i]) << 16);
            else
                halfs_to_floats(h, dst + e0, ne);
        }
        return;
    }
    const int64_t n_blocks = n / t.block_elems;
#ifdef SPECTER_X86_VECTORS
    if (cpu_avx2()) {
        switch (t.type) {
            case SPECTER_TYPE_Q8_0: return q8_0_avx2(src, dst, n_blocks);
            case SPECTER_TYPE_Q4_K: return q4_k_avx2(src, dst, n_blocks);
            case SPECTER_TYPE_Q6_K: return q6_k_avx2(src, dst, n_blocks);
            case SPECTER_TYPE_IQ4_NL: return iq4_avx2<false>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ4_XS: return iq4_avx2<true>(src, dst, n_blocks);
            default: break;
        }
    }
#endif
    for (int64_t i = 0; i < n_blocks; ++i) t.decode(src + i * t.block_bytes, dst + i * t.block_elems);
}

void dequantize_rows_f16(const TypeInfo & t, const uint8_t * src, uint16_t * dst, int64_t n_rows,
                         int64_t row_len) {
    const int64_t n = n_rows * row_len;
    if (t.type == SPECTER_TYPE_F16) {
        std::memcpy(dst, src, size_t(n) * 2);
        return;
    }
    constexpr int64_t kChunk = 1024;  // a multiple of every block size
    float tmp[kChunk];
    for (int64_t e0 = 0; e0 < n; e0 += kChunk) {
        const int64_t ne = n - e0 < kChunk ? n - e0 : kChunk;  // a whole number of blocks
        const int64_t nb = ne / t.block_elems;
        const uint8_t * s = src + (e0 / t.block_elems) * t.block_bytes;
        for (int64_t i = 0; i < nb; ++i) t.decode(s + i * t.block_bytes, tmp + i * t.block_elems);
        for (int64_t i = 0; i < ne; ++i) dst[e0 + i] = float_to_half(tmp[i]);
    }
}

}  // namespace specter
