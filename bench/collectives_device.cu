// Device collective benchmark in the style of nccl-tests: the quantized collectives of ZeRO++ on
// device memory (qwZ all-gather, hpZ gather, qgZ reduce-scatter in one and two hops, all-reduce)
// over the nccl transport (one rank per visible GPU) and the cuda_local transport (several ranks
// sharing GPU 0), each size next to the unquantized collectives of the same transport measured in
// the same run and printed in the same table.
//
//   collectives_device [--transport nccl|cuda_local|all] [--op LIST] [--sizes LIST] [--graph] ...
//   (--help lists every flag)
//
// Rows. Every (transport, size) prints three groups of rows, the reference of a group first
// (marked '*' in the path column):
//   all_gather      ncclAllGather*  NCCL's own all-gather of the unquantized shards (nccl only)
//                   tr.all_gather   the transport's all_gather of the shards' raw bytes (the
//                                   reference for cuda_local)
//                   qwZ             QuantizedAllGather in the weight format
//                   hpZ             SecondaryShard::gather in the hpZ format (the backward gather
//                                   inside the node; compared with the world-wide gathers above)
//   reduce_scatter  ncclReduceScatter*, tr.all_to_all (the raw bytes of an unquantized
//                   reduce-scatter, without the reduction), qgZ-1hop, qgZ-2hop
//                   (QuantizedReduceScatter in the gradient format(s))
//   all_reduce      ncclAllReduce*, tr.a2a+ag (raw all_to_all then raw all_gather of a shard),
//                   qgZ-1hop+qwZ or qgZ-2hop+qwZ (QuantizedAllReduce; its all-gather stage uses the
//                   gradient format)
//
// Columns (nccl-tests definitions): count = elements of the full tensor (all ranks' shards
// together, before padding); size = count x element bytes; time = mean time of one call, on the
// slowest rank: CUDA events recorded on each rank's stream around the timed calls, with no host
// synchronisation in between; algbw = size / time (GB/s, 1e9 bytes); busbw = algbw x (n-1)/n for
// all-gather and reduce-scatter, x 2(n-1)/n for all-reduce, where n is the number of ranks that
// exchange (the world, or the L ranks of a node for hpZ). intra / inter = bytes one rank hands to
// the transport per call for peers on its own node / on other nodes (the transports' byte
// counters over one call; for the direct NCCL rows the logical volume: one shard per peer, twice
// for all-reduce), largest over ranks. x_time, x_wire = time and intra + inter relative to the
// group's reference row of the same size. flags = the result flags of the plan's call, read with
// gpu::read_result_flags after the timed calls and OR-ed over ranks ("ok" when none). #wrong
// (with -c 1 / --check 1, as nccl-tests' -c; "-" otherwise and on reference rows) = number of
// output elements, over all ranks, whose bits differ from those of the host plan: after a qcoll
// row's timed calls every rank downloads its input(s) and output, and rank 0 recomputes the same
// call with the same plan class over qcoll::LocalTransport (same world, node table, layout,
// formats, reduction, hops and rounding; for hpZ, capture of the same full buffer then gather).
// Any NaN equals any NaN. The device path is specified to equal the host path bit for bit, so any
// non-zero #wrong is a bug. The check runs outside the timed calls but is slow at large sizes.
//
// Exit status: 0, or 1 if some row's flags hold kResultRejected or kResultBadMessage, or some
// row's #wrong is not 0 (or a CUDA / NCCL / qcoll error occurred), 2 on a bad command line.
// Without a CUDA device the program prints "skipped: no CUDA device" and exits with 0 (a benchmark
// is not a test).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#ifndef QCOLL_HAVE_NCCL
#if defined(__has_include)
#if __has_include(<nccl.h>)
#define QCOLL_HAVE_NCCL 1
#endif
#endif
#endif
#ifndef QCOLL_HAVE_NCCL
#define QCOLL_HAVE_NCCL 0
#endif
#if !QCOLL_HAVE_NCCL && !defined(QCOLL_HAS_NCCL)
#define QCOLL_HAS_NCCL 0  // a build without NCCL: keep transport/nccl.cuh from including <nccl.h>
#endif

#include <qcoll/qcoll.cuh>
#include <qcoll/transport/cuda_local.cuh>
#if QCOLL_HAVE_NCCL
#include <qcoll/transport/nccl.cuh>
#endif

#include "bench_util.hpp"

