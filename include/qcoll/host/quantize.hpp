#pragma once
//! \file
//! Host (CPU) kernels: quantize, dequantize and dequantize-accumulate packed messages.
//!
//! Single-threaded loops over the per-block math of format/format.hpp, written so the compiler
//! vectorizes them. They are the oracle of the device kernels: same inputs, same bits.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../core/error.hpp"
#include "../format/message.hpp"

#if !defined(QCOLL_HOST_AVX2_DISPATCH)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__) && !defined(__CUDACC__)
//! 1: host quantizers pick an AVX2 build of their loops at run time (define to 0 to turn off).
#define QCOLL_HOST_AVX2_DISPATCH 1
#else
#define QCOLL_HOST_AVX2_DISPATCH 0
#endif
#endif

QCOLL_NAMESPACE_BEGIN
namespace host {

//! Rounding and stochastic-rounding key of a quantization.
struct QuantizeOptions {
  Rounding rounding = Rounding::nearest;  //!< nearest-even or stochastic
  std::uint64_t seed = 0;                 //!< stochastic rounding key
  std::uint64_t index_base = 0;           //!< index of element 0 in the random stream (for slices)
};

namespace detail {

//! Packs one block of codes into F::block * F::code_bits / 8 bytes (little-endian bit order:
//! element 2k of a 4-bit format in the low nibble; 6-bit codes as a little-endian bit stream).
template <class F>
inline void pack_block(const typename F::code_type* c, unsigned char* out) {
  constexpr unsigned bits = F::code_bits;
  if constexpr (bits == 8) {
    std::memcpy(out, c, F::block);
  } else if constexpr (bits == 4) {
    for (std::size_t k = 0; k < F::block / 2; ++k)
      out[k] = static_cast<unsigned char>((c[2 * k] & 0xFu) | ((c[2 * k + 1] & 0xFu) << 4));
  } else if constexpr (bits == 6) {
    for (std::size_t k = 0; k < F::block / 4; ++k) {
      const std::uint32_t w = (c[4 * k] & 0x3Fu) | ((c[4 * k + 1] & 0x3Fu) << 6) |
                              ((c[4 * k + 2] & 0x3Fu) << 12) | ((c[4 * k + 3] & 0x3Fu) << 18);
      out[3 * k] = static_cast<unsigned char>(w);
      out[3 * k + 1] = static_cast<unsigned char>(w >> 8);
      out[3 * k + 2] = static_cast<unsigned char>(w >> 16);
    }
  } else {
    std::memcpy(out, c, F::block * sizeof(typename F::code_type));  // 16/32-bit, little-endian host
  }
}

//! Inverse of pack_block.
template <class F>
inline void unpack_block(const unsigned char* in, typename F::code_type* c) {
  constexpr unsigned bits = F::code_bits;
  if constexpr (bits == 8) {
    std::memcpy(c, in, F::block);
  } else if constexpr (bits == 4) {
    for (std::size_t k = 0; k < F::block / 2; ++k) {
      c[2 * k] = static_cast<std::uint8_t>(in[k] & 0xFu);
      c[2 * k + 1] = static_cast<std::uint8_t>(in[k] >> 4);
    }
  } else if constexpr (bits == 6) {
    for (std::size_t k = 0; k < F::block / 4; ++k) {
      const std::uint32_t w = static_cast<std::uint32_t>(in[3 * k]) |
                              (static_cast<std::uint32_t>(in[3 * k + 1]) << 8) |
                              (static_cast<std::uint32_t>(in[3 * k + 2]) << 16);
      c[4 * k] = static_cast<std::uint8_t>(w & 0x3Fu);
      c[4 * k + 1] = static_cast<std::uint8_t>((w >> 6) & 0x3Fu);
      c[4 * k + 2] = static_cast<std::uint8_t>((w >> 12) & 0x3Fu);
      c[4 * k + 3] = static_cast<std::uint8_t>((w >> 18) & 0x3Fu);
    }
  } else {
    std::memcpy(c, in, F::block * sizeof(typename F::code_type));
  }
}

//! Order key of a float's bits: for floats a < b (not NaN), order_key(a) < order_key(b) as signed
//! integers, with -0 just below +0. It maps the sign-magnitude bits onto two's complement by
//! flipping the magnitude bits of negative values, so applying it twice gives the bits back.
inline std::int32_t order_key(std::uint32_t u) {
  return static_cast<std::int32_t>(u ^ ((0u - (u >> 31)) >> 1));
}

//! Inverse of order_key.
inline std::uint32_t order_bits(std::int32_t k) {
  const auto u = static_cast<std::uint32_t>(k);
  return u ^ ((0u - (u >> 31)) >> 1);
}

//! Statistics of x[0, valid) in element order: NaN and ±Inf are left out of absmax, lo and hi
//! and set nonfinite; of equal extremes the first in element order is kept (so a zero lo or hi
//! carries the sign of the block's first zero). The reference for block_stats.
template <class T>
inline BlockStats block_stats_sequential(const T* x, std::size_t valid) {
  BlockStats s = stats_empty();
  float amax = 0.0f, lo = s.lo, hi = s.hi;
  bool bad = false;
  for (std::size_t i = 0; i < valid; ++i) {
    const float v = to_float(x[i]);
    const bool fin = fp::is_finite(v);
    bad |= !fin;
    const float a = fin ? fp::abs(v) : 0.0f;
    amax = amax > a ? amax : a;
    lo = (fin && v < lo) ? v : lo;
    hi = (fin && v > hi) ? v : hi;
  }
  return BlockStats{amax, lo, hi, bad};
}

//! The 16-bit analogues of order_key / order_bits (for the bit patterns of half and bfloat16).
inline std::int16_t order_key16(std::uint16_t u) {
  return static_cast<std::int16_t>(u ^ static_cast<std::uint16_t>((0u - (u >> 15)) & 0x7fffu));
}
inline std::uint16_t order_bits16(std::int16_t k) {
  const auto u = static_cast<std::uint16_t>(k);
  return static_cast<std::uint16_t>(u ^ ((0u - (u >> 15)) & 0x7fffu));
}

//! If a zero is the block's lo or hi, gives it the sign of the first zero in element order.
template <class T>
inline void stats_zero_sign(const T* x, std::size_t valid, BlockStats& s) {
  if (!(s.lo == 0.0f || s.hi == 0.0f)) return;
  for (std::size_t i = 0; i < valid; ++i) {
    const float v = to_float(x[i]);
    if (v == 0.0f) {
      s.lo = s.lo == 0.0f ? v : s.lo;
      s.hi = s.hi == 0.0f ? v : s.hi;
      return;
    }
  }
}

//! Statistics of x[0, valid); equal to block_stats_sequential. The loop keeps three integer
//! reductions (largest |x| bits, smallest and largest order key) that the compiler vectorizes, and
//! that the caller's optimiser drops when its make_meta reads absmax only; 16-bit inputs are
//! reduced on their own bit patterns (conversion to float is exact and monotone, so it commutes
//! with max and min). The rare cases redo the work: a block holding NaN/Inf goes through
//! block_stats_sequential, and a zero lo or hi takes the sign of the first zero. O(valid).
template <class T>
inline BlockStats block_stats(const T* x, std::size_t valid) {
  BlockStats s;
  if constexpr (sizeof(T) == 2) {
    // |x| patterns at or above this one are Inf or NaN
    constexpr std::int16_t inf = std::is_same<T, half>::value ? 0x7c00 : 0x7f80;
    std::int16_t amax = 0;
    std::int16_t klo = order_key16(static_cast<std::uint16_t>(inf));
    std::int16_t khi = order_key16(static_cast<std::uint16_t>(0x8000 | inf));
    for (std::size_t i = 0; i < valid; ++i) {
      const std::uint16_t u = x[i].bits;
      const auto a = static_cast<std::int16_t>(u & 0x7fffu);
      const std::int16_t k = order_key16(u);
      amax = a > amax ? a : amax;
      klo = k < klo ? k : klo;
      khi = k > khi ? k : khi;
    }
    if (amax >= inf) return block_stats_sequential(x, valid);
    s = BlockStats{to_float(T{static_cast<std::uint16_t>(amax)}), to_float(T{order_bits16(klo)}),
                   to_float(T{order_bits16(khi)}), false};
  } else {
    std::uint32_t umax = 0;
    std::int32_t klo = order_key(0x7f800000u), khi = order_key(0xff800000u);
    for (std::size_t i = 0; i < valid; ++i) {
      const std::uint32_t u = fp::bits(to_float(x[i]));
      const std::uint32_t a = u & 0x7fffffffu;
      const std::int32_t k = order_key(u);
      umax = a > umax ? a : umax;
      klo = k < klo ? k : klo;
      khi = k > khi ? k : khi;
    }
    if (umax >= 0x7f800000u) return block_stats_sequential(x, valid);
    s = BlockStats{fp::from_bits(umax), fp::from_bits(order_bits(klo)), fp::from_bits(order_bits(khi)),
                   false};
  }
  stats_zero_sign(x, valid, s);
  return s;
}

//! Encodes x[0, valid) as one block (valid <= F::block; lanes past valid get code 0 and are not
//! part of the statistics), writes its codes and meta bytes, and returns whether it is
//! non-finite on the wire (block_nonfinite: a NaN/Inf input, or an Identity<half/bfloat16>
//! overflow). `index0` is the random-stream index of x[0]. Full blocks run loops of
//! compile-time length (statistics, then codes into a local array, then packing), which the
//! compiler unrolls and vectorizes where the format's arithmetic allows.
template <class F, class T>
inline bool encode_block(const T* x, std::size_t valid, float message_scale, const QuantizeOptions& opt,
                         std::uint64_t index0, unsigned char* codes, unsigned char* meta) {
  const bool full = valid == F::block;
  const BlockStats s = full ? block_stats(x, F::block) : block_stats(x, valid);
  const typename F::Meta m = F::make_meta(s, message_scale);
  F::store_meta(m, meta);
  alignas(64) typename F::code_type c[F::block];
  if (opt.rounding == Rounding::nearest) {
    if (full) {
      for (std::size_t i = 0; i < F::block; ++i) c[i] = F::encode(to_float(x[i]), m);
    } else {
      for (std::size_t i = 0; i < valid; ++i) c[i] = F::encode(to_float(x[i]), m);
    }
  } else {
    for (std::size_t i = 0; i < valid; ++i)
      c[i] = F::encode_sr(to_float(x[i]), m, random_bits(opt.seed, index0 + i));
  }
  for (std::size_t i = valid; i < F::block; ++i) c[i] = 0;
  pack_block<F>(c, codes);
  return block_nonfinite<F>(s);
}

//! Decodes the first `valid` values of one block and hands each to sink(i, value).
template <class F, class Sink>
inline void decode_block(const unsigned char* codes, const unsigned char* meta, float message_scale,
                         std::size_t valid, Sink&& sink) {
  const typename F::Meta m = F::load_meta(meta, message_scale);
  alignas(64) typename F::code_type c[F::block];
  unpack_block<F>(codes, c);
  if (valid == F::block) {
    for (std::size_t i = 0; i < F::block; ++i) sink(i, F::decode(c[i], m));
  } else {
    for (std::size_t i = 0; i < valid; ++i) sink(i, F::decode(c[i], m));
  }
}

//! Where block b of a message reads its input from: `ptr` (element 0 of the block) and how many
//! elements are valid (the rest of the block is padding).
template <class T>
struct BlockSource {
  const T* ptr;
  std::size_t valid;
};

//! Message absmax over finite values, for formats with a per-message scale.
template <class F, class T, class Source>
inline float message_absmax(std::size_t nblocks, Source&& src) {
  float amax = 0.0f;
  for (std::size_t b = 0; b < nblocks; ++b) {
    const BlockSource<T> s = src(b);
    const float a =
        s.valid == F::block ? block_stats(s.ptr, F::block).absmax : block_stats(s.ptr, s.valid).absmax;
    amax = fp::max(amax, a);
  }
  return amax;
}

//! Writes a message of n elements whose block b reads from src(b) (a BlockSource<T>). The caller
//! has checked `out` (packed_bytes<F>(n) bytes). Returns the header flags. O(n).
template <class F, class T, class Source>
inline std::uint32_t quantize_blocks_impl(std::size_t n, Source&& src, void* out,
                                          const QuantizeOptions& opt) {
  using L = MessageLayout<F>;
  auto* base = static_cast<unsigned char*>(out);
  const std::size_t nb = L::blocks(n);
  // Zero the bytes no block writes (message meta padding, code and meta padding); the blocks write
  // all of their codes and meta bytes, the header comes last.
  const std::size_t codes_end = L::codes_offset + nb * L::block_code_bytes;
  const std::size_t metas_end = L::metas_offset(n) + nb * F::meta_bytes;
  std::memset(base + sizeof(MessageHeader), 0, L::codes_offset - sizeof(MessageHeader));
  std::memset(base + codes_end, 0, L::metas_offset(n) - codes_end);
  std::memset(base + metas_end, 0, L::bytes(n) - metas_end);
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) {
    mscale = F::message_scale(message_absmax<F, T>(nb, src));
    ::qcoll::detail::store_f32(base + L::message_meta_offset, mscale);
  }
  bool bad = false;
  for (std::size_t b = 0; b < nb; ++b) {
    const BlockSource<T> s = src(b);
    bad |= encode_block<F>(s.ptr, s.valid, mscale, opt, opt.index_base + b * F::block,
                           base + L::codes_offset + b * L::block_code_bytes,
                           base + L::metas_offset(n) + b * F::meta_bytes);
  }
  MessageHeader h = make_header<F>(n);
  h.flags = bad ? kFlagNonFinite : 0u;
  std::memcpy(base, &h, sizeof h);
  return h.flags;
}

#if QCOLL_HOST_AVX2_DISPATCH
//! quantize_blocks_impl compiled for AVX2 (everything inlined into it, so the loops vectorize 8
//! wide). Same IEEE operations, no FMA: the same bytes as the baseline build.
template <class F, class T, class Source>
__attribute__((target("avx2"), flatten)) std::uint32_t quantize_blocks_avx2(std::size_t n, Source&& src,
                                                                            void* out,
                                                                            const QuantizeOptions& opt) {
  return quantize_blocks_impl<F, T>(n, src, out, opt);
}
#endif

//! Writes a message of n elements whose block b reads from src(b) (a BlockSource<T>). The caller
//! has checked `out` (packed_bytes<F>(n) bytes). Returns the header flags. O(n). On x86-64 builds
//! without -mavx2 it runs an AVX2 build of the same code when the processor has AVX2.
template <class F, class T, class Source>
inline std::uint32_t quantize_blocks(std::size_t n, Source&& src, void* out, const QuantizeOptions& opt) {
#if QCOLL_HOST_AVX2_DISPATCH
  if (__builtin_cpu_supports("avx2")) return quantize_blocks_avx2<F, T>(n, src, out, opt);
#endif
  return quantize_blocks_impl<F, T>(n, src, out, opt);
}

//! Formats whose codes are minifloats (FP8, MX floats, NVFP4): their decode is bit manipulation
//! with selects that the host compiler does not vectorize, so table look-ups pay off.
template <class F>
struct minifloat_codes : std::false_type {};
template <class E, std::size_t Block>
struct minifloat_codes<Fp8Scaled<E, Block>> : std::true_type {};
template <class E>
struct minifloat_codes<MxFloat<E>> : std::true_type {};
template <>
struct minifloat_codes<NvFp4> : std::true_type {};

//! Whether decoding F into values of type V (float, or the output type of dequantize) looks
//! values up in tables built with F::decode instead of calling F::decode per element. The result
//! is the same either way (F::decode is a function of the code, the meta bytes and the message
//! scale); tables win when F::decode does not vectorize (minifloat codes) or the rounding to a
//! 16-bit V dominates, provided tables are rarely rebuilt: a 1-byte meta (MX, NVFP4) keeps up to
//! 16 tables keyed by the meta byte, other formats rebuild one table per block, which pays for
//! blocks of at least 4x the number of codes.
template <class F, class V>
constexpr bool use_decode_table() {
  if constexpr (F::code_bits > 8 || F::meta_bytes == 0) {
    return false;
  } else {
    constexpr std::size_t codes = std::size_t{1} << F::code_bits;
    constexpr bool rare_rebuilds = F::meta_bytes == 1 || F::block >= 4 * codes;
    return rare_rebuilds && (minifloat_codes<F>::value || sizeof(V) == 2);
  }
}

//! Decoded values of every code of F for recently seen meta bytes: a direct-mapped cache of 16
//! tables keyed by the meta byte for 1-byte metas, otherwise one table for the last meta seen.
template <class F, class V>
class DecodeTables {
 public:
  static constexpr std::size_t codes = std::size_t{1} << F::code_bits;
  static constexpr std::size_t slots = F::meta_bytes == 1 ? 16 : 1;

