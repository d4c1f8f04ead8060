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
#include <utility>

#include "../core/error.hpp"
#include "../format/message.hpp"
#include "block_stats.hpp"
#include "simd_avx2.hpp"

QCOLL_NAMESPACE_BEGIN
namespace host {

//! Rounding and stochastic-rounding key of a quantization.
struct QuantizeOptions {
  Rounding rounding = Rounding::nearest;  //!< nearest-even or stochastic
  std::uint64_t seed = 0;                 //!< stochastic rounding key
  std::uint64_t index_base = 0;           //!< index of element 0 in the random stream (for slices)
  std::uint64_t tag = 0;                  //!< written to the message header (collectives: the call's tag)
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

//! Whether a kernel writes out[0, limit) with non-temporal stores: outputs far beyond the caches
//! (as memcpy does), 16-byte aligned.
template <class V>
inline bool stream_output(const V* out, std::size_t limit) {
  return limit * sizeof(V) >= (std::size_t{16} << 20) && reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
}

//! Where block b of a message reads its input from: `ptr` (element 0 of the block) and how many
//! elements are valid (the rest of the block is padding).
template <class T>
struct BlockSource {
  const T* ptr;
  std::size_t valid;
};

//! The Source of a contiguous array of n elements: block b at in + b * Block, the last block
//! possibly partial (host::quantize). It states its runs of full blocks (full_run_end, O(1)).
template <class T, std::size_t Block>
struct ArraySource {
  const T* in;
  std::size_t n;
  BlockSource<T> operator()(std::size_t b) const {
    const std::size_t first = b * Block;
    return BlockSource<T>{in + first, n - first < Block ? n - first : Block};
  }
  //! The end of the run of full blocks from block b (full): every block before n / Block; nb at most.
  std::size_t full_run_end(std::size_t, std::size_t nb) const {
    const std::size_t full = n / Block;
    return full < nb ? full : nb;
  }
};

//! Whether a Source states its runs of full blocks itself: a member full_run_end(b, nb), for a full
//! block b, an end in [b, nb] such that the blocks [b, end) are full and each starts Block elements
//! after the one before. It may stop early (at b itself, even), never late; the callers take the
//! blocks it leaves out one by one.
template <class S, class = void>
struct states_runs : std::false_type {};
template <class S>
struct states_runs<S,
                   std::void_t<decltype(std::declval<const S&>().full_run_end(std::size_t{}, std::size_t{}))>>
    : std::true_type {};

//! The end of the run of full blocks from block b (whose source is s0 = src(b)) that follow each
//! other in memory: the first block after b that is not full or does not start at s0.ptr + (end -
//! b) * F::block (nb at most); b itself if s0 is not full. A Source that states its runs answers
//! (states_runs; it may answer with a shorter run, b itself even); others are scanned: O(run
//! length) calls of src.
template <class F, class T, class Source>
inline std::size_t full_run_end(Source& src, std::size_t b, std::size_t nb, const BlockSource<T>& s0) {
  if (s0.valid != F::block) return b;
  if constexpr (states_runs<std::remove_cv_t<Source>>::value) {
    return src.full_run_end(b, nb);
  } else {
    std::size_t end = b + 1;
    for (; end < nb; ++end) {
      const BlockSource<T> t = src(end);
      if (t.valid != F::block || t.ptr != s0.ptr + (end - b) * F::block) break;
    }
    return end;
  }
}

//! Message absmax over finite values, for formats with a per-message scale. Simd: each run of
//! full blocks that follow each other in memory goes through one AVX2 reduction (the caller runs
//! on a processor that has it); with `codes` (the message's codes, block b's at b *
//! block_code_bytes), one that also leaves the run's block maxima there for encode_full_run
//! (absmax_entries).
template <class F, class T, bool Simd = false, class Source>
inline float message_absmax(std::size_t nblocks, Source&& src,
                            [[maybe_unused]] unsigned char* codes = nullptr) {
  float amax = 0.0f;
  for (std::size_t b = 0; b < nblocks;) {
    const BlockSource<T> s = src(b);
#if QCOLL_HOST_AVX2_DISPATCH
    if constexpr (Simd) {
      static_assert(F::block % 16 == 0, "the AVX2 reduction takes multiples of 16 elements");
      const std::size_t end = full_run_end<F>(src, b, nblocks, s);
      if (end > b) {
        const float m = codes != nullptr ? avx2::absmax_entries<F>(
                                               s.ptr, end - b, codes + b * MessageLayout<F>::block_code_bytes)
                                         : avx2::absmax_finite(s.ptr, (end - b) * F::block);
        amax = fp::max(amax, m);
        b = end;
        continue;
      }
    }
#endif
    const float a =
        s.valid == F::block ? block_stats(s.ptr, F::block).absmax : block_stats(s.ptr, s.valid).absmax;
    amax = fp::max(amax, a);
    ++b;
  }
  return amax;
}

//! Writes a message of n elements whose block b reads from src(b) (a BlockSource<T>). The caller
//! has checked `out` (packed_bytes<F>(n) bytes). Returns the header flags. O(n). Simd: full,
//! finite blocks with nearest rounding go through the AVX2 kernels (the caller runs on a
//! processor that has AVX2 and F16C); the other blocks, and every block otherwise, through
//! encode_block.
template <class F, class T, class Source, bool Simd = false>
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
  bool bad = false;
  unsigned char* const codes = base + L::codes_offset;
  unsigned char* const metas = base + L::metas_offset(n);
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) {
    // with nearest rounding, the kernels' encode pass (encode_full_run) reads each run's block
    // maxima that the message maximum's pass leaves in the codes (the codes overwrite them)
    const bool nearest = opt.rounding == Rounding::nearest;
    mscale = F::message_scale(message_absmax<F, T, Simd>(nb, src, Simd && nearest ? codes : nullptr));
    ::qcoll::detail::store_f32(base + L::message_meta_offset, mscale);
  }
#if QCOLL_HOST_AVX2_DISPATCH
  // 8-bit integer codes far beyond the caches are written as memcpy writes them, without first
  // reading their lines (non-temporal stores; fenced below). Their encoding is cheap, so the kernel
  // is bound by memory traffic. Measured side by side, these stores made no difference beyond the
  // noise to 4-bit codes and slowed the minifloat encoders, which are bound by arithmetic.
  bool stream = false;
  if constexpr (Simd) {
    if constexpr (avx2::Codec<F>::signed_codes && F::code_bits == 8)
      stream = stream_output(codes, codes_end - L::codes_offset);
  }
#endif
  const auto encode = [&](std::size_t b, const BlockSource<T>& s) {
    bad |= encode_block<F>(s.ptr, s.valid, mscale, opt, opt.index_base + b * F::block,
                           codes + b * L::block_code_bytes, metas + b * F::meta_bytes);
  };
#if QCOLL_HOST_AVX2_DISPATCH
  // the asymmetric integers' groups left to the double arithmetic (redone below)
  [[maybe_unused]] std::conditional_t<Simd, typename avx2::later_for<F, T>::type, char> later;
  if constexpr (!std::is_same<decltype(later), char>::value) {
    later.codes = codes;
    later.metas = metas;
  }
#endif
  for (std::size_t b = 0; b < nb;) {
#if QCOLL_HOST_AVX2_DISPATCH
    if constexpr (Simd) {
      if constexpr (!avx2::Codec<F>::range) {
        // Runs of full blocks consecutive in memory through the kernels (which hand non-finite
        // blocks back to encode); the other blocks below.
        const BlockSource<T> s0 = src(b);
        const std::size_t end = opt.rounding == Rounding::nearest ? full_run_end<F>(src, b, nb, s0) : b;
        if (end > b) {
          const auto redo = [&](std::size_t k) {
            encode(b + k, BlockSource<T>{s0.ptr + k * F::block, F::block});
          };
          avx2::encode_full_run<F>(s0.ptr, end - b, mscale, codes + b * L::block_code_bytes,
                                   metas + b * F::meta_bytes, stream, avx2::BlockRedo::of(redo));
          b = end;
          continue;
        }
      } else {
        // Groups of full blocks through the kernels, pipelined (each call gathers the next group's
        // statistics before it encodes its own); the others (and non-finite blocks) below.
        constexpr std::size_t group = avx2::group_blocks<F>();
        const T* ptr[2][group];
        const auto gather = [&](std::size_t from, const T** p) {
          std::size_t count = 0;
          for (; count < group && from + count < nb; ++count) {
            const BlockSource<T> s = src(from + count);
            if (s.valid != F::block) break;
            p[count] = s.ptr;
          }
          return count;
        };
        std::size_t count = opt.rounding == Rounding::nearest ? gather(b, ptr[0]) : 0;
        if (count > 0) {
          avx2::AsymStats st;
          avx2::asym_stats<F>(ptr[0], count, metas + b * F::meta_bytes, st);
          for (int cur = 0; count > 0; cur ^= 1) {  // a short group ends the run
            const std::size_t next = b + count, next_count = count == group ? gather(next, ptr[cur ^ 1]) : 0;
            const unsigned left = avx2::encode_full_blocks<F>(ptr[cur], count, st, ptr[cur ^ 1], next_count,
                                                              metas + next * F::meta_bytes,
                                                              codes + b * L::block_code_bytes, later);
            for (std::size_t k = 0; k < count; ++k)
              if (left & (1u << k)) encode(b + k, BlockSource<T>{ptr[cur][k], F::block});
            b = next;
            count = next_count;
          }
          continue;
        }
      }
    }
#endif
    encode(b, src(b));
    ++b;
  }
#if QCOLL_HOST_AVX2_DISPATCH
  avx2::flush_later(later);
  if (stream) avx2::fence();
#endif
  MessageHeader h = make_header<F>(n, opt.tag);
  h.flags = bad ? kFlagNonFinite : 0u;
  std::memcpy(base, &h, sizeof h);
  return h.flags;
}

