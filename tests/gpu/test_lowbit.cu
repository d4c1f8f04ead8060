// The low-bit techniques on the device data path (cuda/lowbit.cuh, collective/device.cuh) against
// the host path, the oracle: for the same inputs and options, every output byte and every final
// error-feedback state byte equal the host plans' over LocalTransport, and the kResultNonFinite
// bit equals the host call's return value.
//
//   - Hadamard rotation: QuantizedAllGather (whole shards of padding, a partly padded shard,
//     stochastic rounding) and QuantizedReduceScatter (one and two hops, node-major and round
//     robin, sum and mean; the same rotation in both hops, different ones, one hop only).
//   - Error feedback: QuantizedReduceScatter (one and two hops, fp32 and bf16 states, decay,
//     hop 2 only, with a rotation) and QuantizedAllReduce (also with a rotation in every stage),
//     over three steps; the device
//     init_residual writes the host's bytes.
//   - A rotated feedback reduce-scatter and a rotated all-gather captured in a CUDA graph once
//     and replayed with new inputs equal the host path's successive calls.
//   - On the device alone: the identity sum over steps of delivered = sum of inputs - residuals,
//     within the bound of the fp32 roundings (as tests/unit/test_lowbit.cpp derives it); the
//     rotation's inverse within 2 k n 2^-24 max|x| of the input (format/hadamard.hpp).
//   - qWD: DeltaAllGather's resync and difference calls keep the device replicas equal to the host
//     path's, on every rank, bit for bit.
//   - Tensor groups (random groups of 4..8 tensors, empty ones and one 1000x larger than its
//     neighbours, NaN in every padding position of the inputs): all-gather (int8, int4 asym, e4m3,
//     MXFP4, identity, rotated), hpZ, reduce-scatter (one and two hops; rotations, feedback,
//     stochastic rounding), all-reduce with feedback, qWD: device == host byte for byte (outputs,
//     flags, states), no non-finite flag, and +0 at every padding position of every output.
//   - A pageable output on one rank of a rotated all-gather or a qWD call: that rank throws
//     naming it, every rank gets kResultRejected, and no device output is written.
//   - Bad states: a state never initialised, or one of another plan, on one rank: that rank gets
//     kResultBadResidual, every rank kResultRejected, no output and no state is written; a null
//     state on one rank: it throws naming `residual`, its peers get kResultRejected.
//
//   - NcclTransport on a one-rank communicator (GPU builds with NCCL): a rotated all-gather and
//     rotated reduce-scatters with feedback, one over a tensor group, equal the host path.
//
// Exits with 77 (reported as skipped by CTest) when there is no CUDA device.

#include "common/gpu_main.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#if defined(QCOLL_HAVE_NCCL) && !QCOLL_HAVE_NCCL
#define QCOLL_HAS_NCCL 0  // the build has NCCL disabled: leave the NCCL transport out
#endif

// Before the CUDA headers: the harness names qcoll's `half` unqualified.
#include "common/collective_harness.hpp"
#include "common/watchdog.hpp"

#include <qcoll/qcoll.cuh>

#include "../common/device_bytes.hpp"
#include "common/nccl_one_rank.hpp"

#if defined(QCOLL_HAVE_NCCL) && QCOLL_HAVE_NCCL && QCOLL_HAS_NCCL
#define TEST_LOWBIT_NCCL 1
#else
#define TEST_LOWBIT_NCCL 0
#endif