  //! The table of the block whose meta bytes are at `meta`: entry c = convert(F::decode(c, meta)).
  template <class Convert>
  const V* get(const unsigned char* meta, float message_scale, Convert&& convert) {
    const std::size_t s = slots == 1 ? 0 : (meta[0] & (slots - 1));
    if (!filled_[s] || std::memcmp(key_[s], meta, F::meta_bytes) != 0) {
      const typename F::Meta m = F::load_meta(meta, message_scale);
      for (std::size_t c = 0; c < codes; ++c)
        table_[s][c] = convert(F::decode(static_cast<std::uint32_t>(c), m));
      std::memcpy(key_[s], meta, F::meta_bytes);
      filled_[s] = true;
    }
    return table_[s];
  }

 private:
  alignas(64) V table_[slots][codes];
  unsigned char key_[slots][F::meta_bytes];
  bool filled_[slots] = {};
};

//! Decodes values [0, limit) of a checked message of n elements as V: value i is handed to
//! store(i, convert(F::decode(code i, meta))), through decode tables when use_decode_table<F, V>.
template <class F, class V, class Convert, class Store>
inline void decode_message_as_impl(const void* msg, std::size_t n, std::size_t limit, Convert&& convert,
                                   Store&& store) {
  using L = MessageLayout<F>;
  const auto* base = static_cast<const unsigned char*>(msg);
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) mscale = ::qcoll::detail::load_f32(base + L::message_meta_offset);
  const std::size_t nb = L::blocks(limit);
  if constexpr (use_decode_table<F, V>()) {
    DecodeTables<F, V> tables;
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t first = b * F::block;
      const std::size_t valid = limit - first < F::block ? limit - first : F::block;
      const V* t = tables.get(base + L::metas_offset(n) + b * F::meta_bytes, mscale, convert);
      const unsigned char* codes = base + L::codes_offset + b * L::block_code_bytes;
      // Short 4-bit blocks: two look-ups per byte. Otherwise unpack (vectorized), then look up.
      if constexpr (F::code_bits == 4 && F::block <= 16) {
        for (std::size_t k = 0; k < valid / 2; ++k) {
          store(first + 2 * k, t[codes[k] & 0xFu]);
          store(first + 2 * k + 1, t[codes[k] >> 4]);
        }
        if (valid % 2 != 0) store(first + valid - 1, t[codes[valid / 2] & 0xFu]);
      } else {
        alignas(64) typename F::code_type c[F::block];
        unpack_block<F>(codes, c);
        if (valid == F::block) {
          for (std::size_t i = 0; i < F::block; ++i) store(first + i, t[c[i]]);
        } else {
          for (std::size_t i = 0; i < valid; ++i) store(first + i, t[c[i]]);
        }
      }
    }
  } else if constexpr (std::is_same<V, float>::value || F::code_bits > 8) {
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t first = b * F::block;
      const std::size_t valid = limit - first < F::block ? limit - first : F::block;
      decode_block<F>(base + L::codes_offset + b * L::block_code_bytes,
                      base + L::metas_offset(n) + b * F::meta_bytes, mscale, valid,
                      [&](std::size_t i, float v) { store(first + i, convert(v)); });
    }
  } else {
    // Quantized codes to a 16-bit V: decode a block to float, then convert it in a loop of its
    // own, so the conversion's rounding branches become vector selects even where the decode
    // itself stays scalar.
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t first = b * F::block;
      const std::size_t valid = limit - first < F::block ? limit - first : F::block;
      alignas(64) float v[F::block];
      decode_block<F>(base + L::codes_offset + b * L::block_code_bytes,
                      base + L::metas_offset(n) + b * F::meta_bytes, mscale, valid,
                      [&](std::size_t i, float x) { v[i] = x; });
      if (valid == F::block) {
        for (std::size_t i = 0; i < F::block; ++i) store(first + i, convert(v[i]));
      } else {
        for (std::size_t i = 0; i < valid; ++i) store(first + i, convert(v[i]));
      }
    }
  }
}

