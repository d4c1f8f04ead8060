// The ZeRO++ primitives over the in-process transport: bit-exact against the straightforward
// re-computation, within the formats' bounds of the fp64 reference, deterministic, the ZeRO++
// communication table from the byte counters, non-finite inputs, and bad arguments.
#include <doctest/doctest.h>

#include <mutex>
#include <string>

#include <qcoll/transport/local.hpp>

#include "../common/collective_harness.hpp"

using namespace qcoll;
using namespace harness;

namespace {

struct Shape {
  int world, per_node;
  bool round_robin;
};

const Shape kShapes[] = {{1, 1, false}, {2, 1, false}, {2, 2, false}, {3, 1, false},
                         {4, 2, false}, {4, 2, true},  {6, 3, true},  {6, 2, false},
                         {8, 4, false}, {8, 4, true},  {8, 2, true},  {16, 4, true}};
const std::size_t kNumels[] = {0, 1, 97, 1000, 4099};

std::vector<long long> node_ids(const Shape& s) {
  std::vector<long long> ids(static_cast<std::size_t>(s.world));
  const int nodes = s.world / s.per_node;
  for (int r = 0; r < s.world; ++r) ids[r] = 1000 + (s.round_robin ? r % nodes : r / s.per_node);
  return ids;
}

// qmax of a symmetric integer format (its bound is derived below), 0 for the others (exactness only).
template <class F>
constexpr int qmax_of() {
  if constexpr (F::id == FormatId::int8 || F::id == FormatId::int4) return F::qmax;
  return 0;
}

template <class T, class F>
void check_all_gather(const Shape& sh, std::size_t numel, Rounding rounding) {
  const ShardLayout layout(numel, sh.world, granule_for(sizeof(T), {F::block}));
  host::QuantizeOptions opt;
  opt.rounding = rounding;
  opt.seed = 42;
  std::vector<std::vector<T>> shards(sh.world);
  const auto x = make_input<T>(7, 0, layout.padded_numel(), numel);  // the weights; padding holds garbage
  for (int r = 0; r < sh.world; ++r)
    shards[r].assign(x.begin() + layout.shard_offset(r),
                     x.begin() + layout.shard_offset(r) + layout.shard_numel());
  std::vector<std::vector<T>> out(sh.world);
  std::vector<std::uint32_t> flags(sh.world);
  LocalGroup g(sh.world, node_ids(sh));
  g.run([&](LocalTransport& t) {
    QuantizedAllGather<T, F, LocalTransport> ag(t, layout, opt);
    Workspace ws(ag.workspace_bytes());
    out[t.rank()].assign(layout.padded_numel(), from_float<T>(-1.0f));
    flags[t.rank()] = ag(shards[t.rank()].data(), out[t.rank()].data(), ws.ptr, ws.bytes);
  });
  const auto want = reference_all_gather<T, F>(shards, layout, opt);
  for (int r = 0; r < sh.world; ++r) {
    CHECK(flags[r] == 0u);
    REQUIRE(same_bits(out[r], want));
  }
  // Against the unquantized weights: half a step of the block (absmax/(2 qmax)) plus T's rounding.
  if constexpr (qmax_of<F>() == 0) return;
  double A = 0;
  for (std::size_t i = 0; i < numel; ++i) A = std::max(A, double(std::fabs(to_float(x[i]))));
  const double step = rounding == Rounding::nearest ? 0.5 : 1.0;
  for (std::size_t i = 0; i < numel; ++i) {
    const double err = std::fabs(double(to_float(out[0][i])) - to_float(x[i]));
    REQUIRE(err <=
            step * A / qmax_of<F>() + (A + A / qmax_of<F>()) * std::ldexp(1.0, -significand_bits<T>() + 1));
  }
  for (std::size_t i = numel; i < layout.padded_numel(); ++i) REQUIRE(to_float(out[0][i]) == 0.0f);
}

template <class T, class F1, class F2>
void check_reduce_scatter(const Shape& sh, std::size_t numel, Reduce op, Hops hops, Rounding rounding) {
  const ShardLayout layout(numel, sh.world, granule_for(sizeof(T), {F1::block, F2::block}));
  host::QuantizeOptions opt;
  opt.rounding = rounding;
  opt.seed = 3;
  auto grads = make_inputs<T>(11, sh.world, layout.padded_numel(), numel);
  std::vector<std::vector<T>> out(sh.world);
  std::vector<std::uint32_t> flags(sh.world);
  const auto ids = node_ids(sh);
  LocalGroup g(sh.world, ids);
  g.run([&](LocalTransport& t) {
    const Topology topo = Topology::from_node_ids(ids, t.rank());
    QuantizedReduceScatter<T, F1, F2, LocalTransport> rs(t, topo, layout, op, hops, opt);
    Workspace ws(rs.workspace_bytes());
    out[t.rank()].assign(layout.shard_numel(), from_float<T>(-1.0f));
    flags[t.rank()] = rs(grads[t.rank()].data(), out[t.rank()].data(), ws.ptr, ws.bytes);
  });
  const Topology topo = Topology::from_node_ids(ids, 0);
  const auto want = reference_reduce_scatter<T, F1, F2>(grads, topo, layout, op, hops, opt);
  double A = 0;
  for (const auto& gr : grads)
    for (std::size_t i = 0; i < numel; ++i) A = std::max(A, double(std::fabs(to_float(gr[i]))));
  const double step = rounding == Rounding::nearest ? 1.0 : 2.0;  // stochastic: a full step
  for (int r = 0; r < sh.world; ++r) {
    CHECK(flags[r] == 0u);
    REQUIRE(same_bits(out[r], want[r]));
    if constexpr (qmax_of<F1>() == 0 || qmax_of<F2>() == 0) continue;
    const auto exact = exact_reduce(grads, layout, r, op);
    for (std::size_t e = 0; e < exact.size(); ++e) {
      const double got = to_float(out[r][e]);
      const double bound =
          step * rs_bound(A, sh.world, topo.num_nodes(), topo.ranks_per_node(), qmax_of<F1>(), qmax_of<F2>(),
                          hops, op, exact[e], significand_bits<T>());
      REQUIRE(std::fabs(got - exact[e]) <= bound);
    }
    for (std::size_t e = exact.size(); e < layout.shard_numel(); ++e) REQUIRE(to_float(out[r][e]) == 0.0f);
  }
}

}  // namespace

