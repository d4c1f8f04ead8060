#pragma once
//! \file
//! Device kernels of the low-bit techniques (docs/lowbit.md): the randomized Hadamard rotation of
//! format/hadamard.hpp over spans of a tensor or a message, and the error-feedback residual of
//! collective/feedback.hpp. The collective plans (collective/device.cuh) call them; they are not a
//! public API of their own.
//!
//! **Same bits as the host.** A CUDA thread block rotates a tile of whole spans in shared memory:
//! the sign pass, the log2(span) butterfly stages of format/hadamard.hpp's walsh_hadamard (each
//! stage's pairs are independent, so running a stage's pairs in parallel between two barriers
//! gives the serial loop's values), and the power-of-two scaling, all with the qcoll::fp helpers
//! (`__f*_rn` on the device, never contracted into FMA). Every value goes through the same
//! operations in the same order as in rotate_forward / rotate_inverse, so host and device agree
//! bit for bit. The residual arithmetic (add the residual, subtract the decoded value, decay, the
//! non-finite rule, bf16 rounding) is the host plan's, operation for operation.
//!
//! All launchers are stream-ordered: no allocation, no host synchronisation.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../collective/feedback.hpp"
#include "../core/fpmath.hpp"
#include "../core/half.hpp"
#include "../core/workspace.hpp"
#include "../format/hadamard.hpp"
#include "check.cuh"
#include "quantize.cuh"

QCOLL_NAMESPACE_BEGIN
namespace gpu {
namespace detail {

//! Elements of the shared-memory tile a rotating CUDA thread block works on: at least the span
//! (the largest span, kMaxRotationSpan floats = 32 KiB, fits the static shared-memory limit).
constexpr std::size_t kRotationTile = kMaxRotationSpan;
//! Tile used when the spans are smaller (a multiple of every span up to it).
constexpr std::size_t kSmallRotationTile = 2048;

//! The tile for rotations a and b: a multiple of both spans, at least kSmallRotationTile.
QCOLL_HOST_DEVICE std::size_t rotation_tile(const Rotation& a, const Rotation& b = Rotation{}) {
  const std::size_t s = a.span() > b.span() ? a.span() : b.span();
  return s > kSmallRotationTile ? s : kSmallRotationTile;
}

//! Rotates v[0, cnt) (shared memory, cnt a multiple of the span; spans start at multiples of the
//! span) forward or back, as rotate_forward / rotate_inverse of each span; `global(i)` is the
//! global element index of element i's sign. Every thread of the block calls it (barriers
//! inside); thread t owns elements t, t + blockDim.x, ... in the sign and scale passes, as in the
//! callers' load and store passes. No-op when the rotation is off.
template <class Global>
QCOLL_DEVICE void rotate_tile(float* v, std::size_t cnt, const Rotation& r, bool forward, Global global) {
  if (!r.enabled()) return;
  const std::size_t span = r.span();
  if (forward)
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
      v[i] = fp::mul(v[i], ::qcoll::detail::rotation_sign(r.seed, global(i)));
  for (std::size_t h = 1; h < span; h *= 2) {
    __syncthreads();
    for (std::size_t p = threadIdx.x; p < cnt / 2; p += blockDim.x) {
      const std::size_t i = p / h * 2 * h + p % h;
      const float a = v[i], b = v[i + h];
      v[i] = fp::add(a, b);
      v[i + h] = fp::sub(a, b);
    }
  }
  __syncthreads();
  const float s = ::qcoll::detail::pow2_neg(forward ? r.log2_span / 2 : (r.log2_span + 1) / 2);
  for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
    v[i] = forward ? fp::mul(v[i], s)
                   : fp::mul(fp::mul(v[i], s), ::qcoll::detail::rotation_sign(r.seed, global(i)));
}

//! Global index of element i of a run whose spans are contiguous in the tensor, read through a
//! source map: the span's first position mapped, plus the offset inside the span.
struct MappedGlobal {
  SourceMap map;
  std::size_t first;  // message position of the run's element 0
  std::size_t span;
  QCOLL_DEVICE std::uint64_t operator()(std::size_t i) const {
    const std::size_t at = first + i;
    return map_position(map, map.position0 + at - at % span) + at % span;
  }
};

//! Global index of element i of a contiguous run starting at global index `base`.
struct LinearGlobal {
  std::size_t base;
  QCOLL_DEVICE std::uint64_t operator()(std::size_t i) const { return base + i; }
};

//! Barrier at the end of a tile. The load, sign, scale and store passes touch only the thread's
//! own elements and every butterfly stage starts with a barrier, so tiles cannot mix today; this
//! keeps them apart should a pass ever read a peer's elements (one barrier per tile).
QCOLL_DEVICE void end_tile() { __syncthreads(); }

// ---------------------------------------------------------------------------------------------
// Error-feedback residual in device memory
// ---------------------------------------------------------------------------------------------

//! What a plan expects of an error-feedback state (passed to the kernels by value).
struct ResidualArgs {
  unsigned char* data = nullptr;  //!< the state (device memory, 64-byte aligned); null: no feedback
  std::size_t bytes = 0;          //!< the caller's size of it
  std::uint64_t plan = 0;         //!< the plan identity's hash
  std::size_t n1 = 0;             //!< hop-1 elements when hop 1 is on (padded_numel)
  std::size_t n2 = 0;             //!< hop-2 elements when hop 2 is on (0 for one hop)
};

//! A state's header checked on the device: ok, and the spans it holds.
struct ResidualView {
  bool ok = false;
  std::uint8_t storage = 0;
  float decay = 1.0f;
  unsigned char* hop1 = nullptr;
  std::size_t n1 = 0;
  unsigned char* hop2 = nullptr;
  std::size_t n2 = 0;

