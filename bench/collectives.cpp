// Collective benchmark in the style of nccl-tests: quantized all-gather (qwZ), reduce-scatter
// (qgZ, one or two hops) and all-reduce over the in-process transport (ranks as threads) or MPI,
// each size next to a baseline row of the engine's own unquantized collective measured in the
// same run.
//
// Semantics (as nccl-tests): size = bytes of the full unquantized buffer per rank (for
// all-gather the output), count = its elements; time = mean time of one call, the slowest rank's;
// algbw = size / time; busbw = algbw * (W-1)/W for all-gather and reduce-scatter and
// algbw * 2(W-1)/W for all-reduce. Wire bytes: what this rank handed to the transport per call
// (the transport's byte counters, largest over ranks), split by same-node / other-node peers.
// max_err: largest |out - ref| over every rank's output, divided by the largest |ref|, where ref is
// the unquantized operation in fp64. #wrong: output elements outside the bound derived below (or,
// when every hop is an identity format, elements that differ from a host re-computation of the
// fp32 pipeline). Exit status: 0, 1 if #wrong > 0 anywhere, 2 on a bad command line.
//
// Error bound (nearest rounding). One quantization of x in a block whose valid elements have
// absmax A (A may be replaced by any upper bound, every term grows with it):
//   |dec(x) - x| <= r * |x| + c * A + 2^-20 * (|x| + A)
//   * symmetric int, qmax = 127 / 7: scale s = A/qmax, codes are rint(x/s) in [-qmax, qmax] with
//     |x/s| <= qmax, so the code error is at most 1/2 step: r = 0, c = 1/(2 qmax).
//   * scaled FP8 e4m3: s = A/448, x/s in [-448, 448] is rounded to nearest on a grid with 3
//     mantissa bits (relative error 2^-4) or, below 2^-6, on the subnormal step 2^-9 (absolute
//     error 2^-10 in code units): r = 2^-4, c = 2^-10 / 448.
//   * MXFP4 (E2M1, emax 2, 1 mantissa bit, subnormal step 0.5, max 6): s = 2^X with
//     X = floor(log2 A) - 2, so A/8 < s <= A/4. Normal codes: relative error 2^-2. Subnormal:
//     absolute 0.25 s <= A/16. Saturation (|x|/s in (6, 8)): error |x| - 6 s < A - 6 A/8 = A/4.
//     r = 1/4, c = 1/4 + 1/16.
//   * identity f32: exact (r = c = 0); identity bf16: round to 8 significant bits, r = 2^-8.
//   The 2^-20 term covers the fp32 arithmetic around the grid: the scale division and the
//   reciprocal (relative 2^-24 each), the multiply x * (1/s) (shifts the code by <= 2^-22 |x/s|),
//   and the decode multiply (relative 2^-24); together well under 16 units of 2^-24.
// A sum of k+1 decoded terms in fp32 starting from +0 adds at most gamma_k * sum |term|,
// gamma_k = 1.01 k 2^-24 (k 2^-24 / (1 - k 2^-24) for k << 2^24). Terms are bounded by
// |x| + error. Two hops: the hop-1 partial P of a node (L terms) is bounded by |P_exact| + e_P and
// that bound also gives the hop-2 block absmax. mean divides by W (one more 2^-24 relative).
// The output is rounded to the element type: + u_T (|ref| + error), u_T = 2^-24 (f32), 2^-8 (bf16).
// All-reduce = that reduce-scatter, then an all-gather of the rounded result (block absmax bounded
// by max(|ref| + error)) and one more rounding to T.
// The MPI baseline is checked against the same bound with identity f32 and one hop (the sum bound
// holds for any summation order); the in-process baseline and identity-only pipelines are checked
// for exact equality with a host re-computation in the plan's documented order.
//
// Overlap (MPI transport, after the tables; --overlap 0 leaves it out): for each op and size, with
// the qcoll row's formats, Tb = time of the blocking call, C = time of a CPU computation
// calibrated to about Tb, To = time of start(); C split in 8 parts with progress() after each;
// finish(), and To' = the same without progress(). The four are timed interleaved, one call at a
// time after a barrier; each figure is the median over the timed calls, slowest rank.
// overlap = (Tb + C - To) / min(Tb, C): 1 when the exchange is hidden entirely behind the
// computation, 0 when start/compute/finish takes as long as the call and the computation in a row.
// With --overlap-compute idle, C is a sleep instead of CPU work (the host waiting for a device).
// Rows 'iallgather' do the same for the transport's own all-gather of size / W bytes per rank
// (MPI_Iallgather + MPI_Test / MPI_Wait against MPI_Allgather), without quantization.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <qcoll/collective/reduce_scatter.hpp>
#include <qcoll/format/dispatch.hpp>
#include <qcoll/layout/group.hpp>
#include <qcoll/transport/local.hpp>

#ifndef QCOLL_HAVE_MPI
#define QCOLL_HAVE_MPI 0
#endif
#if QCOLL_HAVE_MPI
#include <qcoll/transport/mpi.hpp>  // includes <mpi.h>
#endif

#include "bench_util.hpp"

using namespace qcoll;