TEST_CASE("all-gather: exact against re-computation, within the format's bound, padding zero") {
  for (const Shape& sh : kShapes)
    for (std::size_t n : kNumels) {
      CAPTURE(sh.world);
      CAPTURE(n);
      check_all_gather<float, Int8<32>>(sh, n, Rounding::nearest);
      check_all_gather<bfloat16, Int8<64>>(sh, n, Rounding::stochastic);
      check_all_gather<half, Int4<32>>(sh, n, Rounding::nearest);
    }
}

TEST_CASE("reduce-scatter, one and two hops: exact against re-computation, within the bound") {
  for (const Shape& sh : kShapes)
    for (std::size_t n : kNumels) {
      CAPTURE(sh.world);
      CAPTURE(sh.per_node);
      CAPTURE(sh.round_robin);
      CAPTURE(n);
      check_reduce_scatter<float, Int4<32>, Int4<32>>(sh, n, Reduce::mean, Hops::two, Rounding::nearest);
      check_reduce_scatter<bfloat16, Int8<32>, Int4<64>>(sh, n, Reduce::sum, Hops::two, Rounding::stochastic);
      check_reduce_scatter<half, Int4<32>, Int4<32>>(sh, n, Reduce::mean, Hops::one, Rounding::nearest);
      check_reduce_scatter<float, Int8<64>, Int8<64>>(sh, n, Reduce::sum, Hops::one, Rounding::stochastic);
    }
}

TEST_CASE("other formats run through the same plans bit-exactly") {
  for (const Shape& sh : {Shape{8, 4, true}, Shape{4, 2, false}})
    for (std::size_t n : {std::size_t(0), std::size_t(33), std::size_t(5000)}) {
      check_all_gather<bfloat16, Fp8E4M3<32>>(sh, n, Rounding::nearest);
      check_all_gather<float, MxFp4>(sh, n, Rounding::stochastic);
      check_all_gather<bfloat16, NvFp4>(sh, n, Rounding::nearest);
      check_all_gather<half, Int8Asym<32>>(sh, n, Rounding::nearest);
      check_all_gather<bfloat16, Identity<bfloat16>>(sh, n, Rounding::nearest);
      check_reduce_scatter<float, Fp8E5M2<32>, MxFp8E4M3>(sh, n, Reduce::mean, Hops::two, Rounding::nearest);
      check_reduce_scatter<bfloat16, NvFp4, NvFp4>(sh, n, Reduce::sum, Hops::two, Rounding::nearest);
      check_reduce_scatter<bfloat16, Identity<float>, Identity<float>>(sh, n, Reduce::sum, Hops::one,
                                                                       Rounding::nearest);
    }
}

