// The host kernels (quantize, dequantize, dequantize_accumulate and the collectives' decode
// helpers) against a frozen scalar reference written here from the formats' per-element functions:
// statistics with stats_add in element order, F::make_meta, F::encode / F::encode_sr per element,
// codes put bit by bit, F::decode per element. Byte for byte, for every format, every block size
// at which the kernels' compile-time choices change (CheckedBlocks), f32 / bf16 / f16 input,
// nearest and stochastic rounding, and inputs holding NaN, ±Inf, ±0, subnormals, values near the
// top of the range, and tails (n not a multiple of the block).
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <qcoll/collective/common.hpp>
#include <qcoll/format/dispatch.hpp>
#include <qcoll/host/quantize.hpp>

using namespace qcoll;

namespace {

// ---- the frozen reference ----------------------------------------------------------------------

template <class F>
std::uint32_t ref_get_code(const unsigned char* codes, std::size_t i) {
  std::uint32_t v = 0;
  for (std::size_t k = 0; k < F::code_bits; ++k) {
    const std::size_t bit = i * F::code_bits + k;
    v |= static_cast<std::uint32_t>((codes[bit / 8] >> (bit % 8)) & 1u) << k;
  }
  return v;
}

template <class F>
void ref_put_code(unsigned char* codes, std::size_t i, std::uint32_t code) {
  for (std::size_t k = 0; k < F::code_bits; ++k) {
    const std::size_t bit = i * F::code_bits + k;
    if ((code >> k) & 1u) codes[bit / 8] = static_cast<unsigned char>(codes[bit / 8] | (1u << (bit % 8)));
  }
}

template <class F, class T>
std::vector<unsigned char> ref_quantize(const std::vector<T>& x, const host::QuantizeOptions& opt) {
  using L = MessageLayout<F>;
  const std::size_t n = x.size();
  std::vector<unsigned char> msg(packed_bytes<F>(n), 0);
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) {
    float amax = 0.0f;
    for (const T& v : x)
      if (fp::is_finite(to_float(v))) amax = fp::max(amax, fp::abs(to_float(v)));
    mscale = F::message_scale(amax);
    detail::store_f32(msg.data() + L::message_meta_offset, mscale);
  }
  bool bad = false;
  for (std::size_t b = 0; b < L::blocks(n); ++b) {
    const std::size_t first = b * F::block;
    const std::size_t valid = std::min<std::size_t>(F::block, n - first);
    // Finite values only; of equal extremes (+0 and -0) the first in element order is kept.
    BlockStats s = stats_empty();
    for (std::size_t i = 0; i < valid; ++i) {
      const float v = to_float(x[first + i]);
      if (!fp::is_finite(v)) {
        s.nonfinite = true;
        continue;
      }
      s.absmax = fp::abs(v) > s.absmax ? fp::abs(v) : s.absmax;
      s.lo = v < s.lo ? v : s.lo;
      s.hi = v > s.hi ? v : s.hi;
    }
    bad |= s.nonfinite;
    const typename F::Meta m = F::make_meta(s, mscale);
    F::store_meta(m, msg.data() + L::metas_offset(n) + b * F::meta_bytes);
    unsigned char* codes = msg.data() + L::codes_offset + b * L::block_code_bytes;
    for (std::size_t i = 0; i < valid; ++i) {
      const float v = to_float(x[first + i]);
      const std::uint32_t c = opt.rounding == Rounding::nearest
                                  ? static_cast<std::uint32_t>(F::encode(v, m))
                                  : static_cast<std::uint32_t>(F::encode_sr(
                                        v, m, random_bits(opt.seed, opt.index_base + first + i)));
      ref_put_code<F>(codes, i, c);
    }
  }
  MessageHeader h = make_header<F>(n);
  h.flags = bad ? kFlagNonFinite : 0u;
  std::memcpy(msg.data(), &h, sizeof h);
  return msg;
}

template <class F>
float ref_decode(const unsigned char* msg, std::size_t n, std::size_t i) {
  using L = MessageLayout<F>;
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) mscale = detail::load_f32(msg + L::message_meta_offset);
  const std::size_t b = i / F::block;
  const typename F::Meta m = F::load_meta(msg + L::metas_offset(n) + b * F::meta_bytes, mscale);
  return F::decode(ref_get_code<F>(msg + L::codes_offset + b * L::block_code_bytes, i % F::block), m);
}

// ---- inputs ------------------------------------------------------------------------------------

enum class Kind { gaussian, specials, zeros, subnormal, huge, constant };
const Kind kKinds[] = {Kind::gaussian,  Kind::specials, Kind::zeros,
                       Kind::subnormal, Kind::huge,     Kind::constant};

template <class T>
std::vector<T> make_input(Kind kind, std::size_t n, std::size_t block, unsigned seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float inf = std::numeric_limits<float>::infinity();
  const float big = std::is_same<T, half>::value       ? 65504.0f
                    : std::is_same<T, bfloat16>::value ? bf16_bits_to_float(0x7f7f)
                                                       : std::numeric_limits<float>::max();
  const float tiny = std::is_same<T, half>::value ? 3e-6f : 1e-39f;
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t blk = i / block;
    float x = normal(g) * std::ldexp(1.0f, static_cast<int>(blk % 9) - 4);
    switch (kind) {
      case Kind::gaussian: break;
      case Kind::specials:
        // every third block holds one special at a varying position; others stay finite
        if (blk % 3 == 1 && i % block == (blk * 7) % block) {
          const float sp[] = {std::numeric_limits<float>::quiet_NaN(), inf, -inf, -std::nanf("0x123")};
          x = sp[(blk / 3) % 4];
        }
        break;
      case Kind::zeros:  // signed zeros as extremes: whole blocks of ±0, non-negative and non-positive blocks
        x = blk % 4 == 0   ? (g() % 2 ? 0.0f : -0.0f)
            : blk % 4 == 1 ? std::fabs(x) * static_cast<float>(g() % 2)
            : blk % 4 == 2 ? -std::fabs(x) * static_cast<float>(g() % 2)
                           : x;
        if (blk % 4 != 3 && g() % 2) x = -x;
        if (blk % 4 == 1 && x < 0) x = -0.0f;
        if (blk % 4 == 2 && x > 0) x = 0.0f;
        break;
      case Kind::subnormal: x = normal(g) * tiny; break;
      case Kind::huge:
        x = big * std::min(1.0f, std::fabs(normal(g)) / 3.0f) * (g() % 2 ? -1.0f : 1.0f);
        break;
      case Kind::constant: x = blk % 2 ? 0.7f : -3.25f; break;
    }
    v[i] = from_float<T>(x);
  }
  return v;
}

