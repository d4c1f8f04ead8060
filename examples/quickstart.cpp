// The README's usage example, compiled and run as is: one ZeRO++ step (qwZ forward gather, hpZ
// backward gather, qgZ gradient reduce-scatter) on 8 in-process ranks in 2 nodes of 4.
#include <qcoll/qcoll.hpp>

#include <algorithm>
#include <cstdio>
#include <vector>

int main() {
  const int world = 8;                                             // 2 nodes of 4 ranks
  const std::size_t numel = 1 << 20;                               // parameters of the model
  std::vector<long long> node_of_rank = {0, 1, 0, 1, 0, 1, 0, 1};  // any placement, not only node-major
  qcoll::LocalGroup group(world, node_of_rank);

  group.run([&](qcoll::LocalTransport& t) {
    using bf16 = qcoll::bfloat16;
    using T = qcoll::LocalTransport;
    // once, at start-up (collective: every rank builds the same plans)
    auto topo = qcoll::Topology::from_node_ids(node_of_rank, t.rank());
    qcoll::ShardLayout layout(numel, t.size(), qcoll::granule_for(sizeof(bf16), {2048}));
    qcoll::QuantizedAllGather<bf16, qcoll::Int8<2048>, T> qwz(t, layout);
    qcoll::SecondaryShard<bf16, qcoll::Identity<bf16, 2048>, T> hpz(t, topo, layout);
    qcoll::QuantizedReduceScatter<bf16, qcoll::Int4<2048>, qcoll::Int4<2048>, T> qgz(t, topo, layout,
                                                                                     qcoll::Reduce::mean);
    std::vector<unsigned char> ws(
        std::max({qwz.workspace_bytes(), hpz.workspace_bytes(), qgz.workspace_bytes()}) +
        qcoll::kWorkspaceAlignment);
    void* w = ws.data() + (qcoll::kWorkspaceAlignment -
                           reinterpret_cast<std::uintptr_t>(ws.data()) % qcoll::kWorkspaceAlignment);
    const std::size_t wb = ws.size() - qcoll::kWorkspaceAlignment;

    std::vector<bf16> shard(layout.shard_numel(), qcoll::from_float<bf16>(0.01f * t.rank()));
    std::vector<bf16> full(layout.padded_numel()),
        grads(layout.padded_numel(), qcoll::from_float<bf16>(1.0f));
    std::vector<bf16> grad_shard(layout.shard_numel());

    // every step
    const std::uint64_t step = 1;
    qwz(shard.data(), full.data(), w, wb);        // forward gather: int8 on the wire
    hpz.capture(full.data(), step);               // keep 1/L of the weights, no communication
    hpz.gather(full.data(), step, w, wb);         // backward gather inside the node only
    qgz(grads.data(), grad_shard.data(), w, wb);  // int4, two hops, mean over ranks

    if (t.rank() == 0)
      std::printf(
          "rank 0: gathered %zu weights, reduced gradient[0] = %g (mean of 1.0), "
          "bytes sent across nodes: qwZ %llu, hpZ %llu, qgZ %llu\n",
          layout.padded_numel(), qcoll::to_float(grad_shard[0]),
          static_cast<unsigned long long>(t.counters().inter_node),
          static_cast<unsigned long long>(hpz.intra_node().counters().inter_node),
          static_cast<unsigned long long>(qgz.inter_node().counters().inter_node));
  });
  return 0;
}
