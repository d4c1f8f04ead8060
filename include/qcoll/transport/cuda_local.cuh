#pragma once
//! \file
//! The in-process device transport: ranks are host threads of one process sharing one GPU, each
//! with its own stream; all_gather and all_to_all are stream-ordered device-to-device copies
//! between the ranks' buffers, ordered across ranks by events (direct calls) or by a small
//! device-side protocol (calls captured in CUDA graphs). For tests and one-GPU use of the device
//! code paths.
//!
//! \code
//!   qcoll::CudaLocalGroup group(4);                          // 4 ranks on device 0
//!   group.run([&](qcoll::CudaLocalTransport& t) {           // called on 4 threads at once
//!     t.all_gather(shard_d, full_d, shard_bytes, t.stream());
//!   });
//! \endcode
//!
//! Built on LocalGroup / LocalTransport (local.hpp): their host rendezvous carries each rank's
//! call description (operation, size, send pointer), so ranks that disagree on a call all throw,
//! and a rank that fails makes every collective of the run throw instead of hanging, exactly as
//! for the host transport.
//!
//! **Direct calls** (the stream is not being captured). A data call of rank i on stream s is:
//!   1. record rank i's event `ready` on s (everything enqueued before the call, which wrote the
//!      send buffer, precedes it);
//!   2. host exchange of call descriptions: checks agreement, learns the peers' send pointers and
//!      events;
//!   3. s waits for every peer's `ready` (cudaStreamWaitEvent), then copies from the peers' send
//!      buffers into recv; record rank i's event `done` on s;
//!   4. host barrier (every rank has recorded its `done`), then s waits for every peer's `done`:
//!      every peer has then finished reading this rank's send buffer, so work enqueued on s after
//!      the call may overwrite it.
//! Every wait is for work already enqueued, so the calls are correct under CUDA's rules alone:
//! nothing spins on the device, and they cannot hang whatever else the ranks' threads do
//! (device-synchronising calls such as cudaFree, any number of ranks and streams). No host
//! synchronisation with the device, no allocation.
//!
//! **Captured calls** (CUDA graphs). A replay has no host step, so the order across ranks is kept
//! on the device: every group (the run's world and every sub-group made by split()) owns device
//! memory holding two 64-bit counters per rank, ready[W] and done[W]; slot i is written only by
//! rank i, and both only grow. A captured call records an `arrive` kernel (e = ready[i] + 1,
//! release-store ready[i] = e, then wait until every peer's ready[r] >= e), the copies (by a copy
//! kernel, not the copy engines: see cuda_local_copy_kernel), and a `depart` kernel (the same on
//! done[]). Capture with cudaStreamCaptureModeThreadLocal or
//! Relaxed (the ranks capture concurrently on their own threads); the host exchange happens at
//! capture time, and the graph reads the peers' send pointers given at capture, which must stay
//! allocated while the graph is used. All ranks must capture the same calls (a call captured by
//! some ranks and made directly by others throws on every rank). Preconditions of replay: every
//! rank replays its graphs the same number of times, in the same order relative to each other and
//! to the group's captured calls; calls of one group on one rank are ordered on the device (one
//! stream, or streams joined by events), as for NCCL; and the ranks' replays run concurrently.
//! That last one is not promised by CUDA: the waiting kernels need every peer's kernels to start
//! while they spin, which fails when two ranks' streams share one of the device's hardware queues
//! (CUDA_DEVICE_MAX_CONNECTIONS, default 8, so more than a few streams in the process), or when a
//! rank's thread blocks in a device-synchronising call (cudaFree, cudaDeviceSynchronize) or a
//! copy to or from pageable host memory before it has launched its replay. Launch every rank's
//! replays after a barrier(), keep world + (other streams) within CUDA_DEVICE_MAX_CONNECTIONS
//! (cuda_local_request_queues() at the start of main() asks for 32), and synchronise and
//! barrier() before host copies or freeing memory. Capture on one stream per rank: the one program
//! whose capture forks to a second stream hung on an H200 (docs/device.md). counters() count calls when
//! they are enqueued or captured, never at replay.
//!
//! **Never hangs silently.** The waits of the captured protocol give up after the group's timeout
//! (CudaLocalGroup, default 120 s, measured with %globaltimer): the kernel prints one line (rank,
//! epoch, peer) and executes a trap, so the CUDA context fails loudly (every later CUDA call of the
//! process returns an error). A failed rank makes its peers' next direct call throw; their
//! replays time out.

