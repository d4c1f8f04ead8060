#pragma once
//! \file
//! qgZ: quantized reduce-scatter in one hop or two hops, and the quantized all-reduce built on it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "all_gather.hpp"
#include "common.hpp"
#include "feedback.hpp"

QCOLL_NAMESPACE_BEGIN

//! A caller's error-feedback state for one call: the buffer given to init_residual() and its size.
struct ResidualState {
  void* data = nullptr;   //!< the state (64-byte aligned; host memory, or device memory for a device
                          //!< transport), initialised by init_residual()
  std::size_t bytes = 0;  //!< its size, at least residual_bytes()
};

//! Route of a quantized reduce-scatter.
enum class Hops : std::uint8_t {
  one,  //!< flat all-to-all over the world: each rank quantizes W slices once
  two,  //!< ZeRO++ qgZ: intra-node all-to-all, reduce, re-quantize, inter-node all-to-all, reduce
};

//! Quantized reduce-scatter (ZeRO++ qgZ). Every rank contributes a full padded gradient
//! (padded_numel() elements of T) and receives its reduced shard (shard_numel() elements): the
//! sum, or the mean (sum / world size), over ranks. Partial sums are accumulated in fp32 in a fixed
//! order (by source index), so the result is deterministic and the same on every transport.
//!
//! Hops::two (N nodes × L ranks): the gradient is quantized in F1 in the qgZ order (chunk for
//! local index j = the slices of ranks (m, j) for m = 0..N-1; the reorder is fused into the
//! quantization), exchanged inside the node, summed, re-quantized in F2 slice by slice, exchanged
//! across nodes among ranks of the same local index, and summed. Only F2 messages of 1/L of the
//! data cross nodes. Hops::one quantizes the W slices in F1 and exchanges them once; F2 is unused.
//!
//! Construction is collective over `world` (it splits off the intra- and inter-node groups for two
//! hops). Calls on host transports block, allocate nothing, and check every argument on every
//! rank before anything is sent; start() / finish() split such a call so its exchanges overlap
//! computation (docs/overlap.md). On device transports the call takes device buffers and is
//! stream-ordered (collective/device.cuh); the results are the host path's, bit for bit.
//! Stochastic rounding uses a per-rank, per-hop key. Each hop has its own options
//! (ReduceScatterOptions): rounding, seed, and a randomized Hadamard rotation (format/hadamard.hpp):
//! a hop with a rotation quantizes rotated spans, the sums are formed in the rotated domain (the
//! rotation is linear and the same on every rank), and the result is rotated back once, on the
//! reduced shard. Rotations and error feedback (feedback.hpp) run on host and device transports
//! with the same bits.
template <class T, class F1, class F2, class Transport>
class QuantizedReduceScatter {
 public:
  using SubTransport = decltype(std::declval<Transport&>().split(0, 0));

  //! Collective. Throws qcoll::Error on every rank, before any sub-group is split off, if the
  //! ranks disagree on the plan (its CallIdentity: element type, formats, blocks, layout sizes,
  //! op, hops, the whole node table, rounding, seed; the error names the fields that differ and
  //! the ranks on each side), `topo` does not describe `world`, the layout's parts differ from the
  //! world size, or shards are not whole blocks of F1 and F2.
  QuantizedReduceScatter(Transport& world, const Topology& topo, const ShardLayout& layout, Reduce op,
                         Hops hops = Hops::two, const host::QuantizeOptions& opt = {})
      : QuantizedReduceScatter(world, topo, layout, op, hops,
                               ReduceScatterOptions{HopOptions::from(opt), HopOptions::from(opt)}) {}

  //! As above, with each hop's rounding, seed and rotation. Also throws (on every rank) if a
  //! rotation's span does not divide its hop's block.
  QuantizedReduceScatter(Transport& world, const Topology& topo, const ShardLayout& layout, Reduce op,
                         Hops hops, const ReduceScatterOptions& options)
      : world_(world),
        calls_{identity(layout, topo, op, hops, options)},
        topo_(checked(world, topo, layout, hops, options, calls_.id, slots_)),
        layout_(layout),
        op_(op),
        hops_(hops),
        hop_(options),
        intra_(world.split(hops == Hops::two ? topo.node() : 0, topo.local_index())),
        inter_(world.split(hops == Hops::two ? topo.local_index() : world.rank(), topo.node())) {
    rank_at_.assign(topo.rank_at_table(), topo.rank_at_table() + topo.world_size());
  }

  //! The plan's identity (call number 0), which every call's agreement compares across ranks.
  const CallIdentity& identity() const { return calls_.id; }

  //! Bytes of one hop-1 message (one per destination).
  std::size_t hop1_message_bytes() const { return packed_bytes<F1>(hop1_count()); }
  //! Bytes of one hop-2 message (two hops only; 0 for one hop).
  std::size_t hop2_message_bytes() const {
    return hops_ == Hops::two ? packed_bytes<F2>(layout_.shard_numel()) : 0;
  }

  //! Workspace the call needs, in bytes (device memory for a device transport).
  std::size_t workspace_bytes() const { return carve(nullptr).bytes; }

