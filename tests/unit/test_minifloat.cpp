// Element codecs for small floats (format/minifloat.hpp).
//
// Every spec is checked three ways:
//  * against a reference written here from the OCP definitions (value of a code in double,
//    nearest-even rounding by searching the sorted list of representable values), which needs
//    nothing but the standard library;
//  * against CUDA's own host conversions (cuda_fp8.h, cuda_fp6.h, cuda_fp4.h), bit for bit, when
//    the CUDA headers are available;
//  * for stochastic rounding, against the rule "round up iff (r >> 8) * 2^-24 < frac", plus a
//    statistical test of unbiasedness.

#include <doctest/doctest.h>

#include "../common/mismatch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <qcoll/core/rng.hpp>
#include <qcoll/format/minifloat.hpp>

// TEST_WITHOUT_CUDA_HEADERS forces the header-less configuration (to exercise it where CUDA exists).
#if defined(__has_include) && !defined(TEST_WITHOUT_CUDA_HEADERS)
#if __has_include(<cuda_fp8.h>) && __has_include(<cuda_fp6.h>) && __has_include(<cuda_fp4.h>)
#define TEST_HAVE_CUDA_MINIFLOAT 1
// cuda_fp4.hpp has unused parameters; keep -Werror builds quiet when it is not a system header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <cuda_fp4.h>
#include <cuda_fp6.h>
#include <cuda_fp8.h>
#pragma GCC diagnostic pop
#endif
#endif
#ifndef TEST_HAVE_CUDA_MINIFLOAT
#define TEST_HAVE_CUDA_MINIFLOAT 0
#endif

namespace mf = qcoll::minifloat;

namespace {

std::uint32_t to_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

std::string hex(std::uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%x", u);
  return buf;
}

float of_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Reference from the OCP definitions (independent of the code under test).

// Which magnitude codes are NaN / Inf, per the OCP FP8 and MX specifications.
template <class S>
bool ref_is_nan(unsigned mag);
template <class S>
bool ref_is_inf(unsigned mag);
template <>
bool ref_is_nan<mf::E4M3>(unsigned mag) {
  return mag == 0x7f;  // S.1111.111
}
template <>
bool ref_is_inf<mf::E4M3>(unsigned) {
  return false;
}
template <>
bool ref_is_nan<mf::E5M2>(unsigned mag) {
  return mag > 0x7c;  // S.11111.{01,10,11}
}
template <>
bool ref_is_inf<mf::E5M2>(unsigned mag) {
  return mag == 0x7c;  // S.11111.00
}
#define TEST_NO_SPECIALS(S)      \
  template <>                    \
  bool ref_is_nan<S>(unsigned) { \
    return false;                \
  }                              \
  template <>                    \
  bool ref_is_inf<S>(unsigned) { \
    return false;                \
  }
TEST_NO_SPECIALS(mf::E2M3)
TEST_NO_SPECIALS(mf::E3M2)
TEST_NO_SPECIALS(mf::E2M1)
#undef TEST_NO_SPECIALS

// Value of a finite magnitude code: E == 0 gives M * 2^(1 - bias - mbits), otherwise
// (1 + M / 2^mbits) * 2^(E - bias).
template <class S>
double ref_magnitude(unsigned mag) {
  const unsigned e = mag >> S::mbits;
  const unsigned m = mag & ((1u << S::mbits) - 1u);
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - S::bias - S::mbits);
  return std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -S::mbits), static_cast<int>(e) - S::bias);
}

// Sorted non-negative finite values, indexed by magnitude code (codes are ordered by value).
template <class S>
std::vector<double> ref_values() {
  std::vector<double> v;
  for (unsigned mag = 0; mag < (1u << (S::bits - 1)); ++mag) {
    if (ref_is_nan<S>(mag) || ref_is_inf<S>(mag)) break;  // specials sit above every finite code
    v.push_back(ref_magnitude<S>(mag));
  }
  return v;
}

// The code for NaN input: E4M3 and E5M2 give the positive NaN 0x7f (CUDA canonicalises the NaN
// to 0x7fffffff first, so the sign is dropped); FP6/FP4 have no NaN and give +max_normal.
template <class S>
unsigned ref_nan_code(const std::vector<double>& values) {
  bool has_nan = false;
  for (unsigned mag = 0; mag < (1u << (S::bits - 1)); ++mag) has_nan = has_nan || ref_is_nan<S>(mag);
  return has_nan ? 0x7fu : static_cast<unsigned>(values.size() - 1);
}

