// CPU dequantization of GGUF/ggml block formats, written from the block layouts (ggml-common.h).
// Each decoder turns one block into floats with the same float32 operations, in the same order,
// as ggml's reference C code, so results are bit-identical (the build turns FMA contraction off).
#include "dequant_cpu.h"

#include <cstdlib>
#include <cstring>

#include "fp16.h"
#include "iq_groups_cpu.h"
#include "kquants_cpu.h"
#include "vectors_cpu.h"

namespace specter {

namespace {
// SPECTER_CPU_VECTORS: "none" turns the vector code off, "avx2" leaves the AVX-512 paths out.
bool vectors_capped_at(const char * level) {
    const char * cap = std::getenv("SPECTER_CPU_VECTORS");
    return cap && std::strcmp(cap, level) == 0;
}
}  // namespace

bool cpu_avx2() {
#ifdef SPECTER_X86_VECTORS
    static const bool v =
        !vectors_capped_at("none") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    return v;
#else
    return false;
#endif
}

bool cpu_avx512() {
#ifdef SPECTER_X86_VECTORS
    static const bool v = cpu_avx2() && !vectors_capped_at("avx2") && __builtin_cpu_supports("avx512f");
    return v;
#else
    return false;
#endif
}

namespace {

constexpr int QK_K = 256;

// ---- F16, Q8_0, Q4_K, Q6_K and IQ rows with AVX2 where the CPU has it (cpu_avx2) ----------------------
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

// IQ1/IQ2/IQ3 blocks: their 32 groups of 8 weights (iq_groups_cpu.h).
template <int TYPE>
void dec_iq(const uint8_t * b, float * y) {
    iq_groups<TYPE>(b, [y](int g, const IqGroup & q) { iq_weights8(q, y + 8 * g); });
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

// IQ4_NL and IQ4_XS blocks: the decoders' weights, 32 at a time (iq4_weights32).
template <bool XS>
__attribute__((target("avx2"))) void iq4_avx2(const uint8_t * src, float * y, int64_t n_blocks) {
    iq4_runs<XS>(src, n_blocks, [y](int64_t at, const uint8_t * qs, float d) __attribute__((target("avx2"))) {
        __m256 w[4];
        iq4_weights32(qs, d, w);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + at + 8 * i, w[i]);
    });
}

// Q4_K, IQ4_NL and IQ4_XS blocks with AVX-512: a permute of each run's 16 values for every 16 weights.
template <int TYPE>
__attribute__((target("avx512f"))) void runs16_decode_avx512(const uint8_t * b, float * y, int64_t n_blocks) {
    runs16_avx512<TYPE>(b, n_blocks, [y](int64_t at, __m512 values, __m512i q0, __m512i q1)
                                         __attribute__((target("avx512f"))) {
        _mm512_storeu_ps(y + at, _mm512_permutexvar_ps(q0, values));
        _mm512_storeu_ps(y + at + 16, _mm512_permutexvar_ps(q1, values));
    });
}

// IQ1/IQ2/IQ3 blocks of TYPE: each group's 8 weights in one vector (iq_weights8_avx2).
template <int TYPE>
__attribute__((target("avx2"))) void iq_grid_avx2(const uint8_t * src, float * y, int64_t n_blocks) {
    for (int64_t b = 0; b < n_blocks; ++b, src += iq_block_bytes(TYPE), y += QK_K)
        iq_groups<TYPE>(src, [y](int g, const IqGroup & q) __attribute__((target("avx2"))) {
            _mm256_storeu_ps(y + 8 * g, iq_weights8_avx2(q));
        });
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
    {SPECTER_TYPE_IQ2_XXS, QK_K, iq_block_bytes(SPECTER_TYPE_IQ2_XXS), dec_iq<SPECTER_TYPE_IQ2_XXS>},
    {SPECTER_TYPE_IQ2_XS, QK_K, iq_block_bytes(SPECTER_TYPE_IQ2_XS), dec_iq<SPECTER_TYPE_IQ2_XS>},
    {SPECTER_TYPE_IQ2_S, QK_K, iq_block_bytes(SPECTER_TYPE_IQ2_S), dec_iq<SPECTER_TYPE_IQ2_S>},
    {SPECTER_TYPE_IQ3_XXS, QK_K, iq_block_bytes(SPECTER_TYPE_IQ3_XXS), dec_iq<SPECTER_TYPE_IQ3_XXS>},
    {SPECTER_TYPE_IQ3_S, QK_K, iq_block_bytes(SPECTER_TYPE_IQ3_S), dec_iq<SPECTER_TYPE_IQ3_S>},
    {SPECTER_TYPE_IQ1_S, QK_K, iq_block_bytes(SPECTER_TYPE_IQ1_S), dec_iq<SPECTER_TYPE_IQ1_S>},
    {SPECTER_TYPE_IQ1_M, QK_K, iq_block_bytes(SPECTER_TYPE_IQ1_M), dec_iq<SPECTER_TYPE_IQ1_M>},
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
    if (cpu_avx512()) {
        switch (t.type) {
            case SPECTER_TYPE_Q4_K: return runs16_decode_avx512<SPECTER_TYPE_Q4_K>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ4_NL: return runs16_decode_avx512<SPECTER_TYPE_IQ4_NL>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ4_XS: return runs16_decode_avx512<SPECTER_TYPE_IQ4_XS>(src, dst, n_blocks);
            default: break;
        }
    }
    if (cpu_avx2()) {
        switch (t.type) {
            case SPECTER_TYPE_Q8_0: return q8_0_avx2(src, dst, n_blocks);
            case SPECTER_TYPE_Q4_K: return q4_k_avx2(src, dst, n_blocks);
            case SPECTER_TYPE_Q6_K: return q6_k_avx2(src, dst, n_blocks);
            case SPECTER_TYPE_IQ4_NL: return iq4_avx2<false>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ4_XS: return iq4_avx2<true>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ2_XXS: return iq_grid_avx2<SPECTER_TYPE_IQ2_XXS>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ2_XS: return iq_grid_avx2<SPECTER_TYPE_IQ2_XS>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ2_S: return iq_grid_avx2<SPECTER_TYPE_IQ2_S>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ3_XXS: return iq_grid_avx2<SPECTER_TYPE_IQ3_XXS>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ3_S: return iq_grid_avx2<SPECTER_TYPE_IQ3_S>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ1_S: return iq_grid_avx2<SPECTER_TYPE_IQ1_S>(src, dst, n_blocks);
            case SPECTER_TYPE_IQ1_M: return iq_grid_avx2<SPECTER_TYPE_IQ1_M>(src, dst, n_blocks);
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
