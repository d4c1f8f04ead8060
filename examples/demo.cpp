// qcoll demo: trains a small MLP with ZeRO-3-style sharding over 8 ranks on 2 nodes, with plain
// collectives, with ZeRO++ (qwZ + hpZ + qgZ), and with low-bit configurations past ZeRO++ (int4
// weights, error feedback, Hadamard rotation, ZeRO-2 with qWD), and compares loss, bytes and time.
// Run with --help for the options. Exit status: 0 when the ZeRO++ final loss is within 2% of the
// plain one and the best low-bit configuration (at least 8x fewer cross-node bytes) is within 1%,
// 1 when not, 2 on a bad command line, 3 on an error.

#ifndef QCOLL_HAVE_MPI
#define QCOLL_HAVE_MPI 0
#endif

#include "demo_model.hpp"

#if QCOLL_HAVE_MPI
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // the C API only
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <qcoll/transport/mpi.hpp>
#endif

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

using qcoll_demo::Bytes;
using qcoll_demo::DemoConfig;
using qcoll_demo::RunResult;
using qcoll_demo::Techniques;

constexpr double kTolerance = 0.02;        // ZeRO++ final loss must be within 2% of the plain one
constexpr double kLowBitTolerance = 0.01;  // the best low-bit configuration: within 1% ...
constexpr double kLowBitRatio = 8.0;       // ... with at least 8x fewer cross-node bytes

// The low-bit configurations the default run adds after plain and ZeRO++.
struct LowBit {
  const char* name;
  Techniques techniques;
};
const LowBit kLowBit[] = {
    {"ZeRO-3, int4 weights: qwZ int4 + Hadamard, hpZ, qgZ int4 + feedback + Hadamard",
     Techniques{true, true, true, true, true, true, false}},
    {"ZeRO-2 + qWD: int4 weight differences, qgZ int4",
     Techniques{false, false, true, false, false, false, true}},
    {"ZeRO-2 + qWD: int4 weight differences, qgZ int4 + feedback + Hadamard",
     Techniques{false, false, true, true, true, false, true}},
};

struct Options {
  DemoConfig config;
  Techniques zeropp{true, true, true};
  int print_every = 5;
  bool low_bit = true;
  bool prefetch = true;
  bool mpi = false;
  bool help = false;
};

void print_help(const char* prog) {
  std::printf(
      "Usage: %s [options]\n"
      "\n"
      "Trains a small MLP (ReLU, fp32 master weights, Adam) to imitate a fixed random teacher network\n"
      "on synthetic data, with ZeRO-3-style sharding: each layer's weight matrix and bias form one\n"
      "tensor group (each tensor in its own whole blocks) cut into one shard per rank; each rank keeps\n"
      "the fp32 master weights and Adam state of its shards only. Every step, layer by layer: all-\n"
      "gather the layer's bf16 weights and compute it (forward; the next layer's gather is started\n"
      "before the layer computes, so it runs meanwhile), then in reverse: gather the weights again\n"
      "(the next one prefetched likewise), backpropagate, and start the reduce-scatter (mean) of the\n"
      "layer's bf16 gradient, finished before the Adam update of the own shards.\n"
      "The job runs from the same seed as:\n"
      "  plain   bf16 all-gathers, bf16 one-hop reduce-scatter (ZeRO-3)\n"
      "  ZeRO++  qwZ: int8 forward all-gather (block 256, one fp32 scale per block)\n"
      "          hpZ: backward gather from a node-local secondary shard (no bytes across nodes)\n"
      "          qgZ: int4 two-hop reduce-scatter (inside the node, then across nodes)\n"
      "It prints the training loss of both runs, the bytes each rank sends per step inside and\n"
      "across nodes, the time per step and the part of it spent in communication calls (blocking\n"
      "calls, start, progress, finish), then checks that the ZeRO++ final loss (held-out set, trained\n"
      "fp32 weights) is within 2%% of the plain one. It trains ZeRO++ a second time with blocking calls\n"
      "instead of prefetch (same plans, same results) to compare the communication wait.\n"
      "Then it trains the low-bit configurations past ZeRO++ (int4 weights with Hadamard rotation,\n"
      "error feedback; ZeRO-2, where every rank keeps all weights and receives the owners' updates\n"
      "as int4 weight differences, qWD) and prints, for every configuration, the cross-node bytes per\n"
      "step and rank, the ratio to plain, and the final loss; it checks that the best one sending at\n"
      "least 8x fewer cross-node bytes than plain ends within 1%% of plain.\n"
      "\n"
      "Ranks are threads of this process, placed node-major on --nodes simulated nodes. Under mpirun\n"
      "(or with --mpi) in a build with MPI, the MPI processes are the ranks instead; --nodes still\n"
      "sets the simulated node placement (node = rank / (ranks / nodes)).\n"
      "\n"
      "Options (value as --name N or --name=N):\n"
      "  --ranks N     ranks (default 8; ignored under MPI, where the job size counts)\n"
      "  --nodes N     nodes; must divide the ranks (default 2)\n"
      "  --steps N     training steps (default 40)\n"
      "  --hidden N    hidden layer width (default 1024)\n"
      "  --layers N    weight layers, i.e. N-1 hidden layers (default 3; the default model has\n"
      "                %zu parameters)\n"
      "  --batch N     samples per rank per step (default 16)\n"
      "  --lr X        Adam learning rate (default 0.001)\n"
      "  --seed N      seed of the teacher, the data and the initial weights (default 1)\n"
      "  --print N     print the loss every N steps (default 5)\n"
      "  --no-qwz      ZeRO++ run: bf16 forward all-gather instead of int8\n"
      "  --no-hpz      ZeRO++ run: backward all-gather over all ranks instead of hpZ\n"
      "  --no-qgz      ZeRO++ run: bf16 one-hop reduce-scatter instead of int4 two-hop\n"
      "  --no-low-bit  skip the low-bit configurations past ZeRO++\n"
      "  --no-prefetch every run with blocking calls (no prefetch, no overlapped reduce-scatter); skips\n"
      "                the second ZeRO++ run\n"
      "  --mpi         run on MPI ranks (default when started by mpirun/mpiexec; needs an MPI build)\n"
      "  --help        this text\n"
      "\n"
      "Exit status: 0 pass, 1 ZeRO++ not within 2%% of plain or no low-bit configuration with 8x\n"
      "fewer cross-node bytes within 1%%, 2 bad option, 3 error.\n",
      prog, qcoll_demo::Mlp::student(DemoConfig{}).numel());
}

