#pragma once
//! \file
//! The device data path of the collective plans: QuantizedAllGather, QuantizedReduceScatter,
//! QuantizedAllReduce, SecondaryShard and DeltaAllGather over a transport whose memory_space is
//! MemorySpace::device (CudaLocalTransport, NcclTransport). Included by those transports' headers
//! and by <qcoll/qcoll.cuh>.
//!
//! **Calls.** The plans' calls take device buffers (input, output and workspace) and a CUDA
//! stream (null: the transport's own stream where it has one). They check their arguments on the
//! host, enqueue kernels and the transport's exchanges on the stream, and return without waiting:
//! no allocation and no host synchronisation inside a call, so a call can be captured in a CUDA
//! graph (over transports that can be captured) and replayed.
//!
//! **Result flags.** A device call cannot return what its kernels find, so it writes it to the
//! first 4 bytes of its workspace (a std::uint32_t in device memory; the call clears it first):
//! kResultNonFinite (some rank's input held NaN or ±Inf, the same on every rank, as the host
//! call's return value), kResultRejected (some rank rejected its arguments) and kResultBadMessage
//! (a received message did not match the plan). With either of the last two, this rank's output
//! was not written. A call with error feedback may add kResultBadResidual (this rank's residual
//! state failed the header check; it then also sends rejected messages, so every rank sees
//! kResultRejected and no state is updated). Read the word after the stream has passed the call,
//! e.g. with read_result_flags.
//!
//! **Per-call agreement without a host synchronisation.** The host path agrees on every call
//! with a small blocking all-reduce before sending. On the device, the verdict travels with the
//! data instead: every message header carries flags (format/message.hpp). A rank whose arguments
//! are bad still takes part in every exchange of the call, sending headers marked kFlagRejected
//! in place of data, and then throws qcoll::Error naming the argument. Every sender ORs into all
//! of its messages the non-finite flag of its whole input (and, at the second hop, what it
//! received at the first), so after the last exchange every rank knows the union over all ranks.
//! A small kernel checks each received header (magic, format, block, count, flags) into the
//! result flags, and the output kernels skip their stores when a rejection or a bad message was
//! seen. So a rank's bad argument never leaves its peers waiting, and never makes them write
//! garbage. The one argument a rank cannot take part without is its workspace: an unusable
//! workspace (null, too small, misaligned, not device memory) throws before anything is enqueued.
//! Every rank of a plan needs the same workspace size, so this is normally the same on all ranks.
//!
//! **Bit-for-bit contract.** For the same inputs, options, layout and topology, outputs equal
//! the host plans' outputs over any host transport, bit for bit (for T = float, a NaN's payload
//! may differ; see cuda/quantize.cuh), and so do the non-finite flags.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../cuda/check.cuh"
#include "../cuda/lowbit.cuh"
#include "../cuda/quantize.cuh"
#include "all_gather.hpp"
#include "common.hpp"
#include "delta_all_gather.hpp"
#include "hpz.hpp"
#include "reduce_scatter.hpp"