#if QCOLL_HOST_AVX2_DISPATCH
//! decode_message_as_impl compiled for AVX2 (see quantize_blocks_avx2).
template <class F, class V, class Convert, class Store>
__attribute__((target("avx2"), flatten)) void decode_message_as_avx2(const void* msg, std::size_t n,
                                                                     std::size_t limit, Convert&& convert,
                                                                     Store&& store) {
  decode_message_as_impl<F, V>(msg, n, limit, convert, store);
}
#endif

//! Decodes values [0, limit) of a checked message of n elements as V: value i is handed to
//! store(i, convert(F::decode(code i, meta))). Runs an AVX2 build where the processor has it.
template <class F, class V, class Convert, class Store>
inline void decode_message_as(const void* msg, std::size_t n, std::size_t limit, Convert&& convert,
                              Store&& store) {
#if QCOLL_HOST_AVX2_DISPATCH
  if (__builtin_cpu_supports("avx2")) return decode_message_as_avx2<F, V>(msg, n, limit, convert, store);
#endif
  decode_message_as_impl<F, V>(msg, n, limit, convert, store);
}

//! Decodes values [0, limit) of a checked message of n elements (limit <= n), handing value i to
//! sink(i, value).
template <class F, class Sink>
inline void decode_message(const void* msg, std::size_t n, Sink&& sink, std::size_t limit) {
  decode_message_as<F, float>(
      msg, n, limit, [](float v) { return v; }, sink);
}