  //! Element i of a span as fp32.
  QCOLL_DEVICE float get(const unsigned char* s, std::size_t i) const {
    if (storage == static_cast<std::uint8_t>(ResidualStorage::f32))
      return reinterpret_cast<const float*>(s)[i];
    return to_float(reinterpret_cast<const bfloat16*>(s)[i]);
  }
  //! Stores what the code failed to carry, r, as element i: decay * r, or 0 where r is not finite
  //! (the host plan's Feedback::keep).
  QCOLL_DEVICE void keep(unsigned char* s, std::size_t i, float r) const {
    const float x = fp::bits(r) << 1 >= 0xff000000u ? 0.0f : fp::mul(decay, r);
    if (storage == static_cast<std::uint8_t>(ResidualStorage::f32)) {
      reinterpret_cast<float*>(s)[i] = x;
    } else {
      reinterpret_cast<bfloat16*>(s)[i] = from_float<bfloat16>(x);
    }
  }
};

//! Reads and checks the header of the state `a` names, as the host plan's check_residual does
//! (magic, plan, storage, sizes for the hops it has on, bytes, decay). Not ok for a null state.
QCOLL_DEVICE ResidualView residual_view(const ResidualArgs& a) {
  ResidualView v;
  if (a.data == nullptr || a.bytes < sizeof(::qcoll::detail::ResidualHeader)) return v;
  const auto& h = *reinterpret_cast<const ::qcoll::detail::ResidualHeader*>(a.data);
  if (h.magic != ::qcoll::detail::kResidualMagic || h.plan != a.plan ||
      h.storage > static_cast<std::uint8_t>(ResidualStorage::bf16))
    return v;
  const std::size_t n1 = h.hop1 != 0 ? a.n1 : 0, n2 = h.hop2 != 0 ? a.n2 : 0;
  if (h.n1 != n1 || h.n2 != n2 || !(h.decay > 0.0f && h.decay <= 1.0f)) return v;
  const std::size_t e = h.storage == 0 ? 4 : 2;
  const std::size_t a2 = sizeof(::qcoll::detail::ResidualHeader) +
                         (n1 * e + ::qcoll::kWorkspaceAlignment - 1) / ::qcoll::kWorkspaceAlignment *
                             ::qcoll::kWorkspaceAlignment;
  if (a.bytes < a2 + n2 * e) return v;
  v.ok = true;
  v.storage = h.storage;
  v.decay = h.decay;
  v.hop1 = a.data + sizeof(::qcoll::detail::ResidualHeader);
  v.n1 = n1;
  v.hop2 = a.data + a2;
  v.n2 = n2;
  return v;
}

//! One thread: checks the state's header; a bad one sets `bad_flag` in *status and kFlagRejected
//! in the k messages at msgs + i * stride (what this rank sends), so every rank of the call skips
//! its output and its residual update.
inline __global__ void residual_check_kernel(ResidualArgs a, std::uint32_t* status, std::uint32_t bad_flag,
                                             unsigned char* msgs, std::size_t stride, int k) {
  if (residual_view(a).ok) return;
  atomicOr(status, bad_flag);
  for (int i = 0; i < k; ++i) or_header_flags(msgs + static_cast<std::size_t>(i) * stride, kFlagRejected);
}

//! One thread: writes a fresh state's header (the spans were zeroed before).
inline __global__ void residual_header_kernel(unsigned char* data, ::qcoll::detail::ResidualHeader h) {
  *reinterpret_cast<::qcoll::detail::ResidualHeader*>(data) = h;
}

// ---------------------------------------------------------------------------------------------
// Quantizer input: floats in message order, blocks valid as a source map says
// ---------------------------------------------------------------------------------------------

//! A message of n elements whose values are in v[0, n) (device memory, message order); block b
//! holds rotated_count(map_block(map, b, Block, n).valid, rot) data elements (a rotation spreads
//! data into the rest of its last span). The host plans quantize the same floats with
//! BlockSource{v + b * Block, that count}.
template <std::size_t Block>
struct BlockFloatInput {
  static constexpr int kVec = 4;
  const float* v;
  SourceMap map;
  std::size_t n;
  Rotation rot;

