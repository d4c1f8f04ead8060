#pragma once
//! \file
//! hpZ: a secondary copy of this rank's share of the weights, and the node-local gather from it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.hpp"

QCOLL_NAMESPACE_BEGIN

namespace detail {
//! Device memory for n elements of T, allocated once (defined in collective/device.cuh).
template <class T>
class DeviceStorage;
}  // namespace detail

//! Hierarchical partitioning (ZeRO++ hpZ). After the forward all-gather, capture() keeps this
//! rank's secondary shard: the 1/L of the full padded buffer (L = ranks per node) that its local
//! index owns, SecondaryLayout::shard_numel() elements, at no communication cost. gather() later
//! rebuilds the full buffer with an all-gather inside the node only, each secondary shard
//! travelling in format F (Identity<T> by default: bit-exact, the forward gather's result is
//! reproduced exactly).
//!
//! The secondary copy carries the weights generation it was taken from; gather() with any other
//! generation throws instead of using stale weights (host transports: on every rank of the world,
//! before sending; device transports: on that rank, its node peers get kResultRejected). On host
//! transports each gather() first agrees with the whole world (one small all-reduce: the call's
//! identity and every rank's verdict on its arguments), so a bad argument or a disagreement on
//! any node raises qcoll::Error on every rank; only the data stays inside the node. start() /
//! finish() split a host gather so the intra-node exchange overlaps computation (docs/overlap.md).
//! The copy is held in plan-owned storage allocated once at construction (device memory for a
//! device transport); calls allocate nothing. On device transports capture() and gather() take device
//! buffers and are stream-ordered (collective/device.cuh).
template <class T, class F, class Transport>
class SecondaryShard {
 public:
  using SubTransport = decltype(std::declval<Transport&>().split(0, 0));

  //! Collective over `world`: checks that all ranks agree on the plan (element type, format,
  //! layout and the whole node table), then splits off the intra-node group (ranks of this rank's
  //! node, ordered by local index). `topo` must describe `world`. `world` must outlive the plan.
  SecondaryShard(Transport& world, const Topology& topo, const ShardLayout& layout)
      : world_(world),
        layout_(layout),
        calls_{identity(layout, topo)},
        secondary_(checked(world, topo, layout, calls_.id, slots_)),
        intra_(world.split(topo.node(), topo.local_index())),
        local_(topo.local_index()),
        storage_(secondary_.shard_numel()) {}

  //! The plan's identity (call number 0), which every gather's agreement compares across ranks.
  const CallIdentity& identity() const { return calls_.id; }

  //! Keeps this rank's secondary shard of `full` (padded_numel() elements, identical on all ranks,
  //! e.g. the output of the forward QuantizedAllGather) as weights generation `generation`. Local,
  //! no communication. O(padded_numel / L). Device transports: `full` is device memory and the
  //! copy is enqueued on `stream` (null: the transport's stream).
  void capture(const T* full, std::uint64_t generation, typename Transport::stream_type stream = {}) {
    const char* fn = "SecondaryShard::capture";
    QCOLL_REQUIRE(full != nullptr || layout_.padded_numel() == 0, fn, "full", "null",
                  "with padded_numel =", layout_.padded_numel());
    const T* from = full + secondary_.shard_offset(local_);
    if constexpr (detail::on_device<Transport>) {
      storage_.assign_async(from, intra_, stream, fn);
    } else {
      (void)stream;
      std::copy(from, from + secondary_.shard_numel(), storage_.begin());
    }
    generation_ = generation;
    captured_ = true;
  }

  //! The generation of the captured copy; throws if nothing was captured yet.
  std::uint64_t generation() const {
    QCOLL_REQUIRE(captured_, "SecondaryShard::generation", "capture()", "never called", "before",
                  "generation()");
    return generation_;
  }

  //! Bytes of one secondary shard's message on the wire.
  std::size_t message_bytes() const { return packed_bytes<F>(secondary_.shard_numel()); }

  //! Workspace the gather needs, in bytes (device memory for a device transport).
  std::size_t workspace_bytes() const { return carve(nullptr).bytes; }

  //! Rebuilds `full` (padded_numel() elements) from the L secondary shards of this node, with an
  //! all-gather over the intra-node group only (no data leaves the node; the agreement is one
  //! small all-reduce over the world). `generation` must equal the captured one on every rank,
  //! else every rank throws qcoll::Error before sending. `full` must not overlap the workspace. Host
  //! transports: returns kResultNonFinite if a secondary shard held NaN or Inf. Device transports:
  //! returns nothing, the flags go to the workspace (collective/device.cuh), and a stale
  //! generation is a rejected argument (this rank throws, its node peers get kResultRejected).
  auto gather(T* full, std::uint64_t generation, void* workspace, std::size_t workspace_bytes,
              typename Transport::stream_type stream = {}) {
    if constexpr (detail::on_device<Transport>) {
      const std::string err = device_gather(full, generation, workspace, workspace_bytes, stream);
      if (!err.empty()) throw Error(err);
    } else {
      return start(full, generation, workspace, workspace_bytes).finish();
    }
  }

 private:
  using State = detail::GatherState<SubTransport, T>;

 public:
  //! A started gather (host transports): see PendingCall.
  using Pending = PendingCall<SecondaryShard, State>;

