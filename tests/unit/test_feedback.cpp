// Error feedback in the quantized reduce-scatter and all-reduce over the in-process transport:
// over 50 steps the delivered sums plus the residuals' change equal the true sums within a bound
// derived from the fp32 roundings (one hop and two hops, each hop's residual), the mean delivered
// gradient is far more accurate with feedback than without, states with every hop off give the
// plain call's bits, and bad states are rejected on every rank before anything is sent.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>

#include <qcoll/collective/reduce_scatter.hpp>
#include <qcoll/transport/local.hpp>

#include "../common/collective_harness.hpp"

using namespace qcoll;
using namespace harness;

namespace {

constexpr double kU = 1.0 / (1 << 24);
const std::vector<long long> kIds = {0, 1, 0, 1, 0, 1, 0, 1};  // 8 ranks, 2 nodes, round-robin
using F = Int4<32>;
using RS = QuantizedReduceScatter<float, F, F, LocalTransport>;

// A rank's residual spans (fp32 storage) inside its state.
struct Spans {
  detail::ResidualSpan hop1, hop2;
};
Spans spans_of(void* state, std::size_t n1, std::size_t n2) {
  const detail::ResidualLayout l{n1, n2, ResidualStorage::f32};
  auto* d = static_cast<unsigned char*>(state);
  return Spans{{d + l.hop1_offset(), n1, ResidualStorage::f32},
               {d + l.hop2_offset(), n2, ResidualStorage::f32}};
}

std::vector<float> read(const detail::ResidualSpan& s) {
  std::vector<float> v(s.n);
  for (std::size_t i = 0; i < s.n; ++i) v[i] = s.get(i);
  return v;
}

// Step t's gradient of rank s (0 in the padding).
std::vector<float> gradient(int s, int t, const ShardLayout& layout) {
  std::vector<float> g(layout.padded_numel(), 0.0f);
  for (std::size_t i = 0; i < layout.numel(); ++i)
    g[i] = input_value(1000 + static_cast<std::uint64_t>(t), s, i);
  return g;
}

}  // namespace

