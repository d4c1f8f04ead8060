#pragma once
//! \file
//! Host (CPU) kernels: quantize, dequantize and dequantize-accumulate packed messages.
//!
//! Single-threaded loops over the per-block math of format/format.hpp, written so the compiler
//! vectorizes them. They are the oracle of the device kernels: same inputs, same bits.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../core/error.hpp"
#include "../format/message.hpp"

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

//! Statistics of x[0, valid).
template <class T>
inline BlockStats block_stats(const T* x, std::size_t valid) {
  // Lane-parallel partial maxima so the loop vectorizes; merged at the end.
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

//! Encodes x[0, valid) as one block (valid <= F::block; lanes past valid get code 0 and are not
//! part of the statistics), writes its codes and meta bytes, and returns whether it held a
//! non-finite value. `index0` is the random-stream index of x[0].
template <class F, class T>
inline bool encode_block(const T* x, std::size_t valid, float message_scale, const QuantizeOptions& opt,
                         std::uint64_t index0, unsigned char* codes, unsigned char* meta) {
  const BlockStats s = block_stats(x, valid);
  const typename F::Meta m = F::make_meta(s, message_scale);
  F::store_meta(m, meta);
  alignas(64) typename F::code_type c[F::block];
  if (opt.rounding == Rounding::nearest) {
    for (std::size_t i = 0; i < valid; ++i) c[i] = F::encode(to_float(x[i]), m);
  } else {
    for (std::size_t i = 0; i < valid; ++i)
      c[i] = F::encode_sr(to_float(x[i]), m, random_bits(opt.seed, index0 + i));
  }
  for (std::size_t i = valid; i < F::block; ++i) c[i] = 0;
  pack_block<F>(c, codes);
  return s.nonfinite;
}

//! Decodes the first `valid` values of one block and hands each to sink(i, value).
template <class F, class Sink>
inline void decode_block(const unsigned char* codes, const unsigned char* meta, float message_scale,
                         std::size_t valid, Sink&& sink) {
  const typename F::Meta m = F::load_meta(meta, message_scale);
  alignas(64) typename F::code_type c[F::block];
  unpack_block<F>(codes, c);
  for (std::size_t i = 0; i < valid; ++i) sink(i, F::decode(c[i], m));
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
    amax = fp::max(amax, block_stats(s.ptr, s.valid).absmax);
  }
  return amax;
}

//! Writes a message of n elements whose block b reads from src(b) (a BlockSource<T>). The caller
//! has checked `out` (packed_bytes<F>(n) bytes). Returns the header flags. O(n).
template <class F, class T, class Source>
inline std::uint32_t quantize_blocks(std::size_t n, Source&& src, void* out, const QuantizeOptions& opt) {
  using L = MessageLayout<F>;
  auto* base = static_cast<unsigned char*>(out);
  const std::size_t nb = L::blocks(n);
  std::memset(base, 0, L::bytes(n));
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

//! Decodes all n values of a checked message, handing value i to sink(i, value).
template <class F, class Sink>
inline void decode_message(const void* msg, std::size_t n, Sink&& sink) {
  using L = MessageLayout<F>;
  const auto* base = static_cast<const unsigned char*>(msg);
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) mscale = ::qcoll::detail::load_f32(base + L::message_meta_offset);
  const std::size_t nb = L::blocks(n);
  for (std::size_t b = 0; b < nb; ++b) {
    const std::size_t first = b * F::block;
    const std::size_t valid = n - first < F::block ? n - first : F::block;
    decode_block<F>(base + L::codes_offset + b * L::block_code_bytes,
                    base + L::metas_offset(n) + b * F::meta_bytes, mscale, valid,
                    [&](std::size_t i, float v) { sink(first + i, v); });
  }
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
//! kFlagNonFinite in the header. Throws qcoll::Error, writing nothing, if in is null with n > 0,
//! out is null or out_bytes is too small. O(n) time, no allocation.
template <class F, class T>
std::size_t quantize(const T* in, std::size_t n, void* out, std::size_t out_bytes,
                     const QuantizeOptions& opt = {}) {
  const std::size_t need = packed_bytes<F>(n);
  QCOLL_REQUIRE(in != nullptr || n == 0, "host::quantize", "in", "null", "with n =", n);
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
//! nothing, if a pointer is null, msg_bytes < packed_bytes<F>(n), or the header is not F's with n
//! elements. O(n).
template <class F, class T>
std::uint32_t dequantize(const void* msg, std::size_t msg_bytes, T* out, std::size_t n) {
  const std::size_t need = packed_bytes<F>(n);
  QCOLL_REQUIRE(msg != nullptr, "host::dequantize", "msg", "null", "needs", need << " bytes");
  QCOLL_REQUIRE(msg_bytes >= need, "host::dequantize", "msg_bytes", msg_bytes, "is below the required", need);
  QCOLL_REQUIRE(out != nullptr || n == 0, "host::dequantize", "out", "null", "with n =", n);
  const MessageHeader h = detail::read_header<F>(msg, n, "host::dequantize", "msg");
  detail::decode_message<F>(msg, n, [out](std::size_t i, float v) { out[i] = from_float<T>(v); });
  return h.flags;
}

//! acc[i] += decoded value i, in fp32 (one rounding per element), for i in [0, n). The building
//! block of reductions: summing several messages in a fixed order is deterministic. Same checks
//! and return value as dequantize. O(n).
template <class F>
std::uint32_t dequantize_accumulate(const void* msg, std::size_t msg_bytes, float* acc, std::size_t n) {
  const std::size_t need = packed_bytes<F>(n);
  QCOLL_REQUIRE(msg != nullptr, "host::dequantize_accumulate", "msg", "null", "needs", need << " bytes");
  QCOLL_REQUIRE(msg_bytes >= need, "host::dequantize_accumulate", "msg_bytes", msg_bytes,
                "is below the required", need);
  QCOLL_REQUIRE(acc != nullptr || n == 0, "host::dequantize_accumulate", "acc", "null", "with n =", n);
  const MessageHeader h = detail::read_header<F>(msg, n, "host::dequantize_accumulate", "msg");
  detail::decode_message<F>(msg, n, [acc](std::size_t i, float v) { acc[i] = fp::add(acc[i], v); });
  return h.flags;
}

}  // namespace host
QCOLL_NAMESPACE_END