//! Reads and checks a message header.
template <class F>
inline MessageHeader read_header(const void* msg, std::size_t n, const char* function, const char* what) {
  MessageHeader h;
  std::memcpy(&h, msg, sizeof h);
  check_header<F>(h, n, function, what);
  return h;
}

}  // namespace detail

//! Quantizes in[0, n) into one packed message at `out` (out_bytes >= packed_bytes<F>(n)).
//! Returns the bytes written (packed_bytes<F>(n)). Blocks holding NaN/Inf get a NaN scale and set
//! kFlagNonFinite in the header (so does an Identity<half/bfloat16> overflow). Throws
//! qcoll::Error, writing nothing, if n > max_count<F>(), in is null with n > 0 or not aligned to
//! alignof(T), out is null or out_bytes is too small. `out` needs no alignment. O(n) time, no
//! allocation.
template <class F, class T>
std::size_t quantize(const T* in, std::size_t n, void* out, std::size_t out_bytes,
                     const QuantizeOptions& opt = {}) {
  const std::size_t need = checked_packed_bytes<F>(n, "host::quantize", "n");
  QCOLL_REQUIRE(in != nullptr || n == 0, "host::quantize", "in", "null", "with n =", n);
  check_aligned("host::quantize", "in", in, alignof(T));
  QCOLL_REQUIRE(out != nullptr, "host::quantize", "out", "null", "needs", need << " bytes");
  QCOLL_REQUIRE(out_bytes >= need, "host::quantize", "out_bytes", out_bytes, "is below the required", need);
  detail::quantize_blocks<F, T>(
      n,
      [&](std::size_t b) {
        const std::size_t first = b * F::block;
        return detail::BlockSource<T>{in + first, n - first < F::block ? n - first : F::block};
      },
      out, opt);
  return need;
}