TEST_CASE("error feedback: delivered sums plus the residuals' change equal the true sums, over 50 steps") {
  const int W = 8, T = 50;
  for (Hops hops : {Hops::one, Hops::two}) {
    const ShardLayout layout(4000, W, granule_for(4, {F::block}));
    const std::size_t P = layout.padded_numel(), S = layout.shard_numel();
    std::vector<std::vector<float>> x(W), e1p(W), e1n(W), e2p(W), e2n(W);
    std::vector<std::vector<double>> delivered(W, std::vector<double>(S, 0.0)),
        truth(W, std::vector<double>(S, 0.0)), slack(W, std::vector<double>(S, 0.0));
    LocalGroup g(W, kIds);
    g.run([&](LocalTransport& t) {
      const int me = t.rank();
      const Topology topo = Topology::from_node_ids(kIds, me);
      const int N = topo.num_nodes(), L = topo.ranks_per_node();
      RS rs(t, topo, layout, Reduce::sum, hops);
      Workspace ws(rs.workspace_bytes()), state(rs.residual_bytes());
      rs.init_residual(state.ptr, state.bytes);
      const Spans sp = spans_of(state.ptr, P, hops == Hops::two ? S * N : 0);
      e1n[me] = read(sp.hop1);
      e2n[me] = read(sp.hop2);
      std::vector<float> out(S);
      for (int step = 0; step < T; ++step) {
        x[me] = gradient(me, step, layout);
        e1p[me] = e1n[me];
        e2p[me] = e2n[me];
        rs(x[me].data(), out.data(), ws.ptr, ws.bytes, ResidualState{state.ptr, state.bytes});
        e1n[me] = read(sp.hop1);
        e2n[me] = read(sp.hop2);
        for (std::size_t i = 0; i < S; ++i) delivered[me][i] += out[i];
        t.barrier();
        // This step's fp32 roundings for rank me's element i. Exactly, out = sum over ranks s of
        // (x_s + e1_s - e1'_s) (+ sum over intermediates k of (e2_k - e2'_k)); each of the
        // following rounds once: v1 = x + e1 (<= u|v1|), e1' = v1 - c1 (<= u|e1'|), the hop-1 sum
        // of L (one hop: W) decoded values c1 (<= L u sum|c1|), v2 = p + e2 and e2' = v2 - c2,
        // the hop-2 sum of N values c2. |c| <= |v| + |e'|. A factor 1.01 covers second order.
        const int owner_node = topo.node_of(me), j = topo.local_index_of(me);
        for (std::size_t i = 0; i < layout.valid_in_shard(me); ++i) {
          const std::size_t gi = layout.shard_offset(me) + i;
          double b = 0, sum_c1 = 0;
          for (int s = 0; s < W; ++s) {
            const double v1 = std::fabs(x[s][gi]) + std::fabs(e1p[s][gi]), c1 = v1 + std::fabs(e1n[s][gi]);
            b += v1 + std::fabs(e1n[s][gi]);
            sum_c1 += c1;
            truth[me][i] += x[s][gi];
          }
          if (hops == Hops::one) {
            b += W * sum_c1;
          } else {
            b += L * sum_c1;
            double sum_c2 = 0;
            for (int m = 0; m < N; ++m) {
              const int k = topo.rank_at(m, j);
              double p = 0;
              for (int l = 0; l < L; ++l) {
                const int s = topo.rank_at(m, l);
                p += std::fabs(x[s][gi]) + std::fabs(e1p[s][gi]) + std::fabs(e1n[s][gi]);
              }
              const std::size_t at = static_cast<std::size_t>(owner_node) * S + i;
              const double v2 = p + std::fabs(e2p[k][at]);
              b += v2 + std::fabs(e2n[k][at]);
              sum_c2 += v2 + std::fabs(e2n[k][at]);
            }
            b += N * sum_c2;
          }
          slack[me][i] += 1.01 * kU * b;
        }
        t.barrier();
      }
      // sum_t out = sum_t sum_s x - sum_s e1_T - sum_k e2_T (the states started at 0).
      const int owner_node = topo.node_of(me), j = topo.local_index_of(me);
      int bad = 0;
      double worst = 0;
      for (std::size_t i = 0; i < layout.valid_in_shard(me); ++i) {
        const std::size_t gi = layout.shard_offset(me) + i;
        double carried = 0;
        for (int s = 0; s < W; ++s) carried += e1n[s][gi];
        if (hops == Hops::two)
          for (int m = 0; m < N; ++m)
            carried += e2n[topo.rank_at(m, j)][static_cast<std::size_t>(owner_node) * S + i];
        const double gap = std::fabs(delivered[me][i] - (truth[me][i] - carried));
        worst = std::max(worst, gap / slack[me][i]);
        bad += gap > slack[me][i];
      }
      CHECK_MESSAGE(bad == 0, "rank " << me << ", " << std::string(hops == Hops::one ? "one hop" : "two hops")
                                      << ": worst gap " << worst << " x its bound");
    });
  }
}