namespace {

namespace q = qcoll;
using Bytes = std::vector<unsigned char>;

constexpr int kWatchdogSeconds = 300;

using testing_support::DeviceBytes;

Bytes download(const void* src, std::size_t n, cudaStream_t s) {
  Bytes h(n);
  if (n > 0) QCOLL_CUDA_CHECK(cudaMemcpyAsync(h.data(), src, n, cudaMemcpyDeviceToHost, s));
  QCOLL_CUDA_CHECK(cudaStreamSynchronize(s));
  return h;
}

template <class T>
Bytes bytes_of(const std::vector<T>& v) {
  Bytes b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <class T>
std::vector<T> from_bytes(const Bytes& b) {
  std::vector<T> v(b.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
  return v;
}

//! "" when equal, else where the first difference is.
std::string difference(const Bytes& got, const Bytes& want) {
  if (got.size() != want.size())
    return "size " + std::to_string(got.size()) + " instead of " + std::to_string(want.size());
  std::size_t count = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && count++ == 0) first = i;
  if (count == 0) return "";
  return std::to_string(count) + " of " + std::to_string(got.size()) + " bytes differ, first at byte " +
         std::to_string(first);
}

//! One collective call sequence over all ranks: per rank and step the output bytes and the flags,
//! and per rank the final error-feedback state.
struct Outcome {
  std::vector<std::vector<Bytes>> out;
  std::vector<std::vector<std::uint32_t>> flags;
  std::vector<Bytes> state;
  std::vector<std::vector<Bytes>> states;  // device: the state after each step
  explicit Outcome(int world)
      : out(static_cast<std::size_t>(world)),
        flags(static_cast<std::size_t>(world)),
        state(static_cast<std::size_t>(world)),
        states(static_cast<std::size_t>(world)) {}
};

//! The calls of a plan: in[step][rank] -> out_count elements, with error feedback when Fb (states
//! initialised with `fb`). `make(transport, topology)` builds the plan.
template <bool Fb, class T, class Make>
Outcome run_host(const std::vector<long long>& ids, std::size_t out_count,
                 const std::vector<std::vector<std::vector<T>>>& in, Make&& make,
                 const q::FeedbackOptions& fb) {
  const int W = static_cast<int>(ids.size());
  Outcome o(W);
  q::LocalGroup g(W, ids);
  g.run([&](q::LocalTransport& t) {
    const int r = t.rank();
    const auto ri = static_cast<std::size_t>(r);
    auto plan = make(t, q::Topology::from_node_ids(ids, r));
    harness::Workspace ws(plan.workspace_bytes());
    std::size_t state_bytes = 0;
    if constexpr (Fb) state_bytes = plan.residual_bytes(fb);
    harness::Workspace state(state_bytes);
    if constexpr (Fb) plan.init_residual(state.ptr, state.bytes, fb);
    for (const auto& step : in) {
      std::vector<T> out(out_count, q::from_float<T>(-1.0f));
      std::uint32_t flags;
      if constexpr (Fb) {
        flags = plan(step[ri].data(), out.data(), ws.ptr, ws.bytes, q::ResidualState{state.ptr, state.bytes});
      } else {
        flags = plan(step[ri].data(), out.data(), ws.ptr, ws.bytes);
      }
      o.out[ri].push_back(bytes_of(out));
      o.flags[ri].push_back(flags);
    }
    const auto* sp = static_cast<const unsigned char*>(state.ptr);
    o.state[ri].assign(sp, sp + state.bytes);
  });
  return o;
}

//! One rank's share of run_device over a device transport `t` on stream `s` (collective: every
//! rank of t calls it). Writes the rank's results into o.
template <bool Fb, class T, class Tr, class Make, class Corrupt>
void device_rank(Tr& t, cudaStream_t s, const std::vector<long long>& ids, std::size_t out_count,
                 const std::vector<std::vector<std::vector<T>>>& in, Make& make, const q::FeedbackOptions& fb,
                 Corrupt& corrupt, bool graph, Outcome& o) {
  const int r = t.rank();
  const auto ri = static_cast<std::size_t>(r);
  auto plan = make(t, q::Topology::from_node_ids(ids, r));
  const std::size_t in_count = in.empty() ? 0 : in[0][ri].size();
  DeviceBytes ws(plan.workspace_bytes()), din(in_count * sizeof(T)), dout(out_count * sizeof(T));
  std::size_t state_bytes = 0;
  if constexpr (Fb) state_bytes = plan.residual_bytes(fb);
  DeviceBytes state(state_bytes);
  q::ResidualState rs{state.as(), state_bytes};
  if constexpr (Fb) {
    plan.init_residual(state.as(), state_bytes, fb, s);
    rs = corrupt(r, plan, rs, s);
  }
  const auto call = [&] {
    if constexpr (Fb) {
      plan(din.as<T>(), dout.as<T>(), ws.as(), ws.size(), rs, s);
    } else {
      plan(din.as<T>(), dout.as<T>(), ws.as(), ws.size(), s);
    }
  };
  QCOLL_CUDA_CHECK(cudaStreamSynchronize(s));
  t.barrier();  // every rank's buffers exist before any rank's kernels wait for its peers
  cudaGraph_t captured = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    QCOLL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    call();
    QCOLL_CUDA_CHECK(cudaStreamEndCapture(s, &captured));
    QCOLL_CUDA_CHECK(cudaGraphInstantiate(&exec, captured, 0));
    t.barrier();  // no rank is still capturing or instantiating when the first replay waits for it
  }
  for (const auto& step : in) {
    QCOLL_CUDA_CHECK(cudaMemsetAsync(dout.as(), 0x7B, out_count * sizeof(T), s));
    if (in_count > 0)
      QCOLL_CUDA_CHECK(
          cudaMemcpyAsync(din.as(), step[ri].data(), in_count * sizeof(T), cudaMemcpyHostToDevice, s));
    if (graph) {
      // Host copies (pageable, so synchronous) only while no replay waits: a rank blocked in one
      // could not launch the replay its peers' replays wait for (docs/device.md). Direct calls
      // need no such care.
      QCOLL_CUDA_CHECK(cudaStreamSynchronize(s));
      t.barrier();
      QCOLL_CUDA_CHECK(cudaGraphLaunch(exec, s));
      QCOLL_CUDA_CHECK(cudaStreamSynchronize(s));
      t.barrier();
    } else {
      call();
    }
    o.out[ri].push_back(download(dout.as(), out_count * sizeof(T), s));
    o.flags[ri].push_back(q::gpu::read_result_flags(ws.as(), s));
    if constexpr (Fb) o.states[ri].push_back(download(state.as(), state_bytes, s));
  }
  o.state[ri] = download(state.as(), state_bytes, s);
  t.barrier();  // every rank's stream is idle before any buffer is freed
  if (graph) {
    QCOLL_CUDA_CHECK(cudaGraphExecDestroy(exec));
    QCOLL_CUDA_CHECK(cudaGraphDestroy(captured));
    t.barrier();
  }
}

//! The same calls on the device over CudaLocalTransport; `corrupt(rank, plan, state, stream)`
//! may spoil a rank's state after init_residual (it returns the ResidualState to pass). With
//! `graph`, the call is captured once in a CUDA graph and every step replays it.
template <bool Fb, class T, class Make, class Corrupt>
Outcome run_device(const std::vector<long long>& ids, std::size_t out_count,
                   const std::vector<std::vector<std::vector<T>>>& in, Make&& make,
                   const q::FeedbackOptions& fb, Corrupt&& corrupt, bool graph = false) {
  Outcome o(static_cast<int>(ids.size()));
  q::CudaLocalGroup g(static_cast<int>(ids.size()), ids);
  g.run([&](q::CudaLocalTransport& t) {
    device_rank<Fb, T>(t, t.stream(), ids, out_count, in, make, fb, corrupt, graph, o);
  });
  return o;
}

struct NoCorruption {
  template <class Plan>
  q::ResidualState operator()(int, Plan&, q::ResidualState rs, cudaStream_t) const {
    return rs;
  }
};

//! Checks device == host: outputs and states byte for byte, flags as the file's header says.
void compare(const Outcome& dev, const Outcome& host, const std::string& label) {
  int compared = 0;
  for (std::size_t r = 0; r < host.out.size(); ++r) {
    const std::string where = label + ", rank " + std::to_string(r);
    REQUIRE_MESSAGE(dev.out[r].size() == host.out[r].size(), where);
    for (std::size_t k = 0; k < host.out[r].size(); ++k) {
      const std::string d = difference(dev.out[r][k], host.out[r][k]);
      CHECK_MESSAGE(d.empty(),
                    where << ", step " << k << ": device output differs from the host path: " << d);
      CHECK_MESSAGE(dev.flags[r][k] == host.flags[r][k], where << ", step " << k << ": device flags "
                                                               << dev.flags[r][k] << ", host "
                                                               << host.flags[r][k]);
      ++compared;
    }
    const std::string d = difference(dev.state[r], host.state[r]);
    CHECK_MESSAGE(d.empty(), where << ": final device residual state differs from the host's: " << d);
  }
  CHECK(compared > 0);
}

//! in[step][rank]: `steps` rounds of harness inputs of count elements (numel of data).
template <class T>
std::vector<std::vector<std::vector<T>>> inputs(std::uint64_t seed, int steps, int world, std::size_t count,
                                                std::size_t numel) {
  std::vector<std::vector<std::vector<T>>> in;
  for (int k = 0; k < steps; ++k) in.push_back(harness::make_inputs<T>(seed + 17 * k, world, count, numel));
  return in;
}

//! All-gather inputs: rank r's shard of one weight buffer per step.
template <class T>
std::vector<std::vector<std::vector<T>>> shard_inputs(std::uint64_t seed, int steps,
                                                      const q::ShardLayout& l) {
  std::vector<std::vector<std::vector<T>>> in(static_cast<std::size_t>(steps));
  for (int k = 0; k < steps; ++k) {
    const std::vector<T> x = harness::make_input<T>(seed + 17 * k, 0, l.padded_numel(), l.numel());
    for (int r = 0; r < l.parts(); ++r)
      in[static_cast<std::size_t>(k)].emplace_back(
          x.begin() + static_cast<std::ptrdiff_t>(l.shard_offset(r)),
          x.begin() + static_cast<std::ptrdiff_t>(l.shard_offset(r) + l.shard_numel()));
  }
  return in;
}

const std::vector<long long> kOneNode3 = {0, 0, 0};
const std::vector<long long> kTwoByTwo = {0, 0, 1, 1};
const std::vector<long long> kRoundRobin6 = {0, 1, 2, 0, 1, 2};

std::string ids_text(const std::vector<long long>& ids) {
  std::string s = "W=" + std::to_string(ids.size()) + " nodes {";
  for (long long i : ids) s += std::to_string(i) + ",";
  return s + "}";
}

// ---------------------------------------------------------------------------------------------
// Hadamard rotation
// ---------------------------------------------------------------------------------------------

template <class T, class F>
void rotated_all_gather(const std::vector<long long>& ids, std::size_t numel, q::HopOptions hop) {
  const int W = static_cast<int>(ids.size());
  const q::ShardLayout layout(numel, W, q::granule_for(sizeof(T), {F::block}));
  const auto in = shard_inputs<T>(numel + 5, 2, layout);
  const auto make = [&](auto& t, const q::Topology&) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedAllGather<T, F, Tr>(t, layout, hop);
  };
  const q::FeedbackOptions none;
  const Outcome host = run_host<false, T>(ids, layout.padded_numel(), in, make, none);
  const Outcome dev = run_device<false, T>(ids, layout.padded_numel(), in, make, none, NoCorruption{});
  compare(dev, host,
          "QuantizedAllGather<" + std::string(q::format_name(F::id)) + ">, " + ids_text(ids) + ", numel " +
              std::to_string(numel) + ", span " + std::to_string(hop.rotation.span()));
}

TEST_CASE("rotated QuantizedAllGather over cuda_local equals the host path") {
  testing_support::Watchdog dog(kWatchdogSeconds, "rotated all-gather");
  q::HopOptions h;
  h.rotation = q::Rotation{6, 42};
  for (std::size_t numel : {std::size_t{4099}, std::size_t{97}}) {
    rotated_all_gather<float, q::Int8<64>>(kOneNode3, numel, h);
    q::HopOptions sr = h;
    sr.rounding = q::Rounding::stochastic;
    sr.seed = 77;
    sr.rotation = q::Rotation{7, 5};
    rotated_all_gather<q::bfloat16, q::Int4<128>>(kTwoByTwo, numel, sr);
  }
  q::HopOptions big;
  big.rotation = q::Rotation{11, 3};  // a span of 2048: one span per tile
  rotated_all_gather<q::half, q::Int8<2048>>(kTwoByTwo, 9000, big);
}