//! Decodes a message of n elements into out[0, n) (rounded to T, nearest-even). Returns the
//! header flags (kFlagNonFinite if any block was non-finite). Throws qcoll::Error, writing
//! nothing, if n > max_count<F>(), a pointer is null, out is not aligned to alignof(T),
//! msg_bytes < packed_bytes<F>(n), or the header is not F's with n elements. Reads only
//! msg[0, packed_bytes<F>(n)), whatever the message holds; `msg` needs no alignment. O(n).
template <class F, class T>
std::uint32_t dequantize(const void* msg, std::size_t msg_bytes, T* out, std::size_t n) {
  const std::size_t need = checked_packed_bytes<F>(n, "host::dequantize", "n");
  QCOLL_REQUIRE(msg != nullptr, "host::dequantize", "msg", "null", "needs", need << " bytes");
  QCOLL_REQUIRE(msg_bytes >= need, "host::dequantize", "msg_bytes", msg_bytes, "is below the required", need);
  QCOLL_REQUIRE(out != nullptr || n == 0, "host::dequantize", "out", "null", "with n =", n);
  check_aligned("host::dequantize", "out", out, alignof(T));
  const MessageHeader h = detail::read_header<F>(msg, n, "host::dequantize", "msg");
  detail::decode_message_as<F, T>(
      msg, n, n, [](float v) { return from_float<T>(v); }, [out](std::size_t i, T v) { out[i] = v; });
  return h.flags;
}

