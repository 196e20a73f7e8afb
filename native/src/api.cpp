// The C entry points of libspecter that do not need CUDA: status strings, type geometry and the
// multithreaded CPU dequantization. No C++ exception crosses the ABI.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <new>
#include <vector>

#include "dequant_cpu.h"
#include "specter.h"
#include "threads_cpu.h"

#ifndef SPECTER_VERSION_STRING
#define SPECTER_VERSION_STRING "0.0.0"
#endif

namespace {

// Keep at least this many elements per thread, so that small tensors run on one.
constexpr int64_t kMinElemsPerThread = 1 << 15;

template <class Fn>
void parallel_rows(int64_t n_rows, int64_t row_len, int n_threads, Fn fn) {
    specter::parallel_for(n_rows, n_threads, std::max<int64_t>(1, kMinElemsPerThread / std::max<int64_t>(1, row_len)),
                          fn);
}

int check_rows(int type, const void * src, const void * dst, int64_t n_rows, int64_t row_len,
               const specter::TypeInfo ** out) {
    const specter::TypeInfo * t = specter::find_type(type);
    if (!t) return SPECTER_ERR_UNSUPPORTED_TYPE;
    if (n_rows < 0 || row_len < 0) return SPECTER_ERR_INVALID_ARG;
    if (row_len % t->block_elems != 0) return SPECTER_ERR_BAD_SHAPE;
    if ((n_rows > 0 && row_len > 0) && (!src || !dst)) return SPECTER_ERR_INVALID_ARG;
    if (row_len > 0 && n_rows > INT64_MAX / row_len) return SPECTER_ERR_INVALID_ARG;
    *out = t;
    return SPECTER_OK;
}

template <class Out, class RowsFn>
int dequantize_any(int type, const void * src, Out * dst, int64_t n_rows, int64_t row_len,
                   int n_threads, RowsFn rows_fn) {
    try {
        const specter::TypeInfo * t = nullptr;
        const int rc = check_rows(type, src, dst, n_rows, row_len, &t);
        if (rc != SPECTER_OK) return rc;
        if (n_rows == 0 || row_len == 0) return SPECTER_OK;
        const int64_t row_bytes = row_len / t->block_elems * t->block_bytes;
        const uint8_t * s = static_cast<const uint8_t *>(src);
        parallel_rows(n_rows, row_len, n_threads, [=](int64_t r0, int64_t r1) {
            rows_fn(*t, s + r0 * row_bytes, dst + r0 * row_len, r1 - r0, row_len);
        });
        return SPECTER_OK;
    } catch (const std::bad_alloc &) {
        return SPECTER_ERR_OUT_OF_MEMORY;
    } catch (...) {
        return SPECTER_ERR_INTERNAL;
    }
}

}  // namespace

extern "C" {

const char * specter_error_string(int code) {
    switch (code) {
        case SPECTER_OK: return "success";
        case SPECTER_ERR_INVALID_ARG: return "invalid argument";
        case SPECTER_ERR_UNSUPPORTED_TYPE: return "unsupported ggml tensor type";
        case SPECTER_ERR_BAD_SHAPE: return "row length is not a multiple of the type's block size";
        case SPECTER_ERR_OUT_OF_MEMORY: return "out of memory";
        case SPECTER_ERR_CUDA: return "CUDA runtime error";
        case SPECTER_ERR_NO_CUDA: return "the native library was built without CUDA";
        case SPECTER_ERR_INTERNAL: return "internal error in the native library";
        case SPECTER_ERR_NOT_READY: return "the counter waited for has not reached its value";
        case SPECTER_ERR_TIMEOUT: return "the answer waited for did not come in time";
        default: return "unknown error code";
    }
}

const char * specter_version(void) { return SPECTER_VERSION_STRING; }

int specter_type_block_size(int type, int64_t * out_elems, size_t * out_bytes) {
    const specter::TypeInfo * t = specter::find_type(type);
    if (!t) return SPECTER_ERR_UNSUPPORTED_TYPE;
    if (out_elems) *out_elems = t->block_elems;
    if (out_bytes) *out_bytes = size_t(t->block_bytes);
    return SPECTER_OK;
}

int specter_row_size(int type, int64_t row_len, size_t * out_bytes) {
    const specter::TypeInfo * t = specter::find_type(type);
    if (!t) return SPECTER_ERR_UNSUPPORTED_TYPE;
    if (!out_bytes || row_len < 0) return SPECTER_ERR_INVALID_ARG;
    if (row_len % t->block_elems != 0) return SPECTER_ERR_BAD_SHAPE;
    *out_bytes = size_t(row_len / t->block_elems) * size_t(t->block_bytes);
    return SPECTER_OK;
}

int specter_dequantize_rows(int type, const void * src, float * dst, int64_t n_rows,
                            int64_t row_len, int n_threads) {
    return dequantize_any(type, src, dst, n_rows, row_len, n_threads, specter::dequantize_rows_f32);
}

int specter_dequantize_rows_f16(int type, const void * src, uint16_t * dst, int64_t n_rows,
                                int64_t row_len, int n_threads) {
    return dequantize_any(type, src, dst, n_rows, row_len, n_threads, specter::dequantize_rows_f16);
}

}  // extern "C"