[[noreturn]] void bad_option(const std::string& message) {
  std::fprintf(stderr, "demo: %s (see --help)\n", message.c_str());
  std::exit(2);
}

long long parse_int(const std::string& name, const std::string& value, long long lo, long long hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno != 0 || v < lo || v > hi)
    bad_option("option " + name + " needs an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
               "], got '" + value + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    bool has_value = false;
    const std::size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto flag = [&](bool& target, bool v) {
      if (has_value) bad_option("option " + arg + " takes no value");
      target = v;
    };
    auto need = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) bad_option("option " + arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h")
      flag(o.help, true);
    else if (arg == "--mpi")
      flag(o.mpi, true);
    else if (arg == "--no-qwz")
      flag(o.zeropp.qwz, false);
    else if (arg == "--no-hpz")
      flag(o.zeropp.hpz, false);
    else if (arg == "--no-qgz")
      flag(o.zeropp.qgz, false);
    else if (arg == "--no-low-bit")
      flag(o.low_bit, false);
    else if (arg == "--no-prefetch")
      flag(o.prefetch, false);
    else if (arg == "--ranks")
      o.config.ranks = static_cast<int>(parse_int(arg, need(), 1, 1024));
    else if (arg == "--nodes")
      o.config.nodes = static_cast<int>(parse_int(arg, need(), 1, 1024));
    else if (arg == "--steps")
      o.config.steps = static_cast<int>(parse_int(arg, need(), 1, 1000000));
    else if (arg == "--hidden")
      o.config.hidden = static_cast<int>(parse_int(arg, need(), 1, 16384));
    else if (arg == "--layers")
      o.config.layers = static_cast<int>(parse_int(arg, need(), 1, 64));
    else if (arg == "--batch")
      o.config.batch = static_cast<int>(parse_int(arg, need(), 1, 65536));
    else if (arg == "--print")
      o.print_every = static_cast<int>(parse_int(arg, need(), 1, 1000000));
    else if (arg == "--seed")
      o.config.seed = static_cast<std::uint64_t>(parse_int(arg, need(), 0, (1LL << 62)));
    else if (arg == "--lr") {
      const std::string v = need();
      errno = 0;
      char* end = nullptr;
      const double lr = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || errno != 0 || !(lr > 0.0) || !std::isfinite(lr) || lr > 10.0)
        bad_option("option --lr needs a number in (0, 10], got '" + v + "'");
      o.config.lr = static_cast<float>(lr);
    } else {
      bad_option("unknown option '" + std::string(argv[i]) + "'");
    }
  }
  return o;
}