  //! Reduces `grad` (padded_numel() elements; elements >= numel are ignored) over all ranks into
  //! `shard` (shard_numel() elements: this rank's slice; padding written as 0). `grad` and `shard`
  //! must not overlap each other or the workspace, and are aligned to alignof(T). Host transports
  //! agree on the call (identity and call number) and the arguments over the world first. Host transports:
  //! returns kResultNonFinite if any rank's gradient held NaN or Inf (same on every rank); such values turn
  //! their blocks into NaN wherever they land. Device transports: returns nothing, the flags go to the
  //! workspace (collective/device.cuh).
  auto operator()(const T* grad, T* shard, void* workspace, std::size_t workspace_bytes,
                  typename Transport::stream_type stream = {}) {
    if constexpr (detail::on_device<Transport>) {
      const std::string err = device_call(grad, shard, workspace, workspace_bytes, stream, nullptr, ~0u);
      if (!err.empty()) throw Error(err);
    } else {
      return start_call(grad, shard, workspace, workspace_bytes, nullptr).finish();
    }
  }

 private:
  struct State;

 public:
  //! A started call (host transports): see PendingCall.
  using Pending = PendingCall<QuantizedReduceScatter, State>;

  //! The first half of operator() (host transports): agrees on the call and the arguments over
  //! the world, quantizes the hop-1 messages and starts their exchange, then returns without
  //! waiting. Throws on every rank, before anything is sent, where operator() would, and also if
  //! this plan has a call in flight (one at a time per plan) or a call whose handle was destroyed
  //! unfinished. `grad` may be changed once start returns; `shard` and the workspace must stay
  //! valid and untouched until finish(). Two hops: the hop-2 exchange starts in progress() once
  //! hop 1 is done, or in finish(). O(padded_numel) work.
  Pending start(const T* grad, T* shard, void* workspace, std::size_t workspace_bytes) {
    return start_call(grad, shard, workspace, workspace_bytes, nullptr);
  }
  //! start() of the call with error feedback; the state is updated by start (hop 1) and by
  //! progress() / finish() (hop 2), so it must stay valid and untouched until finish().
  Pending start(const T* grad, T* shard, void* workspace, std::size_t workspace_bytes,
                ResidualState residual) {
    return start_call(grad, shard, workspace, workspace_bytes, &residual);
  }

  //! The second half of operator(): pending.finish() for a handle of this plan (throws
  //! qcoll::Error if it belongs to another plan or is not active). Completes the exchanges, sums
  //! and writes `shard`; returns kResultNonFinite as operator() does. O(padded_numel) work.
  std::uint32_t finish(Pending& pending) { return pending.finish_by(this, "QuantizedReduceScatter::finish"); }

  //! Bytes of an error-feedback state with options `fb` (collective/feedback.hpp): a 64-byte
  //! header, the hop-1 residual (padded_numel() elements, indexed like the gradient) when
  //! fb.hop1, and the hop-2 residual (this rank's hop-1 sum: num_nodes() * shard_numel()
  //! elements, node slice by node slice) when fb.hop2 and the plan has two hops. O(1).
  std::size_t residual_bytes(const FeedbackOptions& fb = {}) const { return residual_layout(fb).bytes(); }

  //! Writes a fresh (all-zero) error-feedback state of this plan with options `fb` into
  //! residual[0, bytes): before the first call with feedback, and to reset it. Local (no
  //! communication). Throws qcoll::Error if residual is null or not 64-byte aligned, bytes is
  //! below residual_bytes(fb), or fb.decay is outside (0, 1]; on a device transport also if it
  //! is not device memory. Device transports: stream-ordered on `stream` (null: the transport's
  //! own), a memset and a one-thread kernel, no host synchronisation. O(residual_bytes).
  void init_residual(void* residual, std::size_t bytes, const FeedbackOptions& fb = {},
                     typename Transport::stream_type stream = {}) const {
    const char* fn = "QuantizedReduceScatter::init_residual";
    const detail::ResidualLayout l = residual_layout(fb);
    detail::check_workspace(fn, residual, bytes, l.bytes(), "residual", "bytes");
    QCOLL_REQUIRE(fb.decay > 0.0f && fb.decay <= 1.0f, fn, "fb.decay", fb.decay, "is outside", "(0, 1]");
    detail::ResidualHeader h{};
    h.magic = detail::kResidualMagic;
    h.hop1 = l.n1 > 0;
    h.hop2 = l.n2 > 0;
    h.storage = static_cast<std::uint8_t>(fb.storage);
    h.decay = fb.decay;
    h.plan = calls_.id.hash();
    h.n1 = l.n1;
    h.n2 = l.n2;
    if constexpr (detail::on_device<Transport>) {
      device_init_residual(residual, l.bytes(), h, stream);
    } else {
      (void)stream;
      std::memset(residual, 0, l.bytes());
      std::memcpy(residual, &h, sizeof h);
    }
  }

