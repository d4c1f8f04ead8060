// Block formats and host quantize/dequantize: error bounds derived from each format's arithmetic,
// edge cases, non-finite blocks, stochastic rounding, bad arguments.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <qcoll/format/dispatch.hpp>
#include <qcoll/host/quantize.hpp>

using namespace qcoll;

namespace {

// ---- data sets -------------------------------------------------------------------------------

enum class Data { gaussian, uniform, heavy, constant, zeros, subnormal, huge, mixed_scale };
const Data kAllData[] = {Data::gaussian, Data::uniform,   Data::heavy, Data::constant,
                         Data::zeros,    Data::subnormal, Data::huge,  Data::mixed_scale};

// Largest finite magnitude of T, as float.
template <class T>
float max_of() {
  if (std::is_same<T, half>::value) return 65504.0f;
  if (std::is_same<T, bfloat16>::value) return bf16_bits_to_float(0x7f7f);
  return std::numeric_limits<float>::max();
}

template <class T>
std::vector<T> make_data(Data d, std::size_t n, unsigned seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-3.0f, 5.0f);
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    float x = 0;
    switch (d) {
      case Data::gaussian: x = normal(g); break;
      case Data::uniform: x = uni(g); break;
      case Data::heavy: x = normal(g) / std::max(1e-3f, std::fabs(normal(g))); break;  // Cauchy-like
      case Data::constant: x = 0.7f; break;
      case Data::zeros: x = 0.0f; break;
      case Data::subnormal:  // subnormal in T (and in fp32 for float)
        x = std::is_same<T, float>::value  ? normal(g) * 1e-39f
            : std::is_same<T, half>::value ? normal(g) * 3e-6f
                                           : normal(g) * 1e-39f;
        break;
      case Data::huge:
        x = max_of<T>() * std::min(1.0f, std::fabs(uni(g)) / 5.0f) * (i % 2 ? -1.0f : 1.0f);
        break;
      case Data::mixed_scale: x = normal(g) * std::pow(10.0f, float(int(i / 37 % 7)) - 3.0f); break;
    }
    v[i] = from_float<T>(x);
  }
  return v;
}

// ---- the bound of each format ------------------------------------------------------------------

// Half of the spacing of minifloat E's grid around |y| (|y| <= max_normal), i.e. the largest
// error of round-to-nearest at y. Normal range: spacing 2^(floor(log2|y|) - mbits); subnormal
// range: 2^(1 - bias - mbits).
template <class E>
double minifloat_half_step(double y) {
  y = std::fabs(y);
  const int emin = 1 - E::bias;
  int e = y > 0 ? int(std::floor(std::log2(y))) : emin;
  if (e < emin) e = emin;
  return std::ldexp(1.0, e - E::mbits) / 2;
}

// Slack for the fp32 arithmetic around the rounding (the scaled value y = x * (1/scale) carries two
// roundings, the decode one more): 4 ulps relative, plus the subnormal resolution of fp32 times the
// largest code magnitude for blocks whose scale is itself subnormal.
double arith_slack(double x, double code_mag) {
  return std::fabs(x) * std::ldexp(1.0, -21) + (code_mag + 1) * 1.5e-45;
}

// The largest error nearest rounding may make on x in a block, from the block's decoded Meta.
template <class F>
double error_bound(double x, const typename F::Meta& m);

template <class F>
struct Bound;

