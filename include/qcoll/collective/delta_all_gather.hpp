#pragma once
//! \file
//! qWD: the weight-difference all-gather (SDP4Bit) for ZeRO-1/2 style training, where every rank
//! holds a replica of the full weights and updates only its own shard.

#include <cstddef>
#include <cstdint>
#include <string>

#include "common.hpp"

QCOLL_NAMESPACE_BEGIN

//! Weight-difference all-gather. Every rank keeps a replica R of the full padded buffer
//! (padded_numel() elements of T, the same bits on every rank). After its optimizer step the owner
//! of shard s holds new weights w_s; a call sends d_s = Q(w_s - R_s) in format F (the difference
//! computed in fp32), and every rank, the owner included, sets R_q <- T(R_q + decode(d_q)) for every
//! shard q, in the same fp32 arithmetic, so the replicas stay bit-identical everywhere. The next
//! difference is taken against R, not against the previous weights, so quantization errors are
//! carried, not accumulated: after a call |w - R| is at most one difference's quantization error
//! plus the rounding of R to T. Differences are small when updates are, which is why 4-bit
//! differences work where 4-bit weights do not.
//!
//! resync<G>() sends the weights themselves in a format G of the caller's choice and sets
//! R_q <- decode(w_q): the first call of a run, or a periodic re-anchoring (with
//! G = Identity<T, ...> the replicas become equal to the weights, bit for bit).
//!
//! Construction is collective over `world`; calls on host transports block, allocate nothing,
//! and agree on the call (its CallIdentity, kind "delta all-gather" or "resync", and the call
//! number) and on every rank's arguments before anything is sent; start() / start_resync() and
//! finish() split a host call so the exchange overlaps computation (docs/overlap.md). Padding (elements >=
//! numel) is neither sent as data nor changed in the replica. Wire bytes per rank:
//! packed_bytes<F>(shard_numel) to each of the W - 1 peers.
//!
//! On device transports (include <qcoll/qcoll.cuh>) the calls take device buffers and a stream,
//! and are stream-ordered with no allocation and no host synchronisation, as the other device
//! plans (collective/device.cuh): result flags in the workspace's first word, a rank's bad
//! argument sent to its peers as rejected messages, no replica written when a rank rejected or a
//! message did not match. The replicas equal the host path's bit for bit.
template <class T, class F, class Transport>
class DeltaAllGather {
 public:
  //! Collective. Throws qcoll::Error on every rank if the ranks disagree on the plan, the layout
  //! has a different number of parts than `world` has ranks, or shards are not whole blocks of F.
  DeltaAllGather(Transport& world, const ShardLayout& layout, const host::QuantizeOptions& opt = {})
      : world_(world), layout_(layout), opt_(opt), calls_{identity(layout, opt)} {
    const std::string err = detail::local_check([&] {
      QCOLL_REQUIRE(layout.parts() == world.size(), "DeltaAllGather", "layout.parts()", layout.parts(),
                    "differs from the world size", world.size());
      detail::check_blocks("DeltaAllGather", layout, F::block, format_name(F::id));
      if constexpr (detail::on_device<Transport>) slots_ = detail::make_device_slots<Transport>(layout);
    });
    detail::agree_on_call(world, calls_.id, err, false, "DeltaAllGather");
  }

  //! The plan's identity (call number 0).
  const CallIdentity& identity() const { return calls_.id; }
  //! The layout.
  const ShardLayout& layout() const { return layout_; }

  //! Workspace of a difference call, in bytes (64-byte aligned; device memory for a device
  //! transport).
  std::size_t workspace_bytes() const { return carve<F>(nullptr).bytes; }
  //! Workspace of resync<G>(), in bytes.
  template <class G>
  std::size_t resync_workspace_bytes() const {
    return carve<G>(nullptr).bytes;
  }

  //! Sends this rank's difference and applies every rank's to `replica`. `shard`: this rank's new
  //! weights (shard_numel() elements); `replica`: padded_numel() elements, the same bits on every
  //! rank (this plan keeps them so). They must not overlap each other or the workspace, and are
  //! aligned to alignof(T). Host transports: returns kResultNonFinite if any rank's difference
  //! held NaN or Inf (the same on every rank; those blocks become NaN in every replica). Device
  //! transports: returns nothing, the flags go to the workspace. O(padded_numel) work.
  auto operator()(const T* shard, T* replica, void* workspace, std::size_t workspace_bytes,
                  typename Transport::stream_type stream = {}) {
    return dispatch<F>(6, shard, replica, workspace, workspace_bytes, stream);
  }