double mib(std::uint64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

std::string describe(const Techniques& t) {
  std::string s;
  auto add = [&](const char* name) { s += s.empty() ? name : std::string(" + ") + name; };
  if (t.qwz) add("qwZ int8");
  if (t.hpz) add("hpZ");
  if (t.qgz) add("qgZ int4 two-hop");
  if (t.feedback) add("error feedback");
  if (t.hadamard) add("Hadamard");
  return s.empty() ? "no technique (same as plain)" : s;
}

double mean_seconds(const RunResult& r) {
  // The first step warms caches and allocators; leave it out when there are others.
  double sum = 0;
  std::size_t n = 0;
  for (std::size_t i = r.steps.size() > 1 ? 1 : 0; i < r.steps.size(); ++i, ++n) sum += r.steps[i].seconds;
  return n ? sum / static_cast<double>(n) : 0.0;
}

double mean_comm_seconds(const RunResult& r) {
  double sum = 0;
  std::size_t n = 0;
  for (std::size_t i = r.steps.size() > 1 ? 1 : 0; i < r.steps.size(); ++i, ++n)
    sum += r.steps[i].comm_seconds;
  return n ? sum / static_cast<double>(n) : 0.0;
}

//! True when two runs of the same configuration have the same losses and bytes in every step.
bool same_run(const RunResult& a, const RunResult& b) {
  auto same = [](Bytes x, Bytes y) { return x.intra == y.intra && x.inter == y.inter; };
  if (a.steps.size() != b.steps.size() || a.final_eval != b.final_eval) return false;
  for (std::size_t i = 0; i < a.steps.size(); ++i) {
    const auto &x = a.steps[i], &y = b.steps[i];
    if (x.loss != y.loss || !same(x.forward, y.forward) || !same(x.backward, y.backward) ||
        !same(x.gradient, y.gradient) || !same(x.update, y.update))
      return false;
  }
  return true;
}

//! Prints the report; returns the exit status (0 pass, 1 fail). `blocking` is the ZeRO++ run
//! without prefetch, or null.
int report(const Options& o, const RunResult& plain, const RunResult& zpp, const RunResult* blocking,
           bool mpi) {
  const DemoConfig& c = o.config;
  std::printf("\nloss (training batch of the step, mean over ranks) and time per step\n");
  std::printf("  %6s  %12s  %12s  %10s  %10s\n", "step", "plain", "ZeRO++", "plain ms", "ZeRO++ ms");
  for (int s = 0; s < c.steps; ++s) {
    if (s % o.print_every != 0 && s + 1 != c.steps) continue;
    const auto& a = plain.steps[static_cast<std::size_t>(s)];
    const auto& b = zpp.steps[static_cast<std::size_t>(s)];
    std::printf("  %6d  %12.6f  %12.6f  %10.1f  %10.1f\n", s + 1, a.loss, b.loss, a.seconds * 1e3,
                b.seconds * 1e3);
  }

  const auto& a = plain.steps.back();
  const auto& b = zpp.steps.back();
  std::printf("\nbytes sent per step by rank 0 (MiB; intra = same node, inter = other nodes)\n");
  std::printf("  %-26s  %10s  %10s  %10s  %10s\n", "phase", "plain in", "plain x", "ZeRO++ in", "ZeRO++ x");
  auto row = [](const char* name, Bytes p, Bytes z) {
    std::printf("  %-26s  %10.3f  %10.3f  %10.3f  %10.3f\n", name, mib(p.intra), mib(p.inter), mib(z.intra),
                mib(z.inter));
  };
  row("forward weight gather", a.forward, b.forward);
  row("backward weight gather", a.backward, b.backward);
  row("gradient reduce-scatter", a.gradient, b.gradient);
  row("total", a.total(), b.total());

  const double lp = plain.final_eval, lz = zpp.final_eval;
  const double rel = std::fabs(lz - lp) / lp;
  const double inter_ratio =
      a.total().inter ? static_cast<double>(b.total().inter) / static_cast<double>(a.total().inter) : 0.0;
  const bool pass = rel <= kTolerance;
  std::printf("\nsummary\n");
  std::printf("  model                 %zu parameters (%zu padded, %zu per shard), %d ranks on %d nodes\n",
              plain.numel, plain.padded_numel, plain.shard_numel, c.ranks, c.nodes);
  std::printf("  ZeRO++ techniques     %s\n", describe(zpp.techniques).c_str());
  std::printf("  held-out loss         initial %.6f; final plain %.6f, ZeRO++ %.6f\n", plain.initial_eval, lp,
              lz);
  std::printf("  relative difference   %.3f%% (limit %.0f%%)\n", rel * 100.0, kTolerance * 100.0);
  std::printf(
      "  cross-node bytes      plain %.3f MiB, ZeRO++ %.3f MiB per step per rank: ratio %.3f (%.2fx less)\n",
      mib(a.total().inter), mib(b.total().inter), inter_ratio, inter_ratio > 0 ? 1.0 / inter_ratio : 0.0);
  std::printf(
      "  time per step         plain %.1f ms, ZeRO++ %.1f ms (all ranks share this machine's cores,\n"
      "                        so times measure compute and quantization, not a network)\n",
      mean_seconds(plain) * 1e3, mean_seconds(zpp) * 1e3);
  const char* mode = o.prefetch ? "with prefetch" : "blocking calls";
  if (blocking)
    std::printf(
        "  communication wait    plain %.1f ms, ZeRO++ %.1f ms per step with prefetch; ZeRO++ %.1f ms\n"
        "                        with blocking calls (same plans and order of layers; losses and bytes\n"
        "                        %s)\n",
        mean_comm_seconds(plain) * 1e3, mean_comm_seconds(zpp) * 1e3, mean_comm_seconds(*blocking) * 1e3,
        same_run(zpp, *blocking) ? "identical" : "DIFFER");
  else
    std::printf("  communication wait    plain %.1f ms, ZeRO++ %.1f ms per step (%s)\n",
                mean_comm_seconds(plain) * 1e3, mean_comm_seconds(zpp) * 1e3, mode);
  std::printf(
      "                        (time rank 0 spends inside blocking calls, start, progress and finish.\n"
      "                        The %d ranks are %s sharing this machine's %u cores, so the wait\n"
      "                        mostly reflects CPU contention, the copies and quantization of all\n"
      "                        ranks on the same cores, not network latency; prefetch can only hide\n"
      "                        what something else moves meanwhile)\n",
      c.ranks, mpi ? "processes" : "threads", std::thread::hardware_concurrency());
  const bool same = blocking == nullptr || same_run(zpp, *blocking);
  std::printf("  result                %s: ZeRO++ final loss is %swithin %.0f%% of plain%s\n",
              pass && same ? "PASS" : "FAIL", pass ? "" : "not ", kTolerance * 100.0,
              same ? "" : "; prefetch and blocking runs differ");
  return pass && same ? 0 : 1;
}

//! Prints the low-bit summary; returns 0 if the best configuration with at least kLowBitRatio fewer
//! cross-node bytes than plain ends within kLowBitTolerance of plain, else 1.
int report_low_bit(const RunResult& plain, const RunResult& zpp, const std::vector<RunResult>& runs) {
  const double lp = plain.final_eval, bp = static_cast<double>(plain.steps.back().total().inter);
  std::printf("\nlow-bit configurations (cross-node bytes per step and rank; final held-out loss)\n");
  std::printf("  %-78s  %8s  %7s  %9s  %8s\n", "configuration", "MiB", "less", "loss", "vs plain");
  auto line = [&](const char* name, const RunResult& r) {
    const double b = static_cast<double>(r.steps.back().total().inter);
    std::printf("  %-78s  %8.3f  %6.2fx  %9.6f  %+7.3f%%\n", name, b / (1024.0 * 1024.0),
                b > 0 ? bp / b : 0.0, r.final_eval, 100.0 * (r.final_eval - lp) / lp);
  };
  line("plain ZeRO-3: bf16 gathers, bf16 one-hop reduce-scatter", plain);
  line("ZeRO++: qwZ int8, hpZ, qgZ int4", zpp);
  int best = -1;
  for (std::size_t k = 0; k < runs.size(); ++k) {
    line(kLowBit[k].name, runs[k]);
    const double b = static_cast<double>(runs[k].steps.back().total().inter);
    const double rel = std::fabs(runs[k].final_eval - lp) / lp;
    if (b > 0 && bp / b >= kLowBitRatio &&
        (best < 0 || rel < std::fabs(runs[static_cast<std::size_t>(best)].final_eval - lp) / lp))
      best = static_cast<int>(k);
  }
  const bool pass =
      best >= 0 && std::fabs(runs[static_cast<std::size_t>(best)].final_eval - lp) / lp <= kLowBitTolerance;
  std::printf("  result                %s: %s%s\n", pass ? "PASS" : "FAIL",
              best >= 0 ? kLowBit[best].name : "no configuration sends 8x fewer bytes",
              pass ? " sends at least 8x fewer cross-node bytes than plain, final loss within 1%" : "");
  return pass ? 0 : 1;
}

void print_start(const Options& o, bool mpi) {
  const DemoConfig& c = o.config;
  std::printf(
      "qcoll demo: %d %s ranks on %d nodes, MLP %d -> %d x %d -> %d, %d steps, batch %d per rank, lr %g\n",
      c.ranks, mpi ? "MPI" : "in-process", c.nodes, c.input, c.layers - 1, c.hidden, c.output, c.steps,
      c.batch, static_cast<double>(c.lr));
  std::fflush(stdout);
}

bool started_by_mpi_launcher() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
         std::getenv("PMIX_RANK") != nullptr;
}