template <unsigned B, std::size_t K>
struct Bound<SymmetricInt<B, K>> {
  // code = rint(x / scale), |code| <= qmax; |x| <= absmax = qmax * scale: half a step.
  static double at(double x, const typename SymmetricInt<B, K>::Meta& m) {
    return 0.5 * m.scale + arith_slack(x, SymmetricInt<B, K>::qmax);
  }
};
template <unsigned B, std::size_t K>
struct Bound<AsymmetricInt<B, K>> {
  // code = rint((x - lo) / scale) in [0, qmax]: half a step, plus one fp32 rounding of the result.
  static double at(double x, const typename AsymmetricInt<B, K>::Meta& m) {
    return 0.5 * m.scale + std::fabs(x) * std::ldexp(1.0, -23) + 1.5e-45;
  }
};
template <class E, std::size_t K>
struct Bound<Fp8Scaled<E, K>> {
  // y = x / scale, |y| <= max_normal: half the minifloat spacing at y, times scale.
  static double at(double x, const typename Fp8Scaled<E, K>::Meta& m) {
    const double y = x / m.scale;
    return minifloat_half_step<E>(y) * m.scale * (1 + 1e-6) + arith_slack(x, E::max_normal);
  }
};
template <class E>
struct Bound<MxFloat<E>> {
  // y = x * 2^-X; |y| < 2^(emax+1); nearest in the grid below max_normal, saturation above.
  static double at(double x, const detail::MxMeta& m) {
    const double s = std::ldexp(1.0, int(m.code) - 127);
    const double y = std::fabs(x) / s;
    const double sat = y > E::max_normal ? (y - E::max_normal) * s : 0.0;
    return minifloat_half_step<E>(std::min(y, double(E::max_normal))) * s + sat + arith_slack(x, 0);
  }
};
template <>
struct Bound<MxInt8> {
  // y = x * 2^-X * 64, |y| < 128: half a step (2^-6 * 2^X) or saturation at 127.
  static double at(double x, const detail::MxMeta& m) {
    const double s = std::ldexp(1.0, int(m.code) - 127 - 6);
    const double y = std::fabs(x) / s;
    return 0.5 * s + (y > 127 ? (y - 127) * s : 0.0) + arith_slack(x, 0);
  }
};
template <>
struct Bound<NvFp4> {
  // y = x / (block scale * message scale); nearest in the E2M1 grid, saturation above 6.
  static double at(double x, const NvFp4::Meta& m) {
    if (m.scale == 0) return std::fabs(x);
    const double y = std::fabs(x) / m.scale;
    const double sat = y > 6 ? (y - 6) * m.scale : 0.0;
    return minifloat_half_step<minifloat::E2M1>(std::min(y, 6.0)) * m.scale * (1 + 1e-6) + sat +
           arith_slack(x, 6);
  }
};
template <class W, std::size_t K>
struct Bound<Identity<W, K>> {
  // one rounding to W: half an ulp of W (relative 2^-(p) with p the significand bits).
  static double at(double x, const typename Identity<W, K>::Meta&) {
    const int p = std::is_same<W, float>::value ? 24 : std::is_same<W, half>::value ? 11 : 8;
    // absolute: half the subnormal spacing of W (fp16 2^-24, bf16 and fp32 share fp32's exponent range).
    const double sub = std::is_same<W, half>::value       ? std::ldexp(1.0, -25)
                       : std::is_same<W, bfloat16>::value ? std::ldexp(1.0, -134)
                                                          : 0.0;
    return std::fabs(x) * std::ldexp(1.0, -p) + sub;
  }
};

// For the scaled formats: the block's scale rule itself.
template <class F>
void check_meta_rule(const BlockStats& s, const typename F::Meta& m, float message_scale) {
  if constexpr (std::is_same<F, SymmetricInt<F::code_bits, F::block>>::value) {
    CHECK(m.scale == s.absmax / float(F::qmax));  // one IEEE division, no clipping of absmax
  } else if constexpr (std::is_same<F, NvFp4>::value) {
    const float target = message_scale > 0 ? s.absmax / (6.0f * message_scale) : 0.0f;
    CHECK(m.code == minifloat::encode<minifloat::E4M3>(target));
  } else {
    (void)s, (void)m, (void)message_scale;
  }
}

template <class F>
struct Emax {
  static constexpr int value = 0;
};
template <class E>
struct Emax<MxFloat<E>> {
  static constexpr int value = E::emax;
};

