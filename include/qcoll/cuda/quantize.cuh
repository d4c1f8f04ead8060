#pragma once
//! \file
//! Device (CUDA) kernels with the contracts of host/quantize.hpp: quantize a tensor into a packed
//! message (optionally reading its blocks through the qgZ reorder), dequantize a message, and sum
//! k messages in fp32 (then write the sum as a tensor, or re-quantize it into a message of another
//! format).
//!
//! For the same inputs the results equal the host kernels' bit for bit: same header, message
//! meta, codes, scale bytes and padding zeros. The one exception is the payload of a NaN that
//! arithmetic produced (a NaN block decoded, a sum with a NaN term) when it is stored as fp32 (a
//! float output, an Identity<float> code re-quantized from sums): the host propagates an operand's
//! payload, the GPU its canonical NaN. Either way the value is a NaN.
//!
//! Every function is stream-ordered: it checks its arguments on the host (throwing qcoll::Error,
//! launching nothing), enqueues kernels on `stream` and returns without waiting. No function
//! allocates or synchronises, so all of them can be captured in a CUDA graph. Any element count
//! 0 <= n <= max_count<F>() (larger counts throw qcoll::Error naming n and the limit) and any
//! block size of the format work; tails and padding are handled in the kernels.
//! Input and output pointers need no particular alignment: 16-byte vector loads and stores are
//! used where the pointers allow it (checked at run time), element-wise access elsewhere.
//!
//! NVFP4 needs the message's absmax before it can encode any block; its quantizers take a
//! workspace of workspace_bytes<F>(n) bytes (kWorkspaceAlignment-aligned device memory) that holds
//! that running maximum. Formats without a message scale need none.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <type_traits>

#include "../core/error.hpp"
#include "../core/fpmath.hpp"
#include "../core/half.hpp"
#include "../core/rng.hpp"
#include "../format/format.hpp"
#include "../format/message.hpp"
#include "../host/quantize.hpp"
#include "../layout/qgz.hpp"
#include "check.cuh"

