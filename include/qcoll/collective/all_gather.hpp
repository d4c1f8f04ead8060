#pragma once
//! \file
//! qwZ: quantized all-gather of a sharded buffer.

#include <cstddef>
#include <cstdint>
#include <string>

#include "common.hpp"

QCOLL_NAMESPACE_BEGIN

//! Quantized all-gather (ZeRO++ qwZ): every rank contributes its primary shard (shard_numel()
//! elements of T) and receives the full padded buffer (padded_numel() elements), each shard having
//! travelled as one packed message of format F. Every rank decodes every message, its own
//! included, so all replicas hold the same bits. Padding elements (index >= numel) are excluded
//! from block statistics and written as zero.
//!
//! A plan is built once (collectively: every rank of `world` constructs it with the same layout
//! and format) and called every step. Calls on host transports block until done; they allocate
//! nothing; start() / finish() split such a call so the exchange overlaps computation
//! (docs/overlap.md). On device transports (CudaLocalTransport, NcclTransport; include <qcoll/qcoll.cuh>)
//! the same call takes device buffers and is stream-ordered: see collective/device.cuh. Wire
//! bytes per rank: packed_bytes<F>(shard_numel) to each of the W - 1 peers.
template <class T, class F, class Transport>
class QuantizedAllGather {
 public:
  //! Collective. Throws qcoll::Error on every rank if the ranks disagree on the plan (its
  //! CallIdentity: element type, format, block, layout sizes, rounding, seed; the error names the
  //! fields that differ and the ranks on each side), if the layout has a different number of
  //! parts than `world` has ranks, or if shards are not whole blocks of F. `opt` selects nearest
  //! or stochastic rounding (keyed by global element index).
  QuantizedAllGather(Transport& world, const ShardLayout& layout, const host::QuantizeOptions& opt = {})
      : QuantizedAllGather(world, layout, HopOptions::from(opt)) {}

  //! As above, with a randomized Hadamard rotation (`hop.rotation`): each rank quantizes its
  //! rotated shard, span by span, and every rank rotates each decoded shard back (on device
  //! transports too, with the same bits). Also throws (on every rank) if the rotation's span does
  //! not divide F's block.
  QuantizedAllGather(Transport& world, const ShardLayout& layout, const HopOptions& hop)
      : world_(world),
        layout_(layout),
        opt_{hop.rounding, hop.seed, 0, 0},
        rotation_(hop.rotation),
        calls_{identity(layout, hop)} {
    const std::string err = detail::local_check([&] {
      QCOLL_REQUIRE(layout.parts() == world.size(), "QuantizedAllGather", "layout.parts()", layout.parts(),
                    "differs from the world size", world.size());
      detail::check_blocks("QuantizedAllGather", layout, F::block, format_name(F::id));
      if constexpr (detail::on_device<Transport>) slots_ = detail::make_device_slots<Transport>(layout);
      check_rotation("QuantizedAllGather", hop.rotation, F::block);
    });
    detail::agree_on_call(world, calls_.id, err, false, "QuantizedAllGather");
  }

  //! The plan's identity (call number 0), which every call's agreement compares across ranks.
  const CallIdentity& identity() const { return calls_.id; }

  //! Bytes of one rank's message on the wire.
  std::size_t message_bytes() const { return packed_bytes<F>(layout_.shard_numel()); }

  //! Workspace the call needs, in bytes (aligned to kWorkspaceAlignment; device memory for a
  //! device transport).
  std::size_t workspace_bytes() const { return carve(nullptr).bytes; }

  //! Gathers: `shard` (shard_numel() elements, this rank's shard; may alias full + shard_offset(rank))
  //! into `full` (padded_numel() elements). Neither may overlap the workspace; both must be
  //! aligned to alignof(T). Host transports: returns kResultNonFinite if any rank's shard held NaN
  //! or Inf (same on every rank), else 0; before anything is sent the ranks agree on the call
  //! (plan identity and call number) and on their arguments, and a disagreement or a rank's bad
  //! argument raises qcoll::Error on all ranks. Device transports: returns nothing, the flags go
  //! to the workspace (collective/device.cuh). O(padded_numel) work.
  auto operator()(const T* shard, T* full, void* workspace, std::size_t workspace_bytes,
                  typename Transport::stream_type stream = {}) {
    if constexpr (detail::on_device<Transport>) {
      const std::string err = device_call(shard, full, workspace, workspace_bytes, stream, nullptr, ~0u);
      if (!err.empty()) throw Error(err);
    } else {
      return start(shard, full, workspace, workspace_bytes).finish();
    }
  }

 private:
  using State = detail::GatherState<Transport, T>;

 public:
  //! A started call (host transports): see PendingCall.
  using Pending = PendingCall<QuantizedAllGather, State>;