template <class T, class F1, class F2>
void rotated_reduce_scatter(const std::vector<long long>& ids, std::size_t numel, q::Hops hops, q::Reduce op,
                            const q::ReduceScatterOptions& opts) {
  const int W = static_cast<int>(ids.size());
  const q::ShardLayout layout(numel, W, q::granule_for(sizeof(T), {F1::block, F2::block}));
  const auto in = inputs<T>(numel + 11, 2, W, layout.padded_numel(), numel);
  const auto make = [&](auto& t, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedReduceScatter<T, F1, F2, Tr>(t, topo, layout, op, hops, opts);
  };
  const q::FeedbackOptions none;
  const Outcome host = run_host<false, T>(ids, layout.shard_numel(), in, make, none);
  const Outcome dev = run_device<false, T>(ids, layout.shard_numel(), in, make, none, NoCorruption{});
  compare(dev, host,
          "QuantizedReduceScatter, " + ids_text(ids) + ", numel " + std::to_string(numel) +
              (hops == q::Hops::one ? ", one hop" : ", two hops") +
              (op == q::Reduce::sum ? ", sum" : ", mean") + ", spans " +
              std::to_string(opts.hop1.rotation.span()) + "/" + std::to_string(opts.hop2.rotation.span()));
}

TEST_CASE("rotated QuantizedReduceScatter over cuda_local equals the host path, one and two hops") {
  testing_support::Watchdog dog(kWatchdogSeconds, "rotated reduce-scatter");
  const q::Rotation a{7, 42}, b{5, 9}, off{};
  q::ReduceScatterOptions same, differ, second, first;
  same.hop1.rotation = a;
  same.hop2.rotation = a;
  differ.hop1.rotation = a;
  differ.hop2.rotation = b;
  differ.hop2.rounding = q::Rounding::stochastic;
  differ.hop2.seed = 5;
  second.hop1.rotation = off;
  second.hop2.rotation = b;
  first.hop1.rotation = q::Rotation{4, 1};
  first.hop2.rotation = off;
  using I8 = q::Int8<128>;
  using I4 = q::Int4<128>;
  for (std::size_t numel : {std::size_t{3001}, std::size_t{200}}) {
    rotated_reduce_scatter<float, I4, I4>(kOneNode3, numel, q::Hops::one, q::Reduce::mean, same);
    rotated_reduce_scatter<q::bfloat16, I8, I4>(kTwoByTwo, numel, q::Hops::two, q::Reduce::sum, same);
    rotated_reduce_scatter<q::bfloat16, I8, I4>(kTwoByTwo, numel, q::Hops::two, q::Reduce::mean, differ);
    rotated_reduce_scatter<float, I4, I4>(kRoundRobin6, numel, q::Hops::two, q::Reduce::sum, second);
    rotated_reduce_scatter<float, I4, I4>(kRoundRobin6, numel, q::Hops::two, q::Reduce::mean, first);
  }
}

TEST_CASE("the device rotation's inverse restores its input within 2 k n 2^-24 max|x|") {
  // Through the all-gather with the Identity<float> format (no quantization): the output is
  // inverse(forward(x)) computed by the device kernels.
  testing_support::Watchdog dog(kWatchdogSeconds, "rotation inverse");
  using F = q::Identity<float, 8192>;
  for (unsigned k : {1u, 5u, 12u, 13u}) {
    q::HopOptions h;
    h.rotation = q::Rotation{k, 1234 + k};
    const q::ShardLayout layout(10000, 2, q::granule_for(4, {F::block}));
    const auto in = shard_inputs<float>(k, 1, layout);
    const auto make = [&](auto& t, const q::Topology&) {
      using Tr = std::decay_t<decltype(t)>;
      return q::QuantizedAllGather<float, F, Tr>(t, layout, h);
    };
    const Outcome dev = run_device<false, float>({0, 0}, layout.padded_numel(), in, make,
                                                 q::FeedbackOptions{}, NoCorruption{});
    const std::vector<float> x = harness::make_input<float>(k, 0, layout.padded_numel(), layout.numel());
    const std::vector<float> y = from_bytes<float>(dev.out[0][0]);
    REQUIRE(y.size() == x.size());
    const double n = static_cast<double>(h.rotation.span());
    int bad = 0, changed = 0;
    for (std::size_t s = 0; s < layout.numel(); s += h.rotation.span()) {
      double mx = 0;
      for (std::size_t i = s; i < s + h.rotation.span() && i < layout.numel(); ++i)
        mx = std::max(mx, std::fabs(static_cast<double>(x[i])));
      const double bound = 2.0 * k * n * std::ldexp(1.0, -24) * mx;
      for (std::size_t i = s; i < s + h.rotation.span() && i < layout.numel(); ++i) {
        bad += std::fabs(static_cast<double>(y[i]) - x[i]) > bound;
        changed += y[i] != x[i];
      }
    }
    for (std::size_t i = layout.numel(); i < y.size(); ++i) bad += y[i] != 0.0f;  // padding stays 0
    CHECK_MESSAGE(bad == 0, "span 2^" << k << ": " << bad << " elements outside the bound");
    if (k >= 5)
      CHECK_MESSAGE(changed > 0, "span 2^" << k << ": the round trip rounded nothing (no rotation?)");
  }
}

// ---------------------------------------------------------------------------------------------
// Error feedback
// ---------------------------------------------------------------------------------------------

template <class T, class F1, class F2>
void feedback_reduce_scatter(const std::vector<long long>& ids, std::size_t numel, q::Hops hops, q::Reduce op,
                             const q::ReduceScatterOptions& opts, const q::FeedbackOptions& fb,
                             const std::string& what) {
  const int W = static_cast<int>(ids.size());
  const q::ShardLayout layout(numel, W, q::granule_for(sizeof(T), {F1::block, F2::block}));
  const auto in = inputs<T>(numel + 23, 3, W, layout.padded_numel(), numel);
  const auto make = [&](auto& t, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedReduceScatter<T, F1, F2, Tr>(t, topo, layout, op, hops, opts);
  };
  const Outcome host = run_host<true, T>(ids, layout.shard_numel(), in, make, fb);
  const Outcome dev = run_device<true, T>(ids, layout.shard_numel(), in, make, fb, NoCorruption{});
  compare(dev, host,
          "QuantizedReduceScatter with feedback (" + what + "), " + ids_text(ids) + ", numel " +
              std::to_string(numel) + (hops == q::Hops::one ? ", one hop" : ", two hops"));
}

TEST_CASE("error feedback over cuda_local equals the host path: outputs and states, three steps") {
  testing_support::Watchdog dog(kWatchdogSeconds, "feedback");
  using I4 = q::Int4<32>;
  using I8 = q::Int8<64>;
  const q::ReduceScatterOptions plain;
  q::ReduceScatterOptions rotated;
  rotated.hop1.rotation = q::Rotation{5, 3};
  rotated.hop2.rotation = q::Rotation{4, 8};
  q::FeedbackOptions f32;
  q::FeedbackOptions bf16;
  bf16.storage = q::ResidualStorage::bf16;
  bf16.decay = 0.5f;
  q::FeedbackOptions hop2_only;
  hop2_only.hop1 = false;
  for (std::size_t numel : {std::size_t{1500}, std::size_t{150}}) {
    feedback_reduce_scatter<float, I4, I4>(kOneNode3, numel, q::Hops::one, q::Reduce::sum, plain, f32, "f32");
    feedback_reduce_scatter<float, I4, I4>(kTwoByTwo, numel, q::Hops::two, q::Reduce::mean, plain, f32,
                                           "f32");
    feedback_reduce_scatter<q::bfloat16, I8, I4>(kRoundRobin6, numel, q::Hops::two, q::Reduce::sum, plain,
                                                 bf16, "bf16, decay 0.5");
    feedback_reduce_scatter<float, I4, I4>(kTwoByTwo, numel, q::Hops::two, q::Reduce::sum, plain, hop2_only,
                                           "hop 2 only");
    feedback_reduce_scatter<q::bfloat16, I8, I4>(kTwoByTwo, numel, q::Hops::two, q::Reduce::mean, rotated,
                                                 f32, "rotated");
    feedback_reduce_scatter<float, I4, I4>(kOneNode3, numel, q::Hops::one, q::Reduce::mean, rotated, bf16,
                                           "rotated, bf16");
  }
}