TEST_CASE("the plain path is exact: identity all-gather moves the bits as they are") {
  const Shape sh{8, 4, true};
  const std::size_t numel = 3001;
  const ShardLayout layout(numel, sh.world, granule_for(2, {32}));
  const auto x = make_input<bfloat16>(5, 0, layout.padded_numel(), numel);
  std::vector<std::vector<bfloat16>> out(sh.world);
  LocalGroup g(sh.world, node_ids(sh));
  g.run([&](LocalTransport& t) {
    QuantizedAllGather<bfloat16, Identity<bfloat16>, LocalTransport> ag(t, layout);
    Workspace ws(ag.workspace_bytes());
    out[t.rank()].resize(layout.padded_numel());
    ag(x.data() + layout.shard_offset(t.rank()), out[t.rank()].data(), ws.ptr, ws.bytes);
  });
  for (std::size_t i = 0; i < numel; ++i) REQUIRE(out[5][i].bits == x[i].bits);
}

TEST_CASE("deterministic: 20 repetitions give the same bits") {
  const Shape sh{8, 4, true};
  const std::size_t numel = 2000;
  const ShardLayout layout(numel, sh.world, granule_for(4, {32}));
  const auto ids = node_ids(sh);
  auto grads = make_inputs<float>(21, sh.world, layout.padded_numel(), numel);
  std::vector<std::vector<float>> first(sh.world);
  bool all_same = true;
  std::mutex mu;
  host::QuantizeOptions opt;
  opt.rounding = Rounding::stochastic;
  opt.seed = 8;
  LocalGroup g(sh.world, ids);
  g.run([&](LocalTransport& t) {
    const Topology topo = Topology::from_node_ids(ids, t.rank());
    QuantizedAllReduce<float, Int4<32>, Int4<32>, Int8<32>, LocalTransport> ar(t, topo, layout, Reduce::mean,
                                                                               Hops::two, opt);
    Workspace ws(ar.workspace_bytes());
    std::vector<float> out(layout.padded_numel());
    for (int rep = 0; rep < 20; ++rep) {
      ar(grads[t.rank()].data(), out.data(), ws.ptr, ws.bytes);
      std::lock_guard<std::mutex> lock(mu);
      if (rep == 0)
        first[t.rank()] = out;
      else
        all_same = all_same && same_bits(first[t.rank()], out);
    }
  });
  CHECK(all_same);
  for (int r = 1; r < sh.world; ++r) CHECK(same_bits(first[0], first[r]));  // all replicas agree
}

TEST_CASE("hpZ: the backward gather rebuilds the forward result inside the node, stale copies refused") {
  for (const Shape& sh : {Shape{8, 4, true}, Shape{8, 4, false}, Shape{6, 3, true}, Shape{4, 1, false}}) {
    const std::size_t numel = 4099;
    const ShardLayout layout(numel, sh.world, granule_for(2, {256}));
    const auto ids = node_ids(sh);
    const auto x = make_input<bfloat16>(9, 0, layout.padded_numel(), numel);
    std::vector<std::vector<bfloat16>> fwd(sh.world), bwd(sh.world);
    std::vector<std::uint64_t> inter(sh.world), intra(sh.world);
    std::vector<std::string> stale(sh.world);
    LocalGroup g(sh.world, ids);
    g.run([&](LocalTransport& t) {
      const Topology topo = Topology::from_node_ids(ids, t.rank());
      QuantizedAllGather<bfloat16, Int8<256>, LocalTransport> qwz(t, layout);
      SecondaryShard<bfloat16, Identity<bfloat16>, LocalTransport> hpz(t, topo, layout);
      Workspace ws(std::max(qwz.workspace_bytes(), hpz.workspace_bytes()));
      auto& f = fwd[t.rank()];
      f.resize(layout.padded_numel());
      qwz(x.data() + layout.shard_offset(t.rank()), f.data(), ws.ptr, ws.bytes);
      hpz.capture(f.data(), 1);
      auto& b = bwd[t.rank()];
      b.assign(layout.padded_numel(), from_float<bfloat16>(5.0f));
      hpz.gather(b.data(), 1, ws.ptr, ws.bytes);
      inter[t.rank()] = hpz.intra_node().counters().inter_node;
      intra[t.rank()] = hpz.intra_node().counters().intra_node;
      try {
        hpz.gather(b.data(), 2, ws.ptr, ws.bytes);  // weights changed, secondary not re-captured
      } catch (const Error& e) {
        stale[t.rank()] = e.what();
      }
    });
    for (int r = 0; r < sh.world; ++r) {
      CHECK(same_bits(fwd[r], bwd[r]));
      CHECK(inter[r] == 0u);
      CHECK(intra[r] ==
            (sh.per_node - 1) * packed_bytes<Identity<bfloat16>>(layout.padded_numel() / sh.per_node));
      CHECK(stale[r].find("'generation' = 2") != std::string::npos);
      CHECK(stale[r].find("stale") != std::string::npos);
    }
  }
}