  //! The call with error feedback: as operator() without it, except that each rank quantizes its
  //! input plus its residual, and keeps what the codes failed to carry (times the decay) as its
  //! new residual, per hop as the state was initialised. Where the carried error is not finite (a
  //! NaN or Inf input) the residual element is set to 0. The state must come from init_residual()
  //! of this plan (or an identical plan), and must not overlap grad, shard or the workspace.
  //! Host transports: otherwise every rank throws before anything is sent; returns the flags as
  //! operator() does. Device transports (the state in device memory): a null, misaligned,
  //! non-device or overlapping state is this rank's argument error (it throws after taking part,
  //! as operator() does); its header is checked by a kernel, and a bad one sets
  //! kResultBadResidual on this rank and kResultRejected on every rank, writing no output and no
  //! residual (collective/device.cuh). Residuals are also left unchanged whenever a call's output
  //! is not written. Results and residuals are deterministic, and equal on host and device.
  //! O(padded_numel) work.
  auto operator()(const T* grad, T* shard, void* workspace, std::size_t workspace_bytes,
                  ResidualState residual, typename Transport::stream_type stream = {}) {
    if constexpr (detail::on_device<Transport>) {
      const std::string err =
          device_call(grad, shard, workspace, workspace_bytes, stream, nullptr, ~0u, &residual);
      if (!err.empty()) throw Error(err);
    } else {
      (void)stream;
      return start_call(grad, shard, workspace, workspace_bytes, &residual).finish();
    }
  }

  //! Device data path (collective/device.cuh), as QuantizedAllGather::device_call; `residual`:
  //! the error-feedback state of the call, or null.
  std::string device_call(const T* grad, T* shard, void* workspace, std::size_t workspace_bytes,
                          typename Transport::stream_type stream, std::uint32_t* status, std::uint32_t report,
                          const ResidualState* residual = nullptr);

  //! The intra-node group of the first hop (two hops) — its counters show hop-1 traffic.
  const SubTransport& intra_node() const { return intra_; }
  //! The inter-node group of the second hop (two hops) — its counters show hop-2 traffic.
  const SubTransport& inter_node() const { return inter_; }
  //! The layout this plan reduces.
  const ShardLayout& layout() const { return layout_; }

 private:
  // Device: enqueues a fresh state's zeroes and header (collective/device.cuh).
  void device_init_residual(void* residual, std::size_t bytes, const detail::ResidualHeader& h,
                            typename Transport::stream_type stream) const;

  template <class, class>
  friend class PendingCall;

  struct Pieces;
  using Request = typename detail::request_of<Transport>::type;
  using SubRequest = typename detail::request_of<SubTransport>::type;

  // An error-feedback state checked for this call: the residual spans (n = 0 when a hop is off).
  struct Feedback {
    detail::ResidualSpan hop1, hop2;
    float decay = 1.0f;
    // Stores decay * r as element i of span s, or 0 where r is not finite.
    void keep(const detail::ResidualSpan& s, std::size_t i, float r) const {
      s.set(i, fp::bits(r) << 1 >= 0xff000000u ? 0.0f : fp::mul(decay, r));
    }
  };

  // A started call: phase 1 while hop 1 is exchanged, 2 while hop 2 is, 3 once all is received.
  struct State : detail::PendingState {
    Request one;      // hop 1 of one hop (over the world)
    SubRequest req1;  // hop 1 of two hops (intra-node)
    SubRequest req2;  // hop 2 (inter-node)
    int phase = 1;
    std::uint32_t result = 0;
    std::uint64_t tag = 0;
    T* shard = nullptr;
    void* workspace = nullptr;
    Feedback fb;
  };

  Pending start_call(const T* grad, T* shard, void* workspace, std::size_t workspace_bytes,
                     const ResidualState* residual) {
    static_assert(!detail::on_device<Transport>, "start/finish run on host transports");
    const char* fn = "QuantizedReduceScatter";
    const Pieces p = carve(workspace);
    const CallIdentity call = calls_.next();
    const std::uint64_t tag = call.hash();
    const Rotation& r1 = hop_.hop1.rotation;
    bool nonfinite = false;
    State st;
    const std::string err = detail::local_check([&] {
      inflight_.check_start(fn, call.word[CallIdentity::call]);
      detail::check_workspace(fn, workspace, workspace_bytes, p.bytes);
      check_arguments(fn, grad, shard, workspace, workspace_bytes);
      if (residual != nullptr) st.fb = check_residual(fn, *residual, grad, shard, workspace, workspace_bytes);
      nonfinite = st.fb.hop1.n > 0 || r1.enabled() ? quantize_hop1_gathered(grad, p.send1, tag, p.acc, st.fb)
                                                   : quantize_hop1(grad, p.send1, tag);
    });
    st.result = detail::agree_on_call(world_, call, err, nonfinite, fn);
    st.call = call.word[CallIdentity::call];
    st.tag = tag;
    st.shard = shard;
    st.workspace = workspace;
    if (hops_ == Hops::one)
      st.one = world_.start_all_to_all(p.send1, p.recv1, hop1_message_bytes());
    else
      st.req1 = intra_.start_all_to_all(p.send1, p.recv1, hop1_message_bytes());
    inflight_.started = st.call;
    return Pending(this, std::move(st));
  }

  // Completes `req` over `t` (wait when `block`, else test); true when it is done.
  template <class Tr, class Req>
  static bool complete(Tr& t, Req& req, bool block) {
    if (!req.active()) return true;
    if (!block) return t.test(req);
    t.wait(req);
    return true;
  }

  // Moves the call through its phases as far as it can (without blocking unless `block`); true
  // once every message has arrived.
  bool advance(State& st, bool block) {
    if (st.phase == 1) {
      if (!(hops_ == Hops::one ? complete(world_, st.one, block) : complete(intra_, st.req1, block)))
        return false;
      if (hops_ == Hops::one) {
        st.phase = 3;
        return true;
      }
      const Pieces p = carve(st.workspace);
      requantize_hop2(p, st.tag, st.fb);
      st.req2 = inter_.start_all_to_all(p.send2, p.recv2, hop2_message_bytes());
      st.phase = 2;
    }
    if (st.phase == 2) {
      if (!complete(inter_, st.req2, block)) return false;
      st.phase = 3;
    }
    return true;
  }

