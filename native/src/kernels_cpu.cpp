// CPU reference implementation of specter_kernels.h: row gather, Y = X.W^T and the grouped MoE
// feed-forward over GGUF-typed weights, and the fused ops of a decode step. Each weight row is
// dequantized (bit-exact with ggml) into a float buffer once per call and dotted with every row of X
// that needs it, in float32 with a fixed summation order, so results do not depend on the thread count
// or on how many rows of X a call has; a row that meets four rows of X or fewer is decoded in registers
// instead where the type and the CPU allow (F16, BF16, Q8_0, Q4_K, Q6_K and the IQ types with AVX2, Q4_K and IQ4
// with AVX-512: `RowDots`), with the same bits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <new>
#include <utility>
#include <vector>

#include "dequant_cpu.h"
#include "fp16.h"
#include "iq_groups_cpu.h"
#include "kernels_common.h"
#include "kquants_cpu.h"
#include "specter_kernels.h"
#include "threads_cpu.h"
#include "vectors_cpu.h"

namespace specter {
namespace {

// The 16 partial sums of a dot product, folded in a fixed order.
inline float fold16(float * acc) {
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
    return acc[0];
}

// float32 dot product with 16 independent partial sums (vectorizes; fixed order): lane j sums the products of
// the elements i = j mod 16 in order, each product rounded before it is added (no FMA), the tail goes to lanes
// 0, 1, ...
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64))
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
float dot_f32(const float * a, const float * b, int64_t k) {
    float acc[16] = {0.f};
    int64_t i = 0;
    for (; i + 16 <= k; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
    for (int64_t j = 0; i + j < k; ++j) acc[j] += a[i + j] * b[i + j];
    return fold16(acc);
}

// ---- one weight row dotted with up to four rows of x, decoded in registers --------------------------------
// For each row of x, dot_f32 of the dequantized row bit for bit (the same lanes, order and rounding), without
// writing the row out: F16, BF16, Q8_0, Q4_K, Q6_K and the IQ types with AVX2. A step covers x row t's 16 lanes
// with two 8-lane sums acc[t][0..1]; each decoded group of 8 weights serves all N rows of x.
#ifdef SPECTER_X86_VECTORS
__attribute__((target("avx2,f16c"))) inline __m256 halfs8_avx2(const uint16_t * h, bool bf) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(h));
    return bf ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)) : _mm256_cvtph_ps(raw);
}

// acc += w * x, the product rounded before it is added (no FMA: dot_f32's rounding).
__attribute__((target("avx2"))) inline void add_product(__m256 & acc, __m256 w, const float * x) {
    acc = _mm256_add_ps(acc, _mm256_mul_ps(w, _mm256_loadu_ps(x)));
}

// fold16 of the 16 lanes of two 8-lane sums, after the products of the elements past the last full step
// (`tail`: their decoded weights, `x` from there on, n of them) went into lanes 0, 1, ...
__attribute__((target("avx2"))) inline float fold16_avx2(const __m256 (&acc)[2], const float * tail = nullptr,
                                                        const float * x = nullptr, int64_t n = 0) {
    float lanes[16];
    _mm256_storeu_ps(lanes, acc[0]);
    _mm256_storeu_ps(lanes + 8, acc[1]);
    for (int64_t j = 0; j < n; ++j) lanes[j] += tail[j] * x[j];
    return fold16(lanes);
}

template <int N>
__attribute__((target("avx2,f16c"))) void dot_f16_avx2(const uint8_t * w, const float * const * xs, int64_t k,
                                                       bool bf, float * out) {
    const uint16_t * h = reinterpret_cast<const uint16_t *>(w);
    __m256 acc[N][2];
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 lo = halfs8_avx2(h + i, bf), hi = halfs8_avx2(h + i + 8, bf);
        for (int t = 0; t < N; ++t) {
            add_product(acc[t][0], lo, xs[t] + i);
            add_product(acc[t][1], hi, xs[t] + i + 8);
        }
    }
    float tail[16];
    for (int64_t j = 0; i + j < k; ++j)
        tail[j] = bf ? bits_to_float(uint32_t(h[i + j]) << 16) : half_to_float(h[i + j]);
    for (int t = 0; t < N; ++t) out[t] = fold16_avx2(acc[t], tail, xs[t] + i, k - i);
}

// Q8_0: a block's 32 weights (quant times the block's scale, as the decoder rounds it) are two 16-lane steps.
template <int N>
__attribute__((target("avx2"))) void dot_q8_0_avx2(const uint8_t * w, const float * const * xs, int64_t k,
                                                   float * out) {
    __m256 acc[N][2];
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 32, w += 34) {
        const __m256 d = _mm256_set1_ps(load_half(w));
        for (int j = 0; j < 4; ++j) {
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(w + 2 + 8 * j));
            const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
            for (int t = 0; t < N; ++t) add_product(acc[t][j & 1], v, xs[t] + i + 8 * j);
        }
    }
    for (int t = 0; t < N; ++t) out[t] = fold16_avx2(acc[t]);
}

// Q4_K: per sub-block of 32 the scale and offset as the decoder computes them, each weight d1 * q - m1 rounded
// twice as there (a multiply, then a subtraction); a sub-block is two 16-lane steps.
template <int N>
__attribute__((target("avx2"))) void dot_q4_k_avx2(const uint8_t * w, const float * const * xs, int64_t k,
                                                   float * out) {
    __m256 acc[N][2];
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 256, w += 144) {
        const float d = load_half(w), dmin = load_half(w + 2);
        for (int c = 0; c < 4; ++c)
            for (int h = 0; h < 2; ++h) {
                __m256 d1, m1;
                q4_k_sub_block(w, c, h, d, dmin, d1, m1);
                const int64_t at = i + c * 64 + h * 32;
                for (int part = 0; part < 4; ++part) {
                    const __m256 wv = q4_k_weights8(w, c, h, part, d1, m1);
                    for (int t = 0; t < N; ++t) add_product(acc[t][part & 1], wv, xs[t] + at + 8 * part);
                }
            }
    }
    for (int t = 0; t < N; ++t) out[t] = fold16_avx2(acc[t]);
}

