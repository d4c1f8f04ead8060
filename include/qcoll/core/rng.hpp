#pragma once
//! \file
//! Counter-based random bits for stochastic rounding: a pure function of (seed, index), so the
//! same element draws the same bits on host and device, in any order and any thread layout.

#include <cstdint>

#include "config.hpp"

QCOLL_NAMESPACE_BEGIN

//! 32 random bits for element `index` under `seed`. A stateless mix of the two 64-bit words
//! (SplitMix64's finaliser over a Weyl step), O(1), no shared state.
QCOLL_HOST_DEVICE std::uint32_t random_bits(std::uint64_t seed, std::uint64_t index) {
  std::uint64_t z = seed * 0xd1342543de82ef95ull + (index + 1) * 0x9e3779b97f4a7c15ull;
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<std::uint32_t>(z >> 32);
}

//! Uniform float in [0, 1) with 24 random bits, exact (multiples of 2^-24).
QCOLL_HOST_DEVICE float random_unit(std::uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

QCOLL_NAMESPACE_END