  QCOLL_DEVICE std::size_t valid_of(std::size_t b) const {
    return rotated_count(map_block(map, b, Block, n).valid, rot);
  }
  template <std::size_t B>
  QCOLL_DEVICE Span span(std::size_t b) const {
    static_assert(B == Block, "BlockFloatInput is read in its own blocks");
    const std::size_t valid = valid_of(b);
    return Span{b * Block, valid, valid == Block && is_aligned16(v + b * Block)};
  }
  QCOLL_DEVICE uint4 load(const Span& s, int e) const {
    if (s.vec) return *reinterpret_cast<const uint4*>(v + s.offset + e);
    std::uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const std::size_t i = static_cast<std::size_t>(e + j);
      if (i < s.valid) w[j] = fp::bits(v[s.offset + i]);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  static QCOLL_DEVICE float value(const uint4& q, int j) {
    return fp::from_bits(j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w);
  }
  QCOLL_DEVICE bool load_run(std::size_t p, float (&out)[kVec]) const {
    if (p + kVec > n || p % Block + kVec > valid_of(p / Block)) return false;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = v[p + static_cast<std::size_t>(j)];
    return true;
  }
  QCOLL_DEVICE float load_one(std::size_t p, bool& ok) const {
    ok = p < n && p % Block < valid_of(p / Block);
    return ok ? v[p] : 0.0f;
  }
};

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

//! All-gather, sender: scratch[0, n) = this rank's shard as floats (0 past `valid` and at the
//! padding `slots` mark), rotated forward span by span (element 0 is global element `base`).
template <class T>
__global__ void __launch_bounds__(kThreads)
    rotate_shard_kernel(const T* shard, std::size_t n, std::size_t valid, Rotation rot, std::size_t base,
                        std::size_t tile, SlotTable slots, float* scratch) {
  __shared__ float buf[kRotationTile];
  for (std::size_t t0 = blockIdx.x * tile; t0 < n; t0 += static_cast<std::size_t>(gridDim.x) * tile) {
    const std::size_t cnt = n - t0 < tile ? n - t0 : tile;
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
      buf[i] =
          t0 + i < valid && is_data_in_slots(slots, base + t0 + i) ? element_to_float(shard[t0 + i]) : 0.0f;
    rotate_tile(buf, cnt, rot, true, LinearGlobal{base + t0});
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x) scratch[t0 + i] = buf[i];
    end_tile();
  }
}

//! All-gather, receiver: message q (blockIdx.y; n elements of F at msgs + q * stride) decoded,
//! its first rotated_count(valid_q) elements rotated back, and stored as T at out + q * n, where
//! valid_q = the elements of [q n, (q + 1) n) below `limit`; the rest, and the padding `slots`
//! mark (out[i] at global position i), is written as 0. Nothing is written when *guard has tripped.
template <class F, class T>
__global__ void __launch_bounds__(kThreads)
    unrotate_gather_kernel(const unsigned char* msgs, std::size_t stride, std::size_t n, Rotation rot,
                           std::size_t tile, T* out, std::size_t limit, SlotTable slots,
                           const std::uint32_t* guard) {
  __shared__ float buf[kRotationTile];
  if (guard_tripped(guard)) return;
  const std::size_t q = blockIdx.y, base = q * n;
  const unsigned char* msg = msgs + q * stride;
  const std::size_t valid = limit <= base ? 0 : (limit - base < n ? limit - base : n);
  const std::size_t carried = rotated_count(valid, rot);
  for (std::size_t t0 = blockIdx.x * tile; t0 < n; t0 += static_cast<std::size_t>(gridDim.x) * tile) {
    const std::size_t cnt = n - t0 < tile ? n - t0 : tile;
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
      buf[i] = t0 + i < carried ? decode_one<F>(msg, n, t0 + i) : 0.0f;
    rotate_tile(buf, cnt, rot, false, LinearGlobal{base + t0});
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
      out[base + t0 + i] =
          from_float<T>(t0 + i < valid && is_data_in_slots(slots, base + t0 + i) ? buf[i] : 0.0f);
    end_tile();
  }
}

//! Reduce-scatter, last step: the fp32 sum (in message order, from +0) of k messages of n
//! elements of F, for the first `carried` elements; rotated back (element 0 is global element
//! `base`); post; stored as T in out[0, valid), 0 in out[valid, n) and at the padding `slots`
//! mark. Nothing is written when *guard has tripped.
template <class F, class T>
__global__ void __launch_bounds__(kThreads)
    unrotate_reduce_kernel(const unsigned char* msgs, std::size_t stride, int k, std::size_t n,
                           std::size_t carried, Rotation rot, std::size_t base, std::size_t tile, PostOp post,
                           T* out, std::size_t valid, SlotTable slots, const std::uint32_t* guard) {
  __shared__ float buf[kRotationTile];
  if (guard_tripped(guard)) return;
  for (std::size_t t0 = blockIdx.x * tile; t0 < n; t0 += static_cast<std::size_t>(gridDim.x) * tile) {
    const std::size_t cnt = n - t0 < tile ? n - t0 : tile;
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
      buf[i] = t0 + i < carried ? reduce_one<F>(msgs, stride, k, n, PostOp{}, t0 + i) : 0.0f;
    rotate_tile(buf, cnt, rot, false, LinearGlobal{base + t0});
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
      out[t0 + i] =
          from_float<T>(t0 + i < valid && is_data_in_slots(slots, base + t0 + i) ? post.apply(buf[i]) : 0.0f);
    end_tile();
  }
}

//! Reduce-scatter, hop 1 through floats: v[0, n) = the message's blocks read from `grad` through
//! `map` (0 past each block's valid count), plus the hop-1 residual where the state has one (and
//! its header is ok), rotated forward span by span (each span's sign index: its mapped global
//! position). With `update`, instead: what the message at `msg` failed to carry (v minus its
//! decoded values) rotated back and kept as the new residual (decay, non-finite rule) at the
//! blocks' valid positions; skipped when *guard has tripped or the state is not ok.
template <class F, class T>
__global__ void __launch_bounds__(kThreads)
    hop1_float_kernel(const T* grad, SourceMap map, std::size_t n, Rotation rot, std::size_t tile,
                      ResidualArgs res, float* v, bool update, const unsigned char* msg,
                      const std::uint32_t* guard) {
  constexpr std::size_t B = F::block;
  __shared__ float buf[kRotationTile];
  const ResidualView fb = res.data != nullptr ? residual_view(res) : ResidualView{};
  if (update && (guard_tripped(guard) || !fb.ok || fb.n1 == 0)) return;
  const bool add = fb.ok && fb.n1 > 0;
  for (std::size_t t0 = blockIdx.x * tile; t0 < n; t0 += static_cast<std::size_t>(gridDim.x) * tile) {
    const std::size_t cnt = n - t0 < tile ? n - t0 : tile;
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x) {
      const std::size_t p = t0 + i, e = p % B;
      const MappedBlock mb = map_block(map, p / B, B, n);
      float x = e < mb.valid ? element_to_float(grad[mb.offset + e]) : 0.0f;
      if (add && e < mb.valid) x = fp::add(x, fb.get(fb.hop1, mb.offset + e));
      buf[i] = x;
    }
    const MappedGlobal g{map, t0, rot.span()};
    rotate_tile(buf, cnt, rot, true, g);
    if (!update) {
      for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x) v[t0 + i] = buf[i];
    } else {
      for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
        buf[i] = fp::sub(buf[i], decode_one<F>(msg, n, t0 + i));
      rotate_tile(buf, cnt, rot, false, g);
      for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x) {
        const std::size_t p = t0 + i, e = p % B;
        const MappedBlock mb = map_block(map, p / B, B, n);
        if (e < mb.valid) fb.keep(fb.hop1, mb.offset + e, buf[i]);
      }
    }
    end_tile();
  }
}