// Q6_K: each weight the sub-block's d * scale times (q - 32), one multiply as the decoder does; one triple of byte
// loads gives the quants of 8 consecutive l in each quarter of a half block, taken in the row's order.
template <int N>
__attribute__((target("avx2"))) void dot_q6_k_avx2(const uint8_t * w, const float * const * xs, int64_t k,
                                                   float * out) {
    __m256 acc[N][2];
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 256, w += 210) {
        const int8_t * sc = reinterpret_cast<const int8_t *>(w + 192);
        const float d = load_half(w + 208);
        for (int j = 0; j < 2; ++j) {
            __m128i q[4][4];  // [l / 8][quarter]
            for (int l8 = 0; l8 < 4; ++l8) q6_quants(w, j, 8 * l8, q[l8]);
            for (int quarter = 0; quarter < 4; ++quarter)
                for (int l8 = 0; l8 < 4; ++l8) {
                    const __m256 wv = q6_k_weights8(q[l8][quarter], d * float(sc[j * 8 + l8 / 2 + 2 * quarter]));
                    const int64_t at = i + j * 128 + quarter * 32 + 8 * l8;
                    for (int t = 0; t < N; ++t) add_product(acc[t][l8 & 1], wv, xs[t] + at);
                }
        }
    }
    for (int t = 0; t < N; ++t) out[t] = fold16_avx2(acc[t]);
}

// IQ4_NL and IQ4_XS: each run of 32 weights the decoder's d * level (with IQ4_XS's sub-block scale), two 16-lane
// steps.
template <int N, bool XS>
__attribute__((target("avx2"))) void dot_iq4_avx2(const uint8_t * w, const float * const * xs, int64_t k,
                                                  float * out) {
    __m256 acc[N][2];
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    iq4_runs<XS>(w, k / (XS ? 256 : 32), [&acc, xs](int64_t at, const uint8_t * qs, float d)
                                              __attribute__((target("avx2"))) {
        __m256 wv[4];
        iq4_weights32(qs, d, wv);
        for (int part = 0; part < 4; ++part)
            for (int t = 0; t < N; ++t) add_product(acc[t][part & 1], wv[part], xs[t] + at + 8 * part);
    });
    for (int t = 0; t < N; ++t) out[t] = fold16_avx2(acc[t]);
}

// IQ1/IQ2/IQ3 (iq_groups_cpu.h): each group of 8 weights one vector, the lanes of half a 16-lane step.
template <int N, int TYPE>
__attribute__((target("avx2"))) void dot_iq_grid_avx2(const uint8_t * w, const float * const * xs, int64_t k,
                                                      float * out) {
    __m256 acc[N][2];
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 256, w += iq_block_bytes(TYPE))
        iq_groups<TYPE>(w, [&acc, xs, i](int g, const IqGroup & q) __attribute__((target("avx2"))) {
            const __m256 wv = iq_weights8_avx2(q);
            for (int t = 0; t < N; ++t) add_product(acc[t][g & 1], wv, xs[t] + i + 8 * g);
        });
    for (int t = 0; t < N; ++t) out[t] = fold16_avx2(acc[t]);
}

// A decoded row `a` (dot_f32's own input) dotted with N rows of x: one load of the row's elements serves them all.
template <int N>
__attribute__((target("avx2"))) void dot_f32_avx2(const float * a, const float * const * xs, int64_t k, float * out) {
    __m256 acc[N][2];
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 lo = _mm256_loadu_ps(a + i), hi = _mm256_loadu_ps(a + i + 8);
        for (int t = 0; t < N; ++t) {
            add_product(acc[t][0], lo, xs[t] + i);
            add_product(acc[t][1], hi, xs[t] + i + 8);
        }
    }
    for (int t = 0; t < N; ++t) out[t] = fold16_avx2(acc[t], a + i, xs[t] + i, k - i);
}

// ---- AVX-512: the 4-bit types' weights by table (runs16_avx512, kquants_cpu.h) ------------------------------
// One 16-lane accumulator per row of x: dot_f32's lanes.

// The 16 lanes' sum, folded as dot_f32 folds them.
__attribute__((target("avx512f"))) inline float fold16_avx512(__m512 acc) {
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    return fold16(lanes);
}

// acc[t] += values[q] * x[t], the product rounded before it is added, for the 16 quants q.
template <int N>
__attribute__((target("avx512f"))) inline void add_step_avx512(__m512 (&acc)[N], __m512 values, __m512i q,
                                                              const float * const * xs, int64_t at) {
    const __m512 wv = _mm512_permutexvar_ps(q, values);
    for (int t = 0; t < N; ++t) acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(wv, _mm512_loadu_ps(xs[t] + at)));
}

// Q4_K, IQ4_NL and IQ4_XS rows: two 16-lane steps a run.
template <int N, int TYPE>
__attribute__((target("avx512f"))) void dot_runs16_avx512(const uint8_t * w, const float * const * xs, int64_t k,
                                                         float * out) {
    __m512 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    runs16_avx512<TYPE>(w, k / (TYPE == SPECTER_TYPE_IQ4_NL ? 32 : 256),
                        [&acc, xs](int64_t at, __m512 values, __m512i q0, __m512i q1)
                            __attribute__((target("avx512f"))) {
        add_step_avx512<N>(acc, values, q0, xs, at);
        add_step_avx512<N>(acc, values, q1, xs, at + 16);
    });
    for (int t = 0; t < N; ++t) out[t] = fold16_avx512(acc[t]);
}