namespace {

const char* const kHelp =
    "usage: collectives [flags]\n"
    "Quantized all-gather / reduce-scatter / all-reduce against the unquantized collective.\n"
    "\n"
    "  --op OP               all_gather | reduce_scatter | all_reduce | all (default: all)\n"
    "  --transport T         local | mpi (default: local; mpi when started with more than one\n"
    "                        MPI process)\n"
    "  --ranks W             ranks of the local transport (default: 8)\n"
    "  --ranks-per-node L    ranks per node, node-major placement (default: 4 for local; for\n"
    "                        mpi the MPI_COMM_TYPE_SHARED groups)\n"
    "  -b, --minbytes N      smallest size in bytes, suffixes K/M/G (default: 4K)\n"
    "  -e, --maxbytes N      largest size (default: 4M)\n"
    "  -f, --stepfactor F    size multiplier (default: 4)\n"
    "  -n, --iters N         timed calls per size (default: 10)\n"
    "  -w, --warmup_iters N  untimed calls first (default: 2)\n"
    "  -c, --check 0|1       check results (default: 1)\n"
    "  --type T              f32 | bf16 (default: f32)\n"
    "  --format F            all-gather format and reduce-scatter hop-1 format:\n"
    "                        int8 int4 e4m3 mxfp4 f32 bf16 (default: int8)\n"
    "  --format2 F           reduce-scatter hop-2 format: the same as --format (default), or\n"
    "                        int8 / int4 with --block 256\n"
    "  --block B             block of int8/int4/e4m3: 256 or 2048 (default: 256; mxfp4 uses 32)\n"
    "  --hops 1|2            reduce-scatter route (default: 2)\n"
    "  --reduce sum|mean     reduction (default: sum)\n"
    "  --seed S              input seed (default: 1)\n"
    "  --overlap 0|1         mpi: also measure start/compute/finish overlap (default: 1)\n"
    "  --overlap-compute K   the computation overlapped: cpu (busy loop) or idle (sleep, as a\n"
    "                        host waiting for a device) (default: cpu)\n"
    "  --group SPEC          run the plans over a tensor group instead of the size sweep:\n"
    "                        list:N1,N2,... (element counts) or random:COUNT:MAX[:SEED] (COUNT\n"
    "                        tensors of 0..MAX elements); prints the padding the tensor alignment\n"
    "                        adds next to the flat layout of the same elements\n";

enum class OpKind { all_gather, reduce_scatter, all_reduce };
const char* op_name(OpKind op) {
  return op == OpKind::all_gather       ? "all_gather"
         : op == OpKind::reduce_scatter ? "reduce_scatter"
                                        : "all_reduce";
}

struct Options {
  std::vector<OpKind> ops{OpKind::all_gather, OpKind::reduce_scatter, OpKind::all_reduce};
  std::string transport;  // "" = choose
  int ranks = 8;
  int ranks_per_node = 0;  // 0 = default
  std::size_t minbytes = 4096, maxbytes = 4u << 20;
  long factor = 4;
  int iters = 10, warmup = 2;
  bool check = true;
  bool bf16 = false;
  FormatId format = FormatId::int8, format2 = FormatId::int8;
  bool format2_set = false;
  std::size_t block = 256;
  Hops hops = Hops::two;
  Reduce reduce = Reduce::sum;
  std::uint64_t seed = 1;
  std::vector<std::size_t> group;  // tensor sizes of --group (empty: the size sweep)
  std::string group_spec;
  bool overlap = true;
  bool overlap_idle = false;
};

// ----------------------------------------------------------------------------------------------
// Inputs: a deterministic function of (seed, rank, global index), so every rank can rebuild any
// rank's input for the reference. Values in [-1, 1) times 2^k, k in [-2, 2] varying per 256
// elements, so blocks have different scales.

std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float gen(std::uint64_t seed, int rank, std::size_t g) {
  const std::uint64_t h = mix(seed * 0x100000001b3ull ^ mix(static_cast<std::uint64_t>(rank) << 40 ^ g));
  const float u =
      static_cast<float>(static_cast<std::int64_t>(h >> 40) - (1 << 23)) / static_cast<float>(1 << 23);
  const int k = static_cast<int>((g / 256 + static_cast<std::size_t>(rank)) % 5) - 2;
  return std::ldexp(u, k);
}

template <class T>
T input(std::uint64_t seed, int rank, std::size_t g) {
  return from_float<T>(gen(seed, rank, g));
}

// ----------------------------------------------------------------------------------------------
// Error model of one hop's format (see the header comment).

struct Model {
  FormatId id = FormatId::identity_f32;
  std::size_t block = 1;
  double r = 0, c = 0;
  int identity_bits = 0;  // 32 or 16 for identity formats, 0 for quantized ones
};

template <class F>
Model model_of() {
  Model m;
  m.id = F::id;
  m.block = F::block;
  switch (F::id) {
    case FormatId::identity_f32: m.identity_bits = 32; break;
    case FormatId::identity_bf16:
      m.identity_bits = 16;
      m.r = std::ldexp(1.0, -8);
      break;
    case FormatId::int8: m.c = 1.0 / 254.0; break;
    case FormatId::int4: m.c = 1.0 / 14.0; break;
    case FormatId::fp8_e4m3:
      m.r = 1.0 / 16.0;
      m.c = std::ldexp(1.0, -10) / 448.0;
      break;
    case FormatId::mxfp4:
      m.r = 0.25;
      m.c = 0.25 + 1.0 / 16.0;
      break;
    default: throw Error("collectives: no error model for format " + std::string(format_name(F::id)));
  }
  return m;
}

constexpr double kSlack = 1.0 / (1 << 20);
double gamma_k(int k) { return 1.01 * k * std::ldexp(1.0, -24); }
double quant_err(const Model& m, double ax, double A) { return m.r * ax + m.c * A + kSlack * (ax + A); }

// The value an identity format delivers for v (the wire rounding).
float wire_round(const Model& m, float v) {
  return m.identity_bits == 16 ? to_float(from_float<bfloat16>(v)) : v;
}

// Block absmax of a[0, n) per block of `block` (n a multiple of block or the valid tail).
void block_absmax(const double* a, std::size_t n, std::size_t block, double* out) {
  for (std::size_t b = 0; b < n; b += block) {
    const std::size_t e = std::min(n, b + block);
    double m = 0;
    for (std::size_t k = b; k < e; ++k) m = std::max(m, std::fabs(a[k]));
    for (std::size_t k = b; k < e; ++k) out[k] = m;
  }
}

// The pipeline whose output is checked.
struct Pipe {
  OpKind op = OpKind::all_gather;
  Model f1, f2, f3;
  Hops hops = Hops::one;
  bool mean = false;
  bool exact = false;    // compare with a host re-computation instead of the bound
  bool final_ag = true;  // all-reduce: an all-gather of the reduced values follows
  double u_t = 0;        // unit roundoff of the element type
  std::uint64_t seed = 1;
  std::size_t numel = 0;
  int world = 1;
  std::vector<int> rank_at;  // node * L + local -> rank
  int nodes = 1, per_node = 1;
  const ShardLayout* layout = nullptr;  // a tensor group's layout: its padding inputs are 0
};

struct CheckResult {
  double max_err = 0, max_ref = 0;
  std::uint64_t wrong = 0;
};

// Reference, bound and (when exact) expected float value of elements [c0, c0 + n) of an output,
// n a multiple of every block of the pipe and c0 aligned to it.
template <class T>
struct Evaluator {
  const Pipe& p;
  std::vector<double> x, e1, a, ref, bnd, pref, pe, tmp;
  std::vector<float> exp;

  explicit Evaluator(const Pipe& pipe) : p(pipe) {}

  double xin(int q, std::size_t g) const {
    return p.layout != nullptr && p.layout->data_in(g, 1) == 0 ? 0.0 : to_float(input<T>(p.seed, q, g));
  }

  void eval(std::size_t c0, std::size_t n) {
    const std::size_t nv = c0 >= p.numel ? 0 : std::min(n, p.numel - c0);
    ref.assign(n, 0.0);
    bnd.assign(n, 0.0);
    exp.assign(n, 0.0f);
    if (nv == 0) return;
    if (p.op == OpKind::all_gather) {
      x.resize(nv);
      a.resize(nv);
      for (std::size_t k = 0; k < nv; ++k) x[k] = xin(0, c0 + k);
      block_absmax(x.data(), nv, p.f1.block, a.data());
      for (std::size_t k = 0; k < nv; ++k) {
        const double e = quant_err(p.f1, std::fabs(x[k]), a[k]);
        ref[k] = x[k];
        bnd[k] = e + p.u_t * (std::fabs(x[k]) + e);
        exp[k] = to_float(from_float<T>(wire_round(p.f1, static_cast<float>(x[k]))));
      }
      return;
    }
    reduce_scatter_part(c0, nv);
    if (p.op == OpKind::all_reduce && p.final_ag) {
      a.resize(nv);
      tmp.resize(nv);
      for (std::size_t k = 0; k < nv; ++k) tmp[k] = std::fabs(ref[k]) + bnd[k];
      block_absmax(tmp.data(), nv, p.f3.block, a.data());
      for (std::size_t k = 0; k < nv; ++k) {
        const double e3 = quant_err(p.f3, tmp[k], a[k]);
        bnd[k] = bnd[k] + e3 + p.u_t * (tmp[k] + e3);
        exp[k] = to_float(from_float<T>(wire_round(p.f3, exp[k])));
      }
    }
  }

