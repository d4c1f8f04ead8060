// The randomized Hadamard rotation (format/hadamard.hpp): it is H D up to a power of two, its
// inverse returns the input within the bound derived from the butterflies' rounding, it spreads
// outliers so that block quantization errs less on heavy-tailed data, and bad spans are rejected.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include <qcoll/format/hadamard.hpp>
#include <qcoll/host/quantize.hpp>

using namespace qcoll;

namespace {

const double kU = std::ldexp(1.0, -24);  // fp32 unit roundoff

// Test data: Gaussian, Student-t with 3 degrees of freedom (heavy tails), or Gaussian with a few
// planted outliers of 100 sigma.
std::vector<float> data(std::size_t n, int kind, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::student_t_distribution<float> t3(3.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = kind == 1 ? t3(g) : normal(g);
  if (kind == 2)
    for (std::size_t i = 300; i < n; i += 1024) v[i] = (i % 2 ? -100.0f : 100.0f);
  return v;
}

double max_abs(const float* x, std::size_t n) {
  double m = 0;
  for (std::size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(x[i])));
  return m;
}

}  // namespace

TEST_CASE("the forward rotation is 2^-floor(k/2) H D, within the butterflies' rounding") {
  for (unsigned k = 1; k <= 6; ++k) {
    const Rotation r{k, 99};
    const std::size_t n = r.span();
    const std::uint64_t base = 1000 + 64 * k;
    const auto x = data(n, 1, k);
    std::vector<float> y(x);
    rotate_forward(y.data(), r, base);
    const double M = max_abs(x.data(), n), scale = std::ldexp(1.0, -static_cast<int>(k / 2));
    for (std::size_t i = 0; i < n; ++i) {
      double want = 0;  // row i of H: (-1)^popcount(i & j)
      for (std::size_t j = 0; j < n; ++j) {
        const double h = (__builtin_popcountll(i & j) % 2) ? -1.0 : 1.0;
        want += h * detail::rotation_sign(r.seed, base + j) * x[j];
      }
      // k stages; stage s rounds values bounded by 2^s M once, and later stages double its error.
      CHECK(std::fabs(y[i] - scale * want) <= scale * k * kU * n * M * (1 + 1e-6));
    }
  }
}

TEST_CASE("inverse(forward(x)) returns x within 2 k n 2^-24 max|x|, for every span") {
  for (unsigned k = 1; k <= 13; ++k) {
    for (int kind = 0; kind < 3; ++kind) {
      const Rotation r{k, 0x5eedull + kind};
      const std::size_t n = r.span();
      const auto x = data(2 * n, kind, 7 * k + kind);
      std::vector<float> v(x);
      for (std::size_t at = 0; at < v.size(); at += n) rotate_forward(v.data() + at, r, 4096 + at);
      for (std::size_t at = 0; at < v.size(); at += n) rotate_inverse(v.data() + at, r, 4096 + at);
      double worst = 0;
      for (std::size_t at = 0; at < v.size(); at += n) {
        const double M = max_abs(x.data() + at, n);
        // Forward: k stages of errors <= k n u M (times the exact scale); the inverse adds H to
        // them (x n) and its own k stages on values <= n M times that scale; the product of the
        // two scales is 1/n. Second-order terms are below 1e-6 of that.
        const double bound = 2.0 * k * static_cast<double>(n) * kU * M * (1 + 1e-6);
        for (std::size_t i = at; i < at + n; ++i) worst = std::max(worst, std::fabs(v[i] - x[i]) / bound);
      }
      CHECK_MESSAGE(worst <= 1.0,
                    "span 2^" << k << ", data kind " << kind << ": " << worst << " x the bound");
    }
  }
}

TEST_CASE("signs follow the global index: spans at different positions rotate differently") {
  const Rotation r{8, 3};
  const auto x = data(256, 0, 1);
  std::vector<float> a(x), b(x);
  rotate_forward(a.data(), r, 0);
  rotate_forward(b.data(), r, 256);
  int differ = 0;
  for (std::size_t i = 0; i < 256; ++i) differ += a[i] != b[i];
  CHECK(differ > 200);
  std::vector<float> c(x);
  rotate_forward(c.data(), Rotation{8, 4}, 0);  // another seed
  differ = 0;
  for (std::size_t i = 0; i < 256; ++i) differ += a[i] != c[i];
  CHECK(differ > 200);
}

TEST_CASE("on heavy-tailed data, quantizing the rotated values errs less") {
  // Each element's error is at most half a step of its block, absmax / (2 q), in the domain where
  // it is quantized; the inverse rotation is 2^(k/2 - ceil(k/2)) times an orthonormal map, so the
  // total squared error after it is at most that factor squared times the rotated blocks' sum of
  // 256 (absmax / (2 q))^2. Both measured errors must respect their bounds, and the rotated one
  // must be the smaller: an outlier no longer sets the step of its whole block.
  auto run = [](auto format, int kind, double& e_plain, double& e_rot, double& bound_rot) {
    using F = decltype(format);
    const Rotation r{8, 11};
    const std::size_t n = 256 * 64;
    const auto x = data(n, kind, 40 + kind);
    std::vector<unsigned char> msg(packed_bytes<F>(n));
    std::vector<float> plain(n), back(n), rotated(x);
    host::quantize<F>(x.data(), n, msg.data(), msg.size());
    host::dequantize<F>(msg.data(), msg.size(), plain.data(), n);
    for (std::size_t at = 0; at < n; at += r.span()) rotate_forward(rotated.data() + at, r, at);
    host::quantize<F>(rotated.data(), n, msg.data(), msg.size());
    host::dequantize<F>(msg.data(), msg.size(), back.data(), n);
    bound_rot = 0;
    for (std::size_t at = 0; at < n; at += F::block) {
      const double step = max_abs(rotated.data() + at, F::block) / F::qmax;
      bound_rot += F::block * (step / 2) * (step / 2) * (1 + 1e-5);  // + the scale's fp32 roundings
    }
    // k = 8 is even: the inverse is orthonormal, the bound carries over unchanged.
    for (std::size_t at = 0; at < n; at += r.span()) rotate_inverse(back.data() + at, r, at);
    e_plain = e_rot = 0;
    for (std::size_t i = 0; i < n; ++i) {
      e_plain += (plain[i] - x[i]) * double(plain[i] - x[i]);
      e_rot += (back[i] - x[i]) * double(back[i] - x[i]);
    }
  };
  for (int kind = 1; kind < 3; ++kind) {
    double p4, r4, b4, p8, r8, b8;
    run(Int4<256>{}, kind, p4, r4, b4);
    run(Int8<256>{}, kind, p8, r8, b8);
    MESSAGE("data kind " << kind << ", total squared error plain vs rotated: int4/256 " << p4 << " vs " << r4
                         << ", int8/256 " << p8 << " vs " << r8);
    CHECK(r4 <= b4);
    CHECK(r8 <= b8);
    CHECK(r4 < p4);
    CHECK(r8 < p8);
  }
}

TEST_CASE("a span that does not divide the block, or is too large, is rejected") {
  CHECK_NOTHROW(check_rotation("f", Rotation{5, 1}, 32));
  CHECK_NOTHROW(check_rotation("f", Rotation{0, 1}, 32));
  CHECK_THROWS_WITH_AS(check_rotation("f", Rotation{6, 1}, 32),
                       doctest::Contains("does not divide the block"), Error);
  CHECK_THROWS_WITH_AS(check_rotation("f", Rotation{14, 1}, 1u << 14), doctest::Contains("2^13"), Error);
}