// Round to nearest, ties to the even code, saturating at the largest finite value.
template <class S>
unsigned ref_encode(float x, const std::vector<double>& values) {
  const std::uint32_t b = to_bits(x);
  if (std::isnan(x)) return ref_nan_code<S>(values);
  const unsigned sign = (b >> 31) << (S::bits - 1);
  const double a = std::min(std::fabs(static_cast<double>(x)), values.back());
  const auto it = std::lower_bound(values.begin(), values.end(), a);  // first value >= a
  unsigned hi = static_cast<unsigned>(it - values.begin());
  unsigned code = hi;
  if (values[hi] != a) {  // a lies strictly between values[hi - 1] and values[hi]
    const unsigned lo = hi - 1;
    const double dlo = a - values[lo], dhi = values[hi] - a;  // exact: all values are dyadic
    code = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1u) == 0 ? lo : hi);
  }
  return code | sign;
}

// ---------------------------------------------------------------------------------------------
// CUDA's conversions.

#if TEST_HAVE_CUDA_MINIFLOAT
template <class S>
unsigned cuda_encode(float x);
template <class S>
float cuda_decode(unsigned code);
template <>
unsigned cuda_encode<mf::E4M3>(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
template <>
unsigned cuda_encode<mf::E5M2>(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
}
template <>
unsigned cuda_encode<mf::E2M3>(float x) {
  return __nv_cvt_float_to_fp6(x, __NV_E2M3, cudaRoundNearest);
}
template <>
unsigned cuda_encode<mf::E3M2>(float x) {
  return __nv_cvt_float_to_fp6(x, __NV_E3M2, cudaRoundNearest);
}
template <>
unsigned cuda_encode<mf::E2M1>(float x) {
  return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
}
template <>
float cuda_decode<mf::E4M3>(unsigned c) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3)));
}
template <>
float cuda_decode<mf::E5M2>(unsigned c) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E5M2)));
}
template <>
float cuda_decode<mf::E2M3>(unsigned c) {
  return __half2float(__half(__nv_cvt_fp6_to_halfraw(static_cast<__nv_fp6_storage_t>(c), __NV_E2M3)));
}
template <>
float cuda_decode<mf::E3M2>(unsigned c) {
  return __half2float(__half(__nv_cvt_fp6_to_halfraw(static_cast<__nv_fp6_storage_t>(c), __NV_E3M2)));
}
template <>
float cuda_decode<mf::E2M1>(unsigned c) {
  return __half2float(__half(__nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(c), __NV_E2M1)));
}
#endif

// ---------------------------------------------------------------------------------------------
// Inputs.

float next_up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }
float next_down(float x) { return std::nextafter(x, -std::numeric_limits<float>::infinity()); }

// Targeted inputs for spec S (both signs): every representable value, every midpoint between
// adjacent values (the ties), and their float neighbours; the virtual next value above
// max_normal, its midpoint and the saturation region; the subnormal range densely; zeros,
// infinities, NaNs with several payloads; float subnormals.
template <class S>
std::vector<float> targeted_inputs(const std::vector<double>& values) {
  std::vector<float> in;
  auto add3 = [&](double v) {
    const float f = static_cast<float>(v);
    REQUIRE(static_cast<double>(f) == v);  // every value and midpoint used here is a float
    in.push_back(f);
    in.push_back(next_up(f));
    in.push_back(next_down(f));
  };
  const std::size_t n = values.size();
  for (std::size_t k = 0; k < n; ++k) {
    add3(values[k]);
    if (k + 1 < n) add3(0.5 * (values[k] + values[k + 1]));
  }
  // Above max_normal: the step of the top binade continues (max + step would be the next code).
  const double max = values[n - 1], step = values[n - 1] - values[n - 2];
  add3(max + 0.5 * step);
  add3(max + step);
  add3(2.0 * max);
  add3(std::ldexp(1.0, S::emax + 1));
  // Saturation region: float patterns from max_normal / 2 to 4 * max_normal, stride 61.
  for (std::uint32_t u = to_bits(static_cast<float>(max / 2)); u <= to_bits(static_cast<float>(4 * max));
       u += 61)
    in.push_back(of_bits(u));
  // Subnormal range and first binade, densely: 2^16 equally spaced values below 2 * 2^emin, and
  // float patterns below 2 * 2^emin with stride 1021 (~ every 2^-13 relative in each binade).
  const double min_normal = std::ldexp(1.0, 1 - S::bias);
  for (int i = 0; i <= (1 << 16); ++i)
    in.push_back(static_cast<float>(std::ldexp(2.0 * min_normal * i, -16)));
  for (std::uint32_t u = 0; u <= to_bits(static_cast<float>(2 * min_normal)); u += 1021)
    in.push_back(of_bits(u));
  // Zeros, float subnormals, smallest normals, largest finite, infinities.
  const float inf = std::numeric_limits<float>::infinity();
  for (std::uint32_t u : {0x0u, 0x1u, 0x2u, 0x3u, 0x400000u, 0x7fffffu, 0x800000u, 0x800001u, 0x7f7fffffu})
    in.push_back(of_bits(u));
  for (std::uint32_t u = 0; u < 0x800000u; u += 4099) in.push_back(of_bits(u));
  in.push_back(inf);
  // NaNs: quiet and signalling, several payloads (the sign is added below).
  for (std::uint32_t u : {0x7f800001u, 0x7f800100u, 0x7fa5a5a5u, 0x7fbfffffu, 0x7fc00000u, 0x7fc00001u,
                          0x7fe00000u, 0x7fffffffu})
    in.push_back(of_bits(u));
  const std::size_t half = in.size();
  for (std::size_t i = 0; i < half; ++i) in.push_back(of_bits(to_bits(in[i]) ^ 0x80000000u));
  return in;
}

