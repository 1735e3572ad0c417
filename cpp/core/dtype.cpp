#include "llaisys/common.hpp"
#include "llaisys/dtype.hpp"

namespace llaisys {

size_t dtype_size(DType d) {
    switch (d) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::I64: return 8;
    case DType::U8: case DType::Bool: return 1;
    }
    throw std::invalid_argument("unknown dtype");
}

const char *dtype_name(DType d) {
    switch (d) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::Bool: return "bool";
    }
    return "?";
}

DType dtype_from_name(const std::string &n) {
    if (n == "f32" || n == "float32") return DType::F32;
    if (n == "f16" || n == "float16") return DType::F16;
    if (n == "bf16" || n == "bfloat16") return DType::BF16;
    if (n == "i32" || n == "int32") return DType::I32;
    if (n == "i64" || n == "int64") return DType::I64;
    if (n == "u8" || n == "uint8") return DType::U8;
    if (n == "bool") return DType::Bool;
    throw std::invalid_argument("unknown dtype '" + n + "' (expected f32, f16, bf16, i32, i64, u8 or bool)");
}

// IEEE half <-> float in software: exact for every half value, round-to-nearest-even the other way.
float to_float(f16_t h) {
    const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
    uint32_t exp = (h.bits >> 10) & 0x1fu, mant = h.bits & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (mant << 13); // inf / nan
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        u = sign;
    } else { // subnormal: normalise
        exp = 113;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            --exp;
        }
        u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

template <>
f16_t from_float<f16_t>(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return f16_t{uint16_t(sign | 0x7e00u)}; // nan
    if (abs >= 0x477ff000u) return f16_t{uint16_t(sign | 0x7c00u)}; // overflow -> inf (>= 65520)
    if (abs < 0x38800000u) {                                       // subnormal or zero in half
        if (abs < 0x33000000u) return f16_t{sign};                  // below half the smallest subnormal
        const uint32_t exp = abs >> 23, mant = (abs & 0x7fffffu) | 0x800000u;
        const int shift = int(126 - exp); // value / 2^-24 = mant >> shift, shift in [1, 24]
        uint32_t half_mant = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++half_mant;
        return f16_t{uint16_t(sign | half_mant)};
    }
    uint32_t r = abs - 0x38000000u; // rebias exponent 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);
    return f16_t{uint16_t(sign | (r >> 13))};
}

} // namespace llaisys
