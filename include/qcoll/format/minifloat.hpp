#pragma once
//! \file
//! Element codecs for small floats: OCP FP8 (E4M3, E5M2), OCP MX FP6 (E2M3, E3M2), OCP MX FP4
//! (E2M1), and the E8M0 shared scale of the MX formats.
//!
//! A code is an unsigned byte holding the element in its low `S::bits` bits, sign in bit
//! `S::bits - 1`, then `S::ebits` exponent bits and `S::mbits` mantissa bits. Encoding rounds to
//! nearest (ties to even) or stochastically, and always saturates: a finite value or infinity
//! beyond ±max_normal becomes ±max_normal. Results are bit-identical to CUDA's saturating
//! conversions (`__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)`, `__nv_cvt_float_to_fp6(x, ...,
//! cudaRoundNearest)`, `__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)`), specials included:
//!
//! | input        | E4M3        | E5M2        | E2M3, E3M2, E2M1       |
//! |--------------|-------------|-------------|------------------------|
//! | NaN (any)    | 0x7f (NaN)  | 0x7f (NaN)  | +max_normal (no NaN)   |
//! | ±Inf         | ±max_normal | ±max_normal | ±max_normal            |
//! | -0, tiny < 0 | -0          | -0          | -0                     |
//!
//! Decoding is exact. A NaN code (E4M3 S.1111.111, E5M2 S.11111.mm with mm != 0) decodes to the
//! float NaN 0x7fffffff whatever its sign, as CUDA's host conversions do; E5M2 ±Inf decodes to ±Inf.
//!
//! Everything here is branch-light integer work on the float's bits plus exact float operations
//! through qcoll::fp, usable on host and device; no lookup tables.

#include <cstdint>

#include "../core/config.hpp"
#include "../core/fpmath.hpp"
#include "../core/rng.hpp"