#include <cuda_runtime.h>
#include <cuda/atomic>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../collective/device.cuh"  // the plans' device data path, for plans over this transport
#include "../core/config.hpp"
#include "../core/error.hpp"
#include "../cuda/check.cuh"
#include "common.hpp"
#include "local.hpp"

QCOLL_NAMESPACE_BEGIN

namespace detail {

//! The two steps of the device protocol (see the top of this file).
enum class CudaLocalPhase : int { arrive = 0, depart = 1 };

//! Nanoseconds of the GPU's global timer.
__device__ __forceinline__ unsigned long long cuda_local_clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

//! Lets other warps run while a wait spins.
__device__ __forceinline__ void cuda_local_pause(unsigned ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  __nanosleep(ns);
#else
  (void)ns;
#endif
}

//! One step of the protocol for rank `me` (i below) of `n`: `counters` is the group's ready[] (arrive) or
//! done[] (depart) array. Thread 0 bumps its own slot to epoch e with a release store, then waits
//! (acquire loads) until every peer's slot is >= e; after `timeout_ns` it prints one line and
//! traps. Launched <<<1, 32>>>; the other threads return at once.
//!
//! Why `>= e`: a rank's steps run one after the other on the device (arrive, depart, arrive, ...;
//! precondition of the file), and every step's wait needs rank i's own slot. A peer's ready slot
//! reaches e + 1 only after its depart of epoch e saw done[i] >= e, which rank i writes only after
//! its arrive of epoch e has finished waiting; a peer's done slot reaches e + 1 only after its
//! arrive of epoch e + 1 saw ready[i] >= e + 1, which rank i writes only after its depart of epoch
//! e has finished waiting. So while rank i waits in a step of epoch e, each peer's slot in the
//! array it reads is e - 1 or e, and a peer's slot in the other array is at most e + 1: no counter
//! is ever more than one epoch ahead of rank i's. Seeing a value >= e therefore means exactly "the
//! peer has reached this step", and `>=` would stay right even if a peer could be further ahead.
template <CudaLocalPhase Phase>
__global__ void __launch_bounds__(32)
    cuda_local_phase_kernel(unsigned long long* counters, int me, int n, unsigned long long timeout_ns) {
  if (threadIdx.x != 0) return;
  using Counter = cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>;
  Counter mine(counters[me]);
  const unsigned long long epoch = mine.load(cuda::memory_order_relaxed) + 1;  // written only here
  mine.store(epoch, cuda::memory_order_release);
  const unsigned long long start = cuda_local_clock_ns();
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    Counter peer(counters[r]);
    unsigned pause_ns = 32;
    while (peer.load(cuda::memory_order_acquire) < epoch) {
      if (cuda_local_clock_ns() - start > timeout_ns) {
        printf(
            "qcoll::CudaLocalTransport: rank %d of %d timed out after %llu ms in %s of epoch %llu, waiting "
            "for rank %d (at epoch %llu); trapping\n",
            me, n, timeout_ns / 1000000ull, Phase == CudaLocalPhase::arrive ? "arrive" : "depart", epoch, r,
            peer.load(cuda::memory_order_relaxed));
        __trap();
      }
      cuda_local_pause(pause_ns);
      if (pause_ns < 1024) pause_ns *= 2;
    }
  }
}

