#pragma once
//! \file
//! Block statistics of the host quantizers (absmax, lo, hi, non-finite flag) over float, half and
//! bfloat16 inputs, shared by the portable loops and the AVX2 kernels.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../format/format.hpp"

QCOLL_NAMESPACE_BEGIN
namespace host {
namespace detail {

//! Order key of a float's bits: for floats a < b (not NaN), order_key(a) < order_key(b) as signed
//! integers, with -0 just below +0. It maps the sign-magnitude bits onto two's complement by
//! flipping the magnitude bits of negative values, so applying it twice gives the bits back.
inline std::int32_t order_key(std::uint32_t u) {
  return static_cast<std::int32_t>(u ^ ((0u - (u >> 31)) >> 1));
}

//! Inverse of order_key.
inline std::uint32_t order_bits(std::int32_t k) {
  const auto u = static_cast<std::uint32_t>(k);
  return u ^ ((0u - (u >> 31)) >> 1);
}

//! Statistics of x[0, valid) in element order: NaN and ±Inf are left out of absmax, lo and hi
//! and set nonfinite; of equal extremes the first in element order is kept (so a zero lo or hi
//! carries the sign of the block's first zero). The reference for block_stats.
template <class T>
inline BlockStats block_stats_sequential(const T* x, std::size_t valid) {
  BlockStats s = stats_empty();
  float amax = 0.0f, lo = s.lo, hi = s.hi;
  bool bad = false;
  for (std::size_t i = 0; i < valid; ++i) {
    const float v = to_float(x[i]);
    const bool fin = fp::is_finite(v);
    bad |= !fin;
    const float a = fin ? fp::abs(v) : 0.0f;
    amax = amax > a ? amax : a;
    lo = (fin && v < lo) ? v : lo;
    hi = (fin && v > hi) ? v : hi;
  }
  return BlockStats{amax, lo, hi, bad};
}

//! The 16-bit analogues of order_key / order_bits (for the bit patterns of half and bfloat16).
inline std::int16_t order_key16(std::uint16_t u) {
  return static_cast<std::int16_t>(u ^ static_cast<std::uint16_t>((0u - (u >> 15)) & 0x7fffu));
}
inline std::uint16_t order_bits16(std::int16_t k) {
  const auto u = static_cast<std::uint16_t>(k);
  return static_cast<std::uint16_t>(u ^ ((0u - (u >> 15)) & 0x7fffu));
}

//! If a zero is the block's lo or hi, gives it the sign of the first zero in element order.
template <class T>
inline void stats_zero_sign(const T* x, std::size_t valid, BlockStats& s) {
  if (!(s.lo == 0.0f || s.hi == 0.0f)) return;
  for (std::size_t i = 0; i < valid; ++i) {
    const float v = to_float(x[i]);
    if (v == 0.0f) {
      s.lo = s.lo == 0.0f ? v : s.lo;
      s.hi = s.hi == 0.0f ? v : s.hi;
      return;
    }
  }
}

//! Statistics of x[0, valid); equal to block_stats_sequential. The loop keeps three integer
//! reductions (largest |x| bits, smallest and largest order key) that the compiler vectorizes, and
//! that the caller's optimiser drops when its make_meta reads absmax only; 16-bit inputs are
//! reduced on their own bit patterns (conversion to float is exact and monotone, so it commutes
//! with max and min). The rare cases redo the work: a block holding NaN/Inf goes through
//! block_stats_sequential, and a zero lo or hi takes the sign of the first zero. O(valid).
template <class T>
inline BlockStats block_stats(const T* x, std::size_t valid) {
  BlockStats s;
  if constexpr (sizeof(T) == 2) {
    // |x| patterns at or above this one are Inf or NaN
    constexpr std::int16_t inf = std::is_same<T, half>::value ? 0x7c00 : 0x7f80;
    std::int16_t amax = 0;
    std::int16_t klo = order_key16(static_cast<std::uint16_t>(inf));
    std::int16_t khi = order_key16(static_cast<std::uint16_t>(0x8000 | inf));
    for (std::size_t i = 0; i < valid; ++i) {
      const std::uint16_t u = x[i].bits;
      const auto a = static_cast<std::int16_t>(u & 0x7fffu);
      const std::int16_t k = order_key16(u);
      amax = a > amax ? a : amax;
      klo = k < klo ? k : klo;
      khi = k > khi ? k : khi;
    }
    if (amax >= inf) return block_stats_sequential(x, valid);
    s = BlockStats{to_float(T{static_cast<std::uint16_t>(amax)}), to_float(T{order_bits16(klo)}),
                   to_float(T{order_bits16(khi)}), false};
  } else {
    std::uint32_t umax = 0;
    std::int32_t klo = order_key(0x7f800000u), khi = order_key(0xff800000u);
    for (std::size_t i = 0; i < valid; ++i) {
      const std::uint32_t u = fp::bits(to_float(x[i]));
      const std::uint32_t a = u & 0x7fffffffu;
      const std::int32_t k = order_key(u);
      umax = a > umax ? a : umax;
      klo = k < klo ? k : klo;
      khi = k > khi ? k : khi;
    }
    if (umax >= 0x7f800000u) return block_stats_sequential(x, valid);
    s = BlockStats{fp::from_bits(umax), fp::from_bits(order_bits(klo)), fp::from_bits(order_bits(khi)),
                   false};
  }
  stats_zero_sign(x, valid, s);
  return s;
}

}  // namespace detail
}  // namespace host
QCOLL_NAMESPACE_END