// Equal bits; for float, two NaNs also count as equal. A NaN code in a block whose scale is NaN
// decodes to NaN times NaN, and which operand's payload a C++ multiplication keeps is the
// compiler's choice (the operation is commutative), so no scalar reference can pin it; 16-bit
// outputs turn every NaN into 0x7fff.
template <class T>
bool same(const T& a, const T& b) {
  if constexpr (std::is_same<T, float>::value) {
    if (fp::is_nan(a) && fp::is_nan(b)) return true;
  }
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// The portable loops (what runs without AVX2) quantizing x into out (packed_bytes<F>(x.size())).
template <class F, class T>
void portable_quantize(const std::vector<T>& x, void* out, const host::QuantizeOptions& opt) {
  const std::size_t n = x.size();
  host::detail::quantize_blocks_impl<F, T>(
      n,
      [&](std::size_t k) {
        const std::size_t first = k * F::block;
        return host::detail::BlockSource<T>{x.data() + first, std::min<std::size_t>(F::block, n - first)};
      },
      out, opt);
}

// Counts mismatches of every host path against the reference for one (F, T).
template <class F, class T>
std::size_t mismatches(std::string& where) {
  std::size_t bad = 0;
  const std::size_t sizes[] = {1, F::block - 1, F::block, 2 * F::block + 3, 5 * F::block + F::block / 2 + 1};
  for (Kind kind : kKinds)
    for (std::size_t n : sizes)
      for (Rounding r : {Rounding::nearest, Rounding::stochastic}) {
        const auto x =
            make_input<T>(kind, n, F::block, static_cast<unsigned>(n * 31 + static_cast<unsigned>(kind)));
        host::QuantizeOptions opt;
        opt.rounding = r;
        opt.seed = 11;
        opt.index_base = 5;
        const std::vector<unsigned char> want = ref_quantize<F>(x, opt);
        std::vector<unsigned char> got(want.size(), 0xAB);
        host::quantize<F>(x.data(), n, got.data(), got.size(), opt);
        const auto note = [&](const char* what) {
          ++bad;
          if (where.empty())
            where = std::string(what) + " " + format_name(F::id) + "/" + std::to_string(F::block) + " " +
                    dtype_name(dtype_of<T>::value) + " kind " + std::to_string(static_cast<int>(kind)) +
                    " n " + std::to_string(n);
        };
        if (got != want) note("quantize");
        // The portable loops (what runs without AVX2) against the same reference.
        std::vector<unsigned char> port(want.size(), 0xCD);
        portable_quantize<F>(x, port.data(), opt);
        if (port != want) note("portable quantize");
        // Decoding: to T, accumulated into fp32, and the collectives' slice decoder (zeroed tail).
        std::vector<T> y(n), z(n + 3), yp(n);
        std::vector<float> acc(n);
        for (std::size_t i = 0; i < n; ++i) acc[i] = static_cast<float>(i % 5) - 2.0f;
        const std::vector<float> acc0 = acc;
        host::dequantize<F>(want.data(), want.size(), y.data(), n);
        host::detail::decode_into_impl<F, T, false>(want.data(), n, n, yp.data());
        host::dequantize_accumulate<F>(want.data(), want.size(), acc.data(), n);
        const std::size_t valid = n - n / 3;
        detail::decode_slice<F, T>(want.data(), n, valid, z.data());
        // Decoding from a block boundary (the kernels stored, the portable loops accumulated onto
        // -0), and the residual of error feedback, r - value, for r holding -0, the value itself (an
        // exact cancellation) and others (fp32 outputs).
        constexpr bool f32 = std::is_same<T, float>::value;
        const std::size_t from = f32 ? n / F::block / 2 * F::block : n;
        std::vector<float> part(n - from, 9.0f), pacc(n - from, -0.0f), resid(f32 ? n : 0);
        if constexpr (f32) {
          host::detail::decode_into<F, float>(want.data(), n, n, part.data(), from);
          host::detail::decode_into_impl<F, float, true>(want.data(), n, n, pacc.data(), from);
          for (std::size_t i = 0; i < n; ++i)
            resid[i] = i % 3 == 0 ? ref_decode<F>(want.data(), n, i) : i % 3 == 1 ? -0.0f : acc0[i];
        }
        const std::vector<float> resid0 = resid;
        if constexpr (f32) host::detail::subtract_decoded<F>(want.data(), n, n, resid.data());
        for (std::size_t i = 0; i < n; ++i) {
          const float d = ref_decode<F>(want.data(), n, i);
          const T wy = from_float<T>(d);
          const float wa = fp::add(acc0[i], d);
          const T wz = i < valid ? wy : from_float<T>(0.0f);
          if (!same(wy, y[i])) note("dequantize");
          if (!same(wy, yp[i])) note("portable dequantize");
          if (!same(wa, acc[i])) note("dequantize_accumulate");
          if (!same(wz, z[i])) note("decode_slice");
          if (i >= from && !same(d, part[i - from])) note("decode_into from a block");
          if (i >= from && !same(fp::add(-0.0f, d), pacc[i - from]))
            note("portable decode_into from a block");
          if (f32 && !same(fp::sub(resid0[i], d), resid[i])) note("subtract_decoded");
        }
      }
  return bad;
}

template <class F>
std::size_t all_types(std::string& where) {
  return mismatches<F, float>(where) + mismatches<F, bfloat16>(where) + mismatches<F, half>(where);
}

// The block sizes at which a compile-time choice of the host kernels changes: 32 (the smallest),
// 64 (4-bit codes take the portable decode table from 64 on), 512 and 1024 (the AVX2 kernels
// group 4 and 2 blocks per step instead of 8; 8-bit codes take the portable table from 1024 on),
// 2048 (one block per step) and 8192 (the largest). 128, 256 and 4096 take the same branches as
// their neighbours but one: from 128 on, the next group's statistics are gathered during a
// group's encoding, which a test case of its own checks at 128, 256 and 512. Leaving them out here
// takes 40% off this file's compile time.
using CheckedBlocks = detail::BlockSet<32, 64, 512, 1024, 2048, 8192>;

template <std::size_t... Bs>
constexpr std::array<std::size_t, sizeof...(Bs)> block_list(detail::BlockSet<Bs...>) {
  return {Bs...};
}

}  // namespace

TEST_CASE("host kernels equal the scalar reference byte for byte: every format, block, type, rounding") {
  const std::string isa = std::string("kernels: ") + host::kernel_isa();
  MESSAGE(isa);
  const FormatId ids[] = {FormatId::int8,       FormatId::int4,       FormatId::int8_asym,
                          FormatId::int4_asym,  FormatId::fp8_e4m3,   FormatId::fp8_e5m2,
                          FormatId::mxfp8_e4m3, FormatId::mxfp8_e5m2, FormatId::mxfp6_e2m3,
                          FormatId::mxfp6_e3m2, FormatId::mxfp4,      FormatId::mxint8,
                          FormatId::nvfp4};
  for (FormatId id : ids) {
    const bool fixed = id >= FormatId::mxfp8_e4m3;
    for (std::size_t block : block_list(CheckedBlocks{})) {
      if (fixed && block > 32) break;
      std::string where;
      const std::size_t bad = detail::dispatch_quantized<CheckedBlocks>(
          id, block, [&](auto f) { return all_types<decltype(f)>(where); });
      const std::string info =
          std::string(format_name(id)) + " block " + std::to_string(block) + ": " + where;
      INFO(info);
      CHECK(bad == 0u);
    }
  }
}