TEST_CASE("error feedback: the mean delivered gradient over 50 steps is far more accurate") {
  // A constant gradient: without feedback every step makes the same rounding error, so the mean
  // error is the quantization error itself; with it, the sum over T steps is off by the final
  // residuals only (the identity above), so the mean error is at most sum |e_T| / T plus the
  // accumulated fp32 rounding. The check: feedback's mean error respects that bound, and is at
  // least 10 times below the plain one (T = 50).
  const int W = 8, T = 50;
  const ShardLayout layout(2048, W, granule_for(4, {F::block}));
  const std::size_t S = layout.shard_numel();
  for (Hops hops : {Hops::one, Hops::two}) {
    std::vector<double> err_plain(W), err_fb(W), bound_fb(W);
    LocalGroup g(W, kIds);
    g.run([&](LocalTransport& t) {
      const int me = t.rank();
      const Topology topo = Topology::from_node_ids(kIds, me);
      RS rs(t, topo, layout, Reduce::sum, hops);
      Workspace ws(rs.workspace_bytes()), state(rs.residual_bytes());
      rs.init_residual(state.ptr, state.bytes);
      const std::vector<float> x = gradient(me, 0, layout);
      std::vector<double> sum_plain(S, 0.0), sum_fb(S, 0.0), truth(S, 0.0);
      std::vector<float> out(S);
      for (int step = 0; step < T; ++step) {
        rs(x.data(), out.data(), ws.ptr, ws.bytes);
        for (std::size_t i = 0; i < S; ++i) sum_plain[i] += out[i];
        rs(x.data(), out.data(), ws.ptr, ws.bytes, ResidualState{state.ptr, state.bytes});
        for (std::size_t i = 0; i < S; ++i) sum_fb[i] += out[i];
      }
      for (int s = 0; s < W; ++s) {
        const std::vector<float> xs = gradient(s, 0, layout);
        for (std::size_t i = 0; i < S; ++i)
          truth[i] += T * static_cast<double>(xs[layout.shard_offset(me) + i]);
      }
      double ep = 0, ef = 0, big = 0;
      for (std::size_t i = 0; i < layout.valid_in_shard(me); ++i) {
        ep += std::fabs(sum_plain[i] - truth[i]) / T;
        ef += std::fabs(sum_fb[i] - truth[i]) / T;
        big = std::max(big, std::fabs(truth[i]) / T);
      }
      const double n = static_cast<double>(layout.valid_in_shard(me));
      err_plain[me] = ep / n;
      err_fb[me] = ef / n;
      // A residual is at most half a step of its block: for int4, absmax(v) / 14 with
      // v = x + e. Inputs are below 3 in magnitude (input_value: 4 uniforms minus 2, times at
      // most 1.5), so |e1| <= (3 + |e1|) / 14, i.e. |e1| <= 3 / 13. A hop-2 partial sum of L
      // decoded values is below L (3 + 2 |e1|), so |e2| <= L (3 + 2 * 3 / 13) / 13. An element's
      // sum carries W hop-1 and (two hops) N hop-2 residuals; the mean over T steps divides them
      // by T. The fp32 roundings of the T delivered sums add at most 4 W^2 u max|sum| per step.
      const double e1 = 3.0 / 13 * (1 + 1e-6), e2 = topo.ranks_per_node() * (3 + 2 * e1) / 13 * (1 + 1e-6);
      bound_fb[me] =
          (W * e1 + (hops == Hops::two ? topo.num_nodes() * e2 : 0.0)) / T + 4.0 * W * W * big * kU;
    });
    for (int r = 0; r < W; ++r) {
      CHECK(err_fb[r] <= bound_fb[r]);
      CHECK(err_fb[r] * 10 < err_plain[r]);
    }
    MESSAGE(std::string(hops == Hops::one ? "one hop" : "two hops")
            << ": mean |error| of the mean delivered gradient, rank 0: " << err_plain[0] << " plain, "
            << err_fb[0] << " with feedback");
  }
}

TEST_CASE("error feedback off in every hop, or a fresh state's first step, gives the plain call's bits") {
  const int W = 8;
  const ShardLayout layout(3001, W, granule_for(4, {F::block}));
  LocalGroup g(W, kIds);
  g.run([&](LocalTransport& t) {
    const int me = t.rank();
    const Topology topo = Topology::from_node_ids(kIds, me);
    RS rs(t, topo, layout, Reduce::mean, Hops::two);
    FeedbackOptions off;
    off.hop1 = off.hop2 = false;
    Workspace ws(rs.workspace_bytes()), s_off(rs.residual_bytes(off)), s_on(rs.residual_bytes());
    rs.init_residual(s_off.ptr, s_off.bytes, off);
    rs.init_residual(s_on.ptr, s_on.bytes);
    const std::vector<float> x = gradient(me, 3, layout);
    std::vector<float> plain(layout.shard_numel()), a(plain.size()), b(plain.size());
    rs(x.data(), plain.data(), ws.ptr, ws.bytes);
    rs(x.data(), a.data(), ws.ptr, ws.bytes, ResidualState{s_off.ptr, s_off.bytes});
    rs(x.data(), b.data(), ws.ptr, ws.bytes, ResidualState{s_on.ptr, s_on.bytes});
    CHECK(same_bits(plain, a));
    CHECK(same_bits(plain, b));  // the state starts at zero: x + 0 is x
  });
}

