#pragma once
//! \file
//! The in-process device transport: ranks are host threads of one process sharing one GPU, each
//! with its own stream; all_gather and all_to_all are stream-ordered device-to-device copies
//! between the ranks' buffers. For tests and one-GPU use of the device code paths.
//!
//! \code
//!   qcoll::CudaLocalGroup group(4);                          // 4 ranks on device 0
//!   group.run([&](qcoll::CudaLocalTransport& t) {           // called on 4 threads at once
//!     t.all_gather(shard_d, full_d, shard_bytes, t.stream());
//!   });
//! \endcode
//!
//! Built on LocalGroup / LocalTransport (local.hpp): their host rendezvous carries each rank's
//! call description (operation, size, send pointer, events), so ranks that disagree on a call
//! all throw, and a rank that fails makes every collective of the run throw instead of hanging,
//! exactly as for the host transport.
//!
//! Data collectives never synchronise the host with a stream. Each rank owns two events for the
//! whole run: "ready", recorded on the caller's stream when the call starts (the send buffer is
//! complete there), and "done", recorded after the rank's copies out of its peers' buffers. A
//! call is: record ready; host exchange of call descriptions; wait on every peer's ready event
//! (cudaStreamWaitEvent) and enqueue the copies from the peers' send buffers; record done; host
//! rendezvous; make the caller's stream wait on every peer's done event, so work enqueued after
//! the call (that may overwrite the send buffer) runs only once every peer has read it.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../core/config.hpp"
#include "../core/error.hpp"
#include "../cuda/check.cuh"
#include "common.hpp"
#include "local.hpp"

QCOLL_NAMESPACE_BEGIN

namespace detail {

//! Per-rank CUDA resources of one CudaLocalGroup::run(): the rank's stream and its two events.
//! Shared by the rank's transport and every sub-group transport split from it.
class CudaLocalRankResources {
 public:
  explicit CudaLocalRankResources(int device) : device_(device) {
    QCOLL_CUDA_CHECK(cudaSetDevice(device));
    try {
      QCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      QCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      QCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    } catch (...) {
      release();
      throw;
    }
  }
  ~CudaLocalRankResources() { release(); }
  CudaLocalRankResources(const CudaLocalRankResources&) = delete;
  CudaLocalRankResources& operator=(const CudaLocalRankResources&) = delete;

  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }
  cudaEvent_t ready() const noexcept { return ready_; }
  cudaEvent_t done() const noexcept { return done_; }

 private:
  void release() noexcept {
    // Errors are ignored: this runs on the way out, possibly while an exception propagates.
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
    if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
    if (done_ != nullptr) (void)cudaEventDestroy(done_);
    (void)cudaGetLastError();
    stream_ = nullptr;
    ready_ = nullptr;
    done_ = nullptr;
  }

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

//! What a rank of a CudaLocalTransport publishes for a data collective (exchanged on the host).
struct CudaLocalCall {
  int op = 0;  // 1 all_gather, 2 all_to_all
  std::size_t bytes = 0;
  const void* send = nullptr;
  cudaEvent_t ready = nullptr;
  cudaEvent_t done = nullptr;
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
  //! copies; `send` may be overwritten by work enqueued on `stream` after the call. Each rank
  //! enqueues size() - 1 (or size() when not in place) copies; no allocation.
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
  //! blocks, device-accessible, not overlapping). Same ordering guarantees as all_gather.
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
  //! control (flags, fingerprints), not per-step data. Not counted in counters().
  void all_reduce(std::uint64_t* data, std::size_t count, ReduceOp op) {
    detail::check_all_reduce("CudaLocalTransport::all_reduce", data, count, op);
    host_->all_reduce(data, count, op);
  }

  //! Returns once every rank of the group has called barrier() (host only: does not wait for
  //! any stream).
  void barrier() { host_->barrier(); }

  //! Collective: ranks with the same `color` (>= 0) form a sub-group ordered by (key, rank); node
  //! ids are carried over. The result shares this rank's stream and events, has its own counters
  //! (zero) and belongs to the same run (a failure anywhere aborts it too).
  CudaLocalTransport split(int color, int key) {
    QCOLL_REQUIRE(color >= 0, "CudaLocalTransport::split", "color", color, "is below", 0);
    auto sub = std::make_unique<LocalTransport>(host_->split(color, key));
    return CudaLocalTransport(std::move(sub), res_);
  }

  //! Bytes handed to this transport for other ranks so far (see ByteCounters).
  const ByteCounters& counters() const noexcept { return counters_; }
  //! Sets every counter back to zero (local, not collective).
  void reset_counters() noexcept { counters_ = ByteCounters{}; }

 private:
  friend class CudaLocalGroup;

  CudaLocalTransport(LocalTransport& host, std::shared_ptr<detail::CudaLocalRankResources> res)
      : host_(&host), res_(std::move(res)) {
    init_peers();
  }
  CudaLocalTransport(std::unique_ptr<LocalTransport> owned,
                     std::shared_ptr<detail::CudaLocalRankResources> res)
      : owned_(std::move(owned)), host_(owned_.get()), res_(std::move(res)) {
    init_peers();
  }