TEST_CASE("rotation and feedback captured in a CUDA graph replay as the host path's calls") {
  testing_support::Watchdog dog(kWatchdogSeconds, "graphs");
  using I4 = q::Int4<32>;
  using I8 = q::Int8<64>;
  const std::size_t numel = 1100;
  q::ReduceScatterOptions opts;
  opts.hop1.rotation = q::Rotation{5, 21};
  opts.hop2.rotation = q::Rotation{3, 22};
  opts.hop2.rounding = q::Rounding::stochastic;
  const q::ShardLayout layout(numel, 4, q::granule_for(2, {I8::block, I4::block}));
  const auto in = inputs<q::bfloat16>(61, 3, 4, layout.padded_numel(), numel);
  const auto make = [&](auto& t, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedReduceScatter<q::bfloat16, I8, I4, Tr>(t, topo, layout, q::Reduce::mean, q::Hops::two,
                                                              opts);
  };
  q::FeedbackOptions fb;
  fb.storage = q::ResidualStorage::bf16;
  const Outcome host = run_host<true, q::bfloat16>(kTwoByTwo, layout.shard_numel(), in, make, fb);
  const Outcome dev =
      run_device<true, q::bfloat16>(kTwoByTwo, layout.shard_numel(), in, make, fb, NoCorruption{}, true);
  compare(dev, host, "QuantizedReduceScatter with rotations and feedback, replayed from a CUDA graph");
  // The replays carried the state: the last step's output differs from the first's.
  CHECK(!difference(dev.out[0].back(), dev.out[0].front()).empty());

  q::HopOptions h;
  h.rotation = q::Rotation{6, 4};
  const auto ag_in = shard_inputs<float>(9, 3, layout);
  const auto make_ag = [&](auto& t, const q::Topology&) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedAllGather<float, q::Int8<64>, Tr>(t, layout, h);
  };
  const q::FeedbackOptions none;
  compare(
      run_device<false, float>(kTwoByTwo, layout.padded_numel(), ag_in, make_ag, none, NoCorruption{}, true),
      run_host<false, float>(kTwoByTwo, layout.padded_numel(), ag_in, make_ag, none),
      "rotated QuantizedAllGather, replayed from a CUDA graph");
}

TEST_CASE("error feedback through QuantizedAllReduce over cuda_local equals the host path") {
  testing_support::Watchdog dog(kWatchdogSeconds, "all-reduce feedback");
  using I4 = q::Int4<32>;
  using I8 = q::Int8<64>;
  const std::size_t numel = 1200;
  const q::ShardLayout layout(numel, 4, q::granule_for(4, {I4::block, I8::block}));
  const auto in = inputs<float>(99, 3, 4, layout.padded_numel(), numel);
  const auto make = [&](auto& t, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedAllReduce<float, I4, I4, I8, Tr>(t, topo, layout, q::Reduce::mean, q::Hops::two);
  };
  const q::FeedbackOptions fb;
  const Outcome host = run_host<true, float>(kTwoByTwo, layout.padded_numel(), in, make, fb);
  const Outcome dev = run_device<true, float>(kTwoByTwo, layout.padded_numel(), in, make, fb, NoCorruption{});
  compare(dev, host, "QuantizedAllReduce with feedback");

  // A rotation in every stage, with feedback.
  q::ReduceScatterOptions opts;
  opts.hop1.rotation = q::Rotation{5, 1};
  opts.hop2.rotation = q::Rotation{4, 2};
  q::HopOptions gather;
  gather.rotation = q::Rotation{6, 3};
  const auto make_rotated = [&](auto& t, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedAllReduce<float, I4, I4, I8, Tr>(t, topo, layout, q::Reduce::sum, q::Hops::two, opts,
                                                        gather);
  };
  compare(run_device<true, float>(kTwoByTwo, layout.padded_numel(), in, make_rotated, fb, NoCorruption{}),
          run_host<true, float>(kTwoByTwo, layout.padded_numel(), in, make_rotated, fb),
          "QuantizedAllReduce with rotations in every stage and feedback");
}

TEST_CASE("error feedback on the device: delivered sums plus the residuals equal the true sums") {
  // One hop, fp32 states, decay 1: exactly, sum_t out = sum_t sum_s x_s - sum_s e_s,T (the states
  // start at 0). Each step rounds v = x + e (<= u|v|), e' = v - c (<= u|e'|) and the sum of W
  // decoded values c (<= W u sum|c|), |c| <= |v| + |e'|; a factor 1.01 covers second order.
  testing_support::Watchdog dog(kWatchdogSeconds, "feedback identity");
  using F = q::Int4<32>;
  const int W = 3, T = 12;
  const std::vector<long long> ids = kOneNode3;
  const q::ShardLayout layout(700, W, q::granule_for(4, {F::block}));
  const std::size_t P = layout.padded_numel(), S = layout.shard_numel();
  const auto in = inputs<float>(5, T, W, P, layout.numel());
  const auto make = [&](auto& t, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedReduceScatter<float, F, F, Tr>(t, topo, layout, q::Reduce::sum, q::Hops::one);
  };
  const Outcome dev = run_device<true, float>(ids, S, in, make, q::FeedbackOptions{}, NoCorruption{});
  // res[t][s]: rank s's hop-1 residual after t steps (fp32, after the 64-byte header).
  std::vector<std::vector<std::vector<float>>> res(T + 1);
  res[0].assign(W, std::vector<float>(P, 0.0f));
  for (int t = 1; t <= T; ++t)
    for (int s = 0; s < W; ++s) {
      const Bytes& b = dev.states[static_cast<std::size_t>(s)][static_cast<std::size_t>(t - 1)];
      REQUIRE(b.size() >= 64 + 4 * P);
      res[static_cast<std::size_t>(t)].push_back(
          from_bytes<float>(Bytes(b.begin() + 64, b.begin() + 64 + 4 * P)));
    }
  std::vector<std::vector<std::vector<float>>> out(W);
  for (int me = 0; me < W; ++me)
    for (const Bytes& b : dev.out[static_cast<std::size_t>(me)])
      out[static_cast<std::size_t>(me)].push_back(from_bytes<float>(b));
  int bad = 0, checked = 0;
  double worst = 0;
  for (int me = 0; me < W; ++me) {
    for (std::size_t i = 0; i < layout.valid_in_shard(me); ++i) {
      const std::size_t gi = layout.shard_offset(me) + i;
      double delivered = 0, truth = 0, slack = 0;
      for (int t = 0; t < T; ++t) {
        delivered += out[static_cast<std::size_t>(me)][static_cast<std::size_t>(t)][i];
        double b = 0, sum_c = 0;
        for (int s = 0; s < W; ++s) {
          const auto ts = static_cast<std::size_t>(t), ss = static_cast<std::size_t>(s);
          const double x = in[ts][ss][gi];
          const double ep = std::fabs(res[ts][ss][gi]), en = std::fabs(res[ts + 1][ss][gi]);
          const double v = std::fabs(x) + ep;
          b += v + en;
          sum_c += v + en;
          truth += x;
        }
        slack += 1.01 * std::ldexp(1.0, -24) * (b + W * sum_c);
      }
      double carried = 0;
      for (int s = 0; s < W; ++s) carried += res[T][static_cast<std::size_t>(s)][gi];
      const double gap = std::fabs(delivered - (truth - carried));
      worst = std::max(worst, gap / slack);
      bad += gap > slack;
      ++checked;
    }
  }
  CHECK(checked > 0);
  CHECK_MESSAGE(bad == 0, bad << " elements outside the bound; worst gap " << worst << " x its bound");
}