QCOLL_NAMESPACE_BEGIN
namespace gpu {

//! Waits for `stream` and returns the result flags a device collective call wrote to `workspace`
//! (its first 4 bytes). Synchronises the stream: call it outside the hot path, or read the word
//! with your own stream-ordered copy. Throws qcoll::Error if workspace is null or not device
//! memory, or if a CUDA call fails.
inline std::uint32_t read_result_flags(const void* workspace, cudaStream_t stream) {
  const char* fn = "gpu::read_result_flags";
  QCOLL_REQUIRE(workspace != nullptr, fn, "workspace", "null", "must be", "the workspace of a device call");
  require_device_accessible(workspace, fn, "workspace");
  std::uint32_t flags = 0;
  QCOLL_CUDA_CHECK(cudaMemcpyAsync(&flags, workspace, sizeof flags, cudaMemcpyDefault, stream));
  QCOLL_CUDA_CHECK(cudaStreamSynchronize(stream));
  return flags;
}

namespace detail {

//! Writes a valid header for each of k messages of n elements of F (message i at msgs + i *
//! stride, 16-byte aligned), flagged kFlagRejected: what a rank that rejected its arguments sends.
template <class F>
__global__ void reject_kernel(unsigned char* msgs, std::size_t stride, int k, std::size_t n,
                              std::uint64_t tag) {
  MessageHeader h = make_header<F>(n, tag);
  h.flags = kFlagRejected;
  for (int i = static_cast<int>(threadIdx.x); i < k; i += static_cast<int>(blockDim.x))
    *reinterpret_cast<MessageHeader*>(msgs + static_cast<std::size_t>(i) * stride) = h;
}

//! Reads the flags word of the header at msg (16-byte aligned).
QCOLL_DEVICE std::uint32_t& header_flags(unsigned char* msg) {
  return reinterpret_cast<MessageHeader*>(msg)->flags;
}

//! One warp: ORs into the flags of each of k messages (at msgs + i * stride) the union of the k
//! messages' own flags and, if `status` is not null, the result flags gathered so far. Makes a
//! sender's non-finite flag (or rejection) ride on all its messages.
__global__ void spread_flags_kernel(unsigned char* msgs, std::size_t stride, int k,
                                    const std::uint32_t* status) {
  constexpr std::uint32_t kMask = kFlagNonFinite | kFlagRejected | kFlagBadMessage;
  std::uint32_t u = 0;
  for (int i = static_cast<int>(threadIdx.x); i < k; i += 32)
    u |= header_flags(msgs + static_cast<std::size_t>(i) * stride) & kMask;
  for (int o = 16; o > 0; o /= 2) u |= __shfl_xor_sync(0xffffffffu, u, o);
  if (status != nullptr) u |= *status & kMask;
  for (int i = static_cast<int>(threadIdx.x); i < k; i += 32)
    header_flags(msgs + static_cast<std::size_t>(i) * stride) |= u;
}

//! Checks the headers of k received messages of n elements of F: a header that is not F's with n
//! elements and the call's tag (a sender in another call: another plan, or another call number)
//! adds kFlagBadMessage; otherwise its flags (masked by `report`, plus the guard flags always) are
//! ORed into *status.
template <class F>
__global__ void verify_kernel(const unsigned char* msgs, std::size_t stride, int k, std::size_t n,
                              std::uint64_t tag, std::uint32_t* status, std::uint32_t report) {
  const MessageHeader want = make_header<F>(n, tag);
  std::uint32_t u = 0;
  for (int i = static_cast<int>(threadIdx.x); i < k; i += static_cast<int>(blockDim.x)) {
    const MessageHeader h =
        *reinterpret_cast<const MessageHeader*>(msgs + static_cast<std::size_t>(i) * stride);
    const bool ok = h.magic == want.magic && h.format == want.format && h.log2_block == want.log2_block &&
                    h.count == want.count && h.tag == want.tag;
    u |= ok ? (h.flags & (report | kGuardFlags) & (kFlagNonFinite | kGuardFlags)) : kFlagBadMessage;
  }
  if (u != 0) atomicOr(status, u);
}

//! Up to kTableChunk ints passed by value (kernel parameters are copied at launch and into graphs).
constexpr int kTableChunk = 256;
struct TableChunk {
  int v[kTableChunk];
};
__global__ void fill_table_kernel(int* dst, TableChunk chunk, int count) {
  for (int i = static_cast<int>(threadIdx.x); i < count; i += static_cast<int>(blockDim.x))
    dst[i] = chunk.v[i];
}

//! Copies a host table of ints into device memory with stream-ordered kernels (no host staging
//! buffer, no pageable memcpy, so it can be captured in a graph).
inline void upload_table(int* dst, const std::vector<int>& table, cudaStream_t stream) {
  for (std::size_t at = 0; at < table.size(); at += kTableChunk) {
    TableChunk c{};
    const std::size_t count = table.size() - at < kTableChunk ? table.size() - at : kTableChunk;
    for (std::size_t i = 0; i < count; ++i) c.v[i] = table[at + i];
    fill_table_kernel<<<1, kTableChunk, 0, stream>>>(dst + at, c, static_cast<int>(count));
    QCOLL_CUDA_CHECK_LAUNCH();
  }
}

template <class F>
void launch_reject(unsigned char* msgs, std::size_t stride, int k, std::size_t n, std::uint64_t tag,
                   cudaStream_t stream) {
  reject_kernel<F><<<1, 256, 0, stream>>>(msgs, stride, k, n, tag);
  QCOLL_CUDA_CHECK_LAUNCH();
}

inline void launch_spread(unsigned char* msgs, std::size_t stride, int k, const std::uint32_t* status,
                          cudaStream_t stream) {
  spread_flags_kernel<<<1, 32, 0, stream>>>(msgs, stride, k, status);
  QCOLL_CUDA_CHECK_LAUNCH();
}

template <class F>
void launch_verify(const unsigned char* msgs, std::size_t stride, int k, std::size_t n, std::uint64_t tag,
                   std::uint32_t* status, std::uint32_t report, cudaStream_t stream) {
  verify_kernel<F><<<1, 256, 0, stream>>>(msgs, stride, k, n, tag, status, report);
  QCOLL_CUDA_CHECK_LAUNCH();
}

//! The stream a plan's call runs on: `stream`, or the transport's own when null and it has one.
template <class Transport>
auto plan_stream(Transport& t, cudaStream_t stream, int) -> decltype(t.stream(), cudaStream_t{}) {
  return stream != nullptr ? stream : t.stream();
}
template <class Transport>
cudaStream_t plan_stream(Transport&, cudaStream_t stream, long) {
  return stream;
}

//! Checks a device plan's workspace (throws before anything is enqueued): present, large enough,
//! aligned, device memory.
inline void check_device_workspace(const char* fn, const void* ws, std::size_t ws_bytes, std::size_t need) {
  ::qcoll::detail::check_workspace(fn, ws, ws_bytes, need);
  require_device_accessible(ws, fn, "workspace");
}

//! Checks one device buffer argument of n elements of T: as ::qcoll::detail::check_buffer (not
//! null when n > 0, aligned, outside the workspace), and device memory.
template <class T>
void check_buffer(const char* fn, const char* name, const T* p, std::size_t n, const void* ws,
                  std::size_t ws_bytes) {
  ::qcoll::detail::check_buffer(fn, name, p, n, ws, ws_bytes);
  if (n > 0) require_device_accessible(p, fn, name);
}

//! The exchange of a gather plan (QuantizedAllGather, SecondaryShard::gather) on `stream`: this
//! rank's message of F from `input` (or, when !ok, a rejected header), the transport's all_gather
//! of the messages in p, the received headers checked into *status (flags masked by `report`),
//! and message q decoded into out + q * input.n, outputs at index >= limit and the padding
//! `slots` mark (out is the full buffer) zeroed; the decode is skipped if the check tripped the
//! guard.
template <class F, class Transport, class Input, class T>
void gather_exchange(Transport& t, const ::qcoll::detail::GatherPieces& p, bool ok, const Input& input,
                     const host::QuantizeOptions& opt, T* out, std::size_t limit, const SlotTable& slots,
                     std::uint32_t* status, std::uint32_t report, cudaStream_t stream) {
  const std::size_t n = input.n, P = packed_bytes<F>(n);
  if (ok) {
    launch_quantize<F>(input, p.send, opt, stream, p.control.scratch);
  } else {
    launch_reject<F>(p.send, P, 1, n, opt.tag, stream);
  }
  t.all_gather(p.send, p.recv, P, stream);
  launch_verify<F>(p.recv, P, t.size(), n, opt.tag, status, report, stream);
  launch_gather_decode<F>(p.recv, P, t.size(), n, out, limit, status, stream, slots);
}

//! The host-side checks of a device call's error-feedback state (its header lives in device
//! memory and is checked by a kernel, residual_check_kernel): present, 64-byte aligned, at least a
//! header's bytes, device memory, and [data, data + bytes) apart from grad, shard and the
//! workspace. Throws qcoll::Error naming the argument.
inline void check_residual_state(const char* fn, const ResidualState& r, const void* grad,
                                 std::size_t grad_bytes, const void* shard, std::size_t shard_bytes,
                                 const void* ws, std::size_t ws_bytes) {
  ::qcoll::detail::check_workspace(fn, r.data, r.bytes, sizeof(::qcoll::detail::ResidualHeader), "residual",
                                   "residual bytes");
  require_device_accessible(r.data, fn, "residual");
  const auto* b = static_cast<const unsigned char*>(r.data);
  const auto apart = [b, &r](const void* q, std::size_t bytes) {
    const auto* c = static_cast<const unsigned char*>(q);
    return q == nullptr || bytes == 0 || c + bytes <= b || b + r.bytes <= c;
  };
  QCOLL_REQUIRE(apart(grad, grad_bytes) && apart(shard, shard_bytes) && apart(ws, ws_bytes), fn, "residual",
                r.data, "overlaps", "grad, shard or the workspace");
}

//! Clears a plan's own result word (when it owns it) and returns the word to use.
inline std::uint32_t* begin_status(std::uint32_t* external, std::uint32_t* own, cudaStream_t stream) {
  if (external != nullptr) return external;
  QCOLL_CUDA_CHECK(cudaMemsetAsync(own, 0, sizeof(std::uint32_t), stream));
  return own;
}

}  // namespace detail
}  // namespace gpu

