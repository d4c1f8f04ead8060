#pragma once
//! \file
//! What every collective plan shares: the reduction kind, plan fingerprints agreed on by all ranks
//! at construction, and the per-call agreement that keeps a rank's bad arguments from leaving its
//! peers hanging.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/hash.hpp"
#include "../core/workspace.hpp"
#include "../format/hadamard.hpp"
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
//! Result flag of a device call with error feedback: this rank's residual state failed the
//! device-side header check (never initialised, another plan's, or sizes, bytes or decay that do
//! not fit); this rank sent its messages marked rejected, so every rank of the call sees
//! kResultRejected, and no output or residual was written. (Host calls throw instead.)
constexpr std::uint32_t kResultBadResidual = 8u;

//! How one hop (or stage) of a collective quantizes: rounding, the stochastic-rounding seed (made
//! distinct per rank and hop inside the plans) and the randomized Hadamard rotation applied before
//! quantizing (format/hadamard.hpp; span 0 = off). Part of the plan's identity.
struct HopOptions {
  Rounding rounding = Rounding::nearest;  //!< nearest-even or stochastic
  std::uint64_t seed = 0;                 //!< stochastic rounding key
  Rotation rotation{};                    //!< Hadamard smoothing of this hop (off by default)

  //! The options of a plan built with one QuantizeOptions for every hop (no rotation).
  static HopOptions from(const host::QuantizeOptions& o) {
    return HopOptions{o.rounding, o.seed, Rotation{}};
  }
};

//! Per-hop options of a QuantizedReduceScatter (hop2 is unused for one hop).
struct ReduceScatterOptions {
  HopOptions hop1;  //!< the rank's own messages (intra-node for two hops)
  HopOptions hop2;  //!< the re-quantized partial sums (inter-node)
};

//! What a rank says it is calling: one word per field of the plan's identity, and the call's
//! number. Every plan builds one at construction; every call (and the construction itself, as
//! call 0) is agreed on by all ranks of the world before any byte moves, and its hash is the tag
//! in every message header of the call. Fields a plan does not have are 0.
struct CallIdentity {
  //! The fields, in the order they are compared and named in errors.
  enum Field : int {
    kind,  //!< 1 all-gather, 2 hpZ gather, 3 reduce-scatter, 4 all-reduce, 6 delta all-gather, 7 resync
    element_type,  //!< DType of the plan's elements
    format1,       //!< FormatId of the (first hop's) format
    block1,        //!< its block size
    format2,       //!< FormatId of the second hop's (all-reduce: the gather's) format
    block2,        //!< its block size
    numel,         //!< the layout's element count
    padded_numel,  //!< the layout's padded element count
    parts,         //!< the layout's shards
    tensors,       //!< the layout's tensor group (TensorGroup::fingerprint(); 0 for a flat buffer)
    reduce_op,     //!< Reduce
    hops,          //!< Hops
    node_table,    //!< Topology::fingerprint() (the whole node table), 0 without topology
    rounding,      //!< Rounding (of the first hop)
    seed,          //!< stochastic rounding seed (of the first hop; 0 for nearest)
    rotation,      //!< the first hop's rotation: log2 span and seed hashed (0: off)
    rounding2,     //!< the second hop's Rounding
    seed2,         //!< the second hop's seed (0 for nearest)
    rotation2,     //!< the second hop's rotation (0: off)
    call,          //!< 0 at construction, then 1, 2, ... per call of this plan
    kFieldCount
  };
  std::uint64_t word[kFieldCount] = {};