//! acc[i] += decoded value i, in fp32 (one rounding per element), for i in [0, n). The building
//! block of reductions: summing several messages in a fixed order is deterministic. Same checks
//! and return value as dequantize. O(n).
template <class F>
std::uint32_t dequantize_accumulate(const void* msg, std::size_t msg_bytes, float* acc, std::size_t n) {
  const std::size_t need = checked_packed_bytes<F>(n, "host::dequantize_accumulate", "n");
  QCOLL_REQUIRE(msg != nullptr, "host::dequantize_accumulate", "msg", "null", "needs", need << " bytes");
  QCOLL_REQUIRE(msg_bytes >= need, "host::dequantize_accumulate", "msg_bytes", msg_bytes,
                "is below the required", need);
  QCOLL_REQUIRE(acc != nullptr || n == 0, "host::dequantize_accumulate", "acc", "null", "with n =", n);
  check_aligned("host::dequantize_accumulate", "acc", acc, alignof(float));
  const MessageHeader h = detail::read_header<F>(msg, n, "host::dequantize_accumulate", "msg");
  detail::decode_message<F>(
      msg, n, [acc](std::size_t i, float v) { acc[i] = fp::add(acc[i], v); }, n);
  return h.flags;
}

}  // namespace host
QCOLL_NAMESPACE_END