  bool progress_call(State& st) { return advance(st, false); }

  // Completes the exchanges, sums the last hop's messages and writes the shard.
  std::uint32_t finish_call(State& st) {
    const char* fn = "QuantizedReduceScatter";
    advance(st, true);
    const Pieces p = carve(st.workspace);
    const std::size_t S = layout_.shard_numel();
    const int r = world_.rank();
    const Rotation& r2 = hops_ == Hops::two ? hop_.hop2.rotation : hop_.hop1.rotation;  // the sums' domain
    const std::size_t mine =
        rotated_count(layout_.valid_in_shard(r), r2);  // sums needed (rotated: whole spans)
    if (hops_ == Hops::one)
      detail::sum_messages<F1>(p.recv1, hop1_message_bytes(), world_.size(), S, mine, p.acc, st.tag, fn);
    else
      detail::sum_messages<F2>(p.recv2, hop2_message_bytes(), topo_.num_nodes(), S, mine, p.acc, st.tag, fn);
    rotate_run(p.acc, mine, r2, layout_.shard_offset(r), false);  // back from the rotated domain
    const std::size_t valid = layout_.valid_in_shard(r);
    const float world = static_cast<float>(world_.size());
    T* shard = st.shard;
    for (std::size_t i = 0; i < valid; ++i)
      shard[i] = from_float<T>(op_ == Reduce::mean ? fp::div(p.acc[i], world) : p.acc[i]);
    for (std::size_t i = valid; i < S; ++i) shard[i] = from_float<T>(0.0f);
    layout_.zero_inner_padding(shard, layout_.shard_offset(r), valid);
    return st.result;
  }

  // Two hops, between the hops: sums the hop-1 messages and re-quantizes the N node slices of the
  // partial sum, one hop-2 message per node, in hop 2's domain (with hop-2 feedback).
  void requantize_hop2(const Pieces& p, std::uint64_t tag, const Feedback& fb) {
    const char* fn = "QuantizedReduceScatter";
    const std::size_t S = layout_.shard_numel();
    const Rotation& r1 = hop_.hop1.rotation;
    const Rotation& r2 = hop_.hop2.rotation;
    const int N = topo_.num_nodes(), L = topo_.ranks_per_node(), j = topo_.local_index();
    const std::size_t n1 = hop1_count();
    detail::sum_messages<F1>(p.recv1, hop1_message_bytes(), L, n1, n1, p.acc, tag, fn);
    host::QuantizeOptions o = quantize_options(2, tag);
    const std::size_t P2 = hop2_message_bytes();
    for (int m = 0; m < N; ++m) {
      const int owner = rank_at_[static_cast<std::size_t>(m * L + j)];
      const std::size_t at = static_cast<std::size_t>(m) * S, first = layout_.shard_offset(owner);
      const std::size_t valid = layout_.valid_in_shard(owner), valid2 = rotated_count(valid, r2);
      float* v = p.acc + at;
      if (!same_rotation(r1, r2)) {
        rotate_run(v, S, r1, first, false);
        for (std::size_t i = valid; i < S; ++i) v[i] = 0.0f;  // padding is zero, not rounding noise
        layout_.zero_inner_padding(v, first, valid);
        rotate_run(v, S, r2, first, true);
      }
      unsigned char* msg = p.send2 + static_cast<std::size_t>(m) * P2;
      const detail::LayoutSource<float, F2::block> src{v, first, layout_, r2};
      // The residual lives where the message carries data: per block, its first src(b).valid
      // elements (for a flat layout, the first valid2 of the slice).
      const auto carried = [&](auto&& fn) {
        for (std::size_t b = 0; b * F2::block < valid2; ++b)
          for (std::size_t e = 0, c = src(b).valid; e < c; ++e) fn(b * F2::block + e);
      };
      if (fb.hop2.n > 0) carried([&](std::size_t i) { v[i] = fp::add(v[i], fb.hop2.get(at + i)); });
      o.index_base = first;
      host::detail::quantize_blocks<F2, float>(S, src, msg, o);
      if (fb.hop2.n > 0) {
        host::detail::subtract_decoded<F2>(msg, S, valid2, v);
        carried([&](std::size_t i) { fb.keep(fb.hop2, at + i, v[i]); });
      }
    }
  }

  // The options of hop 1 or 2 for this rank's messages of a call with `tag`.
  host::QuantizeOptions quantize_options(int hop, std::uint64_t tag) const {
    const HopOptions& h = hop == 1 ? hop_.hop1 : hop_.hop2;
    host::QuantizeOptions o;
    o.rounding = h.rounding;
    o.seed = detail::rank_seed(h.seed, world_.rank(), hop);
    o.tag = tag;
    return o;
  }

  // True if two rotations are the same map (both off, or the same span and seed).
  static bool same_rotation(const Rotation& a, const Rotation& b) {
    return a.enabled() == b.enabled() && (!a.enabled() || (a.log2_span == b.log2_span && a.seed == b.seed));
  }

