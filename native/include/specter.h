/*
 * specter.h - the plain C ABI of specter-gguf's native library (libspecter).
 *
 * Rules (the discipline of llama.cpp's llama.h):
 *   - every call returns an int status: SPECTER_OK (0) or a negative SPECTER_ERR_* code;
 *     results come back through out-pointers;
 *   - sizes are explicit: element counts are int64_t, byte counts are size_t;
 *   - no global state a caller must set up first; calls are thread-safe unless stated.
 *
 * The Python loader (specter_gguf/native.py) feeds the text between the CDEF markers of every
 * header in this folder to cffi's cdef after dropping preprocessor lines and the SPECTER_API
 * macro, so inside those markers write only plain C declarations (no macros in declarations,
 * no inline code, integer constants as enum members).
 */
#ifndef SPECTER_H
#define SPECTER_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#  if defined(SPECTER_BUILD)
#    define SPECTER_API __declspec(dllexport)
#  else
#    define SPECTER_API __declspec(dllimport)
#  endif
#else
#  define SPECTER_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* SPECTER_CDEF_BEGIN */

/* Status codes. */
enum specter_status {
    SPECTER_OK                   =  0,
    SPECTER_ERR_INVALID_ARG      = -1, /* null pointer, negative count, bad thread count ... */
    SPECTER_ERR_UNSUPPORTED_TYPE = -2, /* ggml type id this library cannot handle           */
    SPECTER_ERR_BAD_SHAPE        = -3, /* row length not a multiple of the type's block     */
    SPECTER_ERR_OUT_OF_MEMORY    = -4,
    SPECTER_ERR_CUDA             = -5, /* a CUDA runtime call failed                         */
    SPECTER_ERR_NO_CUDA          = -6, /* the library was built without CUDA                 */
    SPECTER_ERR_INTERNAL         = -7,
    SPECTER_ERR_NOT_READY        = -8, /* a counter waited for has not reached its value       */
    SPECTER_ERR_TIMEOUT          = -9  /* an answer waited for did not come in time            */
};

/* ggml tensor type ids: same numbering as enum ggml_type in ggml.h (only those we handle). */
enum specter_ggml_type {
    SPECTER_TYPE_F32  = 0,
    SPECTER_TYPE_F16  = 1,
    SPECTER_TYPE_Q4_0 = 2,
    SPECTER_TYPE_Q4_1 = 3,
    SPECTER_TYPE_Q5_0 = 6,
    SPECTER_TYPE_Q5_1 = 7,
    SPECTER_TYPE_Q8_0 = 8,
    SPECTER_TYPE_Q2_K = 10,
    SPECTER_TYPE_Q3_K = 11,
    SPECTER_TYPE_Q4_K = 12,
    SPECTER_TYPE_Q5_K = 13,
    SPECTER_TYPE_Q6_K = 14,
    SPECTER_TYPE_IQ2_XXS = 16,
    SPECTER_TYPE_IQ2_XS = 17,
    SPECTER_TYPE_IQ3_XXS = 18,
    SPECTER_TYPE_IQ1_S = 19,
    SPECTER_TYPE_IQ4_NL = 20,
    SPECTER_TYPE_IQ3_S = 21,
    SPECTER_TYPE_IQ2_S = 22,
    SPECTER_TYPE_IQ4_XS = 23,
    SPECTER_TYPE_IQ1_M = 29,
    SPECTER_TYPE_BF16 = 30
};

/* A static, human-readable description of a status code (never NULL). */
SPECTER_API const char * specter_error_string(int code);

/* The library version as "MAJOR.MINOR.PATCH" (static string). */
SPECTER_API const char * specter_version(void);

/* 1 when the library was built with CUDA kernels, else 0. */
SPECTER_API int specter_has_cuda(void);

/* Number of CUDA devices visible; *out_count = 0 (and SPECTER_OK) in a CPU-only build or when no
 * device/driver is present. SPECTER_ERR_CUDA for any other CUDA runtime failure. */
SPECTER_API int specter_cuda_device_count(int * out_count);

/* Block geometry of a type: *out_elems elements are stored in *out_bytes bytes
 * (F32: 1 / 4, F16: 1 / 2, Q8_0: 32 / 34, Q4_K: 256 / 144 ...). Either out-pointer may be NULL. */
SPECTER_API int specter_type_block_size(int type, int64_t * out_elems, size_t * out_bytes);

/* Bytes taken by one row of row_len elements of the given type (row_len a multiple of the block). */
SPECTER_API int specter_row_size(int type, int64_t row_len, size_t * out_bytes);

/* Dequantize n_rows contiguous rows of row_len elements each from src (raw GGUF bytes) into dst
 * (n_rows * row_len floats). Bit-exact with ggml's reference dequantization. Rows are split over
 * n_threads CPU threads (n_threads <= 0: all cores). */
SPECTER_API int specter_dequantize_rows(int type, const void * src, float * dst,
                                        int64_t n_rows, int64_t row_len, int n_threads);

/* Same, writing IEEE half floats (uint16 bit patterns, round-to-nearest-even from the float32
 * result; F16 input is copied as is). */
SPECTER_API int specter_dequantize_rows_f16(int type, const void * src, uint16_t * dst,
                                            int64_t n_rows, int64_t row_len, int n_threads);

/* SPECTER_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* SPECTER_H */
