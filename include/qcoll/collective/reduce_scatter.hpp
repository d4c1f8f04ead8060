#pragma once
//! \file
//! qgZ: quantized reduce-scatter in one hop or two hops, and the quantized all-reduce built on it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "all_gather.hpp"
#include "common.hpp"

QCOLL_NAMESPACE_BEGIN

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
//! rank before anything is sent. On device transports the call takes device buffers and is
//! stream-ordered (collective/device.cuh); the results are the host path's, bit for bit.
//! Stochastic rounding (opt) uses a per-rank, per-hop key.
template <class T, class F1, class F2, class Transport>
class QuantizedReduceScatter {
 public:
  using SubTransport = decltype(std::declval<Transport&>().split(0, 0));

  //! Collective. Throws qcoll::Error on every rank if the ranks disagree on the plan, `topo` does
  //! not describe `world`, the layout's parts differ from the world size, or shards are not whole
  //! blocks of F1 and F2.
  QuantizedReduceScatter(Transport& world, const Topology& topo, const ShardLayout& layout, Reduce op,
                         Hops hops = Hops::two, const host::QuantizeOptions& opt = {})
      : world_(world),
        topo_(checked(world, topo, layout, hops)),
        layout_(layout),
        op_(op),
        hops_(hops),
        opt_(opt),
        intra_(world.split(hops == Hops::two ? topo.node() : 0, topo.local_index())),
        inter_(world.split(hops == Hops::two ? topo.local_index() : world.rank(), topo.node())) {
    rank_at_.assign(topo.rank_at_table(), topo.rank_at_table() + topo.world_size());
    detail::agree_on_plan(
        world,
        detail::fingerprint(
            {3, static_cast<std::uint64_t>(F1::id), F1::block, static_cast<std::uint64_t>(F2::id), F2::block,
             static_cast<std::uint64_t>(dtype_of<T>::value), layout.numel(), layout.padded_numel(),
             static_cast<std::uint64_t>(op), static_cast<std::uint64_t>(hops),
             static_cast<std::uint64_t>(topo.ranks_per_node())}),
        "QuantizedReduceScatter", describe());
  }

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
  //! must not overlap. Host transports: returns kResultNonFinite if any rank's gradient held NaN or
  //! Inf (same on every rank); such values turn their blocks into NaN wherever they land. Device
  //! transports: returns nothing, the flags go to the workspace (collective/device.cuh).
  auto operator()(const T* grad, T* shard, void* workspace, std::size_t workspace_bytes,
                  typename Transport::stream_type stream = {}) {
    if constexpr (detail::on_device<Transport>) {
      const std::string err = device_call(grad, shard, workspace, workspace_bytes, stream, nullptr, ~0u);
      if (!err.empty()) throw Error(err);
    } else {
      return host_call(grad, shard, workspace, workspace_bytes);
    }
  }

  //! Device data path (collective/device.cuh), as QuantizedAllGather::device_call.
  std::string device_call(const T* grad, T* shard, void* workspace, std::size_t workspace_bytes,
                          typename Transport::stream_type stream, std::uint32_t* status,
                          std::uint32_t report);

  //! The intra-node group of the first hop (two hops) — its counters show hop-1 traffic.
  const SubTransport& intra_node() const { return intra_; }
  //! The inter-node group of the second hop (two hops) — its counters show hop-2 traffic.
  const SubTransport& inter_node() const { return inter_; }
  //! The layout this plan reduces.
  const ShardLayout& layout() const { return layout_; }

 private:
  std::uint32_t host_call(const T* grad, T* shard, void* workspace, std::size_t workspace_bytes) {
    const char* fn = "QuantizedReduceScatter";
    const Pieces p = carve(workspace);
    const std::size_t S = layout_.shard_numel();
    bool nonfinite = false;
    const std::string err = detail::local_check([&] {
      QCOLL_REQUIRE(grad != nullptr || layout_.padded_numel() == 0, fn, "grad", "null",
                    "with padded_numel =", layout_.padded_numel());
      QCOLL_REQUIRE(shard != nullptr || S == 0, fn, "shard", "null", "with shard_numel =", S);
      QCOLL_REQUIRE(
          shard == nullptr || grad == nullptr || shard + S <= grad || grad + layout_.padded_numel() <= shard,
          fn, "shard", static_cast<const void*>(shard), "overlaps", "grad");
      detail::check_workspace(fn, workspace, workspace_bytes, p.bytes);
      nonfinite = quantize_hop1(grad, p.send1);
    });
    const std::uint32_t result = detail::agree_on_call(world_, err, nonfinite, fn);
    const int r = world_.rank();
    if (hops_ == Hops::one) {
      world_.all_to_all(p.send1, p.recv1, hop1_message_bytes());
      detail::sum_messages<F1>(p.recv1, hop1_message_bytes(), world_.size(), S, layout_.valid_in_shard(r),
                               p.acc, fn);
    } else {
      const int N = topo_.num_nodes(), L = topo_.ranks_per_node(), j = topo_.local_index();
      const std::size_t n1 = hop1_count();
      intra_.all_to_all(p.send1, p.recv1, hop1_message_bytes());
      detail::sum_messages<F1>(p.recv1, hop1_message_bytes(), L, n1, n1, p.acc, fn);
      // Re-quantize the N node slices of the partial sum, one message per node.
      host::QuantizeOptions o = opt_;
      o.seed = detail::rank_seed(opt_.seed, r, 2);
      const std::size_t P2 = hop2_message_bytes();
      for (int m = 0; m < N; ++m) {
        const int owner = rank_at_[static_cast<std::size_t>(m * L + j)];
        o.index_base = layout_.shard_offset(owner);
        host::detail::quantize_blocks<F2, float>(
            S,
            detail::SliceSource<float, F2::block>{p.acc + static_cast<std::size_t>(m) * S, 0,
                                                  layout_.valid_in_shard(owner)},
            p.send2 + static_cast<std::size_t>(m) * P2, o);
      }
      inter_.all_to_all(p.send2, p.recv2, P2);
      detail::sum_messages<F2>(p.recv2, P2, N, S, layout_.valid_in_shard(r), p.acc, fn);
    }
    const std::size_t valid = layout_.valid_in_shard(r);
    const float world = static_cast<float>(world_.size());
    for (std::size_t i = 0; i < valid; ++i)
      shard[i] = from_float<T>(op_ == Reduce::mean ? fp::div(p.acc[i], world) : p.acc[i]);
    for (std::size_t i = valid; i < S; ++i) shard[i] = from_float<T>(0.0f);
    return result;
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
    p.acc = c.take<float>(device ? 0 : hop1_count());  // device: sums are formed on the fly
    p.bytes = c.bytes();
    return p;
  }