TEST_CASE("the ZeRO++ communication table from the byte counters (2 nodes x 4, bf16)") {
  // A bf16 model of numel elements, M = 2 * padded_numel bytes. Per rank and step:
  // plain ZeRO-3: forward all-gather + backward all-gather + reduce-scatter, each (W-1)/W * M.
  // ZeRO++: qwZ int8 forward gather (M/2 plus scales), hpZ backward gather (0 across nodes),
  // qgZ int4 two-hop reduce-scatter (across nodes: (N-1) slices of int4 = M/4 of a 1/L share).
  const int W = 8, L = 4, N = 2;
  const std::size_t numel = 1 << 20;
  const ShardLayout layout(numel, W, granule_for(2, {2048}));
  const double M = 2.0 * layout.padded_numel();
  std::vector<long long> ids(W);
  for (int r = 0; r < W; ++r) ids[r] = r % N;  // not node-major
  struct Row {
    std::uint64_t fwd_total, bwd_inter, bwd_total, rs_inter, rs_total;
  };
  std::vector<Row> plain(W), zpp(W);
  LocalGroup g(W, ids);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    const Topology topo = Topology::from_node_ids(ids, r);
    std::vector<bfloat16> w(layout.padded_numel()),
        grad = make_input<bfloat16>(2, r, layout.padded_numel(), numel);
    std::vector<bfloat16> gshard(layout.shard_numel());
    const auto shard = make_input<bfloat16>(4, r, layout.shard_numel(), layout.shard_numel());
    {
      QuantizedAllGather<bfloat16, Identity<bfloat16, 2048>, LocalTransport> ag(t, layout);
      QuantizedReduceScatter<bfloat16, Identity<bfloat16, 2048>, Identity<bfloat16, 2048>, LocalTransport> rs(
          t, topo, layout, Reduce::mean, Hops::one);
      Workspace ws(std::max(ag.workspace_bytes(), rs.workspace_bytes()));
      t.reset_counters();
      ag(shard.data(), w.data(), ws.ptr, ws.bytes);
      plain[r].fwd_total = t.counters().total();
      ag(shard.data(), w.data(), ws.ptr, ws.bytes);
      plain[r].bwd_total = t.counters().total() - plain[r].fwd_total;
      plain[r].bwd_inter = 0;
      const auto before = t.counters().total();
      rs(grad.data(), gshard.data(), ws.ptr, ws.bytes);
      plain[r].rs_total = t.counters().total() - before;
      plain[r].rs_inter = 0;
    }
    {
      QuantizedAllGather<bfloat16, Int8<2048>, LocalTransport> qwz(t, layout);
      SecondaryShard<bfloat16, Identity<bfloat16, 2048>, LocalTransport> hpz(t, topo, layout);
      QuantizedReduceScatter<bfloat16, Int4<2048>, Int4<2048>, LocalTransport> qgz(t, topo, layout,
                                                                                   Reduce::mean);
      Workspace ws(std::max({qwz.workspace_bytes(), hpz.workspace_bytes(), qgz.workspace_bytes()}));
      t.reset_counters();
      qwz(shard.data(), w.data(), ws.ptr, ws.bytes);
      zpp[r].fwd_total = t.counters().total();
      hpz.capture(w.data(), 7);
      hpz.gather(w.data(), 7, ws.ptr, ws.bytes);
      zpp[r].bwd_inter = hpz.intra_node().counters().inter_node;
      zpp[r].bwd_total = hpz.intra_node().counters().total();
      qgz(grad.data(), gshard.data(), ws.ptr, ws.bytes);
      zpp[r].rs_inter = qgz.inter_node().counters().inter_node + qgz.intra_node().counters().inter_node;
      zpp[r].rs_total = qgz.inter_node().counters().total() + qgz.intra_node().counters().total();
    }
  });
  const std::size_t S = layout.shard_numel();
  const std::size_t blocks = S / 2048;
  for (int r = 0; r < W; ++r) {
    // Plain: 3 * (W-1)/W * M (+ one header per message).
    const std::size_t H = sizeof(MessageHeader);
    CHECK(plain[r].fwd_total == (W - 1) * (2 * S + H));
    CHECK(plain[r].bwd_total == (W - 1) * (2 * S + H));
    CHECK(plain[r].rs_total == (W - 1) * (2 * S + H));
    // qwZ: int8 codes (M/2 of a bf16 model) plus one fp32 scale per 2048-element block.
    CHECK(zpp[r].fwd_total == (W - 1) * (H + S + align16(4 * blocks)));
    // hpZ: nothing leaves the node.
    CHECK(zpp[r].bwd_inter == 0u);
    CHECK(zpp[r].bwd_total == (L - 1) * (H + 2 * N * S));
    // qgZ across nodes: (N-1) int4 slices (S/2 bytes) plus scales.
    CHECK(zpp[r].rs_inter == (N - 1) * (H + S / 2 + align16(4 * blocks)));
  }
  // The table, as fractions of M per rank (W-1)/W -> 1 for large W; here exact for W = 8.
  const double f = double(W - 1) / W;
  CHECK(plain[0].fwd_total / M == doctest::Approx(f).epsilon(1e-3));
  CHECK(zpp[0].fwd_total / M == doctest::Approx(0.5 * f).epsilon(0.01));  // 0.5M (+ scales)
  CHECK(zpp[0].rs_inter / M ==
        doctest::Approx(0.25 * (N - 1) / double(W)).epsilon(0.01));  // int4 of a 1/W share per peer node
  const double plain_total = double(plain[0].fwd_total + plain[0].bwd_total + plain[0].rs_total);
  CHECK(plain_total / M == doctest::Approx(3 * f).epsilon(1e-3));  // 3M for the plain path
  MESSAGE("per rank, fractions of M: plain fwd "
          << plain[0].fwd_total / M << " bwd " << plain[0].bwd_total / M << " rs " << plain[0].rs_total / M
          << "; ZeRO++ fwd " << zpp[0].fwd_total / M << " bwd across nodes " << zpp[0].bwd_inter / M
          << " rs across nodes " << zpp[0].rs_inter / M);
}

