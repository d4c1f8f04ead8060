// Start/finish on the in-process transport: the nonblocking exchanges (start_all_gather,
// start_all_to_all, test, wait) and the plans' start()/finish() split. Results are compared bit for
// bit with the blocking calls; overlap is shown by ranks that wait (outside qcoll) for a peer which
// can only get there if the exchange progressed without them, so a blocking start would hang and
// the watchdog would fail the test; misuse must raise qcoll::Error, never hang.

#include <doctest/doctest.h>

#include <qcoll/collective/delta_all_gather.hpp>

#include "../common/collective_harness.hpp"
#include "../common/error_of.hpp"
#include "../common/watchdog.hpp"

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using namespace qcoll;
using namespace harness;
using testing_support::error_of;

namespace {

struct Watchdog : testing_support::Watchdog {
  Watchdog() : testing_support::Watchdog(120, "test_overlap") {}
};

//! A counter threads can wait on (outside qcoll), to order the ranks of a test deterministically.
struct Counter {
  std::mutex mu;
  std::condition_variable cv;
  int value = 0;
  void add() {
    {
      std::lock_guard<std::mutex> lk(mu);
      ++value;
    }
    cv.notify_all();
  }
  void wait_for(int n) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return value >= n; });
  }
};

//! Byte i of the block rank `src` sends to rank `dst`.
unsigned char byte_of(int src, int dst, std::size_t i) {
  return static_cast<unsigned char>(
      (i * 7u + static_cast<unsigned>(src) * 31u + static_cast<unsigned>(dst) * 5u + 1u) & 0xffu);
}

const std::vector<long long> kTwoNodes = {0, 0, 1, 1};

// ---- transport level ---------------------------------------------------------------------------

TEST_CASE("local nonblocking all_gather and all_to_all deliver the blocking calls' bytes") {
  Watchdog dog;
  const int W = 4;
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}}) {
    CAPTURE(n);
    std::vector<std::string> bad(W);
    LocalGroup g(W);
    g.run([&](LocalTransport& t) {
      const int r = t.rank();
      std::vector<unsigned char> send(n * W), a(n * W), b(n * W, 0), c(n * W), d(n * W, 0);
      for (int dst = 0; dst < W; ++dst)
        for (std::size_t i = 0; i < n; ++i) send[static_cast<std::size_t>(dst) * n + i] = byte_of(r, dst, i);
      // in-place gather: own block already in recv
      std::vector<unsigned char> inplace(n * W, 0);
      std::copy(send.begin(), send.begin() + static_cast<std::ptrdiff_t>(n),
                inplace.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * n));
      t.all_gather(send.data(), a.data(), n);
      t.all_to_all(send.data(), c.data(), n);
      const ByteCounters blocking = t.counters();
      t.reset_counters();
      auto q1 = t.start_all_gather(send.data(), b.data(), n);
      auto q2 = t.start_all_to_all(send.data(), d.data(), n);
      auto q3 = t.start_all_gather(inplace.data() + static_cast<std::size_t>(r) * n, inplace.data(), n);
      t.wait(q3);
      t.wait(q2);
      t.wait(q1);
      if (a != b) bad[r] += "gather differs; ";
      if (c != d) bad[r] += "all_to_all differs; ";
      if (inplace != a) bad[r] += "in-place gather differs; ";
      if (q1.active() || q2.active()) bad[r] += "request still active; ";
      const ByteCounters nb = t.counters();
      if (nb.calls != 3 || nb.total() != blocking.total() + blocking.total() / 2)
        bad[r] += "counters " + std::to_string(nb.total()) + " vs " + std::to_string(blocking.total());
    });
    for (int r = 0; r < W; ++r) CHECK_MESSAGE(bad[r].empty(), "rank ", r, ": ", bad[r]);
  }
}