  //! Name of a field, as errors print it.
  static const char* field_name(int f) noexcept {
    static const char* const names[] = {"kind",
                                        "element type",
                                        "format",
                                        "block",
                                        "second format",
                                        "second block",
                                        "numel",
                                        "padded numel",
                                        "parts",
                                        "tensor group",
                                        "reduce op",
                                        "hops",
                                        "node table",
                                        "rounding",
                                        "seed",
                                        "rotation",
                                        "second rounding",
                                        "second seed",
                                        "second rotation",
                                        "call number"};
    static_assert(sizeof(names) / sizeof(names[0]) == kFieldCount, "one name per field");
    return f >= 0 && f < kFieldCount ? names[f] : "?";
  }
  //! 64-bit hash of all fields (FNV-1a); never 0, so a tag of 0 marks a standalone message.
  std::uint64_t hash() const noexcept {
    Fnv1a h;
    for (std::uint64_t w : word) h.mix(w);
    return h.value == 0 ? 1 : h.value;
  }
  //! Renders field f's value for an error message (kinds, types, formats and ops by name).
  std::string field_value(int f) const {
    const std::uint64_t v = word[f];
    switch (f) {
      case kind: {
        static const char* const kinds[] = {"?",          "all-gather", "hpZ gather",       "reduce-scatter",
                                            "all-reduce", "?",          "delta all-gather", "delta resync"};
        return v < 8 ? kinds[v] : std::to_string(v);
      }
      case element_type: return dtype_name(static_cast<DType>(v));
      case format1:
      case format2: return format_name(static_cast<FormatId>(v));
      case reduce_op: return v == 0 ? "sum" : v == 1 ? "mean" : std::to_string(v);
      case hops: return v == 0 ? "one" : v == 1 ? "two" : std::to_string(v);
      case node_table:
      case tensors:
      case rotation:
      case rotation2: {
        std::ostringstream os;
        os << "#" << std::hex << v;
        return os.str();
      }
      default: return std::to_string(v);
    }
  }
};

namespace detail {

//! Sets a hop's fields (hop 1 or 2) of an identity.
inline void set_hop(CallIdentity& id, int hop, const HopOptions& h) {
  id.word[hop == 1 ? CallIdentity::rounding : CallIdentity::rounding2] =
      static_cast<std::uint64_t>(h.rounding);
  id.word[hop == 1 ? CallIdentity::seed : CallIdentity::seed2] =
      h.rounding == Rounding::stochastic ? h.seed : 0;
  id.word[hop == 1 ? CallIdentity::rotation : CallIdentity::rotation2] =
      h.rotation.enabled() ? fnv1a({h.rotation.log2_span, h.rotation.seed}) : 0;
}

//! The identity of a plan over `layout` (kind, element type, the layout's sizes, the first hop's
//! options); callers fill in the formats, op, hops, node table and second hop.
template <class T>
CallIdentity plan_identity(int kind, const ShardLayout& layout, const HopOptions& hop1) {
  CallIdentity id;
  id.word[CallIdentity::kind] = static_cast<std::uint64_t>(kind);
  id.word[CallIdentity::element_type] = static_cast<std::uint64_t>(dtype_of<T>::value);
  id.word[CallIdentity::numel] = layout.numel();
  id.word[CallIdentity::padded_numel] = layout.padded_numel();
  id.word[CallIdentity::parts] = static_cast<std::uint64_t>(layout.parts());
  id.word[CallIdentity::tensors] = layout.group_fingerprint();
  set_hop(id, 1, hop1);
  return id;
}

//! A plan's identity and the count of its calls: next() is the identity of the next call.
struct PlanCalls {
  CallIdentity id;         //!< the plan's identity (call number 0)
  std::uint64_t made = 0;  //!< calls numbered so far