TEST_CASE("a bad residual state on one rank: no output or state is written anywhere") {
  testing_support::Watchdog dog(kWatchdogSeconds, "bad residual");
  using F = q::Int4<32>;
  const std::vector<long long> ids = kTwoByTwo;
  const q::ShardLayout layout(900, 4, q::granule_for(4, {F::block}));
  const auto in = inputs<float>(3, 1, 4, layout.padded_numel(), layout.numel());
  // Every rank builds the plan it calls and a plan with another op; rank 1's state is zeroed
  // (never initialised, mode 0) or initialised by the other plan (mode 1).
  struct Pair {
    using RS = q::QuantizedReduceScatter<float, F, F, q::CudaLocalTransport>;
    RS used, other;
    int mode, rank;
    std::size_t workspace_bytes() const { return used.workspace_bytes(); }
    std::size_t residual_bytes(const q::FeedbackOptions& fb) const { return used.residual_bytes(fb); }
    void init_residual(void* p, std::size_t n, const q::FeedbackOptions& fb, cudaStream_t s) const {
      (mode == 1 && rank == 1 ? other : used).init_residual(p, n, fb, s);
      if (mode == 0 && rank == 1) QCOLL_CUDA_CHECK(cudaMemsetAsync(p, 0, n, s));
    }
    void operator()(const float* g, float* o, void* w, std::size_t b, q::ResidualState r, cudaStream_t s) {
      used(g, o, w, b, r, s);
    }
  };
  for (int mode = 0; mode < 2; ++mode) {
    const auto make = [&](q::CudaLocalTransport& t, const q::Topology& topo) {
      return Pair{{t, topo, layout, q::Reduce::sum, q::Hops::two},
                  {t, topo, layout, q::Reduce::mean, q::Hops::two},
                  mode,
                  t.rank()};
    };
    std::vector<Bytes> fresh(4);
    const auto keep = [&](int r, Pair&, q::ResidualState rs, cudaStream_t s) {
      fresh[static_cast<std::size_t>(r)] = download(rs.data, rs.bytes, s);
      return rs;
    };
    const Outcome dev =
        run_device<true, float>(ids, layout.shard_numel(), in, make, q::FeedbackOptions{}, keep);
    const std::string what = mode == 0 ? "a state never initialised" : "a state of another plan";
    for (int r = 0; r < 4; ++r) {
      const auto ri = static_cast<std::size_t>(r);
      const std::uint32_t want = q::kResultRejected | (r == 1 ? q::kResultBadResidual : 0u);
      CHECK_MESSAGE((dev.flags[ri][0] & (q::kResultRejected | q::kResultBadResidual)) == want,
                    what << ", rank " << r << ": flags " << dev.flags[ri][0]);
      CHECK_MESSAGE(dev.out[ri][0] == Bytes(dev.out[ri][0].size(), 0x7B),
                    what << ", rank " << r << ": output written");
      CHECK_MESSAGE(difference(dev.state[ri], fresh[ri]).empty(),
                    what << ", rank " << r << ": state written");
    }
  }
}

TEST_CASE("a null residual state on one rank: it throws naming it, its peers get kResultRejected") {
  testing_support::Watchdog dog(kWatchdogSeconds, "null residual");
  using F = q::Int4<32>;
  const std::vector<long long> ids = kOneNode3;
  const q::ShardLayout layout(500, 3, q::granule_for(4, {F::block}));
  const auto in = inputs<float>(8, 1, 3, layout.padded_numel(), layout.numel());
  std::vector<std::string> errors(3);
  std::vector<std::uint32_t> flags(3);
  q::CudaLocalGroup g(3, ids);
  g.run([&](q::CudaLocalTransport& t) {
    const int r = t.rank();
    const auto ri = static_cast<std::size_t>(r);
    const cudaStream_t s = t.stream();
    q::QuantizedReduceScatter<float, F, F, q::CudaLocalTransport> rs(t, q::Topology::from_node_ids(ids, r),
                                                                     layout, q::Reduce::sum, q::Hops::one);
    DeviceBytes ws(rs.workspace_bytes()), din(layout.padded_numel() * 4), dout(layout.shard_numel() * 4),
        state(rs.residual_bytes());
    rs.init_residual(state.as(), state.size(), q::FeedbackOptions{}, s);
    QCOLL_CUDA_CHECK(cudaMemcpyAsync(din.as(), in[0][ri].data(), din.size(), cudaMemcpyHostToDevice, s));
    t.barrier();
    const q::ResidualState st{r == 2 ? nullptr : state.as(), state.size()};
    try {
      rs(din.as<float>(), dout.as<float>(), ws.as(), ws.size(), st, s);
    } catch (const q::Error& e) {
      errors[ri] = e.what();
    }
    flags[ri] = q::gpu::read_result_flags(ws.as(), s);
    t.barrier();
  });
  CHECK_MESSAGE(errors[2].find("residual") != std::string::npos, "rank 2: " << errors[2]);
  for (int r = 0; r < 2; ++r) {
    CHECK_MESSAGE(errors[static_cast<std::size_t>(r)].empty(), errors[static_cast<std::size_t>(r)]);
    CHECK((flags[static_cast<std::size_t>(r)] & q::kResultRejected) != 0);
  }
}

// ---------------------------------------------------------------------------------------------
// Weight-difference all-gather (qWD)
// ---------------------------------------------------------------------------------------------

//! Every rank's replica (bytes) after each call: a resync in Identity<T>, then `steps` difference
//! calls with weights drifting by small updates; all ranks hold the same weights (their own shard
//! is what they send). With `nan_at` (a tensor group's padding), those weights are NaN.
template <class T, class F, class Tr>
std::vector<std::vector<Bytes>> delta_run(const std::vector<long long>& ids, const q::ShardLayout& layout,
                                          const q::host::QuantizeOptions& opt, int steps,
                                          std::vector<std::vector<std::uint32_t>>& flags,
                                          const std::vector<char>* nan_at = nullptr) {
  using G = q::Identity<T, F::block>;
  const int W = static_cast<int>(ids.size());
  const std::size_t P = layout.padded_numel(), S = layout.shard_numel();
  std::vector<std::vector<T>> weights;  // weights[k]: the full weights before call k
  for (int k = 0; k <= steps; ++k) {
    std::vector<T> w(P);
    for (std::size_t i = 0; i < P; ++i)
      w[i] = q::from_float<T>(nan_at != nullptr && (*nan_at)[i]
                                  ? std::numeric_limits<float>::quiet_NaN()
                                  : harness::input_value(3, 0, i) +
                                        0.01f * static_cast<float>(k) * harness::input_value(4 + k, 1, i));
    weights.push_back(w);
  }
  std::vector<std::vector<Bytes>> replicas(static_cast<std::size_t>(W));
  flags.assign(static_cast<std::size_t>(W), {});
  if constexpr (Tr::memory_space == q::MemorySpace::host) {
    q::LocalGroup g(W, ids);
    g.run([&](q::LocalTransport& t) {
      const auto ri = static_cast<std::size_t>(t.rank());
      q::DeltaAllGather<T, F, q::LocalTransport> qwd(t, layout, opt);
      harness::Workspace ws(std::max(qwd.workspace_bytes(), qwd.template resync_workspace_bytes<G>()));
      std::vector<T> replica(P, q::from_float<T>(0.0f));
      for (int k = 0; k <= steps; ++k) {
        const T* mine = weights[static_cast<std::size_t>(k)].data() + layout.shard_offset(t.rank());
        flags[ri].push_back(k == 0 ? qwd.template resync<G>(mine, replica.data(), ws.ptr, ws.bytes)
                                   : qwd(mine, replica.data(), ws.ptr, ws.bytes));
        replicas[ri].push_back(bytes_of(replica));
      }
    });
  } else {
    q::CudaLocalGroup g(W, ids);
    g.run([&](q::CudaLocalTransport& t) {
      const auto ri = static_cast<std::size_t>(t.rank());
      const cudaStream_t s = t.stream();
      q::DeltaAllGather<T, F, q::CudaLocalTransport> qwd(t, layout, opt);
      const std::size_t wb = std::max(qwd.workspace_bytes(), qwd.template resync_workspace_bytes<G>());
      DeviceBytes ws(wb), replica(P * sizeof(T)), shard(S * sizeof(T));
      QCOLL_CUDA_CHECK(cudaMemsetAsync(replica.as(), 0, P * sizeof(T), s));
      t.barrier();
      for (int k = 0; k <= steps; ++k) {
        const T* mine = weights[static_cast<std::size_t>(k)].data() + layout.shard_offset(t.rank());
        QCOLL_CUDA_CHECK(cudaMemcpyAsync(shard.as(), mine, S * sizeof(T), cudaMemcpyHostToDevice, s));
        if (k == 0) {
          qwd.template resync<G>(shard.as<T>(), replica.as<T>(), ws.as(), wb, s);
        } else {
          qwd(shard.as<T>(), replica.as<T>(), ws.as(), wb, s);
        }
        flags[ri].push_back(q::gpu::read_result_flags(ws.as(), s));
        replicas[ri].push_back(download(replica.as(), P * sizeof(T), s));
      }
      t.barrier();
    });
  }
  return replicas;
}