  //! The first half of gather() (host transports): agrees on the call and the arguments over the
  //! world, quantizes this rank's secondary shard and starts the intra-node exchange, then returns
  //! without waiting for it. Throws on every rank, before anything is sent, where gather() would,
  //! and also if this plan has a gather in flight (one at a time per plan) or one whose handle was
  //! destroyed unfinished. `full` and the workspace must stay valid and untouched until finish().
  //! O(padded_numel / L) work.
  Pending start(T* full, std::uint64_t generation, void* workspace, std::size_t workspace_bytes) {
    static_assert(!detail::on_device<Transport>, "start/finish run on host transports");
    const char* fn = "SecondaryShard::gather";
    const std::size_t S = secondary_.shard_numel();
    const detail::GatherPieces p = carve(workspace);
    const CallIdentity call = calls_.next();
    const std::string err = detail::local_check([&] {
      inflight_.check_start(fn, call.word[CallIdentity::call]);
      QCOLL_REQUIRE(captured_, fn, "capture()", "never called", "before", "gather()");
      QCOLL_REQUIRE(generation == generation_, fn, "generation", generation,
                    "does not match the captured (stale secondary) generation", generation_);
      detail::check_workspace(fn, workspace, workspace_bytes, p.bytes);
      detail::check_buffer(fn, "full", full, layout_.padded_numel(), workspace, workspace_bytes);
      const std::size_t offset = secondary_.shard_offset(local_);
      host::QuantizeOptions o;
      o.index_base = offset;
      o.tag = call.hash();
      host::detail::quantize_blocks<F, T>(
          S, detail::LayoutSource<T, F::block>{storage_.data(), offset, layout_}, p.send, o);
    });
    // Agreed over the world, so that every node hears of a rank's bad argument or disagreement;
    // the non-finite flag is the node's (what this rank receives), from the message headers.
    detail::agree_on_call(world_, call, err, false, fn);
    State st(intra_, call, 0, full, workspace, p.send, p.recv, message_bytes());
    inflight_.started = st.call;
    return Pending(this, std::move(st));
  }

  //! The second half of gather(): pending.finish() for a handle of this plan (throws qcoll::Error
  //! if it belongs to another plan or is not active). Waits for the node's secondary shards,
  //! decodes them into `full`, returns kResultNonFinite as gather() does. O(padded_numel) work.
  std::uint32_t finish(Pending& pending) { return pending.finish_by(this, "SecondaryShard::finish"); }

  //! The intra-node group this plan gathers over (its byte counters show the hpZ traffic).
  const SubTransport& intra_node() const { return intra_; }
  //! The secondary layout (L shards of the padded buffer).
  const SecondaryLayout& secondary_layout() const { return secondary_; }

 private:
  using Storage = std::conditional_t<detail::on_device<Transport>, detail::DeviceStorage<T>, std::vector<T>>;

  std::string device_gather(T* full, std::uint64_t generation, void* workspace, std::size_t workspace_bytes,
                            typename Transport::stream_type stream);

  template <class, class>
  friend class PendingCall;

  bool progress_call(State& st) { return !st.req.active() || intra_.test(st.req); }

  // Waits for the node's messages and decodes them.
  std::uint32_t finish_call(State& st) {
    if (st.req.active()) intra_.wait(st.req);
    const std::size_t S = secondary_.shard_numel(), numel = layout_.numel();
    return detail::decode_gathered<F>(
        secondary_.parts(), carve(st.workspace), message_bytes(), S, st.out,
        [this](int j) { return secondary_.shard_offset(j); },
        [&](int j) { return valid_elements_in(numel, secondary_.shard_offset(j), S); }, layout_, st.tag,
        "SecondaryShard::gather", "message from a node peer");
  }

  static CallIdentity identity(const ShardLayout& layout, const Topology& topo) {
    CallIdentity id = detail::plan_identity<T>(2, layout, HopOptions{});
    detail::set_format<F>(id, 1);
    id.word[CallIdentity::node_table] = topo.fingerprint();
    return id;
  }

  detail::GatherPieces carve(void* base) const {
    return detail::carve_gather(base, message_bytes(), secondary_.parts(), detail::on_device<Transport>);
  }
  // The checks agreed at construction; a device plan also copies the group's slots to `slots`.
  static SecondaryLayout checked(Transport& world, const Topology& topo, const ShardLayout& layout,
                                 const CallIdentity& id, detail::DeviceSlots& slots) {
    const std::string err = detail::local_check([&] {
      QCOLL_REQUIRE(topo.world_size() == world.size() && topo.rank() == world.rank(), "SecondaryShard",
                    "topo", "world " << topo.world_size() << " rank " << topo.rank(),
                    "does not describe the transport's",
                    "world " << world.size() << " rank " << world.rank());
      QCOLL_REQUIRE(layout.parts() == world.size(), "SecondaryShard", "layout.parts()", layout.parts(),
                    "differs from the world size", world.size());
      detail::check_blocks("SecondaryShard", layout, F::block, format_name(F::id));
      if constexpr (detail::on_device<Transport>) slots = detail::make_device_slots<Transport>(layout);
    });
    detail::agree_on_call(world, id, err, false, "SecondaryShard");
    return SecondaryLayout(layout, topo);
  }

  Transport& world_;
  ShardLayout layout_;
  detail::PlanCalls calls_;
  detail::DeviceSlots slots_;  // device transports: the group's slot table (set by checked())
  SecondaryLayout secondary_;
  SubTransport intra_;
  int local_;
  Storage storage_;
  std::uint64_t generation_ = 0;
  bool captured_ = false;
  detail::InFlight inflight_;
};

QCOLL_NAMESPACE_END