QCOLL_NAMESPACE_BEGIN
namespace gpu {

// Source maps (where each message block reads its input) live in layout/qgz.hpp, shared with the
// host collectives; these names keep them reachable as gpu::SourceMap etc.
using ::qcoll::map_block;
using ::qcoll::map_position;
using ::qcoll::MappedBlock;
using ::qcoll::SourceMap;

//! Alignment (bytes) the workspace of the quantizers must have.
constexpr std::size_t kWorkspaceAlignment = 16;

//! Workspace bytes the quantizers of format F need for n elements: kWorkspaceAlignment for formats
//! with a per-message scale (NVFP4, the running absmax), 0 otherwise. O(1).
template <class F>
constexpr std::size_t workspace_bytes(std::size_t /*n*/) {
  return has_message_scale<F> ? kWorkspaceAlignment : 0;
}

namespace detail {

//! Threads per CUDA thread block of every kernel here.
constexpr int kThreads = 256;
//! Upper bound on grid sizes; kernels loop over the remaining work.
constexpr std::size_t kMaxGrid = std::size_t{1} << 30;

// ---------------------------------------------------------------------------------------------
// Format traits
// ---------------------------------------------------------------------------------------------

//! True when F's make_meta reads BlockStats::lo / hi (the asymmetric integers). Defaults to true
//! so a new format gets the full statistics; formats known to use only absmax opt out.
template <class F>
struct uses_range : std::true_type {};
template <unsigned Bits, std::size_t Block>
struct uses_range<SymmetricInt<Bits, Block>> : std::false_type {};
template <class E, std::size_t Block>
struct uses_range<Fp8Scaled<E, Block>> : std::false_type {};
template <class E>
struct uses_range<MxFloat<E>> : std::false_type {};
template <>
struct uses_range<MxInt8> : std::false_type {};
template <>
struct uses_range<NvFp4> : std::false_type {};
template <class W, std::size_t Block>
struct uses_range<Identity<W, Block>> : std::false_type {};

//! True for the unquantized Identity formats (no statistics, element-wise kernels).
template <class F>
struct is_identity : std::false_type {};
template <class W, std::size_t Block>
struct is_identity<Identity<W, Block>> : std::true_type {};

//! How the block kernels spread one format block over threads: each thread holds kIters vectors of
//! kVec consecutive elements (vector r of thread t starts at element (r * kGroup + t) * kVec), a
//! group of kGroup threads covers one block, and a CUDA thread block covers kBlocksPerCta blocks.
template <std::size_t Block, int Vec>
struct Geometry {
  static constexpr int kVec = Vec;
  static constexpr int kBlock = static_cast<int>(Block);
  static_assert(kBlock % kVec == 0, "the block must be a multiple of the vector width");
  static constexpr int kVecs = kBlock / kVec;  // vectors per format block
  static constexpr int kGroup = kVecs / 2 < 1 ? 1 : (kVecs / 2 > kThreads ? kThreads : kVecs / 2);
  static constexpr int kIters = kVecs / kGroup;
  static constexpr int kBlocksPerCta = kThreads / kGroup;
  static_assert(kGroup * kIters == kVecs && kThreads % kGroup == 0, "bad block geometry");
  static_assert(kGroup <= 32 || kGroup % 32 == 0, "groups above a warp must be whole warps");
};

// ---------------------------------------------------------------------------------------------
// Bit and element I/O
// ---------------------------------------------------------------------------------------------

QCOLL_HOST_DEVICE bool is_aligned16(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

//! Mask of the low Bits bits.
template <unsigned Bits>
constexpr std::uint32_t kCodeMask = Bits >= 32 ? 0xffffffffu : ((1u << (Bits % 32)) - 1u);

//! 32-bit words holding N codes of Bits bits.
template <unsigned Bits, int N>
constexpr int kCodeWords = static_cast<int>((N * Bits + 31) / 32);

//! Packs N codes into a little-endian bit stream (code 0 in the lowest bits), as host pack_block.
template <unsigned Bits, int N>
QCOLL_DEVICE void pack_codes(const std::uint32_t (&c)[N], std::uint32_t (&w)[kCodeWords<Bits, N>]) {
#pragma unroll
  for (int i = 0; i < kCodeWords<Bits, N>; ++i) w[i] = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const std::uint32_t v = c[k] & kCodeMask<Bits>;
    const unsigned bit = static_cast<unsigned>(k) * Bits;
    const unsigned shift = bit % 32;
    w[bit / 32] |= v << shift;
    if (shift + Bits > 32) w[bit / 32 + 1] |= v >> (32 - shift);
  }
}

//! Inverse of pack_codes.
template <unsigned Bits, int N>
QCOLL_DEVICE void unpack_codes(const std::uint32_t (&w)[kCodeWords<Bits, N>], std::uint32_t (&c)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const unsigned bit = static_cast<unsigned>(k) * Bits;
    const unsigned shift = bit % 32;
    std::uint32_t v = w[bit / 32] >> shift;
    if (shift + Bits > 32) v |= w[bit / 32 + 1] << (32 - shift);
    c[k] = v & kCodeMask<Bits>;
  }
}

//! Stores the first Bytes bytes of w at p: one or more 16-, 8-, 4- or 2-byte stores when
//! `aligned` (p is then a multiple of min(Bytes, 16)), byte stores otherwise.
template <int Bytes, int W>
QCOLL_DEVICE void store_bytes(unsigned char* p, const std::uint32_t (&w)[W], bool aligned) {
  static_assert(Bytes <= 4 * W, "not enough words");
  if (aligned) {
    if constexpr (Bytes % 16 == 0) {
#pragma unroll
      for (int i = 0; i < Bytes / 16; ++i)
        reinterpret_cast<uint4*>(p)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
      return;
    } else if constexpr (Bytes == 8) {
      *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
      return;
    } else if constexpr (Bytes == 4) {
      *reinterpret_cast<std::uint32_t*>(p) = w[0];
      return;
    } else if constexpr (Bytes == 2) {
      *reinterpret_cast<std::uint16_t*>(p) = static_cast<std::uint16_t>(w[0]);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < Bytes; ++j) p[j] = static_cast<unsigned char>(w[j / 4] >> (8 * (j % 4)));
}

//! Loads Bytes bytes from p into w (unused high bytes of the last word are zero); alignment as
//! store_bytes.
template <int Bytes, int W>
QCOLL_DEVICE void load_bytes(const unsigned char* p, std::uint32_t (&w)[W], bool aligned) {
  static_assert(Bytes <= 4 * W, "not enough words");
  if (aligned) {
    if constexpr (Bytes % 16 == 0) {
#pragma unroll
      for (int i = 0; i < Bytes / 16; ++i) {
        const uint4 q = reinterpret_cast<const uint4*>(p)[i];
        w[4 * i] = q.x;
        w[4 * i + 1] = q.y;
        w[4 * i + 2] = q.z;
        w[4 * i + 3] = q.w;
      }
      return;
    } else if constexpr (Bytes == 8) {
      const uint2 q = *reinterpret_cast<const uint2*>(p);
      w[0] = q.x;
      w[1] = q.y;
      return;
    } else if constexpr (Bytes == 4) {
      w[0] = *reinterpret_cast<const std::uint32_t*>(p);
      return;
    } else if constexpr (Bytes == 2) {
      w[0] = *reinterpret_cast<const std::uint16_t*>(p);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < W; ++i) w[i] = 0;
#pragma unroll
  for (int j = 0; j < Bytes; ++j) w[j / 4] |= static_cast<std::uint32_t>(p[j]) << (8 * (j % 4));
}

//! Loads the N codes of elements [e, e + N) from a message's code area (e a multiple of N, N a
//! multiple of 4 for 6-bit codes). `aligned`: the code area is 16-byte aligned.
template <unsigned Bits, int N>
QCOLL_DEVICE void load_codes(const unsigned char* codes, std::size_t e, std::uint32_t (&c)[N], bool aligned) {
  constexpr int bytes = static_cast<int>(N * Bits / 8);
  static_assert(N * Bits % 8 == 0, "a code run must fill whole bytes");
  std::uint32_t w[kCodeWords<Bits, N>];
  load_bytes<bytes>(codes + e * Bits / 8, w, aligned);
  unpack_codes<Bits, N>(w, c);
}

//! Code of element e of a message's code area, read byte by byte.
template <unsigned Bits>
QCOLL_DEVICE std::uint32_t read_code(const unsigned char* codes, std::size_t e) {
  const std::size_t bit = e * Bits;
  const unsigned char* p = codes + bit / 8;
  const unsigned shift = static_cast<unsigned>(bit % 8);
  std::uint64_t acc = 0;
#pragma unroll
  for (unsigned j = 0; j < (Bits + 14) / 8; ++j)
    if (8 * j < shift + Bits) acc |= static_cast<std::uint64_t>(p[j]) << (8 * j);
  return static_cast<std::uint32_t>(acc >> shift) & kCodeMask<Bits>;
}

//! Writes the code of element e (whole-byte codes only: 8, 16 or 32 bits).
template <unsigned Bits>
QCOLL_DEVICE void write_code(unsigned char* codes, std::size_t e, std::uint32_t c) {
  static_assert(Bits % 8 == 0, "write_code needs whole-byte codes");
#pragma unroll
  for (unsigned j = 0; j < Bits / 8; ++j)
    codes[e * (Bits / 8) + j] = static_cast<unsigned char>(c >> (8 * j));
}

//! Exact binary16 -> float, bit-identical to qcoll::half_bits_to_float (NaN -> 0x7fffffff) but
//! branch-free: a subnormal is its mantissa times 2^-24, one exact multiplication. Keeps the
//! kernels reading fp16 as light as those reading bf16.
QCOLL_HOST_DEVICE float half_bits_to_float_fast(std::uint32_t h) {
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t man = h & 0x3ffu;
  const std::uint32_t normal = sign | ((exp + 112u) << 23) | (man << 13);
  const std::uint32_t special = man != 0 ? 0x7fffffffu : (sign | 0x7f800000u);
  const std::uint32_t sub = sign | fp::bits(fp::mul(static_cast<float>(man), 5.9604644775390625e-8f));
  return fp::from_bits(exp == 0x1fu ? special : (exp != 0 ? normal : sub));
}

//! Widens the raw bits of one element of type T.
template <class T>
QCOLL_DEVICE float element_from_bits(std::uint32_t u) {
  if constexpr (sizeof(T) == 4) {
    return fp::from_bits(u);
  } else if constexpr (std::is_same<T, half>::value) {
    return half_bits_to_float_fast(u & 0xffffu);
  } else {
    return to_float(T{static_cast<std::uint16_t>(u)});
  }
}

//! Widens one element of type T.
template <class T>
QCOLL_DEVICE float element_to_float(T x) {
  if constexpr (std::is_same<T, half>::value) {
    return half_bits_to_float_fast(x.bits);
  } else {
    return to_float(x);
  }
}

//! Raw bits of element type T nearest (even) to v.
template <class T>
QCOLL_DEVICE std::uint32_t element_bits(float v) {
  if constexpr (sizeof(T) == 4) {
    return fp::bits(v);
  } else {
    return from_float<T>(v).bits;
  }
}

//! Loads 16 bytes of T (p 16-byte aligned) as floats.
template <class T>
QCOLL_DEVICE void load_elements(const T* p, float (&v)[16 / sizeof(T)]) {
  const uint4 q = *reinterpret_cast<const uint4*>(p);
  const std::uint32_t w[4] = {q.x, q.y, q.z, q.w};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = fp::from_bits(w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = element_from_bits<T>(w[i] & 0xffffu);
      v[2 * i + 1] = element_from_bits<T>(w[i] >> 16);
    }
  }
}

//! Stores N floats (N * sizeof(T) a multiple of 16) as T at p: 16-byte stores when `aligned`,
//! element stores otherwise.
template <class T, int N>
QCOLL_DEVICE void store_elements(T* p, const float (&v)[N], bool aligned) {
  constexpr int per_word = static_cast<int>(4 / sizeof(T));
  constexpr int words = N / per_word;
  static_assert(N % per_word == 0 && words % 4 == 0, "store_elements writes whole 16-byte vectors");
  if (aligned) {
    std::uint32_t w[words];
#pragma unroll
    for (int i = 0; i < words; ++i) {
      if constexpr (per_word == 1) {
        w[i] = element_bits<T>(v[i]);
      } else {
        w[i] = element_bits<T>(v[2 * i]) | (element_bits<T>(v[2 * i + 1]) << 16);
      }
    }
    constexpr int kBytes = N * static_cast<int>(sizeof(T));
    store_bytes<kBytes>(reinterpret_cast<unsigned char*>(p), w, true);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = from_float<T>(v[j]);
  }
}

// ---------------------------------------------------------------------------------------------
// Decoding messages
// ---------------------------------------------------------------------------------------------

//! Message meta (NVFP4 tensor scale) of a message, or 0.
template <class F>
QCOLL_DEVICE float message_scale_of(const unsigned char* msg) {
  if constexpr (has_message_scale<F>) {
    return ::qcoll::detail::load_f32(msg + MessageLayout<F>::message_meta_offset);
  } else {
    return 0.0f;
  }
}

//! Decodes elements [e, e + N) of a message of n elements (all inside one block; e a multiple of
//! N). `aligned`: the message starts 16-byte aligned.
template <class F, int N>
QCOLL_DEVICE void decode_run(const unsigned char* msg, std::size_t n, std::size_t e, bool aligned,
                             float (&v)[N]) {
  using L = MessageLayout<F>;
  const typename F::Meta m =
      F::load_meta(msg + L::metas_offset(n) + (e / F::block) * F::meta_bytes, message_scale_of<F>(msg));
  std::uint32_t c[N];
  load_codes<F::code_bits, N>(msg + L::codes_offset, e, c, aligned);
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = F::decode(c[j], m);
}

//! Decodes element e of a message of n elements.
template <class F>
QCOLL_DEVICE float decode_one(const unsigned char* msg, std::size_t n, std::size_t e) {
  using L = MessageLayout<F>;
  const typename F::Meta m =
      F::load_meta(msg + L::metas_offset(n) + (e / F::block) * F::meta_bytes, message_scale_of<F>(msg));
  return F::decode(read_code<F::code_bits>(msg + L::codes_offset, e), m);
}

//! What a reduction does to its fp32 sum at the end: multiply by `value` (dequantize_reduce's
//! post_scale) or divide by it (a collective's mean: sum / world size, one rounding, as the host
//! plans). Skipped when value is 1, which changes no bits either way.
struct PostOp {
  float value = 1.0f;
  bool divide = false;
  QCOLL_HOST_DEVICE float apply(float x) const {
    if (value == 1.0f) return x;
    return divide ? fp::div(x, value) : fp::mul(x, value);
  }
};

//! The fp32 sum, in message order starting from +0, of k messages of n elements (message i at
//! msgs + i * stride), then post.apply; elements [e, e + N).
template <class F, int N>
QCOLL_DEVICE void reduce_run(const unsigned char* msgs, std::size_t stride, int k, std::size_t n, PostOp post,
                             std::size_t e, bool aligned, float (&v)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = 0.0f;
  for (int i = 0; i < k; ++i) {
    float d[N];
    decode_run<F, N>(msgs + static_cast<std::size_t>(i) * stride, n, e, aligned, d);
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = fp::add(v[j], d[j]);
  }
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = post.apply(v[j]);
}

//! reduce_run for one element.
template <class F>
QCOLL_DEVICE float reduce_one(const unsigned char* msgs, std::size_t stride, int k, std::size_t n,
                              PostOp post, std::size_t e) {
  float v = 0.0f;
  for (int i = 0; i < k; ++i)
    v = fp::add(v, decode_one<F>(msgs + static_cast<std::size_t>(i) * stride, n, e));
  return post.apply(v);
}

// ---------------------------------------------------------------------------------------------
// Inputs of the quantizing kernels
// ---------------------------------------------------------------------------------------------
//
// An Input hands the kernels the values of a message of n elements, as floats:
//   kVec                         elements per vector
//   n                            message elements
//   span<Block>(b)               block b: Span{offset, valid, vec}
//   load(span, e)                lanes [e, e + kVec) of the block (e a multiple of kVec) as one
//                                16-byte vector of raw element bits; lanes >= valid hold +0 and
//                                must be masked by the caller
//   value(vector, j)             lane j of such a vector as a float
//   load_run(p, v)               message elements [p, p + kVec) if all hold data and can be read
//                                as one vector; false otherwise
//   load_one(p, valid)           message element p, valid = it holds data (0 otherwise)

//! A block of an Input: where it starts, how many elements hold data, whether it can be read in
//! whole vectors.
struct Span {
  std::size_t offset;
  std::size_t valid;
  bool vec;
};

//! A tensor of T read through a SourceMap.
template <class T>
struct TensorInput {
  static constexpr int kVec = static_cast<int>(16 / sizeof(T));
  const T* in;
  SourceMap map;
  std::size_t n;

  template <std::size_t Block>
  QCOLL_DEVICE Span span(std::size_t b) const {
    const MappedBlock mb = map_block(map, b, Block, n);
    return Span{mb.offset, mb.valid, mb.valid == Block && is_aligned16(in + mb.offset)};
  }
  QCOLL_DEVICE uint4 load(const Span& s, int e) const {
    if (s.vec) return *reinterpret_cast<const uint4*>(in + s.offset + e);
    std::uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const std::size_t i = static_cast<std::size_t>(e + j);
      if (i < s.valid) {
        if constexpr (sizeof(T) == 4) {
          w[j] = fp::bits(in[s.offset + i]);
        } else {
          w[j / 2] |= static_cast<std::uint32_t>(in[s.offset + i].bits) << (16 * (j % 2));
        }
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  //! Lane j of a vector returned by load().
  static QCOLL_DEVICE float value(const uint4& q, int j) {
    const std::uint32_t w = j / (kVec / 4) == 0   ? q.x
                            : j / (kVec / 4) == 1 ? q.y
                            : j / (kVec / 4) == 2 ? q.z
                                                  : q.w;
    if constexpr (sizeof(T) == 4) {
      return fp::from_bits(w);
    } else {
      return element_from_bits<T>(j % 2 == 0 ? (w & 0xffffu) : (w >> 16));
    }
  }
  QCOLL_DEVICE bool load_run(std::size_t p, float (&v)[kVec]) const {
    if (p + kVec > n) return false;
    const std::size_t s0 = map_position(map, map.position0 + p);
    const std::size_t s1 = map_position(map, map.position0 + p + (kVec - 1));
    if (s1 != s0 + (kVec - 1) || map_data(map, s0, kVec) != kVec || !is_aligned16(in + s0)) return false;
    load_elements(in + s0, v);
    return true;
  }
  QCOLL_DEVICE float load_one(std::size_t p, bool& valid) const {
    valid = false;
    if (p >= n) return 0.0f;
    const std::size_t s = map_position(map, map.position0 + p);
    valid = map_data(map, s, 1) != 0;
    return valid ? element_to_float(in[s]) : 0.0f;
  }
};

//! The fp32 sum (then post) of k messages of msg_n elements of format F, read from message
//! element `first` on: element p of this input is the reduction of element first + p. Elements
//! p >= valid (valid <= n) are padding: left out of the statistics, code 0, and so are the
//! elements a tensor group's `slots` mark as padding (input element p at global position
//! slot_base + p; slots = 0: none). `first` and the
//! message's block size keep every block of this input inside one block of F's messages when
//! first is a multiple of the smaller of the two blocks and both are powers of two.
template <class F>
struct ReduceInput {
  static constexpr int kVec = 4;
  const unsigned char* msgs;
  std::size_t stride;
  int k;
  std::size_t msg_n;  // elements per source message
  std::size_t first;  // source element of input element 0
  std::size_t n;      // input elements (the message written has n elements)
  std::size_t valid;  // input elements holding data
  PostOp post;
  bool aligned;           // every message starts 16-byte aligned
  SlotTable slots;        // a tensor group's slots in device memory (slots = 0: flat)
  std::size_t slot_base;  // global position of input element 0

  //! Data elements at the start of input elements [at, at + count) (a run inside one block).
  QCOLL_DEVICE std::size_t data(std::size_t at, std::size_t count) const {
    const std::size_t v = at >= valid ? 0 : (valid - at < count ? valid - at : count);
    return slots.slots > 0 && v > 0 ? data_in_slots(slots, slot_base + at, v) : v;
  }
  template <std::size_t Block>
  QCOLL_DEVICE Span span(std::size_t b) const {
    const std::size_t at = b * Block;
    const std::size_t v = data(at, Block);
    return Span{at, v, aligned && v == Block && (first + at) % kVec == 0};
  }
  QCOLL_DEVICE uint4 load(const Span& s, int e) const {
    float v[kVec];
    if (s.vec) {
      reduce_run<F, kVec>(msgs, stride, k, msg_n, post, first + s.offset + static_cast<std::size_t>(e), true,
                          v);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const std::size_t i = static_cast<std::size_t>(e + j);
        v[j] = i < s.valid ? reduce_one<F>(msgs, stride, k, msg_n, post, first + s.offset + i) : 0.0f;
      }
    }
    return make_uint4(fp::bits(v[0]), fp::bits(v[1]), fp::bits(v[2]), fp::bits(v[3]));
  }
  //! Lane j of a vector returned by load().
  static QCOLL_DEVICE float value(const uint4& q, int j) {
    return fp::from_bits(j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w);
  }
  QCOLL_DEVICE bool load_run(std::size_t p, float (&v)[kVec]) const {
    if (data(p, kVec) != kVec || (first + p) % kVec != 0) return false;
    reduce_run<F, kVec>(msgs, stride, k, msg_n, post, first + p, aligned, v);
    return true;
  }
  QCOLL_DEVICE float load_one(std::size_t p, bool& ok) const {
    ok = data(p, 1) != 0;
    return ok ? reduce_one<F>(msgs, stride, k, msg_n, post, first + p) : 0.0f;
  }
};

// ---------------------------------------------------------------------------------------------
// Reductions inside a group of threads
// ---------------------------------------------------------------------------------------------

//! Butterfly over the G lanes of an aligned group (G <= 32: the group; G > 32: the warp): each step
//! sets x = op(partner's x, x). Every lane of the warp must call it (full mask).
template <int G, class V, class Op>
QCOLL_DEVICE V group_reduce(V x, Op op) {
#pragma unroll
  for (int o = (G < 32 ? G : 32) / 2; o > 0; o /= 2) x = op(__shfl_xor_sync(0xffffffffu, x, o), x);
  return x;
}
//! op(y, x) = the larger (y only if strictly larger).
struct TakeLarger {
  template <class V>
  QCOLL_DEVICE V operator()(V y, V x) const {
    return y > x ? y : x;
  }
};
//! op(y, x) = the smaller (y only if strictly smaller).
struct TakeSmaller {
  template <class V>
  QCOLL_DEVICE V operator()(V y, V x) const {
    return y < x ? y : x;
  }
};
template <int G>
QCOLL_DEVICE std::uint32_t group_max_u32(std::uint32_t x) {
  return group_reduce<G>(x, TakeLarger{});
}
template <int G>
QCOLL_DEVICE std::uint32_t group_min_u32(std::uint32_t x) {
  return group_reduce<G>(x, TakeSmaller{});
}
template <int G>
QCOLL_DEVICE float group_min_f32(float x) {
  return group_reduce<G>(x, TakeSmaller{});
}
template <int G>
QCOLL_DEVICE float group_max_f32(float x) {
  return group_reduce<G>(x, TakeLarger{});
}

//! Per-warp partial statistics of a group spanning several warps.
struct Partial {
  std::uint32_t umax;  // max of |x| bits over valid lanes, non-finite included
  std::uint32_t fmax;  // max of |x| bits over valid finite lanes
  std::uint32_t zkey;  // min of (lane << 1 | sign) over valid zero lanes
  float lo, hi;        // min / max over valid finite lanes
};

struct MaxU32 {
  QCOLL_DEVICE std::uint32_t operator()(std::uint32_t a, std::uint32_t b) const { return a > b ? a : b; }
};

//! ORs `flags` into the header of the message at `msg` (any alignment): each non-zero byte is
//! ORed atomically into the aligned 32-bit word that holds it.
QCOLL_DEVICE void or_header_flags(unsigned char* msg, std::uint32_t flags) {
  constexpr std::size_t kFlagsOffset = 4;  // MessageHeader::flags
#pragma unroll
  for (unsigned j = 0; j < 4; ++j) {
    const std::uint32_t byte = (flags >> (8 * j)) & 0xffu;
    if (byte == 0) continue;
    const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(msg + kFlagsOffset + j);
    auto* word = reinterpret_cast<unsigned int*>(addr & ~static_cast<std::uintptr_t>(3));
    atomicOr(word, byte << (8 * (addr & 3u)));
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

//! Writes the header of a message of n elements of F with flags 0, zeroes every padding byte
//! outside the blocks' codes and metas (message meta area, code and meta padding) and the absmax
//! scratch (if any). One warp.
template <class F>
__global__ void message_prologue_kernel(unsigned char* out, std::size_t n, std::uint64_t tag,
                                        std::uint32_t* amax_bits) {
  using L = MessageLayout<F>;
  static_assert(offsetof(MessageHeader, magic) == 0 && offsetof(MessageHeader, format) == 2 &&
                    offsetof(MessageHeader, log2_block) == 3 && offsetof(MessageHeader, flags) == 4 &&
                    offsetof(MessageHeader, count) == 8 && offsetof(MessageHeader, tag) == 16 &&
                    offsetof(MessageHeader, reserved) == 24 && sizeof(MessageHeader) == 32,
                "MessageHeader layout");
  const MessageHeader h = make_header<F>(n, tag);
  const std::uint64_t words[4] = {
      static_cast<std::uint64_t>(h.magic) | (static_cast<std::uint64_t>(h.format) << 16) |
          (static_cast<std::uint64_t>(h.log2_block) << 24) | (static_cast<std::uint64_t>(h.flags) << 32),
      h.count, h.tag, h.reserved};
  const unsigned i = threadIdx.x;
  if (i < 32) out[i] = static_cast<unsigned char>(words[i / 8] >> (8 * (i % 8)));
  const std::size_t nb = L::blocks(n);
  const std::size_t pads[3][2] = {
      {L::message_meta_offset, L::codes_offset},
      {L::codes_offset + nb * L::block_code_bytes, L::metas_offset(n)},
      {L::metas_offset(n) + nb * F::meta_bytes, L::bytes(n)},
  };
  for (int r = 0; r < 3; ++r)
    for (std::size_t o = pads[r][0] + i; o < pads[r][1]; o += blockDim.x) out[o] = 0;
  if (amax_bits != nullptr && i == 0) *amax_bits = 0u;
}

//! Message absmax over finite values (as float bits; max-ed into *amax_bits, which starts at 0).
template <class F, class Input>
__global__ void __launch_bounds__(kThreads) absmax_kernel(Input input, std::uint32_t* amax_bits) {
  using Geo = Geometry<F::block, Input::kVec>;
  constexpr int V = Geo::kVec, G = Geo::kGroup, R = Geo::kIters, BPC = Geo::kBlocksPerCta;
  const std::size_t nb = MessageLayout<F>::blocks(input.n);
  const int g = static_cast<int>(threadIdx.x) / G;
  const int t = static_cast<int>(threadIdx.x) % G;
  std::uint32_t m = 0;
  for (std::size_t tile = blockIdx.x; tile * BPC < nb; tile += gridDim.x) {
    const std::size_t b = tile * BPC + static_cast<std::size_t>(g);
    if (b >= nb) continue;
    const Span s = input.template span<F::block>(b);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4 q = input.load(s, (r * G + t) * V);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const std::uint32_t u = fp::bits(Input::value(q, j)) & 0x7fffffffu;
        const std::uint32_t f = u < 0x7f800000u ? u : 0u;
        m = f > m ? f : m;
      }
    }
  }
  using BlockReduce = cub::BlockReduce<std::uint32_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage tmp;
  const std::uint32_t total = BlockReduce(tmp).Reduce(m, MaxU32{});
  if (threadIdx.x == 0 && total != 0) atomicMax(amax_bits, total);
}

//! Quantizes the blocks of a message of input.n elements of F (not Identity) into `out`, whose
//! header and padding message_prologue_kernel has written. Per block: statistics reduced over
//! the block's group of threads (shuffles, then shared memory for groups of several warps),
//! F::make_meta, meta bytes from the group's first thread, codes from every thread.
template <class F, class Input>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(Input input, unsigned char* out, bool out_aligned, host::QuantizeOptions opt,
                    const std::uint32_t* amax_bits) {
  using Geo = Geometry<F::block, Input::kVec>;
  using L = MessageLayout<F>;
  constexpr int V = Geo::kVec, G = Geo::kGroup, R = Geo::kIters, BPC = Geo::kBlocksPerCta;
  constexpr unsigned kBits = F::code_bits;
  constexpr int kVecBytes = static_cast<int>(V * kBits / 8);
  static_assert(V * kBits % 8 == 0, "a vector of codes must fill whole bytes");
  constexpr std::uint32_t kInfBits = 0x7f800000u;
  __shared__ Partial partials[kThreads / 32];

  const std::size_t n = input.n;
  const std::size_t nb = L::blocks(n);
  const int g = static_cast<int>(threadIdx.x) / G;
  const int t = static_cast<int>(threadIdx.x) % G;
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) {
    mscale = F::message_scale(fp::from_bits(*amax_bits));
    if (blockIdx.x == 0 && threadIdx.x == 0) ::qcoll::detail::store_f32(out + L::message_meta_offset, mscale);
  }
  unsigned char* const codes = out + L::codes_offset;
  unsigned char* const metas = out + L::metas_offset(n);
  bool bad = false;

  // The loop condition is the same for every thread of the CUDA block (barriers inside).
  for (std::size_t tile = blockIdx.x; tile * BPC < nb; tile += gridDim.x) {
    const std::size_t b = tile * BPC + static_cast<std::size_t>(g);
    const bool active = b < nb;
    const Span s = active ? input.template span<F::block>(b) : Span{0, 0, false};
    uint4 q[R];  // raw element bits: 16-bit inputs stay packed until used
#pragma unroll
    for (int r = 0; r < R; ++r) q[r] = input.load(s, (r * G + t) * V);

    // |x| maximum over valid lanes, as bits (inactive and padding lanes hold +0).
    std::uint32_t umax = 0;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const std::uint32_t u = fp::bits(Input::value(q[r], j)) & 0x7fffffffu;
        umax = u > umax ? u : umax;
      }
    umax = group_max_u32<G>(umax);
    // The finite absmax differs only when the block holds NaN/Inf (rare): computed then.
    std::uint32_t fmax = umax;
    if (__any_sync(0xffffffffu, umax >= kInfBits)) {
      std::uint32_t f = 0;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const std::uint32_t u = fp::bits(Input::value(q[r], j)) & 0x7fffffffu;
          f = (u < kInfBits && u > f) ? u : f;
        }
      fmax = group_max_u32<G>(f);
    }
    float lo = fp::from_bits(0x7f800000u), hi = fp::from_bits(0xff800000u);
    std::uint32_t zkey = 0xffffffffu;
    if constexpr (uses_range<F>::value) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const int e = (r * G + t) * V + j;
          const float x = Input::value(q[r], j);
          const bool ok = static_cast<std::size_t>(e) < s.valid && fp::is_finite(x);
          lo = ok && x < lo ? x : lo;
          hi = ok && x > hi ? x : hi;
        }
      lo = group_min_f32<G>(lo);
      hi = group_max_f32<G>(hi);
      // The host keeps the first of equal extremes in element order; only ±0 compare equal with
      // different bits, so when an extreme is zero the sign of the first zero decides.
      if (__any_sync(0xffffffffu, lo == 0.0f || hi == 0.0f)) {
        std::uint32_t z = 0xffffffffu;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const int e = (r * G + t) * V + j;
            const float x = Input::value(q[r], j);
            const std::uint32_t key = (static_cast<std::uint32_t>(e) << 1) | (fp::bits(x) >> 31);
            z = (static_cast<std::size_t>(e) < s.valid && x == 0.0f && key < z) ? key : z;
          }
        zkey = group_min_u32<G>(z);
      }
    }
    if constexpr (G > 32) {
      const int lane = static_cast<int>(threadIdx.x) % 32;
      const int warp = static_cast<int>(threadIdx.x) / 32;
      if (lane == 0) partials[warp] = Partial{umax, fmax, zkey, lo, hi};
      __syncthreads();
      const int w0 = g * (G / 32);
#pragma unroll
      for (int w = 0; w < G / 32; ++w) {
        const Partial p = partials[w0 + w];
        umax = p.umax > umax ? p.umax : umax;
        fmax = p.fmax > fmax ? p.fmax : fmax;
        zkey = p.zkey < zkey ? p.zkey : zkey;
        lo = p.lo < lo ? p.lo : lo;
        hi = p.hi > hi ? p.hi : hi;
      }
      __syncthreads();
    }
    if constexpr (uses_range<F>::value) {
      const float zero = fp::from_bits((zkey & 1u) << 31);
      lo = lo == 0.0f ? zero : lo;
      hi = hi == 0.0f ? zero : hi;
    }
    const bool nonfinite = umax >= kInfBits;
    const BlockStats st{fp::from_bits(fmax), lo, hi, nonfinite};
    const typename F::Meta m = F::make_meta(st, mscale);
    if (active) {
      if (t == 0) {
        F::store_meta(m, metas + b * F::meta_bytes);
        bad = bad || nonfinite;
      }
      const std::uint64_t index0 = opt.index_base + static_cast<std::uint64_t>(b) * F::block;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int e = (r * G + t) * V;
        std::uint32_t c[V];
        if (opt.rounding == Rounding::nearest) {
#pragma unroll
          for (int j = 0; j < V; ++j) c[j] = F::encode(Input::value(q[r], j), m);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j)
            c[j] = F::encode_sr(Input::value(q[r], j), m,
                                random_bits(opt.seed, index0 + static_cast<std::uint64_t>(e + j)));
        }
        if (s.valid != F::block) {
#pragma unroll
          for (int j = 0; j < V; ++j) c[j] = static_cast<std::size_t>(e + j) < s.valid ? c[j] : 0u;
        }
        std::uint32_t w[kCodeWords<kBits, V>];
        pack_codes<kBits, V>(c, w);
        store_bytes<kVecBytes>(codes + b * L::block_code_bytes + static_cast<std::size_t>(e) * kBits / 8, w,
                               out_aligned);
      }
    }
  }
  if (__syncthreads_or(bad ? 1 : 0) && threadIdx.x == 0) or_header_flags(out, kFlagNonFinite);
}