//! Per node slice of a hop-1 sum (a kernel's blockIdx.y): the global offset of its first element
//! (the owner's shard offset) and its data elements. Passed by value.
struct SliceTable {
  static constexpr int kMax = 64;  //!< node slices per launch
  std::size_t first[kMax];
  std::size_t valid[kMax];
};

//! True when element i of a hop-2 slice (global element first + i, `valid` data elements, blocks
//! of `block`) is carried by its message: i % block is below the block's data elements (a tensor
//! group's `slots` leave out its padding), rounded up to whole spans of r2 (the host plan's
//! LayoutSource count).
QCOLL_DEVICE bool hop2_carries(std::size_t i, std::size_t first, std::size_t valid, std::size_t block,
                               const SlotTable& slots, const Rotation& r2) {
  const std::size_t at = i - i % block;
  if (at >= valid) return false;
  std::size_t d = valid - at < block ? valid - at : block;
  if (slots.slots > 0) d = data_in_slots(slots, first + at, d);
  return i % block < rotated_count(d, r2);
}

//! Reduce-scatter, hop 2 through floats, node slice m = m0 + blockIdx.y: v[m s, (m + 1) s) = the
//! fp32 sums of the k hop-1 messages (n1 elements of F1 each) at elements [m s, (m + 1) s); with
//! `rerotate` (r1 and r2 differ), rotated back with r1, zeroed past valid_m and rotated forward
//! with r2 (element 0 is global element first_m; the padding `slots` mark is zeroed too); plus
//! the hop-2 residual at the elements hop2_carries (blocks of block2) where the state has an ok one.
template <class F1>
__global__ void __launch_bounds__(kThreads)
    hop2_float_kernel(const unsigned char* msgs, std::size_t stride, int k, std::size_t n1, std::size_t s,
                      int m0, SliceTable slices, Rotation r1, Rotation r2, bool rerotate, std::size_t tile,
                      ResidualArgs res, float* v, std::size_t block2, SlotTable slots) {
  __shared__ float buf[kRotationTile];
  const ResidualView fb = res.data != nullptr ? residual_view(res) : ResidualView{};
  const bool add = fb.ok && fb.n2 > 0;
  const std::size_t m = static_cast<std::size_t>(m0) + blockIdx.y;
  const std::size_t first = slices.first[blockIdx.y], valid = slices.valid[blockIdx.y];
  for (std::size_t t0 = blockIdx.x * tile; t0 < s; t0 += static_cast<std::size_t>(gridDim.x) * tile) {
    const std::size_t cnt = s - t0 < tile ? s - t0 : tile;
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
      buf[i] = reduce_one<F1>(msgs, stride, k, n1, PostOp{}, m * s + t0 + i);
    if (rerotate) {
      rotate_tile(buf, cnt, r1, false, LinearGlobal{first + t0});
      for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x)
        if (t0 + i >= valid || !is_data_in_slots(slots, first + t0 + i)) buf[i] = 0.0f;
      __syncthreads();
      rotate_tile(buf, cnt, r2, true, LinearGlobal{first + t0});
    }
    for (std::size_t i = threadIdx.x; i < cnt; i += blockDim.x) {
      float x = buf[i];
      if (add && hop2_carries(t0 + i, first, valid, block2, slots, r2))
        x = fp::add(x, fb.get(fb.hop2, m * s + t0 + i));
      v[m * s + t0 + i] = x;
    }
    end_tile();
  }
}