using testing_support::Mismatch;

}  // namespace

#define TEST_SPECS mf::E4M3, mf::E5M2, mf::E2M3, mf::E3M2, mf::E2M1

TEST_CASE_TEMPLATE("minifloat: spec facts agree with the OCP definitions", S, TEST_SPECS) {
  const std::vector<double> values = ref_values<S>();
  CHECK(S::bits == 1 + S::ebits + S::mbits);
  CHECK(values.back() == static_cast<double>(S::max_normal));
  CHECK(values.size() == S::max_code + 1);
  CHECK(std::ldexp(1.0, S::emax) <= values.back());
  CHECK(values.back() < std::ldexp(1.0, S::emax + 1));
  for (std::size_t k = 1; k < values.size(); ++k) CHECK(values[k - 1] < values[k]);
  CHECK(static_cast<double>(mf::decode<S>(static_cast<std::uint8_t>(S::max_code))) == values.back());
}

TEST_CASE_TEMPLATE("minifloat: decode of every code matches the definition", S, TEST_SPECS) {
  const unsigned ncodes = 1u << S::bits;
  const double inf = std::numeric_limits<double>::infinity();
  for (unsigned byte = 0; byte < 256; ++byte) {  // bits above S::bits must be ignored
    const unsigned c = byte & (ncodes - 1);
    const unsigned mag = c & (ncodes / 2 - 1);
    const bool neg = (c >> (S::bits - 1)) != 0;
    const float got = mf::decode<S>(static_cast<std::uint8_t>(byte));
    INFO(S::name, " code byte ", hex(byte), " decoded bits ", hex(to_bits(got)));
    if (ref_is_nan<S>(mag)) {
      CHECK(to_bits(got) == 0x7fffffffu);  // documented canonical NaN, sign dropped
    } else if (ref_is_inf<S>(mag)) {
      CHECK(static_cast<double>(got) == (neg ? -inf : inf));
    } else {
      const double want = neg ? -ref_magnitude<S>(mag) : ref_magnitude<S>(mag);
      CHECK(static_cast<double>(got) == want);
      CHECK(std::signbit(got) == neg);  // -0 stays -0
    }
  }
}

TEST_CASE_TEMPLATE("minifloat: round-to-nearest-even encode matches the reference", S, TEST_SPECS) {
  const std::vector<double> values = ref_values<S>();
  const std::vector<float> in = targeted_inputs<S>(values);
  Mismatch m;
  for (float x : in) {
    const unsigned got = mf::encode<S>(x), want = ref_encode<S>(x, values);
    if (got != want) m.add(to_bits(x), got, want);
  }
  // Random float patterns of every exponent, and random values within +-2 max_normal.
  for (std::uint64_t i = 0; i < (1u << 18); ++i) {
    const std::uint32_t r = qcoll::random_bits(0x5eed, i);
    const float y = static_cast<float>((2.0 * qcoll::random_unit(r) - 1.0) * 2.0 * values.back());
    for (float x : {of_bits(r), y}) {
      const unsigned got = mf::encode<S>(x), want = ref_encode<S>(x, values);
      if (got != want) m.add(to_bits(x), got, want);
    }
  }
  INFO(S::name, ": ", m.describe());
  CHECK(m.count == 0);
  // Every finite code decodes and re-encodes to itself.
  for (unsigned c = 0; c < (1u << S::bits); ++c) {
    const unsigned mag = c & ((1u << (S::bits - 1)) - 1u);
    if (ref_is_nan<S>(mag) || ref_is_inf<S>(mag)) continue;
    CHECK(mf::encode<S>(mf::decode<S>(static_cast<std::uint8_t>(c))) == c);
  }
}