  //! The first half of operator() (host transports): agrees on the call and the arguments over
  //! the world, quantizes this rank's shard and starts the exchange, then returns without waiting
  //! for it. Throws on every rank, before anything is sent, where operator() would, and also if
  //! this plan has a call in flight (one at a time per plan) or a call whose handle was destroyed
  //! unfinished. `shard`, `full` and the workspace must stay valid and untouched until finish()
  //! (shard may be changed once start returns). O(shard_numel) work.
  Pending start(const T* shard, T* full, void* workspace, std::size_t workspace_bytes) {
    static_assert(!detail::on_device<Transport>, "start/finish run on host transports");
    const char* fn = "QuantizedAllGather";
    const std::size_t S = layout_.shard_numel();
    const int r = world_.rank();
    const Pieces p = carve(workspace);
    const CallIdentity call = calls_.next();
    bool nonfinite = false;
    const std::string err = detail::local_check([&] {
      inflight_.check_start(fn, call.word[CallIdentity::call]);
      detail::check_workspace(fn, workspace, workspace_bytes, p.bytes);
      detail::check_buffer(fn, "shard", shard, S, workspace, workspace_bytes);
      detail::check_buffer(fn, "full", full, layout_.padded_numel(), workspace, workspace_bytes);
      host::QuantizeOptions o = opt_;
      o.index_base = layout_.shard_offset(r);
      o.tag = call.hash();
      std::uint32_t flags;
      if (!rotation_.enabled()) {
        flags = host::detail::quantize_blocks<F, T>(
            S, detail::LayoutSource<T, F::block>{shard, o.index_base, layout_}, p.send, o);
      } else {
        const std::size_t valid = layout_.valid_in_shard(r);
        for (std::size_t i = 0; i < S; ++i) p.scratch[i] = i < valid ? to_float(shard[i]) : 0.0f;
        layout_.zero_inner_padding(p.scratch, o.index_base, valid);
        rotate_run(p.scratch, S, rotation_, o.index_base, true);
        flags = host::detail::quantize_blocks<F, float>(
            S, detail::LayoutSource<float, F::block>{p.scratch, o.index_base, layout_, rotation_}, p.send, o);
      }
      nonfinite = (flags & kFlagNonFinite) != 0;
    });
    const std::uint32_t result = detail::agree_on_call(world_, call, err, nonfinite, fn);
    State st(world_, call, result, full, workspace, p.send, p.recv, message_bytes());
    inflight_.started = st.call;
    return Pending(this, std::move(st));
  }

  //! The second half of operator(): pending.finish() for a handle of this plan (throws
  //! qcoll::Error if it belongs to another plan or is not active). Waits for the exchange,
  //! decodes every rank's message into `full`, returns kResultNonFinite as operator() does.
  //! O(padded_numel) work.
  std::uint32_t finish(Pending& pending) { return pending.finish_by(this, "QuantizedAllGather::finish"); }

  //! The layout this plan gathers.
  const ShardLayout& layout() const { return layout_; }

  //! Device data path (collective/device.cuh): enqueues the call; returns this rank's argument
  //! error ("" if none) after enqueuing its share of the exchange. `status`: the result word to
  //! OR flags into (null: the workspace's own, reset first); `report`: the header flags reported.
  std::string device_call(const T* shard, T* full, void* workspace, std::size_t workspace_bytes,
                          typename Transport::stream_type stream, std::uint32_t* status,
                          std::uint32_t report);

 private:
  template <class, class>
  friend class PendingCall;

  bool progress_call(State& st) { return !st.req.active() || world_.test(st.req); }

  // Waits for the messages and decodes them.
  std::uint32_t finish_call(State& st) {
    const char* fn = "QuantizedAllGather";
    if (st.req.active()) world_.wait(st.req);
    const Pieces p = carve(st.workspace);
    const std::size_t S = layout_.shard_numel();
    T* full = st.out;
    if (!rotation_.enabled()) {
      detail::decode_gathered<F>(
          world_.size(), p, message_bytes(), S, full, [this](int q) { return layout_.shard_offset(q); },
          [this](int q) { return layout_.valid_in_shard(q); }, layout_, st.tag, fn, "message from a peer");
      return st.result;
    }
    // Rotated: decode each shard into the scratch, rotate it back, store its data elements.
    for (int q = 0; q < world_.size(); ++q) {
      const unsigned char* msg = p.recv + static_cast<std::size_t>(q) * message_bytes();
      detail::read_call_header<F>(msg, S, st.tag, fn, "message from a peer");
      const std::size_t valid = layout_.valid_in_shard(q), first = layout_.shard_offset(q);
      detail::decode_slice<F>(msg, S, rotated_count(valid, rotation_), p.scratch);
      rotate_run(p.scratch, rotated_count(valid, rotation_), rotation_, first, false);
      for (std::size_t i = 0; i < S; ++i) full[first + i] = from_float<T>(i < valid ? p.scratch[i] : 0.0f);
      layout_.zero_inner_padding(full + first, first, valid);
    }
    return st.result;
  }

  static CallIdentity identity(const ShardLayout& layout, const HopOptions& hop) {
    CallIdentity id = detail::plan_identity<T>(1, layout, hop);
    detail::set_format<F>(id, 1);
    return id;
  }

  // The gather's pieces, then (rotation only) a float scratch of one shard (the rotated shard
  // before it is quantized).
  struct Pieces : detail::GatherPieces {
    float* scratch;
  };
  Pieces carve(void* base) const {
    Pieces p{detail::carve_gather(base, message_bytes(), world_.size(), detail::on_device<Transport>),
             nullptr};
    const std::size_t extra = rotation_.enabled() ? layout_.shard_numel() * sizeof(float) : 0;
    if (base != nullptr && extra > 0)
      p.scratch = reinterpret_cast<float*>(static_cast<unsigned char*>(base) + p.bytes);
    p.bytes += (extra + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
    return p;
  }
  Transport& world_;
  ShardLayout layout_;
  host::QuantizeOptions opt_;
  Rotation rotation_;
  detail::PlanCalls calls_;
  detail::InFlight inflight_;
  detail::DeviceSlots slots_;  // device transports: the group's slot table in device memory
};

QCOLL_NAMESPACE_END
