// The host kernels of the unquantized identity formats (f32, bf16, f16 on the wire) against the
// per-element definition: code i = from_float<W>(to_float(x[i])), padding codes 0, kFlagNonFinite
// exactly when some code is ±Inf or NaN; decoding = from_float<V>(to_float(code)) or fp::add into
// fp32 accumulators. Every wire type, input and output type, with random bit patterns (NaN
// payloads of either sign, ±Inf, subnormals), values at the 16-bit types' rounding boundaries,
// tails, and outputs large enough for non-temporal stores at 32- and 16-byte alignment.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <qcoll/host/quantize.hpp>

using namespace qcoll;

namespace {

std::uint32_t bits_of(float v) { return fp::bits(v); }
std::uint32_t bits_of(half v) { return v.bits; }
std::uint32_t bits_of(bfloat16 v) { return v.bits; }

// Inputs of T: a third random bit patterns, a third values near the half and bfloat16 overflow
// and subnormal boundaries (either side of each rounding midpoint), a third gaussian.
template <class T>
std::vector<T> make_values(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float edges[] = {65504.0f,
                         65519.996f,
                         65520.0f,
                         65536.0f,
                         bf16_bits_to_float(0x7f7f),
                         fp::from_bits(0x7f7f7fffu),
                         fp::from_bits(0x7f7f8000u),
                         5.9604645e-8f,
                         2.9802322e-8f,
                         2.9802326e-8f,
                         6.1035156e-5f,
                         1e-40f,
                         0.0f};
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned pick = g() % 3;
    if (pick == 0) {
      const std::uint32_t r = g();
      if constexpr (sizeof(T) == 4) {
        v[i] = fp::from_bits(r);
      } else {
        std::memcpy(&v[i], &r, sizeof(T));
      }
    } else {
      float x = pick == 1 ? edges[g() % (sizeof edges / sizeof edges[0])] : normal(g) * 100.0f;
      if (g() % 2) x = -x;
      v[i] = from_float<T>(x);
    }
  }
  return v;
}

template <class F, class T>
void check_quantize(const std::vector<T>& x, std::size_t n) {
  using W = typename host::detail::identity_element<F>::type;
  using L = MessageLayout<F>;
  std::vector<unsigned char> msg(packed_bytes<F>(n), 0xAB);
  host::quantize<F>(x.data(), n, msg.data(), msg.size());
  // The definition, element by element.
  bool bad = false, same = true;
  for (std::size_t i = 0; i < n; ++i) {
    const W w = from_float<W>(to_float(x[i]));
    bad |= F::code_nonfinite(bits_of(w));
    same &= std::memcmp(msg.data() + L::codes_offset + i * sizeof(W), &w, sizeof w) == 0;
  }
  CHECK(same);
  for (std::size_t i = n; i < L::blocks(n) * F::block; ++i) {
    W w;
    std::memcpy(&w, msg.data() + L::codes_offset + i * sizeof(W), sizeof w);
    same &= bits_of(w) == 0;
  }
  CHECK(same);
  MessageHeader h;
  std::memcpy(&h, msg.data(), sizeof h);
  CHECK(h.flags == (bad ? kFlagNonFinite : 0u));
  // The portable loops, byte for byte (header, paddings).
  std::vector<unsigned char> ref(msg.size(), 0xCD);
  host::detail::quantize_blocks_impl<F, T>(
      n,
      [&](std::size_t b) {
        const std::size_t first = b * F::block;
        return host::detail::BlockSource<T>{x.data() + first, n - first < F::block ? n - first : F::block};
      },
      ref.data(), host::QuantizeOptions{});
  CHECK(msg == ref);
}

template <class F, class V>
void check_dequantize(const std::vector<unsigned char>& msg, std::size_t n, std::size_t offset) {
  using W = typename host::detail::identity_element<F>::type;
  std::vector<V> out(n + offset + 8);
  host::dequantize<F>(msg.data(), msg.size(), out.data() + offset, n);
  bool same = true;
  for (std::size_t i = 0; i < n; ++i) {
    W w;
    std::memcpy(&w, msg.data() + MessageLayout<F>::codes_offset + i * sizeof(W), sizeof w);
    same &= bits_of(out[offset + i]) == bits_of(from_float<V>(to_float(w)));
  }
  CHECK(same);
}

