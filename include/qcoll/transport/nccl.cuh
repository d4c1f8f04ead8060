#pragma once
//! \file
//! The NCCL transport: the transport concept of common.hpp on an NCCL communicator, one rank per
//! GPU. all_gather and all_to_all are stream-ordered NCCL calls on device buffers; all_reduce
//! (small, host data, for set-up and control) blocks.
//!
//! \code
//!   ncclComm_t comm;  // made by the application (ncclCommInitRank, ...)
//!   qcoll::NcclTransport t(comm, node_id_of_rank);   // does not take ownership of comm
//!   t.all_gather(shard_d, full_d, shard_bytes, stream);
//! \endcode
//!
//! Every NCCL call is checked: a result other than ncclSuccess throws qcoll::Error naming the call,
//! with ncclGetErrorString() and the communicator's ncclGetLastError() text. The communicator is
//! used in blocking mode (NCCL's default); the caller makes the communicator's device current
//! before the data collectives, as NCCL requires.
//!
//! The content of this header is only compiled where <nccl.h> is found (QCOLL_HAS_NCCL is then 1;
//! define QCOLL_HAS_NCCL to 0 beforehand to leave it out).

#if !defined(QCOLL_HAS_NCCL) && defined(QCOLL_HAVE_NCCL)  // qcoll's own build says whether NCCL is on
#define QCOLL_HAS_NCCL QCOLL_HAVE_NCCL
#endif
#if !defined(QCOLL_HAS_NCCL) && defined(__has_include)
#if __has_include(<nccl.h>)
#define QCOLL_HAS_NCCL 1
#endif
#endif
#ifndef QCOLL_HAS_NCCL
#define QCOLL_HAS_NCCL 0
#endif

#if QCOLL_HAS_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../collective/device.cuh"  // the plans' device data path, for plans over this transport
#include "../core/config.hpp"
#include "../core/error.hpp"
#include "../cuda/check.cuh"
#include "common.hpp"

QCOLL_NAMESPACE_BEGIN

