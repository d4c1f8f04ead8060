// qcoll's 16-bit float types (core/half.hpp): qcoll::half and qcoll::bfloat16.
//
// Checked against the IEEE / bfloat16 definitions written here (no CUDA needed), and bit for bit
// against CUDA's host conversions (__half2float, __bfloat162float, __float2half_rn,
// __float2bfloat16_rn) when the CUDA headers are available: every 16-bit pattern decoded, and
// more than 2^26 float inputs encoded (a strided sweep of all 2^32 patterns, random patterns,
// specials, and every rounding midpoint with its float neighbours).

#include <doctest/doctest.h>

#include "../common/mismatch.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <qcoll/core/half.hpp>
#include <qcoll/core/rng.hpp>

// TEST_WITHOUT_CUDA_HEADERS forces the header-less configuration (to exercise it where CUDA exists).
#if defined(__has_include) && !defined(TEST_WITHOUT_CUDA_HEADERS)
#if __has_include(<cuda_fp16.h>) && __has_include(<cuda_bf16.h>)
#define TEST_HAVE_CUDA_HALF 1
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#endif
#ifndef TEST_HAVE_CUDA_HALF
#define TEST_HAVE_CUDA_HALF 0
#endif

namespace {

std::uint32_t to_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float of_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

std::string hex(std::uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%x", u);
  return buf;
}

// Value of a binary16 pattern from the IEEE 754 definition (NaN for NaN patterns).
double ref_half_value(unsigned h) {
  const unsigned e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  const double s = (h & 0x8000u) ? -1.0 : 1.0;
  if (e == 0x1f)
    return m ? std::numeric_limits<double>::quiet_NaN() : s * std::numeric_limits<double>::infinity();
  if (e == 0) return s * std::ldexp(static_cast<double>(m), -24);
  return s * std::ldexp(1024.0 + m, static_cast<int>(e) - 25);
}

// Value of a bfloat16 pattern: sign, 8 exponent bits (bias 127), 7 mantissa bits.
double ref_bf16_value(unsigned b) {
  const unsigned e = (b >> 7) & 0xffu, m = b & 0x7fu;
  const double s = (b & 0x8000u) ? -1.0 : 1.0;
  if (e == 0xff)
    return m ? std::numeric_limits<double>::quiet_NaN() : s * std::numeric_limits<double>::infinity();
  if (e == 0) return s * std::ldexp(static_cast<double>(m), -133);
  return s * std::ldexp(128.0 + m, static_cast<int>(e) - 134);
}

// Round-to-nearest-even reference over a sorted table of the non-negative finite values
// (index = bit pattern); `overflow` is the first magnitude that rounds to infinity (the midpoint
// between the largest finite value and the next power of two, which rounds up because the largest
// finite pattern is odd). NaN gives 0x7fff, as documented in half.hpp.
unsigned ref_round(float x, const std::vector<double>& values, double overflow, unsigned inf_bits) {
  if (std::isnan(x)) return 0x7fffu;
  const unsigned sign = std::signbit(x) ? 0x8000u : 0u;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= overflow) return sign | inf_bits;
  const auto it = std::lower_bound(values.begin(), values.end(), a);
  unsigned hi = static_cast<unsigned>(it - values.begin());
  if (hi == values.size()) return sign | (hi - 1);  // between max and overflow: rounds down
  if (values[hi] == a) return sign | hi;
  const unsigned lo = hi - 1;
  const double dlo = a - values[lo], dhi = values[hi] - a;
  return sign | (dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1u) == 0 ? lo : hi));
}

std::vector<double> half_values() {
  std::vector<double> v;
  for (unsigned h = 0; h < 0x7c00u; ++h) v.push_back(ref_half_value(h));
  return v;
}

std::vector<double> bf16_values() {
  std::vector<double> v;
  for (unsigned b = 0; b < 0x7f80u; ++b) v.push_back(ref_bf16_value(b));
  return v;
}

constexpr double half_overflow = 65520.0;             // (65504 + 65536) / 2
const double bf16_overflow = std::ldexp(511.0, 119);  // (0x1.fep127 + 2^128) / 2 = 0x1.ffp127

float next_up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }
float next_down(float x) { return std::nextafter(x, -std::numeric_limits<float>::infinity()); }

