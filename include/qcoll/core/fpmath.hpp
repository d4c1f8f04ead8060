#pragma once
//! \file
//! Scalar float arithmetic that gives the same bits on host and device.
//!
//! Device code uses the `__f*_rn` intrinsics, which nvcc never fuses into FMA; host code uses plain
//! IEEE operators (qcoll's CMake target adds `-ffp-contract=off`; copy-in users must not enable
//! FMA contraction for translation units that call qcoll's host kernels, see docs/formats.md).

#include <cstdint>
#include <cstring>

#include "config.hpp"

QCOLL_NAMESPACE_BEGIN
namespace fp {

//! Reinterprets the bits of a float as uint32.
QCOLL_HOST_DEVICE std::uint32_t bits(float x) {
#if QCOLL_DEVICE_CODE
  return __float_as_uint(x);
#else
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

//! Reinterprets uint32 bits as a float.
QCOLL_HOST_DEVICE float from_bits(std::uint32_t u) {
#if QCOLL_DEVICE_CODE
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

//! a * b, rounded to nearest even, never fused.
QCOLL_HOST_DEVICE float mul(float a, float b) {
#if QCOLL_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

//! a + b, rounded to nearest even, never fused.
QCOLL_HOST_DEVICE float add(float a, float b) {
#if QCOLL_DEVICE_CODE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

//! a - b, rounded to nearest even, never fused.
QCOLL_HOST_DEVICE float sub(float a, float b) {
#if QCOLL_DEVICE_CODE
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

//! a / b, IEEE division rounded to nearest even (never an approximate reciprocal).
QCOLL_HOST_DEVICE float div(float a, float b) {
#if QCOLL_DEVICE_CODE
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

//! |x| by clearing the sign bit.
QCOLL_HOST_DEVICE float abs(float x) { return from_bits(bits(x) & 0x7fffffffu); }

//! True when x is neither NaN nor infinite.
QCOLL_HOST_DEVICE bool is_finite(float x) { return (bits(x) & 0x7f800000u) != 0x7f800000u; }

//! True when x is NaN.
QCOLL_HOST_DEVICE bool is_nan(float x) { return (bits(x) & 0x7fffffffu) > 0x7f800000u; }

//! Quiet NaN.
QCOLL_HOST_DEVICE float nan() { return from_bits(0x7fc00000u); }

//! Larger of a and b (NaN-free inputs).
QCOLL_HOST_DEVICE float max(float a, float b) { return a > b ? a : b; }

//! Smaller of a and b (NaN-free inputs).
QCOLL_HOST_DEVICE float min(float a, float b) { return a < b ? a : b; }

//! Rounds to the nearest integer, ties to even, for |x| < 2^31 (result as float).
QCOLL_HOST_DEVICE float rint(float x) {
#if QCOLL_DEVICE_CODE
  return rintf(x);
#else
  // Adding and subtracting 1.5 * 2^23 rounds to an integer in the current (nearest-even) mode.
  const float magic = 12582912.0f;
  const float ax = abs(x);
  if (!(ax < 8388608.0f)) return x;  // already an integer (or NaN/Inf)
  float r = sub(add(ax, magic), magic);
  return from_bits(bits(r) | (bits(x) & 0x80000000u));
#endif
}

//! Largest integer not greater than x, for |x| < 2^23 (result as float).
QCOLL_HOST_DEVICE float floor(float x) {
  float r = rint(x);
  return r > x ? sub(r, 1.0f) : r;
}

//! 2^e as a float, for -126 <= e <= 127 (exact).
QCOLL_HOST_DEVICE float exp2i(int e) { return from_bits(static_cast<std::uint32_t>(e + 127) << 23); }

//! floor(log2(x)) for finite x > 0, subnormals included.
QCOLL_HOST_DEVICE int ilog2(float x) {
  std::uint32_t u = bits(x) & 0x7fffffffu;
  int e = static_cast<int>(u >> 23);
  if (e != 0) return e - 127;
  // subnormal: value = m * 2^-149
  int lz = 0;
  for (std::uint32_t m = u; (m & 0x400000u) == 0; m <<= 1) ++lz;
  return -127 - lz;
}

//! x * 2^e exactly where the result is a normal float or zero-free subnormal-safe scaling.
//! Computed as two exact multiplications so that any e in [-252, 254] works.
QCOLL_HOST_DEVICE float ldexp(float x, int e) {
  if (e > 127) {
    x = mul(x, exp2i(127));
    e -= 127;
  } else if (e < -126) {
    x = mul(x, exp2i(-126));
    e += 126;
  }
  return mul(x, exp2i(e));
}

//! a * b in double, rounded to nearest even, never fused.
QCOLL_HOST_DEVICE double dmul(double a, double b) {
#if QCOLL_DEVICE_CODE
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

//! a + b in double, rounded to nearest even, never fused.
QCOLL_HOST_DEVICE double dadd(double a, double b) {
#if QCOLL_DEVICE_CODE
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

//! a - b in double, rounded to nearest even, never fused.
QCOLL_HOST_DEVICE double dsub(double a, double b) {
#if QCOLL_DEVICE_CODE
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}

//! a / b in double, IEEE division.
QCOLL_HOST_DEVICE double ddiv(double a, double b) {
#if QCOLL_DEVICE_CODE
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

//! Rounds a double to the nearest integer, ties to even, for |x| < 2^51.
QCOLL_HOST_DEVICE double drint(double x) {
#if QCOLL_DEVICE_CODE
  return ::rint(x);
#else
  const double magic = 6755399441055744.0;  // 1.5 * 2^52
  const double ax = x < 0 ? -x : x;
  if (!(ax < 4503599627370496.0)) return x;
  const double r = (ax + magic) - magic;
  return x < 0 ? -r : r;
#endif
}

}  // namespace fp
QCOLL_NAMESPACE_END
