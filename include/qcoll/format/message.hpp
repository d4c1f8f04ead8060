#pragma once
//! \file
//! The packed message: qcoll's wire format for n elements of a block format F.
//!
//! ```
//! offset 0                 header (32 bytes, MessageHeader)
//! offset 32                message meta (F::message_meta_bytes, padded to 16; absent when 0)
//! codes_offset(n)          codes of all blocks, block after block (padded to 16)
//! metas_offset(n)          per-block scale data, F::meta_bytes each (padded to 16)
//! bytes(n)                 end
//! ```
//! One buffer carries codes and scales together, so one collective moves a whole message. Padding
//! codes of the tail block are zero bits; padding bytes are zero. docs/formats.md has the details.

#include <cstddef>
#include <cstdint>
#include <string>

#include "../core/checked.hpp"
#include "../core/error.hpp"
#include "format.hpp"

QCOLL_NAMESPACE_BEGIN

//! Header flag: some input element was NaN or ±Inf (its block decodes to NaN), or, for
//! Identity<half/bfloat16>, a finite input overflowed the 16-bit type and decodes to ±Inf. A
//! device collective also sets it on every message of a sender whose input held one anywhere.
constexpr std::uint32_t kFlagNonFinite = 1u;
//! Header flag (device collectives): the sender, or a rank upstream of it, rejected its call's
//! arguments; the message's codes are not data.
constexpr std::uint32_t kFlagRejected = 2u;
//! Header flag (device collectives): a message received upstream of the sender did not match the
//! plan (magic, format, block or count); the message's codes are not data.
constexpr std::uint32_t kFlagBadMessage = 4u;

//! Magic number of a message header ("qC" little-endian).
constexpr std::uint16_t kMessageMagic = 0x4371;

//! The 32-byte header at the start of every message.
struct MessageHeader {
  std::uint16_t magic;      //!< kMessageMagic
  std::uint8_t format;      //!< FormatId
  std::uint8_t log2_block;  //!< log2 of the block size
  std::uint32_t flags;      //!< kFlag* bits
  std::uint64_t count;      //!< number of elements
  std::uint64_t tag;        //!< the call's tag (a collective's plan identity and call number; 0 standalone)
  std::uint64_t reserved;   //!< 0
};
static_assert(sizeof(MessageHeader) == 32, "the message header is 32 bytes");

//! Rounds n up to a multiple of 16.
QCOLL_HOST_DEVICE constexpr std::size_t align16(std::size_t n) {
  return (n + 15) & ~static_cast<std::size_t>(15);
}

//! log2 of a power of two.
QCOLL_HOST_DEVICE constexpr unsigned log2_exact(std::size_t n) {
  unsigned e = 0;
  while (n > 1) {
    n >>= 1;
    ++e;
  }
  return e;
}

//! Byte layout of a message of F. All functions O(1), host and device. Byte offsets and sizes
//! are exact for n <= max_count<F>() (below); callers check n first (checked_packed_bytes).
template <class F>
struct MessageLayout {
  //! Number of blocks for n elements: ceil(n / block) (exact for every n).
  QCOLL_HOST_DEVICE static constexpr std::size_t blocks(std::size_t n) {
    return n / F::block + (n % F::block != 0 ? 1 : 0);
  }
  //! Bytes of codes in one block.
  static constexpr std::size_t block_code_bytes = F::block * F::code_bits / 8;
  //! Offset of the message meta (NVFP4's tensor scale).
  static constexpr std::size_t message_meta_offset = sizeof(MessageHeader);
  //! Offset of the first block's codes.
  static constexpr std::size_t codes_offset = sizeof(MessageHeader) + align16(F::message_meta_bytes);
  //! Offset of the first block's meta bytes.
  QCOLL_HOST_DEVICE static constexpr std::size_t metas_offset(std::size_t n) {
    return codes_offset + align16(blocks(n) * block_code_bytes);
  }
  //! Total message bytes for n elements.
  QCOLL_HOST_DEVICE static constexpr std::size_t bytes(std::size_t n) {
    return metas_offset(n) + align16(blocks(n) * F::meta_bytes);
  }
};

static_assert(sizeof(std::size_t) == 8, "qcoll needs a 64-bit size_t");