//! Copies `bytes` bytes from `src` to `dst` with the multiprocessors, 16 bytes per thread where
//! both are 16-byte aligned. Captured calls copy with this kernel, not with copy-engine copies: a
//! replay's copies wait for its `arrive` kernel, and pending copy-engine work of one rank's graph
//! was seen on an H200 to hold up a peer's own copies (a device-to-host download before its
//! replay), so that the peer never launched the replay its rank waited for.
__global__ void __launch_bounds__(256)
    cuda_local_copy_kernel(unsigned char* dst, const unsigned char* src, std::size_t bytes) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t tail = 0;
  if (((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src)) & 15u) == 0) {
    const std::size_t words = bytes / 16;
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (std::size_t k = first; k < words; k += stride) d[k] = s[k];
    tail = words * 16;
  }
  for (std::size_t k = tail + first; k < bytes; k += stride) dst[k] = src[k];
}

//! Makes a device current for its lifetime and restores the previous one.
class CudaLocalDeviceScope {
 public:
  explicit CudaLocalDeviceScope(int device) {
    QCOLL_CUDA_CHECK(cudaGetDevice(&previous_));
    QCOLL_CUDA_CHECK(cudaSetDevice(device));
  }
  ~CudaLocalDeviceScope() { (void)cudaSetDevice(previous_); }
  CudaLocalDeviceScope(const CudaLocalDeviceScope&) = delete;
  CudaLocalDeviceScope& operator=(const CudaLocalDeviceScope&) = delete;

 private:
  int previous_ = 0;
};

//! State of one CudaLocalGroup::run() shared by all its transports: the device, the timeout of
//! the protocol's waits, and the registry of the groups' counter allocations and the ranks'
//! events (freed when the run ends, after every thread has joined).
class CudaLocalRunShared {
 public:
  CudaLocalRunShared(int device, unsigned long long timeout_ns) : device_(device), timeout_ns_(timeout_ns) {}
  ~CudaLocalRunShared() { (void)release_all(); }
  CudaLocalRunShared(const CudaLocalRunShared&) = delete;
  CudaLocalRunShared& operator=(const CudaLocalRunShared&) = delete;

  int device() const noexcept { return device_; }
  unsigned long long timeout_ns() const noexcept { return timeout_ns_; }

  //! Allocates the counters of a group of `n` ranks on the current device (ready[n] then
  //! done[n], zero), registers them, and returns once the zeroing is complete (so any stream may
  //! use them). Set-up only: blocks, and is not legal while the calling thread captures.
  unsigned long long* allocate_counters(int n) {
    const std::size_t bytes = 2 * static_cast<std::size_t>(n) * sizeof(unsigned long long);
    void* p = nullptr;
    QCOLL_CUDA_CHECK(cudaMalloc(&p, bytes));
    try {
      std::lock_guard<std::mutex> lk(mu_);
      blocks_.push_back(p);
    } catch (...) {
      (void)cudaFree(p);
      throw;
    }
    // From here on the registry frees p, also if the zeroing fails.
    QCOLL_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cudaStreamPerThread));
    QCOLL_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return static_cast<unsigned long long*>(p);
  }

  //! Creates an event (timing disabled) that lives until the run ends: a rank's peers wait on its
  //! events (direct calls), so they must outlive the rank's own transport. Set-up only.
  cudaEvent_t create_event() {
    std::lock_guard<std::mutex> lk(mu_);
    events_.push_back(nullptr);  // if this throws, nothing was created yet
    const cudaError_t err = cudaEventCreateWithFlags(&events_.back(), cudaEventDisableTiming);
    if (err != cudaSuccess) events_.pop_back();
    QCOLL_CUDA_CHECK(err);
    return events_.back();
  }

  //! Waits for the device (a protocol kernel may still run on a stream the user gave), then frees
  //! every registered allocation and event. Returns the result of the wait (frees in any case).
  cudaError_t release_all() noexcept {
    std::lock_guard<std::mutex> lk(mu_);
    if (blocks_.empty() && events_.empty()) return cudaSuccess;
    int previous = 0;
    const bool restore = cudaGetDevice(&previous) == cudaSuccess;
    (void)cudaSetDevice(device_);
    const cudaError_t err = cudaDeviceSynchronize();
    for (void* p : blocks_) (void)cudaFree(p);
    blocks_.clear();
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
    events_.clear();
    (void)cudaGetLastError();
    if (restore) (void)cudaSetDevice(previous);
    return err;
  }

 private:
  int device_;
  unsigned long long timeout_ns_;
  std::mutex mu_;
  std::vector<void*> blocks_;        // guarded by mu_
  std::vector<cudaEvent_t> events_;  // guarded by mu_
};

