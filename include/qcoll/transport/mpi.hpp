#pragma once
//! \file
//! The MPI transport: wraps a communicator the job already has; collectives on host memory.
//!
//! \code
//!   qcoll::MpiTransport world(MPI_COMM_WORLD);          // node ids from MPI_COMM_TYPE_SHARED
//!   auto node = world.split(world.node_of(world.rank()), world.rank());   // ranks of this node
//!   world.all_gather(shard, full, shard_bytes);
//! \endcode
//!
//! Errors: every MPI call's return code is checked, and a failure becomes qcoll::Error with the
//! call's name and MPI_Error_string's text. qcoll never changes the error handler of a
//! communicator it is given; with MPI's default handler (MPI_ERRORS_ARE_FATAL) an error on it
//! aborts the job before qcoll sees it. Users who want qcoll::Error instead should call
//! `MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN)` themselves. Communicators qcoll creates
//! (split(), discover_node_ids()) use MPI_ERRORS_RETURN.
//!
//! The content of this header is only compiled where <mpi.h> is found (QCOLL_HAS_MPI is then 1;
//! define QCOLL_HAS_MPI to 0 beforehand to leave it out).

#if !defined(QCOLL_HAS_MPI) && defined(__has_include)
#if __has_include(<mpi.h>)
#define QCOLL_HAS_MPI 1
#endif
#endif
#ifndef QCOLL_HAS_MPI
#define QCOLL_HAS_MPI 0
#endif

#if QCOLL_HAS_MPI

// Open MPI's deprecated C++ bindings, pulled in by <mpi.h>, trip -Wcast-function-type.
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wunknown-warning-option"
#pragma clang diagnostic ignored "-Wcast-function-type"
#include <mpi.h>
#pragma clang diagnostic pop
#elif defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpragmas"
#pragma GCC diagnostic ignored "-Wcast-function-type"
#include <mpi.h>
#pragma GCC diagnostic pop
#else
#include <mpi.h>
#endif

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../core/config.hpp"
#include "../core/error.hpp"
#include "../layout/topology.hpp"
#include "common.hpp"

QCOLL_NAMESPACE_BEGIN

namespace detail {

//! Largest element count passed to one MPI call (MPI counts are int). Only tests lower it, to
//! run the large-message path (derived datatypes, chunking) with small buffers.
inline std::size_t mpi_max_count = static_cast<std::size_t>(INT_MAX);

//! Throws qcoll::Error "qcoll: CALL failed: <MPI_Error_string text> (MPI error code RC)".
[[noreturn]] inline void throw_mpi_error(int rc, const char* call) {
  char text[MPI_MAX_ERROR_STRING + 1] = {};
  int len = 0;
  std::string message = "qcoll: ";
  message += call;
  message += " failed: ";
  if (MPI_Error_string(rc, text, &len) == MPI_SUCCESS && len > 0)
    message.append(text, static_cast<std::size_t>(len));
  else
    message += "unknown MPI error";
  message += " (MPI error code " + std::to_string(rc) + ")";
  throw Error(message);
}

//! Checks the return code of an MPI call named `call`.
inline void mpi_check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw_mpi_error(rc, call);
}

//! True between MPI_Init and MPI_Finalize.
inline bool mpi_is_running() noexcept {
  int initialized = 0, finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS || MPI_Finalized(&finalized) != MPI_SUCCESS) return false;
  return initialized && !finalized;
}

//! Owns a communicator created by qcoll; frees it unless MPI is already finalized.
class MpiOwnedComm {
 public:
  MpiOwnedComm() = default;
  explicit MpiOwnedComm(MPI_Comm c) noexcept : comm_(c) {}
  MpiOwnedComm(MpiOwnedComm&& o) noexcept : comm_(o.release()) {}
  MpiOwnedComm& operator=(MpiOwnedComm&& o) noexcept {
    if (this != &o) {
      reset();
      comm_ = o.release();
    }
    return *this;
  }
  MpiOwnedComm(const MpiOwnedComm&) = delete;
  MpiOwnedComm& operator=(const MpiOwnedComm&) = delete;
  ~MpiOwnedComm() { reset(); }

