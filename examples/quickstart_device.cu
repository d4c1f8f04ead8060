// The quick start on device memory: one ZeRO++ step (qwZ forward gather, hpZ backward gather,
// qgZ gradient reduce-scatter) on 8 ranks in 2 nodes of 4, all sharing GPU 0 through
// CudaLocalTransport, first called directly and then captured in a CUDA graph and replayed. With
// NCCL, the same plans take a qcoll::NcclTransport (one rank per GPU) instead.
#include <qcoll/qcoll.cuh>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {
void check(cudaError_t e) {
  if (e != cudaSuccess) throw qcoll::Error(cudaGetErrorString(e));
}
}  // namespace

int main() {
  qcoll::cuda_local_request_queues();  // before the first CUDA call: 8 ranks' streams, one queue each
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device\n");
    return 0;
  }
  const int world = 8;
  const std::size_t numel = 1 << 20;
  std::vector<long long> node_of_rank = {0, 1, 0, 1, 0, 1, 0, 1};  // any placement, not only node-major
  qcoll::CudaLocalGroup group(world, node_of_rank);

  group.run([&](qcoll::CudaLocalTransport& t) {
    using bf16 = qcoll::bfloat16;
    using T = qcoll::CudaLocalTransport;
    // once, at start-up (collective: every rank builds the same plans)
    auto topo = qcoll::Topology::from_node_ids(node_of_rank, t.rank());
    qcoll::ShardLayout layout(numel, t.size(), qcoll::granule_for(sizeof(bf16), {2048}));
    qcoll::QuantizedAllGather<bf16, qcoll::Int8<2048>, T> qwz(t, layout);
    qcoll::SecondaryShard<bf16, qcoll::Identity<bf16, 2048>, T> hpz(t, topo, layout);
    qcoll::QuantizedReduceScatter<bf16, qcoll::Int4<2048>, qcoll::Int4<2048>, T> qgz(t, topo, layout,
                                                                                     qcoll::Reduce::mean);
    const std::size_t wb = std::max({qwz.workspace_bytes(), hpz.workspace_bytes(), qgz.workspace_bytes()});
    void* w = nullptr;  // cudaMalloc returns 256-byte aligned memory
    bf16 *shard = nullptr, *full = nullptr, *grads = nullptr, *grad_shard = nullptr;
    check(cudaMalloc(&w, wb));
    check(cudaMalloc(&shard, layout.shard_numel() * sizeof(bf16)));
    check(cudaMalloc(&full, layout.padded_numel() * sizeof(bf16)));
    check(cudaMalloc(&grads, layout.padded_numel() * sizeof(bf16)));
    check(cudaMalloc(&grad_shard, layout.shard_numel() * sizeof(bf16)));
    std::vector<bf16> ones(layout.padded_numel(), qcoll::from_float<bf16>(1.0f));
    check(cudaMemcpy(grads, ones.data(), ones.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    check(cudaMemcpy(shard, ones.data(), layout.shard_numel() * sizeof(bf16), cudaMemcpyHostToDevice));

    // one step, stream-ordered: no host synchronisation inside
    cudaStream_t s = t.stream();
    auto step = [&](std::uint64_t generation) {
      qwz(shard, full, w, wb, s);              // forward gather: int8 on the wire
      hpz.capture(full, generation, s);        // keep 1/L of the weights, no communication
      hpz.gather(full, generation, w, wb, s);  // backward gather inside the node only
      qgz(grads, grad_shard, w, wb, s);        // int4, two hops, mean over ranks
    };
    t.barrier();  // every rank's set-up (allocations, copies) is done before any rank waits on the GPU
    step(1);
    const std::uint32_t flags = qcoll::gpu::read_result_flags(w, s);  // the last call's flags

    // the same step captured once in a CUDA graph, then replayed
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    step(2);
    check(cudaStreamEndCapture(s, &graph));
    check(cudaGraphInstantiate(&exec, graph, 0));
    // The ranks share one GPU and wait for each other on it: finish every rank's set-up before
    // any rank starts replaying, and every rank's replays before any rank frees memory.
    t.barrier();
    for (int i = 0; i < 3; ++i) check(cudaGraphLaunch(exec, s));
    check(cudaStreamSynchronize(s));
    t.barrier();
    bf16 g0;
    check(cudaMemcpy(&g0, grad_shard, sizeof g0, cudaMemcpyDeviceToHost));
    if (t.rank() == 0)
      std::printf(
          "rank 0: reduced gradient[0] = %g (mean of 1.0), result flags %u, "
          "bytes sent across nodes by qgZ per call: %llu\n",
          qcoll::to_float(g0), flags,
          static_cast<unsigned long long>(qgz.inter_node().counters().inter_node / 2));
    check(cudaGraphExecDestroy(exec));
    check(cudaGraphDestroy(graph));
    for (void* p : {w, static_cast<void*>(shard), static_cast<void*>(full), static_cast<void*>(grads),
                    static_cast<void*>(grad_shard)})
      check(cudaFree(p));
  });
  return 0;
}