namespace {

namespace qc = qcoll;
namespace bench = qcoll::bench;

const char* const kHelp =
    "usage: collectives_device [flags]\n"
    "Quantized collectives on device memory (qwZ all-gather, hpZ gather, qgZ reduce-scatter in one\n"
    "and two hops, all-reduce) next to the unquantized collectives of the same transport.\n"
    "\n"
    "  --transport T         nccl | cuda_local | all (default: all; without NCCL in the build, all\n"
    "                        means cuda_local)\n"
    "  --gpus G              nccl: one rank per GPU on the first G visible GPUs, one host thread\n"
    "                        each, communicators from ncclCommInitAll (default: every visible GPU;\n"
    "                        one GPU gives a world of 1)\n"
    "  --nccl-nodes N        nccl: place the G ranks on N pretend nodes, node-major (default: 1)\n"
    "  --ranks W             cuda_local: W ranks sharing GPU 0, one host thread each, 1..64\n"
    "                        (default: 4)\n"
    "  --nodes N             cuda_local: place the W ranks on N pretend nodes of W/N ranks,\n"
    "                        node-major (default: 2 when W is even, else 1); the topology of the\n"
    "                        two-hop reduce-scatter and of hpZ\n"
    "  --op LIST             comma-separated: all_gather (qwZ), hpz, reduce_scatter_1hop,\n"
    "                        reduce_scatter_2hop (qgZ), all_reduce, all (default: all); the\n"
    "                        reference rows of an op's group always run\n"
    "  --sizes LIST          element counts of the full tensor (all ranks' shards together),\n"
    "                        comma-separated, suffixes K M G = 2^10 2^20 2^30; replaces -b -e -f\n"
    "  -b, --minbytes N      smallest full-tensor size in bytes, as nccl-tests (default: 1M\n"
    "                        elements)\n"
    "  -e, --maxbytes N      largest full-tensor size in bytes (default: 256M elements)\n"
    "  -f, --stepfactor F    size multiplier, 2..1024 (default: 4)\n"
    "                        Sizes whose buffers would not fit in device memory are skipped with a\n"
    "                        note.\n"
    "  -n, --iters N         timed calls per row, 1..100000 (default: 20)\n"
    "  -w, --warmup_iters N  untimed calls before them, 0..100000 (default: 5)\n"
    "  --graph               capture one call per rank in a CUDA graph and time graph launches\n"
    "  --type T              element type: f32 | f16 | bf16 (default: bf16; f32 only in a quick build)\n"
    "  --wformat F           weight format of the qwZ all-gather (default: int8)\n"
    "  --hformat F           format of the hpZ gather (default: the element type, unquantized)\n"
    "  --gformat F           gradient format: reduce-scatter hop 1, and all-reduce (default: int4)\n"
    "  --gformat2 F          reduce-scatter hop-2 format: the --gformat (default), int8 or int4\n"
    "                        Formats: int8 int4 e4m3 mxfp4, or the element type's own name\n"
    "                        (f32 / f16 / bf16) for unquantized.\n"
    "  --block B             block of int8, int4, e4m3 (and the layout granule): 256 | 2048\n"
    "                        (default: 256; mxfp4 always uses 32)\n"
    "  --hops 1|2            route of the all-reduce's reduce-scatter stage (default: 2)\n"
    "  --reduce sum|mean     reduction of reduce-scatter and all-reduce (default: sum)\n"
    "  --rounding R          nearest | stochastic: rounding of the quantized all-gather,\n"
    "                        reduce-scatter and all-reduce, stochastic keyed by --seed (default:\n"
    "                        nearest)\n"
    "  --seed S              input seed (and stochastic rounding key), 0..2^31-1 (default: 1)\n"
    "  -c, --check C         1: after each qcoll row's timed calls, compare every rank's output\n"
    "                        with the host plan's over LocalTransport fed the same inputs (column\n"
    "                        #wrong: elements whose bits differ; any NaN equals any NaN); slow at\n"
    "                        large sizes (default: 0, no check)\n"
    "  --csv                 print the table as CSV (notes as '#' lines)\n"
    "  -h, --help            this text\n"
    "\n"
    "Exit status: 0; 1 if a call reported kResultRejected or kResultBadMessage, if a row's #wrong\n"
    "is not 0, or on a CUDA, NCCL or qcoll error; 2 on a bad command line. Without a CUDA device: prints\n"
    "\"skipped: no CUDA device\" and exits with 0.\n";

enum : unsigned {
  kOpAllGather = 1,
  kOpHpz = 2,
  kOpRs1 = 4,
  kOpRs2 = 8,
  kOpAllReduce = 16,
  kOpAll = 31,
};

constexpr std::size_t kDefaultMinCount = std::size_t{1} << 20;
constexpr std::size_t kDefaultMaxCount = std::size_t{256} << 20;
constexpr std::size_t kMaxCount = std::size_t{1} << 36;  // keeps every byte count far from overflow

struct Options {
  bool nccl = true;
  bool cuda_local = true;
  int gpus = 0;  // 0: every visible GPU
  int nccl_nodes = 1;
  int ranks = 4;
  int nodes = 0;  // 0: default
  unsigned ops = kOpAll;
  std::vector<std::size_t> sizes;          // element counts; empty: the sweep below
  std::size_t minbytes = 0, maxbytes = 0;  // 0: the default counts
  std::size_t factor = 4;
  int iters = 20;
  int warmup = 5;
  bool graph = false;
  bool csv = false;
  qc::DType type = bench::kQuickBuild ? qc::DType::f32 : qc::DType::bf16;  // the quick build has f32 only
  qc::FormatId wformat = qc::FormatId::int8;
  qc::FormatId hformat = qc::FormatId::identity_bf16;
  qc::FormatId gformat = qc::FormatId::int4;
  qc::FormatId gformat2 = qc::FormatId::int4;
  std::string wformat_text = "int8", hformat_text, gformat_text = "int4", gformat2_text;
  std::size_t block = 256;
  qc::Hops hops = qc::Hops::two;
  qc::Reduce reduce = qc::Reduce::sum;
  bool stochastic = false;
  std::uint64_t seed = 1;
  int check = 0;
};

std::size_t elem_bytes(qc::DType t) { return t == qc::DType::f32 ? 4 : 2; }

qc::FormatId identity_of(qc::DType t) {
  return t == qc::DType::f32   ? qc::FormatId::identity_f32
         : t == qc::DType::f16 ? qc::FormatId::identity_f16
                               : qc::FormatId::identity_bf16;
}

// Resolves a format flag once the element type is known: int8 int4 e4m3 mxfp4, or the element
// type's own identity format.
qc::FormatId resolve_format(const std::string& flag, const std::string& text, qc::DType type) {
  const std::string ty = qc::dtype_name(type);
  const std::string allowed = "int8 int4 e4m3 mxfp4 " + ty;
  if (text == "int8") return qc::FormatId::int8;
  if (text == "int4") return qc::FormatId::int4;
  if (text == "e4m3") return qc::FormatId::fp8_e4m3;
  if (text == "mxfp4") return qc::FormatId::mxfp4;
  if (text == ty) return identity_of(type);
  if (text == "f32" || text == "f16" || text == "bf16")
    throw bench::UsageError("flag " + flag + ": '" + text + "' is not the element type " + ty +
                            " (unquantized formats travel as the element type); expected one of " + allowed);
  throw bench::UsageError("flag " + flag + ": '" + text + "' is not one of " + allowed);
}

unsigned parse_ops(const std::string& text) {
  unsigned ops = 0;
  for (const std::string& item : bench::split_list(text)) {
    if (item == "all_gather") {
      ops |= kOpAllGather;
    } else if (item == "hpz") {
      ops |= kOpHpz;
    } else if (item == "reduce_scatter_1hop") {
      ops |= kOpRs1;
    } else if (item == "reduce_scatter_2hop") {
      ops |= kOpRs2;
    } else if (item == "all_reduce") {
      ops |= kOpAllReduce;
    } else if (item == "all") {
      ops |= kOpAll;
    } else {
      throw bench::UsageError("flag --op: '" + item +
                              "' is not one of all_gather hpz reduce_scatter_1hop reduce_scatter_2hop "
                              "all_reduce all");
    }
  }
  if (ops == 0) throw bench::UsageError("flag --op: '" + text + "' names no operation");
  return ops;
}

Options parse(int argc, char** argv, bool& help) {
  Options o;
  help = false;
  bool sizes_given = false, range_given = false;
  for (bench::Args a(argc, argv); !a.done();) {
    if (a.flag("-h", "--help")) {
      help = true;
    } else if (a.flag("--transport")) {
      const std::string v = a.value();
      if (v != "nccl" && v != "cuda_local" && v != "all")
        throw bench::UsageError("flag --transport: '" + v + "' is not nccl, cuda_local or all");
#if !QCOLL_HAVE_NCCL
      if (v == "nccl")
        throw bench::UsageError(
            "flag --transport: nccl is not available (this program was built without NCCL)");
#endif
      o.nccl = v != "cuda_local";
      o.cuda_local = v != "nccl";
    } else if (a.flag("--gpus")) {
      o.gpus = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 1024));
    } else if (a.flag("--nccl-nodes")) {
      o.nccl_nodes = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 1024));
    } else if (a.flag("--ranks")) {
      o.ranks = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 64));
    } else if (a.flag("--nodes")) {
      o.nodes = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 64));
    } else if (a.flag("--op")) {
      o.ops = parse_ops(a.value());
    } else if (a.flag("--sizes")) {
      const std::string v = a.value();
      o.sizes.clear();
      for (const std::string& item : bench::split_list(v)) {
        const std::size_t n = bench::parse_count(item, a.name());
        if (n > kMaxCount)
          throw bench::UsageError("flag --sizes: " + item +
                                  " elements exceeds the limit of 2^36 = " + std::to_string(kMaxCount));
        o.sizes.push_back(n);
      }
      if (o.sizes.empty()) throw bench::UsageError("flag --sizes: '" + v + "' lists no size");
      sizes_given = true;
    } else if (a.flag("-b", "--minbytes")) {
      o.minbytes = bench::parse_count(a.value(), a.name());
      range_given = true;
    } else if (a.flag("-e", "--maxbytes")) {
      o.maxbytes = bench::parse_count(a.value(), a.name());
      range_given = true;
    } else if (a.flag("-f", "--stepfactor")) {
      o.factor = static_cast<std::size_t>(bench::parse_int(a.value(), a.name(), 2, 1024));
    } else if (a.flag("-n", "--iters")) {
      o.iters = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 100000));
    } else if (a.flag("-w", "--warmup_iters")) {
      o.warmup = static_cast<int>(bench::parse_int(a.value(), a.name(), 0, 100000));
    } else if (a.flag("--graph")) {
      o.graph = true;
    } else if (a.flag("--csv")) {
      o.csv = true;
    } else if (a.flag("--type")) {
      const std::string v = a.value();
      if (v == "f32") {
        o.type = qc::DType::f32;
      } else if (v == "f16") {
        o.type = qc::DType::f16;
      } else if (v == "bf16") {
        o.type = qc::DType::bf16;
      } else {
        throw bench::UsageError("flag --type: '" + v + "' is not f32, f16 or bf16");
      }
      bench::check_quick_build_type("--type", v);
    } else if (a.flag("--wformat")) {
      o.wformat_text = a.value();
    } else if (a.flag("--hformat")) {
      o.hformat_text = a.value();
    } else if (a.flag("--gformat")) {
      o.gformat_text = a.value();
    } else if (a.flag("--gformat2")) {
      o.gformat2_text = a.value();
    } else if (a.flag("--block")) {
      const std::string v = a.value();
      if (v != "256" && v != "2048") throw bench::UsageError("flag --block: '" + v + "' is not 256 or 2048");
      o.block = v == "256" ? 256 : 2048;
    } else if (a.flag("--hops")) {
      o.hops = bench::parse_int(a.value(), a.name(), 1, 2) == 1 ? qc::Hops::one : qc::Hops::two;
    } else if (a.flag("--reduce")) {
      const std::string v = a.value();
      if (v != "sum" && v != "mean") throw bench::UsageError("flag --reduce: '" + v + "' is not sum or mean");
      o.reduce = v == "sum" ? qc::Reduce::sum : qc::Reduce::mean;
    } else if (a.flag("--rounding")) {
      const std::string v = a.value();
      if (v != "nearest" && v != "stochastic")
        throw bench::UsageError("flag --rounding: '" + v + "' is not nearest or stochastic");
      o.stochastic = v == "stochastic";
    } else if (a.flag("-c", "--check")) {
      o.check = static_cast<int>(bench::parse_int(a.value(), a.name(), 0, 1));
    } else if (a.flag("--seed")) {
      o.seed = static_cast<std::uint64_t>(bench::parse_int(a.value(), a.name(), 0, 2147483647));
    } else {
      a.unknown();
    }
  }
  if (help) return o;

  o.wformat = resolve_format("--wformat", o.wformat_text, o.type);
  if (o.hformat_text.empty()) o.hformat_text = qc::dtype_name(o.type);
  o.hformat = resolve_format("--hformat", o.hformat_text, o.type);
  o.gformat = resolve_format("--gformat", o.gformat_text, o.type);
  if (o.gformat2_text.empty()) o.gformat2_text = o.gformat_text;
  o.gformat2 = resolve_format("--gformat2", o.gformat2_text, o.type);
  if (o.gformat2 != o.gformat && o.gformat2 != qc::FormatId::int8 && o.gformat2 != qc::FormatId::int4)
    throw bench::UsageError("flag --gformat2: '" + o.gformat2_text + "' must be the --gformat ('" +
                            o.gformat_text + "'), int8 or int4");

  if (o.nodes == 0) o.nodes = o.ranks % 2 == 0 ? 2 : 1;
  if (o.cuda_local && o.ranks % o.nodes != 0)
    throw bench::UsageError("flag --nodes: " + std::to_string(o.nodes) + " does not divide --ranks " +
                            std::to_string(o.ranks));

  if (sizes_given && range_given)
    throw bench::UsageError("flag --sizes: cannot be combined with -b / -e (give one or the other)");
  if (!sizes_given) {
    const std::size_t eb = elem_bytes(o.type);
    const std::size_t lo = o.minbytes != 0 ? o.minbytes / eb : kDefaultMinCount;
    const std::size_t hi = o.maxbytes != 0 ? o.maxbytes / eb : kDefaultMaxCount;
    if (lo == 0)
      throw bench::UsageError("flag -b: " + std::to_string(o.minbytes) + " bytes is below one element of " +
                              std::to_string(eb) + " bytes");
    if (hi > kMaxCount)
      throw bench::UsageError("flag -e: " + std::to_string(o.maxbytes) +
                              " bytes exceeds the limit of 2^36 = " + std::to_string(kMaxCount) +
                              " elements");
    if (lo > hi)
      throw bench::UsageError("flag -b: " + std::to_string(lo * eb) + " bytes exceeds -e, " +
                              std::to_string(hi * eb) + " bytes");
    for (std::size_t n = lo; n <= hi; n *= o.factor) {
      o.sizes.push_back(n);
      if (n > hi / o.factor) break;
    }
  }
  return o;
}

