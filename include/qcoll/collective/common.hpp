#pragma once
//! \file
//! What every collective plan shares: the reduction kind, plan fingerprints agreed on by all ranks
//! at construction, and the per-call agreement that keeps a rank's bad arguments from leaving its
//! peers hanging.

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "../core/error.hpp"
#include "../core/workspace.hpp"
#include "../format/message.hpp"
#include "../host/quantize.hpp"
#include "../layout/qgz.hpp"
#include "../layout/shard.hpp"
#include "../layout/topology.hpp"
#include "../transport/common.hpp"

QCOLL_NAMESPACE_BEGIN

//! How a reduce-scatter combines the ranks' contributions.
enum class Reduce : std::uint8_t {
  sum,   //!< the sum over ranks
  mean,  //!< the sum divided by the world size (as a plain reduce-scatter followed by averaging)
};

//! Result flag of a call: some rank's input held NaN or ±Inf (the same on every rank).
constexpr std::uint32_t kResultNonFinite = kFlagNonFinite;
//! Result flag of a device call: some rank rejected its arguments; this rank's output was not
//! written. (Host calls throw on every rank instead.)
constexpr std::uint32_t kResultRejected = kFlagRejected;
//! Result flag of a device call: a received message did not match the plan; this rank's output
//! was not written. (Host calls throw instead.)
constexpr std::uint32_t kResultBadMessage = kFlagBadMessage;