TEST_CASE("local nonblocking exchange completes while a rank computes without calling qcoll") {
  Watchdog dog;
  const int W = 4;
  const std::size_t n = 1000;
  Counter go, finished;
  std::vector<int> ok(W, 0), tested(W, 0);
  LocalGroup g(W);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    std::vector<unsigned char> send(n), recv(n * W, 0);
    for (std::size_t i = 0; i < n; ++i) send[i] = byte_of(r, 0, i);
    if (r == 0) {
      auto req = t.start_all_gather(send.data(), recv.data(), n);  // returns before any peer starts
      go.add();
      finished.wait_for(W - 1);         // "compute": the peers finish meanwhile, rank 0 calls nothing
      tested[r] = t.test(req) ? 1 : 0;  // already done: test() does not block
      if (req.active()) t.wait(req);
    } else {
      go.wait_for(1);
      auto req = t.start_all_gather(send.data(), recv.data(), n);
      t.wait(req);
      finished.add();
      tested[r] = 1;
    }
    bool same = true;
    for (int q = 0; q < W; ++q)
      for (std::size_t i = 0; i < n; ++i)
        same = same && recv[static_cast<std::size_t>(q) * n + i] == byte_of(q, 0, i);
    ok[r] = same ? 1 : 0;
  });
  for (int r = 0; r < W; ++r) {
    CHECK(ok[r] == 1);
    CHECK(tested[r] == 1);
  }
}

TEST_CASE("local nonblocking exchanges: misuse and disagreement raise qcoll::Error") {
  Watchdog dog;
  SUBCASE("wait twice, test after wait, wait on an empty request") {
    std::vector<std::string> e1(2), e2(2), e3(2);
    LocalGroup g(2);
    g.run([&](LocalTransport& t) {
      unsigned char s = 1, rv[2];
      auto req = t.start_all_gather(&s, rv, 1);
      t.wait(req);
      e1[t.rank()] = error_of([&] { t.wait(req); });
      e2[t.rank()] = error_of([&] { t.test(req); });
      LocalTransport::Request none;
      e3[t.rank()] = error_of([&] { t.wait(none); });
    });
    for (int r = 0; r < 2; ++r) {
      CHECK(e1[r].find("LocalTransport::wait: argument 'req' = an inactive request") != std::string::npos);
      CHECK(e2[r].find("LocalTransport::test: argument 'req'") != std::string::npos);
      CHECK(e3[r].find("inactive request") != std::string::npos);
    }
  }
  SUBCASE("ranks that start different exchanges all throw") {
    std::vector<std::string> e(3);
    LocalGroup g(3);
    g.run([&](LocalTransport& t) {
      std::vector<unsigned char> s(3 * 4, 1), rv(3 * 4);
      e[t.rank()] = error_of([&] {
        auto req = t.rank() == 1 ? t.start_all_to_all(s.data(), rv.data(), 4)
                                 : t.start_all_gather(s.data(), rv.data(), 4);
        t.wait(req);
      });
      t.barrier();  // the group still works afterwards
    });
    for (int r = 0; r < 3; ++r)
      CHECK(e[r].find(
                "ranks disagree on the nonblocking exchange: rank 0 started all_gather with bytes_per_rank = "
                "4, rank 1 started all_to_all") != std::string::npos);
  }
  SUBCASE("a request destroyed before every rank started withdraws its rank: peers throw") {
    std::vector<std::string> e(3);
    Counter started, withdrawn, tried;
    LocalGroup g(3);
    g.run([&](LocalTransport& t) {
      std::vector<unsigned char> s(4, 1), rv(3 * 4);
      const int r = t.rank();
      if (r == 0) {
        auto req = t.start_all_gather(s.data(), rv.data(), 4);
        started.add();
        e[r] = error_of([&] { t.wait(req); });
        tried.wait_for(1);
      } else if (r == 1) {
        started.wait_for(1);
        {
          auto req = t.start_all_gather(s.data(), rv.data(), 4);
        }  // destroyed unfinished while rank 2 has not started
        withdrawn.add();
        e[r] = "withdrew";
        tried.wait_for(1);  // ranks stay in the run (one that left would be reported instead)
      } else {
        withdrawn.wait_for(1);
        e[r] = error_of([&] { t.start_all_gather(s.data(), rv.data(), 4); });
        tried.add();
      }
    });
    CHECK(e[0].find(
              "rank 1 destroyed its request of a nonblocking all_gather before all ranks had started it") !=
          std::string::npos);
    CHECK(e[1] == "withdrew");
    CHECK_MESSAGE(e[2].find("rank 1 destroyed its request") != std::string::npos, e[2]);
  }
  SUBCASE("a rank that fails while its peers wait in an exchange does not leave them hanging") {
    LocalGroup g(2);
    std::string peer;
    CHECK_THROWS_WITH_AS(g.run([&](LocalTransport& t) {
      unsigned char s = 1, rv[2];
      if (t.rank() == 1) throw std::runtime_error("boom");
      peer = error_of([&] {
        auto req = t.start_all_gather(&s, rv, 1);
        t.wait(req);
      });
      throw Error(peer);
    }),
                         "boom", std::runtime_error);
    CHECK(peer.find("peer rank 1 failed: boom") != std::string::npos);
  }
}