#if QCOLL_HOST_AVX2_DISPATCH
//! quantize_blocks_impl compiled for AVX2 with everything inlined into it, for formats without
//! AVX2 kernels (the identity formats). Same IEEE operations, no FMA: the same bytes as the
//! portable build.
template <class F, class T, class Source>
QCOLL_AVX2 __attribute__((flatten)) std::uint32_t quantize_blocks_avx2(std::size_t n, Source&& src, void* out,
                                                                       const QuantizeOptions& opt) {
  return quantize_blocks_impl<F, T>(n, src, out, opt);
}
#endif

//! The element type W of Identity<W, Block>.
template <class F>
struct identity_element;
template <class W, std::size_t Block>
struct identity_element<Identity<W, Block>> {
  using type = W;
};

#if QCOLL_HOST_AVX2_DISPATCH
//! quantize_blocks_impl for an identity format F, its element conversions in AVX2 (the same bytes:
//! codes are from_float<W>(to_float(x)) whatever the rounding, and a block is non-finite exactly
//! when one of its codes is ±Inf or NaN).
template <class F, class T, class Source>
inline std::uint32_t quantize_identity_avx2(std::size_t n, Source&& src, void* out,
                                            const QuantizeOptions& opt) {
  using L = MessageLayout<F>;
  using W = typename identity_element<F>::type;
  auto* base = static_cast<unsigned char*>(out);
  const std::size_t nb = L::blocks(n);
  const std::size_t codes_end = L::codes_offset + nb * L::block_code_bytes;
  std::memset(base + sizeof(MessageHeader), 0, L::codes_offset - sizeof(MessageHeader));
  std::memset(base + codes_end, 0, L::bytes(n) - codes_end);
  bool bad = false;
  for (std::size_t b = 0; b < nb;) {
    // a run of full blocks that follow each other in memory in one call, or one partial block
    const BlockSource<T> s = src(b);
    std::size_t end = full_run_end<F>(src, b, nb, s), count = (end - b) * F::block;
    if (end == b) {
      end = b + 1;
      count = s.valid;
    }
    unsigned char* codes = base + L::codes_offset + b * L::block_code_bytes;
    bad |= avx2::convert_codes<W>(s.ptr, count, codes);
    std::memset(codes + count * sizeof(W), 0, ((end - b) * F::block - count) * sizeof(W));
    b = end;
  }
  MessageHeader h = make_header<F>(n, opt.tag);
  h.flags = bad ? kFlagNonFinite : 0u;
  std::memcpy(base, &h, sizeof h);
  return h.flags;
}
#endif