  void reduce_scatter_part(std::size_t c0, std::size_t nv) {
    const int W = p.world;
    x.resize(static_cast<std::size_t>(W) * nv);
    e1.resize(x.size());
    a.resize(nv);
    for (int q = 0; q < W; ++q) {
      double* xq = &x[static_cast<std::size_t>(q) * nv];
      for (std::size_t k = 0; k < nv; ++k) xq[k] = xin(q, c0 + k);
      block_absmax(xq, nv, p.f1.block, a.data());
      for (std::size_t k = 0; k < nv; ++k)
        e1[static_cast<std::size_t>(q) * nv + k] = quant_err(p.f1, std::fabs(xq[k]), a[k]);
    }
    auto X = [&](int q, std::size_t k) { return x[static_cast<std::size_t>(q) * nv + k]; };
    auto E = [&](int q, std::size_t k) { return e1[static_cast<std::size_t>(q) * nv + k]; };
    std::vector<double>& err = tmp;
    err.assign(nv, 0.0);
    if (p.hops == Hops::one) {
      for (std::size_t k = 0; k < nv; ++k) {
        double s = 0, se = 0, sa = 0;
        float acc = 0.0f;
        for (int q = 0; q < W; ++q) {
          s += X(q, k);
          se += E(q, k);
          sa += std::fabs(X(q, k)) + E(q, k);
          acc += wire_round(p.f1, static_cast<float>(X(q, k)));
        }
        ref[k] = s;
        err[k] = se + gamma_k(W - 1) * sa;
        exp[k] = acc;
      }
    } else {
      const int N = p.nodes, L = p.per_node;
      pref.assign(static_cast<std::size_t>(N) * nv, 0.0);
      pe.assign(pref.size(), 0.0);
      std::vector<float> pacc(pref.size(), 0.0f);
      for (int m = 0; m < N; ++m)
        for (std::size_t k = 0; k < nv; ++k) {
          double s = 0, se = 0, sa = 0;
          float acc = 0.0f;
          for (int j = 0; j < L; ++j) {
            const int q = p.rank_at[static_cast<std::size_t>(m * L + j)];
            s += X(q, k);
            se += E(q, k);
            sa += std::fabs(X(q, k)) + E(q, k);
            acc += wire_round(p.f1, static_cast<float>(X(q, k)));
          }
          const std::size_t i = static_cast<std::size_t>(m) * nv + k;
          pref[i] = s;
          pe[i] = se + gamma_k(L - 1) * sa;
          pacc[i] = acc;
        }
      std::vector<double> mag(nv), a2(nv);
      std::vector<double> sum_e(nv, 0.0), sum_a(nv, 0.0), sum_r(nv, 0.0);
      std::vector<float> acc2(nv, 0.0f);
      for (int m = 0; m < N; ++m) {
        const std::size_t o = static_cast<std::size_t>(m) * nv;
        for (std::size_t k = 0; k < nv; ++k) mag[k] = std::fabs(pref[o + k]) + pe[o + k];
        block_absmax(mag.data(), nv, p.f2.block, a2.data());
        for (std::size_t k = 0; k < nv; ++k) {
          const double e2 = quant_err(p.f2, mag[k], a2[k]);
          sum_e[k] += pe[o + k] + e2;
          sum_a[k] += mag[k] + e2;
          sum_r[k] += pref[o + k];
          acc2[k] += wire_round(p.f2, pacc[o + k]);
        }
      }
      for (std::size_t k = 0; k < nv; ++k) {
        ref[k] = sum_r[k];
        err[k] = sum_e[k] + gamma_k(N - 1) * sum_a[k];
        exp[k] = acc2[k];
      }
    }
    const double w = static_cast<double>(W);
    for (std::size_t k = 0; k < nv; ++k) {
      if (p.mean) {
        ref[k] /= w;
        err[k] = err[k] / w + (std::fabs(ref[k]) + err[k] / w) * std::ldexp(1.0, -24);
        exp[k] = fp::div(exp[k], static_cast<float>(W));
      }
      bnd[k] = err[k] + p.u_t * (std::fabs(ref[k]) + err[k]);
      exp[k] = to_float(from_float<T>(exp[k]));
    }
  }
};

// Checks out[0, n) = output elements [g0, g0 + n) (chunks of `chunk` elements).
template <class T>
void check_range(const Pipe& p, const T* out, std::size_t g0, std::size_t n, std::size_t chunk,
                 CheckResult& res) {
  Evaluator<T> ev(p);
  for (std::size_t c = 0; c < n; c += chunk) {
    const std::size_t len = std::min(chunk, n - c);
    ev.eval(g0 + c, len);
    for (std::size_t k = 0; k < len; ++k) {
      const double v = to_float(out[c + k]);
      const double err = std::fabs(v - ev.ref[k]);
      res.max_ref = std::max(res.max_ref, std::fabs(ev.ref[k]));
      if (std::isnan(err)) {
        res.max_err = NAN;
        ++res.wrong;
        continue;
      }
      if (!std::isnan(res.max_err)) res.max_err = std::max(res.max_err, err);
      const bool ok = p.exact ? static_cast<float>(v) == ev.exp[k] : err <= ev.bnd[k];
      if (!ok) ++res.wrong;
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Timing and statistics shared over ranks.

struct RowStats {
  double seconds = 0;  // mean per call, slowest rank
  std::uint64_t intra = 0, inter = 0;
  CheckResult check;
  bool checked = false;
};

std::uint64_t bits_of(double d) {
  std::uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}
double from_bits64(std::uint64_t u) {
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}

// Combines the ranks' statistics: max of time, bytes, errors (non-negative doubles order like
// their bit patterns; NaN 0x7ff8... is above every finite value), sum of #wrong.
template <class Tr>
RowStats combine(Tr& t, RowStats s) {
  std::uint64_t mx[5] = {static_cast<std::uint64_t>(s.seconds * 1e9), s.intra, s.inter,
                         bits_of(s.check.max_err), bits_of(s.check.max_ref)};
  t.all_reduce(mx, 5, ReduceOp::max);
  std::uint64_t sm = s.check.wrong;
  t.all_reduce(&sm, 1, ReduceOp::sum);
  s.seconds = static_cast<double>(mx[0]) * 1e-9;
  s.intra = mx[1];
  s.inter = mx[2];
  s.check.max_err = from_bits64(mx[3]);
  s.check.max_ref = from_bits64(mx[4]);
  s.check.wrong = sm;
  return s;
}

template <class Tr, class Fn>
double time_calls(Tr& t, const Options& o, Fn&& call) {
  for (int i = 0; i < o.warmup; ++i) call();
  t.barrier();
  const double t0 = bench::now_seconds();
  for (int i = 0; i < o.iters; ++i) call();
  return (bench::now_seconds() - t0) / o.iters;
}

// A 64-byte aligned buffer (bench::Buffer aligns to 2 MiB) of at least one byte.
struct Bytes {
  bench::Buffer buf;
  explicit Bytes(std::size_t n) : buf(std::max<std::size_t>(n, 1)) { buf.touch(); }
  template <class T>
  T* as() {
    return buf.as<T>();
  }
};

Pipe base_pipe(const Options& o, OpKind op, std::size_t numel, const Topology& topo, bool bf16) {
  Pipe p;
  p.op = op;
  p.hops = o.hops;
  p.mean = o.reduce == Reduce::mean;
  p.u_t = bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
  p.seed = o.seed;
  p.numel = numel;
  p.world = topo.world_size();
  p.rank_at.assign(topo.rank_at_table(), topo.rank_at_table() + topo.world_size());
  p.nodes = topo.num_nodes();
  p.per_node = topo.ranks_per_node();
  return p;
}

// Checks this rank's output of `op` (full buffer for all-gather / all-reduce, own shard for
// reduce-scatter) against the pipe.
template <class T>
CheckResult check_output(const Pipe& p, const ShardLayout& layout, int rank, const T* out) {
  CheckResult res;
  std::size_t chunk = std::max({p.f1.block, p.f2.block, p.f3.block, std::size_t{1}});
  while (chunk < 1024 && layout.shard_numel() % (2 * chunk) == 0) chunk *= 2;
  if (p.op == OpKind::reduce_scatter)
    check_range(p, out, layout.shard_offset(rank), layout.shard_numel(), chunk, res);
  else
    check_range(p, out, 0, layout.padded_numel(), chunk, res);
  return res;
}

// ----------------------------------------------------------------------------------------------
// One qcoll row: plan(s) over transport t with formats F1 (all-gather, hop 1) and F2 (hop 2).

// The layout of a row: the flat layout of numel elements, or (--group) the group's.
template <class T, class F1, class F2>
ShardLayout row_layout(const Options& o, std::size_t numel, int W) {
  const std::size_t granule = granule_for(sizeof(T), {F1::block, F2::block});
  return o.group.empty() ? ShardLayout(numel, W, granule) : TensorGroup(o.group, W, granule).layout();
}

// Whether element g of a layout's buffer is data (below numel and, in a group, inside a tensor).
bool is_data(const ShardLayout& layout, std::size_t g) { return layout.data_in(g, 1) == 1; }

template <class T, class F1, class F2, class Tr>
RowStats run_qcoll(Tr& t, const Topology& topo, const Options& o, OpKind op, std::size_t numel, Hops hops) {
  const int W = t.size(), r = t.rank();
  const ShardLayout layout = row_layout<T, F1, F2>(o, numel, W);
  numel = layout.numel();
  const std::size_t S = layout.shard_numel(), P = layout.padded_numel();
  Options oo = o;
  oo.hops = hops;
  Pipe pipe = base_pipe(oo, op, numel, topo, std::is_same<T, bfloat16>::value);
  pipe.layout = layout.grouped() ? &layout : nullptr;
  pipe.f1 = model_of<F1>();
  pipe.f2 = model_of<F2>();
  pipe.f3 = pipe.f1;
  pipe.exact = pipe.f1.identity_bits && (hops == Hops::one || pipe.f2.identity_bits);
  RowStats s;
  auto fill_full = [&](T* buf, int who) {
    for (std::size_t g = 0; g < P; ++g)
      buf[g] = is_data(layout, g) ? input<T>(o.seed, who, g) : from_float<T>(0.0f);
  };
  if (op == OpKind::all_gather) {
    QuantizedAllGather<T, F1, Tr> plan(t, layout);
    Bytes in(S * sizeof(T)), out(P * sizeof(T)), ws(plan.workspace_bytes());
    const std::size_t off = layout.shard_offset(r);
    for (std::size_t i = 0; i < S; ++i)
      in.as<T>()[i] = is_data(layout, off + i) ? input<T>(o.seed, 0, off + i) : from_float<T>(0.0f);
    const ByteCounters c0 = t.counters();
    s.seconds =
        time_calls(t, o, [&] { plan(in.as<T>(), out.as<T>(), ws.as<void>(), plan.workspace_bytes()); });
    const ByteCounters c1 = t.counters();
    const std::uint64_t calls = static_cast<std::uint64_t>(o.iters + o.warmup);
    s.intra = (c1.intra_node - c0.intra_node) / calls;
    s.inter = (c1.inter_node - c0.inter_node) / calls;
    if (o.check) s.check = check_output(pipe, layout, r, out.as<T>());
  } else if (op == OpKind::reduce_scatter) {
    QuantizedReduceScatter<T, F1, F2, Tr> plan(t, topo, layout, o.reduce, hops);
    Bytes in(P * sizeof(T)), out(S * sizeof(T)), ws(plan.workspace_bytes());
    fill_full(in.as<T>(), r);
    auto total = [&] {
      ByteCounters c = t.counters();
      for (const ByteCounters* sub : {&plan.intra_node().counters(), &plan.inter_node().counters()}) {
        c.intra_node += sub->intra_node;
        c.inter_node += sub->inter_node;
      }
      return c;
    };
    const ByteCounters c0 = total();
    s.seconds =
        time_calls(t, o, [&] { plan(in.as<T>(), out.as<T>(), ws.as<void>(), plan.workspace_bytes()); });
    const ByteCounters c1 = total();
    const std::uint64_t calls = static_cast<std::uint64_t>(o.iters + o.warmup);
    s.intra = (c1.intra_node - c0.intra_node) / calls;
    s.inter = (c1.inter_node - c0.inter_node) / calls;
    if (o.check) s.check = check_output(pipe, layout, r, out.as<T>());
  } else {
    QuantizedAllReduce<T, F1, F2, F1, Tr> plan(t, topo, layout, o.reduce, hops);
    Bytes in(P * sizeof(T)), out(P * sizeof(T)), ws(plan.workspace_bytes());
    fill_full(in.as<T>(), r);
    s.seconds =
        time_calls(t, o, [&] { plan(in.as<T>(), out.as<T>(), ws.as<void>(), plan.workspace_bytes()); });
    if (o.check) s.check = check_output(pipe, layout, r, out.as<T>());
    {
      // QuantizedAllReduce does not expose the counters of its reduce-scatter's sub-groups, so the
      // wire bytes come from one call of the same two stages built separately (the same messages).
      QuantizedReduceScatter<T, F1, F2, Tr> rs(t, topo, layout, o.reduce, hops);
      QuantizedAllGather<T, F1, Tr> ag(t, layout);
      Bytes ws2(std::max(rs.workspace_bytes(), ag.workspace_bytes())), mid(S * sizeof(T));
      const ByteCounters a0 = t.counters(), i0 = rs.intra_node().counters(), e0 = rs.inter_node().counters();
      rs(in.as<T>(), mid.as<T>(), ws2.as<void>(), ws2.buf.size());
      ag(mid.as<T>(), out.as<T>(), ws2.as<void>(), ws2.buf.size());
      const ByteCounters a1 = t.counters(), i1 = rs.intra_node().counters(), e1 = rs.inter_node().counters();
      s.intra =
          (a1.intra_node - a0.intra_node) + (i1.intra_node - i0.intra_node) + (e1.intra_node - e0.intra_node);
      s.inter =
          (a1.inter_node - a0.inter_node) + (i1.inter_node - i0.inter_node) + (e1.inter_node - e0.inter_node);
    }
  }
  s.checked = o.check;
  return s;
}

// ----------------------------------------------------------------------------------------------
// Overlap of start/finish with computation (see the header comment).

struct OverlapStats {
  double blocking = 0, compute = 0, split = 0, split_quiet = 0;  // seconds per call, slowest rank
};

// A computation that touches no buffer of the call: `units` rounds of a dependent fp chain.
double spin(std::size_t units) {
  volatile double sink = 0;
  double x = 1.0;
  for (std::size_t u = 0; u < units; ++u)
    for (int i = 0; i < 256; ++i) x = x * 0.999999 + 1e-7;
  sink = x;
  return sink;
}

// Slowest rank's value of `seconds`.
template <class Tr>
double slowest(Tr& t, double seconds) {
  std::uint64_t ns = static_cast<std::uint64_t>(seconds * 1e9);
  t.all_reduce(&ns, 1, ReduceOp::max);
  return static_cast<double>(ns) * 1e-9;
}

// Measures `plan` (any of the three; in -> out with the workspace) blocking and split around a
// computation calibrated to the blocking time.
template <class Tr, class Plan, class In, class Out>
OverlapStats measure_overlap(Tr& t, const Options& o, Plan& plan, const In* in, Out* out, void* ws,
                             std::size_t ws_bytes) {
  constexpr int kParts = 8;
  auto blocking = [&] { plan(in, out, ws, ws_bytes); };
  // Seconds of one call of fn, started after a barrier.
  auto once = [&](const std::function<void()>& fn) {
    t.barrier();
    const double t0 = bench::now_seconds();
    fn();
    return bench::now_seconds() - t0;
  };
  OverlapStats s;
  std::vector<double> first;
  for (int i = -o.warmup; i < o.iters; ++i) {
    const double dt = once(blocking);
    if (i >= 0) first.push_back(dt);
  }
  const double tb = slowest(t, bench::median(first));
  // Seconds per 1024 units of spin() on this rank (the fastest of 5 probes: preemption only adds
  // time), then the units that take about the blocking time.
  double unit = 1e9;
  for (int k = 0; k < 5; ++k) {
    const double t0 = bench::now_seconds();
    spin(1024);
    unit = std::min(unit, bench::now_seconds() - t0);
  }
  const std::size_t part = std::max<std::size_t>(1, static_cast<std::size_t>(tb / unit * 1024.0 / kParts));
  // The computation in kParts parts, calling between() after each: CPU work, or
  // (--overlap-compute idle) sleeping until the end of each part (deadlines from the start, so
  // oversleeping does not add up), as a host waiting for a device does.
  const auto nap = std::chrono::nanoseconds(static_cast<long long>(tb / kParts * 1e9));
  auto compute_with = [&](const std::function<void()>& between) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < kParts; ++k) {
      if (o.overlap_idle)
        std::this_thread::sleep_until(t0 + nap * (k + 1));
      else
        spin(part);
      between();
    }
  };
  auto compute = [&] { compute_with([] {}); };
  auto split = [&] {
    auto p = plan.start(in, out, ws, ws_bytes);
    compute_with([&] { p.progress(); });
    plan.finish(p);
  };
  auto quiet = [&] {
    auto p = plan.start(in, out, ws, ws_bytes);
    compute();
    plan.finish(p);
  };
  // The four variants interleaved, each call timed alone after a barrier; the median per variant
  // (robust against a busy machine), then the slowest rank's.
  std::vector<double> v[4];
  for (int i = -o.warmup; i < o.iters; ++i) {
    int k = 0;
    for (const auto& fn : {std::function<void()>(blocking), std::function<void()>(compute),
                           std::function<void()>(split), std::function<void()>(quiet)}) {
      const double dt = once(fn);
      if (i >= 0) v[k].push_back(dt);
      ++k;
    }
  }
  s.blocking = slowest(t, bench::median(v[0]));
  s.compute = slowest(t, bench::median(v[1]));
  s.split = slowest(t, bench::median(v[2]));
  s.split_quiet = slowest(t, bench::median(v[3]));
  return s;
}

// The transport's own exchange as a plan for measure_overlap: the all-gather of `bytes` bytes per
// rank, blocking or started (start_all_gather; progress() is test()).
template <class Tr>
struct BareGather {
  Tr& t;
  std::size_t bytes;
  struct Pending {
    Tr* t;
    typename Tr::Request req;
    bool progress() { return !req.active() || t->test(req); }
  };
  void operator()(const unsigned char* in, unsigned char* out, void*, std::size_t) {
    t.all_gather(in, out, bytes);
  }
  Pending start(const unsigned char* in, unsigned char* out, void*, std::size_t) {
    return Pending{&t, t.start_all_gather(in, out, bytes)};
  }
  void finish(Pending& p) {
    if (p.req.active()) t.wait(p.req);
  }
};

// The overlap of the transport's nonblocking all-gather of size / W bytes per rank.
template <class Tr>
OverlapStats run_bare_overlap(Tr& t, const Options& o, std::size_t size) {
  const std::size_t per_rank = size / static_cast<std::size_t>(t.size());
  Bytes in(per_rank), out(per_rank * static_cast<std::size_t>(t.size()));
  std::memset(in.as<unsigned char>(), t.rank() + 1, per_rank);
  BareGather<Tr> plan{t, per_rank};
  return measure_overlap(t, o, plan, in.as<unsigned char>(), out.as<unsigned char>(), nullptr, 0);
}

// The overlap of `op` with formats F1 (all-gather, hop 1) and F2 (hop 2), as run_qcoll builds it.
template <class T, class F1, class F2, class Tr>
OverlapStats run_overlap(Tr& t, const Topology& topo, const Options& o, OpKind op, std::size_t numel) {
  const int W = t.size(), r = t.rank();
  const ShardLayout layout(numel, W, granule_for(sizeof(T), {F1::block, F2::block}));
  const std::size_t P = layout.padded_numel();
  Bytes in(P * sizeof(T)), out(P * sizeof(T));
  for (std::size_t g = 0; g < P; ++g)
    in.as<T>()[g] = g < numel ? input<T>(o.seed, r, g) : from_float<T>(0.0f);
  if (op == OpKind::all_gather) {
    QuantizedAllGather<T, F1, Tr> plan(t, layout);
    Bytes ws(plan.workspace_bytes());
    return measure_overlap(t, o, plan, in.as<T>() + layout.shard_offset(r), out.as<T>(), ws.as<void>(),
                           plan.workspace_bytes());
  }
  if (op == OpKind::reduce_scatter) {
    QuantizedReduceScatter<T, F1, F2, Tr> plan(t, topo, layout, o.reduce, o.hops);
    Bytes ws(plan.workspace_bytes());
    return measure_overlap(t, o, plan, in.as<T>(), out.as<T>(), ws.as<void>(), plan.workspace_bytes());
  }
  QuantizedAllReduce<T, F1, F2, F1, Tr> plan(t, topo, layout, o.reduce, o.hops);
  Bytes ws(plan.workspace_bytes());
  return measure_overlap(t, o, plan, in.as<T>(), out.as<T>(), ws.as<void>(), plan.workspace_bytes());
}

// ----------------------------------------------------------------------------------------------
// MPI baseline rows: MPI_Allgather / MPI_Reduce_scatter_block / MPI_Allreduce. f32 moves as
// MPI_FLOAT; bf16 all-gather moves the bytes (MPI_BYTE); bf16 reductions convert to fp32, reduce
// with MPI_FLOAT and convert back, the conversions inside the timed region. Wire bytes are not
// counted by MPI; the row shows the logical volume a direct exchange would hand to peers
// (all-gather: the shard to every peer; reduce-scatter: one shard to every peer; all-reduce:
// both), split by the node table.

#if QCOLL_HAVE_MPI
void mpi_ok(int rc, const char* what) {
  if (rc != MPI_SUCCESS) throw Error(std::string("collectives: ") + what + " failed");
}

template <class T>
RowStats run_mpi_baseline(MpiTransport& t, const Topology& topo, const Options& o, OpKind op,
                          std::size_t numel) {
  const int W = t.size(), r = t.rank();
  const bool bf16 = std::is_same<T, bfloat16>::value;
  const ShardLayout layout(numel, W, granule_for(sizeof(T), {}));
  const std::size_t S = layout.shard_numel(), P = layout.padded_numel();
  QCOLL_REQUIRE(P <= static_cast<std::size_t>(INT32_MAX) / 4, "collectives", "size", P * sizeof(T),
                "is too large for the MPI baseline; limit", INT32_MAX / 4);
  Pipe pipe = base_pipe(o, op, numel, topo, bf16);
  pipe.hops = Hops::one;
  pipe.f1 = pipe.f2 = pipe.f3 = Model{};  // identity f32, exact transfer; any summation order
  pipe.final_ag = false;
  pipe.exact = op == OpKind::all_gather;
  MPI_Comm comm = t.comm();
  RowStats s;
  const std::size_t peers_intra = static_cast<std::size_t>(topo.ranks_per_node() - 1);
  const std::size_t peers_inter = static_cast<std::size_t>(W) - 1 - peers_intra;
  const std::size_t shard_bytes = S * sizeof(T);
  const std::size_t mult = op == OpKind::all_reduce ? 2 : 1;
  s.intra = mult * peers_intra * shard_bytes;
  s.inter = mult * peers_inter * shard_bytes;
  if (op == OpKind::all_gather) {
    Bytes in(S * sizeof(T)), out(P * sizeof(T));
    const std::size_t off = layout.shard_offset(r);
    for (std::size_t i = 0; i < S; ++i)
      in.as<T>()[i] = off + i < numel ? input<T>(o.seed, 0, off + i) : from_float<T>(0.0f);
    s.seconds = time_calls(t, o, [&] {
      if (bf16)
        mpi_ok(MPI_Allgather(in.as<void>(), static_cast<int>(S * 2), MPI_BYTE, out.as<void>(),
                             static_cast<int>(S * 2), MPI_BYTE, comm),
               "MPI_Allgather");
      else
        mpi_ok(MPI_Allgather(in.as<void>(), static_cast<int>(S), MPI_FLOAT, out.as<void>(),
                             static_cast<int>(S), MPI_FLOAT, comm),
               "MPI_Allgather");
    });
    if (o.check) s.check = check_output(pipe, layout, r, out.as<T>());
  } else {
    Bytes in(P * sizeof(T)), out((op == OpKind::all_reduce ? P : S) * sizeof(T));
    Bytes f32in(bf16 ? P * 4 : 0), f32out(bf16 ? (op == OpKind::all_reduce ? P : S) * 4 : 0);
    for (std::size_t g = 0; g < P; ++g)
      in.as<T>()[g] = g < numel ? input<T>(o.seed, r, g) : from_float<T>(0.0f);
    const std::size_t n_out = op == OpKind::all_reduce ? P : S;
    const bool mean = o.reduce == Reduce::mean;
    s.seconds = time_calls(t, o, [&] {
      const float* src = reinterpret_cast<const float*>(in.as<T>());
      float* dst = reinterpret_cast<float*>(out.as<T>());
      if (bf16) {
        for (std::size_t g = 0; g < P; ++g) f32in.as<float>()[g] = to_float(in.as<T>()[g]);
        src = f32in.as<float>();
        dst = f32out.as<float>();
      }
      if (op == OpKind::all_reduce)
        mpi_ok(MPI_Allreduce(src, dst, static_cast<int>(P), MPI_FLOAT, MPI_SUM, comm), "MPI_Allreduce");
      else
        mpi_ok(MPI_Reduce_scatter_block(src, dst, static_cast<int>(S), MPI_FLOAT, MPI_SUM, comm),
               "MPI_Reduce_scatter_block");
      if (mean || bf16)
        for (std::size_t i = 0; i < n_out; ++i)
          out.as<T>()[i] = from_float<T>(mean ? fp::div(dst[i], static_cast<float>(W)) : dst[i]);
    });
    if (o.check) s.check = check_output(pipe, layout, r, out.as<T>());
  }
  s.checked = o.check;
  return s;
}
#endif

// ----------------------------------------------------------------------------------------------
// Format dispatch over the supported set (keeps the number of instantiations small).

template <std::size_t B, class Fn>
void with_format_b(FormatId id, Fn&& fn) {
  switch (id) {
    case FormatId::identity_f32: fn(Identity<float, B>{}); return;
    case FormatId::identity_bf16: fn(Identity<bfloat16, B>{}); return;
    case FormatId::int8: fn(Int8<B>{}); return;
    case FormatId::int4: fn(Int4<B>{}); return;
    case FormatId::fp8_e4m3: fn(Fp8E4M3<B>{}); return;
    case FormatId::mxfp4: fn(MxFp4{}); return;
    default: throw bench::UsageError(std::string("format ") + format_name(id) + " is not supported here");
  }
}

// The hop-2 format: the hop-1 format, or (block 256) int8 / int4.
template <std::size_t B, class F1, class Fn>
void with_format2_b(FormatId id, Fn&& fn) {
  if (id == F1::id) {
    fn(F1{});
    return;
  }
  if constexpr (B == 256) {
    if (id == FormatId::int8) {
      fn(Int8<B>{});
      return;
    }
    if (id == FormatId::int4) {
      fn(Int4<B>{});
      return;
    }
  }
  throw bench::UsageError(std::string("flag --format2: ") + format_name(id) +
                          " must equal --format, or be int8 / int4 with --block 256");
}

bool supported(FormatId id) {
  return id == FormatId::identity_f32 || id == FormatId::identity_bf16 || id == FormatId::int8 ||
         id == FormatId::int4 || id == FormatId::fp8_e4m3 || id == FormatId::mxfp4;
}

// ----------------------------------------------------------------------------------------------
// Driver (every rank runs it; rank 0 prints).

std::string fmt_label(const Options& o, OpKind op) {
  std::string f1 = format_name(o.format), f2 = format_name(o.format2);
  if (op == OpKind::all_gather) return f1;
  if (o.hops == Hops::one) return op == OpKind::all_reduce ? f1 + ">" + f1 : f1;
  return op == OpKind::all_reduce ? f1 + ">" + f2 + ">" + f1 : f1 + ">" + f2;
}

// Elements of data of --group (0 without one).
std::size_t group_numel(const Options& o) {
  std::size_t n = 0;
  for (std::size_t x : o.group) n += x;
  return n;
}

// The cost of tensor alignment: padded elements and wire bytes per rank of the group's layout
// next to the flat layout of the same elements, for the granule of each format of the run.
template <class T>
void print_group_cost(const Options& o, int W) {
  const std::size_t n = group_numel(o);
  std::printf("# tensor group %s: %zu tensors, %zu elements (%zu empty, largest %zu)\n", o.group_spec.c_str(),
              o.group.size(), n,
              static_cast<std::size_t>(std::count(o.group.begin(), o.group.end(), std::size_t{0})),
              o.group.empty() ? std::size_t{0} : *std::max_element(o.group.begin(), o.group.end()));
  std::printf("# %-18s %14s %14s %14s %9s\n", "granule (elements)", "flat padded", "group padded", "extra",
              "extra(%)");
  const std::size_t blocks[] = {o.format == FormatId::mxfp4 ? std::size_t{32} : o.block};
  for (std::size_t b : blocks) {
    const std::size_t g = granule_for(sizeof(T), {b});
    const ShardLayout flat(n, W, g);
    const TensorGroup grp(o.group, W, g);
    std::printf("# %-18zu %14zu %14zu %14zu %9.2f\n", g, flat.padded_numel(), grp.padded_numel(),
                grp.padded_numel() - flat.padded_numel(), 100.0 * grp.padding_overhead());
  }
}

template <class T, class Tr>
std::uint64_t bench_all(Tr& t, const Topology& topo, const Options& o, bool is_mpi) {
  const int W = t.size();
  const bool root = t.rank() == 0;
  const char* type = std::is_same<T, bfloat16>::value ? "bf16" : "f32";
  std::uint64_t wrong_total = 0;
  bench::Table table({{"size", 11},
                      {"count", 10},
                      {"type", 4, true},
                      {"path", 10, true},
                      {"format", 15, true},
                      {"time(us)", 10},
                      {"algbw", 7},
                      {"busbw", 7},
                      {"intra(B)", 11},
                      {"inter(B)", 11},
                      {"max_err", 9},
                      {"#wrong", 7}},
                     false);
  if (root) {
    if (*bench::quick_build_warning() != '\0') std::printf("# %s\n", bench::quick_build_warning());
    std::printf(
        "# qcoll collectives: transport %s, %d ranks, %d nodes x %d ranks per node, iters %d, warmup %d, "
        "reduce %s, hops %d, block %zu\n",
        is_mpi ? "mpi" : "local", W, topo.num_nodes(), topo.ranks_per_node(), o.iters, o.warmup,
        o.reduce == Reduce::sum ? "sum" : "mean", o.hops == Hops::one ? 1 : 2, o.block);
    std::printf("# baseline rows: %s\n",
                is_mpi
                    ? "MPI_Allgather / MPI_Reduce_scatter_block / MPI_Allreduce (bf16: bytes for the gather, "
                      "fp32 for reductions; wire bytes = logical volume)"
                    : "qcoll's plain path: identity format of the element type, one hop (path 'ident-1hop')");
  }
  if (root && !o.group.empty()) print_group_cost<T>(o, W);
  std::vector<std::vector<std::string>> overlap_rows;
  const bool overlap = is_mpi && o.overlap;
  for (OpKind op : o.ops) {
    if (root) {
      std::printf("\n# %s (algbw/busbw in GB/s; intra/inter: bytes per rank per call)\n", op_name(op));
      table.header();
    }
    const double busf = op == OpKind::all_reduce ? 2.0 * (W - 1) / W : static_cast<double>(W - 1) / W;
    // --group: one size, the group's elements.
    const std::size_t group_bytes = group_numel(o) * sizeof(T);
    const std::size_t min_size = o.group.empty() ? o.minbytes : group_bytes;
    const std::size_t max_size = o.group.empty() ? o.maxbytes : group_bytes;
    for (std::size_t size = min_size; size <= max_size;) {
      const std::size_t count = size / sizeof(T);
      auto print = [&](const char* path, const std::string& label, RowStats s) {
        s = combine(t, s);
        wrong_total += s.check.wrong;
        if (!root) return;
        const double algbw = static_cast<double>(size) / s.seconds / 1e9;
        const double rel = s.check.max_ref > 0 ? s.check.max_err / s.check.max_ref : s.check.max_err;
        table.row({std::to_string(size), std::to_string(count), type, path, label,
                   bench::strf("%.1f", s.seconds * 1e6), bench::strf("%.3f", algbw),
                   bench::strf("%.3f", algbw * busf), std::to_string(s.intra), std::to_string(s.inter),
                   s.checked ? bench::strf("%.2e", rel) : std::string("-"),
                   s.checked ? std::to_string(s.check.wrong) : std::string("-")});
      };
      // qcoll row
      {
        RowStats s;
        OverlapStats ov;
        const std::size_t B = o.block;
        auto go = [&](auto blk) {
          constexpr std::size_t Bk = decltype(blk)::value;
          with_format_b<Bk>(o.format, [&](auto f1) {
            using F1 = decltype(f1);
            if (op == OpKind::all_gather) {
              s = run_qcoll<T, F1, F1>(t, topo, o, op, count, o.hops);
              if (overlap) ov = run_overlap<T, F1, F1>(t, topo, o, op, count);
            } else {
              with_format2_b<Bk, F1>(o.format2, [&](auto f2) {
                using F2 = decltype(f2);
                s = run_qcoll<T, F1, F2>(t, topo, o, op, count, o.hops);
                if (overlap) ov = run_overlap<T, F1, F2>(t, topo, o, op, count);
              });
            }
          });
        };
        if (B == 2048)
          go(std::integral_constant<std::size_t, 2048>{});
        else
          go(std::integral_constant<std::size_t, 256>{});
        print("qcoll", fmt_label(o, op), s);
        if (overlap) {
          auto add_row = [&](const char* name, const std::string& label, const OverlapStats& x) {
            const double hideable = std::min(x.blocking, x.compute);
            auto frac = [&](double split) {
              return bench::strf("%.2f", hideable > 0 ? (x.blocking + x.compute - split) / hideable : 0.0);
            };
            overlap_rows.push_back({name, std::to_string(size), label, bench::strf("%.1f", x.blocking * 1e6),
                                    bench::strf("%.1f", x.compute * 1e6), bench::strf("%.1f", x.split * 1e6),
                                    frac(x.split), bench::strf("%.1f", x.split_quiet * 1e6),
                                    frac(x.split_quiet)});
          };
          add_row(op_name(op), fmt_label(o, op), ov);
          if (op == OpKind::all_gather) add_row("iallgather", "bytes", run_bare_overlap(t, o, size));
        }
      }
      // baseline row
      {
        RowStats s;
        bool done = false;
#if QCOLL_HAVE_MPI
        if constexpr (std::is_same<Tr, MpiTransport>::value) {
          s = run_mpi_baseline<T>(t, topo, o, op, count);
          done = true;
        }
#endif
        if (!done) {
          using Id = Identity<T, 256>;
          s = run_qcoll<T, Id, Id>(t, topo, o, op, count, Hops::one);
        }
        print(is_mpi ? "mpi" : "ident-1hop", is_mpi ? "-" : type, s);
      }
      if (size > max_size / static_cast<std::size_t>(o.factor) || !o.group.empty()) break;
      size *= static_cast<std::size_t>(o.factor);
    }
  }
  if (root && overlap && !overlap_rows.empty()) {
    std::printf(
        "\n# overlap (compute %s): start; compute C (8 parts, progress() after each); finish, against the "
        "blocking call "
        "Tb and C in a row;\n# overlap = (Tb + C - T) / min(Tb, C); 'quiet': the same without progress() "
        "(times in us, slowest rank)\n",
        o.overlap_idle ? "idle" : "cpu");
    bench::Table ot({{"op", 14, true},
                     {"size", 11},
                     {"format", 15, true},
                     {"Tb", 9},
                     {"C", 9},
                     {"T", 9},
                     {"overlap", 7},
                     {"T_quiet", 9},
                     {"ovl_quiet", 9}},
                    false);
    ot.header();
    for (const auto& row : overlap_rows) ot.row(row);
  }
  return wrong_total;
}

template <class Tr>
std::uint64_t bench_typed(Tr& t, const Topology& topo, const Options& o, bool is_mpi) {
#if QCOLL_BENCH_QUICK_BUILD
  return bench_all<float>(t, topo, o, is_mpi);  // parse() admits f32 only: half the instantiations
#else
  return o.bf16 ? bench_all<bfloat16>(t, topo, o, is_mpi) : bench_all<float>(t, topo, o, is_mpi);
#endif
}

// --group SPEC: list:N1,N2,... or random:COUNT:MAX[:SEED].
std::vector<std::size_t> parse_group(const std::string& spec) {
  auto number = [&](const std::string& v) {
    char* end = nullptr;
    const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0')
      throw bench::UsageError("flag --group: '" + v + "' in '" + spec + "' is not a count");
    return static_cast<std::size_t>(x);
  };
  auto split = [](const std::string& v, char sep) {
    std::vector<std::string> out;
    std::size_t at = 0;
    for (std::size_t i; (i = v.find(sep, at)) != std::string::npos; at = i + 1)
      out.push_back(v.substr(at, i - at));
    out.push_back(v.substr(at));
    return out;
  };
  std::vector<std::size_t> sizes;
  if (spec.rfind("list:", 0) == 0) {
    for (const std::string& x : split(spec.substr(5), ',')) sizes.push_back(number(x));
  } else if (spec.rfind("random:", 0) == 0) {
    const std::vector<std::string> f = split(spec.substr(7), ':');
    if (f.size() < 2 || f.size() > 3)
      throw bench::UsageError("flag --group: '" + spec + "' is not random:COUNT:MAX[:SEED]");
    const std::size_t count = number(f[0]), max = number(f[1]);
    std::uint64_t state = f.size() == 3 ? number(f[2]) : 1;
    for (std::size_t k = 0; k < count; ++k)
      sizes.push_back(static_cast<std::size_t>(mix(++state) % (max + 1)));
  } else {
    throw bench::UsageError("flag --group: '" + spec + "' is not list:N1,N2,... or random:COUNT:MAX[:SEED]");
  }
  if (sizes.empty() || (sizes.size() == 1 && sizes[0] == 0))
    throw bench::UsageError("flag --group: '" + spec + "' has no elements");
  return sizes;
}

Options parse(int argc, char** argv, bool& help) {
  Options o;
  help = false;
  for (bench::Args a(argc, argv); !a.done();) {
    if (a.flag("-h", "--help")) {
      help = true;
    } else if (a.flag("--op")) {
      const std::string v = a.value();
      if (v == "all_gather")
        o.ops = {OpKind::all_gather};
      else if (v == "reduce_scatter")
        o.ops = {OpKind::reduce_scatter};
      else if (v == "all_reduce")
        o.ops = {OpKind::all_reduce};
      else if (v == "all")
        o.ops = {OpKind::all_gather, OpKind::reduce_scatter, OpKind::all_reduce};
      else
        throw bench::UsageError("flag --op: '" + v +
                                "' is not all_gather, reduce_scatter, all_reduce or all");
    } else if (a.flag("--transport")) {
      o.transport = a.value();
      if (o.transport != "local" && o.transport != "mpi")
        throw bench::UsageError("flag --transport: '" + o.transport + "' is not local or mpi");
    } else if (a.flag("--ranks")) {
      o.ranks = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 1024));
    } else if (a.flag("--ranks-per-node")) {
      o.ranks_per_node = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 1024));
    } else if (a.flag("-b", "--minbytes")) {
      o.minbytes = bench::parse_count(a.value(), a.name());
    } else if (a.flag("-e", "--maxbytes")) {
      o.maxbytes = bench::parse_count(a.value(), a.name());
    } else if (a.flag("-f", "--stepfactor")) {
      o.factor = bench::parse_int(a.value(), a.name(), 2, 1024);
    } else if (a.flag("-n", "--iters")) {
      o.iters = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 1000000));
    } else if (a.flag("-w", "--warmup_iters")) {
      o.warmup = static_cast<int>(bench::parse_int(a.value(), a.name(), 0, 1000000));
    } else if (a.flag("-c", "--check")) {
      o.check = bench::parse_int(a.value(), a.name(), 0, 1) != 0;
    } else if (a.flag("--type")) {
      const std::string v = a.value();
      if (v != "f32" && v != "bf16") throw bench::UsageError("flag --type: '" + v + "' is not f32 or bf16");
      o.bf16 = v == "bf16";
      bench::check_quick_build_type("--type", v);
    } else if (a.flag("--format") || a.flag("--format2")) {
      const std::string flag = a.name(), v = a.value();
      FormatId id;
      try {
        id = parse_format(v);
      } catch (const Error& e) {
        throw bench::UsageError("flag " + flag + ": " + e.what());
      }
      if (!supported(id))
        throw bench::UsageError("flag " + flag + ": '" + v + "' is not one of int8 int4 e4m3 mxfp4 f32 bf16");
      if (flag == "--format") {
        o.format = id;
      } else {
        o.format2 = id;
        o.format2_set = true;
      }
    } else if (a.flag("--block")) {
      o.block = static_cast<std::size_t>(bench::parse_int(a.value(), a.name(), 1, 8192));
      if (o.block != 256 && o.block != 2048) throw bench::UsageError("flag --block: must be 256 or 2048");
    } else if (a.flag("--hops")) {
      o.hops = bench::parse_int(a.value(), a.name(), 1, 2) == 1 ? Hops::one : Hops::two;
    } else if (a.flag("--reduce")) {
      const std::string v = a.value();
      if (v != "sum" && v != "mean") throw bench::UsageError("flag --reduce: '" + v + "' is not sum or mean");
      o.reduce = v == "sum" ? Reduce::sum : Reduce::mean;
    } else if (a.flag("--overlap")) {
      o.overlap = bench::parse_int(a.value(), a.name(), 0, 1) != 0;
    } else if (a.flag("--overlap-compute")) {
      const std::string v = a.value();
      if (v != "cpu" && v != "idle")
        throw bench::UsageError("flag --overlap-compute: '" + v + "' is not cpu or idle");
      o.overlap_idle = v == "idle";
    } else if (a.flag("--group")) {
      o.group_spec = a.value();
      o.group = parse_group(o.group_spec);
    } else if (a.flag("--seed")) {
      o.seed = static_cast<std::uint64_t>(bench::parse_int(a.value(), a.name(), 0, 2147483647));
    } else {
      a.unknown();
    }
  }
  if (!o.format2_set) o.format2 = o.format;
  if (o.format2 != o.format &&
      !(o.block == 256 && (o.format2 == FormatId::int8 || o.format2 == FormatId::int4)))
    throw bench::UsageError(std::string("flag --format2: ") + format_name(o.format2) +
                            " must equal --format, or be int8 / int4 with --block 256");
  if (o.minbytes > o.maxbytes) throw bench::UsageError("flag -b: minbytes exceeds maxbytes");
  return o;
}