//! Identity formats: element-wise conversion of every code position of the message (tail and
//! padding positions get code 0). Like the host (block_nonfinite), a code that is ±Inf or NaN
//! (a NaN/Inf input, or a finite input beyond a 16-bit type's range) sets kFlagNonFinite.
template <class F, class Input>
__global__ void __launch_bounds__(kThreads)
    identity_kernel(Input input, unsigned char* out, bool out_aligned) {
  using L = MessageLayout<F>;
  constexpr int V = Input::kVec;
  constexpr unsigned kBits = F::code_bits;
  const typename F::Meta m{};
  const std::size_t total = L::blocks(input.n) * F::block;
  unsigned char* const codes = out + L::codes_offset;
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x * V;
  bool bad = false;  // padding lanes hold +0, so they never count
  for (std::size_t p = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; p < total;
       p += step) {
    if (p + V <= total) {
      std::uint32_t c[V];
      float v[V];
      if (input.load_run(p, v)) {
#pragma unroll
        for (int j = 0; j < V; ++j) c[j] = F::encode(v[j], m);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          bool ok;
          v[j] = input.load_one(p + j, ok);
          c[j] = ok ? F::encode(v[j], m) : 0u;
        }
      }
#pragma unroll
      for (int j = 0; j < V; ++j) bad = bad || F::code_nonfinite(c[j]);
      std::uint32_t w[kCodeWords<kBits, V>];
      pack_codes<kBits, V>(c, w);
      store_bytes<static_cast<int>(V * kBits / 8)>(codes + p * (kBits / 8), w, out_aligned);
    } else {
      for (std::size_t q = p; q < total; ++q) {
        bool ok;
        const float x = input.load_one(q, ok);
        const std::uint32_t c = ok ? F::encode(x, m) : 0u;
        bad = bad || F::code_nonfinite(c);
        write_code<kBits>(codes, q, c);
      }
    }
  }
  if (__syncthreads_or(bad ? 1 : 0) && threadIdx.x == 0) or_header_flags(out, kFlagNonFinite);
}

