// The collective plans on the device data path (collective/device.cuh) against the host path, the
// oracle: for the same inputs, options, layout and topology, every output element has the same bits
// (float outputs compare NaN == NaN: a NaN's payload may differ) and the kResultNonFinite bit of
// the device result flags equals the host call's return value.
//
//   - QuantizedAllGather, QuantizedReduceScatter (sum and mean, one and two hops),
//     QuantizedAllReduce and SecondaryShard (capture + gather) over CudaLocalTransport, 2..8 ranks,
//     node tables with one node, node-major N x L and round-robin (not node-major) placement;
//     f32/f16/bf16 with int8, int4 asymmetric, e4m3, MXFP4, NVFP4 and identity; sizes that leave
//     whole shards empty or pad the last one; stochastic rounding; NaN and Inf inputs; in-place
//     calls; the null stream.
//   - each plan captured in a CUDA graph and replayed with new input contents in the same buffers.
//   - rejected arguments: a pageable pointer or a stale hpZ generation on one rank (that rank
//     throws naming the argument, its peers neither throw nor hang, get kResultRejected and keep
//     their outputs), and an unusable workspace on all ranks (every rank throws, nothing is
//     enqueued).
//   - NcclTransport on a one-rank communicator.
//
// Device buffers are allocated and freed only between host barriers: the cuda_local protocol waits
// on the device for every rank's share, so a rank blocked in cudaMalloc/cudaFree (which may wait for
// the whole device) while a peer's kernels wait for it would deadlock.
//
// Exits with 77 (reported as skipped by CTest) when there is no CUDA device.

#include "common/gpu_main.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(QCOLL_HAVE_NCCL) && !QCOLL_HAVE_NCCL
#define QCOLL_HAS_NCCL 0  // the build has NCCL disabled: leave the NCCL transport out
#endif

// Before the CUDA headers: the harness names qcoll's `half` unqualified, which is ambiguous once
// cuda_fp16.h has declared ::half.
#include "common/collective_harness.hpp"
#include "common/watchdog.hpp"

#include <qcoll/qcoll.cuh>

#include "../common/device_bytes.hpp"
#include "common/nccl_one_rank.hpp"

#if defined(QCOLL_HAVE_NCCL) && QCOLL_HAVE_NCCL && QCOLL_HAS_NCCL
#define TEST_PLANS_NCCL 1
#else
#define TEST_PLANS_NCCL 0
#endif

namespace {

namespace q = qcoll;
using testing_support::Watchdog;

#define TEST_CUDA(expr) QCOLL_CUDA_CHECK(expr)

// Every test case aborts the process after this long: longer than cuda_local's own device-side
// timeout (120 s), which reports which rank waits for which peer.
constexpr int kWatchdogSeconds = 300;

// ---------------------------------------------------------------------------------------------
// Device buffers and transfers
// ---------------------------------------------------------------------------------------------

using testing_support::DeviceBytes;

template <class T>
void upload(T* dst, const std::vector<T>& src, cudaStream_t s) {
  if (!src.empty())
    TEST_CUDA(cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, s));
}

//! Copies n elements back once `s` has passed everything enqueued so far.
template <class T>
std::vector<T> download(const T* src, std::size_t n, cudaStream_t s) {
  std::vector<T> h(n);
  if (n > 0) TEST_CUDA(cudaMemcpyAsync(h.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, s));
  TEST_CUDA(cudaStreamSynchronize(s));
  return h;
}

// Device outputs are pre-filled with this byte (a finite value of every element type, distinct
// from the host outputs' pre-fill of -1), so an element a path leaves unwritten shows as a
// difference.
constexpr unsigned char kSentinelByte = 0x7B;

template <class T>
T sentinel() {
  T v;
  std::memset(static_cast<void*>(&v), kSentinelByte, sizeof v);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Comparison and failure collection
// ---------------------------------------------------------------------------------------------

template <class T>
std::uint32_t bits_of(T v) {
  std::uint32_t b = 0;
  std::memcpy(&b, &v, sizeof v);
  return b;
}

template <class T>
bool same_element(T a, T b) {
  if constexpr (std::is_same<T, float>::value) {
    if (std::isnan(a) && std::isnan(b)) return true;  // the payload of a float NaN may differ
  }
  return bits_of(a) == bits_of(b);
}

//! "" when got equals want element for element (NaN == NaN for float), else how they differ.
template <class T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return "size " + std::to_string(got.size()) + " instead of " + std::to_string(want.size());
  std::size_t count = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!same_element(got[i], want[i]) && count++ == 0) first = i;
  if (count == 0) return "";
  char buf[200];
  std::snprintf(buf, sizeof buf, "%zu of %zu elements differ; first at %zu: got 0x%x (%g), want 0x%x (%g)",
                count, got.size(), first, bits_of(got[first]), static_cast<double>(q::to_float(got[first])),
                bits_of(want[first]), static_cast<double>(q::to_float(want[first])));
  return buf;
}

//! Failures found on worker threads or in loops, reported from the test's thread, and the number of
//! rank results compared (a test that compared nothing fails).
struct Failures {
  std::mutex mu;
  std::vector<std::string> messages;
  std::size_t compared = 0;  // updated on the test's thread only
  void add(const std::string& m) {
    std::lock_guard<std::mutex> lk(mu);
    messages.push_back(m);
  }
  void report() {
    CHECK(compared > 0);
    const std::size_t shown = messages.size() < 40 ? messages.size() : 40;
    for (std::size_t i = 0; i < shown; ++i) FAIL_CHECK(messages[i]);
    if (messages.size() > shown) FAIL_CHECK((messages.size() - shown) << " more failures");
    messages.clear();
  }
};

