// Tensor groups: layout arithmetic, and every plan over random groups of tensors on the in-process
// transport. A tensor's result never depends on its neighbours: gathered values equal quantizing
// that tensor alone, reduce-scatter shards equal the per-piece sums of quantizing each rank's piece
// alone, and a tensor whose neighbours change keeps its bits in every plan (two hops and the
// all-reduce included). Padding holds NaN in every input and never shows: no non-finite flag,
// zeros in every output. Ranks with different groups are rejected.
//
// QCOLL_GROUPS_CASES (default 6) random groups per format; QCOLL_GROUPS_MAX_NUMEL (default 3e5)
// caps a group's elements (the full range: 1..200 tensors of 0..1e5 elements, e.g.
// QCOLL_GROUPS_CASES=50 QCOLL_GROUPS_MAX_NUMEL=20000000).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <qcoll/collective/all_gather.hpp>
#include <qcoll/collective/delta_all_gather.hpp>
#include <qcoll/collective/hpz.hpp>
#include <qcoll/collective/reduce_scatter.hpp>
#include <qcoll/layout/group.hpp>
#include <qcoll/transport/local.hpp>

#include "../common/collective_harness.hpp"

using namespace qcoll;
using namespace harness;

namespace {

std::size_t env_size(const char* name, std::size_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? static_cast<std::size_t>(std::strtoull(v, nullptr, 10)) : fallback;
}

// A random list of 1..200 tensor sizes in 0..1e5, mostly small (as a model's biases and norms
// beside its matrices), including empty tensors, scaled down to at most max_total elements.
std::vector<std::size_t> random_sizes(std::mt19937_64& g, std::size_t max_total) {
  const std::size_t count = 1 + g() % 200;
  std::vector<std::size_t> n(count);
  std::size_t total = 0;
  for (auto& x : n) {
    const unsigned kind = g() % 8;
    x = kind == 0 ? 0 : kind <= 4 ? g() % 300 : kind <= 6 ? g() % 5000 : g() % 100001;
    total += x;
  }
  if (total > max_total)
    for (auto& x : n) x = x * max_total / total;
  return n;
}

// Rank r's input: value(seed, r, position) in every tensor, NaN in every padding position.
template <class T>
std::vector<T> group_input(const TensorGroup& grp, std::uint64_t seed, int r) {
  std::vector<T> v(grp.padded_numel(), from_float<T>(std::numeric_limits<float>::quiet_NaN()));
  for (std::size_t k = 0; k < grp.size(); ++k)
    for (std::size_t i = 0; i < grp.numel(k); ++i)
      v[grp.offset(k) + i] = from_float<T>(input_value(seed, r, grp.offset(k) + i));
  return v;
}

// Every padding position of `full` (the group's buffer) is +0 and every tensor element finite.
template <class T>
bool padding_is_zero(const TensorGroup& grp, const std::vector<T>& full) {
  std::vector<char> data(full.size(), 0);
  for (std::size_t k = 0; k < grp.size(); ++k)
    for (std::size_t i = 0; i < grp.numel(k); ++i) data[grp.offset(k) + i] = 1;
  const T zero = from_float<T>(0.0f);
  for (std::size_t i = 0; i < full.size(); ++i) {
    const float x = to_float(full[i]);
    if (data[i] ? !std::isfinite(x) : std::memcmp(&full[i], &zero, sizeof(T)) != 0) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("groups: slots are whole granules, shards balanced, pieces cover every tensor once") {
  std::mt19937_64 g(7);
  for (int trial = 0; trial < 40; ++trial) {
    const std::vector<std::size_t> n = random_sizes(g, 400000);
    const int W = 1 + static_cast<int>(g() % 8);
    const std::size_t granule = std::size_t{16} << (g() % 5);
    const TensorGroup grp(n, W, granule);
    REQUIRE(grp.size() == n.size());
    CHECK(grp.padded_numel() % (granule * static_cast<std::size_t>(W)) == 0);
    CHECK(grp.shard_numel() * static_cast<std::size_t>(W) == grp.padded_numel());
    std::size_t at = 0, data = 0;
    for (std::size_t k = 0; k < n.size(); ++k) {
      CHECK(grp.offset(k) == at);
      CHECK(grp.offset(k) % granule == 0);
      CHECK(grp.slot_numel(k) >= n[k]);
      CHECK(grp.slot_numel(k) < n[k] + granule);
      at += grp.slot_numel(k);
      data += n[k];
    }
    CHECK(grp.data_numel() == data);
    CHECK(grp.padded_numel() >= at);
    CHECK(grp.padded_numel() < at + granule * static_cast<std::size_t>(W));
    // Pieces: each tensor's elements exactly once, in order, inside the right shard.
    std::vector<std::size_t> covered(n.size(), 0);
    for (int r = 0; r < W; ++r) {
      std::size_t last = 0;
      grp.for_each_piece(r, [&](const TensorGroup::Piece& p) {
        CHECK(p.count > 0);
        CHECK(p.offset >= last);
        last = p.offset + p.count;
        CHECK(p.offset >= grp.layout().shard_offset(r));
        CHECK(p.offset + p.count <= grp.layout().shard_offset(r) + grp.shard_numel());
        CHECK(p.offset == grp.offset(p.tensor) + p.tensor_offset);
        CHECK(p.tensor_offset == covered[p.tensor]);
        covered[p.tensor] += p.count;
      });
    }
    for (std::size_t k = 0; k < n.size(); ++k) CHECK(covered[k] == n[k]);
    // data_in and the inner padding agree with the tensor table.
    const ShardLayout& l = grp.layout();
    std::vector<char> is_data(grp.padded_numel(), 0);
    for (std::size_t k = 0; k < n.size(); ++k)
      for (std::size_t i = 0; i < n[k]; ++i) is_data[grp.offset(k) + i] = 1;
    for (std::size_t b = 0; b < grp.padded_numel(); b += granule) {
      std::size_t expect = 0;
      while (expect < granule && is_data[b + expect]) ++expect;
      CHECK(l.data_in(b, granule) == expect);
    }
    std::size_t padding = 0;
    l.for_each_inner_padding(0, grp.padded_numel(), [&](std::size_t first, std::size_t count) {
      for (std::size_t i = first; i < first + count; ++i) CHECK(!is_data[i]);
      padding += count;
    });
    std::size_t expected_padding = 0;
    for (std::size_t i = 0; i < l.numel(); ++i) expected_padding += !is_data[i];
    CHECK(padding == expected_padding);
  }
}

TEST_CASE("groups: a one-tensor group is the flat layout; bad descriptions are rejected") {
  const TensorGroup one({1000}, 4, 64);
  CHECK(one.layout() == ShardLayout(1000, 4, 64));
  CHECK(!one.layout().grouped());
  CHECK(one.fingerprint() == 0);
  CHECK(one.padding_overhead() == 0.0);
  const TensorGroup two({500, 500}, 4, 64);
  CHECK(two.layout().grouped());
  CHECK(two.fingerprint() != 0);
  CHECK(two.fingerprint() != TensorGroup({512, 488}, 4, 64).fingerprint());
  CHECK(TensorGroup({10, 10, 10}, 1, 64).padding_overhead() == 2.0);  // 3 slots of 64 vs 64
  CHECK(TensorGroup({0, 0, 7}, 2, 16).offset(2) == 0);
  CHECK(TensorGroup::from_shapes({TensorShape::matrix(3, 5), TensorShape::vector(2)}, 2, 16).fingerprint() !=
        TensorGroup({15, 2}, 2, 16).fingerprint());
  CHECK_THROWS_WITH_AS(TensorGroup({1, 2}, 0, 16), doctest::Contains("'parts' = 0"), Error);
  CHECK_THROWS_WITH_AS(TensorGroup({1, 2}, 2, 0), doctest::Contains("'granule' = 0"), Error);
  CHECK_THROWS_WITH_AS(TensorGroup::from_shapes({TensorShape(14, 3, 5)}, 2, 16),
                       doctest::Contains("shapes[0]"), Error);
  CHECK_THROWS_WITH_AS(TensorGroup({1, std::numeric_limits<std::size_t>::max() - 8}, 2, 16),
                       doctest::Contains("shapes[1].numel"), Error);
  CHECK_THROWS_WITH_AS(TensorGroup({1, 2}, 2, 16).offset(2), doctest::Contains("'k' = 2"), Error);
  // Slots of 16 elements cannot hold whole blocks of 32.
  CHECK_THROWS_WITH_AS(
      [] {
        LocalGroup g(2, {0, 0});
        g.run([](LocalTransport& t) {
          const TensorGroup grp({10, 10, 10, 10}, 2, 16);  // shards of 32, slots of 16
          QuantizedAllGather<float, Int8<32>, LocalTransport> ag(t, grp);
        });
      }(),
      doctest::Contains("tensor group's slots whole blocks"), Error);
}

namespace {

// All-gather over random groups: every tensor equals the round trip of that tensor alone.
template <class F>
void gather_matches_tensor_alone(std::uint64_t seed) {
  std::mt19937_64 g(seed);
  const std::size_t cases = env_size("QCOLL_GROUPS_CASES", 6);
  const std::size_t max_total = env_size("QCOLL_GROUPS_MAX_NUMEL", 300000);
  for (std::size_t c = 0; c < cases; ++c) {
    const int W = 2 + static_cast<int>(g() % 7);
    const TensorGroup grp(random_sizes(g, max_total), W, granule_for(sizeof(float), {F::block, 128}));
    std::vector<std::vector<float>> full(static_cast<std::size_t>(W));
    std::vector<std::uint32_t> flags(static_cast<std::size_t>(W), 99);
    const std::vector<float> in = group_input<float>(grp, seed, 0);  // the same weights on every rank
    LocalGroup lg(W, std::vector<long long>(static_cast<std::size_t>(W), 0));
    lg.run([&](LocalTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      QuantizedAllGather<float, F, LocalTransport> ag(t, grp);
      Workspace ws(ag.workspace_bytes());
      full[r].assign(grp.padded_numel(), 1.0f);
      flags[r] = ag(in.data() + grp.layout().shard_offset(t.rank()), full[r].data(), ws.ptr, ws.bytes);
    });
    for (int r = 0; r < W; ++r) {
      CHECK(flags[static_cast<std::size_t>(r)] == 0u);
      CHECK(padding_is_zero(grp, full[static_cast<std::size_t>(r)]));
      CHECK(same_bits(full[static_cast<std::size_t>(r)], full[0]));
    }
    std::size_t bad = 0;
    for (std::size_t k = 0; k < grp.size(); ++k) {
      // Each tensor alone, as it lies in its shards: a shard boundary inside it starts a message
      // there, so quantize piece by piece (blocks align with the tensor's own either way).
      std::vector<float> alone(grp.numel(k));
      for (int r = 0; r < W; ++r) {
        const TensorGroup::Piece p = grp.piece(k, r);
        if (p.count > 0) roundtrip<F>(in.data() + p.offset, p.count, {}, alone.data() + p.tensor_offset);
      }
      if (grp.numel(k) > 0 &&
          std::memcmp(alone.data(), full[0].data() + grp.offset(k), grp.numel(k) * sizeof(float)) != 0)
        ++bad;
    }
    CHECK_MESSAGE(bad == 0, "tensors differing from their own round trip: " << bad << " of " << grp.size());
  }
}

}  // namespace

TEST_CASE("groups: all-gather of every tensor equals that tensor quantized alone") {
  gather_matches_tensor_alone<Int8<32>>(1);
  gather_matches_tensor_alone<Int4Asym<64>>(2);  // asymmetric: padding in a block would move its range
  gather_matches_tensor_alone<Fp8E4M3<128>>(3);
  gather_matches_tensor_alone<MxFp4>(4);
}

TEST_CASE("groups: one-hop reduce-scatter shards equal the per-piece sums") {
  using F = Int4Asym<32>;
  std::mt19937_64 g(11);
  for (std::size_t c = 0; c < env_size("QCOLL_GROUPS_CASES", 6); ++c) {
    const int W = 2 + static_cast<int>(g() % 5);
    const TensorGroup grp(random_sizes(g, env_size("QCOLL_GROUPS_MAX_NUMEL", 300000) / 2), W,
                          granule_for(sizeof(float), {F::block}));
    std::vector<std::vector<float>> in(static_cast<std::size_t>(W)), out(static_cast<std::size_t>(W));
    for (int r = 0; r < W; ++r) in[static_cast<std::size_t>(r)] = group_input<float>(grp, 100 + c, r);
    std::vector<std::uint32_t> flags(static_cast<std::size_t>(W), 99);
    LocalGroup lg(W, std::vector<long long>(static_cast<std::size_t>(W), 0));
    lg.run([&](LocalTransport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      const Topology topo = Topology::node_major(W, 1, t.rank());
      QuantizedReduceScatter<float, F, F, LocalTransport> rs(t, topo, grp, Reduce::sum, Hops::one);
      Workspace ws(rs.workspace_bytes());
      out[r].assign(grp.shard_numel(), 1.0f);
      flags[r] = rs(in[r].data(), out[r].data(), ws.ptr, ws.bytes);
    });
    std::size_t bad = 0;
    for (int r = 0; r < W; ++r) {
      const auto& shard = out[static_cast<std::size_t>(r)];
      CHECK(flags[static_cast<std::size_t>(r)] == 0u);
      std::vector<float> expect(grp.shard_numel(), 0.0f);
      grp.for_each_piece(r, [&](const TensorGroup::Piece& p) {
        std::vector<float> acc(p.count, 0.0f), d(p.count);
        for (int q = 0; q < W; ++q) {
          roundtrip<F>(in[static_cast<std::size_t>(q)].data() + p.offset, p.count, {}, d.data());
          for (std::size_t i = 0; i < p.count; ++i) acc[i] += d[i];
        }
        std::copy(acc.begin(), acc.end(),
                  expect.begin() + static_cast<std::ptrdiff_t>(p.offset - r * grp.shard_numel()));
      });
      if (!same_bits(expect, shard)) ++bad;
    }
    CHECK(bad == 0);
  }
}

namespace {

// Runs every plan over a group whose middle tensor is replaced (same size, other values) and
// checks that the first and last tensors keep their bits: AG, hpZ, RS one and two hops (with a
// rotation, feedback and stochastic rounding), AR, qWD. Inputs hold NaN in their padding.
struct PlanOutputs {
  std::vector<std::vector<float>> ag, hpz, rs1, rs2, ar, qwd;
};

PlanOutputs run_all_plans(const TensorGroup& grp, const std::vector<std::vector<float>>& in) {
  using F = Int4Asym<32>;
  using G = Int8<32>;
  const std::vector<long long> ids = {0, 1, 0, 1, 1, 0};  // 2 nodes of 3, not node-major
  const int W = static_cast<int>(ids.size());
  PlanOutputs o;
  for (auto* v : {&o.ag, &o.hpz, &o.rs1, &o.rs2, &o.ar, &o.qwd}) v->resize(static_cast<std::size_t>(W));
  LocalGroup lg(W, ids);
  lg.run([&](LocalTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    const Topology topo = Topology::from_node_ids(ids, t.rank());
    const ShardLayout& l = grp.layout();
    const float* mine = in[r].data();
    {
      QuantizedAllGather<float, F, LocalTransport> ag(t, grp);
      Workspace ws(ag.workspace_bytes());
      o.ag[r].assign(l.padded_numel(), 2.0f);
      REQUIRE(ag(in[0].data() + l.shard_offset(t.rank()), o.ag[r].data(), ws.ptr, ws.bytes) == 0u);
      SecondaryShard<float, G, LocalTransport> hpz(t, topo, grp);
      hpz.capture(in[0].data(), 1);
      Workspace ws2(hpz.workspace_bytes());
      o.hpz[r].assign(l.padded_numel(), 2.0f);
      REQUIRE(hpz.gather(o.hpz[r].data(), 1, ws2.ptr, ws2.bytes) == 0u);
    }
    ReduceScatterOptions ro;
    ro.hop1 = HopOptions{Rounding::stochastic, 5, Rotation{4, 9}};
    ro.hop2 = HopOptions{Rounding::nearest, 0, Rotation{3, 2}};
    // Two steps of a reduce-scatter with feedback (the residual carried into the second step).
    const auto reduce = [&](auto& rs, std::vector<float>& out) {
      Workspace ws(rs.workspace_bytes());
      Workspace res(rs.residual_bytes());
      rs.init_residual(res.ptr, res.bytes);
      out.assign(l.shard_numel(), 2.0f);
      for (int step = 0; step < 2; ++step)
        REQUIRE(rs(mine, out.data(), ws.ptr, ws.bytes, ResidualState{res.ptr, res.bytes}) == 0u);
    };
    {
      QuantizedReduceScatter<float, F, F, LocalTransport> rs(t, topo, grp, Reduce::mean, Hops::one, ro);
      reduce(rs, o.rs1[r]);
    }
    {
      QuantizedReduceScatter<float, F, G, LocalTransport> rs(t, topo, grp, Reduce::sum, Hops::two, ro);
      reduce(rs, o.rs2[r]);
    }
    {
      QuantizedAllReduce<float, F, G, F, LocalTransport> ar(t, topo, grp, Reduce::sum, Hops::two);
      Workspace ws(ar.workspace_bytes());
      o.ar[r].assign(l.padded_numel(), 2.0f);
      REQUIRE(ar(mine, o.ar[r].data(), ws.ptr, ws.bytes) == 0u);
    }
    {
      DeltaAllGather<float, F, LocalTransport> qwd(t, grp);
      Workspace ws(qwd.workspace_bytes());
      o.qwd[r].assign(l.padded_numel(), 0.0f);
      for (int step = 0; step < 2; ++step)
        REQUIRE(qwd(in[static_cast<std::size_t>(step)].data() + l.shard_offset(t.rank()), o.qwd[r].data(),
                    ws.ptr, ws.bytes) == 0u);
    }
  });
  return o;
}

}  // namespace

TEST_CASE("groups: a tensor's result does not depend on its neighbours, in every plan") {
  const int W = 6;
  // Tensor 1 (the neighbour) changes; tensors 0 and 2 share blocks' granules with it in a flat
  // buffer, but not in the group. Sizes make tensors span shards and end mid-block.
  const std::vector<std::size_t> sizes = {1000, 333, 1701};
  const TensorGroup grp(sizes, W, granule_for(sizeof(float), {32, 16}));
  std::vector<std::vector<float>> a(W), b(W);
  for (int r = 0; r < W; ++r) {
    a[static_cast<std::size_t>(r)] = group_input<float>(grp, 21, r);
    b[static_cast<std::size_t>(r)] = a[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < sizes[1]; ++i)  // a neighbour with 1000x the magnitude
      b[static_cast<std::size_t>(r)][grp.offset(1) + i] = 1000.0f * input_value(77, r, i);
  }
  const PlanOutputs oa = run_all_plans(grp, a), ob = run_all_plans(grp, b);
  // Compares tensors 0 and 2 of full buffers, or the parts of them in each rank's shard.
  const auto same_outside = [&](const std::vector<std::vector<float>>& x,
                                const std::vector<std::vector<float>>& y, bool sharded) {
    for (int r = 0; r < W; ++r)
      for (std::size_t k : {std::size_t{0}, std::size_t{2}}) {
        const TensorGroup::Piece p =
            sharded ? grp.piece(k, r) : TensorGroup::Piece{k, 0, grp.offset(k), sizes[k]};
        const std::size_t base = sharded ? grp.layout().shard_offset(r) : 0;
        const auto& u = x[static_cast<std::size_t>(r)];
        const auto& v = y[static_cast<std::size_t>(r)];
        if (p.count > 0 && std::memcmp(u.data() + (p.offset - base), v.data() + (p.offset - base),
                                       p.count * sizeof(float)) != 0)
          return false;
      }
    return true;
  };
  CHECK(same_outside(oa.ag, ob.ag, false));
  CHECK(same_outside(oa.hpz, ob.hpz, false));
  CHECK(same_outside(oa.rs1, ob.rs1, true));
  CHECK(same_outside(oa.rs2, ob.rs2, true));
  CHECK(same_outside(oa.ar, ob.ar, false));
  CHECK(same_outside(oa.qwd, ob.qwd, false));
  // The neighbour did change, padding stayed zero, replicas agree.
  CHECK(!same_bits(oa.ag[0], ob.ag[0]));
  for (int r = 0; r < W; ++r) {
    for (const auto* v : {&oa.ag, &oa.hpz, &oa.ar, &oa.qwd, &ob.ag, &ob.ar})
      CHECK(padding_is_zero(grp, (*v)[static_cast<std::size_t>(r)]));
    CHECK(same_bits(oa.ar[static_cast<std::size_t>(r)], oa.ar[0]));
    CHECK(same_bits(oa.qwd[static_cast<std::size_t>(r)], oa.qwd[0]));
  }
  // In a flat buffer the same data would share blocks across tensors: the comparison above
  // would fail there (a check that the test can tell).
  const TensorGroup flat({grp.offset(2) + sizes[2]}, W, granule_for(sizeof(float), {32, 16}));
  std::vector<float> fa(flat.padded_numel(), 0.0f), fb(flat.padded_numel(), 0.0f);
  for (std::size_t i = 0; i < sizes[0] + sizes[1]; ++i) {  // packed without padding
    fa[i] = i < sizes[0] ? a[0][i] : a[0][grp.offset(1) + i - sizes[0]];
    fb[i] = i < sizes[0] ? b[0][i] : b[0][grp.offset(1) + i - sizes[0]];
  }
  roundtrip<Int4Asym<32>>(fa.data(), sizes[0] + sizes[1], {}, fa.data());
  roundtrip<Int4Asym<32>>(fb.data(), sizes[0] + sizes[1], {}, fb.data());
  CHECK(std::memcmp(fa.data(), fb.data(), sizes[0] * sizeof(float)) != 0);
}

TEST_CASE("groups: ranks with different groups are rejected on every rank") {
  const std::vector<long long> ids = {0, 0, 1, 1};
  const auto msgs = errors_of(4, ids, [](LocalTransport& t) {
    // Same padded size and shards; rank 2 splits the buffer differently.
    const TensorGroup grp(
        t.rank() == 2 ? std::vector<std::size_t>{100, 60} : std::vector<std::size_t>{60, 100}, 4, 32);
    QuantizedAllGather<float, Int8<32>, LocalTransport> ag(t, grp);
  });
  for (const std::string& m : msgs) {
    CHECK(has(m, "ranks disagree"));
    CHECK(has(m, "tensor group"));
    CHECK(has(m, "(rank 2)"));
  }
}