// Every rounding midpoint of the format (including the overflow midpoint) with its two float
// neighbours, both signs, plus specials, zeros, float subnormals and the over/underflow regions.
std::vector<float> targeted_inputs(const std::vector<double>& values, double overflow,
                                   std::uint32_t region_lo, std::uint32_t region_hi,
                                   std::uint32_t underflow_bits) {
  std::vector<float> in;
  auto add3 = [&](double v) {
    const float f = static_cast<float>(v);
    REQUIRE(static_cast<double>(f) == v);
    in.push_back(f);
    in.push_back(next_up(f));
    in.push_back(next_down(f));
  };
  for (std::size_t k = 0; k + 1 < values.size(); ++k) add3(0.5 * (values[k] + values[k + 1]));
  add3(overflow);
  add3(values.back());
  // Every float pattern around the overflow threshold and around the underflow-to-zero threshold.
  for (std::uint32_t u = region_lo; u <= region_hi; ++u) in.push_back(of_bits(u));
  for (std::uint32_t u = underflow_bits - 4096; u <= underflow_bits + 4096; ++u) in.push_back(of_bits(u));
  for (std::uint32_t u : {0x0u, 0x1u, 0x3ffu, 0x400000u, 0x7fffffu, 0x800000u, 0x7f7fffffu, 0x7f800000u,
                          0x7f800001u, 0x7f800100u, 0x7fa5a5a5u, 0x7fbfffffu, 0x7fc00000u, 0x7fc00001u,
                          0x7fffffffu, 0x7f7f8000u, 0x477fe000u, 0x477ff000u, 0x47800000u})
    in.push_back(of_bits(u));
  const std::size_t n = in.size();
  for (std::size_t i = 0; i < n; ++i) in.push_back(of_bits(to_bits(in[i]) ^ 0x80000000u));
  return in;
}

using testing_support::Mismatch;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Without CUDA.

TEST_CASE("half: layout of qcoll::half and qcoll::bfloat16") {
  static_assert(sizeof(qcoll::half) == 2 && alignof(qcoll::half) == 2, "half is 2 bytes, 2-aligned");
  static_assert(sizeof(qcoll::bfloat16) == 2 && alignof(qcoll::bfloat16) == 2, "bfloat16 is 2 bytes");
  static_assert(std::is_standard_layout<qcoll::half>::value && std::is_trivially_copyable<qcoll::half>::value,
                "half must be a plain 16-bit pattern");
  static_assert(
      std::is_standard_layout<qcoll::bfloat16>::value && std::is_trivially_copyable<qcoll::bfloat16>::value,
      "bfloat16 must be a plain 16-bit pattern");
  static_assert(offsetof(qcoll::half, bits) == 0 && offsetof(qcoll::bfloat16, bits) == 0, "bits at offset 0");
  // Arrays pack with no padding: element k sits at byte 2k.
  qcoll::half a[3] = {{0x3c00}, {0x4000}, {0xc000}};
  unsigned char bytes[sizeof a];
  std::memcpy(bytes, a, sizeof a);
  CHECK(sizeof a == 6);
  CHECK((bytes[2] | (bytes[3] << 8)) == 0x4000);
  CHECK(qcoll::dtype_of<float>::value == qcoll::DType::f32);
  CHECK(qcoll::dtype_of<qcoll::half>::value == qcoll::DType::f16);
  CHECK(qcoll::dtype_of<qcoll::bfloat16>::value == qcoll::DType::bf16);
  CHECK(std::string(qcoll::dtype_name(qcoll::DType::bf16)) == "bf16");
}

TEST_CASE("half: decode of every pattern matches the definition") {
  for (unsigned h = 0; h < 0x10000u; ++h) {
    const float hf = qcoll::to_float(qcoll::half{static_cast<std::uint16_t>(h)});
    const float bf = qcoll::to_float(qcoll::bfloat16{static_cast<std::uint16_t>(h)});
    const double hw = ref_half_value(h), bw = ref_bf16_value(h);
    INFO("pattern ", hex(h), " half -> ", hex(to_bits(hf)), " bf16 -> ", hex(to_bits(bf)));
    if (std::isnan(hw)) {
      CHECK(to_bits(hf) == 0x7fffffffu);  // any binary16 NaN widens to 0x7fffffff
    } else {
      CHECK(static_cast<double>(hf) == hw);
      CHECK(std::signbit(hf) == ((h & 0x8000u) != 0));
    }
    // bfloat16 is the top half of a float: widening keeps every bit, NaN payloads included
    CHECK(to_bits(bf) == (h << 16));
    if (!std::isnan(bw)) CHECK(static_cast<double>(bf) == bw);
  }
}