  struct Pieces {
    detail::DeviceControl control;
    int* table;  // device: Topology::rank_at_table() for the qgZ reorder (two hops)
    unsigned char* send1;
    unsigned char* recv1;
    unsigned char* send2;
    unsigned char* recv2;
    float* acc;
    std::size_t bytes;
  };

  // Elements per hop-1 message: one slice (one hop) or the N slices of a local index (two hops).
  std::size_t hop1_count() const {
    return hops_ == Hops::two ? layout_.shard_numel() * static_cast<std::size_t>(topo_.num_nodes())
                              : layout_.shard_numel();
  }
  int hop1_messages() const { return hops_ == Hops::two ? topo_.ranks_per_node() : world_.size(); }

  Pieces carve(void* base) const {
    WorkspaceCarver c(base);
    const std::size_t P1 = hop1_message_bytes(), P2 = hop2_message_bytes();
    const std::size_t k1 = static_cast<std::size_t>(hop1_messages());
    const std::size_t k2 = static_cast<std::size_t>(topo_.num_nodes());
    constexpr bool device = detail::on_device<Transport>;
    Pieces p{};
    p.control = detail::take_control(c, device);
    p.table = c.take<int>(device && hops_ == Hops::two ? rank_at_.size() : 0);
    p.send1 = c.take<unsigned char>(P1, k1);
    p.recv1 = c.take<unsigned char>(P1, k1);
    p.send2 = c.take<unsigned char>(P2, hops_ == Hops::two ? k2 : 0);
    p.recv2 = c.take<unsigned char>(P2, hops_ == Hops::two ? k2 : 0);
    // The fp32 values of one hop-1 message or of the hop-1 sums. The device forms plain sums on
    // the fly, and uses this for rotations and error feedback.
    p.acc = c.take<float>(hop1_count());
    p.bytes = c.bytes();
    return p;
  }

  // The argument checks shared by the host and device calls (buffers: present, aligned, apart
  // from each other and from the workspace).
  void check_arguments(const char* fn, const T* grad, const T* shard, const void* workspace,
                       std::size_t workspace_bytes) const {
    const std::size_t S = layout_.shard_numel(), padded = layout_.padded_numel();
    detail::check_buffer(fn, "grad", grad, padded, workspace, workspace_bytes);
    detail::check_buffer(fn, "shard", shard, S, workspace, workspace_bytes);
    QCOLL_REQUIRE(shard == nullptr || grad == nullptr || S == 0 || padded == 0 || shard + S <= grad ||
                      grad + padded <= shard,
                  fn, "shard", static_cast<const void*>(shard), "overlaps", "grad");
  }

  static CallIdentity identity(const ShardLayout& layout, const Topology& topo, Reduce op, Hops hops,
                               const ReduceScatterOptions& options) {
    CallIdentity id = detail::plan_identity<T>(3, layout, options.hop1);
    if (hops == Hops::two) detail::set_hop(id, 2, options.hop2);
    detail::set_format<F1>(id, 1);
    detail::set_format<F2>(id, 2);
    id.word[CallIdentity::reduce_op] = static_cast<std::uint64_t>(op);
    id.word[CallIdentity::hops] = static_cast<std::uint64_t>(hops);
    id.word[CallIdentity::node_table] = topo.fingerprint();
    return id;
  }

  detail::ResidualLayout residual_layout(const FeedbackOptions& fb) const {
    return detail::ResidualLayout{fb.hop1 ? layout_.padded_numel() : 0,
                                  fb.hop2 && hops_ == Hops::two ? hop1_count() : 0, fb.storage};
  }

  // Checks an error-feedback state against this plan and the call's other buffers.
  Feedback check_residual(const char* fn, const ResidualState& r, const T* grad, const T* shard,
                          const void* workspace, std::size_t workspace_bytes) const {
    detail::check_workspace(fn, r.data, r.bytes, sizeof(detail::ResidualHeader), "residual",
                            "residual bytes");
    detail::ResidualHeader h;
    std::memcpy(&h, r.data, sizeof h);
    QCOLL_REQUIRE(h.magic == detail::kResidualMagic, fn, "residual", "a buffer without a residual header",
                  "must be initialised by", "init_residual()");
    QCOLL_REQUIRE(h.plan == calls_.id.hash(), fn, "residual", "the state of another plan", "must be one of",
                  "this plan (init_residual())");
    QCOLL_REQUIRE(h.storage <= static_cast<std::uint8_t>(ResidualStorage::bf16), fn, "residual storage",
                  static_cast<int>(h.storage), "is not one of", "f32, bf16");
    FeedbackOptions o;
    o.hop1 = h.hop1 != 0;
    o.hop2 = h.hop2 != 0;
    o.storage = static_cast<ResidualStorage>(h.storage);
    const detail::ResidualLayout l = residual_layout(o);
    QCOLL_REQUIRE(h.n1 == l.n1 && h.n2 == l.n2, fn, "residual", "sizes " << h.n1 << " + " << h.n2,
                  "differ from this plan's", l.n1 << " + " << l.n2);
    QCOLL_REQUIRE(r.bytes >= l.bytes(), fn, "residual bytes", r.bytes, "is below the required", l.bytes());
    QCOLL_REQUIRE(h.decay > 0.0f && h.decay <= 1.0f, fn, "residual decay", h.decay, "is outside", "(0, 1]");
    const auto* b = static_cast<const unsigned char*>(r.data);
    const auto apart = [b, &l](const void* q, std::size_t bytes) {
      const auto* c = static_cast<const unsigned char*>(q);
      return q == nullptr || bytes == 0 || c + bytes <= b || b + l.bytes() <= c;
    };
    QCOLL_REQUIRE(apart(grad, layout_.padded_numel() * sizeof(T)) &&
                      apart(shard, layout_.shard_numel() * sizeof(T)) && apart(workspace, workspace_bytes),
                  fn, "residual", r.data, "overlaps", "grad, shard or the workspace");
    auto* d = static_cast<unsigned char*>(r.data);
    Feedback f;
    f.hop1 = detail::ResidualSpan{d + l.hop1_offset(), l.n1, o.storage};
    f.hop2 = detail::ResidualSpan{d + l.hop2_offset(), l.n2, o.storage};
    f.decay = h.decay;
    return f;
  }