// How many of y[0, n) differ from want[0, n) (see same).
template <class T>
std::size_t count_differences(const T* y, const T* want, std::size_t n) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += !same(y[i], want[i]);
  return bad;
}

TEST_CASE_TEMPLATE("large outputs (non-temporal stores) and unaligned outputs decode like the portable loops",
                   F, Int8<256>, Int4<32>, MxFp4, MxFp6E2M3, NvFp4, Int8Asym<2048>, Fp8E4M3<8192>) {
  // 5M elements: the fp32 and 16-bit outputs pass the size above which dequantize streams (the
  // asymmetric integers' FMA loop and the FP8 decoders included). fp32 outputs compare NaNs as
  // equal (see same).
  const std::size_t n = (std::size_t{5} << 20) + 17;
  const auto x = make_input<float>(Kind::specials, n, F::block, 3);
  std::vector<unsigned char> msg(packed_bytes<F>(n));
  host::quantize<F>(x.data(), n, msg.data(), msg.size());
  std::vector<float> y(n + 1), want(n);
  host::detail::decode_into_impl<F, float, false>(msg.data(), n, n, want.data());
  host::dequantize<F>(msg.data(), msg.size(), y.data(), n);
  CHECK(count_differences(y.data(), want.data(), n) == 0u);
  host::dequantize<F>(msg.data(), msg.size(), y.data() + 1, n);  // 4-byte aligned only
  CHECK(count_differences(y.data() + 1, want.data(), n) == 0u);
  std::vector<bfloat16> b(n), bwant(n);
  host::detail::decode_into_impl<F, bfloat16, false>(msg.data(), n, n, bwant.data());
  host::dequantize<F>(msg.data(), msg.size(), b.data(), n);
  CHECK(std::memcmp(b.data(), bwant.data(), n * sizeof(bfloat16)) == 0);
}

TEST_CASE_TEMPLATE("large messages (non-temporal code stores) quantize like the portable loops", F, Int8<32>,
                   Int8<2048>) {
  // Codes past the 16 MiB above which quantize streams them, a partial last block, and the same
  // input from a 16-byte aligned and a 4-byte aligned message (which does not stream).
  const std::size_t n = ((std::size_t{16} << 20) * 8 / F::code_bits) + F::block + 5;
  const auto x = make_input<bfloat16>(Kind::specials, n, F::block, 5);
  std::vector<unsigned char> want(packed_bytes<F>(n)), got(want.size() + 4);
  portable_quantize<F>(x, want.data(), host::QuantizeOptions{});
  for (std::size_t shift : {0, 4}) {
    CAPTURE(shift);
    host::quantize<F>(x.data(), n, got.data() + shift, want.size());
    CHECK(std::memcmp(got.data() + shift, want.data(), want.size()) == 0);
  }
}

// Whether host::quantize writes the message the portable loops write for x (default options).
template <class F, class T>
bool quantizes_like_portable(const std::vector<T>& x) {
  std::vector<unsigned char> want(packed_bytes<F>(x.size())), got(want.size());
  portable_quantize<F>(x, want.data(), host::QuantizeOptions{});
  host::quantize<F>(x.data(), x.size(), got.data(), got.size());
  return got == want;
}

TEST_CASE_TEMPLATE("fp32 runs read as two streams quantize like the portable loops", F, NvFp4, Int8<32>,
                   Int4<64>, MxFp6E2M3) {
  // A run of full blocks past the size from which the kernels read fp32 input as two streams (the
  // run's halves in turns), an odd count of full blocks (the last turn takes the one left over) and
  // a partial last block; blocks handed back to the scalar encoder in both halves: non-finite ones
  // (specials) and ones whose scale is below the normal range (subnormal input).
  const std::size_t n = (std::size_t{1} << 18) + 3 * F::block + 5;
#if QCOLL_HOST_AVX2_DISPATCH
  static_assert(host::detail::avx2::two_stream_run_bytes <= (std::size_t{1} << 18) * sizeof(float),
                "the run reaches the two-stream size");
#endif
  for (Kind kind : {Kind::specials, Kind::subnormal, Kind::gaussian}) {
    CAPTURE(static_cast<int>(kind));
    CHECK(quantizes_like_portable<F>(make_input<float>(kind, n, F::block, 11)));
  }
}

// From block 128 on, the kernels gather a group's statistics while they encode the group before
// it; the sizes of the first test case reach that only at blocks 1024 and larger. 17 blocks and a
// partial one: two full groups and more (groups hold at most 8 blocks), of every input kind (NaN and
// Inf in the gathered groups among them), and the same bytes as the portable loops.
TEST_CASE_TEMPLATE(
    "groups whose statistics are gathered during the previous group's codes quantize like the "
    "portable loops",
    F, Int8<128>, Int4<512>, Fp8E4M3<256>, Fp8E5M2<128>) {
  const std::size_t n = 17 * F::block + 7;
  for (Kind kind : kKinds) {
    CAPTURE(static_cast<int>(kind));
    CHECK(quantizes_like_portable<F>(make_input<float>(kind, n, F::block, 17)));
    CHECK(quantizes_like_portable<F>(make_input<bfloat16>(kind, n, F::block, 19)));
    CHECK(quantizes_like_portable<F>(make_input<half>(kind, n, F::block, 23)));
  }
}

// The largest code value of a format whose block scale is absmax over it.
template <class F>
struct LargestCode;
template <unsigned B, std::size_t K>
struct LargestCode<SymmetricInt<B, K>> {
  static constexpr float value = SymmetricInt<B, K>::qmax;
};
template <class E, std::size_t K>
struct LargestCode<Fp8Scaled<E, K>> {
  static constexpr float value = E::max_normal;
};