template <class T, class F>
void delta_case(const std::vector<long long>& ids, std::size_t numel, const q::host::QuantizeOptions& opt) {
  const int W = static_cast<int>(ids.size()), steps = 3;
  const q::ShardLayout layout(numel, W, q::granule_for(sizeof(T), {F::block}));
  std::vector<std::vector<std::uint32_t>> hf, df;
  const auto host = delta_run<T, F, q::LocalTransport>(ids, layout, opt, steps, hf);
  const auto dev = delta_run<T, F, q::CudaLocalTransport>(ids, layout, opt, steps, df);
  const std::string label = "DeltaAllGather<" + std::string(q::format_name(F::id)) + ">, " + ids_text(ids) +
                            ", numel " + std::to_string(numel);
  for (std::size_t r = 0; r < host.size(); ++r)
    for (std::size_t k = 0; k < host[r].size(); ++k) {
      const std::string d = difference(dev[r][k], host[r][k]);
      CHECK_MESSAGE(d.empty(),
                    label << ", rank " << r << ", call " << k << ": device replica differs: " << d);
      CHECK_MESSAGE(df[r][k] == hf[r][k],
                    label << ", rank " << r << ", call " << k << ": flags " << df[r][k]);
      CHECK_MESSAGE(difference(dev[r][k], dev[0][k]).empty(), label << ": replicas differ between ranks");
    }
  // The differences moved the replica: the last call's replica is not the resync's.
  CHECK(!difference(host[0].back(), host[0].front()).empty());
}

TEST_CASE("DeltaAllGather (qWD) over cuda_local equals the host path: resync, then differences") {
  testing_support::Watchdog dog(kWatchdogSeconds, "qWD");
  q::host::QuantizeOptions nearest, stochastic;
  stochastic.rounding = q::Rounding::stochastic;
  stochastic.seed = 31;
  for (std::size_t numel : {std::size_t{2000}, std::size_t{150}}) {
    delta_case<q::bfloat16, q::Int4<128>>(kTwoByTwo, numel, nearest);
    delta_case<float, q::Int4Asym<32>>(kOneNode3, numel, stochastic);
    delta_case<q::half, q::Fp8E4M3<32>>(kRoundRobin6, numel, nearest);
  }
}

TEST_CASE(
    "a pageable buffer on one rank of a rotated all-gather or a qWD call: it throws, its peers write "
    "nothing") {
  testing_support::Watchdog dog(kWatchdogSeconds, "bad arguments");
  using F = q::Int8<64>;
  const std::vector<long long> ids = kTwoByTwo;
  const q::ShardLayout layout(1000, 4, q::granule_for(4, {F::block}));
  const std::size_t P = layout.padded_numel(), S = layout.shard_numel();
  q::HopOptions h;
  h.rotation = q::Rotation{6, 8};
  for (int plan_kind = 0; plan_kind < 2; ++plan_kind) {
    const char* argument = plan_kind == 0 ? "full" : "replica";
    std::vector<std::string> errors(4);
    std::vector<std::uint32_t> flags(4);
    std::vector<Bytes> outs(4);
    q::CudaLocalGroup g(4, ids);
    g.run([&](q::CudaLocalTransport& t) {
      const int r = t.rank();
      const auto ri = static_cast<std::size_t>(r);
      const cudaStream_t s = t.stream();
      q::QuantizedAllGather<float, F, q::CudaLocalTransport> ag(t, layout, h);
      q::DeltaAllGather<float, F, q::CudaLocalTransport> qwd(t, layout);
      const std::size_t wb = std::max(ag.workspace_bytes(), qwd.workspace_bytes());
      DeviceBytes ws(wb), shard(S * 4), out(P * 4);
      std::vector<float> pageable(P, 0.0f);
      const std::vector<float> x = harness::make_input<float>(2, r, S, S);
      QCOLL_CUDA_CHECK(cudaMemcpyAsync(shard.as(), x.data(), S * 4, cudaMemcpyHostToDevice, s));
      QCOLL_CUDA_CHECK(cudaMemsetAsync(out.as(), 0x7B, P * 4, s));
      QCOLL_CUDA_CHECK(cudaStreamSynchronize(s));
      t.barrier();
      float* dst = r == 1 ? pageable.data() : out.as<float>();
      try {
        if (plan_kind == 0) {
          ag(shard.as<float>(), dst, ws.as(), wb, s);
        } else {
          qwd(shard.as<float>(), dst, ws.as(), wb, s);
        }
      } catch (const q::Error& e) {
        errors[ri] = e.what();
      }
      flags[ri] = q::gpu::read_result_flags(ws.as(), s);
      outs[ri] = download(out.as(), P * 4, s);
      t.barrier();
    });
    for (std::size_t r = 0; r < 4; ++r) {
      const std::string where =
          std::string(plan_kind == 0 ? "rotated all-gather" : "qWD") + ", rank " + std::to_string(r) + ": ";
      if (r == 1) {
        CHECK_MESSAGE(errors[r].find(std::string("'") + argument + "'") != std::string::npos,
                      where << "expected an error naming '" << argument << "', got: " << errors[r]);
      } else {
        CHECK_MESSAGE(errors[r].empty(), where << errors[r]);
      }
      CHECK_MESSAGE((flags[r] & q::kResultRejected) != 0, where << "flags " << flags[r]);
      CHECK_MESSAGE(outs[r] == Bytes(P * 4, 0x7B), where << "the rejected call wrote the output");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor groups
// ---------------------------------------------------------------------------------------------

//! A random group's tensor sizes: 4..8 tensors of 0..12 elements, at least one empty, and one
//! neighbour 1000..12000 times larger.
std::vector<std::size_t> group_sizes(std::uint64_t seed) {
  std::mt19937_64 g(seed);
  const std::size_t count = 4 + g() % 5;
  std::vector<std::size_t> n(count);
  for (auto& x : n) x = g() % 4 == 0 ? 0 : 1 + g() % 12;
  const std::size_t big = g() % count;
  n[big] = 1000 * (1 + g() % 12);
  n[(big + 1 + g() % (count - 1)) % count] = 0;
  return n;
}

//! 1 at the group's data positions, 0 at its padding (inside the group and past its end).
std::vector<char> group_data(const q::TensorGroup& grp) {
  std::vector<char> d(grp.padded_numel(), 0);
  for (std::size_t k = 0; k < grp.size(); ++k)
    for (std::size_t i = 0; i < grp.numel(k); ++i) d[grp.offset(k) + i] = 1;
  return d;
}

//! A group's full buffer for rank r: input values at data positions, NaN in all padding.
template <class T>
std::vector<T> group_full(const q::TensorGroup& grp, std::uint64_t seed, int r) {
  const std::vector<char> d = group_data(grp);
  std::vector<T> v(grp.padded_numel());
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] =
        q::from_float<T>(d[i] ? harness::input_value(seed, r, i) : std::numeric_limits<float>::quiet_NaN());
  return v;
}

//! in[step][rank]: every rank's full buffer (reduce-scatter, all-reduce, hpZ).
template <class T>
std::vector<std::vector<std::vector<T>>> group_inputs(const q::TensorGroup& grp, std::uint64_t seed,
                                                      int steps) {
  std::vector<std::vector<std::vector<T>>> in(static_cast<std::size_t>(steps));
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < grp.parts(); ++r)
      in[static_cast<std::size_t>(k)].push_back(group_full<T>(grp, seed + 17 * k, r));
  return in;
}

//! in[step][rank]: rank r's shard of one full buffer (all-gather).
template <class T>
std::vector<std::vector<std::vector<T>>> group_shards(const q::TensorGroup& grp, std::uint64_t seed,
                                                      int steps) {
  std::vector<std::vector<std::vector<T>>> in(static_cast<std::size_t>(steps));
  for (int k = 0; k < steps; ++k) {
    const std::vector<T> x = group_full<T>(grp, seed + 17 * k, 0);
    for (int r = 0; r < grp.parts(); ++r)
      in[static_cast<std::size_t>(k)].emplace_back(
          x.begin() + static_cast<std::ptrdiff_t>(grp.layout().shard_offset(r)),
          x.begin() + static_cast<std::ptrdiff_t>(grp.layout().shard_offset(r) + grp.shard_numel()));
  }
  return in;
}

//! Device == host (compare), no non-finite flag (the NaN is all in the padding), and +0 at every
//! padding position of every output; `shards`: outputs are rank r's shard, else the full buffer.
template <class T>
void compare_group(const Outcome& dev, const Outcome& host, const q::TensorGroup& grp, bool shards,
                   const std::string& label) {
  compare(dev, host, label);
  const std::vector<char> d = group_data(grp);
  for (std::size_t r = 0; r < dev.out.size(); ++r)
    for (std::size_t k = 0; k < dev.out[r].size(); ++k) {
      CHECK_MESSAGE(dev.flags[r][k] == 0, label << ", rank " << r << ": flags " << dev.flags[r][k]);
      const std::vector<T> v = from_bytes<T>(dev.out[r][k]);
      const std::size_t first = shards ? grp.layout().shard_offset(static_cast<int>(r)) : 0;
      std::size_t bad = 0, data = 0;
      for (std::size_t i = 0; i < v.size(); ++i) {
        static const unsigned char zero[sizeof(T)] = {};
        if (!d[first + i]) bad += std::memcmp(&v[i], zero, sizeof(T)) != 0;
        data += d[first + i];
      }
      CHECK_MESSAGE(bad == 0, label << ", rank " << r << ": " << bad << " padding outputs are not +0");
      if (!shards) CHECK(data > 0);
    }
}

std::string group_text(const q::TensorGroup& grp) {
  std::string s = "group {";
  for (std::size_t k = 0; k < grp.size(); ++k) s += std::to_string(grp.numel(k)) + ",";
  return s + "}";
}

template <class T, class F>
void group_all_gather(const std::vector<long long>& ids, std::uint64_t seed, const q::HopOptions& hop) {
  const int W = static_cast<int>(ids.size());
  const q::TensorGroup grp(group_sizes(seed), W, q::granule_for(sizeof(T), {F::block}));
  const q::ShardLayout& layout = grp;
  REQUIRE(layout.grouped());
  const auto in = group_shards<T>(grp, seed, 1);
  const auto make = [&](auto& t, const q::Topology&) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedAllGather<T, F, Tr>(t, layout, hop);
  };
  const q::FeedbackOptions none;
  compare_group<T>(run_device<false, T>(ids, layout.padded_numel(), in, make, none, NoCorruption{}),
                   run_host<false, T>(ids, layout.padded_numel(), in, make, none), grp, false,
                   "grouped QuantizedAllGather<" + std::string(q::format_name(F::id)) + ">, " +
                       group_text(grp) + ", span " + std::to_string(hop.rotation.span()));
}