// ---- plan level --------------------------------------------------------------------------------

using AG = QuantizedAllGather<float, Int8<256>, LocalTransport>;
using RS = QuantizedReduceScatter<float, Int8<256>, Int4<256>, LocalTransport>;
using AR = QuantizedAllReduce<float, Int8<256>, Int4<256>, Int8<256>, LocalTransport>;
using HPZ = SecondaryShard<float, Int8<256>, LocalTransport>;
using QWD = DeltaAllGather<float, Int4<256>, LocalTransport>;

constexpr std::size_t kNumel = 3000;  // not a multiple of the shards: padding on the last rank

ShardLayout layout4() { return ShardLayout(kNumel, 4, granule_for(sizeof(float), {256})); }

TEST_CASE("plan start/finish returns the blocking call's bits (all-gather, reduce-scatter, all-reduce)") {
  Watchdog dog;
  const ShardLayout layout = layout4();
  const auto grads = make_inputs<float>(5, 4, layout.padded_numel(), kNumel);
  std::vector<std::string> bad(4);
  LocalGroup g(4, kTwoNodes);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    const Topology topo = Topology::from_node_ids(kTwoNodes, r);
    const std::vector<float>& grad = grads[static_cast<std::size_t>(r)];
    const float* shard_in = grad.data() + layout.shard_offset(r);
    {
      AG ag(t, layout);
      Workspace ws(ag.workspace_bytes());
      std::vector<float> a(layout.padded_numel()), b(layout.padded_numel());
      const std::uint32_t fa = ag(shard_in, a.data(), ws.ptr, ws.bytes);
      AG::Pending p = ag.start(shard_in, b.data(), ws.ptr, ws.bytes);
      if (!p.active() || p.call() != 2) bad[r] += "ag handle; ";
      const std::uint32_t fb = ag.finish(p);
      if (!same_bits(a, b) || fa != fb) bad[r] += "all-gather differs; ";
      if (p.active()) bad[r] += "ag handle active after finish; ";
    }
    for (Hops hops : {Hops::one, Hops::two}) {
      RS rs(t, topo, layout, Reduce::mean, hops);
      Workspace ws(rs.workspace_bytes());
      std::vector<float> a(layout.shard_numel()), b(layout.shard_numel());
      rs(grad.data(), a.data(), ws.ptr, ws.bytes);
      RS::Pending p = rs.start(grad.data(), b.data(), ws.ptr, ws.bytes);
      rs.finish(p);
      if (!same_bits(a, b)) bad[r] += hops == Hops::one ? "rs one hop differs; " : "rs two hops differs; ";
      // with error feedback on both hops: two plans, two fresh states, one blocking, one split
      RS rs2(t, topo, layout, Reduce::mean, hops);
      const FeedbackOptions fo{};
      Workspace ra(rs.residual_bytes(fo)), rb(rs2.residual_bytes(fo));
      rs.init_residual(ra.ptr, ra.bytes, fo);
      rs2.init_residual(rb.ptr, rb.bytes, fo);
      rs(grad.data(), a.data(), ws.ptr, ws.bytes, ResidualState{ra.ptr, ra.bytes});
      RS::Pending p2 = rs2.start(grad.data(), b.data(), ws.ptr, ws.bytes, ResidualState{rb.ptr, rb.bytes});
      p2.finish();
      if (!same_bits(a, b)) bad[r] += "rs with feedback differs; ";
      if (std::memcmp(static_cast<char*>(ra.ptr) + 64, static_cast<char*>(rb.ptr) + 64, ra.bytes - 64) != 0)
        bad[r] += "residuals differ; ";
    }
    {
      AR ar(t, topo, layout, Reduce::sum, Hops::two);
      Workspace ws(ar.workspace_bytes());
      std::vector<float> a(layout.padded_numel()), b(layout.padded_numel());
      ar(grad.data(), a.data(), ws.ptr, ws.bytes);
      AR::Pending p = ar.start(grad.data(), b.data(), ws.ptr, ws.bytes);
      ar.finish(p);
      if (!same_bits(a, b)) bad[r] += "all-reduce differs; ";
    }
  });
  for (int r = 0; r < 4; ++r) CHECK_MESSAGE(bad[r].empty(), "rank ", r, ": ", bad[r]);
}

