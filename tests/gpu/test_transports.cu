// The device transports: CudaLocalTransport (threads sharing one GPU) with 2..8 ranks, called
// directly and replayed from CUDA graphs, and NcclTransport on a one-rank communicator
// (ncclCommInitAll on one GPU) when NCCL is available. Expected buffers are built from the
// definition of each collective, never from the transport.
//
// Exits with 77 (reported as skipped by CTest) when there is no CUDA device.

#include "../common/gpu_main.hpp"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(QCOLL_HAVE_NCCL) && !QCOLL_HAVE_NCCL
#define QCOLL_HAS_NCCL 0  // the build has NCCL disabled: leave the NCCL transport out
#endif

#include <qcoll/transport/cuda_local.cuh>
#include <qcoll/transport/nccl.cuh>

#include "../common/device_bytes.hpp"
#include "../common/nccl_one_rank.hpp"

namespace {

#define TEST_CUDA(expr) QCOLL_CUDA_CHECK(expr)

using testing_support::DeviceBytes;

//! Byte i of the block that rank r sends as block b. c = 8r + b + 1 is distinct for r, b < 8 and
//! 37 is odd, so c * 37 mod 256 differs between any two (r, b): a block from the wrong rank or at
//! the wrong position differs from the expected one at byte 0 already.
unsigned char pattern(int r, int b, std::size_t i) {
  const unsigned c = static_cast<unsigned>(8 * r + b + 1);
  return static_cast<unsigned char>(c * 37u + static_cast<unsigned>(i) * 7u);
}

std::vector<unsigned char> block(int r, int b, std::size_t bytes) {
  std::vector<unsigned char> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v[i] = pattern(r, b, i);
  return v;
}

std::vector<unsigned char> download(const unsigned char* d, std::size_t bytes, cudaStream_t s) {
  std::vector<unsigned char> h(bytes);
  TEST_CUDA(cudaMemcpyAsync(h.data(), d, bytes, cudaMemcpyDeviceToHost, s));
  TEST_CUDA(cudaStreamSynchronize(s));
  return h;
}

//! Collects failures of worker threads (doctest assertions are reported from the main thread).
struct Failures {
  std::mutex mu;
  std::vector<std::string> messages;
  void add(const std::string& m) {
    std::lock_guard<std::mutex> lk(mu);
    messages.push_back(m);
  }
};

// Odd size, not a multiple of any copy granule.
constexpr std::size_t kBytes = 4099;

void gather_case(int world, bool in_place) {
  std::vector<long long> nodes;
  for (int r = 0; r < world; ++r) nodes.push_back(r / 2);  // two ranks per node
  qcoll::CudaLocalGroup group(world, nodes);
  Failures fails;
  group.run([&](qcoll::CudaLocalTransport& t) {
    const int me = t.rank();
    const cudaStream_t s = t.stream();
    DeviceBytes recv(kBytes * static_cast<std::size_t>(world));
    DeviceBytes own(kBytes);
    unsigned char* send = in_place ? recv.get() + static_cast<std::size_t>(me) * kBytes : own.get();
    const std::vector<unsigned char> mine = block(me, 0, kBytes);
    TEST_CUDA(cudaMemcpyAsync(send, mine.data(), kBytes, cudaMemcpyHostToDevice, s));
    t.all_gather(send, recv.get(), kBytes, s);
    // Overwriting the send buffer right after the call, on the same stream, must not reach any
    // peer: the stream waits until every peer has copied it.
    if (!in_place) TEST_CUDA(cudaMemsetAsync(send, 0xEE, kBytes, s));
    const std::vector<unsigned char> got = download(recv.get(), recv.size(), s);
    for (int r = 0; r < world; ++r) {
      if (std::memcmp(got.data() + static_cast<std::size_t>(r) * kBytes, block(r, 0, kBytes).data(),
                      kBytes) != 0)
        fails.add("rank " + std::to_string(me) + ": block " + std::to_string(r) + " differs");
    }
    // Counters: one call; kBytes for each peer, split by node (ranks 2k and 2k+1 share node k).
    int same = 0;
    for (int r = 0; r < world; ++r)
      if (r != me && r / 2 == me / 2) ++same;
    const qcoll::ByteCounters& c = t.counters();
    if (c.calls != 1 || c.intra_node != kBytes * static_cast<std::uint64_t>(same) ||
        c.inter_node != kBytes * static_cast<std::uint64_t>(world - 1 - same))
      fails.add("rank " + std::to_string(me) + ": counters " + std::to_string(c.intra_node) + "/" +
                std::to_string(c.inter_node) + "/" + std::to_string(c.calls));
    t.reset_counters();
    if (t.counters().total() != 0 || t.counters().calls != 0) fails.add("reset_counters");
  });
  for (const auto& m : fails.messages) FAIL_CHECK(m);
}

TEST_CASE("cuda_local all_gather, out of place and in place, 2..8 ranks") {
  for (int world = 2; world <= 8; ++world) {
    CAPTURE(world);
    gather_case(world, false);
    gather_case(world, true);
  }
}

TEST_CASE("cuda_local all_to_all, 2..8 ranks, repeated calls") {
  for (int world = 2; world <= 8; ++world) {
    CAPTURE(world);
    qcoll::CudaLocalGroup group(world);
    Failures fails;
    group.run([&](qcoll::CudaLocalTransport& t) {
      const int me = t.rank();
      const cudaStream_t s = t.stream();
      const std::size_t total = kBytes * static_cast<std::size_t>(world);
      DeviceBytes send(total), recv(total);
      for (int round = 0; round < 3; ++round) {
        // Block j of rank me's send goes to rank j; the pattern's "rank" argument varies with
        // the round so a stale result of an earlier round is caught.
        std::vector<unsigned char> h(total);
        for (int j = 0; j < world; ++j) {
          const std::vector<unsigned char> b = block((me + round) % 8, j, kBytes);
          std::memcpy(h.data() + static_cast<std::size_t>(j) * kBytes, b.data(), kBytes);
        }
        TEST_CUDA(cudaMemcpyAsync(send.get(), h.data(), total, cudaMemcpyHostToDevice, s));
        t.all_to_all(send.get(), recv.get(), kBytes);  // null stream: the rank's own stream
        const std::vector<unsigned char> got = download(recv.get(), total, s);
        for (int i = 0; i < world; ++i) {
          if (std::memcmp(got.data() + static_cast<std::size_t>(i) * kBytes,
                          block((i + round) % 8, me, kBytes).data(), kBytes) != 0)
            fails.add("rank " + std::to_string(me) + " round " + std::to_string(round) + ": block " +
                      std::to_string(i) + " differs");
        }
      }
      // All ranks on node 0: three calls of kBytes to each of world - 1 peers, all intra-node.
      if (t.counters().calls != 3 || t.counters().inter_node != 0 ||
          t.counters().intra_node != 3 * kBytes * static_cast<std::uint64_t>(world - 1))
        fails.add("rank " + std::to_string(me) + ": counters");
    });
    for (const auto& m : fails.messages) FAIL_CHECK(m);
  }
}

TEST_CASE("cuda_local split, all_reduce and barrier") {
  const int world = 6;
  qcoll::CudaLocalGroup group(world, {0, 0, 0, 1, 1, 1});
  Failures fails;
  group.run([&](qcoll::CudaLocalTransport& t) {
    const int me = t.rank();
    // Colors by parity, keys descending: color 0 = {4, 2, 0}, color 1 = {5, 3, 1} in that order.
    qcoll::CudaLocalTransport sub = t.split(me % 2, -me);
    const int expect_rank = (world - 1 - me) / 2;
    if (sub.size() != 3 || sub.rank() != expect_rank)
      fails.add("rank " + std::to_string(me) + ": sub rank " + std::to_string(sub.rank()));
    // Node ids are carried over: sub rank k is parent rank p(k) = (me % 2) + 2 * (2 - k).
    for (int k = 0; k < 3; ++k) {
      const int parent = me % 2 + 2 * (2 - k);
      if (sub.node_of(k) != parent / 3) fails.add("rank " + std::to_string(me) + ": sub.node_of");
    }
    DeviceBytes recv(3 * kBytes), send(kBytes);
    const std::vector<unsigned char> mine = block(me, 1, kBytes);
    TEST_CUDA(cudaMemcpyAsync(send.get(), mine.data(), kBytes, cudaMemcpyHostToDevice, sub.stream()));
    sub.all_gather(send.get(), recv.get(), kBytes, sub.stream());
    const std::vector<unsigned char> got = download(recv.get(), 3 * kBytes, sub.stream());
    for (int k = 0; k < 3; ++k) {
      const int parent = me % 2 + 2 * (2 - k);
      if (std::memcmp(got.data() + static_cast<std::size_t>(k) * kBytes, block(parent, 1, kBytes).data(),
                      kBytes) != 0)
        fails.add("rank " + std::to_string(me) + ": sub block " + std::to_string(k));
    }
    if (t.counters().calls != 0 || sub.counters().calls != 1) fails.add("split counters");

    // all_reduce of host words: sum of ranks 0..5 = 15; min 0; max 5; or of 1 << r = 0b111111.
    std::uint64_t v[4] = {static_cast<std::uint64_t>(me), static_cast<std::uint64_t>(me),
                          static_cast<std::uint64_t>(me), std::uint64_t{1} << me};
    t.all_reduce(v, 1, qcoll::ReduceOp::sum);
    t.all_reduce(v + 1, 1, qcoll::ReduceOp::min);
    t.all_reduce(v + 2, 1, qcoll::ReduceOp::max);
    t.all_reduce(v + 3, 1, qcoll::ReduceOp::bit_or);
    if (v[0] != 15 || v[1] != 0 || v[2] != 5 || v[3] != 63) fails.add("all_reduce");
    t.barrier();
  });
  for (const auto& m : fails.messages) FAIL_CHECK(m);
}

TEST_CASE("cuda_local: a failing rank makes the others throw instead of hanging") {
  qcoll::CudaLocalGroup group(4);
  std::atomic<int> peer_errors{0};
  CHECK_THROWS_WITH_AS(group.run([&](qcoll::CudaLocalTransport& t) {
    if (t.rank() == 2) throw std::runtime_error("rank two fails");
    DeviceBytes send(kBytes), recv(4 * kBytes);
    try {
      t.all_gather(send.get(), recv.get(), kBytes, t.stream());
    } catch (const qcoll::Error&) {
      ++peer_errors;
      throw;
    }
  }),
                       "rank two fails", std::runtime_error);
  CHECK(peer_errors.load() == 3);
}

TEST_CASE("cuda_local: bad arguments and disagreeing ranks") {
  qcoll::CudaLocalGroup group(2);
  Failures fails;
  std::atomic<int> caught{0};
  group.run([&](qcoll::CudaLocalTransport& t) {
    DeviceBytes d(4 * kBytes);
    std::vector<unsigned char> pageable(2 * kBytes);
    // Every rank makes the same bad call; the checks run before any rendezvous.
    try {
      t.all_gather(pageable.data(), d.get(), kBytes);
      fails.add("pageable send accepted");
    } catch (const qcoll::Error& e) {
      if (std::string(e.what()).find("send") == std::string::npos) fails.add(e.what());
      ++caught;
    }
    try {
      t.all_to_all(d.get(), pageable.data(), kBytes / 2);
      fails.add("pageable recv accepted");
    } catch (const qcoll::Error&) {
      ++caught;
    }
    try {
      t.all_gather(nullptr, d.get(), kBytes);
      fails.add("null send accepted");
    } catch (const qcoll::Error&) {
      ++caught;
    }
    try {
      t.all_gather(d.get(), d.get() + 1, kBytes);  // overlapping, not the in-place block
      fails.add("overlap accepted");
    } catch (const qcoll::Error&) {
      ++caught;
    }
    try {
      (void)t.split(-1, 0);
      fails.add("negative color accepted");
    } catch (const qcoll::Error&) {
      ++caught;
    }
    // Ranks disagree on the size: both throw, neither hangs, the group stays usable.
    try {
      t.all_gather(d.get(), d.get() + 2 * kBytes, t.rank() == 0 ? 16 : 32, t.stream());
      fails.add("size mismatch accepted");
    } catch (const qcoll::Error&) {
      ++caught;
    }
    // Rank 0 captures the call, rank 1 makes it directly: the two would order their copies by
    // different protocols, so both throw, naming the capture.
    {
      const cudaStream_t s = t.stream();
      if (t.rank() == 0) TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      std::string what;
      try {
        t.all_gather(d.get(), d.get() + 2 * kBytes, 16, s);
      } catch (const qcoll::Error& e) {
        what = e.what();
      }
      if (t.rank() == 0) {
        cudaGraph_t g = nullptr;
        TEST_CUDA(cudaStreamEndCapture(s, &g));
        if (g != nullptr) TEST_CUDA(cudaGraphDestroy(g));
      }
      if (what.find("while capturing") == std::string::npos || what.find("disagree") == std::string::npos)
        fails.add("rank " + std::to_string(t.rank()) + ": capture mismatch: '" + what + "'");
      else
        ++caught;
    }
    t.barrier();
    if (t.counters().calls != 0) fails.add("failed calls were counted");
  });
  for (const auto& m : fails.messages) FAIL_CHECK(m);
  CHECK(caught.load() == 2 * 7);
  CHECK_THROWS_AS(qcoll::CudaLocalGroup(2, {}, -1), qcoll::Error);
  CHECK_THROWS_AS(qcoll::CudaLocalGroup(0), qcoll::Error);
  CHECK_THROWS_AS(qcoll::CudaLocalGroup(2, {0}), qcoll::Error);
  // The protocol's timeout must be at least one millisecond; the message names the argument.
  for (long long bad : {0LL, -5LL}) {
    CAPTURE(bad);
    std::string what;
    try {
      qcoll::CudaLocalGroup g(2, {}, 0, bad);
    } catch (const qcoll::Error& e) {
      what = e.what();
    }
    CHECK(what.find("timeout_ms") != std::string::npos);
  }
  CHECK(qcoll::CudaLocalGroup(2, {}, 0, 1).timeout_ms() == 1);
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs
// ---------------------------------------------------------------------------------------------

//! Byte i of block b that rank r sends in iteration `iter` of the graph test. c = 64 iter + 8 r +
//! b + 1 takes 256 consecutive values for iter < 4 and r, b < 8, so c is distinct modulo 256, and
//! so is c * 37 (37 is odd): data of another iteration, rank or block differs at byte 0 already.
__host__ __device__ unsigned char graph_pattern(unsigned iter, int r, int b, std::size_t i) {
  const unsigned c = 64u * iter + 8u * static_cast<unsigned>(r) + static_cast<unsigned>(b) + 1u;
  return static_cast<unsigned char>(c * 37u + static_cast<unsigned>(i) * 7u);
}

//! The all_gather block of the graph test uses block index 7; the all_to_all blocks use 0..world-1.
constexpr int kGatherBlock = 7;

//! Fills this rank's send buffers for iteration *iter, then advances *iter (one block: every
//! thread reads *iter before the barrier, thread 0 writes it after).
__global__ void graph_fill_kernel(unsigned* iter, int rank, int world, unsigned char* gather_send,
                                  unsigned char* a2a_send, std::size_t bytes) {
  const unsigned it = *iter;
  for (std::size_t i = threadIdx.x; i < bytes; i += blockDim.x) {
    gather_send[i] = graph_pattern(it, rank, kGatherBlock, i);
    for (int j = 0; j < world; ++j)
      a2a_send[static_cast<std::size_t>(j) * bytes + i] = graph_pattern(it, rank, j, i);
  }
  __syncthreads();
  if (threadIdx.x == 0) *iter = it + 1;
}

//! Owning graph and executable graph.
struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
  }
};