namespace detail {

//! Device memory for n elements of T, allocated at construction (the plan's set-up), freed at
//! destruction. Used by SecondaryShard on device transports.
template <class T>
class DeviceStorage {
 public:
  explicit DeviceStorage(std::size_t n) : n_(n) {
    if (n > 0) QCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), n * sizeof(T)));
  }
  ~DeviceStorage() {
    if (data_ != nullptr) (void)cudaFree(data_);
  }
  DeviceStorage(const DeviceStorage&) = delete;
  DeviceStorage& operator=(const DeviceStorage&) = delete;
  DeviceStorage(DeviceStorage&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceStorage& operator=(DeviceStorage&&) = delete;

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return n_; }

  //! Enqueues a copy of from[0, size()) (device memory) into the storage on `stream` (null: the
  //! transport's stream).
  template <class Transport>
  void assign_async(const T* from, Transport& t, cudaStream_t stream, const char* fn) {
    if (n_ == 0) return;
    gpu::require_device_accessible(from, fn, "full");
    QCOLL_CUDA_CHECK(cudaMemcpyAsync(data_, from, n_ * sizeof(T), cudaMemcpyDeviceToDevice,
                                     gpu::detail::plan_stream(t, stream, 0)));
  }

 private:
  T* data_ = nullptr;
  std::size_t n_ = 0;
};

