// qcoll-mpi-ranks: 2 3 4 6 8
// The ZeRO++ primitives across MPI processes: bit-exact against the straightforward
// re-computation and against the in-process transport, deterministic, non-finite inputs and bad
// arguments handled on every rank without a hang.
#include "../common/mpi_main.hpp"

#include <qcoll/collective/delta_all_gather.hpp>
#include <qcoll/transport/local.hpp>
#include <qcoll/transport/mpi.hpp>

#include "../common/collective_harness.hpp"

using namespace qcoll;
using namespace harness;

namespace {

using mpi_main::world_rank;
using mpi_main::world_size;

// Node tables for this world: one node, one rank per node, and (for even sizes) two nodes with
// ranks placed round-robin, i.e. not node-major.
std::vector<std::vector<long long>> placements(int W) {
  std::vector<std::vector<long long>> out;
  out.push_back(std::vector<long long>(W, 7));
  std::vector<long long> each(W);
  for (int r = 0; r < W; ++r) each[r] = 100 + r;
  out.push_back(each);
  if (W % 2 == 0 && W > 2) {
    std::vector<long long> rr(W);
    for (int r = 0; r < W; ++r) rr[r] = r % 2;
    out.push_back(rr);
  }
  return out;
}

// Runs the reduce-scatter of every rank's regenerated gradient over `t` (MPI) and over a
// LocalGroup in this process, and checks this rank's result against both and the re-computation.
template <class T, class F1, class F2>
void check_rs(const std::vector<long long>& ids, std::size_t numel, Reduce op, Hops hops, Rounding rounding) {
  const int W = world_size(), me = world_rank();
  const ShardLayout layout(numel, W, granule_for(sizeof(T), {F1::block, F2::block}));
  host::QuantizeOptions opt;
  opt.rounding = rounding;
  opt.seed = 17;
  auto grads = make_inputs<T>(31, W, layout.padded_numel(), numel);
  MpiTransport t(MPI_COMM_WORLD, ids);
  const Topology topo = Topology::from_node_ids(ids, me);
  QuantizedReduceScatter<T, F1, F2, MpiTransport> rs(t, topo, layout, op, hops, opt);
  Workspace ws(rs.workspace_bytes());
  std::vector<T> out(layout.shard_numel());
  const std::uint32_t flags = rs(grads[me].data(), out.data(), ws.ptr, ws.bytes);
  CHECK(flags == 0u);
  const auto want = reference_reduce_scatter<T, F1, F2>(grads, topo, layout, op, hops, opt);
  CHECK(same_bits(out, want[me]));
  std::vector<T> local_out;
  LocalGroup g(W, ids);
  g.run([&](LocalTransport& lt) {
    const Topology lt_topo = Topology::from_node_ids(ids, lt.rank());
    QuantizedReduceScatter<T, F1, F2, LocalTransport> lrs(lt, lt_topo, layout, op, hops, opt);
    Workspace lws(lrs.workspace_bytes());
    std::vector<T> o(layout.shard_numel());
    lrs(grads[lt.rank()].data(), o.data(), lws.ptr, lws.bytes);
    if (lt.rank() == me) local_out = o;
  });
  CHECK(same_bits(out, local_out));
}

template <class T, class F>
void check_ag(const std::vector<long long>& ids, std::size_t numel, Rounding rounding) {
  const int W = world_size(), me = world_rank();
  const ShardLayout layout(numel, W, granule_for(sizeof(T), {F::block}));
  host::QuantizeOptions opt;
  opt.rounding = rounding;
  opt.seed = 5;
  const auto x = make_input<T>(3, 0, layout.padded_numel(), numel);
  std::vector<std::vector<T>> shards(W);
  for (int r = 0; r < W; ++r)
    shards[r].assign(x.begin() + layout.shard_offset(r),
                     x.begin() + layout.shard_offset(r) + layout.shard_numel());
  MpiTransport t(MPI_COMM_WORLD, ids);
  QuantizedAllGather<T, F, MpiTransport> ag(t, layout, opt);
  Workspace ws(ag.workspace_bytes());
  std::vector<T> full(layout.padded_numel());
  CHECK(ag(shards[me].data(), full.data(), ws.ptr, ws.bytes) == 0u);
  CHECK(same_bits(full, reference_all_gather<T, F>(shards, layout, opt)));
}

}  // namespace

TEST_CASE("all-gather and reduce-scatter over MPI: exact, and the same bits as the in-process transport") {
  const int W = world_size();
  for (const auto& ids : placements(W))
    for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(97), std::size_t(4099)}) {
      CAPTURE(n);
      CAPTURE(ids[0]);
      check_ag<bfloat16, Int8<64>>(ids, n, Rounding::nearest);
      check_ag<float, NvFp4>(ids, n, Rounding::stochastic);
      check_rs<float, Int4<32>, Int4<32>>(ids, n, Reduce::mean, Hops::two, Rounding::nearest);
      check_rs<bfloat16, Int8<32>, Int4<64>>(ids, n, Reduce::sum, Hops::two, Rounding::stochastic);
      check_rs<half, Fp8E4M3<32>, Fp8E4M3<32>>(ids, n, Reduce::mean, Hops::one, Rounding::nearest);
    }
}