namespace detail {

//! Throws qcoll::Error "qcoll: NCCL error in `CALL`: ERROR STRING (CODE); last error: TEXT".
[[noreturn]] inline void throw_nccl_error(ncclResult_t result, const char* call, ncclComm_t comm) {
  std::ostringstream os;
  os << "qcoll: NCCL error in `" << call << "`: " << ncclGetErrorString(result) << " ("
     << static_cast<int>(result) << ")";
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') os << "; last error: " << last;
  throw Error(os.str());
}

//! Throws qcoll::Error naming `call` unless `result` is ncclSuccess.
inline void check_nccl(ncclResult_t result, const char* call, ncclComm_t comm) {
  if (result != ncclSuccess) throw_nccl_error(result, call, comm);
}

//! Makes a device current for its lifetime and restores the previous one.
class NcclDeviceScope {
 public:
  explicit NcclDeviceScope(int device) {
    QCOLL_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) QCOLL_CUDA_CHECK(cudaSetDevice(device));
  }
  ~NcclDeviceScope() { (void)cudaSetDevice(previous_); }
  NcclDeviceScope(const NcclDeviceScope&) = delete;
  NcclDeviceScope& operator=(const NcclDeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace detail

//! Checks an NCCL call inside NcclTransport; `comm` names the communicator for ncclGetLastError.
#define QCOLL_NCCL_CHECK(comm, expr) ::qcoll::detail::check_nccl((expr), #expr, (comm))

//! A rank of an NCCL communicator as a qcoll transport. Movable, not copyable.
class NcclTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::device;  //!< buffers are device memory
  using stream_type = cudaStream_t;                                 //!< calls are stream-ordered

  //! Bytes of the device staging buffer of all_reduce (allocated once, at construction).
  static constexpr std::size_t staging_bytes = 4096;

  //! Wraps `comm` (not owned: the caller destroys it after this transport). `node_id_of_rank`
  //! has one node id per rank of comm (ids in [0, INT_MAX]); empty puts every rank on node 0.
  //! Allocates the staging buffer and an internal stream on comm's device.
  explicit NcclTransport(ncclComm_t comm, std::vector<long long> node_id_of_rank = {})
      : NcclTransport(comm, false, Tag{}) {
    // The delegated constructor has completed, so the destructor cleans up if this throws.
    nodes_ = detail::make_node_table("NcclTransport", node_id_of_rank, size_);
    init_peers();
  }

  NcclTransport(NcclTransport&& o) noexcept { take(o); }
  NcclTransport& operator=(NcclTransport&& o) noexcept {
    if (this != &o) {
      release();
      take(o);
    }
    return *this;
  }
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;
  //! Frees the staging buffer and stream; destroys the communicator if split() made it.
  ~NcclTransport() { release(); }

  //! This rank's index in the communicator (ncclCommUserRank).
  int rank() const noexcept { return rank_; }
  //! Number of ranks of the communicator (ncclCommCount).
  int size() const noexcept { return size_; }
  //! Node id of rank `peer` of this communicator. Throws if peer is outside [0, size()).
  int node_of(int peer) const { return nodes_[detail::check_peer("NcclTransport::node_of", peer, size_)]; }
  //! The wrapped communicator.
  ncclComm_t comm() const noexcept { return comm_; }
  //! The communicator's CUDA device (ncclCommCuDevice).
  int device() const noexcept { return device_; }

  //! ncclAllGather of `bytes_per_rank` bytes (ncclInt8) per rank on `stream`: `recv` gets rank
  //! r's block at offset r * bytes_per_rank. In place when send == recv + rank() *
  //! bytes_per_rank; otherwise send must not overlap recv. Buffers must be device-accessible.
  //! Stream-ordered; zero bytes enqueues nothing.
  void all_gather(const void* send, void* recv, std::size_t bytes_per_rank, stream_type stream = {}) {
    const char* fn = "NcclTransport::all_gather";
    detail::check_all_gather(fn, send, recv, bytes_per_rank, rank_, size_);
    if (bytes_per_rank > 0) {
      gpu::require_device_accessible(send, fn, "send");
      gpu::require_device_accessible(recv, fn, "recv");
      QCOLL_NCCL_CHECK(comm_, ncclAllGather(send, recv, bytes_per_rank, ncclInt8, comm_, stream));
    }
    detail::count_exchange(counters_, intra_peers_, inter_peers_, bytes_per_rank);
  }

  //! Personalised exchange on `stream`: block j of `send` goes to rank j, block i of `recv`
  //! comes from rank i (blocks of `bytes_per_rank` bytes, size() blocks each, device-accessible,
  //! not overlapping). One NCCL group of ncclSend/ncclRecv per peer; the own block is a
  //! cudaMemcpyAsync. Stream-ordered; zero bytes enqueues nothing.
  void all_to_all(const void* send, void* recv, std::size_t bytes_per_rank, stream_type stream = {}) {
    const char* fn = "NcclTransport::all_to_all";
    detail::check_all_to_all(fn, send, recv, bytes_per_rank, size_);
    if (bytes_per_rank > 0) {
      gpu::require_device_accessible(send, fn, "send");
      gpu::require_device_accessible(recv, fn, "recv");
      const auto* in = static_cast<const unsigned char*>(send);
      auto* out = static_cast<unsigned char*>(recv);
      const std::size_t own = static_cast<std::size_t>(rank_) * bytes_per_rank;
      QCOLL_CUDA_CHECK(cudaMemcpyAsync(out + own, in + own, bytes_per_rank, cudaMemcpyDefault, stream));
      QCOLL_NCCL_CHECK(comm_, ncclGroupStart());
      ncclResult_t first = ncclSuccess;
      const char* first_call = "";
      for (int p = 0; p < size_ && first == ncclSuccess; ++p) {
        if (p == rank_) continue;
        const std::size_t off = static_cast<std::size_t>(p) * bytes_per_rank;
        first = ncclSend(in + off, bytes_per_rank, ncclInt8, p, comm_, stream);
        first_call = "ncclSend";
        if (first != ncclSuccess) break;
        first = ncclRecv(out + off, bytes_per_rank, ncclInt8, p, comm_, stream);
        first_call = "ncclRecv";
      }
      // The group is always closed, also after a failed ncclSend / ncclRecv.
      const ncclResult_t end = ncclGroupEnd();
      if (first != ncclSuccess) detail::throw_nccl_error(first, first_call, comm_);
      QCOLL_NCCL_CHECK(comm_, end);
    }
    detail::count_exchange(counters_, intra_peers_, inter_peers_, bytes_per_rank);
  }

  //! In-place reduction of `count` 64-bit words of host memory over the communicator; every rank
  //! gets the same result. Copies through the staging buffer in chunks, one ncclAllReduce
  //! (ncclUint64: sum, min, max) per chunk on the internal stream, and synchronises that stream:
  //! it blocks, and is meant for set-up and control, not per-step data. bit_or, which NCCL does
  //! not have, is an ncclMax over a byte map: each bit of a chunk of words becomes one byte (0 or
  //! 1), so a max over ranks is the or (64 bytes per word: 64 words per chunk). All ranks must
  //! pass the same count and op (NCCL cannot check this). Not counted in counters().
  void all_reduce(std::uint64_t* data, std::size_t count, ReduceOp op) {
    detail::check_all_reduce("NcclTransport::all_reduce", data, count, op);
    if (count == 0) return;
    detail::NcclDeviceScope scope(device_);
    if (op == ReduceOp::bit_or) {
      constexpr std::size_t words_per_chunk = staging_bytes / 64;
      unsigned char map[staging_bytes];
      for (std::size_t begin = 0; begin < count; begin += words_per_chunk) {
        const std::size_t n = std::min(words_per_chunk, count - begin);
        for (std::size_t i = 0; i < n; ++i)
          for (int b = 0; b < 64; ++b)
            map[i * 64 + static_cast<std::size_t>(b)] =
                static_cast<unsigned char>((data[begin + i] >> b) & 1u);
        reduce_staged(map, n * 64, ncclUint8, ncclMax);
        for (std::size_t i = 0; i < n; ++i) {
          std::uint64_t w = 0;
          for (int b = 0; b < 64; ++b)
            w |= static_cast<std::uint64_t>(map[i * 64 + static_cast<std::size_t>(b)] != 0) << b;
          data[begin + i] = w;
        }
      }
      return;
    }
    const ncclRedOp_t nop = op == ReduceOp::sum ? ncclSum : op == ReduceOp::min ? ncclMin : ncclMax;
    constexpr std::size_t words_per_chunk = staging_bytes / sizeof(std::uint64_t);
    for (std::size_t begin = 0; begin < count; begin += words_per_chunk) {
      const std::size_t n = std::min(words_per_chunk, count - begin);
      reduce_staged(data + begin, n, ncclUint64, nop);
    }
  }

  //! Returns once every rank has called barrier(): an all_reduce of one word (blocks).
  void barrier() {
    std::uint64_t w = 0;
    all_reduce(&w, 1, ReduceOp::max);
  }

  //! Collective (ncclCommSplit): ranks with the same `color` (>= 0) form a sub-communicator
  //! ordered by (key, rank). Node ids are carried over (found with one blocking ncclAllGather of
  //! the parent ranks on the new communicator). The result owns and destroys its communicator
  //! and has its own counters (zero).
  NcclTransport split(int color, int key) {
    QCOLL_REQUIRE(color >= 0, "NcclTransport::split", "color", color, "is below", 0);
    detail::NcclDeviceScope scope(device_);
    ncclComm_t sub = nullptr;
    QCOLL_NCCL_CHECK(comm_, ncclCommSplit(comm_, color, key, &sub, nullptr));
    QCOLL_REQUIRE(sub != nullptr, "NcclTransport::split", "color", color,
                  "gave no communicator (ncclCommSplit returned NULL)", "");
    NcclTransport t(sub, true, Tag{});  // owns sub from here on, also if the rest throws
    t.nodes_.assign(static_cast<std::size_t>(t.size_), 0);
    std::vector<std::int32_t> parent(static_cast<std::size_t>(t.size_));
    {
      // One gather of all parent ranks: the staging buffer holds groups of up to 1023 ranks;
      // beyond that a temporary device buffer is used (split is set-up, not per step).
      const std::size_t need = (parent.size() + 1) * sizeof(std::int32_t);
      void* buf = t.staging_;
      void* temp = nullptr;
      if (need > staging_bytes) {
        QCOLL_CUDA_CHECK(cudaMalloc(&temp, need));
        buf = temp;
      }
      try {
        auto* dev = static_cast<std::int32_t*>(buf);
        const std::int32_t me = rank_;
        QCOLL_CUDA_CHECK(cudaMemcpyAsync(dev, &me, sizeof(me), cudaMemcpyHostToDevice, t.stream_));
        QCOLL_NCCL_CHECK(t.comm_, ncclAllGather(dev, dev + 1, 1, ncclInt32, t.comm_, t.stream_));
        QCOLL_CUDA_CHECK(cudaMemcpyAsync(parent.data(), dev + 1, parent.size() * sizeof(std::int32_t),
                                         cudaMemcpyDeviceToHost, t.stream_));
        QCOLL_CUDA_CHECK(cudaStreamSynchronize(t.stream_));
        t.check_async();
      } catch (...) {
        if (temp != nullptr) (void)cudaFree(temp);
        throw;
      }
      if (temp != nullptr) QCOLL_CUDA_CHECK(cudaFree(temp));
    }
    for (std::size_t r = 0; r < parent.size(); ++r) {
      QCOLL_REQUIRE(parent[r] >= 0 && parent[r] < size_, "NcclTransport::split", "parent rank", parent[r],
                    "is outside [0, parent size) with parent size =", size_);
      t.nodes_[r] = nodes_[static_cast<std::size_t>(parent[r])];
    }
    t.init_peers();
    return t;
  }

  //! Throws qcoll::Error if the communicator reports an asynchronous error
  //! (ncclCommGetAsyncError), e.g. after a failure of a peer or of the network.
  void check_async() const {
    ncclResult_t async = ncclSuccess;
    QCOLL_NCCL_CHECK(comm_, ncclCommGetAsyncError(comm_, &async));
    if (async != ncclSuccess && async != ncclInProgress)
      detail::throw_nccl_error(async, "ncclCommGetAsyncError", comm_);
  }

  //! Bytes handed to this transport for other ranks so far (see ByteCounters).
  const ByteCounters& counters() const noexcept { return counters_; }
  //! Sets every counter back to zero (local, not collective).
  void reset_counters() noexcept { counters_ = ByteCounters{}; }

 private:
  struct Tag {};

  //! Queries rank, size and device and allocates the staging buffer and stream; on failure
  //! releases what it made (and the communicator when owned).
  NcclTransport(ncclComm_t comm, bool owns, Tag) : comm_(comm), owns_(owns) {
    try {
      QCOLL_REQUIRE(comm != nullptr, "NcclTransport", "comm", "nullptr", "is not a communicator", "");
      QCOLL_NCCL_CHECK(comm_, ncclCommUserRank(comm_, &rank_));
      QCOLL_NCCL_CHECK(comm_, ncclCommCount(comm_, &size_));
      QCOLL_NCCL_CHECK(comm_, ncclCommCuDevice(comm_, &device_));
      detail::NcclDeviceScope scope(device_);
      QCOLL_CUDA_CHECK(cudaMalloc(&staging_, staging_bytes));
      QCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    } catch (...) {
      release();
      throw;
    }
  }

  void init_peers() {
    intra_peers_ = detail::count_same_node_peers(nodes_, rank_);
    inter_peers_ = size_ - 1 - intra_peers_;
  }

  //! Copies `count` elements of `host` to the staging buffer, all-reduces them there, copies
  //! them back and synchronises the internal stream.
  void reduce_staged(void* host, std::size_t count, ncclDataType_t type, ncclRedOp_t op) {
    const std::size_t bytes = count * (type == ncclUint8 ? 1u : sizeof(std::uint64_t));
    QCOLL_CUDA_CHECK(cudaMemcpyAsync(staging_, host, bytes, cudaMemcpyHostToDevice, stream_));
    QCOLL_NCCL_CHECK(comm_, ncclAllReduce(staging_, staging_, count, type, op, comm_, stream_));
    QCOLL_CUDA_CHECK(cudaMemcpyAsync(host, staging_, bytes, cudaMemcpyDeviceToHost, stream_));
    QCOLL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    check_async();
  }

  void take(NcclTransport& o) noexcept {
    comm_ = std::exchange(o.comm_, nullptr);
    owns_ = std::exchange(o.owns_, false);
    rank_ = o.rank_;
    size_ = o.size_;
    device_ = o.device_;
    staging_ = std::exchange(o.staging_, nullptr);
    stream_ = std::exchange(o.stream_, nullptr);
    nodes_ = std::move(o.nodes_);
    intra_peers_ = o.intra_peers_;
    inter_peers_ = o.inter_peers_;
    counters_ = o.counters_;
  }

  void release() noexcept {
    // Errors are ignored: this runs on the way out, possibly while an exception propagates.
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
    if (staging_ != nullptr) (void)cudaFree(staging_);
    (void)cudaGetLastError();
    if (owns_ && comm_ != nullptr) (void)ncclCommDestroy(comm_);
    stream_ = nullptr;
    staging_ = nullptr;
    comm_ = nullptr;
    owns_ = false;
  }

  ncclComm_t comm_ = nullptr;
  bool owns_ = false;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  void* staging_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<int> nodes_;
  int intra_peers_ = 0;
  int inter_peers_ = 0;
  ByteCounters counters_;
};

QCOLL_NAMESPACE_END

#endif  // QCOLL_HAS_NCCL