// The AVX-512 dot of a weight row of type `type` with N rows of x; false where the type has none (AVX2's serves).
template <int N>
bool dot_row_avx512(int type, const uint8_t * w, const float * const * xs, int64_t k, float * out) {
    switch (type) {
        case SPECTER_TYPE_Q4_K: dot_runs16_avx512<N, SPECTER_TYPE_Q4_K>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ4_NL: dot_runs16_avx512<N, SPECTER_TYPE_IQ4_NL>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ4_XS: dot_runs16_avx512<N, SPECTER_TYPE_IQ4_XS>(w, xs, k, out); return true;
        default: return false;
    }
}

// The fused dot of a weight row of type `type` with N rows of x; false where the type has none.
template <int N>
bool dot_row_avx2(int type, const uint8_t * w, const float * const * xs, int64_t k, float * out) {
    switch (type) {
        case SPECTER_TYPE_F16: dot_f16_avx2<N>(w, xs, k, false, out); return true;
        case SPECTER_TYPE_BF16: dot_f16_avx2<N>(w, xs, k, true, out); return true;
        case SPECTER_TYPE_Q8_0: dot_q8_0_avx2<N>(w, xs, k, out); return true;
        case SPECTER_TYPE_Q4_K: dot_q4_k_avx2<N>(w, xs, k, out); return true;
        case SPECTER_TYPE_Q6_K: dot_q6_k_avx2<N>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ4_NL: dot_iq4_avx2<N, false>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ4_XS: dot_iq4_avx2<N, true>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ2_XXS: dot_iq_grid_avx2<N, SPECTER_TYPE_IQ2_XXS>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ2_XS: dot_iq_grid_avx2<N, SPECTER_TYPE_IQ2_XS>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ2_S: dot_iq_grid_avx2<N, SPECTER_TYPE_IQ2_S>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ3_XXS: dot_iq_grid_avx2<N, SPECTER_TYPE_IQ3_XXS>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ3_S: dot_iq_grid_avx2<N, SPECTER_TYPE_IQ3_S>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ1_S: dot_iq_grid_avx2<N, SPECTER_TYPE_IQ1_S>(w, xs, k, out); return true;
        case SPECTER_TYPE_IQ1_M: dot_iq_grid_avx2<N, SPECTER_TYPE_IQ1_M>(w, xs, k, out); return true;
        default: return false;
    }
}
#endif

// Rows of x handled by one pass over a weight row.
constexpr int kRowsPerPass = 4;

// out[t] = dot_f32(a, xs[t], k) for t < n <= kRowsPerPass.
void dot_f32_rows(const float * a, const float * const * xs, int n, int64_t k, float * out) {
#ifdef SPECTER_X86_VECTORS
    if (cpu_avx2()) {
        switch (n) {
            case 1: return dot_f32_avx2<1>(a, xs, k, out);
            case 2: return dot_f32_avx2<2>(a, xs, k, out);
            case 3: return dot_f32_avx2<3>(a, xs, k, out);
            default: return dot_f32_avx2<4>(a, xs, k, out);
        }
    }
#endif
    for (int t = 0; t < n; ++t) out[t] = dot_f32(a, xs[t], k);
}

// The fused dot of a weight row with n <= kRowsPerPass rows of x; false when neither the type nor the CPU has a
// path (the caller dequantizes the row).
bool dot_row_fused(const TypeInfo & t, const uint8_t * w, const float * const * xs, int n, int64_t k, float * out) {
#ifdef SPECTER_X86_VECTORS
    if (!cpu_avx2()) return false;
    const bool wide = cpu_avx512();
    switch (n) {
        case 1: return (wide && dot_row_avx512<1>(t.type, w, xs, k, out)) || dot_row_avx2<1>(t.type, w, xs, k, out);
        case 2: return (wide && dot_row_avx512<2>(t.type, w, xs, k, out)) || dot_row_avx2<2>(t.type, w, xs, k, out);
        case 3: return (wide && dot_row_avx512<3>(t.type, w, xs, k, out)) || dot_row_avx2<3>(t.type, w, xs, k, out);
        default: return (wide && dot_row_avx512<4>(t.type, w, xs, k, out)) || dot_row_avx2<4>(t.type, w, xs, k, out);
    }
#endif
    (void)t, (void)w, (void)xs, (void)n, (void)k, (void)out;
    return false;
}

// One weight row at a time, dotted with the rows of x that need it, up to kRowsPerPass of them in one pass: each
// product is dot_f32 of the dequantized row. `dot_row_fused` decodes the row in registers in every pass where it
// can if the row is F16 or BF16 (one conversion per 8 weights) or meets no more than kRowsPerPass rows of x in all
// (a decode step, or an expert few tokens chose); a quantized row that meets more is dequantized once into `buf`
// for all its passes (measured faster from 8 rows of x on: 2026-12-05, Q4_K, two cores).
struct RowDots {
    const TypeInfo & t;
    int64_t k;
    std::vector<float> buf;
    const uint8_t * row = nullptr;
    bool decoded = false;

    RowDots(const TypeInfo & type, int64_t row_len) : t(type), k(row_len), buf(size_t(row_len) + 1) {}
    void start(const uint8_t * w) { row = w, decoded = false; }
    // out[i] = the row's dot with xs[i] for i < n <= kRowsPerPass; `meets`: the rows of x this row meets in all
    void dot(const float * const * xs, int n, int64_t meets, float * out) {
        const bool halfs = t.type == SPECTER_TYPE_F16 || t.type == SPECTER_TYPE_BF16;
        if ((halfs || meets <= kRowsPerPass) && dot_row_fused(t, row, xs, n, k, out)) return;
        if (!decoded) dequantize_rows_f32(t, row, buf.data(), 1, k), decoded = true;
        dot_f32_rows(buf.data(), xs, n, k, out);
    }
};

// Work per thread: at least this many weight elements.
constexpr int64_t kMinElems = 1 << 16;

int64_t rows_per_thread(int64_t k) { return std::max<int64_t>(1, kMinElems / std::max<int64_t>(1, k)); }

