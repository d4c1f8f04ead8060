#pragma once
//! \file
//! qcoll's 16-bit float types: `qcoll::half` (IEEE binary16) and `qcoll::bfloat16`.
//!
//! Both are a 16-bit pattern in a standard-layout struct, so arrays of them are layout-compatible
//! with CUDA's `__half` and `__nv_bfloat16` (reinterpret the pointer). Conversions from float round
//! to nearest even and match CUDA's `__float2half_rn` / `__float2bfloat16_rn` bit for bit, NaN
//! included (any NaN becomes 0x7fff).

#include <cstdint>

#include "fpmath.hpp"

QCOLL_NAMESPACE_BEGIN

//! IEEE 754 binary16 value, stored as its bit pattern.
struct half {
  std::uint16_t bits;  //!< raw bit pattern
};

//! bfloat16 value (the upper 16 bits of an fp32), stored as its bit pattern.
struct bfloat16 {
  std::uint16_t bits;  //!< raw bit pattern
};

static_assert(sizeof(half) == 2 && alignof(half) == 2, "half must be 2 bytes");
static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2, "bfloat16 must be 2 bytes");

//! Exact widening of a binary16 pattern to float (subnormals and Inf preserved; NaN → 0x7fffffff,
//! matching CUDA's `__half2float`).
QCOLL_HOST_DEVICE float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  std::uint32_t out;
  if (exp == 0x1fu) {
    out = man != 0 ? 0x7fffffffu : (sign | 0x7f800000u);  // any NaN → 0x7fffffff, as CUDA does
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    out = sign;
  } else {
    // subnormal: value = man * 2^-24; normalise
    int e = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --e;
    }
    out = sign | (static_cast<std::uint32_t>(e) << 23) | ((man & 0x3ffu) << 13);
  }
  return fp::from_bits(out);
}

//! float → binary16 bits, round to nearest even; overflow → ±Inf; NaN → 0x7fff.
QCOLL_HOST_DEVICE std::uint16_t float_to_half_bits(float f) {
  const std::uint32_t x = fp::bits(f);
  const std::uint32_t u = x & 0x7fffffffu;
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  if (u >= 0x7f800000u) return static_cast<std::uint16_t>(u == 0x7f800000u ? (sign | 0x7c00u) : 0x7fffu);
  if (u >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds past max
  std::uint32_t result, rem;
  if (u >= 0x38800000u) {  // normal half
    rem = u << 19;
    result = (u - 0x38000000u) >> 13;
  } else if (u < 0x33000001u) {  // rounds to zero
    return static_cast<std::uint16_t>(sign);
  } else {  // subnormal half
    const std::uint32_t shift = 0x7eu - (u >> 23);
    const std::uint32_t mant = (u & 0x7fffffu) | 0x800000u;
    rem = mant << (32u - shift);
    result = mant >> shift;
  }
  if (rem > 0x80000000u || (rem == 0x80000000u && (result & 1u))) ++result;
  return static_cast<std::uint16_t>(sign | result);
}

//! Exact widening of a bfloat16 pattern to float.
QCOLL_HOST_DEVICE float bf16_bits_to_float(std::uint16_t b) {
  return fp::from_bits(static_cast<std::uint32_t>(b) << 16);
}

//! float → bfloat16 bits, round to nearest even; NaN → 0x7fff.
QCOLL_HOST_DEVICE std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t x = fp::bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  std::uint32_t r = x >> 16;
  const std::uint32_t rem = x << 16;
  if (rem > 0x80000000u || (rem == 0x80000000u && (r & 1u))) ++r;
  return static_cast<std::uint16_t>(r);
}

//! Widens any supported element type (float, half, bfloat16) to float.
QCOLL_HOST_DEVICE float to_float(float x) { return x; }
//! \overload
QCOLL_HOST_DEVICE float to_float(half x) { return half_bits_to_float(x.bits); }
//! \overload
QCOLL_HOST_DEVICE float to_float(bfloat16 x) { return bf16_bits_to_float(x.bits); }

//! Narrows a float to element type T (float, half or bfloat16), rounding to nearest even.
template <class T>
QCOLL_HOST_DEVICE T from_float(float x);
template <>
QCOLL_HOST_DEVICE float from_float<float>(float x) {
  return x;
}
template <>
QCOLL_HOST_DEVICE half from_float<half>(float x) {
  return half{float_to_half_bits(x)};
}
template <>
QCOLL_HOST_DEVICE bfloat16 from_float<bfloat16>(float x) {
  return bfloat16{float_to_bf16_bits(x)};
}

//! Element types qcoll moves, as a runtime tag (it travels in message headers).
enum class DType : std::uint8_t { f32 = 0, f16 = 1, bf16 = 2 };

//! The DType tag of element type T.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<half> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<bfloat16> {
  static constexpr DType value = DType::bf16;
};

//! Short name of a DType ("f32", "f16", "bf16").
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "?";
}

QCOLL_NAMESPACE_END