// Declared and documented in common.hpp: the slot table copied to device memory, once.
template <class Transport>
DeviceSlots make_device_slots(const ShardLayout& layout) {
  DeviceSlots d;
  if constexpr (on_device<Transport>) {
    const SlotTable t = layout.slots();
    if (t.slots == 0) return d;
    void* raw = nullptr;
    QCOLL_CUDA_CHECK(cudaMalloc(&raw, 2 * t.slots * sizeof(std::size_t)));
    d.memory = std::shared_ptr<void>(raw, [](void* q) { (void)cudaFree(q); });
    auto* dev = static_cast<std::size_t*>(raw);
    QCOLL_CUDA_CHECK(cudaMemcpy(dev, t.slot_start, t.slots * sizeof(std::size_t), cudaMemcpyHostToDevice));
    QCOLL_CUDA_CHECK(
        cudaMemcpy(dev + t.slots, t.data_end, t.slots * sizeof(std::size_t), cudaMemcpyHostToDevice));
    d.table = SlotTable{dev, dev + t.slots, t.slots};
  }
  return d;
}

//! The identity source map of a run of `valid` data elements whose element 0 is global position
//! `first` of a layout with (device) slots `slots`.
inline SourceMap run_map(std::size_t valid, std::size_t first, const SlotTable& slots) {
  SourceMap m = SourceMap::identity(valid);
  m.slots = slots;
  m.slot_base = first;
  return m;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// QuantizedAllGather
// ---------------------------------------------------------------------------------------------

template <class T, class F, class Transport>
std::string QuantizedAllGather<T, F, Transport>::device_call(const T* shard, T* full, void* workspace,
                                                             std::size_t workspace_bytes,
                                                             typename Transport::stream_type stream,
                                                             std::uint32_t* status, std::uint32_t report) {
  namespace gd = gpu::detail;
  const char* fn = "QuantizedAllGather";
  const Pieces p = carve(workspace);
  gd::check_device_workspace(fn, workspace, workspace_bytes, p.bytes);
  stream = gd::plan_stream(world_, stream, 0);
  const std::size_t S = layout_.shard_numel();
  const int r = world_.rank();
  std::uint32_t* const st = gd::begin_status(status, p.control.status, stream);
  const std::string err = detail::local_check([&] {
    gd::check_buffer(fn, "shard", shard, S, workspace, workspace_bytes);
    gd::check_buffer(fn, "full", full, layout_.padded_numel(), workspace, workspace_bytes);
  });
  host::QuantizeOptions o = opt_;
  o.index_base = layout_.shard_offset(r);
  o.tag = calls_.next().hash();
  const SlotTable& slots = slots_.table;
  const std::size_t valid = layout_.valid_in_shard(r);
  const SourceMap map = detail::run_map(valid, layout_.shard_offset(r), slots);
  if (!rotation_.enabled()) {
    gd::gather_exchange<F>(world_, p, err.empty(), gd::TensorInput<T>{shard, map, S}, o, full,
                           layout_.numel(), slots, st, report, stream);
    return err;
  }
  // Rotated: the shard as floats, rotated span by span, quantized with its whole spans as data;
  // every received message decoded, rotated back and stored (as the host path, same bits).
  const std::size_t tile = gd::rotation_tile(rotation_);
  const std::size_t P = message_bytes();
  if (err.empty()) {
    gd::rotate_shard_kernel<T><<<gd::grid_for(S, tile), gd::kThreads, 0, stream>>>(
        shard, S, valid, rotation_, layout_.shard_offset(r), tile, slots, p.scratch);
    QCOLL_CUDA_CHECK_LAUNCH();
    // Block b carries its data elements rounded up to whole spans (the host's LayoutSource).
    gd::launch_quantize<F>(gd::BlockFloatInput<F::block>{p.scratch, map, S, rotation_}, p.send, o, stream,
                           p.control.scratch);
  } else {
    gd::launch_reject<F>(p.send, P, 1, S, o.tag, stream);
  }
  world_.all_gather(p.send, p.recv, P, stream);
  gd::launch_verify<F>(p.recv, P, world_.size(), S, o.tag, st, report, stream);
  if (S > 0) {
    const dim3 grid(gd::grid_for(S, tile), static_cast<unsigned>(world_.size()));
    gd::unrotate_gather_kernel<F, T>
        <<<grid, gd::kThreads, 0, stream>>>(p.recv, P, S, rotation_, tile, full, layout_.numel(), slots, st);
    QCOLL_CUDA_CHECK_LAUNCH();
  }
  return err;
}

// ---------------------------------------------------------------------------------------------
// QuantizedReduceScatter
// ---------------------------------------------------------------------------------------------

template <class T, class F1, class F2, class Transport>
std::string QuantizedReduceScatter<T, F1, F2, Transport>::device_call(
    const T* grad, T* shard, void* workspace, std::size_t workspace_bytes,
    typename Transport::stream_type stream, std::uint32_t* status, std::uint32_t report,
    const ResidualState* residual) {
  namespace gd = gpu::detail;
  const char* fn = "QuantizedReduceScatter";
  const Pieces p = carve(workspace);
  gd::check_device_workspace(fn, workspace, workspace_bytes, p.bytes);
  stream = gd::plan_stream(world_, stream, 0);
  const std::size_t S = layout_.shard_numel(), padded = layout_.padded_numel(), numel = layout_.numel();
  const int r = world_.rank();
  std::uint32_t* const st = gd::begin_status(status, p.control.status, stream);
  const std::size_t n1 = hop1_count(), P1 = hop1_message_bytes();
  const bool two = hops_ == Hops::two;
  const std::string err = detail::local_check([&] {
    check_arguments(fn, grad, shard, workspace, workspace_bytes);
    if (padded > 0) gpu::require_device_accessible(grad, fn, "grad");
    if (S > 0) gpu::require_device_accessible(shard, fn, "shard");
    if (residual != nullptr)
      gd::check_residual_state(fn, *residual, grad, padded * sizeof(T), shard, S * sizeof(T), workspace,
                               workspace_bytes);
  });
  const int k1 = hop1_messages();
  const std::uint64_t tag = calls_.next().hash();
  host::QuantizeOptions o = quantize_options(1, tag);
  const int N = topo_.num_nodes(), L = topo_.ranks_per_node(), j = topo_.local_index();
  const Rotation& r1 = hop_.hop1.rotation;
  const Rotation& r2 = two ? hop_.hop2.rotation : r1;  // the domain of the final sums
  // The residual: its header is checked on the device (the host cannot read it without a sync).
  gd::ResidualArgs res{};
  if (residual != nullptr && err.empty())
    res = gd::ResidualArgs{static_cast<unsigned char*>(residual->data), residual->bytes, calls_.id.hash(),
                           padded, two ? n1 : 0};
  const bool float1 = r1.enabled() || res.data != nullptr;  // hop 1 through floats (p.acc)
  const std::size_t tile1 = gd::rotation_tile(r1);
  // Where hop-1 message q reads the gradient (the qgZ reorder for two hops).
  const SlotTable& slots = slots_.table;
  const auto map1 = [&](int q) {
    gpu::SourceMap m = two ? gpu::SourceMap::qgz(numel, S, N, L, p.table, static_cast<std::size_t>(q) * n1)
                           : gpu::SourceMap::identity(numel, layout_.shard_offset(q));
    m.slots = slots;  // the gradient is the whole buffer: slot_base 0
    return m;
  };
  // Hop 1: quantize (the qgZ reorder fused in for two hops), or mark the messages rejected.
  if (!err.empty()) {
    gd::launch_reject<F1>(p.send1, P1, k1, n1, tag, stream);
  } else {
    if (two) gd::upload_table(p.table, rank_at_, stream);
    for (int q = 0; q < k1; ++q) {
      const gpu::SourceMap map = map1(q);
      o.index_base = map.position0;
      unsigned char* msg = p.send1 + static_cast<std::size_t>(q) * P1;
      if (!float1) {
        gd::launch_quantize<F1>(gd::TensorInput<T>{grad, map, n1}, msg, o, stream, p.control.scratch);
        continue;
      }
      gd::hop1_float_kernel<F1, T><<<gd::grid_for(n1, tile1), gd::kThreads, 0, stream>>>(
          grad, map, n1, r1, tile1, res, p.acc, false, nullptr, nullptr);
      QCOLL_CUDA_CHECK_LAUNCH();
      gd::launch_quantize<F1>(gd::BlockFloatInput<F1::block>{p.acc, map, n1, r1}, msg, o, stream,
                              p.control.scratch);
    }
    if (res.data != nullptr) {
      gd::residual_check_kernel<<<1, 1, 0, stream>>>(res, st, kResultBadResidual, p.send1, P1, k1);
      QCOLL_CUDA_CHECK_LAUNCH();
    }
  }
  gd::launch_spread(p.send1, P1, k1, nullptr, stream);
  const std::size_t valid = layout_.valid_in_shard(r);
  const gd::PostOp post{op_ == Reduce::mean ? static_cast<float>(world_.size()) : 1.0f, true};
  // The reduced shard: sums of k messages of F, rotated back when the domain is rotated.
  const auto finish = [&](auto format, const unsigned char* msgs, std::size_t stride, int k) {
    using F = decltype(format);
    if (!r2.enabled()) {
      gd::launch_reduce<F>(msgs, stride, k, S, post, shard, valid, st, stream, slots,
                           layout_.shard_offset(r));
    } else if (S > 0) {
      const std::size_t tile = gd::rotation_tile(r2);
      gd::unrotate_reduce_kernel<F, T><<<gd::grid_for(S, tile), gd::kThreads, 0, stream>>>(
          msgs, stride, k, S, rotated_count(valid, r2), r2, layout_.shard_offset(r), tile, post, shard, valid,
          slots, st);
      QCOLL_CUDA_CHECK_LAUNCH();
    }
  };
  // The hop-1 residual update, after the last exchange (skipped when the output is not written).
  const auto keep1 = [&] {
    if (res.data == nullptr) return;
    for (int q = 0; q < k1; ++q) {
      gd::hop1_float_kernel<F1, T><<<gd::grid_for(n1, tile1), gd::kThreads, 0, stream>>>(
          grad, map1(q), n1, r1, tile1, res, nullptr, true, p.send1 + static_cast<std::size_t>(q) * P1, st);
      QCOLL_CUDA_CHECK_LAUNCH();
    }
  };
  if (!two) {
    world_.all_to_all(p.send1, p.recv1, P1, stream);
    gd::launch_verify<F1>(p.recv1, P1, k1, S, tag, st, report, stream);
    finish(F1{}, p.recv1, P1, k1);
    keep1();
    return err;
  }
  intra_.all_to_all(p.send1, p.recv1, P1, stream);
  gd::launch_verify<F1>(p.recv1, P1, L, n1, tag, st, report, stream);
  // Sum the L chunks and re-quantize each node's slice of the partial sum.
  host::QuantizeOptions o2 = quantize_options(2, tag);
  const std::size_t P2 = hop2_message_bytes();
  const bool float2 = r1.enabled() || r2.enabled() || res.data != nullptr;
  // Global offset and data elements of node slices [m0, m0 + count) of the hop-1 sum.
  const auto slice_table = [&](int m0, int count) {
    gd::SliceTable t{};
    for (int i = 0; i < count; ++i) {
      const int owner = rank_at_[static_cast<std::size_t>((m0 + i) * L + j)];
      t.first[i] = layout_.shard_offset(owner);
      t.valid[i] = layout_.valid_in_shard(owner);
    }
    return t;
  };
  if (!float2) {  // plain: the sums are formed on the fly, never written out
    const bool aligned1 = gd::is_aligned16(p.recv1) && P1 % 16 == 0;
    for (int m = 0; m < N; ++m) {
      const int owner = rank_at_[static_cast<std::size_t>(m * L + j)];
      o2.index_base = layout_.shard_offset(owner);
      gd::launch_quantize<F2>(
          gd::ReduceInput<F1>{p.recv1, P1, L, n1, static_cast<std::size_t>(m) * S, S,
                              layout_.valid_in_shard(owner), gd::PostOp{}, aligned1, slots, o2.index_base},
          p.send2 + static_cast<std::size_t>(m) * P2, o2, stream, p.control.scratch);
    }
  } else {  // through floats: the sums into p.acc, moved into hop 2's domain, plus the residual
    const std::size_t tile2 = gd::rotation_tile(r1, r2);
    for (int m0 = 0; m0 < N; m0 += gd::SliceTable::kMax) {
      const int count = N - m0 < gd::SliceTable::kMax ? N - m0 : gd::SliceTable::kMax;
      const gd::SliceTable slices = slice_table(m0, count);
      if (S > 0) {
        gd::hop2_float_kernel<F1>
            <<<dim3(gd::grid_for(S, tile2), static_cast<unsigned>(count)), gd::kThreads, 0, stream>>>(
                p.recv1, P1, L, n1, S, m0, slices, r1, r2, !same_rotation(r1, r2), tile2, res, p.acc,
                F2::block, slots);
        QCOLL_CUDA_CHECK_LAUNCH();
      }
    }
    for (int m = 0; m < N; ++m) {
      const int owner = rank_at_[static_cast<std::size_t>(m * L + j)];
      o2.index_base = layout_.shard_offset(owner);
      // Block b carries its data elements rounded up to whole spans of r2 (the host's LayoutSource).
      const SourceMap map2 = detail::run_map(layout_.valid_in_shard(owner), o2.index_base, slots);
      gd::launch_quantize<F2>(
          gd::BlockFloatInput<F2::block>{p.acc + static_cast<std::size_t>(m) * S, map2, S, r2},
          p.send2 + static_cast<std::size_t>(m) * P2, o2, stream, p.control.scratch);
    }
  }
  gd::launch_spread(p.send2, P2, N, st, stream);
  inter_.all_to_all(p.send2, p.recv2, P2, stream);
  gd::launch_verify<F2>(p.recv2, P2, N, S, tag, st, report, stream);
  finish(F2{}, p.recv2, P2, N);
  keep1();
  if (res.data != nullptr && S > 0) {
    for (int m0 = 0; m0 < N; m0 += gd::SliceTable::kMax) {
      const int count = N - m0 < gd::SliceTable::kMax ? N - m0 : gd::SliceTable::kMax;
      gd::hop2_update_kernel<F2>
          <<<dim3(gd::grid_for(S, gd::kThreads), static_cast<unsigned>(count)), gd::kThreads, 0, stream>>>(
              p.send2, P2, S, slice_table(m0, count), m0, r2, res, p.acc, slots, st);
      QCOLL_CUDA_CHECK_LAUNCH();
    }
  }
  return err;
}

template <class T, class F1, class F2, class Transport>
void QuantizedReduceScatter<T, F1, F2, Transport>::device_init_residual(
    void* residual, std::size_t bytes, const detail::ResidualHeader& h,
    typename Transport::stream_type stream) const {
  const char* fn = "QuantizedReduceScatter::init_residual";
  gpu::require_device_accessible(residual, fn, "residual");
  stream = gpu::detail::plan_stream(world_, stream, 0);
  QCOLL_CUDA_CHECK(cudaMemsetAsync(residual, 0, bytes, stream));
  gpu::detail::residual_header_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned char*>(residual), h);
  QCOLL_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------------
// QuantizedAllReduce
// ---------------------------------------------------------------------------------------------

template <class T, class F1, class F2, class F3, class Transport>
void QuantizedAllReduce<T, F1, F2, F3, Transport>::device_call(const T* in, T* out, void* workspace,
                                                               std::size_t workspace_bytes,
                                                               typename Transport::stream_type stream,
                                                               const ResidualState* residual) {
  namespace gd = gpu::detail;
  const Pieces p = carve(workspace);
  gd::check_device_workspace("QuantizedAllReduce", workspace, workspace_bytes, p.bytes);
  stream = gd::plan_stream(world_, stream, 0);
  std::uint32_t* const st = gd::begin_status(nullptr, p.control.status, stream);
  // Both stages run even when this rank rejected an argument, so its peers are not left waiting;
  // the all-gather reports only rejections and bad messages (the non-finite flag is the
  // reduce-scatter's, as on the host).
  // This plan's own names come first in an error (the stages would name `grad` and `full`).
  const std::size_t padded = rs_.layout().padded_numel();
  calls_.next();  // numbered as on the host (the stages carry their own tags)
  const std::string err0 = detail::local_check([&] {
    gd::check_buffer("QuantizedAllReduce", "in", in, padded, workspace, workspace_bytes);
    gd::check_buffer("QuantizedAllReduce", "out", out, padded, workspace, workspace_bytes);
  });
  const std::string err1 = rs_.device_call(in, p.shard, p.inner, p.inner_bytes, stream, st, ~0u, residual);
  const std::string err2 = ag_.device_call(p.shard, out, p.inner, p.inner_bytes, stream, st, 0u);
  for (const std::string* e : {&err0, &err1, &err2})
    if (!e->empty()) throw Error(*e);
}

// ---------------------------------------------------------------------------------------------
// SecondaryShard
// ---------------------------------------------------------------------------------------------

template <class T, class F, class Transport>
std::string SecondaryShard<T, F, Transport>::device_gather(T* full, std::uint64_t generation, void* workspace,
                                                           std::size_t workspace_bytes,
                                                           typename Transport::stream_type stream) {
  namespace gd = gpu::detail;
  const char* fn = "SecondaryShard::gather";
  const detail::GatherPieces p = carve(workspace);
  gd::check_device_workspace(fn, workspace, workspace_bytes, p.bytes);
  stream = gd::plan_stream(intra_, stream, 0);
  const std::size_t S = secondary_.shard_numel();
  std::uint32_t* const st = gd::begin_status(nullptr, p.control.status, stream);
  const std::string err = detail::local_check([&] {
    QCOLL_REQUIRE(captured_, fn, "capture()", "never called", "before", "gather()");
    QCOLL_REQUIRE(generation == generation_, fn, "generation", generation,
                  "does not match the captured (stale secondary) generation", generation_);
    gd::check_buffer(fn, "full", full, layout_.padded_numel(), workspace, workspace_bytes);
  });
  const std::size_t offset = secondary_.shard_offset(local_);
  host::QuantizeOptions o;
  o.index_base = offset;
  o.tag = calls_.next().hash();
  gd::gather_exchange<F>(
      intra_, p, err.empty(),
      gd::TensorInput<T>{storage_.data(),
                         detail::run_map(valid_elements_in(layout_.numel(), offset, S), offset, slots_.table),
                         S},
      o, full, layout_.numel(), slots_.table, st, ~0u, stream);
  return err;
}

// ---------------------------------------------------------------------------------------------
// DeltaAllGather (qWD)
// ---------------------------------------------------------------------------------------------

template <class T, class F, class Transport>
template <class G>
std::string DeltaAllGather<T, F, Transport>::device_call(int kind, const T* shard, T* replica,
                                                         void* workspace, std::size_t workspace_bytes,
                                                         typename Transport::stream_type stream) {
  namespace gd = gpu::detail;
  const char* fn = kind == 6 ? "DeltaAllGather" : "DeltaAllGather::resync";
  const Pieces p = carve<G>(workspace);
  gd::check_device_workspace(fn, workspace, workspace_bytes, p.bytes);
  stream = gd::plan_stream(world_, stream, 0);
  const std::size_t S = layout_.shard_numel(), P = packed_bytes<G>(S), padded = layout_.padded_numel();
  const int r = world_.rank();
  std::uint32_t* const st = gd::begin_status(nullptr, p.control.status, stream);
  const std::string err = detail::local_check([&] {
    gd::check_buffer(fn, "shard", shard, S, workspace, workspace_bytes);
    gd::check_buffer(fn, "replica", replica, padded, workspace, workspace_bytes);
    QCOLL_REQUIRE(
        shard == nullptr || replica == nullptr || S == 0 || shard + S <= replica || replica + padded <= shard,
        fn, "shard", static_cast<const void*>(shard), "overlaps", "replica");
  });
  const CallIdentity call = next_call<G>(kind);
  const std::size_t valid = layout_.valid_in_shard(r), offset = layout_.shard_offset(r);
  host::QuantizeOptions o = opt_;
  o.seed = detail::rank_seed(opt_.seed, r, 1);
  o.index_base = offset;
  o.tag = call.hash();
  if (err.empty()) {
    if (valid > 0) {
      gd::delta_diff_kernel<T><<<gd::grid_for(valid, gd::kThreads), gd::kThreads, 0, stream>>>(
          shard, replica + offset, valid, kind == 6, p.diff);
      QCOLL_CUDA_CHECK_LAUNCH();
    }
    gd::launch_quantize<G>(gd::TensorInput<float>{p.diff, detail::run_map(valid, offset, slots_.table), S},
                           p.send, o, stream, p.control.scratch);
  } else {
    gd::launch_reject<G>(p.send, P, 1, S, o.tag, stream);
  }
  world_.all_gather(p.send, p.recv, P, stream);
  gd::launch_verify<G>(p.recv, P, world_.size(), S, o.tag, st, ~0u, stream);
  if (S > 0) {
    const dim3 grid(gd::grid_for(S, gd::kThreads), static_cast<unsigned>(world_.size()));
    gd::delta_apply_kernel<G, T><<<grid, gd::kThreads, 0, stream>>>(p.recv, P, S, replica, layout_.numel(),
                                                                    kind == 6, slots_.table, st);
    QCOLL_CUDA_CHECK_LAUNCH();
  }
  return err;
}

QCOLL_NAMESPACE_END