QCOLL_NAMESPACE_BEGIN
namespace minifloat {

//! OCP FP8 E4M3: bias 7, no infinities, NaN = S.1111.111, largest finite 448 = S.1111.110.
struct E4M3 {
  //! exponent bits, mantissa bits, exponent bias, largest exponent of a normal value
  static constexpr int ebits = 4, mbits = 3, bias = 7, emax = 8;
  static constexpr int bits = 1 + ebits + mbits;   //!< bits per code
  static constexpr float max_normal = 448.f;       //!< largest finite value
  static constexpr std::uint32_t max_code = 0x7e;  //!< magnitude code of max_normal
  static constexpr bool has_inf = false;           //!< has ±Inf codes
  static constexpr bool has_nan = true;            //!< has NaN codes
  static constexpr std::uint8_t nan_code = 0x7f;   //!< encode's result for NaN
  static constexpr const char* name = "e4m3";      //!< short name
};

//! OCP FP8 E5M2: IEEE-like, bias 15, ±Inf = S.11111.00, NaN = S.11111.{01,10,11}, largest 57344.
struct E5M2 {
  //! exponent bits, mantissa bits, exponent bias, largest exponent of a normal value
  static constexpr int ebits = 5, mbits = 2, bias = 15, emax = 15;
  static constexpr int bits = 1 + ebits + mbits;   //!< bits per code
  static constexpr float max_normal = 57344.f;     //!< largest finite value
  static constexpr std::uint32_t max_code = 0x7b;  //!< magnitude code of max_normal
  static constexpr bool has_inf = true;            //!< has ±Inf codes
  static constexpr bool has_nan = true;            //!< has NaN codes
  static constexpr std::uint8_t nan_code = 0x7f;   //!< encode's result for NaN
  static constexpr const char* name = "e5m2";      //!< short name
};

//! OCP MX FP6 E2M3: bias 1, every code finite, largest 7.5.
struct E2M3 {
  //! exponent bits, mantissa bits, exponent bias, largest exponent of a normal value
  static constexpr int ebits = 2, mbits = 3, bias = 1, emax = 2;
  static constexpr int bits = 1 + ebits + mbits;   //!< bits per code
  static constexpr float max_normal = 7.5f;        //!< largest finite value
  static constexpr std::uint32_t max_code = 0x1f;  //!< magnitude code of max_normal
  static constexpr bool has_inf = false;           //!< has ±Inf codes
  static constexpr bool has_nan = false;           //!< has NaN codes
  static constexpr std::uint8_t nan_code = 0x1f;   //!< encode's result for NaN (+max_normal)
  static constexpr const char* name = "e2m3";      //!< short name
};

//! OCP MX FP6 E3M2: bias 3, every code finite, largest 28.
struct E3M2 {
  //! exponent bits, mantissa bits, exponent bias, largest exponent of a normal value
  static constexpr int ebits = 3, mbits = 2, bias = 3, emax = 4;
  static constexpr int bits = 1 + ebits + mbits;   //!< bits per code
  static constexpr float max_normal = 28.f;        //!< largest finite value
  static constexpr std::uint32_t max_code = 0x1f;  //!< magnitude code of max_normal
  static constexpr bool has_inf = false;           //!< has ±Inf codes
  static constexpr bool has_nan = false;           //!< has NaN codes
  static constexpr std::uint8_t nan_code = 0x1f;   //!< encode's result for NaN (+max_normal)
  static constexpr const char* name = "e3m2";      //!< short name
};

//! OCP MX FP4 E2M1: bias 1, every code finite, values 0, 0.5, 1, 1.5, 2, 3, 4, 6.
struct E2M1 {
  //! exponent bits, mantissa bits, exponent bias, largest exponent of a normal value
  static constexpr int ebits = 2, mbits = 1, bias = 1, emax = 2;
  static constexpr int bits = 1 + ebits + mbits;  //!< bits per code
  static constexpr float max_normal = 6.f;        //!< largest finite value
  static constexpr std::uint32_t max_code = 0x7;  //!< magnitude code of max_normal
  static constexpr bool has_inf = false;          //!< has ±Inf codes
  static constexpr bool has_nan = false;          //!< has NaN codes
  static constexpr std::uint8_t nan_code = 0x7;   //!< encode's result for NaN (+max_normal)
  static constexpr const char* name = "e2m1";     //!< short name
};

namespace detail {

//! Float bits of the value of magnitude code c, for a normal code (exponent field != 0).
template <class S>
QCOLL_HOST_DEVICE constexpr std::uint32_t normal_bits(std::uint32_t c) {
  return (c << (23 - S::mbits)) + (static_cast<std::uint32_t>(127 - S::bias) << 23);
}

//! Derived compile-time facts of spec S, as float bit patterns (integral constants, so they are
//! usable in device code without relaxed constexpr).
template <class S>
struct Facts {
  static constexpr int emin = 1 - S::bias;  //!< smallest normal exponent
  //! max_normal; also the saturation threshold (magnitudes are clamped to it before rounding)
  static constexpr std::uint32_t max_bits = normal_bits<S>(S::max_code);
  //! the smallest normal 2^emin
  static constexpr std::uint32_t min_normal_bits = static_cast<std::uint32_t>(127 + emin) << 23;
  //! the subnormal step 2^(emin - mbits) and its reciprocal
  static constexpr std::uint32_t sub_step_bits = static_cast<std::uint32_t>(127 + emin - S::mbits) << 23;
  static constexpr std::uint32_t inv_sub_step_bits = static_cast<std::uint32_t>(127 - emin + S::mbits) << 23;
  //! 2^(emin - mbits + 23): adding it to a magnitude below 2^emin rounds that magnitude to a
  //! multiple of the subnormal step (nearest even) and leaves the count in the low bits
  static constexpr std::uint32_t sub_magic_bits = static_cast<std::uint32_t>(127 + emin - S::mbits + 23)
                                                  << 23;
  //! the rebias subtracted from float bits to get code bits (shifted by 23 - mbits)
  static constexpr std::uint32_t rebias = static_cast<std::uint32_t>(127 - S::bias) << 23;