template <class Fn>
int guarded(Fn fn) {
    try {
        return fn();
    } catch (const std::bad_alloc &) {
        return SPECTER_ERR_OUT_OF_MEMORY;
    } catch (...) {
        return SPECTER_ERR_INTERNAL;
    }
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// 1 / sqrt(mean(s^2) + eps) of n values, the sum of squares in double as ggml's CPU rms_norm.
inline float rms_scale(const float * s, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += double(s[i]) * s[i];
    return float(1.0 / std::sqrt(ss / double(n) + double(eps)));
}

// y = x . w^T, or with `swiglu` y = silu(x . gate^T) * (x . up^T) for w = [gate; up] of 2n rows.
int qmatmul(int w_type, const void * w, int64_t n, int64_t k, int x_type, const void * x, int64_t m, float * y,
            bool swiglu, int n_threads) {
    const TypeInfo * t = nullptr;
    const int rc = check_qmatmul(w_type, w, swiglu ? 2 * n : n, k, x_type, x, m, y, &t);
    if (rc != SPECTER_OK) return rc;
    if (m == 0 || n == 0) return SPECTER_OK;
    return guarded([&] {
        std::vector<float> xf;
        const float * xs = static_cast<const float *>(x);
        if (x_type == SPECTER_TYPE_F16) {
            xf.resize(size_t(m * k));
            const uint16_t * h = static_cast<const uint16_t *>(x);
            for (int64_t i = 0; i < m * k; ++i) xf[size_t(i)] = half_to_float(h[i]);
            xs = xf.data();
        }
        const int64_t rb = row_bytes(*t, k);
        const uint8_t * ws = static_cast<const uint8_t *>(w);
        const int64_t per = std::max<int64_t>(1, rows_per_thread(swiglu ? 2 * k : k) / std::max<int64_t>(1, m));
        parallel_for(n, n_threads, per, [&](int64_t b, int64_t e) {
            RowDots gate(*t, k), up(*t, swiglu ? k : 0);
            for (int64_t r = b; r < e; ++r) {
                gate.start(ws + r * rb);
                if (swiglu) up.start(ws + (n + r) * rb);
                for (int64_t i0 = 0; i0 < m; i0 += kRowsPerPass) {
                    const int c = int(std::min<int64_t>(kRowsPerPass, m - i0));
                    const float * x_rows[kRowsPerPass];
                    for (int j = 0; j < c; ++j) x_rows[j] = xs + (i0 + j) * k;
                    float g[kRowsPerPass], u[kRowsPerPass];
                    gate.dot(x_rows, c, m, g);
                    if (swiglu) up.dot(x_rows, c, m, u);
                    for (int j = 0; j < c; ++j) y[(i0 + j) * n + r] = swiglu ? silu(g[j]) * u[j] : g[j];
                }
            }
        });
        return SPECTER_OK;
    });
}

// The top C of a row of n logits ranked by (sample_key desc, id asc), best first, as the integers key << 32 | ~id
// (one order for both). One pass: a buffer of up to 4C entries is cut back to its best C when it fills, after which
// only a logit above the C-th best so far enters.
void sample_top(const float * x, int64_t n, int64_t C, std::vector<uint64_t> & best) {
    best.clear();
    uint64_t floor = 0;  // every entry is > 0 (keys are >= 1)
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t c = uint64_t(sample_key(x[i])) << 32 | (0xffffffffu - uint32_t(i));
        if (c <= floor) continue;
        best.push_back(c);
        if (best.size() == size_t(4 * C)) {
            std::nth_element(best.begin(), best.begin() + (C - 1), best.end(), std::greater<uint64_t>());
            best.resize(size_t(C));
            floor = best.back();
        }
    }
    std::sort(best.begin(), best.end(), std::greater<uint64_t>());
    best.resize(size_t(C));
}

}  // namespace
}  // namespace specter

using namespace specter;

extern "C" {

int specter_get_rows(int type, const void * src, int64_t n_rows, int64_t row_len, const int32_t * ids,
                     int64_t n_ids, float * dst, int n_threads) {
    const TypeInfo * t = nullptr;
    int rc = check_weight(type, n_rows, row_len, &t);
    if (rc != SPECTER_OK) return rc;
    if (n_ids < 0) return SPECTER_ERR_INVALID_ARG;
    if (n_ids == 0 || row_len == 0) return SPECTER_OK;
    if (!ids || !dst || !src) return SPECTER_ERR_INVALID_ARG;
    return guarded([&] {
        const int64_t rb = row_bytes(*t, row_len);
        const uint8_t * s = static_cast<const uint8_t *>(src);
        parallel_for(n_ids, n_threads, rows_per_thread(row_len), [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) {
                const int64_t r = ids[i];
                float * d = dst + i * row_len;
                if (r < 0 || r >= n_rows)
                    std::fill(d, d + row_len, std::nanf(""));
                else
                    dequantize_rows_f32(*t, s + r * rb, d, 1, row_len);
            }
        });
        return SPECTER_OK;
    });
}

int specter_qmatmul(int w_type, const void * w, int64_t n, int64_t k, int x_type, const void * x, int64_t m,
                    float * y, int algo, int n_threads) {
    (void)algo;
    return qmatmul(w_type, w, n, k, x_type, x, m, y, false, n_threads);
}

int specter_qmatmul_swiglu(int w_type, const void * w, int64_t n, int64_t k, int x_type, const void * x, int64_t m,
                           float * y, int n_threads) {
    return qmatmul(w_type, w, n, k, x_type, x, m, y, true, n_threads);
}

int specter_moe_workspace_size(int64_t n_tokens, int64_t top_k, int64_t n_expert, int64_t d_model, int64_t d_ff,
                               size_t * out_bytes) {
    MoeLayout L;
    if (!out_bytes || !moe_layout(n_tokens, top_k, n_expert, d_model, d_ff, &L)) return SPECTER_ERR_INVALID_ARG;
    *out_bytes = L.total;
    return SPECTER_OK;
}