  //! Sends this rank's weights in format G and sets every replica's shard q to the decoded
  //! weights of rank q. Same arguments and checks as operator(), with resync_workspace_bytes<G>().
  template <class G>
  auto resync(const T* shard, T* replica, void* workspace, std::size_t workspace_bytes,
              typename Transport::stream_type stream = {}) {
    return dispatch<G>(7, shard, replica, workspace, workspace_bytes, stream);
  }

 private:
  template <class G>
  struct State;

 public:
  //! A started difference call (host transports): see PendingCall.
  using Pending = PendingCall<DeltaAllGather, State<F>>;
  //! A started resync<G>() (host transports).
  template <class G>
  using ResyncPending = PendingCall<DeltaAllGather, State<G>>;

  //! The first half of operator() (host transports): agrees on the call and the arguments over the
  //! world, quantizes this rank's difference and starts the exchange, then returns without waiting
  //! for it. Throws on every rank, before anything is sent, where operator() would, and also if
  //! this plan has a call in flight (one at a time per plan) or one whose handle was destroyed
  //! unfinished. `replica` and the workspace must stay valid and untouched until finish() (shard
  //! may be changed once start returns). O(shard_numel) work.
  Pending start(const T* shard, T* replica, void* workspace, std::size_t workspace_bytes) {
    return start_call<F>(6, shard, replica, workspace, workspace_bytes);
  }
  //! The first half of resync<G>() (host transports); as start().
  template <class G>
  ResyncPending<G> start_resync(const T* shard, T* replica, void* workspace, std::size_t workspace_bytes) {
    return start_call<G>(7, shard, replica, workspace, workspace_bytes);
  }
  //! The second half: pending.finish() for a handle of this plan (throws qcoll::Error if it belongs
  //! to another plan or is not active). Waits for the messages, applies them to the replica and
  //! returns what the blocking call returns. O(padded_numel) work.
  template <class G>
  std::uint32_t finish(PendingCall<DeltaAllGather, State<G>>& pending) {
    return pending.finish_by(this, "DeltaAllGather::finish");
  }

 private:
  template <class, class>
  friend class PendingCall;

  // out: the replica; kind 6 (a difference) or 7 (a resync in format G).
  template <class G>
  struct State : detail::GatherState<Transport, T> {
    using detail::GatherState<Transport, T>::GatherState;
    int kind = 6;
  };

  struct Pieces {
    detail::DeviceControl control;  // device: the result word and the quantizers' scratch
    float* diff;
    unsigned char* send;
    unsigned char* recv;
    std::size_t bytes;
  };
  template <class G>
  Pieces carve(void* base) const {
    WorkspaceCarver c(base);
    Pieces p{};
    p.control = detail::take_control(c, detail::on_device<Transport>);
    p.diff = c.take<float>(layout_.shard_numel());
    const std::size_t P = packed_bytes<G>(layout_.shard_numel());
    p.send = c.take<unsigned char>(P);
    p.recv = c.take<unsigned char>(P, static_cast<std::size_t>(world_.size()));
    p.bytes = c.bytes();
    return p;
  }

  template <class G>
  auto dispatch(int kind, const T* shard, T* replica, void* workspace, std::size_t workspace_bytes,
                typename Transport::stream_type stream) {
    if constexpr (detail::on_device<Transport>) {
      const std::string err = device_call<G>(kind, shard, replica, workspace, workspace_bytes, stream);
      if (!err.empty()) throw Error(err);
    } else {
      (void)stream;
      return start_call<G>(kind, shard, replica, workspace, workspace_bytes).finish();
    }
  }

  // The identity of the next call: kind 6 (a difference) or 7 (a resync), format G.
  template <class G>
  CallIdentity next_call(int kind) {
    CallIdentity call = calls_.next();
    call.word[CallIdentity::kind] = static_cast<std::uint64_t>(kind);
    detail::set_format<G>(call, 2);
    return call;
  }

  // Device data path (collective/device.cuh): enqueues the call; returns this rank's argument
  // error ("" if none) after taking part in the exchange.
  template <class G>
  std::string device_call(int kind, const T* shard, T* replica, void* workspace, std::size_t workspace_bytes,
                          typename Transport::stream_type stream);