//! Reduce-scatter, hop-2 residual update, node slice m = m0 + blockIdx.y: for the elements i the
//! message carries (hop2_carries, blocks of F2), keeps v[m s + i] minus the decoded element i of
//! the slice's sent message (at msgs + m * stride, s elements of F2) as the hop-2 residual.
//! Skipped when *guard has tripped or the state has no (ok) hop-2 residual.
template <class F2>
__global__ void __launch_bounds__(kThreads)
    hop2_update_kernel(const unsigned char* msgs, std::size_t stride, std::size_t s, SliceTable slices,
                       int m0, Rotation r2, ResidualArgs res, const float* v, SlotTable slots,
                       const std::uint32_t* guard) {
  const ResidualView fb = residual_view(res);
  if (guard_tripped(guard) || !fb.ok || fb.n2 == 0) return;
  const std::size_t m = static_cast<std::size_t>(m0) + blockIdx.y;
  const std::size_t first = slices.first[blockIdx.y], valid = slices.valid[blockIdx.y];
  const std::size_t valid2 = rotated_count(valid, r2);
  const unsigned char* msg = msgs + m * stride;
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < valid2; i += step)
    if (hop2_carries(i, first, valid, F2::block, slots, r2))
      fb.keep(fb.hop2, m * s + i, fp::sub(v[m * s + i], decode_one<F2>(msg, s, i)));
}