  // The source map of hop-1 message q: the slice of rank q (one hop) or the qgZ chunk of local
  // index q (two hops).
  SourceMap hop1_map(int q) const {
    SourceMap m = hops_ == Hops::one
                      ? SourceMap::identity(layout_.numel(), layout_.shard_offset(q))
                      : SourceMap::qgz(layout_.numel(), layout_.shard_numel(), topo_.num_nodes(),
                                       topo_.ranks_per_node(), rank_at_.data(),
                                       static_cast<std::size_t>(q) * hop1_count());
    m.slots = layout_.slots();
    return m;
  }

  // Hop 1 through a float copy (error feedback or a rotation): message q's blocks are gathered
  // from the gradient into `v` (n1 floats, message order; plus the residual with feedback),
  // rotated span by span, and encoded; with feedback the message is decoded back and the residual
  // becomes decay * (v - decode), rotated back, at the same gradient positions.
  bool quantize_hop1_gathered(const T* grad, unsigned char* send, std::uint64_t tag, float* v,
                              const Feedback& fb) const {
    constexpr std::size_t B = F1::block;
    const Rotation& rot = hop_.hop1.rotation;
    const std::size_t n = hop1_count(), P1 = hop1_message_bytes(), nb = MessageLayout<F1>::blocks(n);
    const std::size_t span = rot.span();
    host::QuantizeOptions o = quantize_options(1, tag);
    bool bad = false;
    for (int q = 0; q < hop1_messages(); ++q) {
      const SourceMap map = hop1_map(q);
      for (std::size_t b = 0; b < nb; ++b) {
        const MappedBlock mb = map_block(map, b, B, n);
        for (std::size_t e = 0; e < B && b * B + e < n; ++e) {
          const float x = e < mb.valid ? to_float(grad[mb.offset + e]) : 0.0f;
          v[b * B + e] = fb.hop1.n > 0 && e < mb.valid ? fp::add(x, fb.hop1.get(mb.offset + e)) : x;
        }
        for (std::size_t e = 0; rot.enabled() && e < B && b * B + e < n; e += span)
          rotate_forward(v + b * B + e, rot, map_position(map, map.position0 + b * B + e));
      }
      unsigned char* msg = send + static_cast<std::size_t>(q) * P1;
      o.index_base = map.position0;
      bad |= host::detail::quantize_blocks<F1, float>(
                 n,
                 [&](std::size_t b) {
                   return host::detail::BlockSource<float>{v + b * B,
                                                           rotated_count(map_block(map, b, B, n).valid, rot)};
                 },
                 msg, o) != 0;
      if (fb.hop1.n == 0) continue;
      host::detail::subtract_decoded<F1>(msg, n, n, v);
      for (std::size_t b = 0; b < nb; ++b) {
        const MappedBlock mb = map_block(map, b, B, n);
        for (std::size_t e = 0; rot.enabled() && e < B && b * B + e < n; e += span)
          rotate_inverse(v + b * B + e, rot, map_position(map, map.position0 + b * B + e));
        for (std::size_t e = 0; e < mb.valid; ++e) fb.keep(fb.hop1, mb.offset + e, v[b * B + e]);
      }
    }
    return bad;
  }

  // Quantizes the hop-1 messages (the qgZ reorder fused in for two hops); returns non-finite.
  bool quantize_hop1(const T* grad, unsigned char* send, std::uint64_t tag) const {
    const std::size_t S = layout_.shard_numel(), P1 = hop1_message_bytes();
    host::QuantizeOptions o = quantize_options(1, tag);
    bool bad = false;
    if (hops_ == Hops::one) {
      for (int q = 0; q < world_.size(); ++q) {
        o.index_base = layout_.shard_offset(q);
        bad |= host::detail::quantize_blocks<F1, T>(
                   S, detail::LayoutSource<T, F1::block>{grad + o.index_base, o.index_base, layout_},
                   send + static_cast<std::size_t>(q) * P1, o) != 0;
      }
      return bad;
    }
    const int N = topo_.num_nodes(), L = topo_.ranks_per_node();
    const std::size_t n1 = hop1_count();
    for (int j = 0; j < L; ++j) {
      const std::size_t first = static_cast<std::size_t>(j) * n1;  // reordered position of chunk j
      SourceMap map = SourceMap::qgz(layout_.numel(), S, N, L, rank_at_.data(), first);
      map.slots = layout_.slots();
      o.index_base = first;
      bad |= host::detail::quantize_blocks<F1, T>(
                 n1,
                 [&](std::size_t b) {
                   const MappedBlock mb = map_block(map, b, F1::block, n1);
                   return host::detail::BlockSource<T>{grad + mb.offset, mb.valid};
                 },
                 send + static_cast<std::size_t>(j) * P1, o) != 0;
    }
    return bad;
  }