// ----------------------------------------------------------------------------------------------
// Device helpers.

//! cudaMalloc'd bytes (at least 256, so that no buffer is null), freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    QCOLL_CUDA_CHECK(cudaMalloc(&p_, std::max<std::size_t>(bytes, 256)));
  }
  ~DeviceBuffer() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return p_; }
  std::size_t bytes() const { return bytes_; }
  template <class U>
  U* as() const {
    return static_cast<U*>(p_);
  }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

//! Values u * 2^e with u uniform in [-1/2, 1/2) from the counter-based generator (seed, global
//! index) and e in [-4, 4] changing every 256 elements, so blocks have different scales.
template <class T>
__global__ void fill_kernel(T* p, std::size_t n, std::uint64_t seed, std::size_t index_base) {
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const std::size_t g = index_base + i;
    const float u = qc::fp::sub(qc::random_unit(qc::random_bits(seed, g)), 0.5f);
    const int e = static_cast<int>((g / 256) % 9) - 4;
    p[i] = qc::from_float<T>(qc::fp::mul(u, qc::fp::exp2i(e)));
  }
}

template <class T>
void fill(T* p, std::size_t n, std::uint64_t seed, std::size_t index_base, cudaStream_t stream) {
  if (n == 0) return;
  const std::size_t blocks = std::min<std::size_t>((n + 255) / 256, 4096);
  fill_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p, n, seed, index_base);
  QCOLL_CUDA_CHECK_LAUNCH();
}