  //! Numbers the next call and returns its identity.
  CallIdentity next() {
    CallIdentity c = id;
    c.word[CallIdentity::call] = ++made;
    return c;
  }
};

//! Sets a format's fields (slot 1 or 2) of an identity.
template <class F>
void set_format(CallIdentity& id, int slot) {
  id.word[slot == 1 ? CallIdentity::format1 : CallIdentity::format2] = static_cast<std::uint64_t>(F::id);
  id.word[slot == 1 ? CallIdentity::block1 : CallIdentity::block2] = F::block;
}

//! Explains a disagreement: every rank's identity (ids[r]) grouped into the fields that differ,
//! each with its values and the ranks holding them.
inline std::string describe_disagreement(const std::vector<CallIdentity>& ids) {
  std::ostringstream os;
  bool first_field = true;
  for (int f = 0; f < CallIdentity::kFieldCount; ++f) {
    std::vector<std::pair<std::uint64_t, std::vector<int>>> groups;
    for (int r = 0; r < static_cast<int>(ids.size()); ++r) {
      const std::uint64_t v = ids[static_cast<std::size_t>(r)].word[f];
      auto g = std::find_if(groups.begin(), groups.end(), [v](const auto& x) { return x.first == v; });
      if (g == groups.end()) {
        groups.push_back({v, {r}});
      } else {
        g->second.push_back(r);
      }
    }
    if (groups.size() < 2) continue;
    os << (first_field ? "" : "; ") << CallIdentity::field_name(f) << ":";
    first_field = false;
    for (std::size_t k = 0; k < groups.size(); ++k) {
      const std::vector<int>& ranks = groups[k].second;
      os << (k ? " vs " : " ") << ids[static_cast<std::size_t>(ranks.front())].field_value(f) << " (rank"
         << (ranks.size() > 1 ? "s" : "");
      const std::size_t shown = std::min<std::size_t>(ranks.size(), 8);
      for (std::size_t i = 0; i < shown; ++i) os << (i ? "," : " ") << ranks[i];
      if (shown < ranks.size()) os << ",... " << ranks.size() << " in all";
      os << ")";
    }
  }
  return os.str();
}

//! Collective over `world`: the one small all-reduce every call (and every plan construction)
//! makes before anything else moves. It combines (1) the identity of what each rank calls, (2)
//! each rank's verdict on its own arguments and (3) its input's non-finite flag. If the ranks
//! disagree on the identity, every rank throws qcoll::Error naming the fields that differ and
//! the ranks on each side (after one more all-reduce of W identities, made only then). If any rank
//! rejected its arguments, every rank throws before anything is sent: the rejecting rank its own
//! message, the others a message naming the lowest rejecting rank. Returns the OR of the
//! non-finite flags (the same on every rank).
template <class Transport>
std::uint32_t agree_on_call(Transport& world, const CallIdentity& id, const std::string& local_error,
                            bool nonfinite, const char* function) {
  const std::uint64_t size = static_cast<std::uint64_t>(world.size());
  const std::uint64_t h = id.hash();
  std::uint64_t v[4] = {local_error.empty() ? 0 : size - static_cast<std::uint64_t>(world.rank()),
                        nonfinite ? 1u : 0u, h, ~h};
  world.all_reduce(v, 4, ReduceOp::max);
  if (v[2] != h || ~v[3] != h) {  // max != min: every rank sees it
    // Every rank's identity, gathered as a sum of words where each rank fills only its own row
    // (the small all-reduce: control traffic, not data).
    constexpr std::size_t K = CallIdentity::kFieldCount;
    std::vector<std::uint64_t> rows(static_cast<std::size_t>(world.size()) * K, 0);
    std::copy(id.word, id.word + K, rows.begin() + static_cast<std::ptrdiff_t>(world.rank()) * K);
    world.all_reduce(rows.data(), rows.size(), ReduceOp::sum);
    std::vector<CallIdentity> ids(static_cast<std::size_t>(world.size()));
    for (std::size_t r = 0; r < ids.size(); ++r) std::copy_n(rows.begin() + r * K, K, ids[r].word);
    std::ostringstream os;
    os << "qcoll::" << function << ": ranks disagree on the call (" << describe_disagreement(ids)
       << "); nothing was sent";
    throw Error(os.str());
  }
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

//! Checks a workspace argument (or another caller-owned buffer named `name`, its size named
//! `bytes_name`) against the plan's need and kWorkspaceAlignment.
inline void check_workspace(const char* function, const void* ws, std::size_t ws_bytes, std::size_t need,
                            const char* name = "workspace", const char* bytes_name = "workspace_bytes") {
  QCOLL_REQUIRE(ws != nullptr || need == 0, function, name, "null", "needs", need << " bytes");
  QCOLL_REQUIRE(ws_bytes >= need, function, bytes_name, ws_bytes, "is below the required", need);
  check_aligned(function, name, ws, kWorkspaceAlignment);
}

//! Checks a buffer argument of n elements of T (host or device memory): not null when n > 0,
//! aligned to alignof(T), and outside the workspace [ws, ws + ws_bytes) (the call writes its
//! messages there while it reads inputs and writes outputs). O(1).
template <class T>
void check_buffer(const char* function, const char* name, const T* p, std::size_t n, const void* ws,
                  std::size_t ws_bytes) {
  QCOLL_REQUIRE(p != nullptr || n == 0, function, name, "null", "with", n << " elements");
  if (p == nullptr || n == 0) return;
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p), b = a + n * sizeof(T);
  const std::uintptr_t w0 = reinterpret_cast<std::uintptr_t>(ws), w1 = w0 + ws_bytes;
  check_aligned(function, name, p, alignof(T));
  QCOLL_REQUIRE(ws == nullptr || ws_bytes == 0 || b <= w0 || w1 <= a, function, name,
                static_cast<const void*>(p) << " (" << n * sizeof(T) << " bytes)", "overlaps the workspace",
                ws << " (" << ws_bytes << " bytes)");
}

//! Checks that a layout's shards are whole blocks of a format.
inline void check_blocks(const char* function, const ShardLayout& layout, std::size_t block,
                         const char* format) {
  QCOLL_REQUIRE(layout.shard_numel() % block == 0, function, "layout.granule()", layout.granule(),
                "does not make shards whole blocks of", format << " (block " << block << ")");
  QCOLL_REQUIRE(!layout.grouped() || layout.granule() % block == 0, function, "layout.granule()",
                layout.granule(), "does not make the tensor group's slots whole blocks of",
                format << " (block " << block << ")");
}

//! Seed of rank r's stochastic rounding at a given hop: distinct per rank so that the ranks'
//! rounding errors are independent and average out in a reduction.
inline std::uint64_t rank_seed(std::uint64_t seed, int rank, int hop) {
  return fnv1a({seed, static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(hop)});
}

//! A message-block source over a run of a layout's buffer: block b reads base + b * Block, where
//! base[0] is the buffer's element `first`; its data elements are the layout's (ShardLayout::data_in:
//! below numel, and inside a tensor of a group), rounded up to whole spans under a rotation (the
//! rotation spreads data into the padding of a partial span). The rest is padding: excluded from
//! statistics, encoded as zero codes.
template <class T, std::size_t Block>
struct LayoutSource {
  const T* base;
  std::size_t first;
  const ShardLayout& layout;
  Rotation rotation{};
  host::detail::BlockSource<T> operator()(std::size_t b) const {
    const std::size_t at = b * Block;
    return host::detail::BlockSource<T>{base + at,
                                        rotated_count(layout.data_in(first + at, Block), rotation)};
  }
  //! The end (nb at most) of the run of full blocks from block b, which is full (the quantizers'
  //! full_run_end): the blocks inside the run of data from block b on (ShardLayout::data_in over
  //! the rest of the message: up to numel, or to the end of block b's tensor's data). O(1) flat,
  //! O(log tensors) grouped. A run that goes on into the next tensor (no padding between), or a
  //! partial block that a rotation fills, ends it early (at b itself for the latter), which costs
  //! nothing but a shorter run.
  std::size_t full_run_end(std::size_t b, std::size_t nb) const {
    const std::size_t data = layout.data_in(first + b * Block, (nb - b) * Block);
    return b + data / Block;  // data <= (nb - b) * Block
  }
};

//! Decodes the first `valid` of the n elements of a checked message into out as T and zeroes
//! out[valid, n).
template <class F, class T>
void decode_slice(const void* msg, std::size_t n, std::size_t valid, T* out) {
  host::detail::decode_into<F, T>(msg, n, valid, out);
  for (std::size_t i = valid; i < n; ++i) out[i] = from_float<T>(0.0f);
}

//! Reads and checks the header of a message received in a call with tag `tag`.
template <class F>
MessageHeader read_call_header(const void* msg, std::size_t n, std::uint64_t tag, const char* function,
                               const char* what) {
  const MessageHeader h = host::detail::read_header<F>(msg, n, function, what);
  check_tag(h, tag, function, what);
  return h;
}

//! Decodes `count` messages of n elements each (message i at msgs + i * stride) and sums them in
//! fp32 in order i = 0, 1, ... into acc[0, limit), starting from +0. Checks each header (and the
//! call's tag).
template <class F>
void sum_messages(const unsigned char* msgs, std::size_t stride, int count, std::size_t n, std::size_t limit,
                  float* acc, std::uint64_t tag, const char* function) {
  for (std::size_t i = 0; i < limit; ++i) acc[i] = 0.0f;
  for (int m = 0; m < count; ++m) {
    const unsigned char* msg = msgs + static_cast<std::size_t>(m) * stride;
    read_call_header<F>(msg, n, tag, function, "received message");
    host::detail::decode_into<F, float, true>(msg, n, limit, acc);
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

//! A device plan's copy of a grouped layout's slot table (empty for a flat layout and on host
//! transports): made once at construction by make_device_slots (collective/device.cuh), which
//! allocates 2 * tensors words of device memory and copies the table there; shared by copies of
//! the plan and freed with the last. Kernels take `table` by value.
struct DeviceSlots {
  std::shared_ptr<void> memory;  //!< the device allocation (null: none)
  SlotTable table{};             //!< the table in device memory (slots = 0: flat)
};

//! The DeviceSlots of `layout` for a plan on Transport: empty unless Transport moves device
//! memory and the layout is a group of several tensors. Defined in collective/device.cuh (which
//! every device transport's header includes). Throws qcoll::Error if a CUDA call fails.
template <class Transport>
DeviceSlots make_device_slots(const ShardLayout& layout);

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

//! Decodes the `ranks` gathered messages in p.recv: message q (n elements of F) into
//! out + offset(q): its first valid(q) elements as T, the rest of the n, and the layout's padding,
//! as zero. Checks every header (and the call's tag). `what` names the senders in errors. Returns
//! the OR of the messages' kFlagNonFinite.
template <class F, class T, class Offset, class Valid>
std::uint32_t decode_gathered(int ranks, const GatherPieces& p, std::size_t message_bytes, std::size_t n,
                              T* out, Offset&& offset, Valid&& valid, const ShardLayout& layout,
                              std::uint64_t tag, const char* function, const char* what) {
  std::uint32_t flags = 0;
  for (int q = 0; q < ranks; ++q) {
    const unsigned char* msg = p.recv + static_cast<std::size_t>(q) * message_bytes;
    flags |= read_call_header<F>(msg, n, tag, function, what).flags & kFlagNonFinite;
    decode_slice<F>(msg, n, valid(q), out + offset(q));
    layout.zero_inner_padding(out + offset(q), offset(q), valid(q));
  }
  return flags;
}

//! The nonblocking request type of a host transport (Transport::Request); an empty stand-in for
//! transports without one (the device transports, whose calls are stream-ordered instead).
template <class Transport, class = void>
struct request_of {
  struct type {
    bool active() const noexcept { return false; }
  };
};
template <class Transport>
struct request_of<Transport, std::void_t<typename Transport::Request>> {
  using type = typename Transport::Request;
};

//! The base of a plan's PendingCall state: the call number; release() (hidden by states that
//! hold another plan's handle) lets go of what the destructor would otherwise report.
struct PendingState {
  std::uint64_t call = 0;  //!< the call's number
  void release() noexcept {}
};

//! The state of a started host call with one all-gather exchange (the plans' start()): the
//! exchange, the agreed result, the call's tag, the output and the workspace.
template <class Transport, class T>
struct GatherState : PendingState {
  typename request_of<Transport>::type req;  //!< the exchange of the messages
  std::uint32_t result = 0;                  //!< the agreed result flags
  std::uint64_t tag = 0;                     //!< the call's tag (CallIdentity::hash)
  T* out = nullptr;                          //!< where finish() writes
  void* workspace = nullptr;

  //! Starts the all-gather of `send` (message_bytes per rank) into `recv` over `t` for `call`.
  GatherState(Transport& t, const CallIdentity& call, std::uint32_t agreed, T* output, void* ws,
              const void* send, void* recv, std::size_t message_bytes)
      : result(agreed), tag(call.hash()), out(output), workspace(ws) {
    this->call = call.word[CallIdentity::call];
    req = t.start_all_gather(send, recv, message_bytes);
  }
  GatherState() = default;
};

//! What a plan knows of its started, unfinished host calls (start / finish): the call in flight
//! and a call whose handle was destroyed unfinished, which the next start reports once.
struct InFlight {
  std::uint64_t started = 0;    //!< call number in flight (0: none)
  std::uint64_t abandoned = 0;  //!< call number destroyed unfinished, not yet reported (0: none)

  //! The local check of a start (or a blocking call) of call number `next`: throws qcoll::Error if
  //! a call is in flight or one was abandoned; forgets the abandoned call either way (reported
  //! once). O(1).
  void check_start(const char* function, std::uint64_t next) {
    const std::uint64_t dropped = abandoned;
    abandoned = 0;
    QCOLL_REQUIRE(started == 0, function, "plan", "call " << started << " started and not finished",
                  "allows one call in flight; finish it before call", next);
    QCOLL_REQUIRE(dropped == 0, function, "plan", "call " << dropped << " destroyed unfinished",
                  "lost its result; this call is rejected so every rank sees it, before call", next);
  }
};

}  // namespace detail

//! A started host call of a plan (the plans' start()): it refers to the caller's buffers and
//! workspace and to the plan, which must all stay valid (and the plan in place) until the call
//! is finished; it owns nothing else. finish() completes it and returns what the blocking call
//! returns; progress() lets the exchange advance from a compute loop (see docs/overlap.md).
//! Destroying an unfinished handle completes (or, where peers have not started it, withdraws
//! from) the exchange so no rank hangs, drops the result, and makes the plan's next call throw on
//! every rank, naming the lost call. Movable, not copyable.
template <class Plan, class State>
class PendingCall {
 public:
  PendingCall() = default;
  PendingCall(PendingCall&& o) noexcept : plan_(o.plan_), state_(std::move(o.state_)) { o.plan_ = nullptr; }
  PendingCall& operator=(PendingCall&& o) noexcept {
    if (this != &o) {
      abandon(true);
      plan_ = o.plan_;
      o.plan_ = nullptr;
      state_ = std::move(o.state_);
    }
    return *this;
  }
  PendingCall(const PendingCall&) = delete;
  PendingCall& operator=(const PendingCall&) = delete;
  ~PendingCall() { abandon(true); }

  //! True from start() until finish() (or drop()).
  bool active() const noexcept { return plan_ != nullptr; }
  //! The call number this handle carries (0 when inactive).
  std::uint64_t call() const noexcept { return plan_ != nullptr ? state_.call : 0; }

  //! Lets the exchange advance without blocking (transport test(); on MPI this is what moves the
  //! data while the caller computes). Returns true once the exchange is done (finish() then only
  //! decodes). A plan with several exchanges starts the next one here when the previous is done.
  //! Throws qcoll::Error if the handle is not active; on an error of the call itself the handle
  //! becomes inactive and the call is over.
  bool progress() {
    require_active("progress");
    try {
      return plan_->progress_call(state_);
    } catch (...) {
      end();
      throw;
    }
  }

  //! Completes the call: waits for the exchange, decodes, and returns what the blocking call
  //! returns. Throws qcoll::Error if the handle is not active (never started, finished already) or
  //! the call fails; the handle is inactive afterwards either way.
  auto finish() {
    require_active("finish");
    Plan* plan = plan_;
    plan_ = nullptr;
    plan->inflight_.started = 0;
    return plan->finish_call(state_);
  }

  //! Completes (or withdraws from) the exchange as the destructor does, without the report: the
  //! result is lost and the plan's next call runs normally. No-op when inactive.
  void drop() noexcept { abandon(false); }

 private:
  friend Plan;
  PendingCall(Plan* plan, State state) noexcept : plan_(plan), state_(std::move(state)) {}

  // The plans' finish(pending): rejects a handle of another plan, then finish().
  auto finish_by(const Plan* owner, const char* function) {
    QCOLL_REQUIRE(plan_ == owner || plan_ == nullptr, function, "pending", "a handle of another plan",
                  "must come from", "this plan's start()");
    return finish();
  }
  void require_active(const char* what) const {
    QCOLL_REQUIRE(plan_ != nullptr, std::string("PendingCall::") + what, "pending", "an inactive handle",
                  "is not", "a started, unfinished call (finished already, or never started)");
  }
  void end() noexcept {
    if (plan_ != nullptr) plan_->inflight_.started = 0;
    plan_ = nullptr;
    state_.release();
    state_ = State{};  // completes the exchanges the state still holds
  }
  void abandon(bool report) noexcept {
    if (plan_ == nullptr) return;
    if (report) plan_->inflight_.abandoned = state_.call;
    end();
  }

  Plan* plan_ = nullptr;
  State state_;
};

namespace detail {}  // namespace detail
QCOLL_NAMESPACE_END
