#pragma once
//! \file
//! Checked size arithmetic: sums and products of sizes derived from element counts, which throw
//! qcoll::Error instead of wrapping modulo 2^64.

#include <cstddef>
#include <limits>

#include "error.hpp"

QCOLL_NAMESPACE_BEGIN

//! Largest value of std::size_t.
constexpr std::size_t kSizeMax = std::numeric_limits<std::size_t>::max();

//! a * b; throws qcoll::Error "qcoll::FUNCTION: argument 'ARGUMENT' = A times B overflows
//! std::size_t; the limit is 18446744073709551615" if the product does not fit. O(1).
inline std::size_t checked_mul(std::size_t a, std::size_t b, const char* function, const char* argument) {
  QCOLL_REQUIRE(a == 0 || b <= kSizeMax / a, function, argument, a << " times " << b,
                "overflows std::size_t; the limit is", kSizeMax);
  return a * b;
}

//! a + b; throws qcoll::Error "qcoll::FUNCTION: argument 'ARGUMENT' = A plus B overflows
//! std::size_t; the limit is 18446744073709551615" if the sum does not fit. O(1).
inline std::size_t checked_add(std::size_t a, std::size_t b, const char* function, const char* argument) {
  QCOLL_REQUIRE(b <= kSizeMax - a, function, argument, a << " plus " << b,
                "overflows std::size_t; the limit is", kSizeMax);
  return a + b;
}

//! n rounded up to a multiple of `unit` (>= 1); throws qcoll::Error as checked_add if that does not
//! fit. O(1).
inline std::size_t checked_round_up(std::size_t n, std::size_t unit, const char* function,
                                    const char* argument) {
  const std::size_t rest = n % unit;
  return rest == 0 ? n : checked_add(n, unit - rest, function, argument);
}

QCOLL_NAMESPACE_END