#if QCOLL_HAVE_NCCL
//! A non-blocking stream, destroyed on destruction.
class Stream {
 public:
  Stream() { QCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() {
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

template <class T>
ncclDataType_t nccl_type() {
  return std::is_same<T, float>::value      ? ncclFloat32
         : std::is_same<T, qc::half>::value ? ncclFloat16
                                            : ncclBfloat16;
}

void nccl_ok(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess)
    throw qc::Error(std::string("collectives_device: ") + what + " failed: " + ncclGetErrorString(rc));
}
#endif

// ----------------------------------------------------------------------------------------------
// The benchmark's one transport type: a cuda_local or NCCL rank behind virtual calls, so that the
// plans and the benchmark around them are compiled once, not once per transport (their host code
// is most of this program's compile time). One virtual call per exchange costs nothing next to
// the exchange. It has the members of the transport concept that the plans and this program use.

class AnyTransport {
 public:
  static constexpr qc::MemorySpace memory_space = qc::MemorySpace::device;
  using stream_type = cudaStream_t;

  //! Wraps `t`, which must outlive this object and every transport split from it.
  template <class Tr>
  static AnyTransport borrow(Tr& t) {
    return AnyTransport(std::make_unique<Model<Tr>>(t));
  }

  int rank() const { return p_->rank(); }
  int size() const { return p_->size(); }
  void all_gather(const void* send, void* recv, std::size_t bytes_per_rank, stream_type stream = {}) {
    p_->all_gather(send, recv, bytes_per_rank, stream);
  }
  void all_to_all(const void* send, void* recv, std::size_t bytes_per_rank, stream_type stream = {}) {
    p_->all_to_all(send, recv, bytes_per_rank, stream);
  }
  void all_reduce(std::uint64_t* data, std::size_t count, qc::ReduceOp op) {
    p_->all_reduce(data, count, op);
  }
  void barrier() { p_->barrier(); }
  AnyTransport split(int color, int key) { return AnyTransport(p_->split(color, key)); }
  const qc::ByteCounters& counters() const { return p_->counters(); }
#if QCOLL_HAVE_NCCL
  //! The NCCL communicator of an NCCL rank (the reference rows call NCCL directly), else null.
  ncclComm_t comm() const { return p_->comm(); }
#endif

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual void all_gather(const void* send, void* recv, std::size_t bytes, cudaStream_t stream) = 0;
    virtual void all_to_all(const void* send, void* recv, std::size_t bytes, cudaStream_t stream) = 0;
    virtual void all_reduce(std::uint64_t* data, std::size_t count, qc::ReduceOp op) = 0;
    virtual void barrier() = 0;
    virtual std::unique_ptr<Concept> split(int color, int key) = 0;
    virtual const qc::ByteCounters& counters() const = 0;
#if QCOLL_HAVE_NCCL
    virtual ncclComm_t comm() const = 0;
#endif
  };

  // A borrowed rank, or an owned one (split results), at t.
  template <class Tr>
  struct Model final : Concept {
    explicit Model(Tr& borrowed) : t(&borrowed) {}
    explicit Model(Tr&& split) : owned(std::make_unique<Tr>(std::move(split))), t(owned.get()) {}
    int rank() const override { return t->rank(); }
    int size() const override { return t->size(); }
    void all_gather(const void* send, void* recv, std::size_t bytes, cudaStream_t stream) override {
      t->all_gather(send, recv, bytes, stream);
    }
    void all_to_all(const void* send, void* recv, std::size_t bytes, cudaStream_t stream) override {
      t->all_to_all(send, recv, bytes, stream);
    }
    void all_reduce(std::uint64_t* data, std::size_t count, qc::ReduceOp op) override {
      t->all_reduce(data, count, op);
    }
    void barrier() override { t->barrier(); }
    std::unique_ptr<Concept> split(int color, int key) override {
      return std::make_unique<Model>(t->split(color, key));
    }
    const qc::ByteCounters& counters() const override { return t->counters(); }
#if QCOLL_HAVE_NCCL
    ncclComm_t comm() const override {
      if constexpr (std::is_same<Tr, qc::NcclTransport>::value) {
        return t->comm();
      } else {
        return nullptr;
      }
    }
#endif
    std::unique_ptr<Tr> owned;  // null when borrowed
    Tr* t;
  };

  explicit AnyTransport(std::unique_ptr<Concept> p) : p_(std::move(p)) {}
  std::unique_ptr<Concept> p_;
};

// ----------------------------------------------------------------------------------------------
// Formats (compile-time dispatch over the supported set, to bound the instantiations).

template <class T, std::size_t B, class Fn>
void with_format(qc::FormatId id, Fn&& fn) {
  switch (id) {
    case qc::FormatId::int8: fn(qc::Int8<B>{}); return;
    case qc::FormatId::int4: fn(qc::Int4<B>{}); return;
    case qc::FormatId::fp8_e4m3: fn(qc::Fp8E4M3<B>{}); return;
    case qc::FormatId::mxfp4: fn(qc::MxFp4{}); return;
    default: fn(qc::Identity<T, B>{}); return;  // parse() admits only the element type's identity
  }
}

// The hop-2 format: the hop-1 format F1, int8 or int4 (parse() admits nothing else).
template <std::size_t B, class F1, class Fn>
void with_format2(qc::FormatId id, Fn&& fn) {
  if (id == F1::id) {
    fn(F1{});
  } else if (id == qc::FormatId::int8) {
    fn(qc::Int8<B>{});
  } else {
    fn(qc::Int4<B>{});
  }
}

template <class F>
std::string name_of() {
  return qc::format_name(F::id);
}

// ----------------------------------------------------------------------------------------------
// One transport's rows, run by every rank (rank 0 prints).

struct RowStats {
  double seconds = 0;  // mean per call; after combine(): the slowest rank's
  std::uint64_t intra = 0, inter = 0;
  std::uint32_t flags = 0;
  bool has_flags = false;  // a qcoll row (baselines have no result flags)
  long long wrong = -1;    // -c 1: output elements differing from the host plan's; -1: not checked
};

// The reference row of a group: the first row printed for an op and size.
struct Ref {
  double seconds = 0;
  std::uint64_t wire = 0;
  bool set = false;
};

std::string flags_text(const RowStats& s) {
  if (!s.has_flags) return "-";
  if (s.flags == 0) return "ok";
  std::string out;
  auto add = [&](const char* w) { out += out.empty() ? w : std::string("|") + w; };
  if (s.flags & qc::kResultRejected) add("REJECTED");
  if (s.flags & qc::kResultBadMessage) add("BADMSG");
  if (s.flags & qc::kResultNonFinite) add("nonfinite");
  const std::uint32_t known = qc::kResultRejected | qc::kResultBadMessage | qc::kResultNonFinite;
  if (s.flags & ~known) add(bench::strf("0x%x", static_cast<unsigned>(s.flags & ~known)).c_str());
  return out;
}

std::vector<bench::Column> columns() {
  return {
      {"op", 14, true}, {"transport", 10, true}, {"ranks", 5},     {"path", 15, true}, {"format", 14, true},
      {"count", 11},    {"size(B)", 12},         {"time(us)", 10}, {"algbw", 8},       {"busbw", 8},
      {"intra(B)", 12}, {"inter(B)", 12},        {"x_time", 7},    {"x_wire", 7},      {"flags", 9, true},
      {"#wrong", 7}};
}

// -c 1: what the ranks of one transport run share to check a row against the host plan. Made
// where the run starts, before its ranks; slot r is written by rank r only, and read by rank 0
// after a barrier.
struct CheckSlot {
  std::vector<unsigned char> in;   // the row's input (hpZ: the captured full buffer), as downloaded
  std::vector<unsigned char> out;  // the row's output after the timed calls
};

struct CheckShare {
  explicit CheckShare(std::vector<long long> ids) : node_ids(std::move(ids)), slots(node_ids.size()) {}
  std::vector<long long> node_ids;  // the run's node table (rank -> node id)
  std::vector<CheckSlot> slots;     // one per rank
};

// Rows of one transport run that failed (the same count on every rank).
struct Outcome {
  int flagged = 0;  // flags hold kResultRejected or kResultBadMessage
  int wrong = 0;    // #wrong > 0
};

// Set once the CSV title row is out (only rank 0 of one transport run at a time touches it).
bool csv_titles_printed = false;

template <class T>
class Bench {
  using Tr = AnyTransport;

