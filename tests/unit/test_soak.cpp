// Soak: many random collectives over the in-process transport (plan kind, format, size, op, 2..8
// ranks, random placements that are not node-major), each compared with the fp64 result of the
// unquantized operation within a bound derived from its formats, with resident memory and time
// per element reported by quarter. CI runs a short version; the full one is
//   QCOLL_SOAK_CALLS=10000 QCOLL_SOAK_MAX_NUMEL=1000000 build/tests/unit/test_soak
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include <qcoll/transport/local.hpp>

#include "../common/collective_harness.hpp"

using namespace qcoll;
using namespace harness;

namespace {

// Largest error of one element after a round trip through F, as a fraction of the largest |x| of
// its block (A): from the formats' arithmetic (docs/formats.md).
//  - symmetric int: scale = A / q, error <= scale / 2;
//  - FP8 E4M3 with fp32 scale A / 448: half the spacing at |x| (2^-4 |x| <= 2^-4 A) or, below the
//    normal range, half the subnormal spacing (2^-10 * A / 448);
//  - MXFP4: scale 2^(floor(log2 A) - 2), so A / scale is in [4, 8); E2M1's largest spacing is 2
//    (half: 1 scale) and values past its max normal 6 saturate by less than 2 scales: <= A / 2.
// Each gets a few fp32 roundings of A on top (scale division and the decode product). Stochastic
// rounding may land on either neighbour of a value: up to a whole spacing, twice the above.
template <class F>
double relative_bound(Rounding rounding) {
  double r = 0;
  if constexpr (F::id == FormatId::int8 || F::id == FormatId::int4) r = 0.5 / F::qmax;
  if constexpr (F::id == FormatId::fp8_e4m3) r = std::ldexp(1.0, -4);
  if constexpr (F::id == FormatId::mxfp4) r = 0.5;
  return (rounding == Rounding::stochastic ? 2 : 1) * r + 4 * std::ldexp(1.0, -24);
}

struct Env {
  long calls;
  std::size_t max_numel;
};
Env read_env() {
  auto get = [](const char* name, long dflt) {
    const char* v = std::getenv(name);
    return v != nullptr ? std::atol(v) : dflt;
  };
  return Env{get("QCOLL_SOAK_CALLS", 120), static_cast<std::size_t>(get("QCOLL_SOAK_MAX_NUMEL", 20000))};
}

double rss_mib() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return static_cast<double>(resident) * 4096.0 / (1024.0 * 1024.0);
}

struct Case {
  int kind;  // 0 all-gather, 1 reduce-scatter one hop, 2 two hops, 3 all-reduce (two hops)
  int world, per_node;
  std::vector<long long> ids;
  std::size_t numel;
  Reduce op;
  Rounding rounding;
  std::uint64_t seed;
};

// Runs one case with format F on every hop; returns the largest error over its bound (<= 1 passes).
template <class F>
double run_case(const Case& c) {
  const int W = c.world;
  const ShardLayout layout(c.numel, W, granule_for(4, {F::block}));
  host::QuantizeOptions opt;
  opt.rounding = c.rounding;
  opt.seed = c.seed;
  const auto in = make_inputs<float>(c.seed, W, layout.padded_numel(), c.numel);
  double A = 0;  // largest |input| of any rank: bounds every block's absmax
  for (const auto& v : in)
    for (std::size_t i = 0; i < c.numel; ++i) A = std::max(A, std::fabs(static_cast<double>(v[i])));
  const double r = relative_bound<F>(c.rounding);
  std::vector<std::vector<float>> out(static_cast<std::size_t>(W));
  LocalGroup g(W, c.ids);
  g.run([&](LocalTransport& t) {
    const int me = t.rank();
    const Topology topo = Topology::from_node_ids(c.ids, me);
    std::vector<float>& o = out[static_cast<std::size_t>(me)];
    if (c.kind == 0) {
      QuantizedAllGather<float, F, LocalTransport> ag(t, layout, opt);
      Workspace ws(ag.workspace_bytes());
      o.assign(layout.padded_numel(), -1.0f);
      ag(in[0].data() + layout.shard_offset(me), o.data(), ws.ptr, ws.bytes);
    } else if (c.kind < 3) {
      QuantizedReduceScatter<float, F, F, LocalTransport> rs(t, topo, layout, c.op,
                                                             c.kind == 1 ? Hops::one : Hops::two, opt);
      Workspace ws(rs.workspace_bytes());
      o.assign(layout.shard_numel(), -1.0f);
      rs(in[static_cast<std::size_t>(me)].data(), o.data(), ws.ptr, ws.bytes);
    } else {
      QuantizedAllReduce<float, F, F, F, LocalTransport> ar(t, topo, layout, c.op, Hops::two, opt);
      Workspace ws(ar.workspace_bytes());
      o.assign(layout.padded_numel(), -1.0f);
      ar(in[static_cast<std::size_t>(me)].data(), o.data(), ws.ptr, ws.bytes);
    }
  });
  double worst = 0;
  auto check = [&](double got, double want, double bound) {
    if (std::isnan(got))
      worst = 1e300;
    else
      worst = std::max(worst, std::fabs(got - want) / bound);
  };
  if (c.kind == 0) {
    // The gathered tensor is in[0]: rank q contributed its shard; every rank holds all of it.
    for (int q = 0; q < W; ++q)
      for (std::size_t i = 0; i < layout.padded_numel(); ++i)
        check(out[static_cast<std::size_t>(q)][i], i < c.numel ? in[0][i] : 0.0, r * A + 1e-30);
    return worst;
  }
  // Reduce-scatter: W contributions err by r * A each; for two hops a partial sum of L
  // contributions (at most L * A * (1 + r)) is re-quantized, N times; fp32 accumulation adds one
  // rounding per addition of values bounded by W * A * (1 + r); mean divides by W.
  const int L = c.per_node, N = W / L;
  double e = W * r * A;
  if (c.kind >= 2) e += N * r * L * A * (1 + r);
  e += 2.0 * W * W * A * (1 + r) * std::ldexp(1.0, -24);
  if (c.op == Reduce::mean) e /= W;
  std::vector<double> exact(layout.padded_numel(), 0.0);
  for (const auto& v : in)
    for (std::size_t i = 0; i < c.numel; ++i) exact[i] += v[i];
  double big = 0;
  for (double& x : exact) {
    if (c.op == Reduce::mean) x /= W;
    big = std::max(big, std::fabs(x));
  }
  const double rounding = (big + e) * std::ldexp(1.0, -23);
  if (c.kind < 3) {
    for (int q = 0; q < W; ++q)
      for (std::size_t i = 0; i < layout.shard_numel(); ++i)
        check(out[static_cast<std::size_t>(q)][i], exact[layout.shard_offset(q) + i], e + rounding + 1e-30);
    return worst;
  }
  // All-reduce: the gather re-quantizes the reduced values (blocks of absmax <= big + e).
  const double e3 = e + r * (big + e) + rounding;
  for (int q = 0; q < W; ++q)
    for (std::size_t i = 0; i < layout.padded_numel(); ++i)
      check(out[static_cast<std::size_t>(q)][i], exact[i], e3 + 1e-30);
  return worst;
}

