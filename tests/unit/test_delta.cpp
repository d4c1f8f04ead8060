// qWD, the weight-difference all-gather, over the in-process transport: 100 steps on 8 ranks in 2
// nodes (placed round-robin), replicas bit-identical on every rank after every step, within one
// difference's quantization bound of the owners' weights; a resync with the identity format
// restores exact equality; disagreements and bad arguments are rejected on every rank.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include <qcoll/collective/delta_all_gather.hpp>
#include <qcoll/transport/local.hpp>

#include "../common/collective_harness.hpp"

using namespace qcoll;
using namespace harness;

namespace {

const std::vector<long long> kIds = {0, 1, 0, 1, 0, 1, 0, 1};  // 8 ranks, 2 nodes, round-robin
constexpr double kU = 1.0 / (1 << 24);

// The weights of step t: w_0 ~ N(0, 1) and w_{t+1} = w_t + 1e-3 * N(0, 1) per element, as fp32,
// rounded to T when stored.
struct Weights {
  std::vector<float> w;
  std::mt19937_64 g{12345};
  explicit Weights(std::size_t n) : w(n) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& x : w) x = d(g);
  }
  void step() {
    std::normal_distribution<float> d(0.0f, 1e-3f);
    for (auto& x : w) x += d(g);
  }
};

// Largest |x| of block b (F::block elements from `at`) of v, within [0, valid).
double block_absmax(const std::vector<double>& v, std::size_t at, std::size_t len) {
  double m = 0;
  for (std::size_t i = at; i < at + len && i < v.size(); ++i) m = std::max(m, std::fabs(v[i]));
  return m;
}

template <class T, class F>
void run_steps(std::size_t numel, int steps) {
  const int W = static_cast<int>(kIds.size());
  const ShardLayout layout(numel, W, granule_for(sizeof(T), {F::block}));
  Weights truth(layout.padded_numel());
  std::vector<std::vector<T>> replica(W, std::vector<T>(layout.padded_numel(), from_float<T>(0.0f)));
  std::vector<std::vector<T>> shard(W, std::vector<T>(layout.shard_numel()));
  const int bits = significand_bits<T>();
  LocalGroup g(W, kIds);
  g.run([&](LocalTransport& t) {
    const int me = t.rank();
    DeltaAllGather<T, F, LocalTransport> qwd(t, layout);
    using Exact = Identity<T, F::block>;
    Workspace ws(std::max(qwd.workspace_bytes(), qwd.template resync_workspace_bytes<Exact>()));
    auto load = [&] {
      for (std::size_t i = 0; i < layout.shard_numel(); ++i)
        shard[me][i] = from_float<T>(truth.w[layout.shard_offset(me) + i]);
    };
    // First call: a resync with the identity format makes every replica equal to the weights.
    load();
    CHECK(qwd.template resync<Exact>(shard[me].data(), replica[me].data(), ws.ptr, ws.bytes) == 0u);
    t.barrier();
    for (int step = 0; step < steps; ++step) {
      // The difference each element will be sent, per the replica before the call (the same on
      // every rank): the bound is per block of it.
      if (me == 0) truth.step();
      t.barrier();
      load();
      std::vector<double> d(layout.padded_numel(), 0.0);
      for (std::size_t i = 0; i < numel; ++i)
        d[i] = static_cast<double>(to_float(from_float<T>(truth.w[i]))) - to_float(replica[me][i]);
      t.barrier();
      CHECK(qwd(shard[me].data(), replica[me].data(), ws.ptr, ws.bytes) == 0u);
      t.barrier();
      // Bit-identical replicas on every rank.
      if (me != 0) REQUIRE(same_bits(replica[me], replica[0]));
      // Within one difference's quantization error of the weights (as stored in T): half a step
      // of the block's scale (absmax / (2 qmax), plus its fp32 roundings), the fp32 subtraction
      // and addition, and the rounding of the new replica to T.
      int bad = 0;
      for (std::size_t i = 0; i < numel; ++i) {
        const std::size_t at = i / F::block * F::block;
        const double w = to_float(from_float<T>(truth.w[i])), r = to_float(replica[me][i]);
        const double bound = block_absmax(d, at, F::block) / (2.0 * F::qmax) * (1 + 8 * kU) +
                             kU * std::fabs(d[i]) + (kU + std::ldexp(1.0, -bits)) * std::fabs(r);
        bad += std::fabs(w - r) > bound;
      }
      CHECK(bad == 0);
      // Padding stays zero in every replica.
      for (std::size_t i = numel; i < layout.padded_numel(); ++i) REQUIRE(to_float(replica[me][i]) == 0.0f);
      t.barrier();
    }
    // A resync restores exact equality.
    load();
    qwd.template resync<Exact>(shard[me].data(), replica[me].data(), ws.ptr, ws.bytes);
    for (std::size_t i = 0; i < numel; ++i)
      REQUIRE(std::memcmp(&replica[me][i], &shard[i / layout.shard_numel()][i % layout.shard_numel()],
                          sizeof(T)) == 0);
  });
}

}  // namespace