TEST_CASE("hpZ gather and qWD start/finish return the blocking calls' bits, interleaved with others") {
  Watchdog dog;
  const ShardLayout layout = layout4();
  const auto weights = make_inputs<float>(7, 4, layout.padded_numel(), kNumel);
  std::vector<std::string> bad(4), second(4), dropped(4);
  LocalGroup g(4, kTwoNodes);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    const Topology topo = Topology::from_node_ids(kTwoNodes, r);
    const std::vector<float>& w = weights[static_cast<std::size_t>(r)];
    const float* shard_in = w.data() + layout.shard_offset(r);
    // hpZ: capture a gathered buffer, then the blocking gather and the split one (with progress)
    AG ag(t, layout);
    HPZ hpz(t, topo, layout);
    Workspace wa(ag.workspace_bytes()), wh(hpz.workspace_bytes());
    std::vector<float> full(layout.padded_numel()), a(full.size(), -1.0f), b(full.size(), -2.0f);
    ag(shard_in, full.data(), wa.ptr, wa.bytes);
    hpz.capture(full.data(), 5);
    const std::uint32_t fa = hpz.gather(a.data(), 5, wh.ptr, wh.bytes);
    HPZ::Pending ph = hpz.start(b.data(), 5, wh.ptr, wh.bytes);
    if (!ph.active() || ph.call() != 2) bad[r] += "hpz handle; ";
    // an all-gather started and finished while the hpZ gather is in flight
    std::vector<float> c(full.size());
    AG::Pending pa = ag.start(shard_in, c.data(), wa.ptr, wa.bytes);
    while (!ph.progress()) {
    }
    const std::uint32_t fb = hpz.finish(ph);
    pa.finish();
    if (!same_bits(a, b) || fa != fb) bad[r] += "hpz differs; ";
    if (!same_bits(a, full) || !same_bits(c, full)) bad[r] += "hpz is not the gathered buffer; ";
    second[r] = error_of([&] {
      HPZ::Pending x = hpz.start(b.data(), 5, wh.ptr, wh.bytes);  // call 3
      hpz.gather(a.data(), 5, wh.ptr, wh.bytes);                  // call 4: rejected
    });
    // qWD: two plans, two replicas; resync then a difference, one blocking, one split
    QWD d1(t, layout), d2(t, layout);
    using G = Int8<256>;
    Workspace w1(d1.resync_workspace_bytes<G>() > d1.workspace_bytes() ? d1.resync_workspace_bytes<G>()
                                                                       : d1.workspace_bytes());
    Workspace w2(w1.bytes);
    std::vector<float> r1(layout.padded_numel()), r2(layout.padded_numel());
    std::vector<float> moved(shard_in, shard_in + layout.shard_numel());
    for (float& v : moved) v += 0.01f;
    d1.resync<G>(shard_in, r1.data(), w1.ptr, w1.bytes);
    QWD::ResyncPending<G> p1 = d2.start_resync<G>(shard_in, r2.data(), w2.ptr, w2.bytes);
    d2.finish(p1);
    if (!same_bits(r1, r2)) bad[r] += "qwd resync differs; ";
    const std::uint32_t f1 = d1(moved.data(), r1.data(), w1.ptr, w1.bytes);
    QWD::Pending p2 = d2.start(moved.data(), r2.data(), w2.ptr, w2.bytes);
    while (!p2.progress()) {
    }
    const std::uint32_t f2 = d2.finish(p2);
    if (!same_bits(r1, r2) || f1 != f2) bad[r] += "qwd difference differs; ";
    // a qWD handle destroyed unfinished: the plan's next call is rejected on every rank
    {
      QWD::Pending x = d2.start(moved.data(), r2.data(), w2.ptr, w2.bytes);
      t.barrier();  // every rank has started the exchange before any handle goes
    }
    dropped[r] = error_of([&] { d2(moved.data(), r2.data(), w2.ptr, w2.bytes); });
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(bad[r].empty(), bad[r]);
    CHECK(second[r].find("SecondaryShard::gather: argument 'plan' = call 3 started and not finished") !=
          std::string::npos);
    CHECK(dropped[r].find("DeltaAllGather: argument 'plan' = call 3 destroyed unfinished") !=
          std::string::npos);
  }
}