std::string flags_text(std::uint32_t f) {
  std::ostringstream os;
  os << "0x" << std::hex << f;
  return os.str();
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---------------------------------------------------------------------------------------------
// Topologies and call specifications
// ---------------------------------------------------------------------------------------------

struct Shape {
  int world, per_node;
  bool round_robin;  // rank r on node r % nodes instead of r / per_node
};

std::vector<long long> node_ids(const Shape& s) {
  std::vector<long long> ids(static_cast<std::size_t>(s.world));
  const int nodes = s.world / s.per_node;
  for (int r = 0; r < s.world; ++r)
    ids[static_cast<std::size_t>(r)] = 100 + (s.round_robin ? r % nodes : r / s.per_node);
  return ids;
}

std::string describe(const Shape& s) {
  std::ostringstream os;
  os << "W=" << s.world << " (" << s.world / s.per_node << " node(s) x " << s.per_node
     << (s.round_robin && s.per_node > 1 && s.per_node < s.world ? ", round robin" : "") << ")";
  return os.str();
}

enum class Poison { none, nan, inf };

//! One call: sizes, options, input data, and how the device call is made.
struct Spec {
  std::size_t numel = 0;
  q::Reduce op = q::Reduce::sum;
  q::Hops hops = q::Hops::one;
  q::host::QuantizeOptions opt;
  std::uint64_t input_seed = 1;
  Poison poison = Poison::none;  // one rank's input holds a NaN or Inf at a valid position
  bool in_place = false;         // the input is part of the output buffer (see Kind::in_place_offset)
  bool null_stream = false;      // the device call gets a null stream (the transport's stream)
  std::uint64_t generation = 1;  // hpZ: capture generation
  bool stale = false;            // hpZ: gather asks for generation + 1
};

//! `reduces`: the plan uses op and hops (reduce-scatter, all-reduce).
std::string describe(const Spec& s, bool reduces) {
  std::ostringstream os;
  os << "numel " << s.numel;
  if (reduces)
    os << ", " << (s.op == q::Reduce::sum ? "sum" : "mean") << ", "
       << (s.hops == q::Hops::one ? "one hop" : "two hops");
  os << ", " << (s.opt.rounding == q::Rounding::nearest ? "nearest" : "stochastic");
  if (s.poison != Poison::none) os << (s.poison == Poison::nan ? ", NaN input" : ", Inf input");
  if (s.in_place) os << ", in place";
  if (s.null_stream) os << ", null stream";
  return os.str();
}

template <class T>
const char* type_name() {
  return q::dtype_name(q::dtype_of<T>::value);
}

template <class F>
std::string format_label() {
  return std::string(q::format_name(F::id)) + "/" + std::to_string(F::block);
}

// ---------------------------------------------------------------------------------------------
// Plan kinds: how to build, feed and call each plan on either data path
// ---------------------------------------------------------------------------------------------
//
// A kind provides: Elem; reduces (uses op and hops); name(); granule(); in_count/out_count(layout) (elements
// of a rank's input and output); sent(layout, ids, r) (the range of rank r's input that it sends and that
// holds data); sees(ids, p, r) (whether a NaN in what rank p sends reaches rank r's result);
// in_place_offset(layout, r) (where the input sits inside the output for an in-place call);
// inputs(spec, layout, world); Plan<Transport>(transport, topology, layout, spec) with
// workspace_bytes(), prepare(in, stream, spec) (hpZ: capture) and exchange(in, out, ws, bytes,
// stream, spec) returning the host flags (0 on the device, whose flags are in the workspace).

//! Elements [offset, offset + count) of a rank's input.
struct Range {
  std::size_t offset, count;
};

template <class Tr>
constexpr bool on_device() {
  return Tr::memory_space == q::MemorySpace::device;
}

//! The flags a plan call returns on the host; 0 on the device (whose flags are in the workspace).
template <class Tr, class Call>
std::uint32_t flags_of(Call&& call) {
  if constexpr (on_device<Tr>()) {
    call();
    return 0;
  } else {
    return call();
  }
}

//! A kind's plan whose call is one operator() (all but hpZ): P built from the arguments given.
template <class P, class Tr, class T>
struct OneCallPlan {
  P p;
  template <class... Args>
  explicit OneCallPlan(Args&&... args) : p(std::forward<Args>(args)...) {}
  std::size_t workspace_bytes() const { return p.workspace_bytes(); }
  void prepare(const T*, typename Tr::stream_type, const Spec&) {}
  std::uint32_t exchange(const T* in, T* out, void* ws, std::size_t bytes, typename Tr::stream_type st,
                         const Spec&) {
    return flags_of<Tr>([&] { return p(in, out, ws, bytes, st); });
  }
};

//! One whole call of a kind's plan: prepare (hpZ: capture) then exchange.
template <class Plan, class T, class Stream>
std::uint32_t call_plan(Plan& plan, const T* in, T* out, void* ws, std::size_t bytes, Stream st,
                        const Spec& s) {
  plan.prepare(in, st, s);
  return plan.exchange(in, out, ws, bytes, st, s);
}

template <class T, class F>
struct AllGatherKind {
  using Elem = T;
  static constexpr bool reduces = false;
  static std::string name() {
    return std::string("QuantizedAllGather<") + type_name<T>() + ", " + format_label<F>() + ">";
  }
  static std::size_t granule() { return q::granule_for(sizeof(T), {F::block}); }
  static std::size_t in_count(const q::ShardLayout& l) { return l.shard_numel(); }
  static std::size_t out_count(const q::ShardLayout& l) { return l.padded_numel(); }
  static Range sent(const q::ShardLayout& l, const std::vector<long long>&, int r) {
    return {0, l.valid_in_shard(r)};
  }
  static bool sees(const std::vector<long long>&, int, int) { return true; }
  static std::size_t in_place_offset(const q::ShardLayout& l, int r) { return l.shard_offset(r); }
  //! Shards of one weight buffer (padding holds garbage that must not show in the result).
  static std::vector<std::vector<T>> inputs(const Spec& s, const q::ShardLayout& l, int world) {
    const std::vector<T> x = harness::make_input<T>(s.input_seed, 0, l.padded_numel(), s.numel);
    std::vector<std::vector<T>> shards(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r)
      shards[static_cast<std::size_t>(r)].assign(x.begin() + l.shard_offset(r),
                                                 x.begin() + l.shard_offset(r) + l.shard_numel());
    return shards;
  }
  template <class Tr>
  struct Plan : OneCallPlan<q::QuantizedAllGather<T, F, Tr>, Tr, T> {
    Plan(Tr& t, const q::Topology&, const q::ShardLayout& l, const Spec& s)
        : OneCallPlan<q::QuantizedAllGather<T, F, Tr>, Tr, T>(t, l, s.opt) {}
  };
};

//! What the reducing kinds share: every rank's input is a whole gradient that every rank reads.
template <class T>
struct WholeGradientKind {
  using Elem = T;
  static constexpr bool reduces = true;
  static std::size_t in_count(const q::ShardLayout& l) { return l.padded_numel(); }
  static Range sent(const q::ShardLayout& l, const std::vector<long long>&, int) { return {0, l.numel()}; }
  static bool sees(const std::vector<long long>&, int, int) { return true; }
  static std::vector<std::vector<T>> inputs(const Spec& s, const q::ShardLayout& l, int world) {
    return harness::make_inputs<T>(s.input_seed, world, l.padded_numel(), s.numel);
  }
};

template <class T, class F1, class F2>
struct ReduceScatterKind : WholeGradientKind<T> {
  static std::string name() {
    return std::string("QuantizedReduceScatter<") + type_name<T>() + ", " + format_label<F1>() + ", " +
           format_label<F2>() + ">";
  }
  static std::size_t granule() { return q::granule_for(sizeof(T), {F1::block, F2::block}); }
  static std::size_t out_count(const q::ShardLayout& l) { return l.shard_numel(); }
  static std::size_t in_place_offset(const q::ShardLayout&, int) { return 0; }  // never in place
  template <class Tr>
  struct Plan : OneCallPlan<q::QuantizedReduceScatter<T, F1, F2, Tr>, Tr, T> {
    Plan(Tr& t, const q::Topology& topo, const q::ShardLayout& l, const Spec& s)
        : OneCallPlan<q::QuantizedReduceScatter<T, F1, F2, Tr>, Tr, T>(t, topo, l, s.op, s.hops, s.opt) {}
  };
};

template <class T, class F1, class F2, class F3>
struct AllReduceKind : WholeGradientKind<T> {
  static std::string name() {
    return std::string("QuantizedAllReduce<") + type_name<T>() + ", " + format_label<F1>() + ", " +
           format_label<F2>() + ", " + format_label<F3>() + ">";
  }
  static std::size_t granule() { return q::granule_for(sizeof(T), {F1::block, F2::block, F3::block}); }
  static std::size_t out_count(const q::ShardLayout& l) { return l.padded_numel(); }
  static std::size_t in_place_offset(const q::ShardLayout&, int) { return 0; }  // in == out
  template <class Tr>
  struct Plan : OneCallPlan<q::QuantizedAllReduce<T, F1, F2, F3, Tr>, Tr, T> {
    Plan(Tr& t, const q::Topology& topo, const q::ShardLayout& l, const Spec& s)
        : OneCallPlan<q::QuantizedAllReduce<T, F1, F2, F3, Tr>, Tr, T>(t, topo, l, s.op, s.hops, s.opt) {}
  };
};

//! hpZ: the input is a rank's full buffer (capture() keeps its secondary shard), the output the
//! buffer rebuilt by gather(). Every rank gets its own input, so a secondary shard taken from the
//! wrong rank shows.
template <class T, class F>
struct SecondaryShardKind {
  using Elem = T;
  static constexpr bool reduces = false;
  static std::string name() {
    return std::string("SecondaryShard<") + type_name<T>() + ", " + format_label<F>() + ">";
  }
  static std::size_t granule() { return q::granule_for(sizeof(T), {F::block}); }
  static std::size_t in_count(const q::ShardLayout& l) { return l.padded_numel(); }
  static std::size_t out_count(const q::ShardLayout& l) { return l.padded_numel(); }
  //! A rank sends the data part of its own secondary shard, to the ranks of its node.
  static Range sent(const q::ShardLayout& l, const std::vector<long long>& ids, int r) {
    const q::Topology topo = q::Topology::from_node_ids(ids, r);
    const q::SecondaryLayout sec(l, topo);
    const std::size_t offset = sec.shard_offset(topo.local_index());
    return {offset, q::valid_elements_in(l.numel(), offset, sec.shard_numel())};
  }
  static bool sees(const std::vector<long long>& ids, int p, int r) {
    return ids[static_cast<std::size_t>(p)] == ids[static_cast<std::size_t>(r)];
  }
  static std::size_t in_place_offset(const q::ShardLayout&, int) { return 0; }
  static std::vector<std::vector<T>> inputs(const Spec& s, const q::ShardLayout& l, int world) {
    return harness::make_inputs<T>(s.input_seed, world, l.padded_numel(), s.numel);
  }
  template <class Tr>
  struct Plan {
    q::SecondaryShard<T, F, Tr> p;
    Plan(Tr& t, const q::Topology& topo, const q::ShardLayout& l, const Spec&) : p(t, topo, l) {}
    std::size_t workspace_bytes() const { return p.workspace_bytes(); }
    //! capture(): keeps this rank's secondary shard of `in` (no communication).
    void prepare(const T* in, typename Tr::stream_type st, const Spec& s) {
      if constexpr (on_device<Tr>()) {
        p.capture(in, s.generation, st);
      } else {
        p.capture(in, s.generation);
      }
    }
    //! gather(): the node-local exchange.
    std::uint32_t exchange(const T*, T* out, void* ws, std::size_t bytes, typename Tr::stream_type st,
                           const Spec& s) {
      const std::uint64_t asked = s.generation + (s.stale ? 1 : 0);
      return flags_of<Tr>([&] { return p.gather(out, asked, ws, bytes, st); });
    }
  };
};

//! The inputs of a call: Kind::inputs, with spec.poison written into the last rank that sends
//! data, two thirds into that data. Returns the rank poisoned (-1: none).
template <class Kind>
int make_case_inputs(const Spec& s, const q::ShardLayout& l, const std::vector<long long>& ids,
                     std::vector<std::vector<typename Kind::Elem>>& in) {
  using T = typename Kind::Elem;
  const int world = static_cast<int>(ids.size());
  in = Kind::inputs(s, l, world);
  if (s.poison == Poison::none) return -1;
  for (int r = world - 1; r >= 0; --r) {
    const Range sent = Kind::sent(l, ids, r);
    if (sent.count == 0) continue;
    const float v = s.poison == Poison::nan ? std::numeric_limits<float>::quiet_NaN()
                                            : std::numeric_limits<float>::infinity();
    in[static_cast<std::size_t>(r)][sent.offset + sent.count * 2 / 3] = q::from_float<T>(v);
    return r;
  }
  return -1;
}

//! The host flags rank r must see when rank `poisoned` (-1: none) sent a NaN or Inf.
template <class Kind>
std::uint32_t expected_flags(const std::vector<long long>& ids, int poisoned, int r) {
  return poisoned >= 0 && Kind::sees(ids, poisoned, r) ? q::kResultNonFinite : 0u;
}

//! Host results of calls of one kind: outputs and flags per rank.
template <class T>
struct Results {
  std::vector<std::vector<T>> out;
  std::vector<std::uint32_t> flags;
  explicit Results(int world)
      : out(static_cast<std::size_t>(world)), flags(static_cast<std::size_t>(world)) {}
};

//! Rank r's host call of `plan` on in (or in place): returns the output and the flags.
template <class Kind>
void host_call(typename Kind::template Plan<q::LocalTransport>& plan, const Spec& s, const q::ShardLayout& l,
               int r, const std::vector<typename Kind::Elem>& in, std::vector<typename Kind::Elem>& out,
               std::uint32_t& flags) {
  using T = typename Kind::Elem;
  harness::Workspace ws(plan.workspace_bytes());
  out.assign(Kind::out_count(l), q::from_float<T>(-1.0f));
  const T* src = in.data();
  if (s.in_place) {
    std::copy(in.begin(), in.end(), out.begin() + static_cast<std::ptrdiff_t>(Kind::in_place_offset(l, r)));
    src = out.data() + Kind::in_place_offset(l, r);
  }
  flags = call_plan(plan, src, out.data(), ws.ptr, ws.bytes, q::HostStream{}, s);
}

//! Device buffers of one rank's call: input (or the input's place in the output), output, workspace.
template <class Kind>
struct DeviceCall {
  using T = typename Kind::Elem;
  std::size_t n_in, n_out, ws_bytes;
  DeviceBytes in, out, ws;
  T* src;  // what the call reads
  DeviceCall(const q::ShardLayout& l, const Spec& s, int r, std::size_t workspace_bytes)
      : n_in(Kind::in_count(l)),
        n_out(Kind::out_count(l)),
        ws_bytes(workspace_bytes),
        in(n_in * sizeof(T)),
        out(n_out * sizeof(T)),
        ws(workspace_bytes),
        src(s.in_place ? out.as<T>() + Kind::in_place_offset(l, r) : in.as<T>()) {}
  //! Enqueues: output := sentinel, input := x (into the output for an in-place call).
  void load(const std::vector<T>& x, cudaStream_t st) {
    TEST_CUDA(cudaMemsetAsync(out.get(), kSentinelByte, n_out * sizeof(T), st));
    upload(src, x, st);
  }
};

// ---------------------------------------------------------------------------------------------
// The sweep: host path vs device path over cuda_local
// ---------------------------------------------------------------------------------------------

class CaseBase {
 public:
  virtual ~CaseBase() = default;
  virtual void run_host(q::LocalTransport& t) = 0;
  virtual void run_device(q::CudaLocalTransport& t) = 0;
  virtual void compare(Failures& f) const = 0;
  virtual const std::string& label() const = 0;
};

//! One call of one plan kind on one shape: the host results, the device results, their comparison.
template <class Kind>
class Case final : public CaseBase {
  using T = typename Kind::Elem;

 public:
  Case(const Shape& shape, const Spec& spec)
      : ids_(node_ids(shape)),
        spec_(spec),
        layout_(spec.numel, shape.world, Kind::granule()),
        host_(shape.world),
        dev_(shape.world) {
    poisoned_ = make_case_inputs<Kind>(spec, layout_, ids_, in_);
    label_ = Kind::name() + ", " + describe(shape) + ", " + describe(spec, Kind::reduces);
  }

  void run_host(q::LocalTransport& t) override {
    const int r = t.rank();
    const q::Topology topo = q::Topology::from_node_ids(ids_, r);
    typename Kind::template Plan<q::LocalTransport> plan(t, topo, layout_, spec_);
    const auto ri = static_cast<std::size_t>(r);
    host_call<Kind>(plan, spec_, layout_, r, in_[ri], host_.out[ri], host_.flags[ri]);
  }

  void run_device(q::CudaLocalTransport& t) override {
    const int r = t.rank();
    const auto ri = static_cast<std::size_t>(r);
    const cudaStream_t s = t.stream();
    const q::Topology topo = q::Topology::from_node_ids(ids_, r);
    typename Kind::template Plan<q::CudaLocalTransport> plan(t, topo, layout_, spec_);
    DeviceCall<Kind> c(layout_, spec_, r, plan.workspace_bytes());
    c.load(in_[ri], s);
    t.barrier();  // every rank's buffers exist before any rank's kernels wait for its peers
    call_plan(plan, c.src, c.out.template as<T>(), c.ws.get(), c.ws_bytes, spec_.null_stream ? nullptr : s,
              spec_);
    dev_.out[ri] = download(c.out.template as<T>(), c.n_out, s);
    dev_.flags[ri] = q::gpu::read_result_flags(c.ws.get(), s);
    t.barrier();  // every rank's stream is idle before any buffer is freed
  }

  void compare(Failures& f) const override {
    for (std::size_t r = 0; r < host_.out.size(); ++r) {
      const std::uint32_t expect_host = expected_flags<Kind>(ids_, poisoned_, static_cast<int>(r));
      ++f.compared;
      const std::string where = label_ + ", rank " + std::to_string(r) + ": ";
      // The oracle itself: a poisoned input must raise the host flag, a clean one must not.
      if (host_.flags[r] != expect_host)
        f.add(where + "host flags " + flags_text(host_.flags[r]) + ", expected " + flags_text(expect_host));
      const std::string d = first_difference(dev_.out[r], host_.out[r]);
      if (!d.empty()) f.add(where + "device output differs from the host path: " + d);
      const std::uint32_t bad = q::kResultRejected | q::kResultBadMessage;
      if ((dev_.flags[r] & q::kResultNonFinite) != host_.flags[r] || (dev_.flags[r] & bad) != 0)
        f.add(where + "device flags " + flags_text(dev_.flags[r]) + ", host flags " +
              flags_text(host_.flags[r]));
    }
  }

  const std::string& label() const override { return label_; }

 private:
  std::vector<long long> ids_;
  Spec spec_;
  q::ShardLayout layout_;
  std::vector<std::vector<T>> in_;
  int poisoned_ = -1;
  Results<T> host_, dev_;
  std::string label_;
};

using Cases = std::vector<std::unique_ptr<CaseBase>>;

//! Runs every case on both paths (one host group run, one device group run) and compares.
void run_cases(const Shape& shape, Cases& cases, Failures& fails) {
  const std::vector<long long> ids = node_ids(shape);
  try {
    q::LocalGroup host(shape.world, ids);
    host.run([&](q::LocalTransport& t) {
      for (auto& c : cases) c->run_host(t);
    });
  } catch (const std::exception& e) {
    fails.add(describe(shape) + ": host path failed: " + e.what());
    return;
  }
  try {
    q::CudaLocalGroup device(shape.world, ids);
    device.run([&](q::CudaLocalTransport& t) {
      for (auto& c : cases) {
        try {
          c->run_device(t);
        } catch (const std::exception& e) {
          throw std::runtime_error(c->label() + ": rank " + std::to_string(t.rank()) + ": " + e.what());
        }
      }
    });
  } catch (const std::exception& e) {
    fails.add(describe(shape) + ": device path failed: " + e.what());
    return;
  }
  for (const auto& c : cases) c->compare(fails);
}

template <class Kind>
void add(Cases& cases, const Shape& shape, Spec s) {
  s.null_stream = (q::random_bits(7, cases.size()) & 1) != 0;  // half the calls: the transport's stream
  cases.push_back(std::make_unique<Case<Kind>>(shape, s));
}

// Node tables: W = 2..8, one node, node-major N x L, and round robin (not node-major).
const Shape kShapes[] = {{2, 2, false}, {2, 1, false}, {3, 3, false}, {3, 1, false}, {4, 2, false},
                         {4, 2, true},  {5, 5, false}, {5, 1, false}, {6, 3, true},  {6, 2, false},
                         {7, 7, false}, {7, 1, false}, {8, 4, true},  {8, 2, false}, {8, 8, false}};

// Sizes and data: empty; 97 (fewer elements than ranks x granule: whole shards of padding) with an
// Inf; 4099 (prime: the last shard partly padded) clean and with a NaN.
struct Variant {
  std::size_t numel;
  Poison poison;
};
const Variant kVariants[] = {{0, Poison::none}, {97, Poison::inf}, {4099, Poison::none}, {4099, Poison::nan}};

Spec base_spec(const Variant& v) {
  Spec s;
  s.numel = v.numel;
  s.poison = v.poison;
  s.input_seed = 1000 + v.numel + static_cast<std::uint64_t>(v.poison);
  s.opt.seed = 0x5eed;
  return s;
}

void sweep(void (*add_cases)(Cases&, const Shape&, const Spec&)) {
  Watchdog dog(kWatchdogSeconds, "test_plans sweep");
  Failures fails;
  for (const Shape& shape : kShapes) {
    Cases cases;
    for (const Variant& v : kVariants) add_cases(cases, shape, base_spec(v));
    run_cases(shape, cases, fails);
  }
  fails.report();
}

// Formats per element type: a few pairs, not the cross product (each pair instantiates kernels).
using AgInt8 = AllGatherKind<float, q::Int8<64>>;
using AgInt4Asym = AllGatherKind<q::bfloat16, q::Int4Asym<32>>;
using AgE4M3 = AllGatherKind<q::half, q::Fp8E4M3<32>>;
using AgMxFp4 = AllGatherKind<q::bfloat16, q::MxFp4>;
using AgNvFp4 = AllGatherKind<q::half, q::NvFp4>;
using AgIdentity = AllGatherKind<float, q::Identity<float>>;

using RsInt = ReduceScatterKind<float, q::Int8<64>, q::Int4<32>>;
using RsInt4Asym = ReduceScatterKind<q::bfloat16, q::Int4Asym<32>, q::Int4Asym<32>>;
using RsE4M3MxFp4 = ReduceScatterKind<q::half, q::Fp8E4M3<32>, q::MxFp4>;
using RsNvFp4 = ReduceScatterKind<q::bfloat16, q::NvFp4, q::NvFp4>;
using RsIdentity = ReduceScatterKind<q::half, q::Identity<float>, q::Identity<float>>;

using ArInt = AllReduceKind<float, q::Int8<64>, q::Int4<32>, q::Int8<64>>;
using ArFp4 = AllReduceKind<q::bfloat16, q::NvFp4, q::NvFp4, q::MxFp4>;

using HpzIdentity = SecondaryShardKind<q::bfloat16, q::Identity<q::bfloat16>>;
using HpzInt8 = SecondaryShardKind<float, q::Int8<64>>;

TEST_CASE("QuantizedAllGather over cuda_local equals the host path, 2..8 ranks") {
  sweep([](Cases& cases, const Shape& shape, const Spec& base) {
    Spec s = base;
    for (int mode = 0; mode < 2; ++mode) {
      s.opt.rounding = mode == 0 ? q::Rounding::nearest : q::Rounding::stochastic;
      s.in_place = mode == 1;  // shard = full + shard_offset(rank)
      add<AgInt8>(cases, shape, s);
      add<AgInt4Asym>(cases, shape, s);
      add<AgE4M3>(cases, shape, s);
      add<AgMxFp4>(cases, shape, s);
      add<AgNvFp4>(cases, shape, s);
      add<AgIdentity>(cases, shape, s);
    }
  });
}

struct Mode {
  q::Reduce op;
  q::Hops hops;
  q::Rounding rounding;
};

TEST_CASE("QuantizedReduceScatter over cuda_local equals the host path, sum and mean, one and two hops") {
  sweep([](Cases& cases, const Shape& shape, const Spec& base) {
    const Mode modes[] = {{q::Reduce::sum, q::Hops::one, q::Rounding::nearest},
                          {q::Reduce::mean, q::Hops::one, q::Rounding::stochastic},
                          {q::Reduce::sum, q::Hops::two, q::Rounding::stochastic},
                          {q::Reduce::mean, q::Hops::two, q::Rounding::nearest}};
    for (const Mode& m : modes) {
      Spec s = base;
      s.op = m.op;
      s.hops = m.hops;
      s.opt.rounding = m.rounding;
      add<RsInt>(cases, shape, s);
      add<RsInt4Asym>(cases, shape, s);
      add<RsE4M3MxFp4>(cases, shape, s);
      add<RsNvFp4>(cases, shape, s);
      add<RsIdentity>(cases, shape, s);
    }
  });
}

TEST_CASE("QuantizedAllReduce over cuda_local equals the host path") {
  sweep([](Cases& cases, const Shape& shape, const Spec& base) {
    const Mode modes[] = {{q::Reduce::mean, q::Hops::two, q::Rounding::stochastic},
                          {q::Reduce::sum, q::Hops::one, q::Rounding::nearest}};
    for (const Mode& m : modes) {
      Spec s = base;
      s.op = m.op;
      s.hops = m.hops;
      s.opt.rounding = m.rounding;
      s.in_place = m.hops == q::Hops::two;  // in == out
      add<ArInt>(cases, shape, s);
      add<ArFp4>(cases, shape, s);
    }
  });
}

TEST_CASE("SecondaryShard capture + gather over cuda_local equals the host path") {
  sweep([](Cases& cases, const Shape& shape, const Spec& base) {
    add<HpzIdentity>(cases, shape, base);
    add<HpzInt8>(cases, shape, base);
  });
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs
// ---------------------------------------------------------------------------------------------

const Shape kGraphShape{4, 2, true};  // two nodes, not node-major
constexpr int kReplays = 3;

//! The inputs of replay k: fresh data each time; replay 1 holds a NaN (the flags must follow the
//! data of each replay, set and cleared again).
Spec replay_spec(Spec s, int k) {
  s.input_seed = 300 + static_cast<std::uint64_t>(k);
  s.poison = k == 1 ? Poison::nan : Poison::none;
  return s;
}

//! Each rank captures one call on its stream (thread-local capture mode), instantiates the graph
//! and replays it kReplays times, writing new inputs into the same buffers before each replay;
//! after each replay the output and flags must equal the host plan's for those inputs.
template <class Kind>
void check_graph(const Spec& spec, Failures& fails) {
  using T = typename Kind::Elem;
  const Shape shape = kGraphShape;
  const int W = shape.world;
  const std::vector<long long> ids = node_ids(shape);
  const q::ShardLayout layout(spec.numel, W, Kind::granule());
  const std::string label =
      Kind::name() + " in a CUDA graph, " + describe(shape) + ", " + describe(spec, Kind::reduces);
  std::vector<std::vector<std::vector<T>>> in(kReplays);
  std::vector<Results<T>> want(kReplays, Results<T>(W)), got(kReplays, Results<T>(W));
  std::vector<int> poisoned(kReplays);
  for (int k = 0; k < kReplays; ++k)
    poisoned[static_cast<std::size_t>(k)] =
        make_case_inputs<Kind>(replay_spec(spec, k), layout, ids, in[static_cast<std::size_t>(k)]);

  try {
    q::LocalGroup host(W, ids);
    host.run([&](q::LocalTransport& t) {
      const int r = t.rank();
      const q::Topology topo = q::Topology::from_node_ids(ids, r);
      typename Kind::template Plan<q::LocalTransport> plan(t, topo, layout, spec);
      for (std::size_t k = 0; k < kReplays; ++k)
        host_call<Kind>(plan, spec, layout, r, in[k][static_cast<std::size_t>(r)],
                        want[k].out[static_cast<std::size_t>(r)], want[k].flags[static_cast<std::size_t>(r)]);
    });
  } catch (const std::exception& e) {
    fails.add(label + ": host path failed: " + e.what());
    return;
  }

  try {
    q::CudaLocalGroup device(W, ids);
    device.run([&](q::CudaLocalTransport& t) {
      const int r = t.rank();
      const auto ri = static_cast<std::size_t>(r);
      const cudaStream_t s = t.stream();
      const q::Topology topo = q::Topology::from_node_ids(ids, r);
      typename Kind::template Plan<q::CudaLocalTransport> plan(t, topo, layout, spec);
      DeviceCall<Kind> c(layout, spec, r, plan.workspace_bytes());
      c.load(in[0][ri], s);
      TEST_CUDA(cudaStreamSynchronize(s));
      t.barrier();

      cudaGraph_t graph = nullptr;
      TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      try {
        call_plan(plan, c.src, c.out.template as<T>(), c.ws.get(), c.ws_bytes, s, spec);
      } catch (...) {
        (void)cudaStreamEndCapture(s, &graph);
        if (graph != nullptr) (void)cudaGraphDestroy(graph);
        throw;
      }
      TEST_CUDA(cudaStreamEndCapture(s, &graph));
      std::size_t nodes = 0;
      TEST_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
      if (nodes == 0) fails.add(label + ": rank " + std::to_string(r) + ": the captured graph is empty");
      // Captured, not run: the output still holds the sentinel.
      const std::vector<T> before = download(c.out.template as<T>(), c.n_out, s);
      if (!first_difference(before, std::vector<T>(c.n_out, sentinel<T>())).empty())
        fails.add(label + ": rank " + std::to_string(r) + ": capturing the call wrote the output");
      cudaGraphExec_t exec = nullptr;
      TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      t.barrier();  // no rank is still capturing or instantiating when the first replay waits for it

      for (std::size_t k = 0; k < kReplays; ++k) {
        // Host copies (pageable, so synchronous) only while no replay waits: a rank blocked in one
        // could not launch the replay its peers' replays wait for (docs/device.md).
        c.load(in[k][ri], s);
        TEST_CUDA(cudaStreamSynchronize(s));
        t.barrier();
        TEST_CUDA(cudaGraphLaunch(exec, s));
        TEST_CUDA(cudaStreamSynchronize(s));
        t.barrier();
        got[k].out[ri] = download(c.out.template as<T>(), c.n_out, s);
        got[k].flags[ri] = q::gpu::read_result_flags(c.ws.get(), s);
      }
      t.barrier();
      TEST_CUDA(cudaGraphExecDestroy(exec));
      TEST_CUDA(cudaGraphDestroy(graph));
      t.barrier();
    });
  } catch (const std::exception& e) {
    fails.add(label + ": device path failed: " + e.what());
    return;
  }

  for (std::size_t k = 0; k < kReplays; ++k)
    for (std::size_t r = 0; r < static_cast<std::size_t>(W); ++r) {
      const std::string where =
          label + ", replay " + std::to_string(k) + ", rank " + std::to_string(r) + ": ";
      const std::uint32_t expect_host = expected_flags<Kind>(ids, poisoned[k], static_cast<int>(r));
      ++fails.compared;
      if (want[k].flags[r] != expect_host)
        fails.add(where + "host flags " + flags_text(want[k].flags[r]) + ", expected " +
                  flags_text(expect_host));
      const std::string d = first_difference(got[k].out[r], want[k].out[r]);
      if (!d.empty()) fails.add(where + "output differs from the host path: " + d);
      if (got[k].flags[r] != want[k].flags[r])
        fails.add(where + "device flags " + flags_text(got[k].flags[r]) + ", host flags " +
                  flags_text(want[k].flags[r]));
    }
}

TEST_CASE("every plan captured in a CUDA graph replays with new inputs, 4 ranks on two nodes") {
  Watchdog dog(kWatchdogSeconds, "test_plans graphs");
  Failures fails;
  Spec s;
  s.numel = 4099;
  s.opt.seed = 91;
  s.opt.rounding = q::Rounding::stochastic;
  check_graph<AgInt8>(s, fails);
  check_graph<AgNvFp4>(s, fails);
  s.op = q::Reduce::mean;
  s.hops = q::Hops::two;
  check_graph<RsInt>(s, fails);
  check_graph<ArInt>(s, fails);
  s.op = q::Reduce::sum;
  s.hops = q::Hops::one;
  s.opt.rounding = q::Rounding::nearest;
  check_graph<RsNvFp4>(s, fails);
  check_graph<HpzIdentity>(s, fails);
  check_graph<HpzInt8>(s, fails);
  fails.report();
}

// ---------------------------------------------------------------------------------------------
// Rejected arguments
// ---------------------------------------------------------------------------------------------

const Shape kBadShape{4, 2, true};
constexpr int kBadRank = 2;

//! What the bad rank gets wrong.
enum class Bad {
  pageable_input,   // its input is a std::vector's data
  pageable_output,  // its output is a std::vector's data
  stale,            // hpZ: it gathers a generation it did not capture
};

//! The host plan's outputs and flags for the inputs `in` (one per rank), over a LocalGroup with
//! the node table `ids`: what every device check compares against.
template <class Kind, class T>
void run_host_reference(const std::vector<long long>& ids, const q::ShardLayout& layout, const Spec& spec,
                        const std::vector<std::vector<T>>& in, Results<T>& want) {
  q::LocalGroup host(static_cast<int>(ids.size()), ids);
  host.run([&](q::LocalTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    typename Kind::template Plan<q::LocalTransport> plan(t, q::Topology::from_node_ids(ids, t.rank()), layout,
                                                         spec);
    host_call<Kind>(plan, spec, layout, t.rank(), in[r], want.out[r], want.flags[r]);
  });
}

//! Rank kBadRank makes one bad call: it must throw qcoll::Error naming `argument` and leave its
//! output untouched; every rank that exchanges with it (all ranks; for hpZ, its node) must return
//! normally, see kResultRejected and find its output untouched; hpZ ranks of the other node make
//! an ordinary call. Then all ranks make a good call, which must equal the host path.
template <class Kind>
void check_one_rank_rejects(Bad bad, const char* argument, const Spec& spec, Failures& fails) {
  using T = typename Kind::Elem;
  const Shape shape = kBadShape;
  const int W = shape.world;
  const std::vector<long long> ids = node_ids(shape);
  const q::ShardLayout layout(spec.numel, W, Kind::granule());
  const std::string label =
      Kind::name() + ", rank " + std::to_string(kBadRank) + " passes a bad '" + argument + "'";
  std::vector<std::vector<T>> in;
  make_case_inputs<Kind>(spec, layout, ids, in);
  Results<T> want(W), after(W), good(W);
  std::vector<std::string> error(static_cast<std::size_t>(W));

  try {
    run_host_reference<Kind>(ids, layout, spec, in, want);
    q::CudaLocalGroup device(W, ids);
    device.run([&](q::CudaLocalTransport& t) {
      const int r = t.rank();
      const auto ri = static_cast<std::size_t>(r);
      const cudaStream_t s = t.stream();
      typename Kind::template Plan<q::CudaLocalTransport> plan(t, q::Topology::from_node_ids(ids, r), layout,
                                                               spec);
      DeviceCall<Kind> c(layout, spec, r, plan.workspace_bytes());
      c.load(in[ri], s);
      std::vector<T> pageable_in = in[ri];
      std::vector<T> pageable_out(c.n_out, sentinel<T>());
      TEST_CUDA(cudaStreamSynchronize(s));
      t.barrier();

      const T* src = c.src;
      T* dst = c.out.template as<T>();
      Spec mine = spec;
      if (r == kBadRank) {
        if (bad == Bad::pageable_input) src = pageable_in.data();
        if (bad == Bad::pageable_output) dst = pageable_out.data();
        if (bad == Bad::stale) mine.stale = true;
      }
      try {
        call_plan(plan, src, dst, c.ws.get(), c.ws_bytes, s, mine);
      } catch (const q::Error& e) {
        error[ri] = std::string("threw: ") + e.what();
      }
      after.flags[ri] = q::gpu::read_result_flags(c.ws.get(), s);
      after.out[ri] = download(c.out.template as<T>(), c.n_out, s);
      t.barrier();

      // The same plan and buffers, good arguments on every rank.
      c.load(in[ri], s);
      t.barrier();
      call_plan(plan, c.src, c.out.template as<T>(), c.ws.get(), c.ws_bytes, s, spec);
      good.out[ri] = download(c.out.template as<T>(), c.n_out, s);
      good.flags[ri] = q::gpu::read_result_flags(c.ws.get(), s);
      t.barrier();
    });
  } catch (const std::exception& e) {
    fails.add(label + ": failed: " + e.what());
    return;
  }

  for (std::size_t r = 0; r < static_cast<std::size_t>(W); ++r) {
    const std::string where = label + ", rank " + std::to_string(r) + ": ";
    ++fails.compared;
    if (r == static_cast<std::size_t>(kBadRank)) {
      if (!has(error[r], std::string("threw: ")) || !has(error[r], std::string("'") + argument + "'"))
        fails.add(where + "expected a qcoll::Error naming '" + argument +
                  "', got: " + (error[r].empty() ? std::string("no error") : error[r]));
      const std::string d =
          first_difference(after.out[r], std::vector<T>(after.out[r].size(), sentinel<T>()));
      if (!d.empty()) fails.add(where + "the rejected call wrote the output: " + d);
    } else if (Kind::sees(ids, kBadRank, static_cast<int>(r))) {  // a peer in an exchange with the bad rank
      if (!error[r].empty()) fails.add(where + "a peer of the bad rank " + error[r]);
      if ((after.flags[r] & q::kResultRejected) == 0)
        fails.add(where + "flags " + flags_text(after.flags[r]) + " lack kResultRejected");
      const std::string d =
          first_difference(after.out[r], std::vector<T>(after.out[r].size(), sentinel<T>()));
      if (!d.empty()) fails.add(where + "the rejected call wrote the output: " + d);
    } else {  // hpZ on another node: no exchange with the bad rank, an ordinary call
      if (!error[r].empty()) fails.add(where + "a rank on another node " + error[r]);
      const std::string d = first_difference(after.out[r], want.out[r]);
      if (!d.empty() || after.flags[r] != want.flags[r])
        fails.add(where + "a rank on another node differs from the host path: flags " +
                  flags_text(after.flags[r]) + "; " + d);
    }
    const std::string g = first_difference(good.out[r], want.out[r]);
    if (!g.empty()) fails.add(where + "the next good call differs from the host path: " + g);
    if (good.flags[r] != want.flags[r])
      fails.add(where + "the next good call's flags " + flags_text(good.flags[r]) + ", host " +
                flags_text(want.flags[r]));
  }
}

TEST_CASE("a bad argument on one rank: it throws naming the argument, its peers get kResultRejected") {
  Watchdog dog(kWatchdogSeconds, "test_plans rejected arguments");
  Failures fails;
  Spec s;
  s.numel = 4099;
  s.hops = q::Hops::two;
  check_one_rank_rejects<AgInt8>(Bad::pageable_input, "shard", s, fails);
  check_one_rank_rejects<AgNvFp4>(Bad::pageable_output, "full", s, fails);
  check_one_rank_rejects<RsInt>(Bad::pageable_input, "grad", s, fails);
  check_one_rank_rejects<RsInt>(Bad::pageable_output, "shard", s, fails);
  check_one_rank_rejects<ArInt>(Bad::pageable_input, "in", s, fails);
  check_one_rank_rejects<HpzIdentity>(Bad::pageable_output, "full", s, fails);
  check_one_rank_rejects<HpzIdentity>(Bad::stale, "generation", s, fails);
  fails.report();
}

//! How every rank's workspace is unusable.
enum class BadWorkspace { misaligned, too_small, pageable, null };

const char* describe(BadWorkspace b) {
  switch (b) {
    case BadWorkspace::misaligned: return "misaligned (ws + 16)";
    case BadWorkspace::too_small: return "one byte too small";
    case BadWorkspace::pageable: return "pageable";
    case BadWorkspace::null: return "null";
  }
  return "";
}

//! Every rank passes the same kind of unusable workspace: every rank throws qcoll::Error naming the
//! workspace, before enqueuing anything (a capture of the call records no node, and neither the
//! output nor the workspace changes). Then a good call equals the host path.
template <class Kind>
void check_bad_workspace(const Spec& spec, Failures& fails) {
  using T = typename Kind::Elem;
  const Shape shape = kBadShape;
  const int W = shape.world;
  const std::vector<long long> ids = node_ids(shape);
  const q::ShardLayout layout(spec.numel, W, Kind::granule());
  std::vector<std::vector<T>> in;
  make_case_inputs<Kind>(spec, layout, ids, in);
  Results<T> want(W), good(W);
  const BadWorkspace kinds[] = {BadWorkspace::misaligned, BadWorkspace::too_small, BadWorkspace::pageable,
                                BadWorkspace::null};

  try {
    run_host_reference<Kind>(ids, layout, spec, in, want);
    q::CudaLocalGroup device(W, ids);
    device.run([&](q::CudaLocalTransport& t) {
      const int r = t.rank();
      const auto ri = static_cast<std::size_t>(r);
      const cudaStream_t s = t.stream();
      typename Kind::template Plan<q::CudaLocalTransport> plan(t, q::Topology::from_node_ids(ids, r), layout,
                                                               spec);
      const std::size_t need = plan.workspace_bytes();
      DeviceCall<Kind> c(layout, spec, r, need + 128);
      harness::Workspace host_ws(need);  // 64-byte aligned, large enough, but pageable
      c.load(in[ri], s);
      TEST_CUDA(cudaMemsetAsync(c.ws.get(), 0x5A, c.ws.size(), s));
      TEST_CUDA(cudaStreamSynchronize(s));
      t.barrier();

      plan.prepare(c.src, s, spec);  // hpZ: capture() is local and may enqueue its copy
      for (BadWorkspace b : kinds) {
        void* ws = c.ws.get();
        std::size_t bytes = need;
        if (b == BadWorkspace::misaligned) ws = c.ws.get() + 16;
        if (b == BadWorkspace::too_small) bytes = need - 1;
        if (b == BadWorkspace::pageable) ws = host_ws.ptr;
        if (b == BadWorkspace::null) ws = nullptr;
        const std::string where =
            Kind::name() + ", " + describe(b) + " workspace, rank " + std::to_string(r) + ": ";
        for (bool captured : {false, true}) {
          // Captured: the graph shows whether the call enqueued anything before throwing.
          cudaGraph_t graph = nullptr;
          if (captured) TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
          std::string error = "no error";
          try {
            plan.exchange(c.src, c.out.template as<T>(), ws, bytes, s, spec);
          } catch (const q::Error& e) {
            error = e.what();
          }
          if (captured) {
            TEST_CUDA(cudaStreamEndCapture(s, &graph));
            std::size_t nodes = 0;
            TEST_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
            TEST_CUDA(cudaGraphDestroy(graph));
            if (nodes != 0) fails.add(where + "the call enqueued " + std::to_string(nodes) + " node(s)");
          }
          const std::string named = b == BadWorkspace::too_small ? "'workspace" : "'workspace'";
          if (!has(error, named))
            fails.add(where + "expected a qcoll::Error naming the workspace, got: " + error);
        }
      }
      const std::vector<T> out = download(c.out.template as<T>(), c.n_out, s);
      const std::vector<unsigned char> ws = download(c.ws.get(), c.ws.size(), s);
      if (!first_difference(out, std::vector<T>(out.size(), sentinel<T>())).empty())
        fails.add(Kind::name() + ", rank " + std::to_string(r) +
                  ": a call with a bad workspace wrote the output");
      if (ws != std::vector<unsigned char>(ws.size(), 0x5A))
        fails.add(Kind::name() + ", rank " + std::to_string(r) +
                  ": a call with a bad workspace wrote the workspace");
      t.barrier();

      c.load(in[ri], s);
      t.barrier();
      call_plan(plan, c.src, c.out.template as<T>(), c.ws.get(), need, s, spec);
      good.out[ri] = download(c.out.template as<T>(), c.n_out, s);
      good.flags[ri] = q::gpu::read_result_flags(c.ws.get(), s);
      t.barrier();
    });
  } catch (const std::exception& e) {
    fails.add(Kind::name() + ", bad workspaces: failed: " + e.what());
    return;
  }
  for (std::size_t r = 0; r < static_cast<std::size_t>(W); ++r) {
    ++fails.compared;
    const std::string g = first_difference(good.out[r], want.out[r]);
    if (!g.empty())
      fails.add(Kind::name() + ", rank " + std::to_string(r) +
                ": the good call after bad workspaces differs: " + g);
    if (good.flags[r] != want.flags[r])
      fails.add(Kind::name() + ", rank " + std::to_string(r) + ": the good call's flags " +
                flags_text(good.flags[r]));
  }
}

TEST_CASE("an unusable workspace on every rank: every rank throws naming it, nothing is enqueued") {
  Watchdog dog(kWatchdogSeconds, "test_plans bad workspace");
  Failures fails;
  Spec s;
  s.numel = 4099;
  s.hops = q::Hops::two;
  check_bad_workspace<AgInt8>(s, fails);
  check_bad_workspace<RsInt>(s, fails);
  check_bad_workspace<ArInt>(s, fails);
  check_bad_workspace<HpzIdentity>(s, fails);
  fails.report();
}

// ---------------------------------------------------------------------------------------------
// NCCL, one rank
// ---------------------------------------------------------------------------------------------

#if TEST_PLANS_NCCL

//! One call of Kind over NcclTransport (world 1) against the host plan with world 1.
template <class Kind>
void check_nccl(q::NcclTransport& t, cudaStream_t s, const Spec& spec, Failures& fails) {
  using T = typename Kind::Elem;
  const std::vector<long long> ids = {0};
  const q::ShardLayout layout(spec.numel, 1, Kind::granule());
  const std::string label = Kind::name() + " over NCCL (one rank), " + describe(spec, Kind::reduces);
  std::vector<std::vector<T>> in;
  const int poisoned = make_case_inputs<Kind>(spec, layout, ids, in);
  Results<T> want(1);
  run_host_reference<Kind>(ids, layout, spec, in, want);
  typename Kind::template Plan<q::NcclTransport> plan(t, q::Topology::from_node_ids(ids, 0), layout, spec);
  DeviceCall<Kind> c(layout, spec, 0, plan.workspace_bytes());
  c.load(in[0], s);
  call_plan(plan, c.src, c.out.template as<T>(), c.ws.get(), c.ws_bytes, s, spec);
  const std::vector<T> got = download(c.out.template as<T>(), c.n_out, s);
  const std::uint32_t flags = q::gpu::read_result_flags(c.ws.get(), s);
  if (want.flags[0] != expected_flags<Kind>(ids, poisoned, 0))
    fails.add(label + ": host flags " + flags_text(want.flags[0]));
  ++fails.compared;
  const std::string d = first_difference(got, want.out[0]);
  if (!d.empty()) fails.add(label + ": output differs from the host path: " + d);
  if (flags != want.flags[0])
    fails.add(label + ": device flags " + flags_text(flags) + ", host flags " + flags_text(want.flags[0]));
}

TEST_CASE("nccl, one rank: all-gather and one-hop reduce-scatter equal the host path") {
  Watchdog dog(kWatchdogSeconds, "test_plans nccl");
  TEST_CUDA(cudaSetDevice(0));
  OneRankComm comm;
  q::NcclTransport t(comm.comm);
  cudaStream_t s;
  TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Failures fails;
  for (const Variant& v : kVariants) {
    Spec spec = base_spec(v);
    spec.hops = q::Hops::one;
    for (q::Rounding rounding : {q::Rounding::nearest, q::Rounding::stochastic}) {
      spec.opt.rounding = rounding;
      spec.op = rounding == q::Rounding::nearest ? q::Reduce::sum : q::Reduce::mean;
      check_nccl<AgInt8>(t, s, spec, fails);
      check_nccl<AgNvFp4>(t, s, spec, fails);
      check_nccl<RsInt>(t, s, spec, fails);
      check_nccl<RsNvFp4>(t, s, spec, fails);
    }
  }
  TEST_CUDA(cudaStreamDestroy(s));
  fails.report();
}

#endif  // TEST_PLANS_NCCL

}  // namespace
