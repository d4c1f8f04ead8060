// Inputs a hostile or confused caller can produce: headers with any bytes, element counts whose
// message sizes do not fit in 64 bits, misaligned typed pointers; and two value rules at the
// edges of the formats (Identity<half/bfloat16> overflow is flagged; NVFP4 decodes as
// (e2m1 * s_b) * s_t).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <qcoll/core/checked.hpp>
#include <qcoll/core/workspace.hpp>
#include <qcoll/format/dispatch.hpp>
#include <qcoll/host/quantize.hpp>

#include "../common/error_of.hpp"

using namespace qcoll;

namespace {

using testing_support::error_of;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();

}  // namespace

// ---- headers ------------------------------------------------------------------------------------

TEST_CASE("check_header names a block field of 2^64 or more without shifting it") {
  using F = Int8<256>;
  MessageHeader h = make_header<F>(10);
  for (unsigned l : {64u, 65u, 127u, 200u, 255u}) {
    h.log2_block = static_cast<std::uint8_t>(l);
    const std::string m = error_of([&] { check_header<F>(h, 10, "test", "msg"); });
    CHECK(contains(m, "int8/block 2^" + std::to_string(l) + " does not match"));
    CHECK(contains(m, "expected format int8/block 256"));
  }
  h.log2_block = 63;
  CHECK(contains(error_of([&] { check_header<F>(h, 10, "test", "msg"); }), "block 9223372036854775808"));
  h.log2_block = 8;
  CHECK(error_of([&] { check_header<F>(h, 10, "test", "msg"); }) == "no error");
  h.format = 200;  // not a FormatId
  CHECK(contains(error_of([&] { check_header<F>(h, 10, "test", "msg"); }), "?/block 256"));
}

// ---- sizes derived from counts ------------------------------------------------------------------

TEST_CASE_TEMPLATE("max_count: the largest count whose message size fits; above it sizes saturate", F,
                   Int8<32>, Int4<8192>, Int8Asym<64>, MxFp6E3M2, MxFp4, NvFp4, Identity<float, 1>,
                   Identity<float, 8192>, Identity<bfloat16, 32>) {
  using L = MessageLayout<F>;
  constexpr std::size_t m = max_count<F>();
  static_assert(m % F::block == 0, "max_count is whole blocks");
  // Exact at the limit: the code and meta areas are as large as the count says, without wrapping.
  const std::size_t nb = m / F::block;
  REQUIRE(L::blocks(m) == nb);
  CHECK(packed_bytes<F>(m) >= L::codes_offset + nb * L::block_code_bytes);
  CHECK(packed_bytes<F>(m) - L::metas_offset(m) >= nb * F::meta_bytes);
  CHECK(packed_bytes<F>(m) < kMax);
  // One block more would not fit, as a count or as bytes: the limit is tight to a block.
  const long double more = static_cast<long double>(nb + 1) * (L::block_code_bytes + F::meta_bytes);
  CHECK((nb + 1 > kMax / F::block || more + L::codes_offset > static_cast<long double>(kMax) - 30.0L));
  // Above the limit packed_bytes saturates, so no buffer size passes a check against it.
  for (std::size_t n : {m + 1, m + F::block, kMax - F::block + 1, kMax})
    if (n > m) CHECK(packed_bytes<F>(n) == kMax);  // (m + F::block wraps where m is the top block)
  CHECK(L::blocks(kMax) == kMax / F::block + (F::block > 1 ? 1 : 0));
  if (m < kMax) {
    const std::string e = error_of([&] { checked_packed_bytes<F>(m + 1, "test", "n"); });
    CHECK(contains(e, "'n' = " + std::to_string(m + 1)));
    CHECK(contains(e, std::to_string(m)));
  }
  CHECK(checked_packed_bytes<F>(F::block, "test", "n") == packed_bytes<F>(F::block));
}