//! Writes a message of n elements whose block b reads from src(b) (a BlockSource<T>, whose input
//! stays valid and unchanged for the call: the kernels may read a block again after later ones).
//! The caller has checked `out` (packed_bytes<F>(n) bytes). Returns the header flags. O(n). On
//! x86-64 it runs the AVX2 kernels when the processor has AVX2 and F16C.
template <class F, class T, class Source>
inline std::uint32_t quantize_blocks(std::size_t n, Source&& src, void* out, const QuantizeOptions& opt) {
#if QCOLL_HOST_AVX2_DISPATCH
  if (avx2::supported()) {
    if constexpr (avx2::has_kernels<F>()) {
      return quantize_blocks_impl<F, T, Source&, true>(n, src, out, opt);
    } else if constexpr (is_identity_format<F>::value) {
      return quantize_identity_avx2<F, T>(n, src, out, opt);
    } else {
      return quantize_blocks_avx2<F, T>(n, src, out, opt);
    }
  }
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

//! Decodes values [from, limit) of a checked message of n elements as V (from a multiple of
//! F::block, at most limit): value i is handed to store(i - from, convert(F::decode(code i,
//! meta))), through decode tables when use_decode_table<F, V>.
template <class F, class V, class Convert, class Store>
inline void decode_message_as_impl(const void* msg, std::size_t n, std::size_t limit, Convert&& convert,
                                   Store&& store, std::size_t from = 0) {
  using L = MessageLayout<F>;
  const auto* base = static_cast<const unsigned char*>(msg);
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) mscale = ::qcoll::detail::load_f32(base + L::message_meta_offset);
  const std::size_t nb = L::blocks(limit);
  if constexpr (use_decode_table<F, V>()) {
    DecodeTables<F, V> tables;
    for (std::size_t b = from / F::block; b < nb; ++b) {
      const std::size_t first = b * F::block, o = first - from;  // o: value first's output index
      const std::size_t valid = limit - first < F::block ? limit - first : F::block;
      const V* t = tables.get(base + L::metas_offset(n) + b * F::meta_bytes, mscale, convert);
      const unsigned char* codes = base + L::codes_offset + b * L::block_code_bytes;
      // Short 4-bit blocks: two look-ups per byte. Otherwise unpack (vectorized), then look up.
      if constexpr (F::code_bits == 4 && F::block <= 16) {
        for (std::size_t k = 0; k < valid / 2; ++k) {
          store(o + 2 * k, t[codes[k] & 0xFu]);
          store(o + 2 * k + 1, t[codes[k] >> 4]);
        }
        if (valid % 2 != 0) store(o + valid - 1, t[codes[valid / 2] & 0xFu]);
      } else {
        alignas(64) typename F::code_type c[F::block];
        unpack_block<F>(codes, c);
        if (valid == F::block) {
          for (std::size_t i = 0; i < F::block; ++i) store(o + i, t[c[i]]);
        } else {
          for (std::size_t i = 0; i < valid; ++i) store(o + i, t[c[i]]);
        }
      }
    }
  } else if constexpr (std::is_same<V, float>::value || F::code_bits > 8) {
    for (std::size_t b = from / F::block; b < nb; ++b) {
      const std::size_t first = b * F::block, o = first - from;  // o: value first's output index
      const std::size_t valid = limit - first < F::block ? limit - first : F::block;
      decode_block<F>(base + L::codes_offset + b * L::block_code_bytes,
                      base + L::metas_offset(n) + b * F::meta_bytes, mscale, valid,
                      [&](std::size_t i, float v) { store(o + i, convert(v)); });
    }
  } else {
    // Quantized codes to a 16-bit V: decode a block to float, then convert it in a loop of its
    // own, so the conversion's rounding branches become vector selects even where the decode
    // itself stays scalar.
    for (std::size_t b = from / F::block; b < nb; ++b) {
      const std::size_t first = b * F::block, o = first - from;  // o: value first's output index
      const std::size_t valid = limit - first < F::block ? limit - first : F::block;
      alignas(64) float v[F::block];
      decode_block<F>(base + L::codes_offset + b * L::block_code_bytes,
                      base + L::metas_offset(n) + b * F::meta_bytes, mscale, valid,
                      [&](std::size_t i, float x) { v[i] = x; });
      if (valid == F::block) {
        for (std::size_t i = 0; i < F::block; ++i) store(o + i, convert(v[i]));
      } else {
        for (std::size_t i = 0; i < valid; ++i) store(o + i, convert(v[i]));
      }
    }
  }
}

