// Element types and the 16-bit float storage types used on the CPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace llaisys {

enum class DType : uint8_t { F32, F16, BF16, I32, I64, U8, Bool };

size_t dtype_size(DType dtype);
const char *dtype_name(DType dtype);
DType dtype_from_name(const std::string &name); // "f32", "float32", "bf16", ... ; ValueError otherwise
inline bool is_float(DType d) { return d == DType::F32 || d == DType::F16 || d == DType::BF16; }

// bf16: the top half of an f32. Conversion rounds to nearest even; NaN stays NaN.
struct bf16_t {
    uint16_t bits;
};
// IEEE half precision.
struct f16_t {
    uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
float to_float(f16_t x);

template <typename T>
T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline bf16_t from_float<bf16_t>(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40)}; // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return bf16_t{uint16_t(u >> 16)};
}
template <>
f16_t from_float<f16_t>(float x);

} // namespace llaisys