// Where every block scale of a group is a normal float, the kernels of these formats encode
// without clamping the scaled values (|x / scale| cannot round past the largest code), in groups
// of several blocks (block 32) as in groups of one (block 2048); blocks with a subnormal scale go
// to the scalar encoder. Groups of scales just above the smallest normal float (even trials) and
// groups mixing normal and subnormal scales (odd trials), each block holding ±absmax and its
// neighbour below, quantize as the portable loops do.
template <class F, class T>
void check_scales_near_normal_min() {
  const float q = LargestCode<F>::value;
  std::mt19937_64 g(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const std::size_t nb = 9;  // more than one group of 8 blocks
  for (int trial = 0; trial < 16; ++trial) {
    std::vector<T> x(nb * F::block);
    for (std::size_t b = 0; b < nb; ++b) {
      const float m = trial % 2 == 0 ? 1.0f + std::ldexp(static_cast<float>(g() % 64), -23)
                                     : std::ldexp(1.0f + u(g) / 4.0f, static_cast<int>(g() % 7) - 3);
      const float amax = q * std::ldexp(m, -126);
      T* blk = x.data() + b * F::block;
      for (std::size_t i = 0; i < F::block; ++i) blk[i] = from_float<T>(amax * u(g));
      blk[(5 * b) % F::block] = from_float<T>(b % 2 ? -amax : amax);
      blk[(5 * b + 1) % F::block] = from_float<T>(std::nextafter(amax, 0.0f));
    }
    CAPTURE(trial);
    CHECK(quantizes_like_portable<F>(x));
  }
}

TEST_CASE_TEMPLATE("block scales around the smallest normal float quantize like the portable loops", F,
                   Int8<32>, Int4<32>, Fp8E4M3<32>, Fp8E5M2<32>, Int8<2048>, Int4<2048>, Fp8E4M3<2048>) {
  check_scales_near_normal_min<F, float>();
  check_scales_near_normal_min<F, bfloat16>();
}

// NVFP4's block scale is its E4M3 code's value times the message scale; the kernels take 1 /
// scale as the encode factor where no scale of the group is a subnormal float, and the scalar
// reciprocal (a pre-factor) otherwise. Messages whose absmax 2^top puts the block scales of a group
// on both sides of the smallest normal float, or all above it, with E4M3 codes from normal down
// to zero, and all-zero blocks among them (a zero scale), quantize as the portable loops do.
template <class T>
void check_nvfp4_scales_near_normal_min() {
  std::mt19937_64 g(13);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const std::size_t nb = 19;  // two full groups of 8 blocks and a partial one
  for (int trial = 0; trial < 24; ++trial) {
    const int top = -96 - trial;  // block scales below 2^-126 from trial 3 on
    std::vector<T> x(nb * NvFp4::block);
    for (std::size_t b = 0; b < nb; ++b) {
      T* blk = x.data() + b * NvFp4::block;
      if (b % 7 == 3) {
        for (std::size_t i = 0; i < NvFp4::block; ++i) blk[i] = from_float<T>(i % 2 ? -0.0f : 0.0f);
        continue;
      }
      // block absmax 2^top down to 2^(top - 21): E4M3 targets from 448 to below half of 2^-9
      const float amax = std::ldexp(1.0f + u(g) / 4.0f, top - static_cast<int>(g() % 22));
      for (std::size_t i = 0; i < NvFp4::block; ++i) blk[i] = from_float<T>(amax * u(g));
      blk[(5 * b) % NvFp4::block] = from_float<T>(b % 2 ? -amax : amax);
    }
    x[1] = from_float<T>(std::ldexp(-1.25f, top));  // the message absmax
    CAPTURE(trial);
    CHECK(quantizes_like_portable<NvFp4>(x));
  }
}

TEST_CASE("NVFP4 block scales around the smallest normal float quantize like the portable loops") {
  check_nvfp4_scales_near_normal_min<float>();
  check_nvfp4_scales_near_normal_min<bfloat16>();
}

// NVFP4's message maximum pass leaves each block's maximum in the run's code bytes for the encode
// pass, which the codes then overwrite (absmax_entries). Runs of whole groups of 8 blocks and of a
// partial one, of every input type and kind (non-finite blocks and blocks with subnormal scales
// handed back to the scalar encoder), from a contiguous array and from a source whose blocks form
// two runs apart in memory (each run keeps its maxima in its own codes), the message maximum in a
// block that holds a NaN: the portable loops' bytes.
template <class T>
std::size_t nvfp4_entries_mismatches() {
  constexpr std::size_t B = NvFp4::block;
  std::size_t bad = 0;
  for (std::size_t nb : {std::size_t{8}, std::size_t{8 * 37 + 5}, std::size_t{8 * 64 + 1}})
    for (Kind kind : kKinds) {
      const std::size_t n = nb * B + 7;  // and a partial last block
      auto x = make_input<T>(kind, n + B, B, static_cast<unsigned>(nb + 3 * static_cast<unsigned>(kind)));
      // specials: the message maximum among the finite values of a block that holds a NaN (block 1,
      // whose special is its element 7), which count for the message scale
      if (kind == Kind::specials) x[B + 2] = from_float<T>(-30000.0f);
      bad += !quantizes_like_portable<NvFp4>(
          std::vector<T>(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n)));
      // blocks [0, cut) from x, the others one block further on: two runs of full blocks
      const std::size_t cut = nb / 3;
      const auto src = [&](std::size_t b) {
        const std::size_t first = b * B;
        return host::detail::BlockSource<T>{x.data() + first + (b < cut ? 0 : B), std::min(B, n - first)};
      };
      std::vector<unsigned char> want(packed_bytes<NvFp4>(n)), got(want.size(), 0xAB);
      host::detail::quantize_blocks_impl<NvFp4, T>(n, src, want.data(), host::QuantizeOptions{});
      host::detail::quantize_blocks<NvFp4, T>(n, src, got.data(), host::QuantizeOptions{});
      bad += got != want;
    }
  return bad;
}

TEST_CASE("NVFP4 block maxima kept in the codes between the two passes: the portable loops' bytes") {
  CHECK(nvfp4_entries_mismatches<float>() == 0u);
  CHECK(nvfp4_entries_mismatches<bfloat16>() == 0u);
  CHECK(nvfp4_entries_mismatches<half>() == 0u);
}

#if QCOLL_HOST_AVX2_DISPATCH
// NVFP4's encoder has an FMA variant (its E2M1 codes), which the tests above run where the
// processor has FMA; here the one a processor without FMA runs, on the same inputs.
TEST_CASE("NVFP4 without FMA: the portable loops' bytes") {
  struct WithoutFma {
    WithoutFma() { host::detail::avx2::encode_without_fma() = true; }
    ~WithoutFma() { host::detail::avx2::encode_without_fma() = false; }
  } without;
  CHECK_FALSE(host::detail::avx2::encode_fma());
  CHECK(nvfp4_entries_mismatches<float>() == 0u);
  CHECK(nvfp4_entries_mismatches<bfloat16>() == 0u);
  CHECK(nvfp4_entries_mismatches<half>() == 0u);
  check_nvfp4_scales_near_normal_min<float>();
  check_nvfp4_scales_near_normal_min<bfloat16>();
}
#endif