// ---------------------------------------------------------------------------------------------
// Weight-difference all-gather (qWD)
// ---------------------------------------------------------------------------------------------

//! qWD sender: diff[i] = shard[i] - replica[i] in fp32 (difference), or shard[i] (resync), for
//! i < valid (the host plan's to_float and fp::sub).
template <class T>
__global__ void __launch_bounds__(kThreads)
    delta_diff_kernel(const T* shard, const T* replica, std::size_t valid, bool difference, float* diff) {
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < valid; i += step)
    diff[i] = difference ? fp::sub(to_float(shard[i]), to_float(replica[i])) : to_float(shard[i]);
}

//! qWD receiver: message q = blockIdx.y (n elements of G at msgs + q * stride) applied to
//! replica[q n, (q + 1) n) below `limit`: R <- T(R + decoded) (difference) or T(decoded) (resync);
//! +0 at the padding `slots` mark (replica[i] at global position i). Elements at or past limit are
//! left alone; nothing is written when *guard has tripped.
template <class G, class T>
__global__ void __launch_bounds__(kThreads)
    delta_apply_kernel(const unsigned char* msgs, std::size_t stride, std::size_t n, T* replica,
                       std::size_t limit, bool difference, SlotTable slots, const std::uint32_t* guard) {
  if (guard_tripped(guard)) return;
  const std::size_t q = blockIdx.y, base = q * n;
  const unsigned char* msg = msgs + q * stride;
  const std::size_t valid = limit <= base ? 0 : (limit - base < n ? limit - base : n);
  T* const out = replica + base;
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < valid;
       i += step) {
    if (!is_data_in_slots(slots, base + i)) {
      out[i] = from_float<T>(0.0f);
      continue;
    }
    const float d = decode_one<G>(msg, n, i);
    out[i] = from_float<T>(difference ? fp::add(to_float(out[i]), d) : d);
  }
}

}  // namespace detail
}  // namespace gpu
QCOLL_NAMESPACE_END