TEST_CASE("a NaN or Inf on one rank: NaN where it lands, same flag everywhere, no hang, next call works") {
  const Shape sh{8, 4, true};
  const std::size_t numel = 3000;
  const ShardLayout layout(numel, sh.world, granule_for(4, {32}));
  const auto ids = node_ids(sh);
  auto grads = make_inputs<float>(13, sh.world, layout.padded_numel(), numel);
  const std::size_t poisoned = layout.shard_offset(5) + 40;  // lands in rank 5's shard
  grads[2][poisoned] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::uint32_t> f1(sh.world), f2(sh.world), fag(sh.world);
  std::vector<std::vector<float>> o1(sh.world), o2(sh.world), full(sh.world);
  LocalGroup g(sh.world, ids);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    const Topology topo = Topology::from_node_ids(ids, r);
    QuantizedReduceScatter<float, Int4<32>, Int4<32>, LocalTransport> rs(t, topo, layout, Reduce::mean);
    QuantizedAllGather<float, Int8<32>, LocalTransport> ag(t, layout);
    Workspace ws(std::max(rs.workspace_bytes(), ag.workspace_bytes()));
    o1[r].resize(layout.shard_numel());
    f1[r] = rs(grads[r].data(), o1[r].data(), ws.ptr, ws.bytes);
    full[r].resize(layout.padded_numel());
    fag[r] = ag(o1[r].data(), full[r].data(), ws.ptr, ws.bytes);
    auto clean = grads[r];
    clean[poisoned] = 0.0f;
    o2[r].resize(layout.shard_numel());
    f2[r] = rs(clean.data(), o2[r].data(), ws.ptr, ws.bytes);
  });
  for (int r = 0; r < sh.world; ++r) {
    CHECK(f1[r] == kResultNonFinite);
    CHECK(fag[r] == kResultNonFinite);
    CHECK(f2[r] == 0u);
    CHECK(std::isnan(full[r][poisoned]));
    for (std::size_t e = 0; e < layout.valid_in_shard(r); ++e) {
      REQUIRE(!std::isnan(o2[r][e]));
      if (r != 5) REQUIRE(!std::isnan(o1[r][e]));
    }
  }
  CHECK(std::isnan(o1[5][40]));
}