  // The checks agreed at construction; a device plan also copies the group's slots to `slots`.
  static Topology checked(Transport& world, const Topology& topo, const ShardLayout& layout, Hops hops,
                          const ReduceScatterOptions& options, const CallIdentity& id,
                          detail::DeviceSlots& slots) {
    const std::string err = detail::local_check([&] {
      QCOLL_REQUIRE(
          topo.world_size() == world.size() && topo.rank() == world.rank(), "QuantizedReduceScatter", "topo",
          "world " << topo.world_size() << " rank " << topo.rank(), "does not describe the transport's",
          "world " << world.size() << " rank " << world.rank());
      QCOLL_REQUIRE(layout.parts() == world.size(), "QuantizedReduceScatter", "layout.parts()",
                    layout.parts(), "differs from the world size", world.size());
      detail::check_blocks("QuantizedReduceScatter", layout, F1::block, format_name(F1::id));
      check_rotation("QuantizedReduceScatter", options.hop1.rotation, F1::block);
      if (hops == Hops::two) {
        detail::check_blocks("QuantizedReduceScatter", layout, F2::block, format_name(F2::id));
        check_rotation("QuantizedReduceScatter", options.hop2.rotation, F2::block);
      }
      if constexpr (detail::on_device<Transport>) slots = detail::make_device_slots<Transport>(layout);
    });
    detail::agree_on_call(world, id, err, false, "QuantizedReduceScatter");
    return topo;
  }

  Transport& world_;
  detail::PlanCalls calls_;
  detail::DeviceSlots slots_;  // device transports: the group's slot table (set by checked())
  Topology topo_;
  ShardLayout layout_;
  Reduce op_;
  Hops hops_;
  ReduceScatterOptions hop_;
  SubTransport intra_;
  SubTransport inter_;
  std::vector<int> rank_at_;
  detail::InFlight inflight_;
};

//! Quantized all-reduce = QuantizedReduceScatter (F1, F2) then QuantizedAllGather (F3) of the
//! reduced shard: every rank ends with the full reduced buffer (padded_numel() elements, the same
//! bits on every rank). Construction is collective.
template <class T, class F1, class F2, class F3, class Transport>
class QuantizedAllReduce {
 public:
  //! Collective; see QuantizedReduceScatter and QuantizedAllGather for the checks.
  QuantizedAllReduce(Transport& world, const Topology& topo, const ShardLayout& layout, Reduce op,
                     Hops hops = Hops::two, const host::QuantizeOptions& opt = {})
      : world_(world),
        rs_(world, topo, layout, op, hops, opt),
        ag_(world, layout, opt),
        calls_{rs_.identity()} {
    calls_.id.word[CallIdentity::kind] = 4;
    detail::set_format<F3>(calls_.id, 2);  // the stage formats F1 and F3 (F2 is in the stage's own)
  }

  //! As above, with the reduce-scatter's options per hop (rounding, seed, rotation) and the
  //! gather stage's (`gather`): e.g. a Hadamard rotation in every stage. Each stage agrees on its
  //! own options (its identity), so ranks with different options are rejected as in the stages.
  QuantizedAllReduce(Transport& world, const Topology& topo, const ShardLayout& layout, Reduce op, Hops hops,
                     const ReduceScatterOptions& options, const HopOptions& gather)
      : world_(world),
        rs_(world, topo, layout, op, hops, options),
        ag_(world, layout, gather),
        calls_{rs_.identity()} {
    calls_.id.word[CallIdentity::kind] = 4;
    detail::set_format<F3>(calls_.id, 2);
  }

  //! Workspace the call needs, in bytes.
  std::size_t workspace_bytes() const { return carve(nullptr).bytes; }

  //! Reduces `in` (padded_numel() elements) over all ranks into `out` (padded_numel() elements).
  //! `in` and `out` may be the same buffer. Host transports: returns kResultNonFinite as the
  //! reduce-scatter does. Device transports: returns nothing; the workspace's result flags carry
  //! the reduce-scatter's kResultNonFinite and either stage's kResultRejected/kResultBadMessage.
  auto operator()(const T* in, T* out, void* workspace, std::size_t workspace_bytes,
                  typename Transport::stream_type stream = {}) {
    if constexpr (detail::on_device<Transport>) {
      device_call(in, out, workspace, workspace_bytes, stream);
    } else {
      return start_call(in, out, workspace, workspace_bytes, nullptr).finish();
    }
  }

 private:
  struct State;

 public:
  //! A started call (host transports): see PendingCall.
  using Pending = PendingCall<QuantizedAllReduce, State>;