Techniques with_prefetch(Techniques t, bool prefetch) {
  t.prefetch = prefetch;
  return t;
}

int run_local(const Options& o) {
  print_start(o, false);
  std::printf("training plain ...\n");
  std::fflush(stdout);
  const RunResult plain = qcoll_demo::train_local(o.config, with_prefetch(Techniques{}, o.prefetch));
  std::printf("training ZeRO++ ...\n");
  std::fflush(stdout);
  const RunResult zpp = qcoll_demo::train_local(o.config, with_prefetch(o.zeropp, o.prefetch));
  std::optional<RunResult> blocking;
  if (o.prefetch) {
    std::printf("training ZeRO++ with blocking calls ...\n");
    std::fflush(stdout);
    blocking = qcoll_demo::train_local(o.config, with_prefetch(o.zeropp, false));
  }
  int status = report(o, plain, zpp, blocking ? &*blocking : nullptr, false);
  if (o.low_bit) {
    std::vector<RunResult> runs;
    for (const LowBit& l : kLowBit) {
      std::printf("training %s ...\n", l.name);
      std::fflush(stdout);
      runs.push_back(qcoll_demo::train_local(o.config, with_prefetch(l.techniques, o.prefetch)));
    }
    status |= report_low_bit(plain, zpp, runs);
  }
  return status;
}

