#pragma once
//! \file
//! Block formats: compile-time facts and the per-block math shared by host and device.
//!
//! A format cuts a tensor into blocks of `block` elements and stores each block as `block` codes of
//! `code_bits` bits plus `meta_bytes` of per-block scale data. Every format type F provides:
//!
//! | member | meaning |
//! |---|---|
//! | `id` | FormatId, travels in message headers |
//! | `block` | elements per block |
//! | `code_bits` | bits per code (4, 6, 8, 16 or 32) |
//! | `meta_bytes` | stored scale bytes per block |
//! | `message_meta_bytes` | stored bytes per message (NVFP4's fp32 tensor scale), else 0 |
//! | `Meta` | a block's decoding (and encoding) parameters |
//! | `make_meta(stats, message_scale)` | Meta from a block's statistics |
//! | `store_meta` / `load_meta` | Meta to and from its stored bytes |
//! | `encode(x, meta)` / `encode_sr(x, meta, bits)` | one value to one code, nearest-even / stochastic |
//! | `decode(code, meta)` | one code to a float |
//!
//! `load_meta(store_meta(make_meta(...)))` decodes exactly as the Meta used for encoding did, so
//! the sender's and receivers' arithmetic are the same. All functions are QCOLL_HOST_DEVICE and use
//! only fp:: operations, so host and device agree bit for bit.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../core/fpmath.hpp"
#include "../core/half.hpp"
#include "../core/rng.hpp"
#include "minifloat.hpp"

QCOLL_NAMESPACE_BEGIN

//! Identifier of a block format; stored in every message header.
enum class FormatId : std::uint8_t {
  identity_f32 = 1,
  identity_f16 = 2,
  identity_bf16 = 3,
  int8 = 4,
  int4 = 5,
  int8_asym = 6,
  int4_asym = 7,
  fp8_e4m3 = 8,
  fp8_e5m2 = 9,
  mxfp8_e4m3 = 10,
  mxfp8_e5m2 = 11,
  mxfp6_e2m3 = 12,
  mxfp6_e3m2 = 13,
  mxfp4 = 14,
  mxint8 = 15,
  nvfp4 = 16,
};

//! Short, stable name of a format ("int8", "mxfp4", ...).
inline const char* format_name(FormatId id) {
  switch (id) {
    case FormatId::identity_f32: return "f32";
    case FormatId::identity_f16: return "f16";
    case FormatId::identity_bf16: return "bf16";
    case FormatId::int8: return "int8";
    case FormatId::int4: return "int4";
    case FormatId::int8_asym: return "int8a";
    case FormatId::int4_asym: return "int4a";
    case FormatId::fp8_e4m3: return "e4m3";
    case FormatId::fp8_e5m2: return "e5m2";
    case FormatId::mxfp8_e4m3: return "mxfp8e4";
    case FormatId::mxfp8_e5m2: return "mxfp8e5";
    case FormatId::mxfp6_e2m3: return "mxfp6e2";
    case FormatId::mxfp6_e3m2: return "mxfp6e3";
    case FormatId::mxfp4: return "mxfp4";
    case FormatId::mxint8: return "mxint8";
    case FormatId::nvfp4: return "nvfp4";
  }
  return "?";
}

//! How a value between two codes is rounded.
enum class Rounding : std::uint8_t {
  nearest = 0,     //!< to the nearest code, ties to even
  stochastic = 1,  //!< up with probability equal to the distance from the lower code (unbiased)
};

//! Statistics of one block's valid elements (tail lanes past the element count are excluded).
struct BlockStats {
  float absmax;    //!< largest |x| over finite elements (0 if none)
  float lo;        //!< smallest finite element (+Inf if none)
  float hi;        //!< largest finite element (-Inf if none)
  bool nonfinite;  //!< some element is NaN or ±Inf
};

//! Statistics of an empty block.
QCOLL_HOST_DEVICE BlockStats stats_empty() {
  return BlockStats{0.0f, fp::from_bits(0x7f800000u), fp::from_bits(0xff800000u), false};
}