#if TEST_HAVE_CUDA_MINIFLOAT

TEST_CASE_TEMPLATE("minifloat: decode of every code matches CUDA", S, TEST_SPECS) {
  for (unsigned c = 0; c < (1u << S::bits); ++c) {
    const float got = mf::decode<S>(static_cast<std::uint8_t>(c)), want = cuda_decode<S>(c);
    INFO(S::name, " code ", hex(c), ": got bits ", hex(to_bits(got)), " CUDA ", hex(to_bits(want)));
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
    } else {
      CHECK(to_bits(got) == to_bits(want));
    }
  }
}

TEST_CASE_TEMPLATE("minifloat: encode matches CUDA bit for bit", S, TEST_SPECS) {
  const std::vector<double> values = ref_values<S>();
  Mismatch targeted, swept, random;
  for (float x : targeted_inputs<S>(values)) {
    const unsigned got = mf::encode<S>(x), want = cuda_encode<S>(x);
    if (got != want) targeted.add(to_bits(x), got, want);
  }
  // Every float pattern with an odd stride (so every residue of the low bits is visited); the
  // offset differs per spec so that the five sweeps cover different patterns. 2^32 / 31 is about
  // 139M patterns per spec (~0.8 s each on one core, most of it in CUDA's double-based path).
  constexpr std::uint64_t stride = 31;
  const std::uint64_t offset = static_cast<std::uint64_t>(S::ebits * 8 + S::mbits) % stride;
  for (std::uint64_t i = offset; i < (std::uint64_t{1} << 32); i += stride) {
    const float x = of_bits(static_cast<std::uint32_t>(i));
    const unsigned got = mf::encode<S>(x), want = cuda_encode<S>(x);
    if (got != want) swept.add(static_cast<std::uint32_t>(i), got, want);
  }
  for (std::uint64_t i = 0; i < (1u << 20); ++i) {
    const float x = of_bits(qcoll::random_bits(0xc0da, i));
    const unsigned got = mf::encode<S>(x), want = cuda_encode<S>(x);
    if (got != want) random.add(to_bits(x), got, want);
  }
  INFO(S::name, " targeted: ", targeted.describe());
  INFO(S::name, " strided sweep: ", swept.describe());
  INFO(S::name, " random: ", random.describe());
  CHECK(targeted.count == 0);
  CHECK(swept.count == 0);
  CHECK(random.count == 0);
}

TEST_CASE("minifloat: e8m0_decode matches CUDA") {
  for (unsigned c = 0; c < 256; ++c) {
    const float got = mf::e8m0_decode(static_cast<std::uint8_t>(c));
    const float want =
        __bfloat162float(__nv_bfloat16(__nv_cvt_e8m0_to_bf16raw(static_cast<__nv_fp8_storage_t>(c))));
    INFO("code ", c, ": got bits ", hex(to_bits(got)), " CUDA ", hex(to_bits(want)));
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
    } else {
      CHECK(to_bits(got) == to_bits(want));
    }
  }
}

#else

TEST_CASE(
    "minifloat: comparisons with CUDA's conversions (skipped: cuda_fp8.h/cuda_fp6.h/cuda_fp4.h not found)" *
    doctest::skip()) {}

#endif

TEST_CASE("minifloat: e8m0_decode matches the definition") {
  for (unsigned c = 0; c < 255; ++c) {
    const float got = mf::e8m0_decode(static_cast<std::uint8_t>(c));
    INFO("code ", c);
    CHECK(static_cast<double>(got) == std::ldexp(1.0, static_cast<int>(c) - 127));
  }
  CHECK(to_bits(mf::e8m0_decode(0xff)) == 0x7fffffffu);  // documented NaN
}