// MX kernels scale by 2^-X in one multiplication where the scalar functions take two: the codes
// are the same, also where the scaled value falls below the smallest normal float. Blocks with
// absmax from 2 to 2^101 (X > 0 for most) holding values scaled to around and below 2^-126,
// subnormal inputs and signed zeros, as fp32 and bf16 input.
template <class F, class T>
void check_mx_tiny_scaled_values() {
  std::mt19937_64 g(11);
  std::uniform_real_distribution<float> u(1.0f, 2.0f);
  const std::size_t nb = 9;
  for (int trial = 0; trial < 8; ++trial) {
    std::vector<T> x(nb * F::block);
    for (std::size_t b = 0; b < nb; ++b) {
      const int e = 1 + static_cast<int>(g() % 100);  // absmax exponent: X = e - emax
      T* blk = x.data() + b * F::block;
      for (std::size_t i = 0; i < F::block; ++i) {
        const float sign = g() % 2 ? -1.0f : 1.0f;
        float v = 0.0f;
        // scaled magnitudes from 2^(emax - 150) to 2^(emax - 105), around and below 2^-126;
        // subnormal inputs; zeros; values near the absmax
        switch (i % 4) {
          case 0: v = std::ldexp(u(g), e - 150 + static_cast<int>(g() % 46)); break;
          case 1: v = std::ldexp(u(g), -149 + static_cast<int>(g() % 24)); break;
          case 2: v = 0.0f; break;
          default: v = std::ldexp(u(g), e - 1 - static_cast<int>(g() % 8)); break;
        }
        blk[i] = from_float<T>(sign * v);
      }
      blk[(3 * b) % F::block] = from_float<T>(std::ldexp(1.5f, e));  // the absmax
    }
    CAPTURE(trial);
    CHECK(quantizes_like_portable<F>(x));
  }
}

TEST_CASE_TEMPLATE("MX blocks scaled down past the smallest normal float quantize like the portable loops", F,
                   MxFp8E4M3, MxFp8E5M2, MxFp6E2M3, MxFp6E3M2, MxFp4, MxInt8) {
  check_mx_tiny_scaled_values<F, float>();
  check_mx_tiny_scaled_values<F, bfloat16>();
}

// MX kernels compute FP8 codes of bfloat16 and half input on the 16-bit patterns where the block
// allows it and fall back per block: blocks of random patterns whose exponents span 34 below the
// absmax (scaled values in the elements' subnormal range and the range that rounds to zero;
// half: subnormal and zero inputs too), absmax exponents over the whole range and past it (bfloat16
// and fp32: from -133, subnormal blocks and normal ones scaled up by 2^120 and more, to 127; half:
// from -26, blocks of subnormals and zeros, to 16, which overflows to Inf), absmax fractions that
// saturate, fraction bits that hit every rounding tie, and signed zeros.
template <class F, class T>
void check_mx_random_patterns() {
  constexpr bool is_half = std::is_same<T, half>::value;
  constexpr int fraction_bits = is_half ? 10 : 7;
  constexpr unsigned fractions = 1u << fraction_bits;
  std::mt19937_64 g(13);
  const std::size_t nb = 9;
  for (int trial = 0; trial < 64; ++trial) {
    std::vector<T> x(nb * F::block);
    for (std::size_t b = 0; b < nb; ++b) {
      // the absmax exponent
      const int top = is_half ? static_cast<int>(g() % 43) - 26 : static_cast<int>(g() % 261) - 133;
      T* blk = x.data() + b * F::block;
      for (std::size_t i = 0; i < F::block; ++i) {
        const float sign = g() % 2 ? -1.0f : 1.0f;
        const float frac = 1.0f + static_cast<float>(g() % fractions) / static_cast<float>(fractions);
        const float v = i % 8 == 7 ? 0.0f : std::ldexp(frac, top - static_cast<int>(g() % 35));
        blk[i] = from_float<T>(sign * v);
      }
      blk[(7 * b) % F::block] = from_float<T>(
          std::ldexp(1.0f + static_cast<float>(g() % fractions) / static_cast<float>(fractions), top));
    }
    CAPTURE(trial);
    CHECK(quantizes_like_portable<F>(x));
  }
}

TEST_CASE_TEMPLATE("MX blocks of random bfloat16 and half patterns quantize like the portable loops", F,
                   MxFp8E4M3, MxFp8E5M2, MxFp6E2M3, MxFp4, MxInt8) {
  check_mx_random_patterns<F, bfloat16>();
  check_mx_random_patterns<F, half>();
  check_mx_random_patterns<F, float>();
}

// MXFP4 codes of 16-bit input are computed on the patterns, its two subnormal codes by comparisons
// with a quarter and three quarters of 2^emin (= 1). Blocks whose scaled values hit every rounding
// tie of E2M1 (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5), both neighbours of each, zeros and the
// smallest subnormal inputs, at block scales 2^-n for n around the largest n at which zero and
// subnormal inputs still read as code 0 on the patterns (bfloat16: 124, half: 12) and across the
// range: the portable loops' bytes.
template <class T>
void check_mxfp4_16bit_ties() {
  constexpr bool is_half = std::is_same<T, half>::value;
  const float tiny = is_half ? std::ldexp(1.0f, -24) : std::ldexp(1.0f, -133);
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const int ns[] = {-12, -1, 0,  1,  2,   5,   10,  11,  12,  13,  14,
                    15,  16, 20, 60, 120, 123, 124, 125, 126, 127, 128};
  std::mt19937_64 g(29);
  for (int n : ns) {
    const float amax = std::ldexp(4.0f, -n);  // the block's scale is 2^-n
    if (is_half && (amax > 65504.0f || amax < std::ldexp(1.0f, -24))) continue;
    std::vector<T> x(4 * MxFp4::block);
    for (std::size_t b = 0; b < 4; ++b) {
      T* blk = x.data() + b * MxFp4::block;
      for (std::size_t i = 0; i < MxFp4::block; ++i) {
        const float t = ties[(i + b) % 7];
        // the tie, or the next T value above or below it
        const T v = from_float<T>(std::ldexp(t, -n));
        T w = v;
        if (b == 1) w.bits = static_cast<std::uint16_t>(v.bits + 1);
        if (b == 2) w.bits = static_cast<std::uint16_t>(v.bits - 1);
        if (b == 3)
          w = from_float<T>(i % 3 == 0   ? 0.0f
                            : i % 3 == 1 ? tiny
                                         : std::ldexp(t, -n) * (g() % 2 ? 0.5f : 0.25f));
        blk[i] = w;
        if (g() % 2) blk[i].bits = static_cast<std::uint16_t>(blk[i].bits | 0x8000u);
      }
      blk[(5 * b) % MxFp4::block] = from_float<T>(b % 2 ? -amax : amax);
    }
    CAPTURE(n);
    CHECK(quantizes_like_portable<MxFp4>(x));
  }
}

TEST_CASE("MXFP4 of bfloat16 and half input at E2M1's rounding ties quantizes like the portable loops") {
  check_mxfp4_16bit_ties<bfloat16>();
  check_mxfp4_16bit_ties<half>();
}

// Messages no quantizer writes (as a peer's corrupted or hostile bytes may be): every code in
// blocks whose scales are ±0, subnormal, near the saturation thresholds, huge, ±Inf or NaN (every
// byte value for 1-byte metas), and several message scales. The decoders must give the scalar
// reference's values: the FP8 decoders' fp16 conversion path covers finite nonzero scales below
// 2^100 and must saturate NaN and Inf codes exactly as scale_value does.
namespace {
template <class F, class T>
std::size_t arbitrary_message_mismatches(const std::vector<unsigned char>& msg, std::size_t n) {
  std::size_t bad = 0;
  std::vector<T> y(n);
  host::dequantize<F>(msg.data(), msg.size(), y.data(), n);
  std::vector<float> acc(n, 1.5f);
  if constexpr (std::is_same<T, float>::value)
    host::dequantize_accumulate<F>(msg.data(), msg.size(), acc.data(), n);
  for (std::size_t i = 0; i < n; ++i) {
    const float d = ref_decode<F>(msg.data(), n, i);
    bad += !same(from_float<T>(d), y[i]);
    if constexpr (std::is_same<T, float>::value) bad += !same(fp::add(1.5f, d), acc[i]);
  }
  return bad;
}
}  // namespace

