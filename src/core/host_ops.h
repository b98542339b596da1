// Local arithmetic on host memory, shared by the core's default folds and the host transports
// (shm, mem): the same loops everywhere, so that host transports produce bit-identical sums for
// the same inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"

namespace odc::host {

// dst[i] += src[i] in fp32 (src fp32 or bf16).
inline void add_into(float* dst, const void* src, DataType src_type, size_t count) {
  if (src_type == DataType::kFloat32) {
    const auto* values = static_cast<const float*>(src);
    for (size_t i = 0; i < count; ++i) dst[i] += values[i];
  } else {
    const auto* values = static_cast<const uint16_t*>(src);
    for (size_t i = 0; i < count; ++i) dst[i] += bf16_to_float(values[i]);
  }
}

// dst[i] = bf16(src[i]) (round to nearest even), for i < count.
inline void narrow_into(uint16_t* dst, const float* src, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = float_to_bf16(src[i]);
}

// dst[i] = ((0 + slots[i]) + slots[stride + i]) + ..., in slot order: reproducible bit for bit.
inline void sum_in_order(float* dst, const float* slots, size_t stride, int num_slots,
                         size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = 0.0f + slots[i];
  for (int s = 1; s < num_slots; ++s) {
    const float* slot = slots + static_cast<size_t>(s) * stride;
    for (size_t i = 0; i < count; ++i) dst[i] += slot[i];
  }
}

}  // namespace odc::host