TEST_CASE("grouped QuantizedAllGather over cuda_local equals the host path: int8, int4 asym, e4m3, MXFP4") {
  testing_support::Watchdog dog(kWatchdogSeconds, "grouped all-gather");
  const q::HopOptions plain;
  group_all_gather<float, q::Int8<32>>(kTwoByTwo, 1, plain);
  group_all_gather<q::bfloat16, q::Int4Asym<64>>(kOneNode3, 2, plain);
  group_all_gather<q::half, q::Fp8E4M3<32>>(kTwoByTwo, 3, plain);
  group_all_gather<float, q::MxFp4>(kOneNode3, 4, plain);
  group_all_gather<q::bfloat16, q::Identity<q::bfloat16, 32>>(kTwoByTwo, 5, plain);
  q::HopOptions rot;
  rot.rotation = q::Rotation{4, 7};
  rot.rounding = q::Rounding::stochastic;
  rot.seed = 9;
  group_all_gather<float, q::Int4Asym<32>>(kTwoByTwo, 6, rot);
}

//! SecondaryShard as a plan call: capture `full`, then gather into out.
template <class T, class F, class Tr>
struct HpzCall {
  q::SecondaryShard<T, F, Tr> p;
  std::uint64_t generation = 0;
  std::size_t workspace_bytes() const { return p.workspace_bytes(); }
  auto operator()(const T* full, T* out, void* ws, std::size_t bytes, typename Tr::stream_type s = {}) {
    p.capture(full, ++generation, s);
    return p.gather(out, generation, ws, bytes, s);
  }
};

template <class T, class F>
void group_hpz(const std::vector<long long>& ids, std::uint64_t seed) {
  const int W = static_cast<int>(ids.size());
  const q::TensorGroup grp(group_sizes(seed), W, q::granule_for(sizeof(T), {F::block}));
  const q::ShardLayout& layout = grp;
  const auto in = group_inputs<T>(grp, seed, 1);
  // Every rank captures the same full buffer (rank 0's), as after a gather.
  auto same = in;
  for (auto& step : same)
    for (auto& v : step) v = step[0];
  const auto make = [&](auto& t, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(t)>;
    return HpzCall<T, F, Tr>{q::SecondaryShard<T, F, Tr>(t, topo, layout)};
  };
  const q::FeedbackOptions none;
  compare_group<T>(run_device<false, T>(ids, layout.padded_numel(), same, make, none, NoCorruption{}),
                   run_host<false, T>(ids, layout.padded_numel(), same, make, none), grp, false,
                   "grouped SecondaryShard<" + std::string(q::format_name(F::id)) + ">, " + group_text(grp));
}

TEST_CASE("grouped SecondaryShard (hpZ) over cuda_local equals the host path") {
  testing_support::Watchdog dog(kWatchdogSeconds, "grouped hpZ");
  group_hpz<q::bfloat16, q::Int8<32>>(kTwoByTwo, 11);
  group_hpz<float, q::Identity<float, 32>>(kRoundRobin6, 12);
}

template <bool Fb, class T, class F1, class F2>
void group_reduce_scatter(const std::vector<long long>& ids, std::uint64_t seed, q::Hops hops, q::Reduce op,
                          const q::ReduceScatterOptions& opts, const q::FeedbackOptions& fb,
                          const std::string& what) {
  const int W = static_cast<int>(ids.size());
  const q::TensorGroup grp(group_sizes(seed), W, q::granule_for(sizeof(T), {F1::block, F2::block}));
  const q::ShardLayout& layout = grp;
  const auto in = group_inputs<T>(grp, seed, Fb ? 2 : 1);
  const auto make = [&](auto& t, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedReduceScatter<T, F1, F2, Tr>(t, topo, layout, op, hops, opts);
  };
  compare_group<T>(run_device<Fb, T>(ids, layout.shard_numel(), in, make, fb, NoCorruption{}),
                   run_host<Fb, T>(ids, layout.shard_numel(), in, make, fb), grp, true,
                   "grouped QuantizedReduceScatter (" + what + "), " + ids_text(ids) + ", " +
                       group_text(grp) + (hops == q::Hops::one ? ", one hop" : ", two hops"));
}