template <class F>
void check_accumulate(const std::vector<unsigned char>& msg, std::size_t n) {
  using W = typename host::detail::identity_element<F>::type;
  std::vector<float> acc(n), want(n);
  for (std::size_t i = 0; i < n; ++i) acc[i] = want[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  host::dequantize_accumulate<F>(msg.data(), msg.size(), acc.data(), n);
  bool same = true;
  for (std::size_t i = 0; i < n; ++i) {
    W w;
    std::memcpy(&w, msg.data() + MessageLayout<F>::codes_offset + i * sizeof(W), sizeof w);
    same &= fp::bits(acc[i]) == fp::bits(fp::add(want[i], to_float(w)));
  }
  CHECK(same);
  // The residual of error feedback, r - value (r holding -0, the value itself and others), and
  // decoding from a block boundary.
  const std::size_t from = n / F::block / 2 * F::block;
  std::vector<float> r(n), part(n - from);
  for (std::size_t i = 0; i < n; ++i) {
    W w;
    std::memcpy(&w, msg.data() + MessageLayout<F>::codes_offset + i * sizeof(W), sizeof w);
    r[i] = i % 3 == 0 ? to_float(w) : i % 3 == 1 ? -0.0f : want[i];
  }
  const std::vector<float> r0 = r;
  host::detail::subtract_decoded<F>(msg.data(), n, n, r.data());
  host::detail::decode_into<F, float>(msg.data(), n, n, part.data(), from);
  bool residual = true, ranged = true;
  for (std::size_t i = 0; i < n; ++i) {
    W w;
    std::memcpy(&w, msg.data() + MessageLayout<F>::codes_offset + i * sizeof(W), sizeof w);
    residual &= fp::bits(r[i]) == fp::bits(fp::sub(r0[i], to_float(w)));
    if (i >= from) ranged &= fp::bits(part[i - from]) == fp::bits(to_float(w));
  }
  CHECK(residual);
  CHECK(ranged);
}

template <class F, class T>
void check_all(std::size_t n, unsigned seed) {
  const std::vector<T> x = make_values<T>(n, seed);
  check_quantize<F>(x, n);
  std::vector<unsigned char> msg(packed_bytes<F>(n));
  host::quantize<F>(x.data(), n, msg.data(), msg.size());
  for (std::size_t offset : {0, 1, 8}) {
    check_dequantize<F, float>(msg, n, offset);
    check_dequantize<F, bfloat16>(msg, n, offset);
    check_dequantize<F, half>(msg, n, offset);
  }
  check_accumulate<F>(msg, n);
  // Codes of every bit pattern (NaN payloads of either sign among them), as a peer may send them.
  std::mt19937 g(seed);
  for (std::size_t i = MessageLayout<F>::codes_offset; i < msg.size(); ++i)
    msg[i] = static_cast<unsigned char>(g());
  for (std::size_t offset : {0, 1, 8}) {
    check_dequantize<F, float>(msg, n, offset);
    check_dequantize<F, bfloat16>(msg, n, offset);
    check_dequantize<F, half>(msg, n, offset);
  }
  check_accumulate<F>(msg, n);
}

template <class W, std::size_t Block>
void check_format() {
  using F = Identity<W, Block>;
  for (std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{15}, Block, Block * 3 + 17, std::size_t{40000} + 3}) {
    CAPTURE(n);
    check_all<F, float>(n, static_cast<unsigned>(n) + 1);
    check_all<F, bfloat16>(n, static_cast<unsigned>(n) + 2);
    check_all<F, half>(n, static_cast<unsigned>(n) + 3);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("identity formats: codes, flags and decodes equal the per-element definition", W, float,
                   bfloat16, half) {
  check_format<W, 32>();
  check_format<W, 2048>();
}

TEST_CASE_TEMPLATE("identity formats: large outputs (non-temporal stores) at 32- and 16-byte alignment", W,
                   float, half) {
  using F = Identity<W, 32>;
  // 8M + 21 elements: 16-bit and fp32 outputs pass the size above which dequantize streams.
  const std::size_t n = (std::size_t{8} << 20) + 21;
  const std::vector<float> x = make_values<float>(n, 11);
  std::vector<unsigned char> msg(packed_bytes<F>(n));
  host::quantize<F>(x.data(), n, msg.data(), msg.size());
  check_dequantize<F, float>(msg, n, 0);
  check_dequantize<F, float>(msg, n, 4);
  check_dequantize<F, half>(msg, n, 0);
  check_dequantize<F, half>(msg, n, 8);
}

TEST_CASE_TEMPLATE(
    "quantized formats: large outputs decode like the portable loops at 32- and 16-byte alignment", F,
    Fp8E4M3<32>, MxFp8E5M2, MxFp4, NvFp4) {
  const std::size_t n = (std::size_t{8} << 20) + 16;
  std::vector<float> x(n);
  std::mt19937 g(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) x[i] = normal(g) * std::ldexp(1.0f, static_cast<int>(i / 32 % 13) - 6);
  std::vector<unsigned char> msg(packed_bytes<F>(n));
  host::quantize<F>(x.data(), n, msg.data(), msg.size());
  std::vector<float> want(n), y(n + 8);
  host::detail::decode_into_impl<F, float, false>(msg.data(), n, n, want.data());
  for (std::size_t offset : {0, 4}) {
    host::dequantize<F>(msg.data(), msg.size(), y.data() + offset, n);
    CHECK(std::memcmp(y.data() + offset, want.data(), n * sizeof(float)) == 0);
  }
  std::vector<half> hwant(n), h(n + 8);
  host::detail::decode_into_impl<F, half, false>(msg.data(), n, n, hwant.data());
  for (std::size_t offset : {0, 8}) {
    host::dequantize<F>(msg.data(), msg.size(), h.data() + offset, n);
    CHECK(std::memcmp(h.data() + offset, hwant.data(), n * sizeof(half)) == 0);
  }
}