TEST_CASE("several plans in flight, finished in different orders on different ranks") {
  Watchdog dog;
  const ShardLayout layout = layout4();
  const auto grads = make_inputs<float>(9, 4, layout.padded_numel(), kNumel);
  std::vector<std::string> bad(4);
  LocalGroup g(4, kTwoNodes);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    const Topology topo = Topology::from_node_ids(kTwoNodes, r);
    const std::vector<float>& grad = grads[static_cast<std::size_t>(r)];
    AG ag1(t, layout), ag2(t, layout);
    RS rs(t, topo, layout, Reduce::sum, Hops::two);
    Workspace w1(ag1.workspace_bytes()), w2(ag2.workspace_bytes()), w3(rs.workspace_bytes());
    std::vector<float> f1(layout.padded_numel()), f2(layout.padded_numel()), s3(layout.shard_numel());
    std::vector<float> e1(f1.size()), e2(f2.size()), e3(s3.size());
    const float* shard_in = grad.data() + layout.shard_offset(r);
    const float* other_in = grads[static_cast<std::size_t>((r + 1) % 4)].data() + layout.shard_offset(r);
    ag1(shard_in, e1.data(), w1.ptr, w1.bytes);
    ag2(other_in, e2.data(), w2.ptr, w2.bytes);
    rs(grad.data(), e3.data(), w3.ptr, w3.bytes);
    AG::Pending p1 = ag1.start(shard_in, f1.data(), w1.ptr, w1.bytes);
    AG::Pending p2 = ag2.start(other_in, f2.data(), w2.ptr, w2.bytes);
    RS::Pending p3 = rs.start(grad.data(), s3.data(), w3.ptr, w3.bytes);
    if (r % 2 == 0) {
      p1.finish();
      p2.finish();
      p3.finish();
    } else {
      p3.finish();
      p2.finish();
      p1.finish();
    }
    if (!same_bits(e1, f1) || !same_bits(e2, f2) || !same_bits(e3, s3)) bad[r] = "differs";
  });
  for (int r = 0; r < 4; ++r) CHECK_MESSAGE(bad[r].empty(), "rank ", r, ": ", bad[r]);
}