int specter_moe_ffn(const float * x, int64_t n_tokens, int64_t d_model, const int32_t * ids, const float * weights,
                    int64_t top_k, int64_t n_expert, int64_t d_ff, const uint64_t * gate_ptrs, int gate_type,
                    const uint64_t * up_ptrs, int up_type, const uint64_t * down_ptrs, int down_type,
                    void * workspace, size_t workspace_bytes, float * out, int accumulate, int n_threads) {
    const MoeArgs a{x, n_tokens, d_model, ids, weights, top_k, n_expert, d_ff, gate_ptrs, up_ptrs, down_ptrs,
                    gate_type, up_type, down_type, workspace, workspace_bytes, out, accumulate};
    MoeLayout L;
    const TypeInfo *tg = nullptr, *tu = nullptr, *td = nullptr;
    const int rc = check_moe(a, &L, &tg, &tu, &td);
    if (rc != SPECTER_OK) return rc;
    if (n_tokens == 0 || d_model == 0) return SPECTER_OK;
    return guarded([&] {
        const int64_t P = L.P;
        auto valid = [&](int64_t p) {
            const int64_t e = ids[p];
            return e >= 0 && e < n_expert && gate_ptrs[e] && up_ptrs[e] && down_ptrs[e];
        };
        // Group the pairs by expert (ascending expert, pairs in order inside a group).
        std::vector<int64_t> count(size_t(n_expert) + 1, 0);
        std::vector<int64_t> perm(static_cast<size_t>(P));
        for (int64_t p = 0; p < P; ++p)
            if (valid(p)) ++count[size_t(ids[p]) + 1];
        for (int64_t e = 0; e < n_expert; ++e) count[size_t(e) + 1] += count[size_t(e)];
        std::vector<int64_t> fill(count.begin(), count.end() - 1);
        for (int64_t p = 0; p < P; ++p)
            if (valid(p)) perm[size_t(fill[size_t(ids[p])]++)] = p;
        std::vector<int64_t> groups;  // experts with at least one pair
        for (int64_t e = 0; e < n_expert; ++e)
            if (count[size_t(e) + 1] > count[size_t(e)]) groups.push_back(e);
        const int64_t G = int64_t(groups.size());

        char * ws = static_cast<char *>(workspace);
        float * act = reinterpret_cast<float *>(ws + L.act);
        float * ypair = reinterpret_cast<float *>(ws + L.ypair);
        const int64_t rb_g = row_bytes(*tg, d_model), rb_u = row_bytes(*tu, d_model), rb_d = row_bytes(*td, d_ff);

        // gate/up: one work item = (group, row of d_ff); act = silu(gate . x) * (up . x)
        parallel_for(G * d_ff, n_threads, rows_per_thread(2 * d_model), [&](int64_t b, int64_t e) {
            RowDots gate(*tg, d_model), up(*tu, d_model);
            for (int64_t it = b; it < e; ++it) {
                const int64_t gi = it / d_ff, r = it % d_ff, ex = groups[size_t(gi)];
                const int64_t q0 = count[size_t(ex)], q1 = count[size_t(ex) + 1];
                gate.start(reinterpret_cast<const uint8_t *>(uintptr_t(gate_ptrs[ex])) + r * rb_g);
                up.start(reinterpret_cast<const uint8_t *>(uintptr_t(up_ptrs[ex])) + r * rb_u);
                for (int64_t q = q0; q < q1; q += kRowsPerPass) {
                    const int c = int(std::min<int64_t>(kRowsPerPass, q1 - q));
                    const float * x_rows[kRowsPerPass];
                    for (int j = 0; j < c; ++j) x_rows[j] = x + (perm[size_t(q + j)] / top_k) * d_model;
                    float g[kRowsPerPass], u[kRowsPerPass];
                    gate.dot(x_rows, c, q1 - q0, g);
                    up.dot(x_rows, c, q1 - q0, u);
                    for (int j = 0; j < c; ++j) act[perm[size_t(q + j)] * d_ff + r] = silu(g[j]) * u[j];
                }
            }
        });
        // down: one work item = (group, row of d_model); ypair = down . act
        parallel_for(G * d_model, n_threads, rows_per_thread(d_ff), [&](int64_t b, int64_t e) {
            RowDots down(*td, d_ff);
            for (int64_t it = b; it < e; ++it) {
                const int64_t gi = it / d_model, r = it % d_model, ex = groups[size_t(gi)];
                const int64_t q0 = count[size_t(ex)], q1 = count[size_t(ex) + 1];
                down.start(reinterpret_cast<const uint8_t *>(uintptr_t(down_ptrs[ex])) + r * rb_d);
                for (int64_t q = q0; q < q1; q += kRowsPerPass) {
                    const int c = int(std::min<int64_t>(kRowsPerPass, q1 - q));
                    const float * act_rows[kRowsPerPass];
                    for (int j = 0; j < c; ++j) act_rows[j] = act + perm[size_t(q + j)] * d_ff;
                    float y[kRowsPerPass];
                    down.dot(act_rows, c, q1 - q0, y);
                    for (int j = 0; j < c; ++j) ypair[perm[size_t(q + j)] * d_model + r] = y[j];
                }
            }
        });
        // weighted sum over each token's slots, in slot order
        parallel_for(n_tokens, n_threads, std::max<int64_t>(1, kMinElems / std::max<int64_t>(1, d_model * top_k)),
                     [&](int64_t b, int64_t e) {
                         for (int64_t t = b; t < e; ++t) {
                             float * o = out + t * d_model;
                             if (!accumulate) std::fill(o, o + d_model, 0.0f);
                             for (int64_t j = 0; j < top_k; ++j) {
                                 const int64_t p = t * top_k + j;
                                 if (!valid(p)) continue;
                                 const float wt = weights[p];
                                 const float * yp = ypair + p * d_model;
                                 for (int64_t c = 0; c < d_model; ++c) o[c] += wt * yp[c];
                             }
                         }
                     });
        return SPECTER_OK;
    });
}

}  // extern "C"