namespace {

// The two neighbours of |x| and the rounding-up threshold, from the reference value list.
struct Bracket {
  unsigned lo = 0, hi = 0;  // magnitude codes, lo == hi when |x| is representable or saturated
  double step = 0, p = 0;   // hi - lo and (|x| - lo) / step
  std::uint64_t k0 = 0;     // ceil(p * 2^24): number of u = (r >> 8) with u * 2^-24 < p
};

template <class S>
Bracket bracket(float x, const std::vector<double>& values) {
  Bracket b;
  const double a = std::min(std::fabs(static_cast<double>(x)), values.back());
  const unsigned lo =
      static_cast<unsigned>(std::upper_bound(values.begin(), values.end(), a) - values.begin()) - 1;
  b.lo = b.hi = lo;
  if (values[lo] == a) return b;
  b.hi = lo + 1;
  b.step = values[b.hi] - values[lo];
  b.p = (a - values[lo]) / b.step;  // exact: a - lo has at most 24 significant bits, step = 2^k
  b.k0 = static_cast<std::uint64_t>(std::ceil(std::ldexp(b.p, 24)));
  return b;
}

}  // namespace

TEST_CASE_TEMPLATE("minifloat: stochastic rounding follows the u < frac rule", S, TEST_SPECS) {
  const std::vector<double> values = ref_values<S>();
  const unsigned sign_bit = 1u << (S::bits - 1);

  // Representable values never move, whatever the random bits.
  std::vector<std::uint32_t> rs = {0u, 1u, 0xffu, 0x100u, 0x7fffffffu, 0x80000000u, 0xffffff00u, 0xffffffffu};
  for (std::uint64_t i = 0; i < 24; ++i) rs.push_back(qcoll::random_bits(0xabc, i));
  std::uint64_t moved = 0;
  for (unsigned c = 0; c < (1u << S::bits); ++c) {
    const unsigned mag = c & (sign_bit - 1);
    if (ref_is_nan<S>(mag) || ref_is_inf<S>(mag)) continue;
    const float v = mf::decode<S>(static_cast<std::uint8_t>(c));
    for (std::uint32_t r : rs) moved += mf::encode_stochastic<S>(v, r) != c;
  }
  CHECK(moved == 0);

  // Every other input: the result is one of the two neighbours, and it is the upper one exactly
  // when (r >> 8) < ceil(p * 2^24), i.e. (r >> 8) * 2^-24 < p. Specials follow encode().
  std::vector<float> in = targeted_inputs<S>(values);
  for (std::uint64_t i = 0; i < (1u << 16); ++i) {
    const std::uint32_t r = qcoll::random_bits(0xfeed, i);
    in.push_back(static_cast<float>((2.0 * qcoll::random_unit(r) - 1.0) * 1.25 * values.back()));
  }
  Mismatch not_neighbour, wrong_side, special;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const float x = in[i];
    const std::uint32_t xb = to_bits(x);
    if (std::isnan(x)) {
      const unsigned got = mf::encode_stochastic<S>(x, qcoll::random_bits(1, i)),
                     want = ref_nan_code<S>(values);
      if (got != want) special.add(xb, got, want);
      continue;
    }
    const Bracket b = bracket<S>(x, values);
    const unsigned sign = (xb >> 31) ? sign_bit : 0u;
    std::vector<std::uint32_t> trial = {0u, 0xffffffffu, qcoll::random_bits(2, i), qcoll::random_bits(3, i)};
    if (b.k0 > 0)
      trial.push_back(static_cast<std::uint32_t>(((b.k0 - 1) << 8) | 0xffu));       // last u that rounds up
    if (b.k0 < (1u << 24)) trial.push_back(static_cast<std::uint32_t>(b.k0 << 8));  // first u that does not
    for (std::uint32_t r : trial) {
      const unsigned got = mf::encode_stochastic<S>(x, r);
      if (got != (b.lo | sign) && got != (b.hi | sign)) not_neighbour.add(xb, got, b.lo | sign);
      const unsigned want = ((r >> 8) < b.k0 ? b.hi : b.lo) | sign;
      if (got != want) wrong_side.add(xb, got, want);
    }
  }
  INFO(S::name, " not a neighbour: ", not_neighbour.describe());
  INFO(S::name, " wrong side of the threshold: ", wrong_side.describe());
  INFO(S::name, " NaN input: ", special.describe());
  CHECK(not_neighbour.count == 0);
  CHECK(wrong_side.count == 0);
  CHECK(special.count == 0);
}