TEST_CASE("half: encode rounds to nearest even (reference, midpoints and random inputs)") {
  const std::vector<double> hv = half_values(), bv = bf16_values();
  std::vector<float> in = targeted_inputs(hv, half_overflow, 0x477fe000u, 0x47800000u, 0x33000000u);
  const std::vector<float> bin = targeted_inputs(bv, bf16_overflow, 0x7f7f0000u, 0x7f800000u, 0x00008000u);
  in.insert(in.end(), bin.begin(), bin.end());
  for (std::uint64_t i = 0; i < (1u << 18); ++i) in.push_back(of_bits(qcoll::random_bits(0x4a1f, i)));
  Mismatch mh, mb;
  for (float x : in) {
    const unsigned gh = qcoll::from_float<qcoll::half>(x).bits, wh = ref_round(x, hv, half_overflow, 0x7c00u);
    const unsigned gb = qcoll::from_float<qcoll::bfloat16>(x).bits,
                   wb = ref_round(x, bv, bf16_overflow, 0x7f80u);
    if (gh != wh) mh.add(to_bits(x), gh, wh);
    if (gb != wb) mb.add(to_bits(x), gb, wb);
  }
  INFO("half: ", mh.describe());
  INFO("bf16: ", mb.describe());
  CHECK(mh.count == 0);
  CHECK(mb.count == 0);
}