TEST_CASE("a header-only message announcing a count whose size wraps is rejected before decoding") {
  // 2^62 fp32 elements would need 2^64 + 32 bytes: the size used to wrap to 32.
  using F = Identity<float>;
  const std::size_t n = std::size_t{1} << 62;
  REQUIRE(packed_bytes<F>(n) == kMax);
  MessageHeader h = make_header<F>(n);
  std::vector<unsigned char> msg(sizeof h);
  std::memcpy(msg.data(), &h, sizeof h);
  std::vector<float> out(4, 7.0f);
  std::string e = error_of([&] { host::dequantize<F>(msg.data(), msg.size(), out.data(), n); });
  CHECK(contains(e, "host::dequantize: argument 'n' = 4611686018427387904 exceeds"));
  CHECK(contains(e, std::to_string(max_count<F>())));
  e = error_of([&] { host::dequantize_accumulate<F>(msg.data(), msg.size(), out.data(), n); });
  CHECK(contains(e, "host::dequantize_accumulate: argument 'n'"));
  for (float v : out) CHECK(v == 7.0f);

  // A count whose block count used to wrap (n + block - 1 past 2^64): quantize wrote a header of
  // that count into a header-sized buffer and claimed success.
  using I8 = Int8<256>;
  volatile std::size_t opaque = kMax - 254;  // hidden from the optimiser's range analysis
  const std::size_t wraps = opaque;
  std::vector<unsigned char> small(sizeof(MessageHeader), 0x5A);
  e = error_of([&] { host::quantize<I8>(out.data(), wraps, small.data(), small.size()); });
  CHECK(contains(e, "host::quantize: argument 'n' = " + std::to_string(wraps)));
  for (unsigned char b : small) CHECK(b == 0x5A);
}

TEST_CASE("workspace carving: sizes that do not fit in std::size_t throw, naming the count") {
  WorkspaceCarver c;
  c.take<float>(10);
  CHECK(c.bytes() == kWorkspaceAlignment);
  c.take<unsigned char>(100, 3);
  CHECK(c.bytes() == kWorkspaceAlignment + 320);
  std::string e = error_of([&] { c.take<float>(kMax / 2); });
  CHECK(contains(e, "WorkspaceCarver::take: argument 'count' = " + std::to_string(kMax / 2) + " times 4"));
  CHECK(contains(e, std::to_string(kMax)));
  e = error_of([&] { c.take<unsigned char>(std::size_t{1} << 40, std::size_t{1} << 30); });
  CHECK(contains(e, "'count' = 1099511627776 times 1073741824 overflows"));
  e = error_of([&] { c.take<unsigned char>(kMax - 10); });  // rounding up to the alignment wraps
  CHECK(contains(e, "overflows"));
  WorkspaceCarver d;
  d.take<unsigned char>(kMax / 2 + 1);                         // 2^63 bytes
  e = error_of([&] { d.take<unsigned char>(kMax / 2 + 1); });  // the total would be 2^64
  CHECK(contains(e, "'workspace bytes'"));
  CHECK(checked_mul(0, kMax, "t", "a") == 0);
  CHECK(checked_add(kMax - 1, 1, "t", "a") == kMax);
  CHECK(checked_round_up(33, 16, "t", "a") == 48);
}

// ---- Identity of 16-bit types: overflow is flagged --------------------------------------------