TEST_CASE("qWD: 100 steps on 8 ranks in 2 nodes, replicas identical and within one difference's error") {
  run_steps<float, Int4<32>>(5000, 100);
  run_steps<bfloat16, Int4<64>>(3001, 100);
  run_steps<float, Int8<32>>(777, 30);
}

TEST_CASE("qWD: 4-bit differences keep the replica far closer than 4-bit weights would") {
  // After 100 steps, the replica's largest error is bounded by half a step of a *difference*
  // block, while a 4-bit all-gather of the weights errs by half a step of a *weight* block:
  // absmax(w) / 14, about 0.25 for N(0, 1) weights in blocks of 32. Check the replica is 20 times
  // closer than that (updates are 1e-3 per step, the differences' steps about 3e-4).
  const int W = 8;
  const ShardLayout layout(4096, W, granule_for(4, {32}));
  Weights truth(layout.padded_numel());
  std::vector<std::vector<float>> replica(W, std::vector<float>(layout.padded_numel(), 0.0f));
  LocalGroup g(W, kIds);
  double worst = 0, weight_step = 0;
  g.run([&](LocalTransport& t) {
    const int me = t.rank();
    DeltaAllGather<float, Int4<32>, LocalTransport> qwd(t, layout);
    Workspace ws(std::max(qwd.workspace_bytes(), qwd.resync_workspace_bytes<Identity<float, 32>>()));
    const float* mine = truth.w.data() + layout.shard_offset(me);
    std::vector<float> shard(mine, mine + layout.shard_numel());
    qwd.resync<Identity<float, 32>>(shard.data(), replica[me].data(), ws.ptr, ws.bytes);
    for (int step = 0; step < 100; ++step) {
      t.barrier();
      if (me == 0) truth.step();
      t.barrier();
      shard.assign(mine, mine + layout.shard_numel());
      qwd(shard.data(), replica[me].data(), ws.ptr, ws.bytes);
    }
    t.barrier();
    if (me == 0) {
      for (std::size_t i = 0; i < layout.numel(); ++i) {
        worst = std::max(worst, std::fabs(static_cast<double>(truth.w[i]) - replica[0][i]));
        if (i % 32 == 0) {
          double a = 0;
          for (std::size_t j = i; j < i + 32; ++j)
            a = std::max(a, std::fabs(static_cast<double>(truth.w[j])));
          weight_step = std::max(weight_step, a / 14.0);
        }
      }
    }
  });
  MESSAGE("after 100 steps: replica error " << worst << ", a 4-bit weight gather's half step up to "
                                            << weight_step);
  CHECK(worst * 20 < weight_step);
}

TEST_CASE("qWD: different plans, a replica inside the workspace, overlapping buffers: every rank throws") {
  const int W = 4;
  const std::vector<long long> ids = {0, 0, 1, 1};
  const ShardLayout a(1000, W, granule_for(4, {32})), b(999, W, granule_for(4, {32}));
  auto errors = [&](auto&& fn) { return errors_of(W, ids, fn); };
  auto msg = errors([&](LocalTransport& t) {
    DeltaAllGather<float, Int4<32>, LocalTransport> p(t, t.rank() == 2 ? b : a);
  });
  for (const auto& m : msg) CHECK(m.find("numel: 1000 (ranks 0,1,3) vs 999 (rank 2)") != std::string::npos);
  msg = errors([&](LocalTransport& t) {
    DeltaAllGather<float, Int4<32>, LocalTransport> p(t, a);
    Workspace ws(p.workspace_bytes() + 4 * a.padded_numel());
    std::vector<float> shard(a.shard_numel()), replica(a.padded_numel());
    float* r = t.rank() == 1 ? static_cast<float*>(ws.ptr) : replica.data();
    p(shard.data(), r, ws.ptr, ws.bytes);
  });
  CHECK(msg[1].find("'replica'") != std::string::npos);
  CHECK(msg[1].find("overlaps the workspace") != std::string::npos);
  for (int r : {0, 2, 3}) CHECK(msg[r].find("rank 1 rejected its arguments") != std::string::npos);
  msg = errors([&](LocalTransport& t) {
    DeltaAllGather<float, Int4<32>, LocalTransport> p(t, a);
    Workspace ws(p.workspace_bytes());
    std::vector<float> replica(a.padded_numel());
    p(replica.data() + 8, replica.data(), ws.ptr, ws.bytes);
  });
  CHECK(msg[0].find("'shard'") != std::string::npos);
  CHECK(msg[0].find("overlaps") != std::string::npos);
}