#if QCOLL_HOST_AVX2_DISPATCH
//! decode_message_as_impl compiled for AVX2 (see quantize_blocks_avx2).
template <class F, class V, class Convert, class Store>
QCOLL_AVX2 __attribute__((flatten)) void decode_message_as_avx2(const void* msg, std::size_t n,
                                                                std::size_t limit, Convert&& convert,
                                                                Store&& store, std::size_t from = 0) {
  decode_message_as_impl<F, V>(msg, n, limit, convert, store, from);
}
#endif

//! Decodes values [0, limit) of a checked message of n elements as V: value i is handed to
//! store(i, convert(F::decode(code i, meta))). Runs an AVX2 build where the processor has it.
template <class F, class V, class Convert, class Store>
inline void decode_message_as(const void* msg, std::size_t n, std::size_t limit, Convert&& convert,
                              Store&& store) {
#if QCOLL_HOST_AVX2_DISPATCH
  if (avx2::supported()) return decode_message_as_avx2<F, V>(msg, n, limit, convert, store);
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

//! from_float<V>, as the convert step of decode_message_as.
template <class V>
struct ConvertTo {
  V operator()(float v) const { return from_float<V>(v); }
};

//! The store step of decode_message_as for decode_into: out[i] = v, or (Acc) out[i] = fp::add(out[i], v).
template <class V, bool Acc>
struct PutInto {
  V* out;
  void operator()(std::size_t i, V v) const {
    if constexpr (Acc) {
      out[i] = fp::add(out[i], v);
    } else {
      out[i] = v;
    }
  }
};

//! Decodes values [from, limit) of a checked message of n elements into out[0, limit - from) as V
//! (from_float<V> of each value), or, when Acc (V = float), adds them: out[i - from] =
//! fp::add(out[i - from], value i). from: a multiple of F::block, at most limit. Simd: through the
//! AVX2 kernels (the caller runs on a processor that has them); otherwise the portable
//! decode_message_as_impl.
template <class F, class V, bool Acc, bool Simd = false>
inline void decode_into_impl(const void* msg, std::size_t n, std::size_t limit, V* out,
                             std::size_t from = 0) {
  static_assert(!Acc || std::is_same<V, float>::value, "accumulation is in fp32");
#if QCOLL_HOST_AVX2_DISPATCH
  if constexpr (Simd) {
    using L = MessageLayout<F>;
    const auto* base = static_cast<const unsigned char*>(msg);
    float mscale = 0.0f;
    if constexpr (has_message_scale<F>) mscale = ::qcoll::detail::load_f32(base + L::message_meta_offset);
    const bool stream = !Acc && stream_output(out, limit - from);
    constexpr auto sink = Acc ? avx2::Sink::add : avx2::Sink::store;
    const std::size_t full = (limit - from) / F::block;
    const unsigned char* codes = base + L::codes_offset + from / F::block * L::block_code_bytes;
    const unsigned char* metas = base + L::metas_offset(n) + from / F::block * F::meta_bytes;
    if (stream) {
      avx2::decode_full_blocks<F, V, avx2::Sink::stream>(codes, metas, mscale, out, full);
    } else {
      avx2::decode_full_blocks<F, V, sink>(codes, metas, mscale, out, full);
    }
    if (full * F::block < limit - from) {
      // The partial last block, whole (its codes past `limit` are the message's or its zero
      // padding), through the same kernel instance into a buffer (holding out's values first where
      // they are added to, zeros past them), then its first `valid` values to out.
      const std::size_t first = full * F::block, valid = limit - from - first;
      alignas(64) unsigned char tail[F::block * sizeof(V)];
      if constexpr (Acc) {
        std::memcpy(tail, out + first, valid * sizeof(V));
        std::memset(tail + valid * sizeof(V), 0, sizeof tail - valid * sizeof(V));
      }
      avx2::decode_full_blocks<F, V, sink>(codes + full * L::block_code_bytes, metas + full * F::meta_bytes,
                                           mscale, reinterpret_cast<V*>(tail), 1);
      std::memcpy(out + first, tail, valid * sizeof(V));
    }
    if (stream) avx2::fence();
  } else
#endif
  {
    decode_message_as_impl<F, V>(msg, n, limit, ConvertTo<V>{}, PutInto<V, Acc>{out}, from);
  }
}

//! Decodes values [from, limit) of a checked message of n elements into out[0, limit - from) as V,
//! or adds them to fp32 accumulators when Acc (see decode_into_impl; from a multiple of F::block,
//! at most limit). AVX2 kernels where the processor has them. O(limit - from).
template <class F, class V, bool Acc = false>
inline void decode_into(const void* msg, std::size_t n, std::size_t limit, V* out, std::size_t from = 0) {
#if QCOLL_HOST_AVX2_DISPATCH
  if constexpr (avx2::has_kernels<F>()) {
    if (avx2::supported()) return decode_into_impl<F, V, Acc, true>(msg, n, limit, out, from);
  } else if constexpr (is_identity_format<F>::value) {
    if (avx2::supported()) {
      using W = typename identity_element<F>::type;
      const auto* codes =
          static_cast<const unsigned char*>(msg) + MessageLayout<F>::codes_offset + from * sizeof(W);
      if constexpr (Acc) {
        avx2::decode_identity<W, avx2::Sink::add>(codes, limit - from, out);
      } else if (stream_output(out, limit - from)) {
        avx2::decode_identity<W, avx2::Sink::stream>(codes, limit - from, out);
        avx2::fence();
      } else {
        avx2::decode_identity<W, avx2::Sink::store>(codes, limit - from, out);
      }
      return;
    }
  } else {
    if (avx2::supported()) {
      return decode_message_as_avx2<F, V>(msg, n, limit, ConvertTo<V>{}, PutInto<V, Acc>{out}, from);
    }
  }
#endif
  decode_into_impl<F, V, Acc>(msg, n, limit, out, from);
}

//! out[i] = fp::sub(out[i], value i) for i in [0, limit) of a checked message of n elements: the
//! residual of error feedback. Chunks of blocks are decoded by decode_into's accumulating
//! instance (which the reduce-scatter runs anyway: no instance of its own) into a buffer of -0,
//! the identity of fp::add, so that the buffer holds the values exactly (signed zeros and NaNs
//! included), then subtracted. O(limit), with a buffer of max(4096, F::block) floats on the stack.
template <class F>
inline void subtract_decoded(const void* msg, std::size_t n, std::size_t limit, float* out) {
  constexpr std::size_t chunk = F::block < 4096 ? 4096 / F::block * F::block : F::block;
  alignas(64) float buf[chunk];
  for (std::size_t i = 0; i < chunk && i < limit; ++i) buf[i] = -0.0f;
  for (std::size_t first = 0; first < limit; first += chunk) {
    const std::size_t m = limit - first < chunk ? limit - first : chunk;
    decode_into<F, float, true>(msg, n, first + m, buf, first);
    std::size_t i = 0;
#if QCOLL_HOST_AVX2_DISPATCH
    if (avx2::supported()) i = avx2::subtract_and_clear(out + first, buf, m);
#endif
    for (; i < m; ++i) {
      out[first + i] = fp::sub(out[first + i], buf[i]);
      buf[i] = -0.0f;
    }
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

//! The instruction set the host kernels run with on this processor: "AVX2+F16C+FMA" (FMA serves
//! the asymmetric integers' decode), "AVX2+F16C" or "portable".
inline const char* kernel_isa() {
#if QCOLL_HOST_AVX2_DISPATCH
  if (detail::avx2::supported()) return detail::avx2::has_fma() ? "AVX2+F16C+FMA" : "AVX2+F16C";
#endif
  return "portable";
}

//! Quantizes in[0, n) into one packed message at `out` (out_bytes >= packed_bytes<F>(n)).
//! Returns the bytes written (packed_bytes<F>(n)). Blocks holding NaN/Inf get a NaN scale and set
//! kFlagNonFinite in the header (so does an Identity<half/bfloat16> overflow). Throws
//! qcoll::Error, writing nothing, if n > max_count<F>(), in is null with n > 0 or not aligned to
//! alignof(T), out is null or out_bytes is too small, or the message's bytes overlap in[0, n) (the
//! input is read while the message is written). `out` needs no alignment. O(n) time, no
//! allocation.
template <class F, class T>
std::size_t quantize(const T* in, std::size_t n, void* out, std::size_t out_bytes,
                     const QuantizeOptions& opt = {}) {
  const std::size_t need = checked_packed_bytes<F>(n, "host::quantize", "n");
  QCOLL_REQUIRE(in != nullptr || n == 0, "host::quantize", "in", "null", "with n =", n);
  check_aligned("host::quantize", "in", in, alignof(T));
  QCOLL_REQUIRE(out != nullptr, "host::quantize", "out", "null", "needs", need << " bytes");
  QCOLL_REQUIRE(out_bytes >= need, "host::quantize", "out_bytes", out_bytes, "is below the required", need);
  const std::uintptr_t i0 = reinterpret_cast<std::uintptr_t>(in), o0 = reinterpret_cast<std::uintptr_t>(out);
  QCOLL_REQUIRE(n == 0 || o0 + need <= i0 || i0 + n * sizeof(T) <= o0, "host::quantize", "out", out,
                "overlaps the input", static_cast<const void*>(in) << " (" << n * sizeof(T) << " bytes)");
  detail::quantize_blocks<F, T>(n, detail::ArraySource<T, F::block>{in, n}, out, opt);
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
  detail::decode_into<F, T>(msg, n, n, out);
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
  detail::decode_into<F, float, true>(msg, n, n, acc);
  return h.flags;
}

}  // namespace host
QCOLL_NAMESPACE_END