TEST_CASE("grouped QuantizedReduceScatter over cuda_local equals the host path: rotation, feedback, SR") {
  testing_support::Watchdog dog(kWatchdogSeconds, "grouped reduce-scatter");
  using I8 = q::Int8<32>;
  using I4 = q::Int4<64>;
  using A4 = q::Int4Asym<32>;
  const q::ReduceScatterOptions plain;
  const q::FeedbackOptions none;
  group_reduce_scatter<false, float, I8, I8>(kOneNode3, 21, q::Hops::one, q::Reduce::sum, plain, none,
                                             "plain");
  group_reduce_scatter<false, q::bfloat16, I8, A4>(kTwoByTwo, 22, q::Hops::two, q::Reduce::mean, plain, none,
                                                   "plain");
  group_reduce_scatter<false, float, I4, q::Identity<float, 32>>(
      kRoundRobin6, 23, q::Hops::two, q::Reduce::sum, plain, none, "identity hop 2");
  q::ReduceScatterOptions sr;
  sr.hop1.rounding = sr.hop2.rounding = q::Rounding::stochastic;
  sr.hop1.seed = 3;
  sr.hop2.seed = 4;
  group_reduce_scatter<false, q::half, I8, I4>(kTwoByTwo, 24, q::Hops::two, q::Reduce::sum, sr, none,
                                               "stochastic");
  q::ReduceScatterOptions rot;
  rot.hop1.rotation = q::Rotation{5, 1};
  rot.hop2.rotation = q::Rotation{4, 2};
  group_reduce_scatter<false, float, I8, I8>(kOneNode3, 25, q::Hops::one, q::Reduce::mean, rot, none,
                                             "rotation");
  group_reduce_scatter<false, q::bfloat16, I8, A4>(kTwoByTwo, 26, q::Hops::two, q::Reduce::sum, rot, none,
                                                   "rotations");
  q::FeedbackOptions fb;
  fb.hop2 = true;
  fb.decay = 0.75f;
  group_reduce_scatter<true, float, A4, I4>(kOneNode3, 27, q::Hops::one, q::Reduce::sum, plain, fb,
                                            "feedback");
  group_reduce_scatter<true, float, I8, A4>(kTwoByTwo, 28, q::Hops::two, q::Reduce::mean, plain, fb,
                                            "feedback, both hops");
  group_reduce_scatter<true, q::bfloat16, I8, I4>(kRoundRobin6, 29, q::Hops::two, q::Reduce::sum, rot, fb,
                                                  "feedback and rotations");
}

TEST_CASE("grouped QuantizedAllReduce over cuda_local equals the host path") {
  testing_support::Watchdog dog(kWatchdogSeconds, "grouped all-reduce");
  using I8 = q::Int8<32>;
  using A4 = q::Int4Asym<32>;
  const q::TensorGroup grp(group_sizes(31), 4, q::granule_for(4, {I8::block, A4::block}));
  const q::ShardLayout& layout = grp;
  const auto in = group_inputs<float>(grp, 31, 2);
  const auto make = [&](auto& t, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(t)>;
    return q::QuantizedAllReduce<float, I8, A4, A4, Tr>(t, topo, layout, q::Reduce::mean, q::Hops::two);
  };
  const q::FeedbackOptions fb;
  compare_group<float>(
      run_device<true, float>(kTwoByTwo, layout.padded_numel(), in, make, fb, NoCorruption{}),
      run_host<true, float>(kTwoByTwo, layout.padded_numel(), in, make, fb), grp, false,
      "grouped QuantizedAllReduce with feedback, " + group_text(grp));
}

TEST_CASE("grouped DeltaAllGather (qWD) over cuda_local equals the host path") {
  testing_support::Watchdog dog(kWatchdogSeconds, "grouped qWD");
  using F = q::Int4Asym<32>;
  const q::TensorGroup grp(group_sizes(41), 4, q::granule_for(sizeof(q::bfloat16), {F::block}));
  const std::vector<char> d = group_data(grp);
  std::vector<char> nan_at(d.size());
  for (std::size_t i = 0; i < d.size(); ++i) nan_at[i] = !d[i];
  q::host::QuantizeOptions opt;
  opt.rounding = q::Rounding::stochastic;
  opt.seed = 5;
  std::vector<std::vector<std::uint32_t>> hf, df;
  const auto host = delta_run<q::bfloat16, F, q::LocalTransport>(kTwoByTwo, grp, opt, 2, hf, &nan_at);
  const auto dev = delta_run<q::bfloat16, F, q::CudaLocalTransport>(kTwoByTwo, grp, opt, 2, df, &nan_at);
  Outcome h(4), v(4);
  for (std::size_t r = 0; r < 4; ++r) {
    h.out[r] = host[r];
    v.out[r] = dev[r];
    h.flags[r] = hf[r];
    v.flags[r] = df[r];
  }
  compare_group<q::bfloat16>(v, h, grp, false, "grouped DeltaAllGather, " + group_text(grp));
}

#if TEST_LOWBIT_NCCL
TEST_CASE(
    "nccl, one rank: a rotated all-gather and rotated reduce-scatters with feedback (one grouped) equal the "
    "host path") {
  testing_support::Watchdog dog(kWatchdogSeconds, "nccl");
  QCOLL_CUDA_CHECK(cudaSetDevice(0));
  OneRankComm comm;
  q::NcclTransport t(comm.comm);
  cudaStream_t s;
  QCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::vector<long long> ids = {0};
  using F = q::Int4<64>;
  const q::ShardLayout layout(3001, 1, q::granule_for(4, {F::block}));
  const auto in = inputs<float>(44, 3, 1, layout.padded_numel(), layout.numel());
  q::ReduceScatterOptions opts;
  opts.hop1.rotation = q::Rotation{6, 2};
  const auto make_rs = [&](auto& tr, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(tr)>;
    return q::QuantizedReduceScatter<float, F, F, Tr>(tr, topo, layout, q::Reduce::mean, q::Hops::one, opts);
  };
  const q::FeedbackOptions fb;
  NoCorruption none;
  Outcome dev(1);
  device_rank<true, float>(t, s, ids, layout.shard_numel(), in, make_rs, fb, none, false, dev);
  compare(dev, run_host<true, float>(ids, layout.shard_numel(), in, make_rs, fb),
          "nccl: rotated QuantizedReduceScatter with feedback");
  const auto make_ag = [&](auto& tr, const q::Topology&) {
    using Tr = std::decay_t<decltype(tr)>;
    return q::QuantizedAllGather<float, F, Tr>(tr, layout, opts.hop1);
  };
  const auto shards = shard_inputs<float>(45, 2, layout);
  Outcome dev_ag(1);
  device_rank<false, float>(t, s, ids, layout.padded_numel(), shards, make_ag, fb, none, false, dev_ag);
  compare(dev_ag, run_host<false, float>(ids, layout.padded_numel(), shards, make_ag, fb),
          "nccl: rotated QuantizedAllGather");
  // A group of several tensors: the plan's slot table in device memory.
  const q::TensorGroup grp(group_sizes(46), 1, q::granule_for(4, {F::block}));
  const q::ShardLayout& glayout = grp;
  const auto gin = group_inputs<float>(grp, 46, 2);
  const auto make_grs = [&](auto& tr, const q::Topology& topo) {
    using Tr = std::decay_t<decltype(tr)>;
    return q::QuantizedReduceScatter<float, F, F, Tr>(tr, topo, glayout, q::Reduce::mean, q::Hops::one, opts);
  };
  Outcome dev_g(1);
  device_rank<true, float>(t, s, ids, glayout.shard_numel(), gin, make_grs, fb, none, false, dev_g);
  compare_group<float>(dev_g, run_host<true, float>(ids, glayout.shard_numel(), gin, make_grs, fb), grp, true,
                       "nccl: grouped QuantizedReduceScatter with feedback");
  QCOLL_CUDA_CHECK(cudaStreamDestroy(s));
}
#endif

}  // namespace
