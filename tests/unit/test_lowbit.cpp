// Low bits without the loss, over the in-process transport.
// Error feedback in the quantized reduce-scatter and all-reduce: over 50 steps the delivered sums
// plus the residuals' change equal the true sums within a bound derived from the fp32 roundings
// (one hop and two hops, each hop's residual), the mean delivered gradient is far more accurate
// with feedback than without, states with every hop off give the plain call's bits, and bad
// states are rejected on every rank before anything is sent.
// Hadamard rotation in the plans: a rotated plan equals the plain plan applied to rotated inputs
// and rotated back (bit for bit), errs less on heavy-tailed data, keeps padding out of the
// results, and ranks with different rotations are rejected.
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

// Runs T steps of rs on a constant gradient (step 0's), without and with error feedback; writes
// this rank's mean |error| of the mean delivered gradient into err_plain[me] and err_fb[me], and
// the largest |mean true value| into big (if not null).
template <class Plan>
void mean_errors(Plan& rs, LocalTransport& t, const ShardLayout& layout, int T,
                 std::vector<double>& err_plain, std::vector<double>& err_fb, double* big) {
  const int me = t.rank(), W = t.size();
  const std::size_t S = layout.shard_numel();
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
    for (std::size_t i = 0; i < S; ++i) truth[i] += T * static_cast<double>(xs[layout.shard_offset(me) + i]);
  }
  double ep = 0, ef = 0, m = 0;
  const std::size_t n = layout.valid_in_shard(me);
  for (std::size_t i = 0; i < n; ++i) {
    ep += std::fabs(sum_plain[i] - truth[i]) / T;
    ef += std::fabs(sum_fb[i] - truth[i]) / T;
    m = std::max(m, std::fabs(truth[i]) / T);
  }
  err_plain[static_cast<std::size_t>(me)] = ep / static_cast<double>(n);
  err_fb[static_cast<std::size_t>(me)] = ef / static_cast<double>(n);
  if (big != nullptr) *big = m;
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
  for (Hops hops : {Hops::one, Hops::two}) {
    std::vector<double> err_plain(W), err_fb(W), bound_fb(W);
    LocalGroup g(W, kIds);
    g.run([&](LocalTransport& t) {
      const int me = t.rank();
      const Topology topo = Topology::from_node_ids(kIds, me);
      RS rs(t, topo, layout, Reduce::sum, hops);
      double big = 0;
      mean_errors(rs, t, layout, T, err_plain, err_fb, &big);
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
  auto errors = [&](auto&& fn) { return errors_of(W, ids, fn); };
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

namespace {

// Rotates every span of the first `n` elements of v forward (global index = position).
void rotate_all(std::vector<float>& v, std::size_t n, const Rotation& r, bool forward) {
  for (std::size_t at = 0; at + r.span() <= n; at += r.span())
    forward ? rotate_forward(v.data() + at, r, at) : rotate_inverse(v.data() + at, r, at);
}

// Heavy-tailed gradient: Student-t-like (a Gaussian divided by a random scale), plus outliers.
std::vector<float> heavy(int s, std::size_t padded, std::size_t numel) {
  std::vector<float> g(padded, 0.0f);
  for (std::size_t i = 0; i < numel; ++i) {
    const float u = random_unit(random_bits(77 + s, i)) + 0.05f;
    g[i] = input_value(5, s, i) / u;
    if (i % 509 == 0) g[i] = 200.0f;
  }
  return g;
}

}  // namespace

TEST_CASE("rotation: a rotated plan is the plain plan on rotated inputs, rotated back, bit for bit") {
  const int W = 8;
  const Rotation rot{5, 0xabc};                                       // span 32
  const ShardLayout layout(32 * 150, W, granule_for(4, {F::block}));  // whole spans: no partial span
  const std::size_t P = layout.padded_numel(), S = layout.shard_numel();
  for (Hops hops : {Hops::one, Hops::two}) {
    for (Rounding rounding : {Rounding::nearest, Rounding::stochastic}) {
      const HopOptions h{rounding, 99, rot};
      const HopOptions plain{rounding, 99, Rotation{}};
      LocalGroup g(W, kIds);
      g.run([&](LocalTransport& t) {
        const int me = t.rank();
        const Topology topo = Topology::from_node_ids(kIds, me);
        RS rotated(t, topo, layout, Reduce::mean, hops, ReduceScatterOptions{h, h});
        RS reference(t, topo, layout, Reduce::sum, hops, ReduceScatterOptions{plain, plain});
        QuantizedAllGather<float, F, LocalTransport> ag_rot(t, layout, h), ag_plain(t, layout, plain);
        Workspace ws(std::max({rotated.workspace_bytes(), reference.workspace_bytes(),
                               ag_rot.workspace_bytes(), ag_plain.workspace_bytes()}));
        const std::vector<float> x = heavy(me, P, layout.numel());
        std::vector<float> xr = x;
        rotate_all(xr, P, rot, true);
        std::vector<float> a(S), b(S);
        rotated(x.data(), a.data(), ws.ptr, ws.bytes);
        reference(xr.data(), b.data(), ws.ptr, ws.bytes);
        std::vector<float> back(b);
        for (std::size_t at = 0; at < S; at += rot.span())
          rotate_inverse(back.data() + at, rot, layout.shard_offset(me) + at);
        for (float& v : back) v = fp::div(v, static_cast<float>(W));
        // Data elements equal bit for bit; padding is zero in both (the sign of a rotated zero
        // may differ, so padding compares by value).
        const std::size_t valid = layout.valid_in_shard(me);
        CHECK(std::memcmp(a.data(), back.data(), valid * sizeof(float)) == 0);
        for (std::size_t i = valid; i < S; ++i) CHECK(a[i] == 0.0f);
        // The all-gather of rank 0's tensor, likewise.
        std::vector<float> full_a(P), full_b(P);
        ag_rot(x.data() + layout.shard_offset(me), full_a.data(), ws.ptr, ws.bytes);
        ag_plain(xr.data() + layout.shard_offset(me), full_b.data(), ws.ptr, ws.bytes);
        rotate_all(full_b, P, rot, false);
        CHECK(std::memcmp(full_a.data(), full_b.data(), layout.numel() * sizeof(float)) == 0);
        for (std::size_t i = layout.numel(); i < P; ++i) CHECK(full_a[i] == 0.0f);
      });
    }
  }
}

TEST_CASE("rotation: on heavy-tailed gradients the reduce-scatter errs less; padding stays out") {
  const int W = 8;
  const ShardLayout layout(5000, W, granule_for(4, {64}));  // 5000: the last span is partial
  using G = Int4<64>;
  using RS64 = QuantizedReduceScatter<float, G, G, LocalTransport>;
  for (Hops hops : {Hops::one, Hops::two}) {
    std::vector<double> e_plain(W), e_rot(W);
    LocalGroup g(W, kIds);
    g.run([&](LocalTransport& t) {
      const int me = t.rank();
      const Topology topo = Topology::from_node_ids(kIds, me);
      const HopOptions on{Rounding::nearest, 0, Rotation{6, 17}}, hop2_off{};
      RS64 plain(t, topo, layout, Reduce::sum, hops);
      RS64 rotated(t, topo, layout, Reduce::sum, hops, ReduceScatterOptions{on, on});
      RS64 first_only(t, topo, layout, Reduce::sum, hops, ReduceScatterOptions{on, hop2_off});
      Workspace ws(std::max(plain.workspace_bytes(), rotated.workspace_bytes()));
      const std::vector<float> x = heavy(me, layout.padded_numel(), layout.numel());
      std::vector<float> a(layout.shard_numel()), b(a.size()), c(a.size());
      plain(x.data(), a.data(), ws.ptr, ws.bytes);
      rotated(x.data(), b.data(), ws.ptr, ws.bytes);
      first_only(x.data(), c.data(), ws.ptr, ws.bytes);
      std::vector<double> exact(layout.shard_numel(), 0.0);
      for (int s = 0; s < W; ++s) {
        const std::vector<float> xs = heavy(s, layout.padded_numel(), layout.numel());
        for (std::size_t i = 0; i < layout.valid_in_shard(me); ++i)
          exact[i] += xs[layout.shard_offset(me) + i];
      }
      double ep = 0, er = 0, ec = 0;
      for (std::size_t i = 0; i < layout.shard_numel(); ++i) {
        if (i >= layout.valid_in_shard(me)) {
          REQUIRE(b[i] == 0.0f);  // padding is never data
          REQUIRE(c[i] == 0.0f);
          continue;
        }
        ep += (a[i] - exact[i]) * (a[i] - exact[i]);
        er += (b[i] - exact[i]) * (b[i] - exact[i]);
        ec += (c[i] - exact[i]) * (c[i] - exact[i]);
      }
      e_plain[me] = ep;
      e_rot[me] = er;
      CHECK(ec < ep);
    });
    double sp = 0, sr = 0;
    for (int r = 0; r < W; ++r) sp += e_plain[r], sr += e_rot[r];
    MESSAGE(std::string(hops == Hops::one ? "one hop" : "two hops")
            << ", int4/64, heavy-tailed: squared error " << sp << " plain, " << sr << " rotated");
    CHECK(sr < sp);
  }
}

TEST_CASE("rotation: different seeds or spans are rejected on every rank; a span must divide the block") {
  const int W = 4;
  const std::vector<long long> ids = {0, 0, 1, 1};
  const ShardLayout layout(1000, W, granule_for(4, {F::block}));
  auto msg = errors_of(W, ids, [&](LocalTransport& t) {
    const Topology topo = Topology::from_node_ids(ids, t.rank());
    const HopOptions h{Rounding::nearest, 0, Rotation{5, t.rank() == 2 ? 8u : 7u}};
    RS rs(t, topo, layout, Reduce::sum, Hops::two, ReduceScatterOptions{h, h});
  });
  for (const auto& m : msg) {
    CHECK(has(m, "ranks disagree on the call (rotation: #"));
    CHECK(has(m, "(ranks 0,1,3) vs #"));
    CHECK(has(m, "second rotation: #"));
  }
  msg = errors_of(W, ids, [&](LocalTransport& t) {
    QuantizedAllGather<float, F, LocalTransport> ag(t, layout,
                                                    HopOptions{Rounding::nearest, 0, Rotation{6, 1}});
  });
  for (const auto& m : msg) CHECK(m.find("does not divide the block") != std::string::npos);
}

TEST_CASE("rotation and error feedback together: the mean delivered gradient stays far more accurate") {
  // As the feedback test above, with a rotation on both hops: the residual (kept unrotated) still
  // carries each step's error, so the sum over T steps is off by the final residuals only, rotated.
  const int W = 8, T = 50;
  const ShardLayout layout(2048, W, granule_for(4, {F::block}));
  std::vector<double> err_plain(W), err_fb(W);
  LocalGroup g(W, kIds);
  g.run([&](LocalTransport& t) {
    const Topology topo = Topology::from_node_ids(kIds, t.rank());
    const HopOptions h{Rounding::nearest, 0, Rotation{5, 3}};
    RS rs(t, topo, layout, Reduce::sum, Hops::two, ReduceScatterOptions{h, h});
    mean_errors(rs, t, layout, T, err_plain, err_fb, nullptr);
  });
  for (int r = 0; r < W; ++r) CHECK(err_fb[r] * 10 < err_plain[r]);
}

TEST_CASE("rotation in every stage of the all-reduce: the reduce-scatter then the all-gather, bit for bit") {
  const int W = 8;
  using G = Int8<32>;
  const ShardLayout layout(3001, W, granule_for(4, {F::block, G::block}));
  const HopOptions h1{Rounding::nearest, 0, Rotation{5, 11}}, h2{Rounding::stochastic, 4, Rotation{3, 12}};
  const HopOptions hg{Rounding::nearest, 0, Rotation{4, 13}};
  LocalGroup g(W, kIds);
  g.run([&](LocalTransport& t) {
    const int me = t.rank();
    const Topology topo = Topology::from_node_ids(kIds, me);
    QuantizedAllReduce<float, F, F, G, LocalTransport> ar(t, topo, layout, Reduce::mean, Hops::two,
                                                          ReduceScatterOptions{h1, h2}, hg);
    RS rs(t, topo, layout, Reduce::mean, Hops::two, ReduceScatterOptions{h1, h2});
    QuantizedAllGather<float, G, LocalTransport> ag(t, layout, hg), plain(t, layout, HopOptions{});
    Workspace ws(std::max({ar.workspace_bytes(), rs.workspace_bytes(), ag.workspace_bytes()}));
    const std::vector<float> x = heavy(me, layout.padded_numel(), layout.numel());
    std::vector<float> out(layout.padded_numel()), shard(layout.shard_numel()), full(layout.padded_numel()),
        unrotated(layout.padded_numel());
    ar(x.data(), out.data(), ws.ptr, ws.bytes);
    rs(x.data(), shard.data(), ws.ptr, ws.bytes);
    ag(shard.data(), full.data(), ws.ptr, ws.bytes);
    plain(shard.data(), unrotated.data(), ws.ptr, ws.bytes);
    CHECK(same_bits(out, full));
    CHECK(!same_bits(out, unrotated));  // the gather stage's rotation took effect
  });
}
