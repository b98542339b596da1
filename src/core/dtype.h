// Element types of symmetric buffers and pushed gradients, and the bf16 <-> fp32 conversions the
// host paths use. bf16 is the upper half of an IEEE fp32 (round-to-nearest-even on narrowing).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace odc {

enum class DataType : uint32_t { kFloat32 = 0, kBfloat16 = 1 };

inline constexpr bool is_valid(DataType type) {
  return type == DataType::kFloat32 || type == DataType::kBfloat16;
}

inline constexpr size_t element_bytes(DataType type) {
  return type == DataType::kFloat32 ? 4 : 2;
}

inline constexpr std::string_view dtype_name(DataType type) {
  return type == DataType::kFloat32 ? "float32" : "bfloat16";
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);                 // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace odc