// Decodes block b's Meta from a message.
template <class F>
typename F::Meta block_meta(const std::vector<unsigned char>& msg, std::size_t n, std::size_t b) {
  using L = MessageLayout<F>;
  float ms = 0;
  if constexpr (has_message_scale<F>) ms = detail::load_f32(msg.data() + L::message_meta_offset);
  return F::load_meta(msg.data() + L::metas_offset(n) + b * F::meta_bytes, ms);
}

template <class F, class T>
void check_roundtrip(const std::vector<T>& x, const char* what) {
  const std::size_t n = x.size();
  std::vector<unsigned char> msg(packed_bytes<F>(n) + 32, 0xAB);
  const std::size_t wrote = host::quantize<F>(x.data(), n, msg.data(), msg.size());
  REQUIRE(wrote == packed_bytes<F>(n));
  for (std::size_t i = wrote; i < msg.size(); ++i) REQUIRE(msg[i] == 0xAB);  // nothing past the message

  MessageHeader h;
  std::memcpy(&h, msg.data(), sizeof h);
  CHECK(h.magic == kMessageMagic);
  CHECK(h.format == static_cast<std::uint8_t>(F::id));
  CHECK((std::size_t{1} << h.log2_block) == F::block);
  CHECK(h.count == n);
  CHECK(h.flags == 0);

  std::vector<float> y(n + 1, -12345.0f);
  host::dequantize<F>(msg.data(), wrote, y.data(), n);
  CHECK(y[n] == -12345.0f);  // nothing written past n

  using L = MessageLayout<F>;
  float ms = 0;
  if constexpr (has_message_scale<F>) {
    float amax = 0;
    for (auto v : x) amax = std::max(amax, std::fabs(to_float(v)));
    ms = detail::load_f32(msg.data() + L::message_meta_offset);
    CHECK(ms == amax / 2688.0f);
  }
  std::size_t bad = 0;
  for (std::size_t b = 0; b < L::blocks(n); ++b) {
    const auto m = block_meta<F>(msg, n, b);
    BlockStats s = stats_empty();
    const std::size_t first = b * F::block, last = std::min(n, first + F::block);
    for (std::size_t i = first; i < last; ++i) stats_add(s, to_float(x[i]));
    if constexpr (!std::is_same<F, MxInt8>::value && !(F::block == 32 && F::meta_bytes == 1)) {
      check_meta_rule<F>(s, m, ms);
    } else {
      if (s.absmax > 0) {
        int e = int(std::floor(std::log2(double(s.absmax)))) - Emax<F>::value;
        e = std::max(-127, std::min(127, e));
        CHECK(int(m.code) - 127 == e);
      } else {
        CHECK(m.code == 0);
      }
    }
    for (std::size_t i = first; i < last; ++i) {
      const double xv = to_float(x[i]);
      const double err = std::fabs(double(y[i]) - xv);
      const double bound = Bound<F>::at(xv, m);
      if (!(err <= bound)) {
        if (bad++ < 3)
          FAIL_CHECK(what << ": element " << i << " x=" << xv << " decoded=" << y[i] << " err=" << err
                          << " bound=" << bound);
      }
    }
    // Tail padding codes are zero bits.
    if (last - first < F::block) {
      const unsigned char* codes = msg.data() + L::codes_offset + b * L::block_code_bytes;
      const std::size_t valid_bits = (last - first) * F::code_bits;
      for (std::size_t bit = valid_bits; bit < F::block * F::code_bits; ++bit)
        if ((codes[bit / 8] >> (bit % 8)) & 1u) {
          FAIL_CHECK(what << ": padding bit " << bit << " of block " << b << " is set");
          break;
        }
    }
  }
  CHECK(bad == 0);

  // Decoding into T rounds the decoded float once.
  std::vector<T> yt(n);
  host::dequantize<F>(msg.data(), wrote, yt.data(), n);
  for (std::size_t i = 0; i < n; ++i) {
    const T want = from_float<T>(y[i]);
    if (std::memcmp(&yt[i], &want, sizeof(T)) != 0) {
      FAIL_CHECK(what << ": T output differs at " << i);
      break;
    }
  }
}