const char* const kFormatNames[] = {"int8/32", "int4/64", "e4m3/128", "mxfp4"};

double run_any(int format, const Case& c) {
  switch (format) {
    case 0: return run_case<Int8<32>>(c);
    case 1: return run_case<Int4<64>>(c);
    case 2: return run_case<Fp8E4M3<128>>(c);
    default: return run_case<MxFp4>(c);
  }
}

}  // namespace

TEST_CASE("soak: random collectives stay within their formats' bounds, memory and time flat") {
  const Env env = read_env();
  std::mt19937_64 rng(20261130);
  const auto t0 = std::chrono::steady_clock::now();
  double quarter_seconds[4] = {}, quarter_elements[4] = {}, quarter_rss[4] = {};
  long failures = 0;
  for (long k = 0; k < env.calls; ++k) {
    Case c;
    c.kind = static_cast<int>(rng() % 4);
    c.world = 2 + static_cast<int>(rng() % 7);
    std::vector<int> divisors;
    for (int d = 1; d <= c.world; ++d)
      if (c.world % d == 0) divisors.push_back(d);
    c.per_node = divisors[rng() % divisors.size()];
    // A random placement: rank perm[k] sits on node k / per_node.
    std::vector<int> perm(static_cast<std::size_t>(c.world));
    for (int r = 0; r < c.world; ++r) perm[static_cast<std::size_t>(r)] = r;
    std::shuffle(perm.begin(), perm.end(), rng);
    c.ids.assign(static_cast<std::size_t>(c.world), 0);
    for (int i = 0; i < c.world; ++i)
      c.ids[static_cast<std::size_t>(perm[static_cast<std::size_t>(i)])] = 50 + i / c.per_node;
    // Sizes log-uniform over [1, max], and 0 now and then.
    const double lg = std::log(static_cast<double>(env.max_numel) + 1.0);
    c.numel =
        rng() % 16 == 0
            ? 0
            : static_cast<std::size_t>(std::exp(lg * std::uniform_real_distribution<double>(0, 1)(rng)));
    c.numel = std::min(c.numel, env.max_numel);
    c.op = rng() % 2 ? Reduce::sum : Reduce::mean;
    c.rounding = rng() % 4 == 0 ? Rounding::stochastic : Rounding::nearest;
    c.seed = rng();
    const int format = static_cast<int>(rng() % 4);
    const auto s = std::chrono::steady_clock::now();
    const double worst = run_any(format, c);
    const int q = static_cast<int>(4 * k / env.calls);
    quarter_seconds[q] += std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count();
    quarter_elements[q] += static_cast<double>(c.numel) * c.world;
    quarter_rss[q] = std::max(quarter_rss[q], rss_mib());
    if (!(worst <= 1.0)) {
      ++failures;
      MESSAGE("call " << k << ": kind " << c.kind << " format " << std::string(kFormatNames[format]) << " W "
                      << c.world << " L " << c.per_node << " numel " << c.numel << " rounding "
                      << static_cast<int>(c.rounding) << ": error " << worst << " x its bound");
    }
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int q = 0; q < 4; ++q)
    std::printf("soak quarter %d: %.1f ns per element and rank, peak resident %.1f MiB\n", q + 1,
                quarter_elements[q] > 0 ? 1e9 * quarter_seconds[q] / quarter_elements[q] : 0.0,
                quarter_rss[q]);
  std::printf("soak: %ld calls (numel up to %zu) in %.1f s, %ld outside their bound\n", env.calls,
              env.max_numel, total, failures);
  CHECK(failures == 0);
  // Flat memory: after the first quarter has seen the size range, the peak does not keep growing
  // by more than one largest working set (inputs and outputs of 8 ranks, ~100 bytes an element).
  if (env.calls >= 400)
    CHECK(quarter_rss[3] <= quarter_rss[0] + 100.0 * env.max_numel / (1024.0 * 1024.0) + 16.0);
}