TEST_CASE_TEMPLATE("Identity<half/bfloat16>: a finite input that rounds to Inf sets kFlagNonFinite", W, half,
                   bfloat16) {
  using F = Identity<W, 32>;
  const bool is_half = std::is_same<W, half>::value;
  // The largest float that rounds to the type's max finite value, and the next float up.
  const float last_finite = is_half ? std::nextafter(65520.0f, 0.0f) : fp::from_bits(0x7f7f7fffu);
  const float first_inf = is_half ? 65520.0f : fp::from_bits(0x7f7f8000u);
  const float limit = is_half ? 65504.0f : fp::from_bits(0x7f7f0000u);
  std::vector<unsigned char> msg(packed_bytes<F>(100));
  std::vector<float> y(100);
  for (float big : {first_inf, -first_inf, std::numeric_limits<float>::max(), 1e38f * (is_half ? 1 : 10)}) {
    if (!std::isfinite(big) || std::fabs(big) < first_inf) continue;
    std::vector<float> x(100, 1.0f);
    x[57] = big;
    CAPTURE(big);
    CHECK(host::quantize<F>(x.data(), x.size(), msg.data(), msg.size()) == msg.size());
    CHECK((host::dequantize<F>(msg.data(), msg.size(), y.data(), y.size()) & kFlagNonFinite) != 0);
    CHECK(std::isinf(y[57]));
    CHECK(std::signbit(y[57]) == std::signbit(big));
    CHECK(y[56] == 1.0f);
  }
  // Just below the overflow threshold: rounds to the largest finite value, no flag.
  std::vector<float> x(100, -2.0f);
  x[3] = last_finite;
  x[4] = -last_finite;
  host::quantize<F>(x.data(), x.size(), msg.data(), msg.size());
  CHECK(host::dequantize<F>(msg.data(), msg.size(), y.data(), y.size()) == 0u);
  CHECK(y[3] == limit);
  CHECK(y[4] == -limit);
  // The rule as the kernels use it, on block statistics and on codes.
  BlockStats s = stats_empty();
  stats_add(s, last_finite);
  CHECK_FALSE(block_nonfinite<F>(s));
  stats_add(s, -first_inf);
  CHECK(block_nonfinite<F>(s));
  CHECK_FALSE(block_nonfinite<Identity<float>>(s));  // fp32 holds every finite float
  CHECK(F::code_nonfinite(F::encode(first_inf, {})));
  CHECK(F::code_nonfinite(F::encode(std::numeric_limits<float>::quiet_NaN(), {})));
  CHECK_FALSE(F::code_nonfinite(F::encode(last_finite, {})));
}

// ---- NVFP4 decode order -------------------------------------------------------------------------

TEST_CASE("NVFP4 decodes (e2m1 * s_b) * s_t: the exact product of the three factors, rounded once") {
  // e2m1 * s_b has at most 2 + 4 significant bits, and with s_t's 24 the product is exact in
  // double: rounding it to float once is the reference. The other order, e2m1 * fl(s_b * s_t),
  // rounds twice and differs for some scales; the test counts those to show it tells them apart.
  const float tensor_scales[] = {0.1f,     1.0f / 3.0f, 0.7f,  1.2345678f, 3.3e-5f,  123.456f,
                                 9.9e-39f, 2.1e-40f,    1e30f, 1.3e36f,    6.02e23f, 0.0f};
  std::size_t checked = 0, other_order_differs = 0, saturated = 0;
  for (float st : tensor_scales)
    for (unsigned sb = 0; sb < 256; ++sb) {
      if ((sb & 0x7f) == 0x7f) continue;  // E4M3 NaN: the block decodes to NaN
      const unsigned char meta = static_cast<unsigned char>(sb);
      const NvFp4::Meta m = NvFp4::load_meta(&meta, st);
      const float b = minifloat::decode<minifloat::E4M3>(static_cast<std::uint8_t>(sb));
      for (std::uint32_t c = 0; c < 16; ++c) {
        const float e = minifloat::decode<minifloat::E2M1>(static_cast<std::uint8_t>(c));
        float want =
            static_cast<float>(static_cast<double>(e) * static_cast<double>(b) * static_cast<double>(st));
        if (std::isinf(want)) {
          want = std::copysign(std::numeric_limits<float>::max(), want);  // kept finite
          ++saturated;
        }
        const float got = NvFp4::decode(c, m);
        CAPTURE(st);
        CAPTURE(sb);
        CAPTURE(c);
        REQUIRE(fp::bits(got) == fp::bits(want));
        const float other = fp::mul(e, fp::mul(b, st));
        if (std::isfinite(other) && fp::bits(other) != fp::bits(want)) ++other_order_differs;
        ++checked;
      }
    }
  CHECK(checked == 12u * 254u * 16u);
  CHECK(other_order_differs > 100u);
  CHECK(saturated > 0u);

  // The same through a whole message (the host decoder's table path): one block per block scale.
  const float st = 0.7f;
  const std::size_t n = 254 * 16;
  using L = MessageLayout<NvFp4>;
  std::vector<unsigned char> msg(packed_bytes<NvFp4>(n), 0);
  const MessageHeader h = make_header<NvFp4>(n);
  std::memcpy(msg.data(), &h, sizeof h);
  detail::store_f32(msg.data() + L::message_meta_offset, st);
  std::size_t blk = 0;
  for (unsigned sb = 0; sb < 256; ++sb) {
    if ((sb & 0x7f) == 0x7f) continue;
    msg[L::metas_offset(n) + blk] = static_cast<unsigned char>(sb);
    for (std::size_t k = 0; k < 8; ++k)  // codes 0..15, two per byte
      msg[L::codes_offset + blk * 8 + k] = static_cast<unsigned char>((2 * k) | ((2 * k + 1) << 4));
    ++blk;
  }
  std::vector<float> y(n);
  CHECK(host::dequantize<NvFp4>(msg.data(), msg.size(), y.data(), n) == 0u);
  std::size_t bad = 0;
  blk = 0;
  for (unsigned sb = 0; sb < 256; ++sb) {
    if ((sb & 0x7f) == 0x7f) continue;
    const float b = minifloat::decode<minifloat::E4M3>(static_cast<std::uint8_t>(sb));
    for (std::uint32_t c = 0; c < 16; ++c) {
      const float e = minifloat::decode<minifloat::E2M1>(static_cast<std::uint8_t>(c));
      const float want =
          static_cast<float>(static_cast<double>(e) * static_cast<double>(b) * static_cast<double>(st));
      if (fp::bits(y[blk * 16 + c]) != fp::bits(want)) ++bad;
    }
    ++blk;
  }
  CHECK(bad == 0u);
}