  // Quantizes the hop-1 messages (the qgZ reorder fused in for two hops); returns non-finite.
  bool quantize_hop1(const T* grad, unsigned char* send) const {
    const std::size_t S = layout_.shard_numel(), P1 = hop1_message_bytes();
    host::QuantizeOptions o = opt_;
    o.seed = detail::rank_seed(opt_.seed, world_.rank(), 1);
    bool bad = false;
    if (hops_ == Hops::one) {
      for (int q = 0; q < world_.size(); ++q) {
        o.index_base = layout_.shard_offset(q);
        bad |= host::detail::quantize_blocks<F1, T>(
                   S, detail::SliceSource<T, F1::block>{grad, layout_.shard_offset(q), layout_.numel()},
                   send + static_cast<std::size_t>(q) * P1, o) != 0;
      }
      return bad;
    }
    const int N = topo_.num_nodes(), L = topo_.ranks_per_node();
    const std::size_t n1 = hop1_count();
    for (int j = 0; j < L; ++j) {
      const std::size_t first = static_cast<std::size_t>(j) * n1;  // reordered position of chunk j
      const SourceMap map = SourceMap::qgz(layout_.numel(), S, N, L, rank_at_.data(), first);
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

  static Topology checked(Transport& world, const Topology& topo, const ShardLayout& layout, Hops hops) {
    const std::string err = detail::local_check([&] {
      QCOLL_REQUIRE(
          topo.world_size() == world.size() && topo.rank() == world.rank(), "QuantizedReduceScatter", "topo",
          "world " << topo.world_size() << " rank " << topo.rank(), "does not describe the transport's",
          "world " << world.size() << " rank " << world.rank());
      QCOLL_REQUIRE(layout.parts() == world.size(), "QuantizedReduceScatter", "layout.parts()",
                    layout.parts(), "differs from the world size", world.size());
      detail::check_blocks("QuantizedReduceScatter", layout, F1::block, format_name(F1::id));
      if (hops == Hops::two)
        detail::check_blocks("QuantizedReduceScatter", layout, F2::block, format_name(F2::id));
    });
    detail::agree_on_call(world, err, false, "QuantizedReduceScatter");
    return topo;
  }

  std::string describe() const {
    return std::string("reduce-scatter of ") + dtype_name(dtype_of<T>::value) + " as " + format_name(F1::id) +
           "/" + std::to_string(F1::block) + " then " + format_name(F2::id) + "/" +
           std::to_string(F2::block) + ", numel " + std::to_string(layout_.numel()) +
           (hops_ == Hops::two ? ", two hops" : ", one hop");
  }

  Transport& world_;
  Topology topo_;
  ShardLayout layout_;
  Reduce op_;
  Hops hops_;
  host::QuantizeOptions opt_;
  SubTransport intra_;
  SubTransport inter_;
  std::vector<int> rank_at_;
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
      : world_(world), rs_(world, topo, layout, op, hops, opt), ag_(world, layout, opt) {}

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
      const Pieces p = carve(workspace);
      const std::string err = detail::local_check([&] {
        const std::size_t padded = rs_.layout().padded_numel();
        QCOLL_REQUIRE(in != nullptr || padded == 0, "QuantizedAllReduce", "in", "null",
                      "with padded_numel =", padded);
        QCOLL_REQUIRE(out != nullptr || padded == 0, "QuantizedAllReduce", "out", "null",
                      "with padded_numel =", padded);
        detail::check_workspace("QuantizedAllReduce", workspace, workspace_bytes, p.bytes);
      });
      detail::agree_on_call(world_, err, false, "QuantizedAllReduce");
      const std::uint32_t flags = rs_(in, p.shard, p.inner, p.inner_bytes, stream);
      ag_(p.shard, out, p.inner, p.inner_bytes, stream);
      return flags;
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
  // Device data path (collective/device.cuh); throws this rank's argument error after enqueuing.
  void device_call(const T* in, T* out, void* workspace, std::size_t workspace_bytes,
                   typename Transport::stream_type stream);

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
};

QCOLL_NAMESPACE_END