namespace detail {

//! 64-bit FNV-1a over a list of words: a plan's identity (kind, formats, element type, sizes).
inline std::uint64_t fingerprint(std::initializer_list<std::uint64_t> words) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::uint64_t w : words)
    for (int i = 0; i < 8; ++i) {
      h ^= (w >> (8 * i)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  return h;
}

//! Collective: every rank of `t` must hold the same fingerprint; otherwise all ranks throw
//! qcoll::Error naming the plan and this rank's description of it.
template <class Transport>
void agree_on_plan(Transport& t, std::uint64_t fp, const char* function, const std::string& description) {
  std::uint64_t v[2] = {fp, ~fp};
  t.all_reduce(v, 2, ReduceOp::max);
  if (v[0] != fp || ~v[1] != fp) {
    std::ostringstream os;
    os << "qcoll::" << function << ": ranks disagree on the plan (format, element type or size); rank "
       << t.rank() << " has " << description;
    throw Error(os.str());
  }
}

//! Collective: combines every rank's verdict on its own arguments and its input's non-finite flag.
//! If any rank rejected its arguments, every rank throws before anything is sent: the rejecting
//! rank its own message, the others a message naming the lowest rejecting rank. Returns the OR of
//! the non-finite flags (the same on every rank).
template <class Transport>
std::uint32_t agree_on_call(Transport& t, const std::string& local_error, bool nonfinite,
                            const char* function) {
  const std::uint64_t size = static_cast<std::uint64_t>(t.size());
  std::uint64_t v[2] = {local_error.empty() ? 0 : size - static_cast<std::uint64_t>(t.rank()),
                        nonfinite ? 1u : 0u};
  t.all_reduce(v, 2, ReduceOp::max);
  if (!local_error.empty()) throw Error(local_error);
  if (v[0] != 0) {
    std::ostringstream os;
    os << "qcoll::" << function << ": rank " << (size - v[0]) << " rejected its arguments; nothing was sent";
    throw Error(os.str());
  }
  return v[1] ? kResultNonFinite : 0u;
}

//! Runs the local argument checks `fn`, returning the message of the qcoll::Error it threw (or "").
template <class Fn>
std::string local_check(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return std::string();
}

//! Checks a workspace argument against the plan's need and alignment.
inline void check_workspace(const char* function, const void* ws, std::size_t ws_bytes, std::size_t need) {
  QCOLL_REQUIRE(ws != nullptr || need == 0, function, "workspace", "null", "needs", need << " bytes");
  QCOLL_REQUIRE(ws_bytes >= need, function, "workspace_bytes", ws_bytes, "is below the required", need);
  QCOLL_REQUIRE(reinterpret_cast<std::uintptr_t>(ws) % kWorkspaceAlignment == 0, function, "workspace", ws,
                "is not aligned to", kWorkspaceAlignment << " bytes");
}

//! Checks that a layout's shards are whole blocks of a format.
inline void check_blocks(const char* function, const ShardLayout& layout, std::size_t block,
                         const char* format) {
  QCOLL_REQUIRE(layout.shard_numel() % block == 0, function, "layout.granule()", layout.granule(),
                "does not make shards whole blocks of", format << " (block " << block << ")");
}

//! Seed of rank r's stochastic rounding at a given hop: distinct per rank so that the ranks'
//! rounding errors are independent and average out in a reduction.
inline std::uint64_t rank_seed(std::uint64_t seed, int rank, int hop) {
  return fingerprint({seed, static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(hop)});
}

//! A message-block source reading elements [offset, offset + n) of `base`, where elements at or
//! past `numel` are padding (excluded from statistics, encoded as zero codes).
template <class T, std::size_t Block>
struct SliceSource {
  const T* base;
  std::size_t offset;
  std::size_t numel;
  host::detail::BlockSource<T> operator()(std::size_t b) const {
    const std::size_t at = offset + b * Block;
    return host::detail::BlockSource<T>{base + at, valid_elements_in(numel, at, Block)};
  }
};

//! Decodes the first `valid` of the n elements of a checked message into out as T and zeroes
//! out[valid, n).
template <class F, class T>
void decode_slice(const void* msg, std::size_t n, std::size_t valid, T* out) {
  host::detail::decode_message_as<F, T>(
      msg, n, valid, [](float v) { return from_float<T>(v); }, [out](std::size_t i, T v) { out[i] = v; });
  for (std::size_t i = valid; i < n; ++i) out[i] = from_float<T>(0.0f);
}

//! Decodes `count` messages of n elements each (message i at msgs + i * stride) and sums them in
//! fp32 in order i = 0, 1, ... into acc[0, limit), starting from +0. Checks each header.
template <class F>
void sum_messages(const unsigned char* msgs, std::size_t stride, int count, std::size_t n, std::size_t limit,
                  float* acc, const char* function) {
  for (std::size_t i = 0; i < limit; ++i) acc[i] = 0.0f;
  for (int m = 0; m < count; ++m) {
    const unsigned char* msg = msgs + static_cast<std::size_t>(m) * stride;
    host::detail::read_header<F>(msg, n, function, "received message");
    host::detail::decode_message<F>(
        msg, n, [acc](std::size_t i, float v) { acc[i] = fp::add(acc[i], v); }, limit);
  }
}

//! The head of a device plan's workspace: the call's result flags word (at offset 0, read with
//! gpu::read_result_flags), then the quantizers' scratch (NVFP4's running absmax).
struct DeviceControl {
  std::uint32_t* status = nullptr;
  std::uint32_t* scratch = nullptr;
};

//! Takes the DeviceControl pieces when `device`, nothing otherwise (host plans return their flags).
inline DeviceControl take_control(WorkspaceCarver& c, bool device) {
  DeviceControl d;
  if (device) {
    d.status = c.take<std::uint32_t>(1);
    d.scratch = c.take<std::uint32_t>(1);
  }
  return d;
}

//! True for transports whose collectives move device memory.
template <class Transport>
constexpr bool on_device = Transport::memory_space == MemorySpace::device;

//! Workspace of a gather: (device: the control words,) this rank's message, then one message per
//! rank of the group.
struct GatherPieces {
  DeviceControl control;
  unsigned char* send;
  unsigned char* recv;
  std::size_t bytes;
};

//! Carves (or, with base == nullptr, measures) the workspace of a gather of `ranks` messages of
//! `message_bytes` each.
inline GatherPieces carve_gather(void* base, std::size_t message_bytes, int ranks, bool device) {
  WorkspaceCarver c(base);
  const DeviceControl control = take_control(c, device);
  unsigned char* send = c.take<unsigned char>(message_bytes);
  unsigned char* recv = c.take<unsigned char>(message_bytes, static_cast<std::size_t>(ranks));
  return GatherPieces{control, send, recv, c.bytes()};
}

//! Gathers the messages in p.send over `t` and decodes message q (n elements of F) into
//! out + offset(q): its first valid(q) elements as T, the rest of the n as zero. Checks every
//! header. `what` names the senders in errors.
template <class F, class T, class Transport, class Offset, class Valid>
void gather_and_decode(Transport& t, const GatherPieces& p, std::size_t message_bytes, std::size_t n, T* out,
                       Offset&& offset, Valid&& valid, const char* function, const char* what) {
  t.all_gather(p.send, p.recv, message_bytes);
  for (int q = 0; q < t.size(); ++q) {
    const unsigned char* msg = p.recv + static_cast<std::size_t>(q) * message_bytes;
    host::detail::read_header<F>(msg, n, function, what);
    decode_slice<F>(msg, n, valid(q), out + offset(q));
  }
}

}  // namespace detail
QCOLL_NAMESPACE_END