  void init_peers() {
    intra_peers_ = 0;
    for (int r = 0; r < size(); ++r)
      if (r != rank() && host_->node_of(r) == host_->node_of(rank())) ++intra_peers_;
    inter_peers_ = size() - 1 - intra_peers_;
    calls_.resize(static_cast<std::size_t>(size()));
  }

  static const char* op_name(int op) noexcept { return op == 1 ? "all_gather" : "all_to_all"; }

  //! The protocol described at the top of this file. op 1: all_gather, 2: all_to_all.
  void exchange(int op, const void* send, void* recv, std::size_t bytes, bool in_place, cudaStream_t stream) {
    if (stream == nullptr) stream = res_->stream();
    const int n = size();
    const int me = rank();
    detail::CudaLocalCall mine;
    mine.op = op;
    mine.bytes = bytes;
    mine.send = send;
    mine.ready = res_->ready();
    mine.done = res_->done();
    QCOLL_CUDA_CHECK(cudaEventRecord(mine.ready, stream));
    // Host exchange of call descriptions: also the rendezvous after which every peer's ready
    // event is recorded. Its own size check cannot fail (every rank sends one description).
    host_->all_gather(&mine, calls_.data(), sizeof(detail::CudaLocalCall));

    for (int r = 0; r < n; ++r) {
      const detail::CudaLocalCall& o = calls_[static_cast<std::size_t>(r)];
      if (o.op == op && o.bytes == bytes) continue;
      std::ostringstream os;
      os << "qcoll::CudaLocalTransport::" << op_name(op) << ": ranks disagree on the collective: rank " << me
         << " called " << op_name(op) << " with bytes_per_rank = " << bytes << ", rank " << r << " called "
         << op_name(o.op) << " with bytes_per_rank = " << o.bytes;
      throw Error(os.str());  // every rank sees the same descriptions, so all throw here
    }

    // Enqueue this rank's copies. A failure here is rethrown only after the second rendezvous,
    // so that the peers are not left waiting in it.
    std::exception_ptr failure;
    try {
      auto* out = static_cast<unsigned char*>(recv);
      const std::size_t my_block = static_cast<std::size_t>(me) * bytes;
      if (bytes > 0) {
        for (int r = 0; r < n; ++r) {
          const detail::CudaLocalCall& o = calls_[static_cast<std::size_t>(r)];
          if (r != me) QCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, o.ready, 0));
          const unsigned char* src = static_cast<const unsigned char*>(o.send);
          if (op == 2) src += my_block;
          if (op == 1 && r == me && in_place) continue;
          QCOLL_CUDA_CHECK(cudaMemcpyAsync(out + static_cast<std::size_t>(r) * bytes, src, bytes,
                                           cudaMemcpyDefault, stream));
        }
      }
      QCOLL_CUDA_CHECK(cudaEventRecord(res_->done(), stream));
    } catch (...) {
      failure = std::current_exception();
    }
    // Every done event is recorded once all ranks pass this rendezvous.
    host_->barrier();
    if (failure) std::rethrow_exception(failure);
    if (bytes > 0) {
      for (int r = 0; r < n; ++r)
        if (r != me)
          QCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, calls_[static_cast<std::size_t>(r)].done, 0));
    }
    detail::count_exchange(counters_, intra_peers_, inter_peers_, bytes);
  }

  std::unique_ptr<LocalTransport> owned_;  // set for transports made by split()
  LocalTransport* host_ = nullptr;         // owned_.get() or the run's top-level host transport
  std::shared_ptr<detail::CudaLocalRankResources> res_;
  std::vector<detail::CudaLocalCall> calls_;  // scratch for the host exchange, one per rank
  int intra_peers_ = 0;
  int inter_peers_ = 0;
  ByteCounters counters_;
};

//! A group of `world` ranks run as host threads of this process, sharing one GPU.
class CudaLocalGroup {
 public:
  //! `world` ranks in [1, 1024]; `node_id_of_rank` as for LocalGroup (empty: all on node 0);
  //! `device` is the CUDA device all ranks use (>= 0; checked against the devices present when
  //! run() starts).
  explicit CudaLocalGroup(int world, std::vector<long long> node_id_of_rank = {}, int device = 0)
      : host_(world, std::move(node_id_of_rank)), device_(device) {
    QCOLL_REQUIRE(device >= 0, "CudaLocalGroup", "device", device, "is below", 0);
  }

  //! Number of ranks.
  int size() const noexcept { return host_.size(); }
  //! The device the ranks use.
  int device() const noexcept { return device_; }

  //! Calls f(CudaLocalTransport&) on `size()` new threads at once and joins them. Each thread
  //! makes `device()` current and creates its rank's non-blocking stream and events; when f
  //! returns (or throws) the stream is synchronised and stream and events are destroyed.
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
    host_.run([&f, device](LocalTransport& host) {
      auto res = std::make_shared<detail::CudaLocalRankResources>(device);
      CudaLocalTransport t(host, res);
      f(t);
    });
  }

 private:
  LocalGroup host_;
  int device_;
};

QCOLL_NAMESPACE_END