// ---- misaligned typed pointers --------------------------------------------------------------------

TEST_CASE("host kernels reject typed pointers not aligned to their type, naming the argument") {
  using F = Int8<32>;
  const std::size_t n = 40;
  alignas(16) unsigned char raw[(n + 1) * sizeof(float)] = {};
  std::vector<unsigned char> msg(packed_bytes<F>(n), 0x5A);
  for (std::size_t off : {1u, 2u, 3u}) {
    const float* in = reinterpret_cast<const float*>(raw + off);
    std::string e = error_of([&] { host::quantize<F>(in, n, msg.data(), msg.size()); });
    CHECK(contains(e, "host::quantize: argument 'in' = 0x"));
    CHECK(contains(e, "is not aligned to 4 bytes"));
  }
  for (unsigned char b : msg) REQUIRE(b == 0x5A);
  std::vector<float> x(n, 1.5f);
  host::quantize<F>(x.data(), n, msg.data(), msg.size());
  float* out = reinterpret_cast<float*>(raw + 2);
  CHECK(contains(error_of([&] { host::dequantize<F>(msg.data(), msg.size(), out, n); }),
                 "host::dequantize: argument 'out'"));
  CHECK(contains(error_of([&] { host::dequantize_accumulate<F>(msg.data(), msg.size(), out, n); }),
                 "host::dequantize_accumulate: argument 'acc'"));
  half* hout = reinterpret_cast<half*>(raw + 1);
  CHECK(contains(error_of([&] { host::dequantize<F>(msg.data(), msg.size(), hout, n); }),
                 "is not aligned to 2 bytes"));
  for (unsigned char b : raw) CHECK(b == 0);
  // Messages are bytes: any alignment works, and aligned typed pointers are accepted.
  std::vector<unsigned char> shifted(msg.size() + 1);
  std::memcpy(shifted.data() + 1, msg.data(), msg.size());
  std::vector<float> y(n);
  CHECK(host::dequantize<F>(shifted.data() + 1, msg.size(), y.data(), n) == 0u);
  CHECK(y == x);
  CHECK(contains(
      error_of([] { check_aligned("f", "p", reinterpret_cast<const void*>(std::uintptr_t{96}), 64); }),
      "qcoll::f: argument 'p' = 0x60 is not aligned to 64 bytes"));
  CHECK(error_of([] { check_aligned("f", "p", nullptr, 64); }) == "no error");
}