extern "C" {

int specter_rms_norm(const float * x, const float * delta, const float * shared, const float * gate,
                     int64_t gate_stride, const float * weight, const float * bias, int64_t n_rows, int64_t n,
                     float eps, float * sum, float * y, int n_threads) {
    const int rc = check_rms_norm(x, delta, shared, gate, gate_stride, weight, n_rows, n, eps, y);
    if (rc != SPECTER_OK) return rc;
    return guarded([&] {
        parallel_for(n_rows, n_threads, std::max<int64_t>(1, kMinElems / n), [&](int64_t b, int64_t e) {
            std::vector<float> s(static_cast<size_t>(n));
            for (int64_t r = b; r < e; ++r) {
                const float g = gate ? 1.0f / (1.0f + std::exp(-gate[r * gate_stride])) : 1.0f;
                for (int64_t i = 0; i < n; ++i) {
                    const int64_t at = r * n + i;
                    s[size_t(i)] = !delta ? x[at] : x[at] + (shared ? delta[at] + shared[at] * g : delta[at]);
                }
                const float scale = rms_scale(s.data(), n, eps);
                for (int64_t i = 0; i < n; ++i) {
                    if (sum) sum[r * n + i] = s[size_t(i)];
                    y[r * n + i] = s[size_t(i)] * scale * weight[i] + (bias ? bias[i] : 0.0f);
                }
            }
        });
        return SPECTER_OK;
    });
}

int specter_moe_topk(const float * logits, int64_t n_tokens, int64_t n_expert, int64_t row_stride, int64_t top_k,
                     int normalize, float scale, int32_t * ids, float * weights, int n_threads) {
    const int rc = check_topk(logits, n_tokens, n_expert, row_stride, top_k, ids, weights);
    if (rc != SPECTER_OK) return rc;
    return guarded([&] {
        parallel_for(n_tokens, n_threads, std::max<int64_t>(1, kMinElems / (n_expert * top_k)),
                     [&](int64_t b, int64_t e) {
                         for (int64_t t = b; t < e; ++t) {
                             const float * l = logits + t * row_stride;
                             float mx = -INFINITY, sum = 0.0f;
                             for (int64_t i = 0; i < n_expert; ++i) mx = std::max(mx, l[i]);
                             for (int64_t i = 0; i < n_expert; ++i) sum += std::exp(l[i] - mx);
                             // the next expert is the best one ranked after the previous: (logit desc, index asc)
                             float last_v = INFINITY, wsum = 0.0f;
                             int64_t last_i = -1;
                             int32_t * id = ids + t * top_k;
                             float * wt = weights + t * top_k;
                             for (int64_t j = 0; j < top_k; ++j) {
                                 int64_t bi = -1;
                                 float bv = 0.0f;
                                 for (int64_t i = 0; i < n_expert; ++i) {
                                     const float v = l[i];
                                     const bool after = v < last_v || (v == last_v && i > last_i);
                                     if (after && (bi < 0 || v > bv)) bv = v, bi = i;
                                 }
                                 last_v = bv, last_i = bi;
                                 id[j] = int32_t(bi);
                                 wt[j] = bi >= 0 ? std::exp(bv - mx) / sum : 0.0f;
                                 wsum += wt[j];
                             }
                             for (int64_t j = 0; j < top_k; ++j) {
                                 if (normalize) wt[j] /= std::max(wsum, 6.103515625e-5f);
                                 if (scale != 0.0f && scale != 1.0f) wt[j] *= scale;
                             }
                         }
                     });
        return SPECTER_OK;
    });
}

int specter_moe_route(int w_type, const void * w, int64_t n_rows, int64_t k, const float * x, int64_t n_tokens,
                      int64_t n_expert, int64_t top_k, int normalize, float scale, float * logits, int32_t * ids,
                      float * weights, uint32_t * done, int n_threads) {
    (void)done;
    const TypeInfo * t = nullptr;
    int rc = check_route(w_type, w, n_rows, k, x, n_tokens, n_expert, top_k, logits, ids, weights, &t);
    if (rc == SPECTER_OK) rc = qmatmul(w_type, w, n_rows, k, SPECTER_TYPE_F32, x, n_tokens, logits, false, n_threads);
    if (rc != SPECTER_OK) return rc;
    return specter_moe_topk(logits, n_tokens, n_expert, n_rows, top_k, normalize, scale, ids, weights, n_threads);
}

int specter_rope_kv(const float * q, int64_t q_stride, const float * k, int64_t k_stride, const float * v,
                    int64_t v_stride, const float * q_bias, const float * k_bias, const float * v_bias,
                    const float * q_norm, const float * k_norm, float norm_eps, int64_t n_tokens, int64_t n_head,
                    int64_t n_head_kv, int64_t head_dim, int64_t rope_dim, int neox, const float * cos,
                    const float * sin, int64_t n_pos, const int64_t * pos, int out_type, void * q_out,
                    void * k_cache, void * v_cache, int64_t capacity, int n_threads) {
    (void)n_threads;  // a few thousand values per token: not worth threads
    const RopeKvArgs a{q, k, v, q_stride, k_stride, v_stride, q_bias, k_bias, v_bias, q_norm, k_norm, norm_eps,
                       n_tokens, n_head, n_head_kv, head_dim, rope_dim, neox, cos, sin, n_pos, pos, out_type, q_out,
                       k_cache, v_cache, capacity};
    const int rc = check_rope_kv(a);
    if (rc != SPECTER_OK) return rc;
    for (int64_t t = 0; t < n_tokens; ++t)
        if (pos[t] < 0 || pos[t] >= n_pos || pos[t] >= capacity) return SPECTER_ERR_INVALID_ARG;
    return guarded([&] {
        const int64_t half = rope_dim / 2;
        std::vector<float> h(static_cast<size_t>(head_dim));
        auto store = [&](void * base, int64_t index) {
            if (out_type == SPECTER_TYPE_F16) {
                uint16_t * o = static_cast<uint16_t *>(base) + index;
                for (int64_t i = 0; i < head_dim; ++i) o[i] = float_to_half(h[size_t(i)]);
            } else {
                std::copy(h.begin(), h.end(), static_cast<float *>(base) + index);
            }
        };
        // head `hd` of row x (+ bias) into h, normalized when `norm` (rms_scale, as specter_rms_norm), its first
        // rope_dim features rotated at position p when `rotate`
        auto load = [&](const float * x, const float * bias, const float * norm, int64_t hd, int64_t p, bool rotate) {
            for (int64_t i = 0; i < head_dim; ++i)
                h[size_t(i)] = x[hd * head_dim + i] + (bias ? bias[hd * head_dim + i] : 0.0f);
            if (norm) {
                const float scale = rms_scale(h.data(), head_dim, norm_eps);
                for (int64_t i = 0; i < head_dim; ++i) h[size_t(i)] = h[size_t(i)] * scale * norm[i];
            }
            if (!rotate) return;
            for (int64_t i = 0; i < half; ++i) {
                const int64_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
                const float c = cos[p * half + i], s = sin[p * half + i], xa = h[size_t(ia)], xb = h[size_t(ib)];
                h[size_t(ia)] = xa * c - xb * s;
                h[size_t(ib)] = xb * c + xa * s;
            }
        };
        for (int64_t t = 0; t < n_tokens; ++t) {
            const int64_t p = pos[t];
            for (int64_t hd = 0; hd < n_head; ++hd) {
                load(q + t * q_stride, q_bias, q_norm, hd, p, true);
                store(q_out, (hd * n_tokens + t) * head_dim);
            }
            for (int64_t hd = 0; hd < n_head_kv; ++hd) {
                load(k + t * k_stride, k_bias, k_norm, hd, p, true);
                store(k_cache, (hd * capacity + p) * head_dim);
                load(v + t * v_stride, v_bias, nullptr, hd, p, false);
                store(v_cache, (hd * capacity + p) * head_dim);
            }
        }
        return SPECTER_OK;
    });
}

int specter_decode_attention_workspace_size(int64_t n_tokens, int64_t n_head, int64_t head_dim, int64_t n_keys,
                                            size_t * out_bytes) {
    AttnLayout L;
    if (!out_bytes || !attn_layout(n_tokens, n_head, head_dim, n_keys, &L)) return SPECTER_ERR_INVALID_ARG;
    *out_bytes = L.total;
    return SPECTER_OK;
}

int specter_decode_attention(int kv_type, const void * q, const void * k_cache, const void * v_cache, int64_t n_tokens,
                             int64_t n_head, int64_t n_head_kv, int64_t head_dim, int64_t n_keys, int64_t capacity,
                             const int64_t * pos, float scale, void * workspace, size_t workspace_bytes, void * out,
                             int n_threads) {
    const AttnArgs a{kv_type, q, k_cache, v_cache, n_tokens, n_head, n_head_kv, head_dim, n_keys, capacity,
                     pos, scale, workspace, workspace_bytes, out};
    AttnLayout L;
    const int rc = check_attention(a, &L);
    if (rc != SPECTER_OK || n_tokens == 0) return rc;
    for (int64_t t = 0; t < n_tokens; ++t)
        if (pos[t] < 0 || pos[t] >= n_keys) return SPECTER_ERR_INVALID_ARG;
    return guarded([&] {
        const int64_t d = head_dim, group = n_head / n_head_kv;
        const bool f16 = kv_type == SPECTER_TYPE_F16;
        // row `r` (element offset) of a tensor of kv_type as float32
        auto load = [&](const void * base, int64_t r, float * dst) {
            if (f16) {
                const uint16_t * s = static_cast<const uint16_t *>(base) + r;
                for (int64_t i = 0; i < d; ++i) dst[i] = half_to_float(s[i]);
            } else {
                std::memcpy(dst, static_cast<const float *>(base) + r, size_t(d) * 4);
            }
        };
        const int64_t per = std::max<int64_t>(1, kMinElems / (n_tokens * n_keys * d * 2));  // heads per thread
        parallel_for(n_head, n_threads, per, [&](int64_t b, int64_t e) {
            std::vector<float> qf(static_cast<size_t>(d)), row(qf.size()), acc(qf.size());
            std::vector<float> s(static_cast<size_t>(n_keys));
            for (int64_t h = b; h < e; ++h) {
                const int64_t kv = (h / group) * capacity * d;
                for (int64_t t = 0; t < n_tokens; ++t) {
                    load(q, (h * n_tokens + t) * d, qf.data());
                    const int64_t n = pos[t] + 1;  // keys 0 .. pos[t]
                    float m = -INFINITY;
                    for (int64_t j = 0; j < n; ++j) {
                        load(k_cache, kv + j * d, row.data());
                        s[size_t(j)] = dot_f32(qf.data(), row.data(), d) * scale;
                        m = std::max(m, s[size_t(j)]);
                    }
                    float l = 0.0f;
                    std::fill(acc.begin(), acc.end(), 0.0f);
                    for (int64_t j = 0; j < n; ++j) {
                        const float w = std::exp(s[size_t(j)] - m);
                        l += w;
                        load(v_cache, kv + j * d, row.data());
                        for (int64_t i = 0; i < d; ++i) acc[size_t(i)] += w * row[size_t(i)];
                    }
                    const int64_t o = (h * n_tokens + t) * d;
                    for (int64_t i = 0; i < d; ++i) {
                        const float y = acc[size_t(i)] / l;
                        if (f16)
                            static_cast<uint16_t *>(out)[o + i] = float_to_half(y);
                        else
                            static_cast<float *>(out)[o + i] = y;
                    }
                }
            }
        });
        return SPECTER_OK;
    });
}

int specter_sample_chain_workspace_size(int64_t n_rows, int64_t n_vocab, int64_t n_candidates, size_t * out_bytes) {
    SampleLayout L;
    if (!out_bytes || !sample_layout(n_rows, n_vocab, n_candidates, &L)) return SPECTER_ERR_INVALID_ARG;
    *out_bytes = L.total;
    return SPECTER_OK;
}

// The chain's float64 operations in the order of the CUDA kernel (kernels_sample.cu), which runs the per-candidate
// ones in parallel and the sums in one thread.
int specter_sample_chain(const float * logits, int64_t n_rows, int64_t n_vocab, int64_t row_stride,
                         int64_t n_candidates, const double * knobs, const double * uniforms, int64_t * ids,
                         double * probs, int64_t * tokens, void * workspace, size_t workspace_bytes, int n_threads) {
    const SampleArgs a{logits, n_rows, n_vocab, row_stride, n_candidates, knobs, uniforms, ids, probs, tokens,
                       workspace, workspace_bytes};
    SampleLayout L;
    const int rc = check_sample_chain(a, &L);
    if (rc != SPECTER_OK || n_rows == 0) return rc;
    return guarded([&] {
        const size_t C = size_t(n_candidates);
        const double temperature = knobs[0], top_p = knobs[1], log_min_p = knobs[2];
        parallel_for(n_rows, n_threads, std::max<int64_t>(1, kMinElems / n_vocab), [&](int64_t b, int64_t e) {
            std::vector<uint64_t> best;
            best.reserve(4 * C);
            std::vector<double> v(C), w(C), cdf(C);
            std::vector<std::pair<int64_t, double>> asc(C);  // (id, p) by ascending id
            for (int64_t r = b; r < e; ++r) {
                sample_top(logits + r * row_stride, n_vocab, n_candidates, best);
                for (size_t i = 0; i < C; ++i) v[i] = sample_logit(uint32_t(best[i] >> 32));
                const double v0 = v[0];
                double z = 0.0;
                for (size_t i = 0; i < C; ++i) z += w[i] = std::exp(v[i] - v0);
                double c = 0.0;
                size_t n_p = 1, n_m = 0;
                for (size_t i = 0; i < C; ++i) {
                    c += w[i] / z;
                    n_p += c < top_p;
                    n_m += v[i] >= v0 + log_min_p;
                }
                const size_t m = std::min(C, std::min(n_p, std::max<size_t>(n_m, 1)));
                z = 0.0;
                for (size_t i = 0; i < C; ++i) {
                    w[i] = i < m ? std::exp((v[i] - v0) / temperature) : 0.0;
                    if (i < m) z += w[i];
                }
                for (size_t i = 0; i < C; ++i) asc[i] = {int64_t(0xffffffffu - uint32_t(best[i])), w[i] / z};
                std::sort(asc.begin(), asc.end());
                for (size_t i = 0; i < C; ++i) {
                    ids[r * n_candidates + int64_t(i)] = asc[i].first;
                    probs[r * n_candidates + int64_t(i)] = asc[i].second;
                }
                if (!uniforms) continue;
                double s = 0.0;
                size_t last = 0, at = 0;
                for (size_t i = 0; i < C; ++i) {
                    cdf[i] = s += asc[i].second;
                    if (asc[i].second > 0.0) last = i;
                }
                const double t = uniforms[r] * s;
                for (size_t i = 0; i < C; ++i) at += cdf[i] <= t;  // the first s_j > t (s is sorted)
                tokens[r] = asc[std::min(at, last)].first;
            }
        });
        return SPECTER_OK;
    });
}

int specter_expert_table(int64_t * slot_of, const int64_t * host_ptrs, const specter_slot_pool * pool,
                         int64_t n_expert, const int32_t * ids, int64_t n_pairs, const uint8_t * skip,
                         const specter_spare_slots * spares, int32_t * routed, int64_t * ptrs, int n_threads) {
    (void)n_threads;
    const int rc = check_expert_table(slot_of, host_ptrs, pool, n_expert, ids, n_pairs, spares, ptrs);
    if (rc != SPECTER_OK) return rc;
    if (spares && spares->n_spare > 0) {
        std::vector<uint8_t> used(size_t(n_expert), 0);
        for (int64_t p = 0; p < n_pairs; ++p)
            if (ids[p] >= 0 && ids[p] < n_expert) used[size_t(ids[p])] = 1;
        int expert[SPECTER_MAX_SPARES], spare[SPECTER_MAX_SPARES];
        const int n = assign_spares(slot_of, used.data(), skip, n_expert, spares->slots, spares->n_spare, expert,
                                    spare);
        for (int i = 0; i < n; ++i) {
            const int64_t slot = spares->slots[spare[i]];
            for (int part = 0; part < 3; ++part)
                std::memcpy(reinterpret_cast<void *>(pool->base + slot * pool->slot_bytes + pool->part_offset[part]),
                            reinterpret_cast<const void *>(host_ptrs[part * n_expert + expert[i]]),
                            size_t(pool->part_bytes[part]));
            slot_of[expert[i]] = slot;
            spares->fetched[expert[i]] = int32_t(slot + 1);
            spares->slots[spare[i]] = -1;
        }
    }
    for (int part = 0; part < 3; ++part)
        for (int64_t e = 0; e < n_expert; ++e)
            ptrs[part * n_expert + e] = expert_address(slot_of, host_ptrs, *pool, skip, n_expert, part, e);
    for (int64_t p = 0; routed && p < n_pairs; ++p)
        if (ids[p] >= 0 && ids[p] < n_expert) ++routed[ids[p]];
    return SPECTER_OK;
}

int specter_wait_counter(const int64_t * counter, const int64_t * base, int64_t offset, int64_t timeout_ns,
                         int64_t * waited_ns, int n_threads) {
    (void)timeout_ns, (void)waited_ns, (void)n_threads;
    if (!counter || !base) return SPECTER_ERR_INVALID_ARG;
    return *counter >= *base + offset ? SPECTER_OK : SPECTER_ERR_NOT_READY;
}

}  // extern "C"