  MPI_Comm get() const noexcept { return comm_; }
  MPI_Comm* out() noexcept { return &comm_; }
  MPI_Comm release() noexcept {
    MPI_Comm c = comm_;
    comm_ = MPI_COMM_NULL;
    return c;
  }
  void reset() noexcept {
    if (comm_ != MPI_COMM_NULL && mpi_is_running()) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

//! Owns a committed derived datatype (or refers to MPI_BYTE).
class MpiOwnedType {
 public:
  MpiOwnedType() = default;
  MpiOwnedType(MpiOwnedType&& o) noexcept : type_(o.type_) { o.type_ = MPI_DATATYPE_NULL; }
  MpiOwnedType& operator=(MpiOwnedType&& o) noexcept {
    if (this != &o) {
      reset();
      type_ = o.type_;
      o.type_ = MPI_DATATYPE_NULL;
    }
    return *this;
  }
  MpiOwnedType(const MpiOwnedType&) = delete;
  MpiOwnedType& operator=(const MpiOwnedType&) = delete;
  ~MpiOwnedType() { reset(); }
  void reset() noexcept {
    if (type_ != MPI_DATATYPE_NULL && type_ != MPI_BYTE && mpi_is_running()) MPI_Type_free(&type_);
    type_ = MPI_DATATYPE_NULL;
  }
  MPI_Datatype* out() noexcept { return &type_; }
  MPI_Datatype get() const noexcept { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

//! `bytes` bytes as (count, datatype) with count <= max_count: MPI_BYTE when that fits, else
//! one element of a derived type of exactly `bytes` bytes (extent `bytes`), built from
//! max_count-byte chunks plus a remainder. Needs bytes <= max_count^2.
class MpiBytes {
 public:
  MpiBytes(std::size_t bytes, std::size_t max_count) {
    if (bytes <= max_count) {
      count_ = static_cast<int>(bytes);
      return;
    }
    const std::size_t q = bytes / max_count, rem = bytes % max_count;
    QCOLL_REQUIRE(q <= max_count, "MpiTransport", "bytes_per_rank", bytes, "exceeds the largest message of",
                  max_count * max_count);
    MpiOwnedType chunk, body;
    mpi_check(MPI_Type_contiguous(static_cast<int>(max_count), MPI_BYTE, chunk.out()), "MPI_Type_contiguous");
    mpi_check(MPI_Type_contiguous(static_cast<int>(q), chunk.get(), body.out()), "MPI_Type_contiguous");
    MpiOwnedType joined;
    MPI_Datatype whole = body.get();
    if (rem > 0) {
      int lengths[2] = {1, static_cast<int>(rem)};
      MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(q * max_count)};
      MPI_Datatype types[2] = {body.get(), MPI_BYTE};
      mpi_check(MPI_Type_create_struct(2, lengths, displacements, types, joined.out()),
                "MPI_Type_create_struct");
      whole = joined.get();
    }
    // Extent exactly `bytes`, so block r of a collective starts at r * bytes.
    mpi_check(MPI_Type_create_resized(whole, 0, static_cast<MPI_Aint>(bytes), type_.out()),
              "MPI_Type_create_resized");
    mpi_check(MPI_Type_commit(type_.out()), "MPI_Type_commit");
    count_ = 1;
  }
  int count() const noexcept { return count_; }
  MPI_Datatype type() const noexcept { return type_.get() == MPI_DATATYPE_NULL ? MPI_BYTE : type_.get(); }

 private:
  int count_ = 0;
  MpiOwnedType type_;
};

inline MPI_Op mpi_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return MPI_SUM;
    case ReduceOp::min: return MPI_MIN;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::bit_or: return MPI_BOR;
  }
  return MPI_OP_NULL;
}

//! A valid address for zero-byte calls whose buffers are null.
inline unsigned char* mpi_dummy_buffer() noexcept {
  static unsigned char dummy[16];
  return dummy;
}

}  // namespace detail

