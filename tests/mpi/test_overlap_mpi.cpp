// qcoll-mpi-ranks: 2 4
// Start/finish across MPI processes: the nonblocking exchanges (MPI_Iallgather / MPI_Ialltoall)
// deliver the blocking calls' bytes, and the plans' start(); compute (calling progress());
// finish() gives the blocking call's bits, with several plans in flight finished in different
// orders on different ranks; misuse raises qcoll::Error on the ranks concerned.
#include "../common/mpi_main.hpp"

#include <qcoll/collective/delta_all_gather.hpp>
#include <qcoll/transport/mpi.hpp>

#include "../common/collective_harness.hpp"
#include "../common/error_of.hpp"

using namespace qcoll;
using namespace harness;
using testing_support::error_of;

namespace {

using mpi_main::world_rank;
using mpi_main::world_size;

// Two nodes of W/2 ranks (node-major) for even W, else one node.
std::vector<long long> node_ids(int W) {
  std::vector<long long> ids(static_cast<std::size_t>(W), 0);
  if (W % 2 == 0)
    for (int r = 0; r < W; ++r) ids[static_cast<std::size_t>(r)] = r / (W / 2);
  return ids;
}

// Some work that does not touch the buffers of the call in flight, with progress() between steps.
template <class Pending>
double compute(Pending& p, int steps) {
  double acc = 0;
  for (int s = 0; s < steps; ++s) {
    for (int i = 0; i < 20000; ++i) acc += 1.0 / (1.0 + i + s);
    p.progress();
  }
  return acc;
}

TEST_CASE("MPI nonblocking all_gather and all_to_all deliver the blocking calls' bytes") {
  const int W = world_size(), r = world_rank();
  MpiTransport t(MPI_COMM_WORLD, node_ids(W));
  for (std::size_t n : {std::size_t{0}, std::size_t{5}, std::size_t{70000}}) {
    CAPTURE(n);
    std::vector<unsigned char> send(n * W), a(n * W), b(n * W, 0), c(n * W), d(n * W, 0);
    for (std::size_t i = 0; i < send.size(); ++i) send[i] = static_cast<unsigned char>(i * 13 + r * 29 + 3);
    t.reset_counters();
    t.all_gather(send.data(), a.data(), n);
    t.all_to_all(send.data(), c.data(), n);
    const ByteCounters blocking = t.counters();
    t.reset_counters();
    MpiTransport::Request q1 = t.start_all_gather(send.data(), b.data(), n);
    MpiTransport::Request q2 = t.start_all_to_all(send.data(), d.data(), n);
    while (!t.test(q2)) {
    }
    t.wait(q1);
    CHECK(a == b);
    CHECK(c == d);
    CHECK(!q1.active());
    CHECK(t.counters().total() == blocking.total());
    CHECK(t.counters().calls == 2u);
    CHECK(error_of([&] { t.wait(q1); }).find("MpiTransport::wait: argument 'req' = an inactive request") !=
          std::string::npos);
  }
}

TEST_CASE("MPI plans: start, compute with progress(), finish equals the blocking call") {
  const int W = world_size(), r = world_rank();
  const std::vector<long long> ids = node_ids(W);
  MpiTransport t(MPI_COMM_WORLD, ids);
  const Topology topo = Topology::from_node_ids(ids, r);
  const std::size_t numel = 5000;
  const ShardLayout layout(numel, W, granule_for(sizeof(float), {256}));
  const auto grads = make_inputs<float>(11, W, layout.padded_numel(), numel);
  const std::vector<float>& grad = grads[static_cast<std::size_t>(r)];
  const float* shard_in = grad.data() + layout.shard_offset(r);

  QuantizedAllGather<float, Int8<256>, MpiTransport> ag(t, layout);
  Workspace wa(ag.workspace_bytes());
  std::vector<float> a(layout.padded_numel()), b(layout.padded_numel());
  ag(shard_in, a.data(), wa.ptr, wa.bytes);
  auto pa = ag.start(shard_in, b.data(), wa.ptr, wa.bytes);
  compute(pa, 5);
  ag.finish(pa);
  CHECK(same_bits(a, b));

  for (Hops hops : {Hops::one, Hops::two}) {
    CAPTURE(static_cast<int>(hops));
    QuantizedReduceScatter<float, Int8<256>, Int4<256>, MpiTransport> rs(t, topo, layout, Reduce::sum, hops);
    Workspace ws(rs.workspace_bytes());
    std::vector<float> x(layout.shard_numel()), y(layout.shard_numel());
    rs(grad.data(), x.data(), ws.ptr, ws.bytes);
    auto p = rs.start(grad.data(), y.data(), ws.ptr, ws.bytes);
    compute(p, 5);
    rs.finish(p);
    CHECK(same_bits(x, y));
  }

  QuantizedAllReduce<float, Int8<256>, Int4<256>, Int8<256>, MpiTransport> ar(t, topo, layout, Reduce::mean,
                                                                              Hops::two);
  Workspace wr(ar.workspace_bytes());
  std::vector<float> u(layout.padded_numel()), v(layout.padded_numel());
  ar(grad.data(), u.data(), wr.ptr, wr.bytes);
  auto pr = ar.start(grad.data(), v.data(), wr.ptr, wr.bytes);
  compute(pr, 3);
  ar.finish(pr);
  CHECK(same_bits(u, v));

  // hpZ: the node-local gather of the captured copy
  SecondaryShard<float, Int8<256>, MpiTransport> hpz(t, topo, layout);
  Workspace wh(hpz.workspace_bytes());
  hpz.capture(a.data(), 3);
  std::vector<float> h1(layout.padded_numel()), h2(layout.padded_numel());
  hpz.gather(h1.data(), 3, wh.ptr, wh.bytes);
  auto ph = hpz.start(h2.data(), 3, wh.ptr, wh.bytes);
  compute(ph, 3);
  hpz.finish(ph);
  CHECK(same_bits(h1, h2));
  CHECK(same_bits(h1, a));

  // qWD: a resync and a difference, blocking on one plan and split on another
  using D = DeltaAllGather<float, Int4<256>, MpiTransport>;
  D d1(t, layout), d2(t, layout);
  Workspace w1(d1.resync_workspace_bytes<Int8<256>>()), w2(w1.bytes);
  std::vector<float> r1(layout.padded_numel()), r2(layout.padded_numel());
  std::vector<float> moved(shard_in, shard_in + layout.shard_numel());
  for (float& m : moved) m *= 1.01f;
  d1.resync<Int8<256>>(shard_in, r1.data(), w1.ptr, w1.bytes);
  auto q1 = d2.start_resync<Int8<256>>(shard_in, r2.data(), w2.ptr, w2.bytes);
  compute(q1, 2);
  d2.finish(q1);
  d1(moved.data(), r1.data(), w1.ptr, w1.bytes);
  auto q2 = d2.start(moved.data(), r2.data(), w2.ptr, w2.bytes);
  compute(q2, 2);
  d2.finish(q2);
  CHECK(same_bits(r1, r2));
}

TEST_CASE("MPI plans: several in flight, finished in different orders on different ranks") {
  const int W = world_size(), r = world_rank();
  const std::vector<long long> ids = node_ids(W);
  MpiTransport t(MPI_COMM_WORLD, ids);
  const Topology topo = Topology::from_node_ids(ids, r);
  const std::size_t numel = 3000;
  const ShardLayout layout(numel, W, granule_for(sizeof(float), {256}));
  const auto grads = make_inputs<float>(12, W, layout.padded_numel(), numel);
  const std::vector<float>& grad = grads[static_cast<std::size_t>(r)];
  QuantizedAllGather<float, Int8<256>, MpiTransport> ag1(t, layout), ag2(t, layout);
  QuantizedReduceScatter<float, Int8<256>, Int8<256>, MpiTransport> rs(t, topo, layout, Reduce::sum,
                                                                       Hops::two);
  Workspace w1(ag1.workspace_bytes()), w2(ag2.workspace_bytes()), w3(rs.workspace_bytes());
  std::vector<float> e1(layout.padded_numel()), e2(layout.padded_numel()), e3(layout.shard_numel());
  std::vector<float> f1(e1.size()), f2(e2.size()), f3(e3.size());
  const float* s1 = grad.data() + layout.shard_offset(r);
  const float* s2 = grads[static_cast<std::size_t>((r + 1) % W)].data() + layout.shard_offset(r);
  ag1(s1, e1.data(), w1.ptr, w1.bytes);
  ag2(s2, e2.data(), w2.ptr, w2.bytes);
  rs(grad.data(), e3.data(), w3.ptr, w3.bytes);
  auto p1 = ag1.start(s1, f1.data(), w1.ptr, w1.bytes);
  auto p2 = ag2.start(s2, f2.data(), w2.ptr, w2.bytes);
  auto p3 = rs.start(grad.data(), f3.data(), w3.ptr, w3.bytes);
  if (r % 2 == 0) {
    p1.finish();
    p2.finish();
    p3.finish();
  } else {
    p3.finish();
    p2.finish();
    p1.finish();
  }
  CHECK(same_bits(e1, f1));
  CHECK(same_bits(e2, f2));
  CHECK(same_bits(e3, f3));
}

TEST_CASE("MPI plans: finish twice, a second start and a lost handle are rejected") {
  const int W = world_size(), r = world_rank();
  MpiTransport t(MPI_COMM_WORLD, node_ids(W));
  const std::size_t numel = 2048;
  const ShardLayout layout(numel, W, granule_for(sizeof(float), {256}));
  const auto grads = make_inputs<float>(13, W, layout.padded_numel(), numel);
  const float* shard_in = grads[static_cast<std::size_t>(r)].data() + layout.shard_offset(r);
  QuantizedAllGather<float, Int8<256>, MpiTransport> ag(t, layout);
  Workspace ws(ag.workspace_bytes()), ws2(ag.workspace_bytes());
  std::vector<float> full(layout.padded_numel()), full2(layout.padded_numel());
  auto p = ag.start(shard_in, full.data(), ws.ptr, ws.bytes);  // call 1
  const std::string second = error_of([&] { ag.start(shard_in, full2.data(), ws2.ptr, ws2.bytes); });
  CHECK(second.find("argument 'plan' = call 1 started and not finished") != std::string::npos);
  ag.finish(p);
  CHECK(error_of([&] { ag.finish(p); }).find("an inactive handle") != std::string::npos);
  CHECK(error_of([&] { ag(shard_in, full.data(), ws.ptr, ws.bytes); }) == "no error");
  // Rank 0's handle destroyed unfinished (its destructor completes the exchange): the next call is
  // rejected on every rank, the one after runs.
  {
    auto d = ag.start(shard_in, full.data(), ws.ptr, ws.bytes);  // call 4 (2: rejected, 3: blocking)
    if (r != 0) ag.finish(d);
  }
  const std::string next = error_of([&] { ag(shard_in, full.data(), ws.ptr, ws.bytes); });
  if (r == 0)
    CHECK(next.find("argument 'plan' = call 4 destroyed unfinished") != std::string::npos);
  else
    CHECK(next.find("rank 0 rejected its arguments; nothing was sent") != std::string::npos);
  CHECK(error_of([&] { ag(shard_in, full.data(), ws.ptr, ws.bytes); }) == "no error");
}

}  // namespace