  // Host call, first half. kind 6: a difference in format G (= F); kind 7: a resync in format G.
  template <class G>
  PendingCall<DeltaAllGather, State<G>> start_call(int kind, const T* shard, T* replica, void* workspace,
                                                   std::size_t workspace_bytes) {
    static_assert(!detail::on_device<Transport>, "start/finish run on host transports");
    const char* fn = kind == 6 ? "DeltaAllGather" : "DeltaAllGather::resync";
    const std::size_t S = layout_.shard_numel(), P = packed_bytes<G>(S);
    const int r = world_.rank();
    const CallIdentity call = next_call<G>(kind);
    const Pieces p = carve<G>(workspace);
    bool nonfinite = false;
    const std::string err = detail::local_check([&] {
      inflight_.check_start(fn, call.word[CallIdentity::call]);
      detail::check_workspace(fn, workspace, workspace_bytes, p.bytes);
      detail::check_buffer(fn, "shard", shard, S, workspace, workspace_bytes);
      detail::check_buffer(fn, "replica", replica, layout_.padded_numel(), workspace, workspace_bytes);
      QCOLL_REQUIRE(shard == nullptr || replica == nullptr || S == 0 || shard + S <= replica ||
                        replica + layout_.padded_numel() <= shard,
                    fn, "shard", static_cast<const void*>(shard), "overlaps", "replica");
      const std::size_t valid = layout_.valid_in_shard(r), offset = layout_.shard_offset(r);
      for (std::size_t i = 0; i < valid; ++i)
        p.diff[i] =
            kind == 6 ? fp::sub(to_float(shard[i]), to_float(replica[offset + i])) : to_float(shard[i]);
      host::QuantizeOptions o = opt_;
      o.seed = detail::rank_seed(opt_.seed, r, 1);
      o.index_base = offset;
      o.tag = call.hash();
      const auto flags = host::detail::quantize_blocks<G, float>(
          S, detail::LayoutSource<float, G::block>{p.diff, offset, layout_}, p.send, o);
      nonfinite = (flags & kFlagNonFinite) != 0;
    });
    const std::uint32_t result = detail::agree_on_call(world_, call, err, nonfinite, fn);
    State<G> st(world_, call, result, replica, workspace, p.send, p.recv, P);
    st.kind = kind;
    inflight_.started = st.call;
    return PendingCall<DeltaAllGather, State<G>>(this, std::move(st));
  }

  template <class G>
  bool progress_call(State<G>& st) {
    return !st.req.active() || world_.test(st.req);
  }

  // Host call, second half: waits for the messages and applies them to the replica.
  template <class G>
  std::uint32_t finish_call(State<G>& st) {
    const char* fn = st.kind == 6 ? "DeltaAllGather" : "DeltaAllGather::resync";
    if (st.req.active()) world_.wait(st.req);
    const std::size_t S = layout_.shard_numel(), P = packed_bytes<G>(S);
    const Pieces p = carve<G>(st.workspace);
    for (int q = 0; q < world_.size(); ++q) {
      const unsigned char* msg = p.recv + static_cast<std::size_t>(q) * P;
      detail::read_call_header<G>(msg, S, st.tag, fn, "message from a peer");
      T* out = st.out + layout_.shard_offset(q);
      if (st.kind == 6) {
        host::detail::decode_message<G>(
            msg, S, [out](std::size_t i, float d) { out[i] = from_float<T>(fp::add(to_float(out[i]), d)); },
            layout_.valid_in_shard(q));
      } else {
        host::detail::decode_into<G, T>(msg, S, layout_.valid_in_shard(q), out);
      }
      layout_.zero_inner_padding(out, layout_.shard_offset(q), layout_.valid_in_shard(q));
    }
    return st.result;
  }

  static CallIdentity identity(const ShardLayout& layout, const host::QuantizeOptions& opt) {
    CallIdentity id = detail::plan_identity<T>(6, layout, HopOptions::from(opt));
    detail::set_format<F>(id, 1);
    return id;
  }

  Transport& world_;
  ShardLayout layout_;
  host::QuantizeOptions opt_;
  detail::PlanCalls calls_;
  detail::InFlight inflight_;
  detail::DeviceSlots slots_;  // device transports: the group's slot table in device memory
};

QCOLL_NAMESPACE_END