  static_assert(S::bits == 1 + S::ebits + S::mbits && S::bits <= 8 && S::mbits >= 1, "bad spec layout");
  static_assert(static_cast<int>(S::max_code >> S::mbits) - S::bias == S::emax,
                "max_code disagrees with emax");
  static_assert(S::max_code < (1u << (S::bits - 1)) && S::nan_code < (1u << S::bits), "codes out of range");
};

//! Exact value of magnitude code c (c <= max_code; no NaN/Inf handling).
template <class S>
QCOLL_HOST_DEVICE float decode_magnitude(std::uint32_t c) {
  const float sub = fp::mul(static_cast<float>(c), fp::from_bits(Facts<S>::sub_step_bits));  // exact
  return (c >> S::mbits) != 0 ? fp::from_bits(normal_bits<S>(c)) : sub;
}

//! Magnitude code of |x| rounded toward zero, for 0 <= a <= max_normal given by its bits u.
template <class S>
QCOLL_HOST_DEVICE std::uint32_t truncate_magnitude(std::uint32_t u) {
  constexpr int drop = 23 - S::mbits;
  const std::uint32_t normal = (u - Facts<S>::rebias) >> drop;
  // below 2^emin the code is floor(a / step); the product is < 2^mbits, so the cast is safe
  const bool small = u < Facts<S>::min_normal_bits;
  const float a = fp::from_bits(small ? u : 0u);
  const std::uint32_t sub =
      static_cast<std::uint32_t>(fp::mul(a, fp::from_bits(Facts<S>::inv_sub_step_bits)));
  return small ? sub : normal;
}

}  // namespace detail

//! Encodes x as spec S, rounding to nearest, ties to even, saturating to ±max_normal (±Inf
//! included); NaN gives S::nan_code. Bit-identical to CUDA's saturating conversions. O(1).
template <class S>
QCOLL_HOST_DEVICE std::uint8_t encode(float x) {
  using F = detail::Facts<S>;
  constexpr int drop = 23 - S::mbits;
  const std::uint32_t b = fp::bits(x);
  const std::uint32_t sign = (b >> 31) << (S::bits - 1);
  const std::uint32_t abs_bits = b & 0x7fffffffu;
  const bool is_nan = abs_bits > 0x7f800000u;
  // Clamp first: rounding is monotone, so clamp-then-round equals round-then-saturate.
  const std::uint32_t u = abs_bits < F::max_bits ? abs_bits : F::max_bits;
  // Normal range: rebias the exponent, then add (half ulp - 1 + lsb) so that the shift rounds to
  // nearest even; a mantissa carry moves into the exponent field, which is the right next code.
  const std::uint32_t rebased = u - F::rebias;
  const std::uint32_t normal = (rebased + ((1u << (drop - 1)) - 1u) + ((rebased >> drop) & 1u)) >> drop;
  // Below 2^emin: one IEEE addition of 2^(emin - mbits + 23) rounds |x| to the subnormal step.
  const bool small = u < F::min_normal_bits;
  const float magic = fp::from_bits(F::sub_magic_bits);
  const std::uint32_t sub = fp::bits(fp::add(fp::from_bits(small ? u : 0u), magic)) - F::sub_magic_bits;
  const std::uint32_t code = (small ? sub : normal) | sign;
  return static_cast<std::uint8_t>(is_nan ? static_cast<std::uint32_t>(S::nan_code) : code);
}

//! Encodes x as spec S with stochastic rounding, saturating like encode().
//!
//! With a = min(|x|, max_normal), lo <= a < hi the adjacent representable magnitudes and
//! step = hi - lo (a power of two), the result is hi with probability (a - lo) / step: it rounds up
//! exactly when `u < frac`, where u = (random_bits >> 8) * 2^-24 (qcoll::random_unit) and
//! frac = (a - lo) / step is computed exactly in float (step is a power of two). The up-probability
//! over uniform random_bits is q = ceil(frac * 2^24) / 2^24, so E[decode] = x exactly whenever frac
//! is a multiple of 2^-24, which holds for every |x| >= half the smallest subnormal of S; below
//! that, q - frac < 2^-24 (a bias under 2^-24 step). Representable values (frac = 0) never move,
//! whatever random_bits. NaN gives S::nan_code; ±Inf gives ±max_normal. O(1).
template <class S>
QCOLL_HOST_DEVICE std::uint8_t encode_stochastic(float x, std::uint32_t random_bits) {
  using F = detail::Facts<S>;
  const std::uint32_t b = fp::bits(x);
  const std::uint32_t sign = (b >> 31) << (S::bits - 1);
  const std::uint32_t abs_bits = b & 0x7fffffffu;
  const bool is_nan = abs_bits > 0x7f800000u;
  const std::uint32_t u = abs_bits < F::max_bits ? abs_bits : F::max_bits;
  const std::uint32_t lo_code = detail::truncate_magnitude<S>(u);
  const float lo = detail::decode_magnitude<S>(lo_code);
  // step = 2^(max(E, 1) - bias - mbits) for exponent field E of lo; multiply by 1/step (exact)
  const int e_field = static_cast<int>(lo_code >> S::mbits);
  const int step_exp = (e_field != 0 ? e_field : 1) - S::bias - S::mbits;
  const float inv_step = fp::from_bits(static_cast<std::uint32_t>(127 - step_exp) << 23);
  const float frac = fp::mul(fp::sub(fp::from_bits(u), lo), inv_step);  // exact, in [0, 1)
  const std::uint32_t up = random_unit(random_bits) < frac ? 1u : 0u;
  const std::uint32_t code = (lo_code + up) | sign;
  return static_cast<std::uint8_t>(is_nan ? static_cast<std::uint32_t>(S::nan_code) : code);
}

//! Exact value of a code of spec S (low S::bits bits used, higher bits ignored). NaN codes give
//! the float NaN 0x7fffffff; E5M2 infinities give ±Inf. Matches CUDA's `__nv_cvt_fp8_to_halfraw`,
//! `__nv_cvt_fp6_to_halfraw`, `__nv_cvt_fp4_to_halfraw` widened to float. O(1).
template <class S>
QCOLL_HOST_DEVICE float decode(std::uint8_t code) {
  const std::uint32_t c = code & ((1u << S::bits) - 1u);
  const std::uint32_t sign = (c >> (S::bits - 1)) << 31;
  const std::uint32_t mag = c & ((1u << (S::bits - 1)) - 1u);
  std::uint32_t out = fp::bits(detail::decode_magnitude<S>(mag)) | sign;
  // magnitude codes above max_code: E5M2 S.11111.00 is Inf, the others are NaN
  constexpr std::uint32_t inf_code = ((1u << S::ebits) - 1u) << S::mbits;
  const bool is_inf = S::has_inf && mag == inf_code;
  const bool is_nan = S::has_nan && mag > S::max_code && !is_inf;
  out = is_inf ? (sign | 0x7f800000u) : out;
  out = is_nan ? 0x7fffffffu : out;
  return fp::from_bits(out);
}

//! Value of an E8M0 scale code: 2^(code - 127) (code 0 is 2^-127, a float subnormal); code 0xFF
//! is NaN, returned as 0x7fffffff (CUDA's `__nv_cvt_e8m0_to_bf16raw` gives the bfloat16 NaN 0x7fff,
//! i.e. float bits 0x7fff0000). O(1).
QCOLL_HOST_DEVICE float e8m0_decode(std::uint8_t code) {
  const std::uint32_t c = code;
  std::uint32_t out = c << 23;
  out = c == 0 ? 0x00400000u : out;
  out = c == 0xffu ? 0x7fffffffu : out;
  return fp::from_bits(out);
}

}  // namespace minifloat
QCOLL_NAMESPACE_END