//! Result flags that mean "do not write the output" (a rank rejected its arguments, or a
//! received message did not match): see guard_tripped.
constexpr std::uint32_t kGuardFlags = kFlagRejected | kFlagBadMessage;

//! True when `guard` (a device status word, or null) holds a flag of kGuardFlags.
QCOLL_DEVICE bool guard_tripped(const std::uint32_t* guard) {
  return guard != nullptr && (*static_cast<const volatile std::uint32_t*>(guard) & kGuardFlags) != 0;
}

//! Where a decode kernel writes: message q's element e goes to out[q * out_stride + e] (decode:
//! one message per blockIdx.y; reduce: the k messages' sum, q = 0). Outputs at index >= limit get
//! +0 instead of a decoded value (padding past a tensor's end), and so do the outputs a tensor
//! group's `slots` mark as padding (out[i] at global position slot_base + i). Nothing is written
//! when `guard` has tripped (it is read once per thread, before any store).
template <class T>
struct DecodeTarget {
  T* out;
  std::size_t out_stride;
  std::size_t limit;
  const std::uint32_t* guard;
  SlotTable slots;        // in device memory (slots = 0: a flat buffer)
  std::size_t slot_base;  // global position of out[0]
};

//! Decodes (kReduce = false: message blockIdx.y) or sums k messages of n elements of F into
//! target (see DecodeTarget).
template <class F, class T, bool kReduce>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(const unsigned char* msgs, std::size_t stride, int k, std::size_t n, PostOp post,
                  DecodeTarget<T> target, bool msg_aligned, bool out_aligned) {
  if (guard_tripped(target.guard)) return;
  constexpr int E = static_cast<int>(32 / sizeof(T));  // two 16-byte vectors of T per thread
  const std::size_t q = kReduce ? 0 : blockIdx.y;
  const unsigned char* const msg = msgs + q * stride;
  T* const out = target.out + q * target.out_stride;
  const std::size_t base = q * target.out_stride;
  const std::size_t valid = target.limit <= base ? 0 : (target.limit - base < n ? target.limit - base : n);
  const std::size_t runs = (n + E - 1) / E;
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const SlotTable& slots = target.slots;
  const std::size_t g0 = target.slot_base + base;  // global position of out[0]
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < runs; i += step) {
    const std::size_t e = i * E;
    if (e + E <= valid && (slots.slots == 0 || data_in_slots(slots, g0 + e, E) == E)) {
      float v[E];
      if constexpr (kReduce) {
        reduce_run<F, E>(msg, stride, k, n, post, e, msg_aligned, v);
      } else {
        decode_run<F, E>(msg, n, e, msg_aligned, v);
      }
      store_elements<T, E>(out + e, v, out_aligned);
    } else {
      const std::size_t end = e + E < n ? e + E : n;
      for (std::size_t p = e; p < end; ++p) {
        float x = 0.0f;
        if (p < valid && is_data_in_slots(slots, g0 + p)) {
          if constexpr (kReduce) {
            x = reduce_one<F>(msg, stride, k, n, post, p);
          } else {
            x = decode_one<F>(msg, n, p);
          }
        }
        out[p] = from_float<T>(x);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

inline unsigned grid_for(std::size_t units, std::size_t per_cta) {
  std::size_t g = (units + per_cta - 1) / per_cta;
  g = g < kMaxGrid ? g : kMaxGrid;
  return static_cast<unsigned>(g < 1 ? 1 : g);
}

//! CUDA thread blocks that fill the current device once (resident at kThreads threads each).
inline std::size_t resident_ctas() {
  int dev = 0, sms = 0, threads = 0;
  QCOLL_CUDA_CHECK(cudaGetDevice(&dev));
  QCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  QCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
  const int per_sm = threads / kThreads;
  return static_cast<std::size_t>(sms) * static_cast<std::size_t>(per_sm < 1 ? 1 : per_sm);
}

template <class F>
void check_workspace(void* workspace, std::size_t workspace_size, std::size_t n, const char* function) {
  const std::size_t need = workspace_bytes<F>(n);
  if (need == 0) return;
  QCOLL_REQUIRE(workspace != nullptr, function, "workspace", "null",
                "but format " << format_name(F::id) << " needs", need << " bytes (workspace_bytes)");
  QCOLL_REQUIRE(workspace_size >= need, function, "workspace_size", workspace_size, "is below the required",
                need);
  require_aligned(workspace, kWorkspaceAlignment, function, "workspace");
  require_device_accessible(workspace, function, "workspace");
}

//! Enqueues the kernels writing a message of input.n elements of F at `out`.
template <class F, class Input>
void launch_quantize(const Input& input, void* out_ptr, const host::QuantizeOptions& opt, cudaStream_t stream,
                     void* workspace) {
  auto* out = static_cast<unsigned char*>(out_ptr);
  auto* amax = has_message_scale<F> ? static_cast<std::uint32_t*>(workspace) : nullptr;
  message_prologue_kernel<F><<<1, 32, 0, stream>>>(out, input.n, opt.tag, amax);
  QCOLL_CUDA_CHECK_LAUNCH();
  const std::size_t nb = MessageLayout<F>::blocks(input.n);
  if (nb == 0) return;
  const bool out_aligned = is_aligned16(out);
  if constexpr (is_identity<F>::value) {
    const std::size_t runs = (nb * F::block + Input::kVec - 1) / Input::kVec;
    identity_kernel<F, Input><<<grid_for(runs, kThreads), kThreads, 0, stream>>>(input, out, out_aligned);
    QCOLL_CUDA_CHECK_LAUNCH();
  } else {
    using Geo = Geometry<F::block, Input::kVec>;
    const std::size_t tiles = (nb + Geo::kBlocksPerCta - 1) / Geo::kBlocksPerCta;
    if constexpr (has_message_scale<F>) {
      const std::size_t ctas = resident_ctas();
      absmax_kernel<F, Input><<<grid_for(tiles < ctas ? tiles : ctas, 1), kThreads, 0, stream>>>(input, amax);
      QCOLL_CUDA_CHECK_LAUNCH();
    }
    quantize_kernel<F, Input>
        <<<grid_for(tiles, 1), kThreads, 0, stream>>>(input, out, out_aligned, opt, amax);
    QCOLL_CUDA_CHECK_LAUNCH();
  }
}

//! Decodes k messages of n elements of F (message q at msgs + q * stride) into out + q * n,
//! zeroing outputs at index >= limit and those `slots` (device memory) mark as padding (out[i]
//! at global position i); skipped when *guard (if not null) has tripped. One kernel (none for
//! n = 0).
template <class F, class T>
void launch_gather_decode(const unsigned char* msgs, std::size_t stride, int k, std::size_t n, T* out,
                          std::size_t limit, const std::uint32_t* guard, cudaStream_t stream,
                          const SlotTable& slots = SlotTable{}) {
  if (n == 0) return;
  constexpr std::size_t E = 32 / sizeof(T);
  const dim3 grid(grid_for((n + E - 1) / E, kThreads), static_cast<unsigned>(k));
  decode_kernel<F, T, false><<<grid, kThreads, 0, stream>>>(
      msgs, stride, k, n, PostOp{}, DecodeTarget<T>{out, n, limit, guard, slots, 0},
      is_aligned16(msgs) && (k == 1 || stride % 16 == 0),
      is_aligned16(out) && (k == 1 || (n * sizeof(T)) % 16 == 0));
  QCOLL_CUDA_CHECK_LAUNCH();
}

//! Sums k messages of n elements of F into out[0, n) (then post), zeroing out[valid, n) and the
//! outputs `slots` (device memory) mark as padding (out[i] at global position slot_base + i);
//! skipped when *guard (if not null) has tripped. One kernel (none for n = 0).
template <class F, class T>
void launch_reduce(const unsigned char* msgs, std::size_t stride, int k, std::size_t n, PostOp post, T* out,
                   std::size_t valid, const std::uint32_t* guard, cudaStream_t stream,
                   const SlotTable& slots = SlotTable{}, std::size_t slot_base = 0) {
  if (n == 0) return;
  constexpr std::size_t E = 32 / sizeof(T);
  decode_kernel<F, T, true><<<grid_for((n + E - 1) / E, kThreads), kThreads, 0, stream>>>(
      msgs, stride, k, n, post, DecodeTarget<T>{out, 0, valid, guard, slots, slot_base},
      is_aligned16(msgs) && (k == 1 || stride % 16 == 0), is_aligned16(out));
  QCOLL_CUDA_CHECK_LAUNCH();
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------------

//! Quantizes in[0, n) (device memory) into one packed message of format F at `out` (device
//! memory, packed_bytes<F>(n) bytes, any alignment), on `stream`. The message equals the one
//! host::quantize<F, T> writes for the same input and options, byte for byte. Blocks holding
//! NaN/Inf get a NaN scale and set kFlagNonFinite in the header. For NVFP4 pass a workspace of
//! workspace_bytes<F>(n) bytes (16-byte aligned device memory); other formats need none. Throws
//! qcoll::Error, enqueuing nothing, if `in` is null with n > 0, `out` is null, a pointer is not
//! device-accessible, or the workspace is missing, too small or misaligned; launch failures throw
//! with the CUDA runtime's message. O(n) work in two or three kernels; no allocation, no host
//! synchronisation.
template <class F, class T>
void quantize(const T* in, std::size_t n, void* out, const host::QuantizeOptions& opt, cudaStream_t stream,
              void* workspace = nullptr, std::size_t workspace_size = 0) {
  const char* fn = "gpu::quantize";
  checked_packed_bytes<F>(n, fn, "n");
  QCOLL_REQUIRE(in != nullptr || n == 0, fn, "in", "null", "with n =", n);
  QCOLL_REQUIRE(out != nullptr, fn, "out", "null", "needs", packed_bytes<F>(n) << " bytes");
  if (n > 0) require_device_accessible(in, fn, "in");
  require_device_accessible(out, fn, "out");
  detail::check_workspace<F>(workspace, workspace_size, n, fn);
  detail::launch_quantize<F>(detail::TensorInput<T>{in, SourceMap::identity(n), n}, out, opt, stream,
                             workspace);
}

//! Quantizes a message of n elements whose block b reads `in` through `map` (map_block: source
//! offset and valid count; offsets >= map.numel are padding), e.g. the fused qgZ reorder: chunk j
//! of the reordered gradient is the message with position0 = j * N * shard_numel and n = N *
//! shard_numel. Equals host::detail::quantize_blocks<F, T> with the source
//! `[&](b) { auto mb = map_block(map, b, F::block, n); return BlockSource<T>{in + mb.offset,
//! mb.valid}; }` byte for byte. Besides quantize's checks, for the qgZ reorder it requires
//! num_nodes, ranks_per_node >= 1, rank_at non-null and device-accessible, shard_numel and
//! position0 multiples of F::block (a block never straddles two shards), and position0 + n <=
//! num_nodes * ranks_per_node * shard_numel. With a tensor group's map.slots (slots > 0), both
//! arrays must be device-accessible (padding they mark is left out as past numel). Workspace as
//! quantize. O(n), O(n log tensors) grouped.
template <class F, class T>
void quantize_mapped(const T* in, std::size_t n, const SourceMap& map, void* out,
                     const host::QuantizeOptions& opt, cudaStream_t stream, void* workspace = nullptr,
                     std::size_t workspace_size = 0) {
  const char* fn = "gpu::quantize_mapped";
  checked_packed_bytes<F>(n, fn, "n");
  const bool reads = n > 0 && map.numel > 0;
  QCOLL_REQUIRE(in != nullptr || !reads, fn, "in", "null", "with n =", n << " and map.numel = " << map.numel);
  QCOLL_REQUIRE(out != nullptr, fn, "out", "null", "needs", packed_bytes<F>(n) << " bytes");
  if (map.shard_numel != 0) {
    QCOLL_REQUIRE(map.num_nodes >= 1, fn, "map.num_nodes", map.num_nodes, "is below the minimum", 1);
    QCOLL_REQUIRE(map.ranks_per_node >= 1, fn, "map.ranks_per_node", map.ranks_per_node,
                  "is below the minimum", 1);
    QCOLL_REQUIRE(map.rank_at != nullptr, fn, "map.rank_at", "null", "needs",
                  map.num_nodes * map.ranks_per_node << " ints of device memory");
    QCOLL_REQUIRE(map.shard_numel % F::block == 0, fn, "map.shard_numel", map.shard_numel,
                  "is not a multiple of the block", F::block);
    QCOLL_REQUIRE(map.position0 % F::block == 0, fn, "map.position0", map.position0,
                  "is not a multiple of the block", F::block);
    const std::size_t ranks =
        static_cast<std::size_t>(map.num_nodes) * static_cast<std::size_t>(map.ranks_per_node);
    const std::size_t positions = ranks * map.shard_numel;
    QCOLL_REQUIRE(positions / ranks == map.shard_numel, fn, "map.shard_numel", map.shard_numel,
                  "times the rank count overflows; ranks =", ranks);
    QCOLL_REQUIRE(
        map.position0 <= positions && n <= positions - map.position0, fn, "n", n,
        "runs past the reordered buffer; map.position0 = " << map.position0 << ", positions =", positions);
    require_device_accessible(map.rank_at, fn, "map.rank_at");
  }
  if (map.slots.slots > 0) {
    QCOLL_REQUIRE(map.slots.slot_start != nullptr && map.slots.data_end != nullptr, fn, "map.slots", "null",
                  "with slots =", map.slots.slots);
    require_device_accessible(map.slots.slot_start, fn, "map.slots.slot_start");
    require_device_accessible(map.slots.data_end, fn, "map.slots.data_end");
  }
  if (reads) require_device_accessible(in, fn, "in");
  require_device_accessible(out, fn, "out");
  detail::check_workspace<F>(workspace, workspace_size, n, fn);
  detail::launch_quantize<F>(detail::TensorInput<T>{in, map, n}, out, opt, stream, workspace);
}

//! Decodes a message of n elements of F (device memory, any alignment) into out[0, n) (device
//! memory), rounding to T nearest-even; equals host::dequantize<F, T> (NaN payloads aside for
//! T = float). The header is not read (it lives in device memory): the caller checks it where it
//! is known. Throws qcoll::Error if msg is null, out is null with n > 0, or a pointer is not
//! device-accessible. O(n), one kernel (none for n = 0).
template <class F, class T>
void dequantize(const void* msg, std::size_t n, T* out, cudaStream_t stream) {
  const char* fn = "gpu::dequantize";
  checked_packed_bytes<F>(n, fn, "n");
  QCOLL_REQUIRE(msg != nullptr, fn, "msg", "null", "needs", packed_bytes<F>(n) << " bytes");
  QCOLL_REQUIRE(out != nullptr || n == 0, fn, "out", "null", "with n =", n);
  require_device_accessible(msg, fn, "msg");
  if (n > 0) require_device_accessible(out, fn, "out");
  detail::launch_gather_decode<F>(static_cast<const unsigned char*>(msg), 0, 1, n, out, n, nullptr, stream);
}

namespace detail {
inline void check_reduce_args(const void* msgs, std::size_t stride, int k, float post_scale,
                              std::size_t msg_bytes, const char* fn) {
  QCOLL_REQUIRE(k >= 1, fn, "k", k, "is below the minimum", 1);
  QCOLL_REQUIRE(msgs != nullptr, fn, "msgs", "null", "needs", k << " messages of " << msg_bytes << " bytes");
  QCOLL_REQUIRE(k == 1 || stride >= msg_bytes, fn, "stride", stride, "is below the message size", msg_bytes);
  QCOLL_REQUIRE(fp::is_finite(post_scale), fn, "post_scale", post_scale, "is not", "finite");
  require_device_accessible(msgs, fn, "msgs");
}
}  // namespace detail

//! out[i] = T(sum_{j=0}^{k-1} decode(message j, i)) for i in [0, n): message j holds n elements
//! of F at msgs + j * stride (device memory); the sum is fp32, starts from +0 and adds message 0,
//! 1, ..., k-1 in that order (fp::add, one rounding each), then is multiplied by post_scale
//! (fp::mul; skipped when post_scale == 1, e.g. 1/world for a mean), then rounded to T. Equals
//! zeroing acc, host::dequantize_accumulate<F> of each message in order, scaling, from_float<T>.
//! Requires k >= 1, stride >= packed_bytes<F>(n) when k > 1, a finite post_scale; throws
//! qcoll::Error otherwise or for null / non-device pointers. O(k n), one kernel.
template <class F, class T>
void dequantize_reduce(const void* msgs, std::size_t stride, int k, std::size_t n, float post_scale, T* out,
                       cudaStream_t stream) {
  const char* fn = "gpu::dequantize_reduce";
  checked_packed_bytes<F>(n, fn, "n");
  detail::check_reduce_args(msgs, stride, k, post_scale, packed_bytes<F>(n), fn);
  QCOLL_REQUIRE(out != nullptr || n == 0, fn, "out", "null", "with n =", n);
  if (n > 0) require_device_accessible(out, fn, "out");
  detail::launch_reduce<F>(static_cast<const unsigned char*>(msgs), stride, k, n,
                           detail::PostOp{post_scale, false}, out, n, nullptr, stream);
}

//! Sums k messages of F exactly as dequantize_reduce (fp32, fixed order, post_scale) and
//! quantizes the fp32 sums into one message of F2 at out_msg, without writing them out: equals
//! host::quantize<F2, float> of the fp32 sums with the same options, byte for byte. Checks as
//! dequantize_reduce plus out_msg (non-null, device-accessible) and the workspace of F2 (as
//! quantize). O(k n).
template <class F, class F2>
void dequantize_reduce_requantize(const void* msgs, std::size_t stride, int k, std::size_t n,
                                  float post_scale, void* out_msg, const host::QuantizeOptions& opt,
                                  cudaStream_t stream, void* workspace = nullptr,
                                  std::size_t workspace_size = 0) {
  const char* fn = "gpu::dequantize_reduce_requantize";
  checked_packed_bytes<F>(n, fn, "n");
  checked_packed_bytes<F2>(n, fn, "n");
  detail::check_reduce_args(msgs, stride, k, post_scale, packed_bytes<F>(n), fn);
  QCOLL_REQUIRE(out_msg != nullptr, fn, "out_msg", "null", "needs", packed_bytes<F2>(n) << " bytes");
  require_device_accessible(out_msg, fn, "out_msg");
  detail::check_workspace<F2>(workspace, workspace_size, n, fn);
  const bool aligned = detail::is_aligned16(msgs) && (k == 1 || stride % 16 == 0);
  detail::launch_quantize<F2>(
      detail::ReduceInput<F>{static_cast<const unsigned char*>(msgs), stride, k, n, 0, n, n,
                             detail::PostOp{post_scale, false}, aligned, SlotTable{}, 0},
      out_msg, opt, stream, workspace);
}

}  // namespace gpu
QCOLL_NAMESPACE_END