TEST_CASE("error feedback through the all-reduce, and compact bf16 residuals with decay") {
  const int W = 8, T = 20;
  const ShardLayout layout(1000, W, granule_for(4, {F::block}));
  for (ResidualStorage storage : {ResidualStorage::f32, ResidualStorage::bf16}) {
    std::vector<double> err(W);
    LocalGroup g(W, kIds);
    g.run([&](LocalTransport& t) {
      const int me = t.rank();
      const Topology topo = Topology::from_node_ids(kIds, me);
      QuantizedAllReduce<float, F, F, Int8<32>, LocalTransport> ar(t, topo, layout, Reduce::sum);
      FeedbackOptions fb;
      fb.storage = storage;
      fb.decay = storage == ResidualStorage::bf16 ? 0.9f : 1.0f;
      Workspace ws(ar.workspace_bytes()), state(ar.residual_bytes(fb));
      CHECK(state.bytes < ar.residual_bytes() + (storage == ResidualStorage::f32 ? 1 : 0));
      ar.init_residual(state.ptr, state.bytes, fb);
      const std::vector<float> x = gradient(me, 1, layout);
      std::vector<float> out(layout.padded_numel());
      std::vector<double> sum(layout.numel(), 0.0), truth(layout.numel(), 0.0);
      for (int step = 0; step < T; ++step) {
        ar(x.data(), out.data(), ws.ptr, ws.bytes, ResidualState{state.ptr, state.bytes});
        for (std::size_t i = 0; i < layout.numel(); ++i) sum[i] += out[i];
      }
      for (int s = 0; s < W; ++s) {
        const std::vector<float> xs = gradient(s, 1, layout);
        for (std::size_t i = 0; i < layout.numel(); ++i) truth[i] += T * static_cast<double>(xs[i]);
      }
      double e = 0;
      for (std::size_t i = 0; i < layout.numel(); ++i) e += std::fabs(sum[i] - truth[i]) / T;
      err[me] = e / static_cast<double>(layout.numel());
    });
    // Every rank delivers the same all-reduced values, so the same error.
    for (int r = 1; r < W; ++r) CHECK(err[r] == err[0]);
    MESSAGE("all-reduce with feedback ("
            << std::string(storage == ResidualStorage::f32 ? "f32" : "bf16, decay 0.9")
            << "): mean |error| of the mean " << err[0]);
  }
}

TEST_CASE("error feedback: a state of another plan, of the wrong size or never initialised is rejected") {
  const int W = 4;
  const std::vector<long long> ids = {0, 0, 1, 1};
  const ShardLayout a(1000, W, granule_for(4, {F::block})), b(1100, W, granule_for(4, {F::block}));
  auto errors = [&](auto&& fn) {
    std::vector<std::string> msg(W);
    LocalGroup g(W, ids);
    g.run([&](LocalTransport& t) {
      try {
        fn(t);
        msg[t.rank()] = "no error";
      } catch (const Error& e) {
        msg[t.rank()] = e.what();
      }
    });
    return msg;
  };
  for (int fault = 0; fault < 4; ++fault) {
    std::vector<float> untouched(W, 0.0f);
    auto msg = errors([&](LocalTransport& t) {
      const Topology topo = Topology::from_node_ids(ids, t.rank());
      RS ra(t, topo, a, Reduce::sum), rb(t, topo, b, Reduce::sum);
      Workspace ws(ra.workspace_bytes()), state(std::max(ra.residual_bytes(), rb.residual_bytes()));
      ra.init_residual(state.ptr, state.bytes);
      std::vector<float> grad(a.padded_numel(), 1.0f), out(a.shard_numel(), 9.0f);
      ResidualState rs{state.ptr, state.bytes};
      if (t.rank() == 1) {
        if (fault == 0) rb.init_residual(state.ptr, state.bytes);      // another plan's
        if (fault == 1) rs.bytes = ra.residual_bytes() - 1;            // too small
        if (fault == 2) std::memset(state.ptr, 0, 64);                 // never initialised
        if (fault == 3) rs.data = static_cast<char*>(state.ptr) + 16;  // misaligned
      }
      try {
        ra(grad.data(), out.data(), ws.ptr, ws.bytes, rs);
      } catch (...) {
        untouched[t.rank()] = out[0];
        throw;
      }
    });
    const char* want[] = {"the state of another plan", "'residual bytes'", "without a residual header",
                          "not aligned to 64"};
    CHECK_MESSAGE(msg[1].find(want[fault]) != std::string::npos, msg[1]);
    for (int r : {0, 2, 3}) CHECK(msg[r].find("rank 1 rejected its arguments") != std::string::npos);
    for (int r = 0; r < W; ++r) CHECK(untouched[r] == 9.0f);
  }
}