//! Per-rank CUDA resources of one CudaLocalGroup::run(): the rank's stream. Shared by the rank's
//! transport and every sub-group transport split from it.
class CudaLocalRankResources {
 public:
  explicit CudaLocalRankResources(int device) : device_(device) {
    QCOLL_CUDA_CHECK(cudaSetDevice(device));
    QCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaLocalRankResources() {
    // Errors are ignored: this runs on the way out, possibly while an exception propagates.
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
    (void)cudaGetLastError();
  }
  CudaLocalRankResources(const CudaLocalRankResources&) = delete;
  CudaLocalRankResources& operator=(const CudaLocalRankResources&) = delete;

  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

//! What a rank of a CudaLocalTransport publishes for a data collective (exchanged on the host).
struct CudaLocalCall {
  int op = 0;        // 1 all_gather, 2 all_to_all
  int captured = 0;  // 1: the call's stream is being captured (counter protocol)
  std::size_t bytes = 0;
  const void* send = nullptr;
  cudaEvent_t ready = nullptr;  // direct calls: recorded after the work that wrote `send`
  cudaEvent_t done = nullptr;   // direct calls: recorded after this rank's copies
};

}  // namespace detail

//! One rank of a CudaLocalGroup run; implements the transport concept of common.hpp with device
//! buffers. Every rank of the group calls the collectives in the same order with the same sizes.
//! Movable, not copyable; a moved-from transport may only be destroyed or assigned to.
class CudaLocalTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::device;  //!< buffers are device memory
  using stream_type = cudaStream_t;                                 //!< calls are stream-ordered

  CudaLocalTransport(CudaLocalTransport&&) noexcept = default;
  CudaLocalTransport& operator=(CudaLocalTransport&&) noexcept = default;
  CudaLocalTransport(const CudaLocalTransport&) = delete;
  CudaLocalTransport& operator=(const CudaLocalTransport&) = delete;
  ~CudaLocalTransport() = default;

  //! This rank's index in the group, in [0, size()).
  int rank() const noexcept { return host_->rank(); }
  //! Number of ranks in the group.
  int size() const noexcept { return host_->size(); }
  //! Node id of rank `peer` (from the table given to CudaLocalGroup, carried through split).
  int node_of(int peer) const {
    detail::check_peer("CudaLocalTransport::node_of", peer, size());
    return host_->node_of(peer);
  }
  //! This rank's non-blocking stream (created by run(), destroyed when the rank's function
  //! returns). The collectives use it when given a null stream.
  cudaStream_t stream() const noexcept { return res_->stream(); }
  //! The device all ranks share.
  int device() const noexcept { return res_->device(); }

  //! Gathers `bytes_per_rank` bytes from every rank into `recv` (size() * bytes_per_rank bytes,
  //! rank r's block at offset r * bytes_per_rank), ordered on `stream` (null: stream()). In place
  //! when send == recv + rank() * bytes_per_rank; otherwise send must not overlap recv. Buffers
  //! must be device-accessible (cudaMalloc, managed or pinned). Returns without waiting for the
  //! copies; `send` may be overwritten by work enqueued on `stream` after the call. Capturable
  //! (see the file's comment). Enqueues size() - 1 (or size() when not in place) copies and, with
  //! several ranks and bytes, 2 * size() event operations and two host rendezvous (direct; the
  //! copies by cudaMemcpyAsync) or two one-warp kernels (captured; the copies by a copy kernel);
  //! no allocation, no host synchronisation with the device.
  void all_gather(const void* send, void* recv, std::size_t bytes_per_rank, stream_type stream = {}) {
    const char* fn = "CudaLocalTransport::all_gather";
    const bool in_place = detail::check_all_gather(fn, send, recv, bytes_per_rank, rank(), size());
    if (bytes_per_rank > 0) {
      gpu::require_device_accessible(send, fn, "send");
      gpu::require_device_accessible(recv, fn, "recv");
    }
    exchange(1, send, recv, bytes_per_rank, in_place, stream);
  }