TEST_CASE_TEMPLATE("minifloat: stochastic rounding is unbiased", S, TEST_SPECS) {
  const std::vector<double> values = ref_values<S>();
  const unsigned nvals = static_cast<unsigned>(values.size());

  // Exact check over the whole distribution of u = (r >> 8) * 2^-24: enumerate all 2^24 values
  // of r >> 8 (the low 8 bits of r are random too) and average the decoded results. Any float x
  // above lo has p = (|x| - lo) / step a multiple of 2^-(23 - mbits), hence of 2^-24, so the mean
  // must equal x exactly.
  // Inputs: one in the subnormal range (lo = 0), one in the top binade, two anywhere.
  for (int t = 0; t < 4; ++t) {
    const std::uint32_t r0 = qcoll::random_bits(0x11, static_cast<std::uint64_t>(t));
    const unsigned lo = t == 0 ? 0u : t == 1 ? nvals - 2 : r0 % (nvals - 1);
    const double step = values[lo + 1] - values[lo];
    const std::uint32_t k = ((r0 >> 8) & ((1u << (23 - S::mbits)) - 1u)) | 1u;
    const double p = std::ldexp(static_cast<double>(k), S::mbits - 23);  // in (0, 1)
    const float x = static_cast<float>(-(values[lo] + p * step));        // negative side
    REQUIRE(static_cast<double>(x) == -(values[lo] + p * step));
    // Exact in double: every term is lo or hi, both multiples of step and below 2^(mbits + 1)
    // step, so the sum of 2^24 terms needs at most 24 + mbits + 1 significant bits.
    double sum = 0;
    for (std::uint32_t j = 0; j < (1u << 24); ++j)
      sum += static_cast<double>(mf::decode<S>(mf::encode_stochastic<S>(x, (j << 8) | (j & 0xffu))));
    INFO(S::name, " x = ", x);
    CHECK(std::ldexp(sum, -24) == static_cast<double>(x));
  }

  // Statistical check with the counter-based generator: K draws for each of many inputs. The
  // number of round-ups is Binomial(K, q) with q = ceil(p * 2^24) / 2^24, so q - p lies in
  // [0, 2^-24). The mean of the decoded values is lo + step * ups / K, and
  //   |mean - |x|| <= step * (5 * sqrt(p (1 - p) / K) + 2^-24)
  // holds unless the draw count is more than five standard deviations from its expectation.
  // Inputs keep p in [2^-6, 1 - 2^-6], so K p (1 - p) >= 250 and the normal approximation that the
  // five-sigma tail (about 6e-7 per input) relies on is sound.
  constexpr int K = 1 << 14;
  std::uint64_t failures = 0;
  double worst = 0;
  for (std::uint64_t t = 0; t < 128; ++t) {
    const std::uint32_t r0 = qcoll::random_bits(0x22, t);
    const unsigned lo = (r0 >> 20) % (nvals - 1);
    const double step = values[lo + 1] - values[lo];
    const double p =
        std::ldexp(static_cast<double>((r0 & 0xfffffu) % ((1u << 20) - (1u << 15)) + (1u << 14)), -20);
    const float x = static_cast<float>(values[lo] + p * step);
    REQUIRE(static_cast<double>(x) == values[lo] + p * step);
    double sum = 0;
    for (int i = 0; i < K; ++i)
      sum += static_cast<double>(mf::decode<S>(
          mf::encode_stochastic<S>(x, qcoll::random_bits(0x33 + t, static_cast<std::uint64_t>(i)))));
    const double mean = sum / K;
    const double bound = step * (5.0 * std::sqrt(p * (1.0 - p) / K) + std::ldexp(1.0, -24));
    const double dev = std::fabs(mean - static_cast<double>(x));
    worst = std::max(worst, dev / bound);
    failures += dev > bound;
  }
  INFO(S::name, ": worst deviation / bound = ", worst);
  CHECK(failures == 0);

  // Saturation: beyond max_normal every draw gives max_normal, so the mean is the clamp.
  for (float x : {S::max_normal * 1.5f, std::numeric_limits<float>::infinity()}) {
    for (std::uint64_t i = 0; i < 64; ++i) {
      CHECK(mf::encode_stochastic<S>(x, qcoll::random_bits(0x44, i)) == S::max_code);
      CHECK(mf::encode_stochastic<S>(-x, qcoll::random_bits(0x44, i)) ==
            (S::max_code | (1u << (S::bits - 1))));
    }
  }
}