TEST_CASE_TEMPLATE("decoders equal the reference on arbitrary codes and scales", F, Int8<256>, Int4<64>,
                   Fp8E4M3<32>, Fp8E4M3<256>, Fp8E5M2<2048>, MxFp8E4M3, MxFp8E5M2, MxFp6E2M3, MxFp6E3M2,
                   MxFp4, MxInt8, NvFp4) {
  using L = MessageLayout<F>;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float scales[] = {1.0f,          -1.0f,   0.0f,  -0.0f,  1e-45f,  1e-38f,
                          0.3f,          -448.0f, 1e30f, -1e30f, 2.5e30f, 1.2676506e30f,
                          1.2676505e30f, 3.4e38f, inf,   -inf,   nan,     -nan};
  // every 1-byte meta twice: NVFP4's 16-bit outputs take their look-up tables from 256 blocks on
  const std::size_t nb = F::meta_bytes == 1 ? 512 : sizeof(scales) / sizeof(scales[0]);
  const std::size_t n = nb * F::block - F::block / 2 - 1;  // a partial last block too
  constexpr std::uint32_t codes = 1u << F::code_bits;
  const float mscales[] = {1.0f, 3e-3f, 1e-40f, 0.0f, inf, nan};
  for (float ms : mscales) {
    if (!has_message_scale<F> && ms != 1.0f) continue;
    std::vector<unsigned char> msg(packed_bytes<F>(n), 0);
    const MessageHeader h = make_header<F>(n);
    std::memcpy(msg.data(), &h, sizeof h);
    if constexpr (has_message_scale<F>) detail::store_f32(msg.data() + L::message_meta_offset, ms);
    for (std::size_t b = 0; b < nb; ++b) {
      unsigned char* meta = msg.data() + L::metas_offset(n) + b * F::meta_bytes;
      if constexpr (F::meta_bytes == 4) {
        detail::store_f32(meta, scales[b]);
      } else {
        static_assert(F::meta_bytes == 1, "a 1- or 4-byte meta");
        meta[0] = static_cast<unsigned char>(b % 256);
      }
      for (std::size_t e = 0; e < F::block && b * F::block + e < n; ++e)
        ref_put_code<F>(msg.data() + L::codes_offset + b * L::block_code_bytes, e,
                        static_cast<std::uint32_t>((e * 7 + b * 3) % codes));
    }
    const std::size_t bad = arbitrary_message_mismatches<F, float>(msg, n) +
                            arbitrary_message_mismatches<F, bfloat16>(msg, n) +
                            arbitrary_message_mismatches<F, half>(msg, n);
    INFO("message scale " << ms);
    CHECK(bad == 0u);
  }
}

// FP8 decoders check blocks of up to 128 elements eight at a time (scales and codes) before
// decoding them with no test of their own: runs of finite blocks with normal scales, broken by a
// block holding one NaN code, one holding an Inf (E5M2) or NaN code, and one with a zero scale, at
// different places in their runs, must still decode as the reference does.
namespace {
template <class F>
struct fp8_element;
template <class E, std::size_t B>
struct fp8_element<Fp8Scaled<E, B>> {
  using type = E;
};
}  // namespace

TEST_CASE_TEMPLATE("FP8 decoders equal the reference when a run of normal blocks holds a non-finite code", F,
                   Fp8E4M3<32>, Fp8E5M2<32>, Fp8E4M3<128>) {
  using L = MessageLayout<F>;
  using E = typename fp8_element<F>::type;
  const std::size_t nb = 40, n = nb * F::block;
  std::vector<unsigned char> msg(packed_bytes<F>(n), 0);
  const MessageHeader h = make_header<F>(n);
  std::memcpy(msg.data(), &h, sizeof h);
  std::mt19937 g(21);
  for (std::size_t b = 0; b < nb; ++b) {
    const float scale = b == 33 ? 0.0f : 0.3f * (1.0f + static_cast<float>(b) / 64.0f);
    detail::store_f32(msg.data() + L::metas_offset(n) + b * F::meta_bytes, scale);
    for (std::size_t e = 0; e < F::block; ++e) {
      // finite codes of either sign
      std::uint32_t c = g() % (E::max_code + 1u);
      if (g() % 2) c |= 0x80u;
      if (b == 11 && e == 5) c = 0xffu;                                  // NaN (E4M3 and E5M2)
      if (b == 26 && e == F::block - 1) c = E::has_inf ? 0x7cu : 0x7fu;  // +Inf (E5M2), NaN (E4M3)
      ref_put_code<F>(msg.data() + L::codes_offset + b * L::block_code_bytes, e, c);
    }
  }
  const std::size_t bad = arbitrary_message_mismatches<F, float>(msg, n) +
                          arbitrary_message_mismatches<F, bfloat16>(msg, n) +
                          arbitrary_message_mismatches<F, half>(msg, n);
  CHECK(bad == 0u);
}