  //! Personalised exchange on `stream` (null: stream()): block j of `send` goes to rank j, block i
  //! of `recv` comes from rank i (blocks of `bytes_per_rank` bytes; both buffers hold size()
  //! blocks, device-accessible, not overlapping). Same ordering guarantees and costs as
  //! all_gather (size() copies).
  void all_to_all(const void* send, void* recv, std::size_t bytes_per_rank, stream_type stream = {}) {
    const char* fn = "CudaLocalTransport::all_to_all";
    detail::check_all_to_all(fn, send, recv, bytes_per_rank, size());
    if (bytes_per_rank > 0) {
      gpu::require_device_accessible(send, fn, "send");
      gpu::require_device_accessible(recv, fn, "recv");
    }
    exchange(2, send, recv, bytes_per_rank, false, stream);
  }

  //! In-place reduction of `count` 64-bit words of host memory over the group; every rank gets
  //! the same result. Runs on the host and blocks (a host rendezvous); meant for set-up and
  //! control (flags, fingerprints), not per-step data; not capturable. Not counted in counters().
  void all_reduce(std::uint64_t* data, std::size_t count, ReduceOp op) {
    detail::check_all_reduce("CudaLocalTransport::all_reduce", data, count, op);
    host_->all_reduce(data, count, op);
  }

  //! Returns once every rank of the group has called barrier() (host only: does not wait for
  //! any stream).
  void barrier() { host_->barrier(); }