 public:
  Bench(Tr& t, const qc::Topology& topo, cudaStream_t stream, const Options& o, const char* transport,
        int ranks_on_device, CheckShare& check)
      : t_(t),
        topo_(topo),
        stream_(stream),
        o_(o),
        transport_(transport),
        ranks_on_device_(ranks_on_device),
        check_(check),
        table_(columns(), o.csv) {
    QCOLL_CUDA_CHECK(cudaEventCreate(&start_));
    QCOLL_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~Bench() {
    (void)cudaEventDestroy(start_);
    (void)cudaEventDestroy(stop_);
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

  //! Runs every size; returns the number of rows whose flags hold kResultRejected or
  //! kResultBadMessage, and of rows with #wrong > 0 (the same on every rank).
  Outcome run() {
    // Text: a header per transport. CSV: one title row for the whole output.
    if (root() && !(o_.csv && csv_titles_printed)) {
      table_.header();
      csv_titles_printed = true;
    }
    for (std::size_t numel : o_.sizes) {
      if (!fits(numel)) continue;
      if (o_.block == 2048) {
        run_size<2048>(numel);
      } else {
        run_size<256>(numel);
      }
    }
    return outcome_;
  }

 private:
  using Counters = qc::ByteCounters;

  bool root() const { return t_.rank() == 0; }
  // A free-form line: "# text" (in CSV mode the table adds the '#').
  void note(const std::string& text) const { table_.note(o_.csv ? text : "# " + text); }
  int world() const { return t_.size(); }
  void sync() { QCOLL_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  // Whether the buffers of `numel` elements fit. A bound per rank of n (6 e + 4) bytes plus 64 MiB,
  // e = element bytes: input and output (2 n e), the workspace's sent and received messages of
  // both hops (at most 4 n e, reached with unquantized formats and one rank per node; far less with
  // quantized ones) and its fp32 partial sums (at most 4 n); times the ranks sharing the device,
  // within 85% of its free memory. Collective: every rank gets the same answer.
  bool fits(std::size_t numel) {
    t_.barrier();
    std::size_t free_b = 0, total_b = 0;
    QCOLL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double need =
        (static_cast<double>(numel) * (6.0 * sizeof(T) + 4.0) + 64.0 * (1 << 20)) * ranks_on_device_;
    std::uint64_t bad = need > 0.85 * static_cast<double>(free_b) ? 1 : 0;
    t_.all_reduce(&bad, 1, qc::ReduceOp::max);
    if (bad != 0 && root())
      note(bench::strf("count %zu skipped: needs about %s of device memory for %d rank(s), %s free", numel,
                       bench::format_bytes(need).c_str(), ranks_on_device_,
                       bench::format_bytes(static_cast<double>(free_b)).c_str()));
    return bad == 0;
  }

  template <std::size_t B>
  void run_size(std::size_t numel) {
    const qc::ShardLayout layout(numel, world(), qc::granule_for(sizeof(T), {B}));
    if (o_.ops & (kOpAllGather | kOpHpz)) gather_group<B>(layout);
    if (o_.ops & (kOpRs1 | kOpRs2)) reduce_scatter_group<B>(layout);
    if (o_.ops & kOpAllReduce) all_reduce_group<B>(layout);
  }

  // ---- timing

  // Captures one call into a graph on this rank's stream (every rank captures its own, at the
  // same time). Collective: returns once every rank has instantiated its graph, so that no rank
  // replays while a peer (sharing its GPU, for cuda_local) is still in set-up calls.
  template <class Call>
  cudaGraphExec_t capture(Call& call) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    sync();
    t_.barrier();
    QCOLL_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    call();
    QCOLL_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    QCOLL_CUDA_CHECK(err);
    t_.barrier();
    return exec;
  }

  // Seconds per call of `call` on this rank's stream: warm-up
  // calls, then `iters` calls (or graph launches) between two events, no host synchronisation in
  // between. Collective; every rank returns after every rank has finished timing.
  template <class Call>
  double time_calls(Call& call) {
    for (int i = 0; i < o_.warmup; ++i) call();
    cudaGraphExec_t exec = nullptr;
    if (o_.graph) {
      exec = capture(call);
      for (int i = 0; i < o_.warmup; ++i) QCOLL_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    }
    sync();
    t_.barrier();
    double seconds = 0;
    {
      QCOLL_CUDA_CHECK(cudaEventRecord(start_, stream_));
      for (int i = 0; i < o_.iters; ++i) {
        if (exec != nullptr) {
          QCOLL_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
        } else {
          call();
        }
      }
      QCOLL_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      QCOLL_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0.0f;
      QCOLL_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      seconds = static_cast<double>(ms) * 1e-3 / o_.iters;
    }
    t_.barrier();  // every rank's replays are done before any rank tears its graph down
    if (exec != nullptr) QCOLL_CUDA_CHECK(cudaGraphExecDestroy(exec));
    return seconds;
  }

  // One counted call (its wire bytes: the change of `counters()` over it), then time_calls().
  template <class Call, class CountersFn>
  RowStats measure(Call&& call, CountersFn&& counters) {
    RowStats s;
    const Counters c0 = counters();
    call();
    const Counters c1 = counters();
    s.intra = c1.intra_node - c0.intra_node;
    s.inter = c1.inter_node - c0.inter_node;
    s.seconds = time_calls(call);
    return s;
  }

  static Counters add(Counters a, const Counters& b) {
    a.intra_node += b.intra_node;
    a.inter_node += b.inter_node;
    a.calls += b.calls;
    return a;
  }

  // The logical volume of a direct exchange: `bytes` to every peer, `times` times.
  void logical_volume(RowStats& s, std::size_t bytes, int times) const {
    const std::uint64_t intra_peers = static_cast<std::uint64_t>(topo_.ranks_per_node() - 1);
    const std::uint64_t inter_peers = static_cast<std::uint64_t>(world() - topo_.ranks_per_node());
    s.intra = intra_peers * bytes * static_cast<std::uint64_t>(times);
    s.inter = inter_peers * bytes * static_cast<std::uint64_t>(times);
  }

#if QCOLL_HAVE_NCCL
  // A direct NCCL reference row: `call` makes the NCCL call named `name` and returns its result;
  // the wire bytes are the logical volume of `times` shards of `shard_bytes` per peer.
  template <class Call>
  void nccl_row(const char* op, const char* name, Call&& call, std::size_t shard_bytes, int times,
                const char* type, std::size_t numel, double busf, Ref& ref) {
    RowStats s = measure([&] { nccl_ok(call(), name); }, [] { return Counters{}; });
    logical_volume(s, shard_bytes, times);
    emit(op, name, type, numel, busf, s, ref);
  }
  // NCCL's reduction for --reduce.
  ncclRedOp_t nccl_reduce_op() const { return o_.reduce == qc::Reduce::mean ? ncclAvg : ncclSum; }
#endif

  // Max of time and bytes, OR of flags over ranks. Collective.
  RowStats combine(RowStats s) {
    std::uint64_t mx[3] = {static_cast<std::uint64_t>(s.seconds * 1e9 + 0.5), s.intra, s.inter};
    t_.all_reduce(mx, 3, qc::ReduceOp::max);
    std::uint64_t f = s.flags;
    t_.all_reduce(&f, 1, qc::ReduceOp::bit_or);
    s.seconds = static_cast<double>(mx[0]) * 1e-9;
    s.intra = mx[1];
    s.inter = mx[2];
    s.flags = static_cast<std::uint32_t>(f);
    return s;
  }

  // Combines a row over ranks and prints it (rank 0). Collective.
  void emit(const char* op, const char* path, const std::string& format, std::size_t numel, double busf,
            RowStats s, Ref& ref) {
    s = combine(s);
    const bool is_ref = !ref.set;
    if (is_ref) ref = Ref{s.seconds, s.intra + s.inter, true};
    if (s.has_flags && (s.flags & (qc::kResultRejected | qc::kResultBadMessage)) != 0) ++outcome_.flagged;
    if (s.wrong > 0) ++outcome_.wrong;
    if (!root()) return;
    const double bytes = static_cast<double>(numel) * sizeof(T);
    const double algbw = s.seconds > 0 ? bytes / s.seconds / 1e9 : 0.0;
    const std::uint64_t wire = s.intra + s.inter;
    table_.row({op, transport_, std::to_string(world()), std::string(path) + (is_ref ? "*" : ""), format,
                std::to_string(numel), bench::strf("%.0f", bytes), bench::strf("%.1f", s.seconds * 1e6),
                bench::strf("%.2f", algbw), bench::strf("%.2f", algbw * busf), std::to_string(s.intra),
                std::to_string(s.inter), ref.seconds > 0 ? bench::strf("%.3f", s.seconds / ref.seconds) : "-",
                ref.wire > 0 ? bench::strf("%.3f", static_cast<double>(wire) / ref.wire) : "-", flags_text(s),
                s.wrong < 0 ? "-" : std::to_string(s.wrong)});
  }

  static double bus(int n, int k) { return n > 0 ? k * (n - 1.0) / n : 0.0; }

  // ---- -c 1: comparison with the host plan (outside the timed calls)

  //! The rounding of the quantized plans, on device and in the host reference alike.
  qc::host::QuantizeOptions quantize_options() const {
    qc::host::QuantizeOptions q;
    q.rounding = o_.stochastic ? qc::Rounding::stochastic : qc::Rounding::nearest;
    q.seed = o_.seed;
    return q;
  }

  // Copies `bytes` of device memory at `from` to `to`, after this rank's stream.
  void download(std::vector<unsigned char>& to, const void* from, std::size_t bytes) {
    to.resize(bytes);
    if (bytes != 0)
      QCOLL_CUDA_CHECK(cudaMemcpyAsync(to.data(), from, bytes, cudaMemcpyDeviceToHost, stream_));
    sync();
  }

  CheckSlot& my_slot() { return check_.slots[static_cast<std::size_t>(t_.rank())]; }

  // -c 1: keeps this rank's input of the row (device memory, `bytes`) for check().
  void stash_input(const void* in_d, std::size_t bytes) {
    if (o_.check != 0) download(my_slot().in, in_d, bytes);
  }

  // -c 1: downloads this rank's output (`out_numel` elements at out_d), then rank 0 recomputes
  // the row on the host and counts the output elements, over all ranks, whose bits differ (see
  // host_mismatches). Collective; sets s.wrong on every rank. Without -c 1: nothing.
  template <class HostRank>
  void check(RowStats& s, const T* out_d, std::size_t out_numel, HostRank&& host_rank) {
    if (o_.check == 0) return;
    CheckSlot& mine = my_slot();
    download(mine.out, out_d, out_numel * sizeof(T));
    t_.barrier();  // every slot is written
    std::uint64_t wrong = root() ? host_mismatches(out_numel, host_rank) : 0;
    t_.all_reduce(&wrong, 1, qc::ReduceOp::sum);  // also keeps the slots alive until rank 0 is done
    mine = CheckSlot{};
    s.wrong = static_cast<long long>(wrong);
  }

  // Runs host_rank(LocalTransport& t, const Topology& topo, const T* in, T* out) on a LocalGroup of
  // world() ranks with the run's node table, rank q fed slot q's input and writing `out_numel`
  // elements; returns the number of those elements, over all ranks, whose bits differ from slot
  // q's downloaded output (any NaN equals any NaN).
  template <class HostRank>
  std::uint64_t host_mismatches(std::size_t out_numel, HostRank& host_rank) const {
    const std::size_t W = static_cast<std::size_t>(world());
    std::vector<std::vector<T>> expect(W);
    qc::LocalGroup group(world(), check_.node_ids);
    group.run([&](qc::LocalTransport& lt) {
      const std::size_t q = static_cast<std::size_t>(lt.rank());
      const CheckSlot& slot = check_.slots[q];
      std::vector<T> in(slot.in.size() / sizeof(T));
      if (!in.empty()) std::memcpy(static_cast<void*>(in.data()), slot.in.data(), in.size() * sizeof(T));
      std::vector<T> out(out_numel);
      host_rank(lt, qc::Topology::from_node_ids(check_.node_ids, lt.rank()), in.data(), out.data());
      expect[q] = std::move(out);
    });
    std::uint64_t wrong = 0;
    for (std::size_t q = 0; q < W; ++q) {
      const std::vector<unsigned char>& got = check_.slots[q].out;
      for (std::size_t i = 0; i < out_numel; ++i) {
        T d;
        std::memcpy(static_cast<void*>(&d), got.data() + i * sizeof(T), sizeof(T));
        if (!same_value(d, expect[q][i])) ++wrong;
      }
    }
    return wrong;
  }

  static bool same_value(const T& a, const T& b) {
    if (std::memcmp(&a, &b, sizeof(T)) == 0) return true;
    const float fa = qc::to_float(a), fb = qc::to_float(b);
    return fa != fa && fb != fb;  // both NaN
  }

  std::uint64_t input_seed() const { return o_.seed * 1000003u + static_cast<std::uint64_t>(t_.rank()); }

  // ---- all-gather group: references, qwZ, hpZ

  template <std::size_t B>
  void gather_group(const qc::ShardLayout& layout) {
    const std::size_t S = layout.shard_numel(), P = layout.padded_numel(), numel = layout.numel();
    const std::size_t shard_bytes = S * sizeof(T);
    const char* type = qc::dtype_name(qc::dtype_of<T>::value);
    const double busf = bus(world(), 1);
    Ref ref;
    {
      DeviceBuffer shard(shard_bytes), full(P * sizeof(T));
      fill(shard.as<T>(), S, o_.seed, layout.shard_offset(t_.rank()), stream_);
      sync();
#if QCOLL_HAVE_NCCL
      if (t_.comm() != nullptr) {
        nccl_row(
            "all_gather", "ncclAllGather",
            [&] { return ncclAllGather(shard.get(), full.get(), S, nccl_type<T>(), t_.comm(), stream_); },
            shard_bytes, 1, type, numel, busf, ref);
      }
#endif
      RowStats s = measure([&] { t_.all_gather(shard.get(), full.get(), shard_bytes, stream_); },
                           [&] { return t_.counters(); });
      emit("all_gather", "tr.all_gather", type, numel, busf, s, ref);
    }
    if (o_.ops & kOpAllGather) {
      with_format<T, B>(o_.wformat, [&](auto f) {
        using F = decltype(f);
        qc::QuantizedAllGather<T, F, Tr> plan(t_, layout, quantize_options());
        DeviceBuffer shard(shard_bytes), full(P * sizeof(T)), ws(plan.workspace_bytes());
        fill(shard.as<T>(), S, o_.seed, layout.shard_offset(t_.rank()), stream_);
        sync();
        RowStats s = measure([&] { plan(shard.as<T>(), full.as<T>(), ws.get(), ws.bytes(), stream_); },
                             [&] { return t_.counters(); });
        s.flags = qc::gpu::read_result_flags(ws.get(), stream_);
        s.has_flags = true;
        stash_input(shard.get(), shard_bytes);
        check(s, full.as<T>(), P, [&](qc::LocalTransport& lt, const qc::Topology&, const T* in, T* out) {
          qc::QuantizedAllGather<T, F, qc::LocalTransport> host(lt, layout, quantize_options());
          bench::Buffer ws(host.workspace_bytes());
          (void)host(in, out, ws.data(), ws.size());
        });
        emit("all_gather", "qwZ", name_of<F>(), numel, busf, s, ref);
      });
    }
    if (o_.ops & kOpHpz) {
      with_format<T, B>(o_.hformat, [&](auto f) {
        using F = decltype(f);
        qc::SecondaryShard<T, F, Tr> plan(t_, topo_, layout);
        DeviceBuffer full(P * sizeof(T)), ws(plan.workspace_bytes());
        fill(full.as<T>(), P, o_.seed, 0, stream_);  // the same full buffer on every rank
        plan.capture(full.as<T>(), 1, stream_);
        sync();
        stash_input(full.get(), P * sizeof(T));  // before the gathers overwrite it
        RowStats s = measure([&] { plan.gather(full.as<T>(), 1, ws.get(), ws.bytes(), stream_); },
                             [&] { return plan.intra_node().counters(); });
        s.flags = qc::gpu::read_result_flags(ws.get(), stream_);
        s.has_flags = true;
        check(s, full.as<T>(), P, [&](qc::LocalTransport& lt, const qc::Topology& topo, const T* in, T* out) {
          qc::SecondaryShard<T, F, qc::LocalTransport> host(lt, topo, layout);
          std::copy(in, in + P, out);  // the device gathers into the captured buffer
          host.capture(in, 1);
          bench::Buffer ws(host.workspace_bytes());
          (void)host.gather(out, 1, ws.data(), ws.size());
        });
        emit("all_gather", "hpZ", name_of<F>(), numel, bus(topo_.ranks_per_node(), 1), s, ref);
      });
    }
  }

  // ---- reduce-scatter group: references, qgZ one and two hops

  template <std::size_t B>
  void reduce_scatter_group(const qc::ShardLayout& layout) {
    const std::size_t S = layout.shard_numel(), P = layout.padded_numel(), numel = layout.numel();
    const std::size_t shard_bytes = S * sizeof(T);
    const char* type = qc::dtype_name(qc::dtype_of<T>::value);
    const double busf = bus(world(), 1);
    Ref ref;
    {
      DeviceBuffer in(P * sizeof(T)), out(P * sizeof(T));
      fill(in.as<T>(), P, input_seed(), 0, stream_);
      sync();
#if QCOLL_HAVE_NCCL
      if (t_.comm() != nullptr) {
        nccl_row(
            "reduce_scatter", "ncclReduceScatter",
            [&] {
              return ncclReduceScatter(in.get(), out.get(), S, nccl_type<T>(), nccl_reduce_op(), t_.comm(),
                                       stream_);
            },
            shard_bytes, 1, type, numel, busf, ref);
      }
#endif
      RowStats s = measure([&] { t_.all_to_all(in.get(), out.get(), shard_bytes, stream_); },
                           [&] { return t_.counters(); });
      emit("reduce_scatter", "tr.all_to_all", type, numel, busf, s, ref);
    }
    with_format<T, B>(o_.gformat, [&](auto f1) {
      using F1 = decltype(f1);
      with_format2<B, F1>(o_.gformat2, [&](auto f2) {
        using F2 = decltype(f2);
        for (const qc::Hops hops : {qc::Hops::one, qc::Hops::two}) {
          const bool one = hops == qc::Hops::one;
          if (!(o_.ops & (one ? kOpRs1 : kOpRs2))) continue;
          qc::QuantizedReduceScatter<T, F1, F2, Tr> plan(t_, topo_, layout, o_.reduce, hops,
                                                         quantize_options());
          DeviceBuffer in(P * sizeof(T)), out(shard_bytes), ws(plan.workspace_bytes());
          fill(in.as<T>(), P, input_seed(), 0, stream_);
          sync();
          RowStats s = measure([&] { plan(in.as<T>(), out.as<T>(), ws.get(), ws.bytes(), stream_); },
                               [&] {
                                 return add(add(t_.counters(), plan.intra_node().counters()),
                                            plan.inter_node().counters());
                               });
          s.flags = qc::gpu::read_result_flags(ws.get(), stream_);
          s.has_flags = true;
          stash_input(in.get(), P * sizeof(T));
          check(s, out.as<T>(), S, [&](qc::LocalTransport& lt, const qc::Topology& topo, const T* x, T* y) {
            qc::QuantizedReduceScatter<T, F1, F2, qc::LocalTransport> host(lt, topo, layout, o_.reduce, hops,
                                                                           quantize_options());
            bench::Buffer ws(host.workspace_bytes());
            (void)host(x, y, ws.data(), ws.size());
          });
          emit("reduce_scatter", one ? "qgZ-1hop" : "qgZ-2hop",
               one ? name_of<F1>() : name_of<F1>() + ">" + name_of<F2>(), numel, busf, s, ref);
        }
      });
    });
  }

  // ---- all-reduce group: references, quantized all-reduce

  template <std::size_t B>
  void all_reduce_group(const qc::ShardLayout& layout) {
    const std::size_t S = layout.shard_numel(), P = layout.padded_numel(), numel = layout.numel();
    const std::size_t shard_bytes = S * sizeof(T);
    const char* type = qc::dtype_name(qc::dtype_of<T>::value);
    const double busf = bus(world(), 2);
    Ref ref;
    {
      DeviceBuffer in(P * sizeof(T)), out(P * sizeof(T)), mid(P * sizeof(T));
      fill(in.as<T>(), P, input_seed(), 0, stream_);
      sync();
#if QCOLL_HAVE_NCCL
      if (t_.comm() != nullptr) {
        nccl_row(
            "all_reduce", "ncclAllReduce",
            [&] {
              return ncclAllReduce(in.get(), out.get(), P, nccl_type<T>(), nccl_reduce_op(), t_.comm(),
                                   stream_);
            },
            shard_bytes, 2, type, numel, busf, ref);
      }
#endif
      const T* own = mid.as<T>() + layout.shard_offset(t_.rank());
      RowStats s = measure(
          [&] {
            t_.all_to_all(in.get(), mid.get(), shard_bytes, stream_);
            t_.all_gather(own, out.get(), shard_bytes, stream_);
          },
          [&] { return t_.counters(); });
      emit("all_reduce", "tr.a2a+ag", type, numel, busf, s, ref);
    }
    with_format<T, B>(o_.gformat, [&](auto f1) {
      using F1 = decltype(f1);
      with_format2<B, F1>(o_.gformat2, [&](auto f2) {
        using F2 = decltype(f2);
        const bool one = o_.hops == qc::Hops::one;
        qc::QuantizedAllReduce<T, F1, F2, F1, Tr> plan(t_, topo_, layout, o_.reduce, o_.hops,
                                                       quantize_options());
        DeviceBuffer in(P * sizeof(T)), out(P * sizeof(T)), ws(plan.workspace_bytes());
        fill(in.as<T>(), P, input_seed(), 0, stream_);
        sync();
        RowStats s = measure([&] { plan(in.as<T>(), out.as<T>(), ws.get(), ws.bytes(), stream_); },
                             [&] {
                               return add(add(t_.counters(), plan.reduce_scatter().intra_node().counters()),
                                          plan.reduce_scatter().inter_node().counters());
                             });
        s.flags = qc::gpu::read_result_flags(ws.get(), stream_);
        s.has_flags = true;
        stash_input(in.get(), P * sizeof(T));
        check(s, out.as<T>(), P, [&](qc::LocalTransport& lt, const qc::Topology& topo, const T* x, T* y) {
          qc::QuantizedAllReduce<T, F1, F2, F1, qc::LocalTransport> host(lt, topo, layout, o_.reduce, o_.hops,
                                                                         quantize_options());
          bench::Buffer ws(host.workspace_bytes());
          (void)host(x, y, ws.data(), ws.size());
        });
        const std::string f = one ? name_of<F1>() + ">" + name_of<F1>()
                                  : name_of<F1>() + ">" + name_of<F2>() + ">" + name_of<F1>();
        emit("all_reduce", one ? "qgZ-1hop+qwZ" : "qgZ-2hop+qwZ", f, numel, busf, s, ref);
      });
    });
  }

  Tr& t_;
  const qc::Topology& topo_;
  cudaStream_t stream_;
  const Options& o_;
  const char* transport_;
  int ranks_on_device_;
  CheckShare& check_;
  bench::Table table_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  Outcome outcome_;
};

Outcome bench_typed(AnyTransport& t, const qc::Topology& topo, cudaStream_t stream, const Options& o,
                    const char* transport, int ranks_on_device, CheckShare& check) {
#if QCOLL_BENCH_QUICK_BUILD
  // parse() admits f32 only: a third of the instantiations (the GPU tests compile the device
  // plans for every element type; so does every build that is not a quick one, this program's
  // emulated check included).
  return Bench<float>(t, topo, stream, o, transport, ranks_on_device, check).run();
#else
  switch (o.type) {
    case qc::DType::f32: return Bench<float>(t, topo, stream, o, transport, ranks_on_device, check).run();
    case qc::DType::f16: return Bench<qc::half>(t, topo, stream, o, transport, ranks_on_device, check).run();
    case qc::DType::bf16: break;
  }
  return Bench<qc::bfloat16>(t, topo, stream, o, transport, ranks_on_device, check).run();
#endif
}

// ----------------------------------------------------------------------------------------------
// Drivers.

std::vector<long long> node_major(int world, int nodes) {
  std::vector<long long> ids(static_cast<std::size_t>(world));
  const int per_node = world / nodes;
  for (int r = 0; r < world; ++r) ids[static_cast<std::size_t>(r)] = r / per_node;
  return ids;
}

void print_device(int dev) {
  cudaDeviceProp prop;
  QCOLL_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("# device %d: %s, sm_%d%d, %d SMs, %s\n", dev, prop.name, prop.major, prop.minor,
              prop.multiProcessorCount,
              bench::format_bytes(static_cast<double>(prop.totalGlobalMem)).c_str());
  if (*bench::quick_build_warning() != '\0') std::printf("# %s\n", bench::quick_build_warning());
}

void print_setup(const Options& o, const char* transport, int world, int nodes) {
  const char* type = qc::dtype_name(o.type);
  std::printf(
      "# qcoll device collectives: transport %s, %d rank(s) on %d node(s) x %d (node-major), type %s, "
      "iters %d, warmup %d, graph %s, reduce %s, block %zu, rounding %s, check %d\n",
      transport, world, nodes, world / nodes, type, o.iters, o.warmup, o.graph ? "on" : "off",
      o.reduce == qc::Reduce::sum ? "sum" : "mean", o.block, o.stochastic ? "stochastic" : "nearest",
      o.check);
  std::printf(
      "# formats: qwZ %s, hpZ %s, qgZ hop 1 %s, hop 2 %s; all-reduce = qgZ in %s then all-gather in %s "
      "(a format named like the element type is unquantized)\n",
      o.wformat_text.c_str(), o.hformat_text.c_str(), o.gformat_text.c_str(), o.gformat2_text.c_str(),
      o.hops == qc::Hops::one ? "one hop" : "two hops", o.gformat_text.c_str());
  std::printf(
      "# count = elements of the full tensor, size = count x %zu B; time = mean per call, slowest rank; "
      "algbw = size/time (GB/s); busbw = algbw x (n-1)/n (all_gather, reduce_scatter; n = L for hpZ) "
      "or x 2(n-1)/n (all_reduce), as nccl-tests; intra/inter = bytes per rank per call to peers on "
      "the same / other nodes; x_time, x_wire: ratio to the group's reference row (*)\n",
      elem_bytes(o.type));
  std::fflush(stdout);
}

Outcome run_cuda_local(const Options& o) {
  QCOLL_CUDA_CHECK(cudaSetDevice(0));
  print_setup(o, "cuda_local", o.ranks, o.nodes);
  print_device(0);
  const std::vector<long long> ids = node_major(o.ranks, o.nodes);
  qc::CudaLocalGroup ranks(o.ranks, ids, 0);
  CheckShare check(ids);
  Outcome failed;
  ranks.run([&](qc::CudaLocalTransport& t) {
    const qc::Topology topo = qc::Topology::from_node_ids(ids, t.rank());
    AnyTransport any = AnyTransport::borrow(t);
    const Outcome f = bench_typed(any, topo, t.stream(), o, "cuda_local", o.ranks, check);
    if (t.rank() == 0) failed = f;
  });
  return failed;
}

#if QCOLL_HAVE_NCCL
Outcome run_nccl(const Options& o, int visible) {
  const int G = o.gpus > 0 ? o.gpus : visible;
  int version = 0;
  nccl_ok(ncclGetVersion(&version), "ncclGetVersion");
  print_setup(o, "nccl", G, o.nccl_nodes);
  std::printf("# NCCL %d.%d.%d, communicators from ncclCommInitAll, one host thread per GPU\n",
              version / 10000, (version / 100) % 100, version % 100);
  for (int d = 0; d < G; ++d) print_device(d);
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(G), nullptr);
  std::vector<int> devs(static_cast<std::size_t>(G));
  for (int d = 0; d < G; ++d) devs[static_cast<std::size_t>(d)] = d;
  nccl_ok(ncclCommInitAll(comms.data(), G, devs.data()), "ncclCommInitAll");
  const std::vector<long long> ids = node_major(G, o.nccl_nodes);
  CheckShare check(ids);
  std::vector<Outcome> failed(static_cast<std::size_t>(G));
  std::vector<std::thread> threads;
  for (int r = 0; r < G; ++r) {
    threads.emplace_back([&, r] {
      try {
        QCOLL_CUDA_CHECK(cudaSetDevice(devs[static_cast<std::size_t>(r)]));
        qc::NcclTransport t(comms[static_cast<std::size_t>(r)], ids);
        const qc::Topology topo = qc::Topology::from_node_ids(ids, t.rank());
        Stream stream;
        AnyTransport any = AnyTransport::borrow(t);
        failed[static_cast<std::size_t>(r)] = bench_typed(any, topo, stream.get(), o, "nccl", 1, check);
      } catch (const std::exception& e) {
        // The peers may be blocked in a collective this rank will never join: end the process.
        std::fprintf(stderr, "collectives_device (nccl rank %d): %s\n", r, e.what());
        std::fflush(stdout);
        std::fflush(stderr);
        std::_Exit(1);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (ncclComm_t c : comms) (void)ncclCommDestroy(c);
  return failed[0];
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    bool help = false;
    o = parse(argc, argv, help);
    if (help) {
      std::fputs(kHelp, stdout);
      return 0;
    }
  } catch (const bench::UsageError& e) {
    std::fprintf(stderr, "collectives_device: %s\n", e.what());
    return 2;
  }

  qcoll::cuda_local_request_queues();  // before the first CUDA call: one hardware queue per rank's stream
  int visible = 0;
  if (cudaGetDeviceCount(&visible) != cudaSuccess || visible == 0) {
    (void)cudaGetLastError();
    std::printf("skipped: no CUDA device\n");
    return 0;
  }

  try {
    if (o.nccl) {
#if QCOLL_HAVE_NCCL
      const int G = o.gpus > 0 ? o.gpus : visible;
      if (o.gpus > visible)
        throw bench::UsageError("flag --gpus: " + std::to_string(o.gpus) + " exceeds the " +
                                std::to_string(visible) + " visible CUDA device(s)");
      if (G % o.nccl_nodes != 0)
        throw bench::UsageError("flag --nccl-nodes: " + std::to_string(o.nccl_nodes) +
                                " does not divide the nccl world of " + std::to_string(G) + " GPU(s)");
#else
      std::printf("# nccl: not available in this build (no NCCL); running cuda_local only\n");
      o.nccl = false;
#endif
    }
  } catch (const bench::UsageError& e) {
    std::fprintf(stderr, "collectives_device: %s\n", e.what());
    return 2;
  }

  Outcome failed;
  auto add = [&](const Outcome& f) {
    failed.flagged += f.flagged;
    failed.wrong += f.wrong;
  };
  try {
#if QCOLL_HAVE_NCCL
    if (o.nccl) {
      add(run_nccl(o, visible));
      if (!o.csv) std::printf("\n");
    }
#endif
    if (o.cuda_local) add(run_cuda_local(o));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collectives_device: %s\n", e.what());
    return 1;
  }
  if (failed.flagged > 0 || failed.wrong > 0) {
    std::printf(
        "# FAILED: %d row(s) with kResultRejected or kResultBadMessage, %d row(s) whose output differs from "
        "the host plan's (#wrong > 0)\n",
        failed.flagged, failed.wrong);
    return 1;
  }
  if (o.check != 0) {
    std::printf(
        "# done: no call reported kResultRejected or kResultBadMessage; every checked output equals the "
        "host plan's bit for bit (#wrong 0)\n");
  } else {
    std::printf(
        "# done: no call reported kResultRejected or kResultBadMessage (outputs not checked: -c 0)\n");
  }
  return 0;
}