// FP8 blocks decode to bfloat16 by look-up: blocks of normal codes by a table of the outputs of
// exponent field 1 (Fp8NormalLookup; eight blocks checked at once up to block 128), the
// others of 64 codes or more by a table of fields 0 and 1 (fp8_bf16_lookup); the exponent field
// is added for the others, the sign last. Every finite code of either sign, in blocks of normal
// codes only and in blocks holding zero and subnormal codes, under scales of either sign on both
// sides of the look-ups' bound, with products subnormal (a subnormal scale included), normal and
// near overflow, and random scales over the whole range, must decode as the reference does.
TEST_CASE_TEMPLATE("FP8 decode to bfloat16 by look-up equals the reference for every finite code", F,
                   Fp8E4M3<32>, Fp8E5M2<32>, Fp8E4M3<64>, Fp8E5M2<128>, Fp8E4M3<2048>, Fp8E5M2<256>) {
  using L = MessageLayout<F>;
  using E = typename fp8_element<F>::type;
  // the bound: |a * 2^8| >= 2^-90 for E4M3 (its codes are converted as fp16 with 2^-8), |a| for E5M2
  const float least = E::ebits == 4 ? 0x1p-98f : 0x1p-90f;
  std::vector<float> scales;
  for (float a : {least, std::nextafter(least, 0.0f), least * 1.5f, 0x1p-110f, 0x1p-120f, 0x1p-126f,
                  0x1p-130f, 1e-45f, 0.3f, 1.0f, 448.0f, 0x1.8p99f, 0x1.fffffep99f}) {
    scales.push_back(a);
    scales.push_back(-a);
  }
  std::mt19937 g(31);
  std::uniform_int_distribution<int> binade(-140, 99);
  for (int r = 0; r < 40; ++r) {
    const float a = std::ldexp(1.0f + static_cast<float>(g() % (1u << 23)) * 0x1p-23f, binade(g));
    scales.push_back(r % 2 ? -a : a);
  }
  // each scale over sixteen blocks (two runs of eight, as decode_fp8_blocks checks them), each run
  // meeting all 256 codes (NaN and Inf magnitudes replaced); in the first run the codes of
  // exponent field 0 are moved to field 1, so that its blocks hold normal codes only
  constexpr std::uint32_t field = 0x7fu & ~((1u << E::mbits) - 1u);
  const std::size_t reps = 16, nb = scales.size() * reps, n = nb * F::block;
  std::vector<unsigned char> msg(packed_bytes<F>(n), 0);
  const MessageHeader h = make_header<F>(n);
  std::memcpy(msg.data(), &h, sizeof h);
  for (std::size_t b = 0; b < nb; ++b) {
    detail::store_f32(msg.data() + L::metas_offset(n) + b * F::meta_bytes, scales[b / reps]);
    for (std::size_t e = 0; e < F::block; ++e) {
      std::uint32_t c = static_cast<std::uint32_t>(((b % 8) * F::block + e) % 256);
      if ((c & 0x7fu) > E::max_code) c = (c & 0x80u) | ((c & 0x7fu) % (E::max_code + 1u));
      if (b % reps < 8 && (c & field) == 0) c |= 1u << E::mbits;
      ref_put_code<F>(msg.data() + L::codes_offset + b * L::block_code_bytes, e, c);
    }
  }
  CHECK(arbitrary_message_mismatches<F, bfloat16>(msg, n) == 0u);
  CHECK(arbitrary_message_mismatches<F, float>(msg, n) + arbitrary_message_mismatches<F, half>(msg, n) == 0u);
}

// The asymmetric integers decode by one float FMA per element where the double sum of F::decode
// is exact (the offset's and the scale's last bits at most 28 binades apart one way and 20 the
// other), by the double arithmetic elsewhere. Metas on both sides of those bounds, zero,
// subnormal, negative and non-finite ones, and two pairs whose double sum is rounded twice (a float
// FMA would give other bytes) must decode as the reference does.
namespace {
template <class F>
std::vector<std::pair<float, float>> asymmetric_metas(std::vector<std::pair<float, float>>& twice_rounded) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  twice_rounded.clear();
  // offset 2^-40 + 3 * 5592407 = 2^24 + 5 + 2^-40: the double sum drops 2^-40 and ties.
  twice_rounded.push_back({5592407.0f, 0x1p-40f});
  // 1 + 130 * 16519105 * 2^-55 = 1 + 2^-24 + 2^-54: likewise (8-bit codes only).
  if (F::qmax >= 130) twice_rounded.push_back({std::ldexp(16519105.0f, -55), 1.0f});
  std::vector<std::pair<float, float>> metas = twice_rounded;
  const float specials[] = {0.0f, -0.0f, 1e-45f, -3e-42f, 1.1754942e-38f, 1.0f, -7.5f, 3e38f, inf, -inf, nan};
  for (float s : specials)
    for (float o : specials) metas.push_back({s, o});
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> mant(0, (1u << 23) - 1);
  std::uniform_int_distribution<int> base(-140, 100);
  for (int d = -26; d <= 34; ++d)  // last-bit exponent of the offset minus the scale's
    for (int r = 0; r < 6; ++r) {
      const int es = base(rng);
      const float scale = std::ldexp(1.0f + static_cast<float>(mant(rng)) * 0x1p-23f, es);
      const float offset = std::ldexp(1.0f + static_cast<float>(mant(rng)) * 0x1p-23f, es + d);
      metas.push_back({(r & 1) ? -scale : scale, (r & 2) ? -offset : offset});
    }
  return metas;
}
}  // namespace

TEST_CASE_TEMPLATE("asymmetric integers decode like the reference on both sides of the FMA bounds", F,
                   Int8Asym<32>, Int4Asym<64>, Int8Asym<2048>) {
  using L = MessageLayout<F>;
  std::vector<std::pair<float, float>> twice_rounded;
  const auto metas = asymmetric_metas<F>(twice_rounded);
  for (const auto& p : twice_rounded) {  // the pairs are what they claim to be
    const typename F::Meta m = F::meta_from(p.first, p.second);
    const std::uint32_t c = F::qmax >= 130 && p.second == 1.0f ? 130 : 3;
    CHECK(std::fma(static_cast<float>(c), p.first, p.second) != F::decode(c, m));
  }
  const std::size_t nb = metas.size(), n = nb * F::block - 5;
  std::vector<unsigned char> msg(packed_bytes<F>(n), 0);
  const MessageHeader h = make_header<F>(n);
  std::memcpy(msg.data(), &h, sizeof h);
  std::mt19937 rng(11);
  for (std::size_t b = 0; b < nb; ++b) {
    F::store_meta(F::meta_from(metas[b].first, metas[b].second),
                  msg.data() + L::metas_offset(n) + b * F::meta_bytes);
    for (std::size_t e = 0; e < F::block && b * F::block + e < n; ++e) {
      // The counterexamples' codes first, then every code, then random ones.
      const std::uint32_t c = e < 2              ? (e == 0 ? 130u : 3u) % (F::qmax + 1u)
                              : e < F::qmax + 3u ? e - 2
                                                 : rng() % (F::qmax + 1u);
      ref_put_code<F>(msg.data() + L::codes_offset + b * L::block_code_bytes, e, c);
    }
  }
  CHECK(arbitrary_message_mismatches<F, float>(msg, n) == 0u);
  CHECK(arbitrary_message_mismatches<F, bfloat16>(msg, n) == 0u);
  CHECK(arbitrary_message_mismatches<F, half>(msg, n) == 0u);
#if QCOLL_HOST_AVX2_DISPATCH
  // The loop a processor without FMA runs: the double arithmetic for every block.
  if (host::detail::avx2::supported()) {
    const std::size_t full = n / F::block;
    std::vector<float> y(full * F::block);
    host::detail::avx2::decode_full_blocks<F, float, host::detail::avx2::Sink::store, false>(
        msg.data() + L::codes_offset, msg.data() + L::metas_offset(n), 0.0f, y.data(), full);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < y.size(); ++i) bad += !same(ref_decode<F>(msg.data(), n, i), y[i]);
    CHECK(bad == 0u);
  }
#endif
}