  //! Collective, set-up only (blocks; not while capturing): ranks with the same `color` (>= 0)
  //! form a sub-group ordered by (key, rank); node ids are carried over. The sub-group's rank 0
  //! allocates its device counters (2 * its size 64-bit words, freed when run() ends, so split
  //! once and keep the result rather than splitting every step). The result shares this rank's
  //! stream, has its own counters() (zero) and belongs to the same run (a failure anywhere
  //! aborts it too).
  CudaLocalTransport split(int color, int key) {
    QCOLL_REQUIRE(color >= 0, "CudaLocalTransport::split", "color", color, "is below", 0);
    auto sub = std::make_unique<LocalTransport>(host_->split(color, key));
    // Rank 0 of the sub-group allocates; a failure still takes part in the exchange (with a null
    // pointer), so the other members throw instead of waiting.
    unsigned long long* mine = nullptr;
    std::exception_ptr failure;
    if (sub->rank() == 0) {
      try {
        mine = shared_->allocate_counters(sub->size());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    std::vector<unsigned long long*> all(static_cast<std::size_t>(sub->size()));
    sub->all_gather(&mine, all.data(), sizeof(mine));
    if (failure) std::rethrow_exception(failure);
    if (all[0] == nullptr) {
      throw Error("qcoll::CudaLocalTransport::split: rank 0 of the sub-group of color " +
                  std::to_string(color) + " could not allocate its device counters");
    }
    return CudaLocalTransport(std::move(sub), res_, shared_, all[0]);
  }

  //! Bytes handed to this transport for other ranks so far (see ByteCounters). Counted when a
  //! call is enqueued (or captured); replays of a captured graph do not advance them.
  const ByteCounters& counters() const noexcept { return counters_; }
  //! Sets every counter back to zero (local, not collective).
  void reset_counters() noexcept { counters_ = ByteCounters{}; }

 private:
  friend class CudaLocalGroup;

  CudaLocalTransport(LocalTransport& host, std::shared_ptr<detail::CudaLocalRankResources> res,
                     std::shared_ptr<detail::CudaLocalRunShared> shared, unsigned long long* sync)
      : host_(&host), res_(std::move(res)), shared_(std::move(shared)), sync_(sync) {
    init_peers();
  }
  CudaLocalTransport(std::unique_ptr<LocalTransport> owned,
                     std::shared_ptr<detail::CudaLocalRankResources> res,
                     std::shared_ptr<detail::CudaLocalRunShared> shared, unsigned long long* sync)
      : owned_(std::move(owned)),
        host_(owned_.get()),
        res_(std::move(res)),
        shared_(std::move(shared)),
        sync_(sync) {
    init_peers();
  }

  void init_peers() {
    ready_event_ = shared_->create_event();
    done_event_ = shared_->create_event();
    intra_peers_ = 0;
    for (int r = 0; r < size(); ++r)
      if (r != rank() && host_->node_of(r) == host_->node_of(rank())) ++intra_peers_;
    inter_peers_ = size() - 1 - intra_peers_;
    calls_.resize(static_cast<std::size_t>(size()));
  }

  static const char* op_name(int op) noexcept { return op == 1 ? "all_gather" : "all_to_all"; }

  //! Enqueues one step of the device protocol on `stream`.
  void launch_phase(detail::CudaLocalPhase phase, cudaStream_t stream) {
    const int n = size();
    unsigned long long* counters = phase == detail::CudaLocalPhase::arrive ? sync_ : sync_ + n;
    if (phase == detail::CudaLocalPhase::arrive)
      detail::cuda_local_phase_kernel<detail::CudaLocalPhase::arrive>
          <<<1, 32, 0, stream>>>(counters, rank(), n, shared_->timeout_ns());
    else
      detail::cuda_local_phase_kernel<detail::CudaLocalPhase::depart>
          <<<1, 32, 0, stream>>>(counters, rank(), n, shared_->timeout_ns());
    QCOLL_CUDA_CHECK_LAUNCH();
  }

  //! Enqueues this rank's copies on `stream`: block r of `recv` from rank r's send buffer (op 1),
  //! or from block rank() of it (op 2); by cudaMemcpyAsync, or by cuda_local_copy_kernel when
  //! `by_kernel` (captured calls of several ranks). Returns the first failure instead of throwing, so that
  //! the caller still completes its share of the protocol.
  std::exception_ptr enqueue_copies(int op, void* recv, std::size_t bytes, bool in_place, bool by_kernel,
                                    cudaStream_t stream) {
    try {
      auto* out = static_cast<unsigned char*>(recv);
      const int me = rank();
      const std::size_t my_block = static_cast<std::size_t>(me) * bytes;
      for (int r = 0; r < size(); ++r) {
        if (op == 1 && r == me && in_place) continue;
        const unsigned char* src =
            static_cast<const unsigned char*>(calls_[static_cast<std::size_t>(r)].send);
        if (op == 2) src += my_block;
        unsigned char* dst = out + static_cast<std::size_t>(r) * bytes;
        if (by_kernel) {
          const std::size_t blocks = std::min<std::size_t>((bytes + 4095) / 4096, 1024);
          detail::cuda_local_copy_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(dst, src, bytes);
          QCOLL_CUDA_CHECK_LAUNCH();
        } else {
          QCOLL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
        }
      }
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }

  //! Makes `stream` wait for event `which` (ready or done) of every peer, as this call's host
  //! exchange gave them.
  void wait_for_peers(cudaEvent_t detail::CudaLocalCall::*which, cudaStream_t stream) {
    for (int r = 0; r < size(); ++r)
      if (r != rank())
        QCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, calls_[static_cast<std::size_t>(r)].*which, 0));
  }

  //! The protocol described at the top of this file. op 1: all_gather, 2: all_to_all.
  void exchange(int op, const void* send, void* recv, std::size_t bytes, bool in_place, cudaStream_t stream) {
    if (stream == nullptr) stream = res_->stream();
    const int n = size();
    const int me = rank();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    QCOLL_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    detail::CudaLocalCall mine;
    mine.op = op;
    mine.captured = capture == cudaStreamCaptureStatusNone ? 0 : 1;
    mine.bytes = bytes;
    mine.send = send;
    mine.ready = ready_event_;
    mine.done = done_event_;
    // Direct call: mark the point after which `send` is complete, before the peers learn of it.
    if (!mine.captured && bytes > 0 && n > 1) QCOLL_CUDA_CHECK(cudaEventRecord(mine.ready, stream));
    // Host exchange of call descriptions. Its own size check cannot fail (every rank sends one
    // description); a failed peer makes it throw on every rank.
    host_->all_gather(&mine, calls_.data(), sizeof(detail::CudaLocalCall));

    for (int r = 0; r < n; ++r) {
      const detail::CudaLocalCall& o = calls_[static_cast<std::size_t>(r)];
      if (o.op == op && o.bytes == bytes && o.captured == mine.captured) continue;
      std::ostringstream os;
      os << "qcoll::CudaLocalTransport::" << op_name(op) << ": ranks disagree on the collective: rank " << me
         << " called " << op_name(op) << " with bytes_per_rank = " << bytes
         << (mine.captured ? " while capturing" : "") << ", rank " << r << " called " << op_name(o.op)
         << " with bytes_per_rank = " << o.bytes << (o.captured ? " while capturing" : "");
      throw Error(os.str());  // every rank sees the same descriptions, so all throw here
    }

    // From here on every rank of the group enqueues its share. Ranks agree on `bytes` and on being
    // captured, so they all skip the protocol together when there is nothing to move; with one
    // rank there is no peer to order against.
    if (bytes > 0) {
      const bool sync = n > 1;
      const bool graph = sync && mine.captured != 0;  // the counter protocol, copies by kernel
      const bool events = sync && !graph;             // the event protocol
      // If this launch fails the peers' arrive kernels time out (the device is in trouble anyway).
      if (graph) launch_phase(detail::CudaLocalPhase::arrive, stream);
      if (events) wait_for_peers(&detail::CudaLocalCall::ready, stream);
      // A failure to enqueue a copy is rethrown only once this rank's share of the protocol is
      // enqueued, so that its peers complete the call.
      std::exception_ptr failure = enqueue_copies(op, recv, bytes, in_place, graph, stream);
      try {
        if (graph) launch_phase(detail::CudaLocalPhase::depart, stream);
        if (events) QCOLL_CUDA_CHECK(cudaEventRecord(mine.done, stream));
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      if (events) {
        // Every rank has recorded its `done` (and will not record it again before the next
        // call's host exchange, which this rank joins only after waiting on it).
        host_->barrier();
        wait_for_peers(&detail::CudaLocalCall::done, stream);
      }
      if (failure) std::rethrow_exception(failure);
    }
    detail::count_exchange(counters_, intra_peers_, inter_peers_, bytes);
  }

  std::unique_ptr<LocalTransport> owned_;  // set for transports made by split()
  LocalTransport* host_ = nullptr;         // owned_.get() or the run's top-level host transport
  std::shared_ptr<detail::CudaLocalRankResources> res_;
  std::shared_ptr<detail::CudaLocalRunShared> shared_;
  unsigned long long* sync_ = nullptr;  // the group's device counters: ready[size()], done[size()]
  cudaEvent_t ready_event_ = nullptr;   // this rank's events for direct calls, owned by shared_
  cudaEvent_t done_event_ = nullptr;
  std::vector<detail::CudaLocalCall> calls_;  // scratch for the host exchange, one per rank
  int intra_peers_ = 0;
  int inter_peers_ = 0;
  ByteCounters counters_;
};

//! Asks CUDA for `queues` hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS, 1..32; CUDA's
//! default is 8) unless the variable is already set, so that the ranks' streams of a
//! CudaLocalGroup whose calls are captured in graphs do not share queues (see the file's
//! comment). Takes effect only if called before the process's first CUDA call (start of main()).
//! Returns false, and changes nothing, when the variable was already set.
inline bool cuda_local_request_queues(int queues = 32) {
  QCOLL_REQUIRE(queues >= 1 && queues <= 32, "cuda_local_request_queues", "queues", queues, "is outside",
                "[1, 32]");
  if (std::getenv("CUDA_DEVICE_MAX_CONNECTIONS") != nullptr) return false;
  const std::string value = std::to_string(queues);
#if defined(_WIN32)
  return _putenv_s("CUDA_DEVICE_MAX_CONNECTIONS", value.c_str()) == 0;
#else
  return setenv("CUDA_DEVICE_MAX_CONNECTIONS", value.c_str(), 0) == 0;
#endif
}

//! A group of `world` ranks run as host threads of this process, sharing one GPU.
class CudaLocalGroup {
 public:
  //! `world` ranks in [1, 1024]; `node_id_of_rank` as for LocalGroup (empty: all on node 0);
  //! `device` is the CUDA device all ranks use (>= 0; checked against the devices present when
  //! run() starts); `timeout_ms` (>= 1, milliseconds) bounds each wait of the device protocol,
  //! after which the waiting kernel prints a line and traps (see the file's comment).
  explicit CudaLocalGroup(int world, std::vector<long long> node_id_of_rank = {}, int device = 0,
                          long long timeout_ms = 120000)
      : host_(world, std::move(node_id_of_rank)), device_(device), timeout_ms_(timeout_ms) {
    QCOLL_REQUIRE(device >= 0, "CudaLocalGroup", "device", device, "is below", 0);
    QCOLL_REQUIRE(timeout_ms >= 1, "CudaLocalGroup", "timeout_ms", timeout_ms, "is below", 1);
  }

  //! Number of ranks.
  int size() const noexcept { return host_.size(); }
  //! The device the ranks use.
  int device() const noexcept { return device_; }
  //! The timeout of the device protocol's waits, in milliseconds.
  long long timeout_ms() const noexcept { return timeout_ms_; }

  //! Calls f(CudaLocalTransport&) on `size()` new threads at once and joins them. Before starting
  //! them, allocates the group's device counters (2 * size() 64-bit words). Each thread makes
  //! `device()` current and creates its rank's non-blocking stream; when f returns (or throws) the
  //! stream is synchronised and destroyed. After all threads have joined, waits for the device and
  //! frees the counters of the group and of every sub-group split from it, and every transport's
  //! two events (cudaEventCreate, at construction and split); throws qcoll::Error if
  //! that wait reports a CUDA error and no rank failed.
  //! Failure semantics are those of LocalGroup::run(): a failing rank makes every collective of
  //! the run throw instead of hanging, and run() rethrows the first failure.
  template <class F>
  void run(F&& f) {
    const int device = device_;
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) (void)cudaGetLastError();
    QCOLL_REQUIRE(err == cudaSuccess && device < count, "CudaLocalGroup::run", "device", device,
                  "is not below the number of CUDA devices", (err == cudaSuccess ? count : 0));
    // Milliseconds to nanoseconds, saturating (a huge timeout means no timeout in practice).
    const auto ms = static_cast<unsigned long long>(timeout_ms_);
    const unsigned long long limit = std::numeric_limits<unsigned long long>::max() / 1000000ull;
    const unsigned long long timeout_ns =
        ms > limit ? std::numeric_limits<unsigned long long>::max() : ms * 1000000ull;
    auto shared = std::make_shared<detail::CudaLocalRunShared>(device, timeout_ns);
    unsigned long long* top = nullptr;
    {
      detail::CudaLocalDeviceScope scope(device);
      top = shared->allocate_counters(size());  // on failure, ~CudaLocalRunShared frees
    }
    host_.run([&f, device, &shared, top](LocalTransport& host) {
      auto res = std::make_shared<detail::CudaLocalRankResources>(device);
      CudaLocalTransport t(host, res, shared, top);
      f(t);
    });
    QCOLL_CUDA_CHECK(shared->release_all());
  }

 private:
  LocalGroup host_;
  int device_;
  long long timeout_ms_;
};

QCOLL_NAMESPACE_END