TEST_CASE("bad arguments are rejected on every rank before anything is sent") {
  const Shape sh{4, 2, true};
  const auto ids = node_ids(sh);
  const ShardLayout layout(1000, sh.world, granule_for(4, {32}));
  using RS = QuantizedReduceScatter<float, Int4<32>, Int4<32>, LocalTransport>;

  SUBCASE("one rank passes a null shard: it names the argument, the others name the rank; nothing sent") {
    std::vector<std::uint64_t> sent(sh.world);
    std::vector<float> untouched(sh.world);
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      QuantizedAllGather<float, Int8<32>, LocalTransport> ag(t, layout);
      Workspace ws(ag.workspace_bytes());
      std::vector<float> shard(layout.shard_numel(), 1.0f), full(layout.padded_numel(), 7.0f);
      t.reset_counters();
      try {
        ag(t.rank() == 2 ? nullptr : shard.data(), full.data(), ws.ptr, ws.bytes);
      } catch (...) {
        sent[t.rank()] = t.counters().total();
        untouched[t.rank()] = full[0];
        throw;
      }
    });
    CHECK(has(msg[2], "'shard' = null"));
    for (int r : {0, 1, 3}) CHECK(has(msg[r], "rank 2 rejected its arguments"));
    for (int r = 0; r < sh.world; ++r) {
      CHECK(sent[r] == 0u);
      CHECK(untouched[r] == 7.0f);
    }
  }
  SUBCASE("too small and misaligned workspace") {
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      const Topology topo = Topology::from_node_ids(ids, t.rank());
      RS rs(t, topo, layout, Reduce::sum);
      Workspace ws(rs.workspace_bytes() + 64);
      std::vector<float> g(layout.padded_numel()), s(layout.shard_numel());
      if (t.rank() == 0)
        rs(g.data(), s.data(), ws.ptr, rs.workspace_bytes() - 1);
      else if (t.rank() == 1)
        rs(g.data(), s.data(), static_cast<char*>(ws.ptr) + 8, rs.workspace_bytes());
      else
        rs(g.data(), s.data(), ws.ptr, rs.workspace_bytes());
    });
    CHECK(has(msg[0], "'workspace_bytes'"));
    CHECK(has(msg[0], "is below the required"));
    CHECK(has(msg[1], "not aligned to 64"));
    CHECK(has(msg[2], "rank 0 rejected"));
  }
  SUBCASE("ranks that disagree on the size or format are told so on all ranks") {
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      const ShardLayout mine(t.rank() == 3 ? 1001 : 1000, sh.world, granule_for(4, {32}));
      QuantizedAllGather<float, Int8<32>, LocalTransport> ag(t, mine);
    });
    for (int r = 0; r < sh.world; ++r) {
      CHECK(has(msg[r], "ranks disagree on the call"));
      CHECK(has(msg[r], "numel: 1000 (ranks 0,1,2) vs 1001 (rank 3)"));
    }
  }
  SUBCASE("topology that does not match the transport, unequal nodes, blocks that do not fit") {
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      const Topology topo = Topology::node_major(8, 2, t.rank());
      RS rs(t, topo, layout, Reduce::sum);
    });
    for (int r = 0; r < sh.world; ++r) CHECK(has(msg[r], "'topo'"));
    CHECK_THROWS_WITH_AS(Topology::from_node_ids({1, 1, 2}, 0), doctest::Contains("same number"), Error);
    auto msg2 = errors_of(sh.world, ids, [&](LocalTransport& t) {
      const ShardLayout fine(100, sh.world, 16);  // shards of 32 elements
      QuantizedAllGather<float, Int8<256>, LocalTransport> ag(t, fine);
    });
    for (int r = 0; r < sh.world; ++r) CHECK(has(msg2[r], "'layout.granule()' = 16"));
  }
  SUBCASE("overlapping reduce-scatter buffers") {
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      const Topology topo = Topology::from_node_ids(ids, t.rank());
      RS rs(t, topo, layout, Reduce::sum);
      Workspace ws(rs.workspace_bytes());
      std::vector<float> g(layout.padded_numel());
      rs(g.data(), g.data() + 8, ws.ptr, ws.bytes);
    });
    CHECK(has(msg[0], "'shard'"));
    CHECK(has(msg[0], "overlaps"));
  }
}