template <class F, class T>
void sweep_format() {
  const std::size_t sizes[] = {0,    1, 2, 31, 97, F::block - 1, F::block, F::block + 1, 3 * F::block + 7,
                               10007};
  unsigned seed = 1;
  for (Data d : kAllData)
    for (std::size_t n : sizes) {
      // A narrower identity wire (fp16, or bf16 from fp32) cannot carry values beyond its range (they become
      // Inf, by design).
      if (d == Data::huge && ((F::id == FormatId::identity_f16 && !std::is_same<T, half>::value) ||
                              (F::id == FormatId::identity_bf16 && std::is_same<T, float>::value)))
        continue;
      const auto x = make_data<T>(d, n, seed++);
      const std::string what = std::string(format_name(F::id)) + "/" + dtype_name(dtype_of<T>::value) +
                               " data " + std::to_string(int(d)) + " n " + std::to_string(n);
      CAPTURE(what);
      check_roundtrip<F>(x, what.c_str());
    }
}

}  // namespace

#define QCOLL_FORMATS                                                                                  \
  Int8<>, Int8<32>, Int8<8192>, Int4<>, Int4<32>, Int4<2048>, Int8Asym<>, Int4Asym<64>, Fp8E4M3<>,     \
      Fp8E5M2<128>, MxFp8E4M3, MxFp8E5M2, MxFp6E2M3, MxFp6E3M2, MxFp4, MxInt8, NvFp4, Identity<float>, \
      Identity<half>, Identity<bfloat16, 256>

TEST_CASE_TEMPLATE("round trip within the format's bound, fp32 input", F, QCOLL_FORMATS) {
  sweep_format<F, float>();
}
TEST_CASE_TEMPLATE("round trip within the format's bound, bf16 input", F, QCOLL_FORMATS) {
  sweep_format<F, bfloat16>();
}
TEST_CASE_TEMPLATE("round trip within the format's bound, fp16 input", F, QCOLL_FORMATS) {
  sweep_format<F, half>();
}

TEST_CASE_TEMPLATE("nearest rounding picks a nearest code of the block's grid", F, Int8<>, Int4<64>,
                   Int8Asym<>, Int4Asym<>, Fp8E4M3<>, Fp8E5M2<>, MxFp8E4M3, MxFp6E2M3, MxFp6E3M2, MxFp4,
                   MxInt8, NvFp4) {
  // Exhaustive over the block's codes: no other code decodes closer to x (beyond fp32 slack).
  const std::size_t n = 4 * F::block + 5;
  for (Data d : {Data::gaussian, Data::heavy, Data::mixed_scale}) {
    const auto x = make_data<float>(d, n, 77);
    std::vector<unsigned char> msg(packed_bytes<F>(n));
    host::quantize<F>(x.data(), n, msg.data(), msg.size());
    std::vector<float> y(n);
    host::dequantize<F>(msg.data(), msg.size(), y.data(), n);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const auto m = block_meta<F>(msg, n, i / F::block);
      double best = INFINITY;
      for (std::uint32_t c = 0; c < (1u << F::code_bits); ++c) {
        const float v = F::decode(c, m);
        if (std::isfinite(v)) best = std::min(best, std::fabs(double(v) - x[i]));
      }
      const double err = std::fabs(double(y[i]) - x[i]);
      if (err > best + arith_slack(x[i], 256)) ++bad;
    }
    CHECK(bad == 0);
  }
}