TEST_CASE("cuda_local all_gather and all_to_all captured in a CUDA graph and replayed") {
  const int world = 4;
  // A 20 s bound on each wait: a protocol fault traps well inside the test's time instead of
  // after the default 120 s.
  qcoll::CudaLocalGroup group(world, {0, 0, 1, 1}, 0, 20000);
  Failures fails;
  group.run([&](qcoll::CudaLocalTransport& t) {
    const int me = t.rank();
    const std::string who = "rank " + std::to_string(me);
    const cudaStream_t s = t.stream();
    // Sub-group by parity, ordered by rank: {0, 2} and {1, 3}; sub rank k is parent me % 2 + 2k.
    qcoll::CudaLocalTransport sub = t.split(me % 2, me);
    const std::size_t total = kBytes * static_cast<std::size_t>(world);
    DeviceBytes iter(sizeof(unsigned)), gsend(kBytes), grecv(total), srecv(2 * kBytes), asend(total),
        arecv(total);
    TEST_CUDA(cudaMemsetAsync(iter.get(), 0, sizeof(unsigned), s));

    // One step: fill the send buffers for the current iteration (advancing the device counter),
    // all_gather over the world and over the sub-group, all_to_all over the world.
    const auto step = [&] {
      graph_fill_kernel<<<1, 256, 0, s>>>(reinterpret_cast<unsigned*>(iter.get()), me, world, gsend.get(),
                                          asend.get(), kBytes);
      TEST_CUDA(cudaGetLastError());
      t.all_gather(gsend.get(), grecv.get(), kBytes, s);
      sub.all_gather(gsend.get(), srecv.get(), kBytes, s);
      t.all_to_all(asend.get(), arecv.get(), kBytes, s);
    };

    Graph g;
    TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    try {
      step();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      (void)cudaStreamEndCapture(s, &broken);
      if (broken != nullptr) (void)cudaGraphDestroy(broken);
      throw;
    }
    TEST_CUDA(cudaStreamEndCapture(s, &g.graph));
    TEST_CUDA(cudaGraphInstantiate(&g.exec, g.graph, 0));
    // Every rank finishes its set-up calls before any replay starts waiting for peers.
    t.barrier();

    // Iterations 0, 2, 3 replay the graph; iteration 1 makes the same calls directly.
    // Host copies (pageable, so synchronous) only while no replay waits: a rank blocked in one
    // could not launch the replay its peers' replays wait for (docs/device.md). The direct step
    // needs no such care.
    for (unsigned k = 0; k < 4; ++k) {
      if (k == 1) {
        step();
      } else {
        TEST_CUDA(cudaGraphLaunch(g.exec, s));
        TEST_CUDA(cudaStreamSynchronize(s));
        t.barrier();
      }
      const std::vector<unsigned char> got_g = download(grecv.get(), total, s);
      const std::vector<unsigned char> got_s = download(srecv.get(), 2 * kBytes, s);
      const std::vector<unsigned char> got_a = download(arecv.get(), total, s);
      for (int r = 0; r < world; ++r) {
        for (std::size_t i = 0; i < kBytes; ++i) {
          const std::size_t at = static_cast<std::size_t>(r) * kBytes + i;
          if (got_g[at] != graph_pattern(k, r, kGatherBlock, i)) {
            fails.add(who + " iteration " + std::to_string(k) + ": all_gather block " + std::to_string(r) +
                      " differs at byte " + std::to_string(i));
            break;
          }
        }
        for (std::size_t i = 0; i < kBytes; ++i) {
          const std::size_t at = static_cast<std::size_t>(r) * kBytes + i;
          if (got_a[at] != graph_pattern(k, r, me, i)) {
            fails.add(who + " iteration " + std::to_string(k) + ": all_to_all block " + std::to_string(r) +
                      " differs at byte " + std::to_string(i));
            break;
          }
        }
      }
      for (int q = 0; q < 2; ++q) {
        for (std::size_t i = 0; i < kBytes; ++i) {
          if (got_s[static_cast<std::size_t>(q) * kBytes + i] !=
              graph_pattern(k, me % 2 + 2 * q, kGatherBlock, i)) {
            fails.add(who + " iteration " + std::to_string(k) + ": sub-group block " + std::to_string(q) +
                      " differs at byte " + std::to_string(i));
            break;
          }
        }
      }
      t.barrier();
    }
    // The graph advanced the device counter on each of its 3 replays, the direct step once.
    unsigned iterations = 0;
    std::memcpy(&iterations, download(iter.get(), sizeof(unsigned), s).data(), sizeof(unsigned));
    if (iterations != 4) fails.add(who + ": iteration counter " + std::to_string(iterations));
    // Counters count enqueued calls: the captured ones once, the direct ones once; replays never.
    if (t.counters().calls != 4 || sub.counters().calls != 2)
      fails.add(who + ": counters " + std::to_string(t.counters().calls) + "/" +
                std::to_string(sub.counters().calls));
    // Nodes {0, 0, 1, 1}: each world call sends kBytes to 1 same-node and 2 other-node peers.
    if (t.counters().intra_node != 4 * kBytes || t.counters().inter_node != 8 * kBytes)
      fails.add(who + ": byte counters");
    t.barrier();
  });
  for (const auto& m : fails.messages) FAIL_CHECK(m);
}