TEST_CASE("ranks that disagree on what they call are told so on every rank, before anything moves") {
  const Shape sh{4, 2, false};
  const auto ids = node_ids(sh);
  using AG = QuantizedAllGather<float, Int8<32>, LocalTransport>;
  using RS = QuantizedReduceScatter<float, Int4<32>, Int4<32>, LocalTransport>;
  // The same data on every rank: the plans' messages pack to the same sizes, so only the call's
  // identity can tell the calls apart.
  const ShardLayout a(1000, sh.world, granule_for(4, {32})), b(999, sh.world, granule_for(4, {32}));
  REQUIRE(a.shard_numel() == b.shard_numel());

  SUBCASE("a different plan of the same message size (numel 1000 vs 999)") {
    std::vector<std::uint64_t> sent(sh.world, 1);
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      AG pa(t, a), pb(t, b);
      REQUIRE(pa.message_bytes() == pb.message_bytes());
      Workspace ws(pa.workspace_bytes());
      std::vector<float> shard(a.shard_numel(), 1.0f), full(a.padded_numel());
      t.reset_counters();
      struct Sent {
        LocalTransport& t;
        std::uint64_t& out;
        ~Sent() { out = t.counters().total(); }
      } s{t, sent[t.rank()]};
      (t.rank() == 1 ? pb : pa)(shard.data(), full.data(), ws.ptr, ws.bytes);
    });
    for (int r = 0; r < sh.world; ++r) {
      CHECK(has(msg[r], "ranks disagree on the call"));
      CHECK(has(msg[r], "numel: 1000 (ranks 0,2,3) vs 999 (rank 1)"));
      CHECK(sent[r] == 0u);
    }
  }
  SUBCASE("a different format of the same message size (int8 vs fp8 e4m3, block 32)") {
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      AG pa(t, a);
      QuantizedAllGather<float, Fp8E4M3<32>, LocalTransport> pf(t, a);
      REQUIRE(pa.message_bytes() == pf.message_bytes());
      Workspace ws(pa.workspace_bytes());
      std::vector<float> shard(a.shard_numel(), 1.0f), full(a.padded_numel());
      if (t.rank() == 3)
        pf(shard.data(), full.data(), ws.ptr, ws.bytes);
      else
        pa(shard.data(), full.data(), ws.ptr, ws.bytes);
    });
    for (int r = 0; r < sh.world; ++r) CHECK(has(msg[r], "format: int8 (ranks 0,1,2) vs e4m3 (rank 3)"));
  }
  SUBCASE("a different collective on one rank (reduce-scatter vs all-gather): an error, not a hang") {
    for (Hops hops : {Hops::one, Hops::two}) {
      auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
        const Topology topo = Topology::from_node_ids(ids, t.rank());
        AG ag(t, a);
        RS rs(t, topo, a, Reduce::sum, hops);
        Workspace ws(std::max(ag.workspace_bytes(), rs.workspace_bytes()));
        std::vector<float> grad(a.padded_numel(), 1.0f), full(a.padded_numel()), shard(a.shard_numel());
        if (t.rank() == 2)
          rs(grad.data(), shard.data(), ws.ptr, ws.bytes);
        else
          ag(shard.data(), full.data(), ws.ptr, ws.bytes);
      });
      for (int r = 0; r < sh.world; ++r)
        CHECK(has(msg[r], "kind: all-gather (ranks 0,1,3) vs reduce-scatter (rank 2)"));
    }
  }
  SUBCASE("the same plan called once more on one rank: the call numbers differ") {
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      AG p1(t, a), p2(t, a);  // identical plans
      Workspace ws(p1.workspace_bytes());
      std::vector<float> shard(a.shard_numel(), 1.0f), full(a.padded_numel());
      p1(shard.data(), full.data(), ws.ptr, ws.bytes);
      (t.rank() == 0 ? p2 : p1)(shard.data(), full.data(), ws.ptr, ws.bytes);
    });
    for (int r = 0; r < sh.world; ++r) CHECK(has(msg[r], "call number: 1 (rank 0) vs 2 (ranks 1,2,3)"));
  }
  SUBCASE("valid but different node tables: every rank is told at construction, for qgZ and hpZ") {
    for (int plan = 0; plan < 2; ++plan) {
      auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
        const Topology topo = t.rank() == 1 ? Topology::round_robin(sh.world, 2, t.rank())
                                            : Topology::node_major(sh.world, 2, t.rank());
        if (plan == 0) {
          RS rs(t, topo, a, Reduce::sum);
        } else {
          SecondaryShard<float, Identity<float, 32>, LocalTransport> hpz(t, topo, a);
        }
      });
      for (int r = 0; r < sh.world; ++r) {
        CHECK(has(msg[r], "ranks disagree on the call (node table: #"));
        CHECK(has(msg[r], "(ranks 0,2,3) vs #"));
      }
    }
  }
  SUBCASE("hpZ: a NaN in one node's copy flags that node's gather only (what its ranks receive)") {
    std::vector<std::uint32_t> flags(sh.world);
    LocalGroup g(sh.world, ids);
    g.run([&](LocalTransport& t) {
      const Topology topo = Topology::from_node_ids(ids, t.rank());
      SecondaryShard<float, Identity<float, 32>, LocalTransport> hpz(t, topo, a);
      Workspace ws(hpz.workspace_bytes());
      std::vector<float> full(a.padded_numel(), 2.0f);
      if (topo.node() == 1) full[5] = std::nanf("");  // node 1's forward result held a NaN
      hpz.capture(full.data(), 1);
      flags[t.rank()] = hpz.gather(full.data(), 1, ws.ptr, ws.bytes);
    });
    for (int r = 0; r < sh.world; ++r)
      CHECK(flags[r] == (Topology::from_node_ids(ids, r).node() == 1 ? kResultNonFinite : 0u));
  }
  SUBCASE("hpZ: a stale generation on one rank raises on every rank of every node") {
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      const Topology topo = Topology::from_node_ids(ids, t.rank());
      SecondaryShard<float, Identity<float, 32>, LocalTransport> hpz(t, topo, a);
      Workspace ws(hpz.workspace_bytes());
      std::vector<float> full(a.padded_numel(), 2.0f);
      hpz.capture(full.data(), 5);
      hpz.gather(full.data(), t.rank() == 3 ? 4 : 5, ws.ptr, ws.bytes);
    });
    CHECK(has(msg[3], "'generation' = 4"));
    for (int r : {0, 1, 2}) CHECK(has(msg[r], "rank 3 rejected its arguments"));
  }
}