// The asymmetric integers encode from a float estimate of the double (x - offset) / scale and take
// the double arithmetic for any 8 elements with an estimate within 5 * 2^-15 of a rounding
// boundary. Blocks whose elements lie 0 to 2 units in the last place from the boundaries k + 1/2,
// over spans from 2^-120 to 2^120 (2^-12 to 2^12 for half), must encode as the portable loops do:
// every element so placed, or (every > 1) one in `every`, the others anywhere in [lo, hi], so that
// vectors of 8 near a boundary and vectors away from them share a group of 32.
template <class F, class T>
std::vector<T> near_ties(std::size_t blocks, unsigned seed, std::size_t every = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const int top = std::is_same<T, half>::value ? 12 : 120;  // half: spans within its range
  std::uniform_int_distribution<int> binade(-top, top), nudge(-2, 2), code(0, F::qmax - 1);
  std::vector<T> x(blocks * F::block);
  for (std::size_t b = 0; b < blocks; ++b) {
    const int e = binade(rng);
    const float lo = to_float(from_float<T>(std::ldexp(unit(rng), e)));
    float hi = to_float(from_float<T>(lo + std::ldexp(1.0f + unit(rng) * 0.5f, e)));
    if (!(hi > lo)) hi = lo;
    const float scale = static_cast<float>((static_cast<double>(hi) - lo) / F::qmax);
    T* xb = x.data() + b * F::block;
    xb[0] = from_float<T>(lo);
    xb[1] = from_float<T>(hi);
    for (std::size_t i = 2; i < F::block; ++i) {
      T v;
      if ((i + b) % every != 0) {  // anywhere in [lo, hi]
        const float u = (unit(rng) + 1.0f) * 0.5f;
        v = from_float<T>(static_cast<float>(lo + u * (static_cast<double>(hi) - lo)));
      } else {  // 0 to 2 units in the last place from k + 1/2
        v = from_float<T>(static_cast<float>(lo + (code(rng) + 0.5) * static_cast<double>(scale)));
        const int step = nudge(rng);
        if constexpr (sizeof(T) == 2) {
          std::uint16_t u16;
          std::memcpy(&u16, &v, 2);
          u16 = static_cast<std::uint16_t>(u16 + step);
          std::memcpy(&v, &u16, 2);
        } else {
          std::uint32_t u32;
          std::memcpy(&u32, &v, 4);
          u32 = static_cast<std::uint32_t>(static_cast<std::int64_t>(u32) + step);
          std::memcpy(&v, &u32, 4);
        }
      }
      const float f = to_float(v);
      xb[i] = from_float<T>(!(f >= lo) ? lo : f > hi ? hi : f);  // NaN (a nudged -0) too
    }
  }
  return x;
}

TEST_CASE_TEMPLATE("asymmetric integers encode values near rounding boundaries like the portable loops", F,
                   Int8Asym<32>, Int8Asym<2048>, Int4Asym<32>) {
  const std::size_t blocks = 65536 / F::block;
  CHECK(quantizes_like_portable<F>(near_ties<F, float>(blocks, 3)));
  CHECK(quantizes_like_portable<F>(near_ties<F, bfloat16>(blocks, 5)));
  CHECK(quantizes_like_portable<F>(near_ties<F, half>(blocks, 9)));
  CHECK(quantizes_like_portable<F>(near_ties<F, float>(blocks, 13, 11)));
  CHECK(quantizes_like_portable<F>(near_ties<F, bfloat16>(blocks, 15, 11)));
  CHECK(quantizes_like_portable<F>(near_ties<F, half>(blocks, 17, 11)));
}

#if QCOLL_HOST_AVX2_DISPATCH
// span_scale's four lanes for spans s[0, 4).
template <int Qmax>
QCOLL_AVX2 void span_scales(const double* s, float* out) {
  namespace A = host::detail::avx2;
  const A::f32x4 r = A::span_scale<Qmax>(A::f64x4{s[0], s[1], s[2], s[3]});
  std::memcpy(out, &r, sizeof r);
}

// The asymmetric integers' scale float(span / qmax) of the kernels (a product by the inverse, the
// division where that may round otherwise) against the division, for spans whose quotient is a
// float midpoint or within 6 units of double's last place of one, normal or subnormal (the product
// rounds to the other float for some hundreds of these), zero and random ones.
template <int Qmax>
std::size_t span_scale_mismatches() {
  std::mt19937_64 g(Qmax);
  std::vector<double> spans = {0.0, 0x1p-149, 0x1p-126, 0x1p-118, 3e-40, 0x1p128};
  for (int k = 0; k < 20000; ++k) {
    const int e = static_cast<int>(g() % 200) - 100;
    const double f = std::ldexp(static_cast<double>((1u << 23) | (g() & 0x7fffffu)), e - 23);
    const double t = (f + std::ldexp(1.0, e - 24)) * Qmax;  // Qmax times a float midpoint: exact
    int et = 0;
    std::frexp(t, &et);  // t in [2^(et - 1), 2^et): its last place is 2^(et - 53)
    for (int j = -6; j <= 6; ++j) spans.push_back(t + j * std::ldexp(1.0, et - 53));
    // and near a midpoint of two subnormal floats, an odd multiple of 2^-150
    const double ts = std::ldexp(static_cast<double>((g() % (1u << 23)) | 1u), -150) * Qmax;
    std::frexp(ts, &et);
    for (int j = -6; j <= 6; ++j) spans.push_back(ts + j * std::ldexp(1.0, et - 53));
    spans.push_back(std::ldexp(static_cast<double>(g() >> 11), -53 - static_cast<int>(g() % 180)));
  }
  while (spans.size() % 4) spans.push_back(1.0);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < spans.size(); i += 4) {
    float got[4];
    span_scales<Qmax>(spans.data() + i, got);
    for (int l = 0; l < 4; ++l) bad += fp::bits(got[l]) != fp::bits(static_cast<float>(spans[i + l] / Qmax));
  }
  return bad;
}

TEST_CASE("asymmetric integer scales: the kernels' product by 1 / qmax rounds as the division") {
  if (!host::detail::avx2::supported()) return;
  CHECK(span_scale_mismatches<255>() == 0u);
  CHECK(span_scale_mismatches<15>() == 0u);
}
#endif

// host::quantize reads x[0, n) only: elements after n (NaN and large values here, where a kernel
// that took the last partial block for a full one would see them) change nothing.
TEST_CASE_TEMPLATE("elements after n do not change the message", F, Int8<32>, Int4<2048>, Fp8E4M3<32>,
                   Int8Asym<32>, MxFp4, NvFp4) {
  for (std::size_t n : {F::block + 3, 5 * F::block - 1, 9 * F::block + F::block / 2}) {
    CAPTURE(n);
    std::vector<float> x = make_input<float>(Kind::gaussian, n, F::block, 29);
    const std::vector<float> exact = x;
    x.resize(n + F::block);
    for (std::size_t i = n; i < x.size(); ++i)
      x[i] = (i % 2) ? 3e38f : std::numeric_limits<float>::quiet_NaN();
    std::vector<unsigned char> want(packed_bytes<F>(n)), got(want.size());
    portable_quantize<F>(exact, want.data(), host::QuantizeOptions{});
    host::quantize<F>(x.data(), n, got.data(), got.size());
    CHECK(got == want);
  }
}