//! Largest element count a message of F may hold: the largest multiple of F::block that fits in
//! std::size_t and whose packed size does too (about 2^64 / bytes per element, for formats of
//! at least one byte per element). Every message size, offset and block index of a message of
//! n <= max_count<F>() elements is computed without overflow. O(1), constexpr.
template <class F>
QCOLL_HOST_DEVICE constexpr std::size_t max_count() {
  using L = MessageLayout<F>;
  // bytes(n) <= codes_offset + blocks * (codes + meta per block) + two paddings of at most 15.
  constexpr std::size_t fixed = L::codes_offset + 30;
  constexpr std::size_t per_block = L::block_code_bytes + F::meta_bytes;
  constexpr std::size_t by_bytes = (~std::size_t{0} - fixed) / per_block;
  constexpr std::size_t by_count = ~std::size_t{0} / F::block;
  return (by_bytes < by_count ? by_bytes : by_count) * F::block;
}

//! Total bytes of a packed message of n elements in format F (header, codes, scales). For
//! n > max_count<F>(), whose size does not fit in std::size_t, returns the largest std::size_t
//! instead of a wrapped size, so no buffer passes a size check against it. O(1).
template <class F>
QCOLL_HOST_DEVICE constexpr std::size_t packed_bytes(std::size_t n) {
  return n <= max_count<F>() ? MessageLayout<F>::bytes(n) : ~std::size_t{0};
}

//! packed_bytes<F>(n) after checking n: throws qcoll::Error "qcoll::FUNCTION: argument 'ARGUMENT'
//! = N exceeds the largest element count of a message of FORMAT/BLOCK, LIMIT" if n >
//! max_count<F>(). O(1).
template <class F>
inline std::size_t checked_packed_bytes(std::size_t n, const char* function, const char* argument) {
  QCOLL_REQUIRE(n <= max_count<F>(), function, argument, n,
                "exceeds the largest element count of a message of",
                format_name(F::id) << "/" << F::block << ", " << max_count<F>());
  return MessageLayout<F>::bytes(n);
}

//! The header a message of n elements of F starts with (flags clear), carrying `tag`.
template <class F>
QCOLL_HOST_DEVICE MessageHeader make_header(std::size_t n, std::uint64_t tag = 0) {
  return MessageHeader{kMessageMagic,
                       static_cast<std::uint8_t>(F::id),
                       static_cast<std::uint8_t>(log2_exact(F::block)),
                       0u,
                       static_cast<std::uint64_t>(n),
                       tag,
                       0u};
}

namespace detail {
//! Text of a header's block field: 2^log2_block in decimal, or "2^L" where that does not fit in
//! 64 bits (any byte may arrive in a header).
inline std::string header_block_text(std::uint8_t log2_block) {
  if (log2_block < 64) return std::to_string(std::uint64_t{1} << log2_block);
  return "2^" + std::to_string(static_cast<unsigned>(log2_block));
}
}  // namespace detail

//! Checks that `h` is a header of F with `n` elements; throws qcoll::Error naming `what` (for
//! example "message from rank 3") and the mismatch otherwise. Any 16 bytes are a valid `h`. O(1).
template <class F>
inline void check_header(const MessageHeader& h, std::size_t n, const char* function, const char* what) {
  QCOLL_REQUIRE(h.magic == kMessageMagic, function, what, "magic 0x" << std::hex << h.magic << std::dec,
                "is not a qcoll message; expected magic", "0x4371");
  QCOLL_REQUIRE(
      h.format == static_cast<std::uint8_t>(F::id) && h.log2_block == log2_exact(F::block), function, what,
      format_name(static_cast<FormatId>(h.format)) << "/block " << detail::header_block_text(h.log2_block),
      "does not match the expected format", format_name(F::id) << "/block " << F::block);
  QCOLL_REQUIRE(h.count == n, function, what, "count " << h.count, "does not match the expected count", n);
}

//! Checks that a header of a collective's message carries the call's tag; throws qcoll::Error
//! naming `what` otherwise (the sender was in another call: a different plan or call number).
inline void check_tag(const MessageHeader& h, std::uint64_t tag, const char* function, const char* what) {
  QCOLL_REQUIRE(h.tag == tag, function, what, "tag 0x" << std::hex << h.tag << std::dec,
                "belongs to another call (plan or call number); expected tag",
                "0x" << std::hex << tag << std::dec);
}

QCOLL_NAMESPACE_END