TEST_CASE("a started gather completes while its rank computes: peers finish without it") {
  Watchdog dog;
  const ShardLayout layout = layout4();
  const auto grads = make_inputs<float>(3, 4, layout.padded_numel(), kNumel);
  std::vector<std::string> bad(4);
  Counter finished;
  LocalGroup g(4);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    AG ag(t, layout);
    Workspace ws(ag.workspace_bytes());
    const float* shard_in = grads[static_cast<std::size_t>(r)].data() + layout.shard_offset(r);
    std::vector<float> want(layout.padded_numel()), got(layout.padded_numel());
    ag(shard_in, want.data(), ws.ptr, ws.bytes);
    if (r == 0) {
      AG::Pending p = ag.start(shard_in, got.data(), ws.ptr, ws.bytes);
      finished.wait_for(3);  // compute: the peers' finish() returns while rank 0 calls nothing
      if (!p.progress()) bad[r] += "exchange not done after every peer finished; ";
      ag.finish(p);
    } else {
      AG::Pending p = ag.start(shard_in, got.data(), ws.ptr, ws.bytes);
      ag.finish(p);
      finished.add();
    }
    if (!same_bits(want, got)) bad[r] += "differs";
  });
  for (int r = 0; r < 4; ++r) CHECK_MESSAGE(bad[r].empty(), "rank ", r, ": ", bad[r]);
}

TEST_CASE("two-hop reduce-scatter: progress() starts hop 2 once hop 1 is done") {
  Watchdog dog;
  const ShardLayout layout = layout4();
  const auto grads = make_inputs<float>(4, 4, layout.padded_numel(), kNumel);
  std::vector<std::string> bad(4);
  Counter finished;
  LocalGroup g(4, kTwoNodes);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    const Topology topo = Topology::from_node_ids(kTwoNodes, r);
    RS rs(t, topo, layout, Reduce::sum, Hops::two);
    Workspace ws(rs.workspace_bytes());
    const std::vector<float>& grad = grads[static_cast<std::size_t>(r)];
    std::vector<float> want(layout.shard_numel()), got(layout.shard_numel());
    rs(grad.data(), want.data(), ws.ptr, ws.bytes);
    RS::Pending p = rs.start(grad.data(), got.data(), ws.ptr, ws.bytes);
    if (r == 0) {
      // Rank 0 only calls progress() until its peers have finished: their hop 2 needs rank 0's
      // hop-2 messages, which only progress() can send here.
      while (!p.progress()) std::this_thread::yield();
      finished.wait_for(3);
    }
    rs.finish(p);
    if (r != 0) finished.add();
    if (!same_bits(want, got)) bad[r] += "differs";
  });
  for (int r = 0; r < 4; ++r) CHECK_MESSAGE(bad[r].empty(), "rank ", r, ": ", bad[r]);
}