std::vector<long long> node_major_ids(int world, int per_node) {
  std::vector<long long> ids(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) ids[static_cast<std::size_t>(r)] = r / per_node;
  return ids;
}

int run_local(const Options& o) {
  const int L = o.ranks_per_node > 0 ? o.ranks_per_node : std::min(4, o.ranks);
  if (o.ranks % L != 0)
    throw bench::UsageError("flag --ranks-per-node: " + std::to_string(L) + " does not divide --ranks " +
                            std::to_string(o.ranks));
  const std::vector<long long> ids = node_major_ids(o.ranks, L);
  LocalGroup group(o.ranks, ids);
  std::uint64_t wrong = 0;
  group.run([&](LocalTransport& t) {
    const Topology topo = Topology::from_node_ids(ids, t.rank());
    const std::uint64_t w = bench_typed(t, topo, o, false);
    if (t.rank() == 0) wrong = w;
  });
  return wrong > 0 ? 1 : 0;
}

#if QCOLL_HAVE_MPI
int run_mpi(const Options& o) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<long long> ids;
  if (o.ranks_per_node > 0) {
    if (size % o.ranks_per_node != 0)
      throw bench::UsageError("flag --ranks-per-node: " + std::to_string(o.ranks_per_node) +
                              " does not divide the MPI world size " + std::to_string(size));
    ids = node_major_ids(size, o.ranks_per_node);
  }
  MpiTransport t(MPI_COMM_WORLD, ids);
  std::vector<long long> nodes(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) nodes[static_cast<std::size_t>(r)] = t.node_of(r);
  const Topology topo = Topology::from_node_ids(nodes, t.rank());
  const std::uint64_t wrong = bench_typed(t, topo, o, true);
  return wrong > 0 ? 1 : 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
#if QCOLL_HAVE_MPI
  MPI_Init(&argc, &argv);
  int world = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
#else
  const int world = 1, rank = 0;
#endif
  int status = 0;
  try {
    bool help = false;
    const Options o = parse(argc, argv, help);
    if (help) {
      if (rank == 0) std::fputs(kHelp, stdout);
    } else {
      const std::string tr = o.transport.empty() ? (world > 1 ? "mpi" : "local") : o.transport;
      if (tr == "mpi") {
#if QCOLL_HAVE_MPI
        status = run_mpi(o);
#else
        throw bench::UsageError("flag --transport: mpi is not available in this build");
#endif
      } else {
        if (world > 1) throw bench::UsageError("flag --transport: local needs a single process");
        status = run_local(o);
      }
      if (rank == 0) std::printf("# %s\n", status == 0 ? "all results within bounds" : "FAILED: #wrong > 0");
    }
  } catch (const bench::UsageError& e) {
    if (rank == 0) std::fprintf(stderr, "collectives: %s\n", e.what());
    status = 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collectives (rank %d): %s\n", rank, e.what());
    status = 1;
#if QCOLL_HAVE_MPI
    MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  }
#if QCOLL_HAVE_MPI
  MPI_Finalize();
#endif
  return status;
}
