// Internal interface of the CPU block decoders (libspecter).
#pragma once

#include <cstdint>

#include "specter.h"

namespace specter {

struct TypeInfo {
    int type;
    int64_t block_elems;
    int64_t block_bytes;
    void (*decode)(const uint8_t * block, float * out);  // one block -> block_elems floats
};

// nullptr for a type this library does not handle.
const TypeInfo * find_type(int type);

// Single-threaded; the caller has checked the arguments (row_len a multiple of t.block_elems).
void dequantize_rows_f32(const TypeInfo & t, const uint8_t * src, float * dst, int64_t n_rows,
                         int64_t row_len);
void dequantize_rows_f16(const TypeInfo & t, const uint8_t * src, uint16_t * dst, int64_t n_rows,
                         int64_t row_len);

}  // namespace specter
