// Shared by the fuzz targets: reading typed values from the fuzzer's bytes, a reduced format
// dispatch (every FormatId, a few block sizes, to keep sanitizer builds quick) and a check that
// aborts with a message (a finding) when a contract does not hold.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <qcoll/core/error.hpp>
#include <qcoll/format/format.hpp>

namespace fuzz {

//! Reads little-endian integers from the fuzzer's bytes; past the end it reads zeros.
class Reader {
 public:
  Reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t u8() { return at_ < size_ ? data_[at_++] : 0; }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(u8()) << (8 * i);
    return v;
  }
  //! The bytes not read yet.
  const std::uint8_t* rest() const { return data_ + (at_ < size_ ? at_ : size_); }
  std::size_t rest_size() const { return at_ < size_ ? size_ - at_ : 0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

//! Aborts (a fuzzer finding) with `what` unless `cond` holds.
inline void expect(bool cond, const char* what) {
  if (!cond) {
    std::fprintf(stderr, "fuzz contract broken: %s\n", what);
    std::abort();
  }
}

//! A value that selects an item of n: sel % n.
inline unsigned pick(std::uint8_t sel, unsigned n) { return sel % n; }

template <std::size_t B>
struct BlockSel {
  static constexpr std::size_t value = B;
};

//! Calls fn(F{}) for the format of FormatId `id` (1..16; others map onto that range) with a
//! block chosen by `block_sel` among 32, 256 and 8192 for the formats with a block parameter.
template <class Fn>
void with_format(std::uint8_t id, std::uint8_t block_sel, Fn&& fn) {
  using namespace qcoll;
  auto blocks = [&](auto make) {
    switch (pick(block_sel, 3)) {
      case 0: make(BlockSel<32>{}); break;
      case 1: make(BlockSel<256>{}); break;
      default: make(BlockSel<8192>{}); break;
    }
  };
  switch (static_cast<FormatId>(1 + id % 16)) {
    case FormatId::identity_f32: blocks([&](auto b) { fn(Identity<float, decltype(b)::value>{}); }); break;
    case FormatId::identity_f16: blocks([&](auto b) { fn(Identity<half, decltype(b)::value>{}); }); break;
    case FormatId::identity_bf16:
      blocks([&](auto b) { fn(Identity<bfloat16, decltype(b)::value>{}); });
      break;
    case FormatId::int8: blocks([&](auto b) { fn(Int8<decltype(b)::value>{}); }); break;
    case FormatId::int4: blocks([&](auto b) { fn(Int4<decltype(b)::value>{}); }); break;
    case FormatId::int8_asym: blocks([&](auto b) { fn(Int8Asym<decltype(b)::value>{}); }); break;
    case FormatId::int4_asym: blocks([&](auto b) { fn(Int4Asym<decltype(b)::value>{}); }); break;
    case FormatId::fp8_e4m3: blocks([&](auto b) { fn(Fp8E4M3<decltype(b)::value>{}); }); break;
    case FormatId::fp8_e5m2: blocks([&](auto b) { fn(Fp8E5M2<decltype(b)::value>{}); }); break;
    case FormatId::mxfp8_e4m3: fn(MxFp8E4M3{}); break;
    case FormatId::mxfp8_e5m2: fn(MxFp8E5M2{}); break;
    case FormatId::mxfp6_e2m3: fn(MxFp6E2M3{}); break;
    case FormatId::mxfp6_e3m2: fn(MxFp6E3M2{}); break;
    case FormatId::mxfp4: fn(MxFp4{}); break;
    case FormatId::mxint8: fn(MxInt8{}); break;
    case FormatId::nvfp4: fn(NvFp4{}); break;
  }
}

//! Size of a message of n elements of F computed in 128-bit integers, independently of the
//! library's 64-bit arithmetic: the oracle the targets compare packed_bytes and buffer sizes to.
template <class F>
unsigned __int128 exact_bytes(std::uint64_t n) {
  using U = unsigned __int128;
  auto align16 = [](U x) { return (x + 15) / 16 * 16; };
  const U blocks = (static_cast<U>(n) + F::block - 1) / F::block;
  const U codes = blocks * (F::block * F::code_bits / 8);
  constexpr U kHeader = 32;  // docs/formats.md: the header is 32 bytes
  return kHeader + align16(F::message_meta_bytes) + align16(codes) + align16(blocks * F::meta_bytes);
}

//! Runs fn and reports whether it threw qcoll::Error (any other exception escapes: a finding).
template <class Fn>
bool throws_error(Fn&& fn) {
  try {
    fn();
  } catch (const qcoll::Error&) {
    return true;
  }
  return false;
}

}  // namespace fuzz