  //! The first half of operator() (host transports): agrees on the call and the arguments, and
  //! starts the reduce-scatter stage (QuantizedReduceScatter::start). `in` may be changed once
  //! start returns; `out` and the workspace must stay untouched until finish(). Throws where
  //! operator() would, and if this plan has a call in flight or one destroyed unfinished.
  Pending start(const T* in, T* out, void* workspace, std::size_t workspace_bytes) {
    return start_call(in, out, workspace, workspace_bytes, nullptr);
  }
  //! start() of the call with error feedback in the reduce-scatter stage.
  Pending start(const T* in, T* out, void* workspace, std::size_t workspace_bytes, ResidualState residual) {
    return start_call(in, out, workspace, workspace_bytes, &residual);
  }

  //! The second half of operator(): finishes the reduce-scatter stage, then runs the all-gather
  //! stage (blocking: it needs the reduced shard) into `out`. Throws qcoll::Error if `pending`
  //! belongs to another plan or is not active.
  std::uint32_t finish(Pending& pending) { return pending.finish_by(this, "QuantizedAllReduce::finish"); }

  //! Bytes of an error-feedback state of the reduce-scatter stage (QuantizedReduceScatter::residual_bytes).
  std::size_t residual_bytes(const FeedbackOptions& fb = {}) const { return rs_.residual_bytes(fb); }
  //! Initialises an error-feedback state of the reduce-scatter stage (QuantizedReduceScatter::init_residual).
  void init_residual(void* residual, std::size_t bytes, const FeedbackOptions& fb = {},
                     typename Transport::stream_type stream = {}) const {
    rs_.init_residual(residual, bytes, fb, stream);
  }
  //! The call with error feedback in the reduce-scatter stage (host or device transports; see
  //! QuantizedReduceScatter's); the gather stage quantizes the reduced shard as without it.
  auto operator()(const T* in, T* out, void* workspace, std::size_t workspace_bytes, ResidualState residual,
                  typename Transport::stream_type stream = {}) {
    if constexpr (detail::on_device<Transport>) {
      device_call(in, out, workspace, workspace_bytes, stream, &residual);
    } else {
      (void)stream;
      return start_call(in, out, workspace, workspace_bytes, &residual).finish();
    }
  }

  //! The reduce-scatter stage (its intra_node()/inter_node() groups carry the hop traffic).
  const QuantizedReduceScatter<T, F1, F2, Transport>& reduce_scatter() const { return rs_; }
  //! The all-gather stage.
  const QuantizedAllGather<T, F3, Transport>& all_gather() const { return ag_; }

 private:
  struct Pieces {
    detail::DeviceControl control;
    T* shard;
    void* inner;
    std::size_t inner_bytes;
    std::size_t bytes;
  };
  template <class, class>
  friend class PendingCall;

  struct State : detail::PendingState {
    typename QuantizedReduceScatter<T, F1, F2, Transport>::Pending rs;  // the reduce-scatter stage
    T* out = nullptr;
    void* workspace = nullptr;
    // The stage's handle goes with this call's (its loss is reported by this plan, not the stage).
    void release() noexcept { rs.drop(); }
  };

  Pending start_call(const T* in, T* out, void* workspace, std::size_t workspace_bytes,
                     const ResidualState* residual) {
    static_assert(!detail::on_device<Transport>, "start/finish run on host transports");
    const Pieces p = carve(workspace);
    const CallIdentity call = calls_.next();
    const std::string err = detail::local_check([&] {
      const char* fn = "QuantizedAllReduce";
      inflight_.check_start(fn, call.word[CallIdentity::call]);
      const std::size_t padded = rs_.layout().padded_numel();
      detail::check_workspace(fn, workspace, workspace_bytes, p.bytes);
      detail::check_buffer(fn, "in", in, padded, workspace, workspace_bytes);
      detail::check_buffer(fn, "out", out, padded, workspace, workspace_bytes);
    });
    detail::agree_on_call(world_, call, err, false, "QuantizedAllReduce");
    State st;
    st.call = call.word[CallIdentity::call];
    st.out = out;
    st.workspace = workspace;
    st.rs = residual != nullptr ? rs_.start(in, p.shard, p.inner, p.inner_bytes, *residual)
                                : rs_.start(in, p.shard, p.inner, p.inner_bytes);
    inflight_.started = st.call;
    return Pending(this, std::move(st));
  }

  bool progress_call(State& st) { return !st.rs.active() || st.rs.progress(); }

  std::uint32_t finish_call(State& st) {
    const Pieces p = carve(st.workspace);
    const std::uint32_t flags = st.rs.finish();
    ag_(p.shard, st.out, p.inner, p.inner_bytes);
    return flags;
  }

  // Device data path (collective/device.cuh); throws this rank's argument error after enqueuing.
  void device_call(const T* in, T* out, void* workspace, std::size_t workspace_bytes,
                   typename Transport::stream_type stream, const ResidualState* residual = nullptr);

  Pieces carve(void* base) const {
    WorkspaceCarver c(base);
    Pieces p{};
    p.control = detail::take_control(c, detail::on_device<Transport>);
    p.shard = c.take<T>(rs_.layout().shard_numel());
    p.inner_bytes = std::max(rs_.workspace_bytes(), ag_.workspace_bytes());
    p.inner = c.take<unsigned char>(p.inner_bytes);
    p.bytes = c.bytes();
    return p;
  }

  Transport& world_;
  QuantizedReduceScatter<T, F1, F2, Transport> rs_;
  QuantizedAllGather<T, F3, Transport> ag_;
  detail::PlanCalls calls_;
  detail::InFlight inflight_;
};

QCOLL_NAMESPACE_END