#if QCOLL_HAS_NCCL

TEST_CASE("nccl: one rank: all_gather, all_to_all, counters") {
  TEST_CUDA(cudaSetDevice(0));
  OneRankComm c;
  qcoll::NcclTransport t(c.comm, {7});
  CHECK(t.rank() == 0);
  CHECK(t.size() == 1);
  CHECK(t.node_of(0) == 7);
  CHECK_THROWS_AS((void)t.node_of(1), qcoll::Error);
  cudaStream_t s;
  TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DeviceBytes a(kBytes), b(kBytes);
  const std::vector<unsigned char> src = block(3, 4, kBytes);
  TEST_CUDA(cudaMemcpyAsync(a.get(), src.data(), kBytes, cudaMemcpyHostToDevice, s));
  // With one rank, recv is the rank's own block.
  t.all_gather(a.get(), b.get(), kBytes, s);
  CHECK(download(b.get(), kBytes, s) == src);
  TEST_CUDA(cudaMemsetAsync(b.get(), 0, kBytes, s));
  t.all_to_all(a.get(), b.get(), kBytes, s);
  CHECK(download(b.get(), kBytes, s) == src);
  t.all_gather(a.get(), a.get(), kBytes, s);  // in place
  CHECK(download(a.get(), kBytes, s) == src);
  // No peers: calls counted, no bytes.
  CHECK(t.counters().calls == 3);
  CHECK(t.counters().total() == 0);
  std::vector<unsigned char> pageable(kBytes);
  CHECK_THROWS_AS(t.all_gather(pageable.data(), b.get(), kBytes, s), qcoll::Error);
  CHECK_THROWS_AS(t.all_to_all(nullptr, b.get(), kBytes, s), qcoll::Error);
  TEST_CUDA(cudaStreamDestroy(s));
}

