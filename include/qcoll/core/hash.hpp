#pragma once
//! \file
//! 64-bit FNV-1a over 64-bit words: the identities that ranks compare (plans, calls, node tables).
//! Not for security; any two different word lists collide with probability about 2^-64.

#include <cstdint>
#include <initializer_list>

#include "config.hpp"

QCOLL_NAMESPACE_BEGIN

//! An FNV-1a accumulator over 64-bit words (each word mixed as 8 little-endian bytes). O(1) a word.
struct Fnv1a {
  std::uint64_t value = 0xcbf29ce484222325ull;  //!< the hash so far

  //! Mixes one word into the hash; returns *this.
  Fnv1a& mix(std::uint64_t w) noexcept {
    for (int i = 0; i < 8; ++i) {
      value ^= (w >> (8 * i)) & 0xffu;
      value *= 0x100000001b3ull;
    }
    return *this;
  }
};

//! FNV-1a of a list of words.
inline std::uint64_t fnv1a(std::initializer_list<std::uint64_t> words) noexcept {
  Fnv1a h;
  for (std::uint64_t w : words) h.mix(w);
  return h.value;
}

QCOLL_NAMESPACE_END