//! Adds one value to a block's statistics.
QCOLL_HOST_DEVICE void stats_add(BlockStats& s, float x) {
  if (fp::is_finite(x)) {
    s.absmax = fp::max(s.absmax, fp::abs(x));
    s.lo = fp::min(s.lo, x);
    s.hi = fp::max(s.hi, x);
  } else {
    s.nonfinite = true;
  }
}

//! Combines the statistics of two parts of a block (order-independent, except that of a +0 and a
//! -0 extreme the first argument's is kept: merge parts in element order to match the host kernel).
QCOLL_HOST_DEVICE BlockStats stats_merge(const BlockStats& a, const BlockStats& b) {
  return BlockStats{fp::max(a.absmax, b.absmax), fp::min(a.lo, b.lo), fp::max(a.hi, b.hi),
                    a.nonfinite || b.nonfinite};
}

namespace detail {

//! True when n is a power of two between lo and hi.
constexpr bool pow2_in(std::size_t n, std::size_t lo, std::size_t hi) {
  return n >= lo && n <= hi && (n & (n - 1)) == 0;
}

//! Multiplier pair (pre, inv) with x * pre * inv ≈ x / scale for any finite scale > 0, including
//! subnormal scales whose reciprocal would overflow: then pre = 2^64 and inv = 1 / (scale * 2^64).
//! Both multiplications by pre are exact.
struct Reciprocal {
  float pre;
  float inv;
};

QCOLL_HOST_DEVICE Reciprocal reciprocal(float scale) {
  if (!(scale > 0.0f) || !fp::is_finite(scale)) return Reciprocal{1.0f, 0.0f};
  if (scale < 1.17549435e-38f) {                // subnormal: 1/scale would overflow
    const float big = 18446744073709551616.0f;  // 2^64
    return Reciprocal{big, fp::div(1.0f, fp::mul(scale, big))};
  }
  return Reciprocal{1.0f, fp::div(1.0f, scale)};
}

QCOLL_HOST_DEVICE float apply(const Reciprocal& r, float x) { return fp::mul(fp::mul(x, r.pre), r.inv); }

//! Clamps an integral float to [lo, hi]; NaN becomes lo (so the conversion to int is defined).
QCOLL_HOST_DEVICE float clamp_code(float c, float lo, float hi) {
  c = c > lo ? c : lo;
  return c < hi ? c : hi;
}

//! Stochastic rounding of y to an integer: floor(y) + (u < frac), u uniform in [0,1) on 2^-24
//! steps. E[result] = y up to 2^-24 of quantisation of the probability.
QCOLL_HOST_DEVICE float round_stochastic(float y, std::uint32_t random) {
  const float lo = fp::floor(y);
  const float frac = fp::sub(y, lo);  // exact for |y| < 2^23
  return random_unit(random) < frac ? fp::add(lo, 1.0f) : lo;
}

//! v * scale, kept finite when scale is finite: near the top of fp32, qmax * (absmax / qmax) can
//! round one ulp past FLT_MAX; that result saturates to ±FLT_MAX instead of becoming Inf. A NaN
//! scale (non-finite block) still gives NaN.
QCOLL_HOST_DEVICE float scale_value(float v, float scale) {
  const float r = fp::mul(v, scale);
  return fp::is_finite(r) || !fp::is_finite(scale) ? r
                                                   : fp::from_bits((fp::bits(r) & 0x80000000u) | 0x7f7fffffu);
}

QCOLL_HOST_DEVICE void store_f32(unsigned char* p, float v) {
  const std::uint32_t u = fp::bits(v);
  p[0] = static_cast<unsigned char>(u);
  p[1] = static_cast<unsigned char>(u >> 8);
  p[2] = static_cast<unsigned char>(u >> 16);
  p[3] = static_cast<unsigned char>(u >> 24);
}

QCOLL_HOST_DEVICE float load_f32(const unsigned char* p) {
  return fp::from_bits(static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
                       (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24));
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Symmetric integers
// ---------------------------------------------------------------------------------------------

//! Symmetric blockwise integer of `Bits` bits (8 or 4): codes in [-(2^(Bits-1)-1), 2^(Bits-1)-1],
//! one fp32 scale = absmax / qmax per block, so ±absmax is exactly representable (no clipping).
//! Block: any power of two from 32 to 8192 elements.
template <unsigned Bits, std::size_t Block>
struct SymmetricInt {
  static_assert(Bits == 8 || Bits == 4, "symmetric integers are 8 or 4 bits");
  static_assert(detail::pow2_in(Block, 32, 8192), "block must be a power of two in [32, 8192]");
  static constexpr FormatId id = Bits == 8 ? FormatId::int8 : FormatId::int4;
  static constexpr std::size_t block = Block;
  static constexpr unsigned code_bits = Bits;
  static constexpr std::size_t meta_bytes = 4;
  static constexpr std::size_t message_meta_bytes = 0;
  static constexpr int qmax = (1 << (Bits - 1)) - 1;
  using code_type = std::uint8_t;

  struct Meta {
    float scale;  //!< decode multiplier (NaN for a non-finite block)
    detail::Reciprocal rcp;
  };

  QCOLL_HOST_DEVICE static Meta meta_from_scale(float scale) {
    return Meta{scale, detail::reciprocal(scale)};
  }
  QCOLL_HOST_DEVICE static Meta make_meta(const BlockStats& s, float /*message_scale*/) {
    return meta_from_scale(s.nonfinite ? fp::nan() : fp::div(s.absmax, static_cast<float>(qmax)));
  }
  QCOLL_HOST_DEVICE static void store_meta(const Meta& m, unsigned char* p) { detail::store_f32(p, m.scale); }
  QCOLL_HOST_DEVICE static Meta load_meta(const unsigned char* p, float /*message_scale*/) {
    return meta_from_scale(detail::load_f32(p));
  }
  QCOLL_HOST_DEVICE static code_type to_code(float c) {
    const int v =
        static_cast<int>(detail::clamp_code(c, -static_cast<float>(qmax), static_cast<float>(qmax)));
    return static_cast<code_type>(static_cast<unsigned>(v) & ((1u << Bits) - 1u));
  }
  QCOLL_HOST_DEVICE static code_type encode(float x, const Meta& m) {
    // Clamping before rounding gives the same code as rounding first (qmax is an integer) and
    // keeps |c| < 2^22, where adding and subtracting 1.5 * 2^23 rounds to nearest even without a
    // branch, so the host loop vectorizes.
    const float c =
        detail::clamp_code(detail::apply(m.rcp, x), -static_cast<float>(qmax), static_cast<float>(qmax));
    const float r = fp::sub(fp::add(c, 12582912.0f), 12582912.0f);
    return static_cast<code_type>(static_cast<unsigned>(static_cast<int>(r)) & ((1u << Bits) - 1u));
  }
  QCOLL_HOST_DEVICE static code_type encode_sr(float x, const Meta& m, std::uint32_t random) {
    return to_code(detail::round_stochastic(detail::apply(m.rcp, x), random));
  }
  QCOLL_HOST_DEVICE static float decode(std::uint32_t code, const Meta& m) {
    const int shift = 32 - static_cast<int>(Bits);
    const int v = static_cast<int>(static_cast<std::uint32_t>(code) << shift) >> shift;  // sign-extend
    return detail::scale_value(static_cast<float>(v), m.scale);
  }
};

//! int8 symmetric, default block 256.
template <std::size_t Block = 256>
using Int8 = SymmetricInt<8, Block>;
//! int4 symmetric (two codes per byte, element 2k in the low nibble), default block 256.
template <std::size_t Block = 256>
using Int4 = SymmetricInt<4, Block>;

// ---------------------------------------------------------------------------------------------
// Asymmetric integers
// ---------------------------------------------------------------------------------------------

//! Asymmetric blockwise integer of `Bits` bits (8 or 4): unsigned codes in [0, 2^Bits - 1], one
//! fp32 scale = (hi - lo) / (2^Bits - 1) and one fp32 offset = lo per block; decode = lo + code *
//! scale. Statistics use valid elements only (tail lanes are masked, not zero-filled). The
//! arithmetic runs in double so blocks spanning nearly the whole fp32 range do not overflow.
template <unsigned Bits, std::size_t Block>
struct AsymmetricInt {
  static_assert(Bits == 8 || Bits == 4, "asymmetric integers are 8 or 4 bits");
  static_assert(detail::pow2_in(Block, 32, 8192), "block must be a power of two in [32, 8192]");
  static constexpr FormatId id = Bits == 8 ? FormatId::int8_asym : FormatId::int4_asym;
  static constexpr std::size_t block = Block;
  static constexpr unsigned code_bits = Bits;
  static constexpr std::size_t meta_bytes = 8;
  static constexpr std::size_t message_meta_bytes = 0;
  static constexpr int qmax = (1 << Bits) - 1;
  using code_type = std::uint8_t;

  struct Meta {
    float scale;   //!< step between codes (NaN for a non-finite block)
    float offset;  //!< value of code 0
    double inv;    //!< 1 / scale (0 when scale is 0)
  };

  QCOLL_HOST_DEVICE static Meta meta_from(float scale, float offset) {
    const double inv = scale > 0.0f ? fp::ddiv(1.0, static_cast<double>(scale)) : 0.0;
    return Meta{scale, offset, inv};
  }
  QCOLL_HOST_DEVICE static Meta make_meta(const BlockStats& s, float /*message_scale*/) {
    if (s.nonfinite) return meta_from(fp::nan(), fp::nan());
    if (!(s.hi >= s.lo)) return meta_from(0.0f, 0.0f);  // empty block
    const double span = fp::dsub(static_cast<double>(s.hi), static_cast<double>(s.lo));
    return meta_from(static_cast<float>(fp::ddiv(span, static_cast<double>(qmax))), s.lo);
  }
  QCOLL_HOST_DEVICE static void store_meta(const Meta& m, unsigned char* p) {
    detail::store_f32(p, m.scale);
    detail::store_f32(p + 4, m.offset);
  }
  QCOLL_HOST_DEVICE static Meta load_meta(const unsigned char* p, float /*message_scale*/) {
    return meta_from(detail::load_f32(p), detail::load_f32(p + 4));
  }
  QCOLL_HOST_DEVICE static double scaled(float x, const Meta& m) {
    return fp::dmul(fp::dsub(static_cast<double>(x), static_cast<double>(m.offset)), m.inv);
  }
  //! Clamps to [0, qmax]; NaN becomes 0.
  QCOLL_HOST_DEVICE static double clamp(double c) {
    c = c > 0.0 ? c : 0.0;
    return c < static_cast<double>(qmax) ? c : static_cast<double>(qmax);
  }
  QCOLL_HOST_DEVICE static code_type to_code(double c) {
    return static_cast<code_type>(static_cast<int>(clamp(c)));
  }
  QCOLL_HOST_DEVICE static code_type encode(float x, const Meta& m) {
    return to_code(fp::drint(scaled(x, m)));
  }
  QCOLL_HOST_DEVICE static code_type encode_sr(float x, const Meta& m, std::uint32_t random) {
    const double y = clamp(scaled(x, m));
    const double lo = static_cast<double>(static_cast<int>(y));  // floor, as y >= 0
    const double frac = fp::dsub(y, lo);
    return to_code(static_cast<double>(random_unit(random)) < frac ? fp::dadd(lo, 1.0) : lo);
  }
  QCOLL_HOST_DEVICE static float decode(std::uint32_t code, const Meta& m) {
    return static_cast<float>(fp::dadd(static_cast<double>(m.offset),
                                       fp::dmul(static_cast<double>(code), static_cast<double>(m.scale))));
  }
};

//! int8 asymmetric (scale + offset per block), default block 256.
template <std::size_t Block = 256>
using Int8Asym = AsymmetricInt<8, Block>;
//! int4 asymmetric (scale + offset per block), default block 256.
template <std::size_t Block = 256>
using Int4Asym = AsymmetricInt<4, Block>;

// ---------------------------------------------------------------------------------------------
// FP8 with an fp32 block scale
// ---------------------------------------------------------------------------------------------

//! OCP FP8 codes (E = minifloat::E4M3 or E5M2) with one fp32 scale = absmax / max_normal per
//! block; encoding saturates to ±max_normal and rounds to nearest even (or stochastically).
template <class E, std::size_t Block>
struct Fp8Scaled {
  static_assert(detail::pow2_in(Block, 32, 8192), "block must be a power of two in [32, 8192]");
  static constexpr FormatId id = E::ebits == 4 ? FormatId::fp8_e4m3 : FormatId::fp8_e5m2;
  static constexpr std::size_t block = Block;
  static constexpr unsigned code_bits = 8;
  static constexpr std::size_t meta_bytes = 4;
  static constexpr std::size_t message_meta_bytes = 0;
  using code_type = std::uint8_t;
  using Meta = typename SymmetricInt<8, Block>::Meta;

  QCOLL_HOST_DEVICE static Meta meta_from_scale(float scale) {
    return Meta{scale, detail::reciprocal(scale)};
  }
  QCOLL_HOST_DEVICE static Meta make_meta(const BlockStats& s, float /*message_scale*/) {
    return meta_from_scale(s.nonfinite ? fp::nan() : fp::div(s.absmax, E::max_normal));
  }
  QCOLL_HOST_DEVICE static void store_meta(const Meta& m, unsigned char* p) { detail::store_f32(p, m.scale); }
  QCOLL_HOST_DEVICE static Meta load_meta(const unsigned char* p, float /*message_scale*/) {
    return meta_from_scale(detail::load_f32(p));
  }
  QCOLL_HOST_DEVICE static code_type encode(float x, const Meta& m) {
    return minifloat::encode<E>(detail::apply(m.rcp, x));
  }
  QCOLL_HOST_DEVICE static code_type encode_sr(float x, const Meta& m, std::uint32_t random) {
    return minifloat::encode_stochastic<E>(detail::apply(m.rcp, x), random);
  }
  QCOLL_HOST_DEVICE static float decode(std::uint32_t code, const Meta& m) {
    return detail::scale_value(minifloat::decode<E>(static_cast<std::uint8_t>(code)), m.scale);
  }
};

//! FP8 E4M3 codes with an fp32 block scale, default block 256.
template <std::size_t Block = 256>
using Fp8E4M3 = Fp8Scaled<minifloat::E4M3, Block>;
//! FP8 E5M2 codes with an fp32 block scale, default block 256.
template <std::size_t Block = 256>
using Fp8E5M2 = Fp8Scaled<minifloat::E5M2, Block>;

// ---------------------------------------------------------------------------------------------
// OCP Microscaling (MX)
// ---------------------------------------------------------------------------------------------

namespace detail {
//! MX scale of a block: E8M0 exponent X = floor(log2(absmax)) - emax, clamped to [-127, 127];
//! the encode factor pair multiplies by 2^-X, the decode pair by 2^X (each as two exact steps).
struct MxMeta {
  std::uint8_t code;  //!< E8M0 bits: X + 127, 0xFF = NaN
  float enc_a, enc_b;
  float dec_a, dec_b;
};

QCOLL_HOST_DEVICE MxMeta mx_meta_from_code(std::uint8_t code) {
  if (code == 0xFF) return MxMeta{code, 0.0f, 0.0f, fp::nan(), 1.0f};
  const int x = static_cast<int>(code) - 127;
  // 2^-x and 2^x as products of two normal powers of two.
  const int e1 = -x / 2, e2 = -x - (-x / 2);
  const int d1 = x / 2, d2 = x - x / 2;
  return MxMeta{code, fp::exp2i(e1), fp::exp2i(e2), fp::exp2i(d1), fp::exp2i(d2)};
}

QCOLL_HOST_DEVICE MxMeta mx_make_meta(const BlockStats& s, int emax) {
  if (s.nonfinite) return mx_meta_from_code(0xFF);
  int x = s.absmax > 0.0f ? fp::ilog2(s.absmax) - emax : -127;
  x = x < -127 ? -127 : (x > 127 ? 127 : x);
  return mx_meta_from_code(static_cast<std::uint8_t>(x + 127));
}

QCOLL_HOST_DEVICE float mx_scale_in(const MxMeta& m, float x) {
  return fp::mul(fp::mul(x, m.enc_a), m.enc_b);
}
QCOLL_HOST_DEVICE float mx_scale_out(const MxMeta& m, float v) {
  return fp::mul(fp::mul(v, m.dec_a), m.dec_b);
}
}  // namespace detail

//! OCP MX format with a minifloat element type E (E4M3, E5M2, E2M3, E3M2 or E2M1): blocks of 32,
//! one E8M0 shared exponent per block, elements saturate to ±max_normal.
template <class E>
struct MxFloat {
  static constexpr FormatId id = E::bits == 4 ? FormatId::mxfp4
                                 : E::bits == 6
                                     ? (E::ebits == 2 ? FormatId::mxfp6_e2m3 : FormatId::mxfp6_e3m2)
                                     : (E::ebits == 4 ? FormatId::mxfp8_e4m3 : FormatId::mxfp8_e5m2);
  static constexpr std::size_t block = 32;
  static constexpr unsigned code_bits = E::bits;
  static constexpr std::size_t meta_bytes = 1;
  static constexpr std::size_t message_meta_bytes = 0;
  using code_type = std::uint8_t;
  using Meta = detail::MxMeta;

  QCOLL_HOST_DEVICE static Meta make_meta(const BlockStats& s, float /*message_scale*/) {
    return detail::mx_make_meta(s, E::emax);
  }
  QCOLL_HOST_DEVICE static void store_meta(const Meta& m, unsigned char* p) { p[0] = m.code; }
  QCOLL_HOST_DEVICE static Meta load_meta(const unsigned char* p, float /*message_scale*/) {
    return detail::mx_meta_from_code(p[0]);
  }
  QCOLL_HOST_DEVICE static code_type encode(float x, const Meta& m) {
    return minifloat::encode<E>(detail::mx_scale_in(m, x));
  }
  QCOLL_HOST_DEVICE static code_type encode_sr(float x, const Meta& m, std::uint32_t random) {
    return minifloat::encode_stochastic<E>(detail::mx_scale_in(m, x), random);
  }
  QCOLL_HOST_DEVICE static float decode(std::uint32_t code, const Meta& m) {
    return detail::mx_scale_out(m, minifloat::decode<E>(static_cast<std::uint8_t>(code)));
  }
};

using MxFp8E4M3 = MxFloat<minifloat::E4M3>;  //!< MXFP8 (E4M3 elements)
using MxFp8E5M2 = MxFloat<minifloat::E5M2>;  //!< MXFP8 (E5M2 elements)
using MxFp6E2M3 = MxFloat<minifloat::E2M3>;  //!< MXFP6 (E2M3 elements)
using MxFp6E3M2 = MxFloat<minifloat::E3M2>;  //!< MXFP6 (E3M2 elements)
using MxFp4 = MxFloat<minifloat::E2M1>;      //!< MXFP4 (E2M1 elements)

//! OCP MXINT8: blocks of 32, E8M0 shared exponent (emax 0), int8 elements with an implicit scale
//! of 2^-6. Codes are kept symmetric in [-127, 127].
struct MxInt8 {
  static constexpr FormatId id = FormatId::mxint8;
  static constexpr std::size_t block = 32;
  static constexpr unsigned code_bits = 8;
  static constexpr std::size_t meta_bytes = 1;
  static constexpr std::size_t message_meta_bytes = 0;
  using code_type = std::uint8_t;
  using Meta = detail::MxMeta;

  QCOLL_HOST_DEVICE static Meta make_meta(const BlockStats& s, float /*message_scale*/) {
    return detail::mx_make_meta(s, 0);
  }
  QCOLL_HOST_DEVICE static void store_meta(const Meta& m, unsigned char* p) { p[0] = m.code; }
  QCOLL_HOST_DEVICE static Meta load_meta(const unsigned char* p, float /*message_scale*/) {
    return detail::mx_meta_from_code(p[0]);
  }
  QCOLL_HOST_DEVICE static code_type to_code(float c) {
    return static_cast<code_type>(static_cast<int>(detail::clamp_code(c, -127.0f, 127.0f)));
  }
  QCOLL_HOST_DEVICE static code_type encode(float x, const Meta& m) {
    return to_code(fp::rint(fp::mul(detail::mx_scale_in(m, x), 64.0f)));
  }
  QCOLL_HOST_DEVICE static code_type encode_sr(float x, const Meta& m, std::uint32_t random) {
    return to_code(detail::round_stochastic(fp::mul(detail::mx_scale_in(m, x), 64.0f), random));
  }
  QCOLL_HOST_DEVICE static float decode(std::uint32_t code, const Meta& m) {
    const float v = static_cast<float>(static_cast<std::int8_t>(static_cast<std::uint8_t>(code)));
    return detail::mx_scale_out(m, fp::mul(v, 0.015625f));
  }
};

// ---------------------------------------------------------------------------------------------
// NVFP4
// ---------------------------------------------------------------------------------------------

//! NVFP4: blocks of 16 E2M1 codes, one E4M3 block scale, and one fp32 tensor scale per message
//! (message_scale = message absmax / (448 * 6)). Block scale = e4m3(absmax_block / (6 *
//! message_scale)). Decoded value = (e2m1 * block scale) * message scale, read left to right: the
//! first product is exact (at most 2 x 4 significant bits), so the value is the exact product of
//! the three factors rounded once to fp32 (then kept finite as detail::scale_value does).
//! Encoding divides by fl(block scale * message scale), which only chooses the code. Elements
//! saturate at ±6.
struct NvFp4 {
  static constexpr FormatId id = FormatId::nvfp4;
  static constexpr std::size_t block = 16;
  static constexpr unsigned code_bits = 4;
  static constexpr std::size_t meta_bytes = 1;
  static constexpr std::size_t message_meta_bytes = 4;
  using code_type = std::uint8_t;

  struct Meta {
    std::uint8_t code;    //!< E4M3 bits of the block scale (0x7F = NaN)
    float block_scale;    //!< the decoded E4M3 block scale
    float message_scale;  //!< the message's fp32 tensor scale
    float scale;          //!< fl(block scale * message scale), the encoding divisor
    detail::Reciprocal rcp;
  };

  //! The per-message fp32 scale from the message's absmax over finite values.
  QCOLL_HOST_DEVICE static float message_scale(float message_absmax) {
    return fp::div(message_absmax, 2688.0f);
  }
  QCOLL_HOST_DEVICE static Meta meta_from_code(std::uint8_t code, float message_scale) {
    const float b = minifloat::decode<minifloat::E4M3>(code);
    const float s = fp::mul(b, message_scale);
    return Meta{code, b, message_scale, s, detail::reciprocal(s)};
  }
  QCOLL_HOST_DEVICE static Meta make_meta(const BlockStats& s, float message_scale) {
    if (s.nonfinite) return meta_from_code(0x7F, message_scale);
    const float denom = fp::mul(6.0f, message_scale);
    const float target = denom > 0.0f ? fp::div(s.absmax, denom) : 0.0f;
    return meta_from_code(minifloat::encode<minifloat::E4M3>(target), message_scale);
  }
  QCOLL_HOST_DEVICE static void store_meta(const Meta& m, unsigned char* p) { p[0] = m.code; }
  QCOLL_HOST_DEVICE static Meta load_meta(const unsigned char* p, float message_scale) {
    return meta_from_code(p[0], message_scale);
  }
  QCOLL_HOST_DEVICE static code_type encode(float x, const Meta& m) {
    return minifloat::encode<minifloat::E2M1>(detail::apply(m.rcp, x));
  }
  QCOLL_HOST_DEVICE static code_type encode_sr(float x, const Meta& m, std::uint32_t random) {
    return minifloat::encode_stochastic<minifloat::E2M1>(detail::apply(m.rcp, x), random);
  }
  QCOLL_HOST_DEVICE static float decode(std::uint32_t code, const Meta& m) {
    const float e = minifloat::decode<minifloat::E2M1>(static_cast<std::uint8_t>(code));
    const float p = fp::mul(e, m.block_scale);  // exact; NaN for a NaN block scale
    return fp::is_finite(p) ? detail::scale_value(p, m.message_scale) : p;
  }
};

// ---------------------------------------------------------------------------------------------
// Identity
// ---------------------------------------------------------------------------------------------

//! The unquantized baseline: each element travels as a W (float, half or bfloat16) as is. Block
//! size only sets the layout granule; there is no scale. Rounding to W is always nearest-even; a
//! finite float beyond W's range becomes ±Inf (no saturation) and, like a NaN/Inf input, sets
//! kFlagNonFinite in the message header (see block_nonfinite).
template <class W, std::size_t Block = 32>
struct Identity {
  static_assert(detail::pow2_in(Block, 1, 8192), "block must be a power of two in [1, 8192]");
  static constexpr FormatId id = dtype_of<W>::value == DType::f32   ? FormatId::identity_f32
                                 : dtype_of<W>::value == DType::f16 ? FormatId::identity_f16
                                                                    : FormatId::identity_bf16;
  static constexpr std::size_t block = Block;
  static constexpr unsigned code_bits = 8 * sizeof(W);
  static constexpr std::size_t meta_bytes = 0;
  static constexpr std::size_t message_meta_bytes = 0;
  using code_type = typename std::conditional<sizeof(W) == 4, std::uint32_t, std::uint16_t>::type;
  struct Meta {};

  QCOLL_HOST_DEVICE static Meta make_meta(const BlockStats&, float) { return Meta{}; }
  QCOLL_HOST_DEVICE static void store_meta(const Meta&, unsigned char*) {}
  QCOLL_HOST_DEVICE static Meta load_meta(const unsigned char*, float) { return Meta{}; }
  QCOLL_HOST_DEVICE static code_type encode(float x, const Meta&) {
    if constexpr (sizeof(W) == 4) {
      return fp::bits(x);
    } else {
      return from_float<W>(x).bits;
    }
  }
  QCOLL_HOST_DEVICE static code_type encode_sr(float x, const Meta& m, std::uint32_t) { return encode(x, m); }
  QCOLL_HOST_DEVICE static float decode(std::uint32_t code, const Meta&) {
    if constexpr (sizeof(W) == 4) {
      return fp::from_bits(code);
    } else {
      return to_float(W{static_cast<std::uint16_t>(code)});
    }
  }
  //! True when `code` is ±Inf or a NaN of W (as the code of a NaN/Inf input, or of a finite input
  //! that overflowed W).
  QCOLL_HOST_DEVICE static bool code_nonfinite(std::uint32_t code) {
    if constexpr (sizeof(W) == 4) {
      return (code & 0x7fffffffu) >= 0x7f800000u;
    } else if constexpr (dtype_of<W>::value == DType::f16) {
      return (code & 0x7fffu) >= 0x7c00u;
    } else {
      return (code & 0x7fffu) >= 0x7f80u;
    }
  }
};

//! True for the Identity formats.
template <class F>
struct is_identity_format : std::false_type {};
template <class W, std::size_t Block>
struct is_identity_format<Identity<W, Block>> : std::true_type {};

//! Whether a block with statistics `s` sets kFlagNonFinite: it held NaN or ±Inf, or (Identity of
//! half or bfloat16) some finite element rounds to ±Inf in the 16-bit type. Rounding is monotone,
//! so that happens exactly when s.absmax does. Host and device kernels use this rule. O(1).
template <class F>
QCOLL_HOST_DEVICE bool block_nonfinite(const BlockStats& s) {
  if constexpr (is_identity_format<F>::value) {
    return s.nonfinite || F::code_nonfinite(F::encode(s.absmax, typename F::Meta{}));
  } else {
    return s.nonfinite;
  }
}

//! True when F's decode depends on a per-message scale (NVFP4).
template <class F>
constexpr bool has_message_scale = F::message_meta_bytes != 0;

QCOLL_NAMESPACE_END