TEST_CASE("half: round trips") {
  // 16 bits -> float -> 16 bits is the identity on every non-NaN pattern; NaN becomes 0x7fff.
  std::uint64_t bad_half = 0, bad_bf16 = 0;
  for (unsigned h = 0; h < 0x10000u; ++h) {
    const std::uint16_t p = static_cast<std::uint16_t>(h);
    const unsigned back_h = qcoll::from_float<qcoll::half>(qcoll::to_float(qcoll::half{p})).bits;
    const unsigned back_b = qcoll::from_float<qcoll::bfloat16>(qcoll::to_float(qcoll::bfloat16{p})).bits;
    const bool half_nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
    const bool bf16_nan = (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
    bad_half += back_h != (half_nan ? 0x7fffu : h);
    bad_bf16 += back_b != (bf16_nan ? 0x7fffu : h);
  }
  CHECK(bad_half == 0);
  CHECK(bad_bf16 == 0);
  // float is its own element type: both directions are the identity, NaN payloads included.
  std::uint64_t bad_float = 0;
  for (std::uint64_t i = 0; i < (1u << 16); ++i) {
    const float x = of_bits(qcoll::random_bits(0x77, i));
    bad_float += to_bits(qcoll::from_float<float>(x)) != to_bits(x);
    bad_float += to_bits(qcoll::to_float(x)) != to_bits(x);
  }
  CHECK(bad_float == 0);
  // float -> 16 bits -> float moves a value by at most half a unit in the last place of the
  // 16-bit format: for |x| in [2^e, 2^(e+1)) within range, |error| <= 2^(e - 11) for binary16
  // (2^-25 below 2^-14) and 2^(e - 8) for bfloat16.
  std::uint64_t bad_err = 0;
  for (std::uint64_t i = 0; i < (1u << 18); ++i) {
    const std::uint32_t r = qcoll::random_bits(0x88, i);
    const float x =
        static_cast<float>(std::ldexp(2.0 * qcoll::random_unit(r) - 1.0, static_cast<int>(r % 40) - 24));
    int e;
    std::frexp(static_cast<double>(x), &e);  // |x| in [2^(e-1), 2^e)
    const double eh = std::fabs(static_cast<double>(qcoll::to_float(qcoll::from_float<qcoll::half>(x))) - x);
    const double eb =
        std::fabs(static_cast<double>(qcoll::to_float(qcoll::from_float<qcoll::bfloat16>(x))) - x);
    bad_err += eh > std::ldexp(1.0, std::max(e - 1, -14) - 11);
    bad_err += eb > std::ldexp(1.0, e - 1 - 8);
  }
  CHECK(bad_err == 0);
}

// ---------------------------------------------------------------------------------------------
// Against CUDA.

#if TEST_HAVE_CUDA_HALF

static_assert(sizeof(qcoll::half) == sizeof(__half) && alignof(qcoll::half) == alignof(__half),
              "qcoll::half must be layout-compatible with __half");
static_assert(sizeof(qcoll::bfloat16) == sizeof(__nv_bfloat16) &&
                  alignof(qcoll::bfloat16) == alignof(__nv_bfloat16),
              "qcoll::bfloat16 must be layout-compatible with __nv_bfloat16");

namespace {
unsigned cuda_half_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
unsigned cuda_bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
}  // namespace

TEST_CASE("half: arrays are interchangeable with CUDA's __half and __nv_bfloat16") {
  constexpr int n = 64;
  __half ch[n];
  __nv_bfloat16 cb[n];
  for (int i = 0; i < n; ++i) {
    const float x = static_cast<float>(i) * 0.37f - 9.0f;
    ch[i] = __float2half_rn(x);
    cb[i] = __float2bfloat16_rn(x);
  }
  qcoll::half qh[n];
  qcoll::bfloat16 qb[n];
  static_assert(sizeof qh == sizeof ch && sizeof qb == sizeof cb, "same array sizes");
  std::memcpy(qh, ch, sizeof ch);
  std::memcpy(qb, cb, sizeof cb);
  for (int i = 0; i < n; ++i) {
    CHECK(to_bits(qcoll::to_float(qh[i])) == to_bits(__half2float(ch[i])));
    CHECK(to_bits(qcoll::to_float(qb[i])) == to_bits(__bfloat162float(cb[i])));
  }
}

TEST_CASE("half: decode of every pattern matches CUDA bit for bit") {
  Mismatch mh, mb;
  for (unsigned h = 0; h < 0x10000u; ++h) {
    const std::uint16_t p = static_cast<std::uint16_t>(h);
    const std::uint32_t gh = to_bits(qcoll::to_float(qcoll::half{p}));
    const std::uint32_t wh = to_bits(__half2float(__ushort_as_half(p)));
    const std::uint32_t gb = to_bits(qcoll::to_float(qcoll::bfloat16{p}));
    const std::uint32_t wb = to_bits(__bfloat162float(__ushort_as_bfloat16(p)));
    if (gh != wh) mh.add(h, gh, wh);  // NaN included: both give 0x7fffffff for every fp16 NaN
    if (gb != wb) mb.add(h, gb, wb);  // NaN included: both keep the bf16 NaN's sign and payload
  }
  INFO("half: ", mh.describe());
  INFO("bf16: ", mb.describe());
  CHECK(mh.count == 0);
  CHECK(mb.count == 0);
}

TEST_CASE("half: encode matches CUDA bit for bit on more than 2^26 inputs") {
  const std::vector<double> hv = half_values(), bv = bf16_values();
  Mismatch th, tb, sh, sb, rh, rb;
  std::uint64_t n_inputs = 0;
  auto compare = [&](float x, Mismatch& mh, Mismatch& mb) {
    const unsigned gh = qcoll::from_float<qcoll::half>(x).bits, wh = cuda_half_bits(x);
    const unsigned gb = qcoll::from_float<qcoll::bfloat16>(x).bits, wb = cuda_bf16_bits(x);
    if (gh != wh) mh.add(to_bits(x), gh, wh);
    if (gb != wb) mb.add(to_bits(x), gb, wb);
    ++n_inputs;
  };
  // Targeted: every binary16 and bfloat16 rounding midpoint with its neighbours, over/underflow
  // regions, specials (NaNs with several payloads, infinities, zeros, float subnormals).
  for (float x : targeted_inputs(hv, half_overflow, 0x477fe000u, 0x47800000u, 0x33000000u))
    compare(x, th, tb);
  for (float x : targeted_inputs(bv, bf16_overflow, 0x7f7f0000u, 0x7f800000u, 0x00008000u))
    compare(x, th, tb);
  // Every float pattern with an odd stride: 2^32 / 15 > 2^28 patterns, every residue of the low
  // bits visited.
  for (std::uint64_t i = 0; i < (std::uint64_t{1} << 32); i += 15)
    compare(of_bits(static_cast<std::uint32_t>(i)), sh, sb);
  // Random patterns.
  for (std::uint64_t i = 0; i < (1u << 22); ++i) compare(of_bits(qcoll::random_bits(0x16b, i)), rh, rb);
  CHECK(n_inputs >= (std::uint64_t{1} << 26));
  INFO("targeted half: ", th.describe());
  INFO("targeted bf16: ", tb.describe());
  INFO("strided half: ", sh.describe());
  INFO("strided bf16: ", sb.describe());
  INFO("random half: ", rh.describe());
  INFO("random bf16: ", rb.describe());
  CHECK(th.count == 0);
  CHECK(tb.count == 0);
  CHECK(sh.count == 0);
  CHECK(sb.count == 0);
  CHECK(rh.count == 0);
  CHECK(rb.count == 0);
}

#else

TEST_CASE("half: comparisons with CUDA's conversions (skipped: cuda_fp16.h/cuda_bf16.h not found)" *
          doctest::skip()) {}

#endif