//! One rank's handle on an MPI communicator (see the transport member set in common.hpp). Every
//! call except rank(), size(), node_of(), comm(), counters() and reset_counters() is collective
//! over the communicator and blocks until this rank's part is done. Movable, not copyable; a
//! moved-from transport may only be destroyed or assigned to.
class MpiTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::host;  //!< buffers are host memory
  using stream_type = HostStream;                                 //!< calls block until done

  //! A started nonblocking collective (start_all_gather / start_all_to_all): an MPI request and
  //! the datatype it uses. It refers to the caller's buffers, which must stay valid and untouched
  //! until it completes (test() or wait()). Progress: MPI moves the data of a nonblocking
  //! collective only inside MPI calls (Open MPI has no progress thread for them by default), so a
  //! long computation between start and wait should call test() now and then. Destroying an
  //! active request waits for it (MPI_Wait; it cannot be cancelled), so the peers never hang on
  //! this rank's part. Movable, not copyable.
  class Request {
   public:
    Request() = default;
    Request(Request&& o) noexcept : req_(o.req_), type_(std::move(o.type_)), bytes_(o.bytes_) {
      o.req_ = MPI_REQUEST_NULL;
    }
    Request& operator=(Request&& o) noexcept {
      if (this != &o) {
        release();
        req_ = o.req_;
        o.req_ = MPI_REQUEST_NULL;
        type_ = std::move(o.type_);
        bytes_ = o.bytes_;
      }
      return *this;
    }
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    ~Request() { release(); }

    //! True until test() has seen it complete or wait() has returned (or thrown).
    bool active() const noexcept { return req_ != MPI_REQUEST_NULL; }

   private:
    friend class MpiTransport;
    void release() noexcept {
      if (req_ != MPI_REQUEST_NULL && detail::mpi_is_running()) MPI_Wait(&req_, MPI_STATUS_IGNORE);
      req_ = MPI_REQUEST_NULL;
    }
    MPI_Request req_ = MPI_REQUEST_NULL;
    detail::MpiBytes type_{0, 1};
    std::size_t bytes_ = 0;
  };

  //! Wraps `comm` (an intra-communicator, not owned, error handler left as is). `node_id_of_rank`
  //! gives each rank's node id (ids in [0, INT_MAX], the same table on every rank); when empty,
  //! the ids come from discover_node_ids(comm), which makes the constructor collective.
  explicit MpiTransport(MPI_Comm comm, std::vector<long long> node_id_of_rank = {}) {
    if (!detail::mpi_is_running())
      throw Error("qcoll::MpiTransport: MPI is not initialized or already finalized");
    QCOLL_REQUIRE(comm != MPI_COMM_NULL, "MpiTransport", "comm", "MPI_COMM_NULL", "is not", "a communicator");
    int inter = 0;
    detail::mpi_check(MPI_Comm_test_inter(comm, &inter), "MPI_Comm_test_inter");
    QCOLL_REQUIRE(!inter, "MpiTransport", "comm", "an inter-communicator", "is not", "an intra-communicator");
    if (node_id_of_rank.empty()) node_id_of_rank = discover_node_ids(comm);
    init(comm, node_id_of_rank);
  }

  MpiTransport(MpiTransport&& o) noexcept
      : comm_(o.comm_),
        owned_(std::move(o.owned_)),
        rank_(o.rank_),
        size_(o.size_),
        intra_peers_(o.intra_peers_),
        inter_peers_(o.inter_peers_),
        nodes_(std::move(o.nodes_)),
        counters_(o.counters_) {
    o.comm_ = MPI_COMM_NULL;
  }
  MpiTransport& operator=(MpiTransport&& o) noexcept {
    if (this != &o) {
      owned_ = std::move(o.owned_);
      comm_ = o.comm_;
      o.comm_ = MPI_COMM_NULL;
      rank_ = o.rank_;
      size_ = o.size_;
      intra_peers_ = o.intra_peers_;
      inter_peers_ = o.inter_peers_;
      nodes_ = std::move(o.nodes_);
      counters_ = o.counters_;
    }
    return *this;
  }
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;
  //! Frees the communicator if this transport made it (split()); never the user's.
  ~MpiTransport() = default;

  //! Node ids from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED): the id of a rank is the lowest rank
  //! (in `comm`) of its shared-memory group. Collective over `comm`.
  static std::vector<long long> discover_node_ids(MPI_Comm comm) {
    QCOLL_REQUIRE(comm != MPI_COMM_NULL, "MpiTransport::discover_node_ids", "comm", "MPI_COMM_NULL", "is not",
                  "a communicator");
    int rank = 0, size = 0;
    detail::mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
    detail::MpiOwnedComm shared;
    detail::mpi_check(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, shared.out()),
                      "MPI_Comm_split_type");
    detail::mpi_check(MPI_Comm_set_errhandler(shared.get(), MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    long long leader = rank;
    detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_LONG_LONG, MPI_MIN, shared.get()),
                      "MPI_Allreduce");
    std::vector<long long> ids(static_cast<std::size_t>(size));
    detail::mpi_check(MPI_Allgather(&leader, 1, MPI_LONG_LONG, ids.data(), 1, MPI_LONG_LONG, comm),
                      "MPI_Allgather");
    return ids;
  }

  //! The wrapped communicator (MPI_COMM_NULL after a move).
  MPI_Comm comm() const noexcept { return comm_; }
  //! This rank's index in the communicator.
  int rank() const noexcept { return rank_; }
  //! Number of ranks in the communicator.
  int size() const noexcept { return size_; }
  //! Node id of rank `peer` of this communicator. Throws qcoll::Error if peer is outside [0, size()).
  int node_of(int peer) const { return nodes_[detail::check_peer("MpiTransport::node_of", peer, size_)]; }

  //! MPI_Allgather of `bytes_per_rank` bytes per rank into `recv` (size() * bytes_per_rank
  //! bytes, block r from rank r). In place (MPI_IN_PLACE) when send == recv + rank() *
  //! bytes_per_rank; otherwise send must not overlap recv. Any size (derived datatype above
  //! INT_MAX bytes).
  void all_gather(const void* send, void* recv, std::size_t bytes_per_rank, stream_type = {}) {
    const bool in_place =
        detail::check_all_gather("MpiTransport::all_gather", send, recv, bytes_per_rank, rank_, size_);
    detail::MpiBytes t(bytes_per_rank, detail::mpi_max_count);
    void* out = recv != nullptr ? recv : detail::mpi_dummy_buffer();
    const void* in = in_place ? MPI_IN_PLACE : (send != nullptr ? send : detail::mpi_dummy_buffer());
    detail::mpi_check(MPI_Allgather(in, t.count(), t.type(), out, t.count(), t.type(), comm_),
                      "MPI_Allgather");
    detail::count_exchange(counters_, intra_peers_, inter_peers_, bytes_per_rank);
  }

  //! MPI_Alltoall: block j of `send` goes to rank j, block i of `recv` comes from rank i (blocks
  //! of `bytes_per_rank` bytes; both buffers hold size() blocks and must not overlap).
  void all_to_all(const void* send, void* recv, std::size_t bytes_per_rank, stream_type = {}) {
    detail::check_all_to_all("MpiTransport::all_to_all", send, recv, bytes_per_rank, size_);
    detail::MpiBytes t(bytes_per_rank, detail::mpi_max_count);
    void* out = recv != nullptr ? recv : detail::mpi_dummy_buffer();
    const void* in = send != nullptr ? send : detail::mpi_dummy_buffer() + 8;
    detail::mpi_check(MPI_Alltoall(in, t.count(), t.type(), out, t.count(), t.type(), comm_), "MPI_Alltoall");
    detail::count_exchange(counters_, intra_peers_, inter_peers_, bytes_per_rank);
  }

  //! MPI_Iallgather: starts all_gather(send, recv, bytes_per_rank) (same arguments, checks and
  //! result) and returns at once. Complete it with test() or wait(); counted in counters() when
  //! it completes. Nonblocking collectives of a communicator are matched in the order the ranks
  //! start them, among themselves and with the blocking ones.
  Request start_all_gather(const void* send, void* recv, std::size_t bytes_per_rank) {
    const bool in_place =
        detail::check_all_gather("MpiTransport::start_all_gather", send, recv, bytes_per_rank, rank_, size_);
    Request req;
    req.type_ = detail::MpiBytes(bytes_per_rank, detail::mpi_max_count);
    req.bytes_ = bytes_per_rank;
    void* out = recv != nullptr ? recv : detail::mpi_dummy_buffer();
    const void* in = in_place ? MPI_IN_PLACE : (send != nullptr ? send : detail::mpi_dummy_buffer());
    const int n = req.type_.count();
    detail::mpi_check(MPI_Iallgather(in, n, req.type_.type(), out, n, req.type_.type(), comm_, &req.req_),
                      "MPI_Iallgather");
    return req;
  }

  //! MPI_Ialltoall: starts all_to_all(send, recv, bytes_per_rank); as start_all_gather.
  Request start_all_to_all(const void* send, void* recv, std::size_t bytes_per_rank) {
    detail::check_all_to_all("MpiTransport::start_all_to_all", send, recv, bytes_per_rank, size_);
    Request req;
    req.type_ = detail::MpiBytes(bytes_per_rank, detail::mpi_max_count);
    req.bytes_ = bytes_per_rank;
    void* out = recv != nullptr ? recv : detail::mpi_dummy_buffer();
    const void* in = send != nullptr ? send : detail::mpi_dummy_buffer() + 8;
    const int n = req.type_.count();
    detail::mpi_check(MPI_Ialltoall(in, n, req.type_.type(), out, n, req.type_.type(), comm_, &req.req_),
                      "MPI_Ialltoall");
    return req;
  }

  //! MPI_Test: drives MPI's progress and returns true (the request completed, no longer active)
  //! if the collective is done. Throws qcoll::Error if the request is not active, or MPI fails.
  bool test(Request& req) {
    check_active("MpiTransport::test", req);
    int flag = 0;
    detail::mpi_check(MPI_Test(&req.req_, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    if (flag) detail::count_exchange(counters_, intra_peers_, inter_peers_, req.bytes_);
    return flag != 0;
  }

  //! MPI_Wait: blocks until the collective is done and completes the request. Throws as test().
  void wait(Request& req) {
    check_active("MpiTransport::wait", req);
    detail::mpi_check(MPI_Wait(&req.req_, MPI_STATUS_IGNORE), "MPI_Wait");
    detail::count_exchange(counters_, intra_peers_, inter_peers_, req.bytes_);
  }

  //! MPI_Allreduce in place on `count` MPI_UINT64_T words (bit_or is MPI_BOR); for flags and
  //! fingerprints. Not counted in counters().
  void all_reduce(std::uint64_t* data, std::size_t count, ReduceOp op) {
    detail::check_all_reduce("MpiTransport::all_reduce", data, count, op);
    std::size_t done = 0;
    do {
      const std::size_t n = std::min(count - done, detail::mpi_max_count);
      std::uint64_t* p =
          data != nullptr ? data + done : reinterpret_cast<std::uint64_t*>(detail::mpi_dummy_buffer());
      detail::mpi_check(
          MPI_Allreduce(MPI_IN_PLACE, p, static_cast<int>(n), MPI_UINT64_T, detail::mpi_op(op), comm_),
          "MPI_Allreduce");
      done += n;
    } while (done < count);
  }

  //! MPI_Barrier.
  void barrier() { detail::mpi_check(MPI_Barrier(comm_), "MPI_Barrier"); }

  //! MPI_Comm_split: ranks with the same `color` (>= 0) form a sub-group ordered by (key, rank).
  //! Node ids are carried over. The result owns (and frees) the new communicator, which uses
  //! MPI_ERRORS_RETURN, and starts with zero counters.
  MpiTransport split(int color, int key) {
    QCOLL_REQUIRE(color >= 0, "MpiTransport::split", "color", color, "is below", 0);
    detail::MpiOwnedComm sub;
    detail::mpi_check(MPI_Comm_split(comm_, color, key, sub.out()), "MPI_Comm_split");
    detail::mpi_check(MPI_Comm_set_errhandler(sub.get(), MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    int sub_size = 0;
    detail::mpi_check(MPI_Comm_size(sub.get(), &sub_size), "MPI_Comm_size");
    long long mine = nodes_[static_cast<std::size_t>(rank_)];
    std::vector<long long> ids(static_cast<std::size_t>(sub_size));
    detail::mpi_check(MPI_Allgather(&mine, 1, MPI_LONG_LONG, ids.data(), 1, MPI_LONG_LONG, sub.get()),
                      "MPI_Allgather");
    MpiTransport t;
    t.init(sub.get(), ids);
    t.owned_ = std::move(sub);
    return t;
  }

  //! Bytes handed to this transport for other ranks so far (see ByteCounters).
  const ByteCounters& counters() const noexcept { return counters_; }
  //! Sets every counter back to zero (local, not collective).
  void reset_counters() noexcept { counters_ = ByteCounters{}; }

 private:
  MpiTransport() = default;

  static void check_active(const char* fn, const Request& req) {
    QCOLL_REQUIRE(req.active(), fn, "req", "an inactive request", "is not",
                  "a started, uncompleted collective (completed already, or never started)");
  }

  void init(MPI_Comm comm, const std::vector<long long>& node_id_of_rank) {
    comm_ = comm;
    detail::mpi_check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
    nodes_ = detail::make_node_table("MpiTransport", node_id_of_rank, size_);
    intra_peers_ = detail::count_same_node_peers(nodes_, rank_);
    inter_peers_ = size_ - 1 - intra_peers_;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  detail::MpiOwnedComm owned_;  // comm_ when qcoll created it, else null
  int rank_ = 0;
  int size_ = 0;
  int intra_peers_ = 0;
  int inter_peers_ = 0;
  std::vector<int> nodes_;
  ByteCounters counters_;
};

//! The topology of `comm` as the machines see it: ranks sharing memory (MPI_COMM_TYPE_SHARED) form
//! a node, whatever their numbering. Collective over `comm`; throws qcoll::Error if the nodes hold
//! different numbers of ranks.
inline Topology discover_topology(MPI_Comm comm) {
  int rank = 0;
  detail::mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  return Topology::from_node_ids(MpiTransport::discover_node_ids(comm), rank);
}

QCOLL_NAMESPACE_END

#endif  // QCOLL_HAS_MPI