#if QCOLL_HAVE_MPI
int run_mpi(Options o) {
  MPI_Init(nullptr, nullptr);
  int status = 3;
  try {
    int size = 0, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    o.config.ranks = size;
    const std::string err = qcoll_demo::validate(o.config);
    if (!err.empty()) {
      if (rank == 0) std::fprintf(stderr, "demo: %s (see --help)\n", err.c_str());
      MPI_Finalize();
      return 2;
    }
    const std::vector<long long> ids = qcoll_demo::node_ids(o.config);
    qcoll::MpiTransport world(MPI_COMM_WORLD, ids);
    const qcoll::Topology topo = qcoll::Topology::from_node_ids(ids, rank);
    if (rank == 0) {
      print_start(o, true);
      std::printf("training plain ...\n");
      std::fflush(stdout);
    }
    const RunResult plain =
        qcoll_demo::train_rank(world, topo, o.config, with_prefetch(Techniques{}, o.prefetch));
    if (rank == 0) {
      std::printf("training ZeRO++ ...\n");
      std::fflush(stdout);
    }
    const RunResult zpp = qcoll_demo::train_rank(world, topo, o.config, with_prefetch(o.zeropp, o.prefetch));
    std::optional<RunResult> blocking;
    if (o.prefetch) blocking = qcoll_demo::train_rank(world, topo, o.config, with_prefetch(o.zeropp, false));
    std::vector<RunResult> runs;
    if (o.low_bit)
      for (const LowBit& l : kLowBit)
        runs.push_back(
            qcoll_demo::train_rank(world, topo, o.config, with_prefetch(l.techniques, o.prefetch)));
    // Every rank holds the same losses, so every rank reaches the same verdict (rank 0 prints it).
    if (rank != 0) std::freopen("/dev/null", "w", stdout);
    status = report(o, plain, zpp, blocking ? &*blocking : nullptr, true);
    if (o.low_bit) status |= report_low_bit(plain, zpp, runs);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "demo: error: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  MPI_Finalize();
  return status;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  if (o.help) {
    print_help(argv[0]);
    return 0;
  }
  const bool mpi = o.mpi || started_by_mpi_launcher();
#if QCOLL_HAVE_MPI
  if (mpi) return run_mpi(o);
#else
  if (o.mpi) bad_option("option --mpi needs a build with MPI (QCOLL_HAVE_MPI)");
  if (mpi) std::fprintf(stderr, "demo: note: built without MPI; running in-process ranks in every process\n");
#endif
  const std::string err = qcoll_demo::validate(o.config);
  if (!err.empty()) bad_option(err);
  try {
    return run_local(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "demo: error: %s\n", e.what());
    return 3;
  }
}