TEST_CASE("nccl: one rank: all_reduce of each op, split") {
  TEST_CUDA(cudaSetDevice(0));
  OneRankComm c;
  qcoll::NcclTransport t(c.comm);
  // With one rank every reduction is the identity; 1000 words take several staging chunks (512
  // words for sum/min/max, 64 for the byte map of bit_or), so chunking and the bit map are used.
  std::vector<std::uint64_t> in(1000);
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& w : in) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    w = x;
  }
  in[0] = ~std::uint64_t{0};
  in[1] = std::uint64_t{1} << 63;
  in[2] = 0;
  for (qcoll::ReduceOp op :
       {qcoll::ReduceOp::sum, qcoll::ReduceOp::min, qcoll::ReduceOp::max, qcoll::ReduceOp::bit_or}) {
    CAPTURE(op);
    std::vector<std::uint64_t> v = in;
    t.all_reduce(v.data(), v.size(), op);
    CHECK(v == in);
  }
  CHECK_THROWS_AS(t.all_reduce(nullptr, 1, qcoll::ReduceOp::sum), qcoll::Error);
  t.barrier();
  qcoll::NcclTransport sub = t.split(0, 0);
  CHECK(sub.size() == 1);
  CHECK(sub.rank() == 0);
  CHECK(sub.comm() != c.comm);
  CHECK(sub.node_of(0) == 0);
  std::uint64_t w = 5;
  sub.all_reduce(&w, 1, qcoll::ReduceOp::max);
  CHECK(w == 5);
  CHECK_THROWS_AS((void)t.split(-1, 0), qcoll::Error);
}

#endif  // QCOLL_HAS_NCCL

}  // namespace