TEST_CASE_TEMPLATE("a NaN or Inf poisons its block only and sets the flag", F, Int8<>, Int4<32>, Int8Asym<64>,
                   Fp8E4M3<>, Fp8E5M2<>, MxFp8E4M3, MxFp4, MxInt8, NvFp4) {
  const std::size_t n = 5 * F::block + 3;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto x = make_data<float>(Data::gaussian, n, 5);
    auto clean = x;
    const std::size_t at = 2 * F::block + 7;
    x[at] = bad;
    clean[at] = 0.0f;
    std::vector<unsigned char> m1(packed_bytes<F>(n)), m2(packed_bytes<F>(n));
    host::quantize<F>(x.data(), n, m1.data(), m1.size());
    host::quantize<F>(clean.data(), n, m2.data(), m2.size());
    std::vector<float> y1(n), y2(n);
    CHECK(host::dequantize<F>(m1.data(), m1.size(), y1.data(), n) == kFlagNonFinite);
    CHECK(host::dequantize<F>(m2.data(), m2.size(), y2.data(), n) == 0u);
    for (std::size_t i = 0; i < n; ++i) {
      if (i / F::block == at / F::block) {
        CHECK(std::isnan(y1[i]));
      } else {
        REQUIRE(std::memcmp(&y1[i], &y2[i], sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE_TEMPLATE("values near the top of fp32 do not overflow the scale", F, Int8<>, Int4<>, Int8Asym<>,
                   Int4Asym<>, Fp8E4M3<>, Fp8E5M2<>, MxFp8E4M3, MxFp4, MxInt8, NvFp4) {
  const float big = std::numeric_limits<float>::max();
  std::vector<float> x = {big, -big, big * 0.5f, -big * 0.999f, 1.0f, 0.0f};
  x.resize(F::block, big * 0.25f);
  std::vector<unsigned char> msg(packed_bytes<F>(x.size()));
  host::quantize<F>(x.data(), x.size(), msg.data(), msg.size());
  std::vector<float> y(x.size());
  CHECK(host::dequantize<F>(msg.data(), msg.size(), y.data(), y.size()) == 0u);
  const auto m = block_meta<F>(msg, x.size(), 0);
  for (std::size_t i = 0; i < x.size(); ++i) {
    CHECK(std::isfinite(y[i]));
    CHECK(std::fabs(double(y[i]) - x[i]) <= Bound<F>::at(x[i], m));
  }
}

TEST_CASE_TEMPLATE("stochastic rounding is unbiased and reproducible", F, Int8<>, Int4<64>, Int4Asym<>,
                   Fp8E4M3<>, Fp8E5M2<>, MxFp4, MxFp6E3M2, MxInt8, NvFp4) {
  const std::size_t n = 2 * F::block;
  const auto x = make_data<float>(Data::uniform, n, 11);
  host::QuantizeOptions opt;
  opt.rounding = Rounding::stochastic;
  const int K = 400;
  std::vector<double> sum(n, 0.0);
  std::vector<unsigned char> msg(packed_bytes<F>(n)), again(msg.size());
  std::vector<float> y(n);
  double max_step = 0;
  for (int k = 0; k < K; ++k) {
    opt.seed = 1000 + k;
    host::quantize<F>(x.data(), n, msg.data(), msg.size(), opt);
    if (k == 0) {
      host::quantize<F>(x.data(), n, again.data(), again.size(), opt);
      CHECK(msg == again);  // same key, same bits
    }
    host::dequantize<F>(msg.data(), msg.size(), y.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto m = block_meta<F>(msg, n, i / F::block);
      // Stochastic rounding lands on one of the two grid neighbours: within one full step (twice
      // the nearest-rounding bound) of x.
      const double step = 2 * Bound<F>::at(x[i], m);
      max_step = std::max(max_step, step);
      REQUIRE(std::fabs(double(y[i]) - x[i]) <= step);
      sum[i] += y[i];
    }
  }
  // Mean error over all n*K draws: each draw's error has mean 0 and |error| <= step, so the
  // standard deviation of the mean is at most max_step / sqrt(n*K); allow 5 of them.
  double total = 0;
  for (std::size_t i = 0; i < n; ++i) total += sum[i] / K - x[i];
  CHECK(std::fabs(total / n) <= 5 * max_step / std::sqrt(double(n) * K));
  // And per element, against the element's own neighbours: within 6 sigma of a Bernoulli mean.
  std::size_t off = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (std::fabs(sum[i] / K - x[i]) > 6 * 0.5 * max_step / std::sqrt(double(K))) ++off;
  CHECK(off == 0);
  // A different seed gives different bits.
  opt.seed = 1;
  host::quantize<F>(x.data(), n, again.data(), again.size(), opt);
  opt.seed = 2;
  host::quantize<F>(x.data(), n, msg.data(), msg.size(), opt);
  CHECK(msg != again);
}

TEST_CASE("stochastic rounding of a slice matches the whole tensor via index_base") {
  using F = Int4<64>;
  const std::size_t n = 10 * F::block;
  const auto x = make_data<float>(Data::gaussian, n, 3);
  host::QuantizeOptions opt;
  opt.rounding = Rounding::stochastic;
  opt.seed = 99;
  std::vector<unsigned char> whole(packed_bytes<F>(n)), part(packed_bytes<F>(4 * F::block));
  host::quantize<F>(x.data(), n, whole.data(), whole.size(), opt);
  opt.index_base = 3 * F::block;
  host::quantize<F>(x.data() + 3 * F::block, 4 * F::block, part.data(), part.size(), opt);
  using L = MessageLayout<F>;
  CHECK(std::memcmp(whole.data() + L::codes_offset + 3 * L::block_code_bytes, part.data() + L::codes_offset,
                    4 * L::block_code_bytes) == 0);
}

TEST_CASE("exactly representable values survive nearest and stochastic rounding unchanged") {
  using F = Int8<32>;
  std::vector<float> x(32);
  x[0] = 127.0f;  // absmax 127 → scale 1 exactly, every integer in [-127, 127] is a code
  for (int i = 1; i < 32; ++i) x[i] = float(i * 7 % 255 - 127);
  for (auto r : {Rounding::nearest, Rounding::stochastic}) {
    host::QuantizeOptions opt;
    opt.rounding = r;
    opt.seed = 5;
    std::vector<unsigned char> msg(packed_bytes<F>(32));
    host::quantize<F>(x.data(), 32, msg.data(), msg.size(), opt);
    std::vector<float> y(32);
    host::dequantize<F>(msg.data(), msg.size(), y.data(), 32);
    CHECK(y == x);
  }
}

TEST_CASE("message sizes: codes and scales 16-byte aligned, one 32-byte header") {
  CHECK(packed_bytes<Int8<256>>(0) == 32);
  CHECK(packed_bytes<Int8<256>>(1) == 32 + 256 + 16);
  CHECK(packed_bytes<Int4<256>>(512) == 32 + 256 + 16);
  CHECK(packed_bytes<MxFp6E2M3>(64) == 32 + 48 + 16);
  CHECK(packed_bytes<NvFp4>(16) == 32 + 16 + 16 + 16);
  CHECK(packed_bytes<Identity<bfloat16>>(3) == 32 + 64);
  CHECK(MessageLayout<Int8Asym<32>>::metas_offset(64) == 32 + 64);
}

TEST_CASE("the header carries the tag of QuantizeOptions; check_tag names a foreign one") {
  std::vector<float> x(100, 1.5f);
  std::vector<unsigned char> msg(packed_bytes<Int8<32>>(100));
  host::QuantizeOptions o;
  o.tag = 0x1234abcdull;
  host::quantize<Int8<32>>(x.data(), x.size(), msg.data(), msg.size(), o);
  MessageHeader h;
  std::memcpy(&h, msg.data(), sizeof h);
  CHECK(h.tag == 0x1234abcdull);
  CHECK(h.reserved == 0u);
  CHECK_NOTHROW(check_tag(h, 0x1234abcdull, "f", "msg"));
  CHECK_THROWS_WITH_AS(check_tag(h, 0x99, "f", "msg"), doctest::Contains("belongs to another call"), Error);
  // The tag is not data: the same values with another tag decode to the same bits.
  std::vector<unsigned char> plain(msg.size());
  host::quantize<Int8<32>>(x.data(), x.size(), plain.data(), plain.size());
  CHECK(std::memcmp(plain.data() + 32, msg.data() + 32, msg.size() - 32) == 0);
}

TEST_CASE("bad arguments raise qcoll::Error naming the argument; nothing is written") {
  using F = Int8<>;
  std::vector<float> x(300, 1.0f);
  std::vector<unsigned char> out(packed_bytes<F>(300), 0x5A);
  auto untouched = [&] {
    for (auto b : out)
      if (b != 0x5A) return false;
    return true;
  };
  auto msg_of = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  std::string m =
      msg_of([&] { host::quantize<F>(static_cast<const float*>(nullptr), 300, out.data(), out.size()); });
  CHECK(m.find("'in'") != std::string::npos);
  CHECK(untouched());
  m = msg_of([&] { host::quantize<F>(x.data(), 300, out.data(), out.size() - 1); });
  CHECK(m.find("'out_bytes'") != std::string::npos);
  CHECK(m.find(std::to_string(out.size() - 1)) != std::string::npos);
  CHECK(m.find(std::to_string(out.size())) != std::string::npos);
  CHECK(untouched());
  m = msg_of([&] { host::quantize<F>(x.data(), 300, nullptr, out.size()); });
  CHECK(m.find("'out'") != std::string::npos);
  // A message whose bytes overlap the input (here its last bytes, then its first).
  std::vector<float> buf(300 + out.size() / 4 + 2, 1.0f);
  const std::vector<float> before = buf;
  m = msg_of([&] { host::quantize<F>(buf.data() + 2, 300, buf.data(), out.size()); });
  CHECK(m.find("'out'") != std::string::npos);
  CHECK(m.find("overlaps the input") != std::string::npos);
  m = msg_of([&] { host::quantize<F>(buf.data(), 300, buf.data() + 299, out.size()); });
  CHECK(m.find("overlaps the input") != std::string::npos);
  CHECK(buf == before);
  CHECK(host::quantize<F>(buf.data(), 300, buf.data() + 300, out.size()) == out.size());  // adjacent

  // Decoding checks the header: wrong format, wrong count, too-short buffer.
  host::quantize<F>(x.data(), 300, out.data(), out.size());
  std::vector<float> y(300, 7.0f);
  m = msg_of([&] { host::dequantize<Int4<>>(out.data(), out.size(), y.data(), 300); });
  CHECK(m.find("format") != std::string::npos);
  m = msg_of([&] { host::dequantize<F>(out.data(), out.size(), y.data(), 299); });
  CHECK(m.find("count 300") != std::string::npos);
  m = msg_of([&] { host::dequantize<F>(out.data(), 10, y.data(), 300); });
  CHECK(m.find("'msg_bytes'") != std::string::npos);
  for (float v : y) REQUIRE(v == 7.0f);

  // Run-time format choice rejects unsupported blocks with the limit in the message.
  m = msg_of([&] { dispatch_format(FormatId::int8, 48, [](auto) { return 0; }); });
  CHECK(m.find("'block' = 48") != std::string::npos);
  CHECK(m.find("[32, 8192]") != std::string::npos);
  m = msg_of([&] { dispatch_format(FormatId::mxfp4, 64, [](auto) { return 0; }); });
  CHECK(m.find("'block' = 64") != std::string::npos);
  m = msg_of([&] { parse_format("int3"); });
  CHECK(m.find("'int3'") != std::string::npos);
  CHECK(dispatch_format(parse_format("int4"), 1024, [](auto f) { return decltype(f)::block; }) == 1024u);
}

TEST_CASE_TEMPLATE("symmetric integer encode: clamping before rounding equals rounding before clamping", F,
                   Int8<>, Int4<>) {
  // The encoder clamps the scaled value to [-qmax, qmax] and then rounds (branch-free); rounding
  // first and clamping after is the definition. They agree for every input, NaN and Inf included.
  std::mt19937_64 g(17);
  std::size_t bad = 0;
  for (int k = 0; k < 200000; ++k) {
    const float scale = std::ldexp(1.0f + float(g() % 1000) / 1000.0f, int(g() % 280) - 150);
    const typename F::Meta m = F::meta_from_scale(scale);
    const float x = k % 97 == 0   ? std::numeric_limits<float>::quiet_NaN()
                    : k % 89 == 0 ? std::numeric_limits<float>::infinity()
                                  : fp::from_bits(static_cast<std::uint32_t>(g()));
    const auto want = F::to_code(fp::rint(detail::apply(m.rcp, x)));
    if (F::encode(x, m) != want) ++bad;
    // values on and next to ties of the code grid
    const float tie = (float(int(g() % (2 * F::qmax + 4))) - F::qmax - 2 + 0.5f) * scale;
    for (float t : {tie, std::nextafter(tie, 0.0f), std::nextafter(tie, 1e30f)})
      if (F::encode(t, m) != F::to_code(fp::rint(detail::apply(m.rcp, t)))) ++bad;
  }
  CHECK(bad == 0);
}

namespace {
template <class F, class T>
std::size_t avx2_vs_baseline_mismatches() {
  std::size_t bad = 0;
  for (Data d : kAllData)
    for (std::size_t n : {std::size_t(1), std::size_t(97), F::block, 3 * F::block + 7, std::size_t(10007)})
      for (Rounding r : {Rounding::nearest, Rounding::stochastic}) {
        const auto x = make_data<T>(d, n, 99);
        host::QuantizeOptions opt;
        opt.rounding = r;
        opt.seed = 4;
        std::vector<unsigned char> a(packed_bytes<F>(n)), b(a.size());
        host::quantize<F>(x.data(), n, a.data(), a.size(), opt);  // dispatching entry point
        host::detail::quantize_blocks_impl<F, T>(
            n,
            [&](std::size_t k) {
              const std::size_t first = k * F::block;
              return host::detail::BlockSource<T>{x.data() + first,
                                                  std::min<std::size_t>(F::block, n - first)};
            },
            b.data(), opt);  // the baseline build of the same loops
        if (a != b) ++bad;
        std::vector<T> ya(n), yb(n);
        host::dequantize<F>(a.data(), a.size(), ya.data(), n);
        host::detail::decode_message_as_impl<F, T>(
            a.data(), n, n, [](float v) { return from_float<T>(v); }, [&](std::size_t i, T v) { yb[i] = v; });
        if (std::memcmp(ya.data(), yb.data(), n * sizeof(T)) != 0) ++bad;
      }
  return bad;
}
}  // namespace

TEST_CASE_TEMPLATE("the run-time AVX2 build of the host kernels gives the same bytes", F, Int8<>, Int4<32>,
                   Int8Asym<>, Int4Asym<64>, Fp8E4M3<>, Fp8E5M2<>, MxFp8E4M3, MxFp6E2M3, MxFp4, MxInt8, NvFp4,
                   Identity<bfloat16>) {
#if QCOLL_HOST_AVX2_DISPATCH
  if (!__builtin_cpu_supports("avx2"))
    MESSAGE("this processor has no AVX2: both paths are the baseline build");
#else
  MESSAGE("AVX2 dispatch is off in this build: both paths are the same code");
#endif
  CHECK(avx2_vs_baseline_mismatches<F, float>() == 0u);
  CHECK(avx2_vs_baseline_mismatches<F, bfloat16>() == 0u);
  CHECK(avx2_vs_baseline_mismatches<F, half>() == 0u);
}