TEST_CASE("buffers inside the workspace and misaligned buffers are rejected on every rank") {
  const Shape sh{4, 2, true};
  const auto ids = node_ids(sh);
  const ShardLayout layout(1000, sh.world, granule_for(4, {32}));
  using AG = QuantizedAllGather<float, Int8<32>, LocalTransport>;
  using RS = QuantizedReduceScatter<float, Int4<32>, Int4<32>, LocalTransport>;
  SUBCASE("an output inside the workspace, an input at its start") {
    for (int which = 0; which < 2; ++which) {
      std::vector<float> untouched(sh.world);
      auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
        AG ag(t, layout);
        // Room for the output after the plan's workspace, all in one block.
        Workspace ws(ag.workspace_bytes() + 4 * layout.padded_numel());
        std::vector<float> shard(layout.shard_numel(), 1.0f), full(layout.padded_numel(), 7.0f);
        float* inside = static_cast<float*>(ws.ptr);
        const bool bad = t.rank() == 1;
        try {
          if (which == 0)
            ag(shard.data(), bad ? inside : full.data(), ws.ptr, ws.bytes);
          else
            ag(bad ? inside : shard.data(), full.data(), ws.ptr, ws.bytes);
        } catch (...) {
          untouched[t.rank()] = full[0];
          throw;
        }
      });
      CHECK(has(msg[1], which == 0 ? "'full'" : "'shard'"));
      CHECK(has(msg[1], "overlaps the workspace"));
      for (int r : {0, 2, 3}) CHECK(has(msg[r], "rank 1 rejected its arguments"));
      for (int r : {0, 2, 3}) CHECK(untouched[r] == 7.0f);
    }
  }
  SUBCASE("a float buffer not aligned to 4 bytes") {
    auto msg = errors_of(sh.world, ids, [&](LocalTransport& t) {
      const Topology topo = Topology::from_node_ids(ids, t.rank());
      RS rs(t, topo, layout, Reduce::sum);
      Workspace ws(rs.workspace_bytes());
      std::vector<float> g(layout.padded_numel() + 1), s(layout.shard_numel());
      const float* grad = g.data();
      if (t.rank() == 0)
        grad = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(g.data()) + 2);
      rs(grad, s.data(), ws.ptr, ws.bytes);
    });
    CHECK(has(msg[0], "'grad'"));
    CHECK(has(msg[0], "is not aligned to 4 bytes"));
    for (int r : {1, 2, 3}) CHECK(has(msg[r], "rank 0 rejected its arguments"));
  }
}