TEST_CASE("all-reduce over MPI: 20 repetitions give the same bits, on every rank") {
  const int W = world_size(), me = world_rank();
  const auto ids = placements(W).back();
  const std::size_t numel = 3000;
  const ShardLayout layout(numel, W, granule_for(4, {32}));
  MpiTransport t(MPI_COMM_WORLD, ids);
  const Topology topo = Topology::from_node_ids(ids, me);
  host::QuantizeOptions opt;
  opt.rounding = Rounding::stochastic;
  QuantizedAllReduce<float, Int4<32>, Int4<32>, Int8<32>, MpiTransport> ar(t, topo, layout, Reduce::mean,
                                                                           Hops::two, opt);
  Workspace ws(ar.workspace_bytes());
  const auto in = make_input<float>(8, me, layout.padded_numel(), numel);
  std::vector<float> first(layout.padded_numel()), out(layout.padded_numel());
  ar(in.data(), first.data(), ws.ptr, ws.bytes);
  for (int rep = 1; rep < 20; ++rep) {
    ar(in.data(), out.data(), ws.ptr, ws.bytes);
    CHECK(same_bits(first, out));
  }
  std::vector<float> rank0 = first;
  MPI_Bcast(rank0.data(), static_cast<int>(rank0.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  CHECK(same_bits(first, rank0));
}

TEST_CASE("a NaN on one rank over MPI: the same flag on every rank, no hang, the next call works") {
  const int W = world_size(), me = world_rank();
  const auto ids = placements(W).back();
  const std::size_t numel = 1000;
  const ShardLayout layout(numel, W, granule_for(4, {32}));
  MpiTransport t(MPI_COMM_WORLD, ids);
  const Topology topo = Topology::from_node_ids(ids, me);
  QuantizedReduceScatter<float, Int4<32>, Int4<32>, MpiTransport> rs(t, topo, layout, Reduce::sum);
  Workspace ws(rs.workspace_bytes());
  auto g = make_input<float>(2, me, layout.padded_numel(), numel);
  const std::size_t at = layout.shard_offset(W - 1) + 3;
  if (me == 0) g[at] = std::numeric_limits<float>::infinity();
  std::vector<float> out(layout.shard_numel());
  CHECK(rs(g.data(), out.data(), ws.ptr, ws.bytes) == kResultNonFinite);
  if (me == W - 1) CHECK(std::isnan(out[3]));
  g[at] = 0.0f;
  CHECK(rs(g.data(), out.data(), ws.ptr, ws.bytes) == 0u);
  std::size_t finite = 0;
  for (std::size_t e = 0; e < layout.valid_in_shard(me); ++e) finite += std::isfinite(out[e]) ? 1 : 0;
  CHECK(finite == layout.valid_in_shard(me));
}

TEST_CASE("bad arguments over MPI: every rank throws before anything is sent") {
  const int W = world_size(), me = world_rank();
  const ShardLayout layout(500, W, granule_for(4, {32}));
  MpiTransport t(MPI_COMM_WORLD);
  QuantizedAllGather<float, Int8<32>, MpiTransport> ag(t, layout);
  Workspace ws(ag.workspace_bytes());
  std::vector<float> shard(layout.shard_numel()), full(layout.padded_numel(), 4.0f);
  std::string msg;
  try {
    ag(shard.data(), me == W - 1 ? nullptr : full.data(), ws.ptr, ws.bytes);
  } catch (const Error& e) {
    msg = e.what();
  }
  if (me == W - 1) {
    CHECK(msg.find("'full' = null") != std::string::npos);
  } else {
    CHECK(msg.find("rank " + std::to_string(W - 1) + " rejected its arguments") != std::string::npos);
  }
  CHECK(t.counters().total() == 0u);
  CHECK(full[0] == 4.0f);
  // Disagreeing plans are reported on all ranks.
  std::string plan;
  try {
    const ShardLayout other(me == 0 ? 501 : 500, W, granule_for(4, {32}));
    QuantizedAllGather<float, Int8<32>, MpiTransport> bad(t, other);
  } catch (const Error& e) {
    plan = e.what();
  }
  if (W > 1) CHECK(plan.find("ranks disagree on the call") != std::string::npos);
  // The plan still works afterwards.
  CHECK(ag(shard.data(), full.data(), ws.ptr, ws.bytes) == 0u);
}

TEST_CASE("qWD over MPI: 100 steps, the replicas of all processes stay bit-identical") {
  const int W = world_size(), me = world_rank();
  std::vector<long long> ids(W);
  for (int r = 0; r < W; ++r) ids[r] = W % 2 == 0 ? r % 2 : 0;  // two nodes, round-robin (even W)
  MpiTransport t(MPI_COMM_WORLD, ids);
  const ShardLayout layout(3001, W, granule_for(2, {64}));
  DeltaAllGather<bfloat16, Int4<64>, MpiTransport> qwd(t, layout);
  using Exact = Identity<bfloat16, 64>;
  Workspace ws(std::max(qwd.workspace_bytes(), qwd.resync_workspace_bytes<Exact>()));
  std::vector<bfloat16> replica(layout.padded_numel()), shard(layout.shard_numel());
  // Every process regenerates the same weights: w_t(i) = x(i) + t * 1e-3 * y(i), x and y fixed.
  auto load = [&](int step) {
    for (std::size_t i = 0; i < layout.shard_numel(); ++i) {
      const std::size_t g = layout.shard_offset(me) + i;
      shard[i] = from_float<bfloat16>(input_value(7, 0, g) +
                                      1e-3f * static_cast<float>(step) * input_value(8, 0, g));
    }
  };
  load(0);
  qwd.resync<Exact>(shard.data(), replica.data(), ws.ptr, ws.bytes);
  int differ = 0;
  for (int step = 1; step <= 100; ++step) {
    load(step);
    qwd(shard.data(), replica.data(), ws.ptr, ws.bytes);
    Fnv1a h;
    for (const bfloat16& v : replica) h.mix(fp::bits(to_float(v)));
    std::uint64_t v[2] = {h.value, ~h.value};
    t.all_reduce(v, 2, ReduceOp::max);
    differ += v[0] != h.value || ~v[1] != h.value;
  }
  CHECK(differ == 0);
}
