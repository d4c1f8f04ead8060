#pragma once
//! \file
//! Randomized block Hadamard rotation: the smoothing transform applied to spans of a tensor before
//! quantization and undone after decoding (SDP4Bit's recipe against outliers).
//!
//! For a span of n = 2^k elements starting at global element index `base`:
//!   forward:  y = 2^-floor(k/2) · H · D · x
//!   inverse:  x = 2^-ceil(k/2)  · D · H · y
//! where H is the n × n Walsh–Hadamard matrix of ±1 entries (H · H = n I), applied by the fast
//! transform (k stages of n/2 add/subtract butterflies, in a fixed order), and D is the diagonal
//! of signs d_i = ±1 from bit 0 of random_bits(seed, base + i). The signs depend on the global
//! index, not on the rank, so every rank rotates element i the same way and the rotation commutes
//! with a sum over ranks (Σ_r f(x_r) = f(Σ_r x_r) up to rounding): a reduce-scatter sums rotated
//! vectors and rotates back once. Both scalings are exact powers of two (their product is 1/n), so
//! inverse(forward(x)) = x up to the butterflies' rounding: at most 2 k n 2^-24 max|x| per element
//! (each of the 2k stages rounds values bounded by n max|x| once; see tests/unit/test_hadamard.cpp).
//! The forward map is orthonormal for even k and √2 times orthonormal for odd k; quantization is
//! scale-invariant, so that does not change errors. All functions are QCOLL_HOST_DEVICE with the
//! qcoll::fp helpers: host and device give the same bits.

#include <cstddef>
#include <cstdint>

#include "../core/config.hpp"
#include "../core/error.hpp"
#include "../core/fpmath.hpp"
#include "../core/rng.hpp"

QCOLL_NAMESPACE_BEGIN

//! Largest rotation span, in elements (the largest block of any format).
constexpr std::size_t kMaxRotationSpan = 8192;

//! A rotation's parameters: span 2^log2_span elements (0: no rotation) and the sign seed. Part of
//! a plan's identity: ranks with different rotations are rejected.
struct Rotation {
  unsigned log2_span = 0;  //!< span = 2^log2_span elements; 0 turns the rotation off
  std::uint64_t seed = 0;  //!< seed of the random signs D (the same on every rank)

  //! Span in elements (1 when off).
  QCOLL_HOST_DEVICE constexpr std::size_t span() const { return std::size_t{1} << log2_span; }
  //! True when the rotation does something.
  QCOLL_HOST_DEVICE constexpr bool enabled() const { return log2_span > 0; }
};

namespace detail {

//! The sign d_i of global element index i: +1 or -1 from bit 0 of random_bits(seed, i).
QCOLL_HOST_DEVICE float rotation_sign(std::uint64_t seed, std::uint64_t index) {
  return (random_bits(seed, index) & 1u) ? -1.0f : 1.0f;
}

//! 2^-e for e in [0, 13], exactly.
QCOLL_HOST_DEVICE float pow2_neg(unsigned e) {
  return fp::from_bits(static_cast<std::uint32_t>(127 - e) << 23);
}

//! In-place fast Walsh–Hadamard transform (unnormalized: v <- H v) of n = 2^k values: stage s
//! pairs v[j] and v[j + 2^s] inside each run of 2^(s+1), writing (a + b, a - b). O(n k).
QCOLL_HOST_DEVICE void walsh_hadamard(float* v, std::size_t n) {
  for (std::size_t h = 1; h < n; h *= 2)
    for (std::size_t i = 0; i < n; i += 2 * h)
      for (std::size_t j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = fp::add(a, b);
        v[j + h] = fp::sub(a, b);
      }
}

}  // namespace detail

//! Forward rotation of one span in place: v[0, n) <- 2^-floor(k/2) H D v, n = r.span(), the span
//! starting at global element index `base`. O(n log n). No-op when the rotation is off.
QCOLL_HOST_DEVICE void rotate_forward(float* v, const Rotation& r, std::uint64_t base) {
  if (!r.enabled()) return;
  const std::size_t n = r.span();
  for (std::size_t i = 0; i < n; ++i) v[i] = fp::mul(v[i], detail::rotation_sign(r.seed, base + i));
  detail::walsh_hadamard(v, n);
  const float s = detail::pow2_neg(r.log2_span / 2);
  for (std::size_t i = 0; i < n; ++i) v[i] = fp::mul(v[i], s);
}

//! Inverse rotation of one span in place: v[0, n) <- 2^-ceil(k/2) D H v. O(n log n).
QCOLL_HOST_DEVICE void rotate_inverse(float* v, const Rotation& r, std::uint64_t base) {
  if (!r.enabled()) return;
  const std::size_t n = r.span();
  detail::walsh_hadamard(v, n);
  const float s = detail::pow2_neg((r.log2_span + 1) / 2);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = fp::mul(fp::mul(v[i], s), detail::rotation_sign(r.seed, base + i));
}

//! Elements of a run of `valid` data elements that a rotated message carries: whole spans (the
//! rotation spreads data into the padding of a partial span). `valid` itself when off. O(1).
QCOLL_HOST_DEVICE constexpr std::size_t rotated_count(std::size_t valid, const Rotation& r) {
  return r.enabled() ? (valid + r.span() - 1) / r.span() * r.span() : valid;
}

//! Rotates forward (or back) the n elements at v, n a multiple of the span, element 0 being
//! global element `global0` (the spans are contiguous in the tensor). No-op when off. O(n log span).
QCOLL_HOST_DEVICE void rotate_run(float* v, std::size_t n, const Rotation& r, std::uint64_t global0,
                                  bool forward) {
  if (!r.enabled()) return;
  for (std::size_t at = 0; at < n; at += r.span())
    forward ? rotate_forward(v + at, r, global0 + at) : rotate_inverse(v + at, r, global0 + at);
}

//! Checks a rotation against the block size of the format it feeds: the span must be at most
//! kMaxRotationSpan and divide `block` (a block holds whole spans, so no span straddles a block,
//! a shard or a tensor). Throws qcoll::Error naming `function`, the span and the limit. O(1).
inline void check_rotation(const char* function, const Rotation& r, std::size_t block) {
  QCOLL_REQUIRE(r.log2_span <= 13, function, "rotation.log2_span", r.log2_span,
                "exceeds the largest span, 2^13 =", kMaxRotationSpan);
  QCOLL_REQUIRE(block % r.span() == 0, function, "rotation span", r.span(), "does not divide the block",
                block);
}

QCOLL_NAMESPACE_END
