#pragma once
//! \file
//! Run-time choice of a block format: from a name ("int8", "mxfp4", ...) and a block size to a
//! call of a generic function with the matching format type.

#include <cstddef>
#include <cstring>
#include <string>

#include "../core/error.hpp"
#include "format.hpp"

QCOLL_NAMESPACE_BEGIN

//! Parses a format name as printed by format_name(); throws qcoll::Error listing the names.
inline FormatId parse_format(const std::string& name) {
  for (int i = 1; i <= 16; ++i) {
    const auto id = static_cast<FormatId>(i);
    if (name == format_name(id)) return id;
  }
  QCOLL_REQUIRE(
      false, "parse_format", "name", "'" << name << "'", "is not one of",
      "f32 f16 bf16 int8 int4 int8a int4a e4m3 e5m2 mxfp8e4 mxfp8e5 mxfp6e2 mxfp6e3 mxfp4 mxint8 nvfp4");
  return FormatId::int8;
}

//! True when `block` is a power of two in [32, 8192] (the blocks of the scaled integer and FP8
//! formats).
constexpr bool valid_block(std::size_t block) {
  return block >= 32 && block <= 8192 && (block & (block - 1)) == 0;
}

namespace detail {
//! A list of block sizes for dispatch_quantized; the last one also takes any other value.
template <std::size_t... Bs>
struct BlockSet {};
using AllBlocks = BlockSet<32, 64, 128, 256, 512, 1024, 2048, 4096, 8192>;

template <template <std::size_t> class F, std::size_t B0, std::size_t... Bs, class Fn>
decltype(auto) dispatch_block(BlockSet<B0, Bs...>, std::size_t block, Fn&& fn) {
  if constexpr (sizeof...(Bs) == 0) {
    return fn(F<B0>{});
  } else {
    if (block == B0) return fn(F<B0>{});
    return dispatch_block<F>(BlockSet<Bs...>{}, block, fn);
  }
}
template <std::size_t B>
using IdF32 = Identity<float, B>;
template <std::size_t B>
using IdF16 = Identity<half, B>;
template <std::size_t B>
using IdBf16 = Identity<bfloat16, B>;

//! dispatch_format for the quantized formats (ids int8 to nvfp4), with the variable-block formats
//! instantiated at the blocks of `Set` only; checks nothing (dispatch_format checks its arguments).
template <class Set, class Fn>
decltype(auto) dispatch_quantized(FormatId id, std::size_t block, Fn&& fn) {
  switch (id) {
    case FormatId::int8: break;
    case FormatId::int4: return dispatch_block<Int4>(Set{}, block, fn);
    case FormatId::int8_asym: return dispatch_block<Int8Asym>(Set{}, block, fn);
    case FormatId::int4_asym: return dispatch_block<Int4Asym>(Set{}, block, fn);
    case FormatId::fp8_e4m3: return dispatch_block<Fp8E4M3>(Set{}, block, fn);
    case FormatId::fp8_e5m2: return dispatch_block<Fp8E5M2>(Set{}, block, fn);
    case FormatId::mxfp8_e4m3: return fn(MxFp8E4M3{});
    case FormatId::mxfp8_e5m2: return fn(MxFp8E5M2{});
    case FormatId::mxfp6_e2m3: return fn(MxFp6E2M3{});
    case FormatId::mxfp6_e3m2: return fn(MxFp6E3M2{});
    case FormatId::mxfp4: return fn(MxFp4{});
    case FormatId::mxint8: return fn(MxInt8{});
    case FormatId::nvfp4: return fn(NvFp4{});
    default: break;
  }
  return dispatch_block<Int8>(Set{}, block, fn);
}
}  // namespace detail

//! Calls fn(F{}) with the format type F named by (id, block) and returns its result. `block` is
//! used by the integer, FP8 and identity formats (a power of two in [32, 8192]); the MX formats
//! have 32 and NVFP4 16, and `block` must then be 0 or that value. Throws qcoll::Error naming
//! `block` otherwise. Instantiates fn for every format and block: meant for tools, not hot paths.
template <class Fn>
decltype(auto) dispatch_format(FormatId id, std::size_t block, Fn&& fn) {
  const bool fixed = id >= FormatId::mxfp8_e4m3;
  if (fixed) {
    const std::size_t want = id == FormatId::nvfp4 ? 16 : 32;
    QCOLL_REQUIRE(block == 0 || block == want, "dispatch_format", "block", block, "is not the fixed block of",
                  format_name(id) << " (" << want << ")");
  } else {
    QCOLL_REQUIRE(valid_block(block), "dispatch_format", "block", block, "is not",
                  "a power of two in [32, 8192]");
  }
  switch (id) {
    case FormatId::identity_f32: return detail::dispatch_block<detail::IdF32>(detail::AllBlocks{}, block, fn);
    case FormatId::identity_f16: return detail::dispatch_block<detail::IdF16>(detail::AllBlocks{}, block, fn);
    case FormatId::identity_bf16:
      return detail::dispatch_block<detail::IdBf16>(detail::AllBlocks{}, block, fn);
    default: break;
  }
  QCOLL_REQUIRE(id >= FormatId::int8 && id <= FormatId::nvfp4, "dispatch_format", "id", static_cast<int>(id),
                "is not a", "FormatId");
  return detail::dispatch_quantized<detail::AllBlocks>(id, block, fn);
}

QCOLL_NAMESPACE_END