TEST_CASE("plan start/finish misuse raises qcoll::Error on the ranks concerned, never a hang") {
  Watchdog dog;
  const ShardLayout layout = layout4();
  const auto grads = make_inputs<float>(2, 4, layout.padded_numel(), kNumel);
  std::vector<std::string> twice(4), second(4), dropped(4), after(4), foreign(4), order(4), progress_after(4);
  Counter all_started;
  LocalGroup g(4);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    AG ag(t, layout), other(t, layout);
    Workspace ws(ag.workspace_bytes()), ws2(other.workspace_bytes());
    const float* shard_in = grads[static_cast<std::size_t>(r)].data() + layout.shard_offset(r);
    std::vector<float> full(layout.padded_numel()), full2(layout.padded_numel());
    // finish twice
    AG::Pending p = ag.start(shard_in, full.data(), ws.ptr, ws.bytes);  // call 1
    ag.finish(p);
    twice[r] = error_of([&] { ag.finish(p); });
    progress_after[r] = error_of([&] { p.progress(); });
    // a second start (or a blocking call) while one is in flight: rejected on every rank
    AG::Pending q = ag.start(shard_in, full.data(), ws.ptr, ws.bytes);              // call 2
    second[r] = error_of([&] { ag(shard_in, full2.data(), ws2.ptr, ws2.bytes); });  // call 3
    // a handle of another plan
    foreign[r] = error_of([&] { other.finish(q); });
    q.finish();
    // a handle destroyed unfinished (rank 2 only): the next call is rejected on every rank
    {
      AG::Pending d = ag.start(shard_in, full.data(), ws.ptr, ws.bytes);  // call 4
      all_started.add();
      all_started.wait_for(4);  // destroyed once every rank has started: the exchange completes
      if (r != 2) d.finish();
    }
    dropped[r] = error_of([&] { ag(shard_in, full.data(), ws.ptr, ws.bytes); });  // call 5
    after[r] = error_of([&] { ag(shard_in, full.data(), ws.ptr, ws.bytes); });    // call 6 runs
    // out of order across plans: ranks start different plans first
    order[r] = error_of([&] {
      AG::Pending x = (r == 3 ? other : ag).start(shard_in, full.data(), ws.ptr, ws.bytes);
      x.finish();
    });
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(twice[r].find("PendingCall::finish: argument 'pending' = an inactive handle") != std::string::npos);
    CHECK(progress_after[r].find("PendingCall::progress: argument 'pending' = an inactive handle") !=
          std::string::npos);
    CHECK(second[r].find(
              "QuantizedAllGather: argument 'plan' = call 2 started and not finished allows one call in "
              "flight; finish it before call 3") != std::string::npos);
    CHECK(foreign[r].find("QuantizedAllGather::finish: argument 'pending' = a handle of another plan") !=
          std::string::npos);
    if (r == 2)
      CHECK(dropped[r].find("argument 'plan' = call 4 destroyed unfinished") != std::string::npos);
    else
      CHECK(dropped[r].find("rank 2 rejected its arguments; nothing was sent") != std::string::npos);
    CHECK(after[r] == "no error");
    CHECK(order[r].find("ranks disagree on the call") != std::string::npos);
  }
}

TEST_CASE("an all-reduce handle destroyed unfinished is reported once, by the all-reduce plan") {
  Watchdog dog;
  const ShardLayout layout = layout4();
  const auto grads = make_inputs<float>(6, 4, layout.padded_numel(), kNumel);
  std::vector<std::string> first(4), then(4);
  LocalGroup g(4, kTwoNodes);
  g.run([&](LocalTransport& t) {
    const int r = t.rank();
    const Topology topo = Topology::from_node_ids(kTwoNodes, r);
    AR ar(t, topo, layout, Reduce::sum, Hops::one);
    Workspace ws(ar.workspace_bytes());
    const std::vector<float>& grad = grads[static_cast<std::size_t>(r)];
    std::vector<float> out(layout.padded_numel());
    {
      AR::Pending p = ar.start(grad.data(), out.data(), ws.ptr, ws.bytes);
      t.barrier();  // every rank has started the exchange before any handle goes
    }
    first[r] = error_of([&] { ar(grad.data(), out.data(), ws.ptr, ws.bytes); });
    then[r] = error_of([&] { ar(grad.data(), out.data(), ws.ptr, ws.bytes); });
  });
  for (int r = 0; r < 4; ++r) {
    CHECK(first[r].find("QuantizedAllReduce: argument 'plan' = call 1 destroyed unfinished") !=
          std::string::npos);
    CHECK(then[r] == "no error");
  }
}

}  // namespace
