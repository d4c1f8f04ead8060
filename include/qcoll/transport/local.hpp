#pragma once
//! \file
//! The in-process transport: ranks are threads of one process, collectives are memcpy between
//! their buffers. For tests, the demo and one-machine use.
//!
//! \code
//!   qcoll::LocalGroup group(8, {0, 0, 0, 0, 1, 1, 1, 1});   // 8 ranks on 2 nodes
//!   group.run([&](qcoll::LocalTransport& t) {               // called on 8 threads at once
//!     t.all_gather(shard, full, shard_bytes);
//!   });
//! \endcode
//!
//! Every collective of a group is a rendezvous of all its ranks: each rank publishes its buffer
//! pointers in a per-rank slot, waits until every rank has arrived, copies what it needs straight
//! from its peers' buffers, and waits again until every rank has finished copying (so no buffer
//! changes while a peer reads it). Waiting uses a mutex and condition variable per group, never
//! spinning. Ranks that disagree on the operation or its size all throw qcoll::Error instead of
//! corrupting memory. A rank that fails (throws out of the function given to run(), or returns
//! from it while its peers wait for it) makes every collective of the run, in every sub-group,
//! throw instead of hanging.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../core/config.hpp"
#include "../core/error.hpp"
#include "common.hpp"

QCOLL_NAMESPACE_BEGIN

namespace detail {

//! Thrown by the collectives of a run in which some rank has failed; run() recognizes it so the
//! rank that failed first, not its victims, is reported.
class LocalPeerFailure : public Error {
 public:
  using Error::Error;
};

enum class LocalOp : int { none, all_gather, all_to_all, all_reduce, barrier, split };

inline const char* local_op_name(LocalOp op) noexcept {
  switch (op) {
    case LocalOp::all_gather: return "all_gather";
    case LocalOp::all_to_all: return "all_to_all";
    case LocalOp::all_reduce: return "all_reduce";
    case LocalOp::barrier: return "barrier";
    case LocalOp::split: return "split";
    case LocalOp::none: break;
  }
  return "none";
}

struct LocalGroupState;

//! What a rank publishes for the collective it is in.
struct LocalSlot {
  LocalOp op = LocalOp::none;
  const void* send = nullptr;
  std::size_t bytes = 0;  // bytes_per_rank, or element count of all_reduce
  ReduceOp reduce = ReduceOp::sum;
  int color = 0;
  int key = 0;
  std::shared_ptr<LocalGroupState> sub;  // written by the creator of this rank's sub-group in split()
};

//! One nonblocking data exchange of a group (start_all_gather / start_all_to_all): what every rank
//! gave when it started it, and its progress. Guarded by the group's mu; the tables are read
//! without the lock only once every rank has started it, after which nobody writes them.
struct LocalNbOp {
  explicit LocalNbOp(int size)
      : op(static_cast<std::size_t>(size), LocalOp::none),
        bytes(static_cast<std::size_t>(size), 0),
        send(static_cast<std::size_t>(size), nullptr),
        recv(static_cast<std::size_t>(size), nullptr),
        in_place(static_cast<std::size_t>(size), 0) {}

  std::vector<LocalOp> op;         // by group rank: the exchange it started
  std::vector<std::size_t> bytes;  // its bytes_per_rank
  std::vector<const void*> send;
  std::vector<void*> recv;
  std::vector<unsigned char> in_place;  // all_gather: send is the rank's own block of recv
  int arrived = 0;                      // ranks that have started it
  int claimed = 0;                      // destinations whose copies some rank has taken on
  int copied = 0;                       // destinations whose copies are made
  bool done = false;                    // every copy made (or the exchange failed)
  int withdrawn = -1;                   // run rank that destroyed its request before all arrived
  std::string error;                    // set with done when the ranks disagree
};

//! One group (the run's world or a sub-group made by split): rendezvous state and slots.
struct LocalGroupState {
  LocalGroupState(std::vector<int> world_ranks_in, std::vector<int> nodes_in)
      : world_ranks(std::move(world_ranks_in)),
        nodes(std::move(nodes_in)),
        size(static_cast<int>(world_ranks.size())),
        slots(world_ranks.size()),
        nb_started(world_ranks.size(), 0) {}

  const std::vector<int> world_ranks;  // run rank of each member, by group rank
  const std::vector<int> nodes;        // node id of each member, by group rank
  const int size;

  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;               // ranks waiting in the current rendezvous (guarded by mu)
  std::uint64_t generation = 0;  // completed rendezvous (guarded by mu)
  int gone = -1;                 // run rank of a member that returned from run() (guarded by mu)
  std::vector<LocalSlot> slots;  // slot r written only by rank r, before the first wait of a call

  // Nonblocking exchanges (guarded by mu): the k-th one each rank starts is matched with the k-th
  // one of every other rank, independently of the blocking collectives in between.
  std::vector<std::uint64_t> nb_started;  // by group rank: exchanges started
  std::vector<std::pair<std::uint64_t, std::shared_ptr<LocalNbOp>>> nb_open;  // not all ranks arrived
};

//! Makes the copies of an exchange every rank has started, one destination rank's blocks at a
//! time, until none is left unclaimed; whoever completes the last marks it done. Called by the
//! rank that starts the exchange last and by every rank that tests, waits for or drops its request,
//! so the copies are shared among the ranks that are there and need none that is computing.
inline void local_nb_help(LocalGroupState& g, LocalNbOp& x) noexcept {
  const auto W = static_cast<std::size_t>(g.size);
  const std::size_t bytes = x.bytes[0];
  for (;;) {
    std::size_t d;
    {
      std::lock_guard<std::mutex> lk(g.mu);
      if (x.claimed == g.size) return;
      d = static_cast<std::size_t>(x.claimed++);
    }
    for (std::size_t q = 0; q < W && bytes > 0; ++q) {
      auto* out = static_cast<unsigned char*>(x.recv[d]) + q * bytes;
      const auto* in = static_cast<const unsigned char*>(x.send[q]);
      if (x.op[0] == LocalOp::all_to_all)
        std::memcpy(out, in + d * bytes, bytes);
      else if (!(d == q && x.in_place[d]))
        std::memcpy(out, in, bytes);
    }
    bool last;
    {
      std::lock_guard<std::mutex> lk(g.mu);
      last = ++x.copied == g.size;
      if (last) x.done = true;
    }
    if (last) g.cv.notify_all();
  }
}

//! State shared by all groups of one LocalGroup::run().
struct LocalRunState {
  explicit LocalRunState(int world) : errors(static_cast<std::size_t>(world)) {}

  std::atomic<bool> aborted{false};
  std::string abort_message;  // written once, under mu, before `aborted` becomes true

  std::mutex mu;  // guards everything below; taken before any group's mu, never after
  std::vector<std::weak_ptr<LocalGroupState>> groups;
  std::size_t prune_at = 16;
  std::vector<std::exception_ptr> errors;  // by run rank
  int first_failure = -1;                  // rank whose own failure aborted the run

  //! Registers a group so aborts reach it.
  void add_group(const std::shared_ptr<LocalGroupState>& g) {
    std::lock_guard<std::mutex> lk(mu);
    if (groups.size() >= prune_at) {
      groups.erase(std::remove_if(groups.begin(), groups.end(),
                                  [](const std::weak_ptr<LocalGroupState>& w) { return w.expired(); }),
                   groups.end());
      prune_at = std::max<std::size_t>(16, 2 * groups.size());
    }
    groups.push_back(g);
    if (aborted.load()) wake_locked(*g);
  }

  static void wake_locked(LocalGroupState& g) {
    { std::lock_guard<std::mutex> lk(g.mu); }
    g.cv.notify_all();
  }

  //! Records the exception with which rank `rank` left the run. The first own failure (anything
  //! but the LocalPeerFailure of this run) aborts the run.
  void fail(int rank, std::exception_ptr e, bool own, const char* what) noexcept {
    std::lock_guard<std::mutex> lk(mu);
    if (rank < static_cast<int>(errors.size())) errors[static_cast<std::size_t>(rank)] = e;
    if (!own || aborted.load()) return;
    first_failure = rank;
    try {
      abort_message = "qcoll: peer rank " + std::to_string(rank) + " failed: " + what;
    } catch (...) {
      abort_message.clear();  // out of memory: a shorter message is better than none
    }
    aborted.store(true);
    for (const auto& w : groups)
      if (auto g = w.lock()) wake_locked(*g);
  }

  //! Rank `rank` returned normally: collectives of its groups can no longer complete.
  void returned(int rank) noexcept {
    std::lock_guard<std::mutex> lk(mu);
    for (const auto& w : groups) {
      auto g = w.lock();
      if (!g || std::find(g->world_ranks.begin(), g->world_ranks.end(), rank) == g->world_ranks.end())
        continue;
      {
        std::lock_guard<std::mutex> glk(g->mu);
        if (g->gone < 0) g->gone = rank;
      }
      g->cv.notify_all();
    }
  }
};

}  // namespace detail

class LocalGroup;

//! One rank's handle on a group of threads (see the transport member set in common.hpp). Made by
//! LocalGroup::run() and split(); used by the thread it was given to only. Every call except
//! rank(), size(), node_of(), counters() and reset_counters() is collective: all ranks of the
//! group call it, in the same order, with the same sizes; each blocks until its part is done.
//! The nonblocking exchanges (start_all_gather, start_all_to_all, then test / wait) are matched
//! among themselves in the order each rank starts them, whatever blocking calls come between.
//! Movable, not copyable; a moved-from transport may only be destroyed or assigned to.
class LocalTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::host;  //!< buffers are host memory
  using stream_type = HostStream;                                 //!< calls block until done

  //! A started nonblocking exchange of this rank (start_all_gather / start_all_to_all), completed
  //! by test() or wait(). It refers to the caller's buffers, which must stay valid and untouched
  //! (send unchanged, recv unread) until it completes. Destroying an incomplete request: if every
  //! rank has started the exchange, waits until its copies are done (bounded: the copying rank
  //! never waits for anything); otherwise withdraws this rank, and the peers' start / test / wait
  //! of that exchange throw qcoll::Error naming it instead of hanging. Movable, not copyable.
  class Request {
   public:
    Request() = default;
    Request(Request&& o) noexcept : op_(std::move(o.op_)), group_(std::move(o.group_)), rank_(o.rank_) {}
    Request& operator=(Request&& o) noexcept {
      if (this != &o) {
        release();
        op_ = std::move(o.op_);
        group_ = std::move(o.group_);
        rank_ = o.rank_;
      }
      return *this;
    }
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    ~Request() { release(); }

    //! True until test() has seen it complete or wait() has returned (or thrown).
    bool active() const noexcept { return op_ != nullptr; }

   private:
    friend class LocalTransport;
    Request(std::shared_ptr<detail::LocalNbOp> op, std::shared_ptr<detail::LocalGroupState> group, int rank)
        : op_(std::move(op)), group_(std::move(group)), rank_(rank) {}

    void release() noexcept {
      if (!op_) return;
      detail::LocalGroupState& g = *group_;
      bool all = false;
      {
        std::lock_guard<std::mutex> lk(g.mu);
        all = op_->arrived == g.size;
        if (!all && op_->withdrawn < 0) op_->withdrawn = g.world_ranks[static_cast<std::size_t>(rank_)];
      }
      if (all) {
        detail::local_nb_help(g, *op_);
        std::unique_lock<std::mutex> lk(g.mu);
        g.cv.wait(lk, [&] { return op_->done; });
      }
      g.cv.notify_all();
      op_.reset();
      group_.reset();
    }

    std::shared_ptr<detail::LocalNbOp> op_;
    std::shared_ptr<detail::LocalGroupState> group_;
    int rank_ = 0;
  };

  LocalTransport(LocalTransport&&) noexcept = default;
  LocalTransport& operator=(LocalTransport&&) noexcept = default;
  LocalTransport(const LocalTransport&) = delete;
  LocalTransport& operator=(const LocalTransport&) = delete;
  ~LocalTransport() = default;

  //! This rank's index in the group, in [0, size()).
  int rank() const noexcept { return rank_; }
  //! Number of ranks in the group.
  int size() const noexcept { return group_->size; }
  //! Node id of rank `peer` of this group (from the table given to LocalGroup, carried through
  //! split). Throws qcoll::Error if peer is outside [0, size()).
  int node_of(int peer) const {
    return group_->nodes[detail::check_peer("LocalTransport::node_of", peer, size())];
  }

  //! Gathers `bytes_per_rank` bytes from every rank: `recv` (size() * bytes_per_rank bytes) gets
  //! rank r's `send` block at offset r * bytes_per_rank. In place when send == recv + rank() *
  //! bytes_per_rank; otherwise send must not overlap recv. Zero bytes is a valid (empty) call.
  //! Each rank copies (size() - 1) * bytes_per_rank bytes.
  void all_gather(const void* send, void* recv, std::size_t bytes_per_rank, stream_type = {}) {
    const bool in_place =
        detail::check_all_gather("LocalTransport::all_gather", send, recv, bytes_per_rank, rank_, size());
    exchange(
        detail::LocalOp::all_gather, send, bytes_per_rank,
        [&](unsigned char* out, int r) {
          if (r == rank_ && in_place) return;
          std::memcpy(out + static_cast<std::size_t>(r) * bytes_per_rank, slot(r).send, bytes_per_rank);
        },
        recv);
  }

  //! Personalised exchange: block j of `send` goes to rank j, block i of `recv` comes from rank i
  //! (blocks of `bytes_per_rank` bytes; both buffers hold size() blocks and must not overlap).
  void all_to_all(const void* send, void* recv, std::size_t bytes_per_rank, stream_type = {}) {
    detail::check_all_to_all("LocalTransport::all_to_all", send, recv, bytes_per_rank, size());
    const std::size_t mine = static_cast<std::size_t>(rank_) * bytes_per_rank;
    exchange(
        detail::LocalOp::all_to_all, send, bytes_per_rank,
        [&](unsigned char* out, int r) {
          std::memcpy(out + static_cast<std::size_t>(r) * bytes_per_rank,
                      static_cast<const unsigned char*>(slot(r).send) + mine, bytes_per_rank);
        },
        recv);
  }

  //! Starts all_gather(send, recv, bytes_per_rank) without waiting for the peers (same arguments,
  //! checks and result). Returns at once, except on the rank that starts it last: that rank makes
  //! the copies (W (W - 1) bytes_per_rank bytes, shared with the ranks that are in test(), wait()
  //! or a request's destructor meanwhile, one destination rank at a time) before returning, so
  //! the ranks that started earlier compute meanwhile and none has to call anything for the data
  //! to move. Complete it with wait() or test(); counted in counters() when it completes.
  Request start_all_gather(const void* send, void* recv, std::size_t bytes_per_rank) {
    const bool in_place = detail::check_all_gather("LocalTransport::start_all_gather", send, recv,
                                                   bytes_per_rank, rank_, size());
    return start_exchange(detail::LocalOp::all_gather, send, recv, bytes_per_rank, in_place);
  }

  //! Starts all_to_all(send, recv, bytes_per_rank) without waiting for the peers; as
  //! start_all_gather.
  Request start_all_to_all(const void* send, void* recv, std::size_t bytes_per_rank) {
    detail::check_all_to_all("LocalTransport::start_all_to_all", send, recv, bytes_per_rank, size());
    return start_exchange(detail::LocalOp::all_to_all, send, recv, bytes_per_rank, false);
  }

  //! True (and the request completed, no longer active) if the exchange is done; false if some
  //! rank has not started it yet. Never blocks on peers. Throws qcoll::Error if the request is not
  //! active, the ranks started different exchanges, a rank withdrew from it, or the run failed.
  bool test(Request& req) { return complete(req, false); }

  //! Blocks until the exchange is done, then completes the request. Throws as test().
  void wait(Request& req) { complete(req, true); }

  //! In-place reduction of `count` 64-bit words over the group (for flags and fingerprints); every
  //! rank gets the same result. Combines ranks in rank order. Not counted in counters().
  void all_reduce(std::uint64_t* data, std::size_t count, ReduceOp op) {
    detail::check_all_reduce("LocalTransport::all_reduce", data, count, op);
    std::vector<std::uint64_t> acc(count);
    detail::LocalSlot s;
    s.op = detail::LocalOp::all_reduce;
    s.send = data;
    s.bytes = count;
    s.reduce = op;
    publish(std::move(s));
    sync(true);
    std::string mismatch = find_mismatch(detail::LocalOp::all_reduce);
    if (mismatch.empty() && count > 0) {
      std::memcpy(acc.data(), slot(0).send, count * sizeof(std::uint64_t));
      for (int r = 1; r < size(); ++r)
        detail::reduce_into(acc.data(), static_cast<const std::uint64_t*>(slot(r).send), count, op);
    }
    sync(false);
    if (!mismatch.empty()) throw Error(mismatch);
    if (count > 0) std::memcpy(data, acc.data(), count * sizeof(std::uint64_t));
  }

  //! Returns once every rank of the group has called barrier().
  void barrier() {
    detail::LocalSlot s;
    s.op = detail::LocalOp::barrier;
    publish(std::move(s));
    sync(true);
    std::string mismatch = find_mismatch(detail::LocalOp::barrier);
    sync(false);
    if (!mismatch.empty()) throw Error(mismatch);
  }

  //! Collective: ranks with the same `color` (>= 0) form a sub-group in which they are ordered by
  //! (key, rank). Node ids are carried over. The result has its own counters (zero) and keeps its
  //! sub-group alive; it belongs to the same run, so a failure anywhere aborts it too.
  LocalTransport split(int color, int key) {
    QCOLL_REQUIRE(color >= 0, "LocalTransport::split", "color", color, "is below", 0);
    detail::LocalSlot s;
    s.op = detail::LocalOp::split;
    s.color = color;
    s.key = key;
    publish(std::move(s));
    sync(true);
    std::string mismatch = find_mismatch(detail::LocalOp::split);
    bool created = true;
    std::exception_ptr own_error;
    // The lowest rank of each color builds the sub-group and hands it to every member's slot;
    // members take it from their own slot after the second rendezvous.
    int creator = -1;
    for (int r = 0; r < size() && creator < 0; ++r)
      if (slot(r).color == color) creator = r;
    if (mismatch.empty() && creator == rank_) {
      try {
        std::vector<int> members;
        for (int r = 0; r < size(); ++r)
          if (slot(r).color == color) members.push_back(r);
        std::stable_sort(members.begin(), members.end(),
                         [this](int a, int b) { return slot(a).key < slot(b).key; });
        std::vector<int> world_ranks, nodes;
        for (int m : members) {
          world_ranks.push_back(group_->world_ranks[static_cast<std::size_t>(m)]);
          nodes.push_back(group_->nodes[static_cast<std::size_t>(m)]);
        }
        auto sub = std::make_shared<detail::LocalGroupState>(std::move(world_ranks), std::move(nodes));
        run_->add_group(sub);
        for (int m : members) group_->slots[static_cast<std::size_t>(m)].sub = sub;
      } catch (...) {
        created = false;
        own_error = std::current_exception();
      }
    }
    sync(false);
    std::shared_ptr<detail::LocalGroupState> sub =
        std::move(group_->slots[static_cast<std::size_t>(rank_)].sub);
    if (!mismatch.empty()) throw Error(mismatch);
    if (!created) std::rethrow_exception(own_error);
    if (!sub) {
      throw Error("qcoll::LocalTransport::split: rank " + std::to_string(creator) +
                  " could not create the sub-group of color " + std::to_string(color));
    }
    const int me = group_->world_ranks[static_cast<std::size_t>(rank_)];
    const int sub_rank = static_cast<int>(std::find(sub->world_ranks.begin(), sub->world_ranks.end(), me) -
                                          sub->world_ranks.begin());
    return LocalTransport(sub_rank, std::move(sub), run_);
  }

  //! Bytes handed to this transport for other ranks so far (see ByteCounters).
  const ByteCounters& counters() const noexcept { return counters_; }
  //! Sets every counter back to zero (local, not collective).
  void reset_counters() noexcept { counters_ = ByteCounters{}; }

 private:
  friend class LocalGroup;

  LocalTransport(int rank, std::shared_ptr<detail::LocalGroupState> group,
                 std::shared_ptr<detail::LocalRunState> run)
      : rank_(rank), group_(std::move(group)), run_(std::move(run)) {
    intra_peers_ = detail::count_same_node_peers(group_->nodes, rank_);
    inter_peers_ = group_->size - 1 - intra_peers_;
  }

  // The data exchange shared by all_gather and all_to_all: publish this rank's send buffer,
  // rendezvous, let copy(recv, r) take what it needs from each rank r, rendezvous again (so every
  // peer's buffer stays valid until all copies are done), then report a mismatch or count bytes.
  template <class Copy>
  void exchange(detail::LocalOp op, const void* send, std::size_t bytes_per_rank, Copy&& copy, void* recv) {
    detail::LocalSlot s;
    s.op = op;
    s.send = send;
    s.bytes = bytes_per_rank;
    publish(std::move(s));
    sync(true);
    const std::string mismatch = find_mismatch(op);
    if (mismatch.empty() && bytes_per_rank > 0)
      for (int r = 0; r < size(); ++r) copy(static_cast<unsigned char*>(recv), r);
    sync(false);
    if (!mismatch.empty()) throw Error(mismatch);
    detail::count_exchange(counters_, intra_peers_, inter_peers_, bytes_per_rank);
  }

  // Registers this rank's part of its next nonblocking exchange; the rank completing the arrivals
  // checks that all ranks started the same exchange and makes the copies (local_nb_help).
  Request start_exchange(detail::LocalOp op, const void* send, void* recv, std::size_t bytes, bool in_place) {
    detail::LocalGroupState& g = *group_;
    const auto me = static_cast<std::size_t>(rank_);
    std::shared_ptr<detail::LocalNbOp> x;
    {
      std::unique_lock<std::mutex> lk(g.mu);
      if (run_->aborted.load() || g.gone >= 0) throw_broken_locked();
      const std::uint64_t seq = g.nb_started[me];
      auto it =
          std::find_if(g.nb_open.begin(), g.nb_open.end(), [seq](const auto& e) { return e.first == seq; });
      x = it != g.nb_open.end() ? it->second : std::make_shared<detail::LocalNbOp>(g.size);
      if (x->withdrawn >= 0) {
        ++g.nb_started[me];
        throw Error(withdrawn_message(op, x->withdrawn));
      }
      if (it == g.nb_open.end()) g.nb_open.emplace_back(seq, x);
      ++g.nb_started[me];
      x->op[me] = op;
      x->bytes[me] = bytes;
      x->send[me] = send;
      x->recv[me] = recv;
      x->in_place[me] = in_place ? 1 : 0;
      if (++x->arrived < g.size) return Request(std::move(x), group_, rank_);
      g.nb_open.erase(
          std::find_if(g.nb_open.begin(), g.nb_open.end(), [seq](const auto& e) { return e.first == seq; }));
      x->error = nb_mismatch(*x);
      if (!x->error.empty()) {  // nothing to copy: every rank throws from test / wait
        x->claimed = x->copied = g.size;
        x->done = true;
      }
    }
    g.cv.notify_all();  // waiting ranks may help copy
    detail::local_nb_help(g, *x);
    return Request(std::move(x), group_, rank_);
  }

  // test() (block = false) and wait() (block = true).
  bool complete(Request& req, bool block) {
    const char* fn = block ? "LocalTransport::wait" : "LocalTransport::test";
    QCOLL_REQUIRE(req.active(), fn, "req", "an inactive request", "is not",
                  "a started, uncompleted exchange (completed already, or never started)");
    QCOLL_REQUIRE(req.group_ == group_ && req.rank_ == rank_, fn, "req", "a request of another group or rank",
                  "is not", "one of this transport");
    detail::LocalGroupState& g = *group_;
    detail::LocalNbOp& x = *req.op_;
    {
      std::unique_lock<std::mutex> lk(g.mu);
      const auto broken = [&] {
        return x.arrived < g.size && (x.withdrawn >= 0 || run_->aborted.load() || g.gone >= 0);
      };
      if (block) g.cv.wait(lk, [&] { return x.arrived == g.size || broken(); });
      if (x.arrived < g.size) {
        if (!broken()) return false;
        // Leave the exchange: nobody may copy into or out of this rank's buffers after it returns.
        const int withdrawn = x.withdrawn;
        if (withdrawn < 0) x.withdrawn = g.world_ranks[static_cast<std::size_t>(rank_)];
        std::shared_ptr<detail::LocalNbOp> keep = std::move(req.op_);
        req.group_.reset();
        if (withdrawn >= 0) throw Error(withdrawn_message(x.op[static_cast<std::size_t>(rank_)], withdrawn));
        throw_broken_locked();
      }
    }
    detail::local_nb_help(g, x);  // every rank has started: help with what is left to copy
    {
      std::unique_lock<std::mutex> lk(g.mu);
      if (block)
        g.cv.wait(lk, [&] { return x.done; });
      else if (!x.done)
        return false;
    }
    std::shared_ptr<detail::LocalNbOp> keep = std::move(req.op_);
    req.group_.reset();
    if (!x.error.empty()) throw Error(x.error);
    detail::count_exchange(counters_, intra_peers_, inter_peers_, x.bytes[static_cast<std::size_t>(rank_)]);
    return true;
  }

  std::string withdrawn_message(detail::LocalOp op, int withdrawn) const {
    return "qcoll::LocalTransport: rank " + std::to_string(withdrawn) + " destroyed its request of a " +
           std::string("nonblocking ") + detail::local_op_name(op) +
           " before all ranks had started it (rank " +
           std::to_string(group_->world_ranks[static_cast<std::size_t>(rank_)]) + " waits for it)";
  }

  // Every rank's part of a nonblocking exchange against rank 0's: "" or the error message.
  std::string nb_mismatch(const detail::LocalNbOp& x) const noexcept {
    for (int r = 1; r < size(); ++r) {
      const auto q = static_cast<std::size_t>(r);
      if (x.op[q] == x.op[0] && x.bytes[q] == x.bytes[0]) continue;
      try {
        std::ostringstream os;
        os << "qcoll::LocalTransport: ranks disagree on the nonblocking exchange: rank 0 started "
           << detail::local_op_name(x.op[0]) << " with bytes_per_rank = " << x.bytes[0] << ", rank " << r
           << " started " << detail::local_op_name(x.op[q]) << " with bytes_per_rank = " << x.bytes[q];
        return os.str();
      } catch (...) {
        return "qcoll::LocalTransport: ranks disagree on the nonblocking exchange";
      }
    }
    return std::string();
  }

  const detail::LocalSlot& slot(int r) const { return group_->slots[static_cast<std::size_t>(r)]; }

  void publish(detail::LocalSlot s) {
    s.sub.reset();
    group_->slots[static_cast<std::size_t>(rank_)] = std::move(s);
  }

  [[noreturn]] void throw_broken_locked() const {
    if (run_->aborted.load()) throw detail::LocalPeerFailure(run_->abort_message);
    throw Error("qcoll::LocalTransport: rank " + std::to_string(group_->gone) +
                " returned from LocalGroup::run() while rank " +
                std::to_string(group_->world_ranks[static_cast<std::size_t>(rank_)]) +
                " waits for it in a collective");
  }

  //! Rendezvous of all ranks of the group. The first rendezvous of a call is abortable: it
  //! throws if the run was aborted or a member has left, unless every rank had already arrived
  //! (then all pass, and all reach the second one). The second rendezvous only waits for ranks
  //! that are known to be copying, so it never needs to abort.
  void sync(bool abortable) {
    detail::LocalGroupState& g = *group_;
    std::unique_lock<std::mutex> lk(g.mu);
    if (abortable && (run_->aborted.load() || g.gone >= 0)) throw_broken_locked();
    const std::uint64_t gen = g.generation;
    if (++g.arrived == g.size) {
      g.arrived = 0;
      ++g.generation;
      lk.unlock();
      g.cv.notify_all();
      return;
    }
    if (abortable) {
      g.cv.wait(lk, [&] { return g.generation != gen || run_->aborted.load() || g.gone >= 0; });
      if (g.generation == gen) throw_broken_locked();
    } else {
      g.cv.wait(lk, [&] { return g.generation != gen; });
    }
  }

  //! Between the two rendezvous: compares every rank's slot with this rank's call. Every rank
  //! reads the same slots, so all reach the same verdict. Returns "" or the error message.
  std::string find_mismatch(detail::LocalOp op) const noexcept {
    const detail::LocalSlot& mine = slot(rank_);
    for (int r = 0; r < size(); ++r) {
      const detail::LocalSlot& o = slot(r);
      const bool same_size =
          op == detail::LocalOp::barrier || op == detail::LocalOp::split ||
          (o.bytes == mine.bytes && (op != detail::LocalOp::all_reduce || o.reduce == mine.reduce));
      if (o.op == op && same_size) continue;
      try {
        std::ostringstream os;
        os << "qcoll::LocalTransport::" << detail::local_op_name(op)
           << ": ranks disagree on the collective: rank " << rank_ << " called " << detail::local_op_name(op)
           << describe(mine) << ", rank " << r << " called " << detail::local_op_name(o.op) << describe(o);
        return os.str();
      } catch (...) {
        return "qcoll::LocalTransport: ranks disagree on the collective";
      }
    }
    return std::string();
  }

  static std::string describe(const detail::LocalSlot& s) {
    std::ostringstream os;
    if (s.op == detail::LocalOp::all_gather || s.op == detail::LocalOp::all_to_all)
      os << " with bytes_per_rank = " << s.bytes;
    else if (s.op == detail::LocalOp::all_reduce)
      os << " with count = " << s.bytes << ", op = " << s.reduce;
    return os.str();
  }

  int rank_ = 0;
  int intra_peers_ = 0;
  int inter_peers_ = 0;
  std::shared_ptr<detail::LocalGroupState> group_;
  std::shared_ptr<detail::LocalRunState> run_;
  ByteCounters counters_;
};

//! A group of `world` ranks run as threads of this process.
class LocalGroup {
 public:
  //! `world` ranks in [1, 1024]; `node_id_of_rank` gives each rank's node id (ids in
  //! [0, INT_MAX], any placement); empty puts every rank on node 0.
  explicit LocalGroup(int world, std::vector<long long> node_id_of_rank = {}) : world_(world) {
    QCOLL_REQUIRE(world >= 1 && world <= 1024, "LocalGroup", "world", world,
                  "is outside [1, limit], limit =", 1024);
    nodes_ = detail::make_node_table("LocalGroup", node_id_of_rank, world);
  }

  //! Number of ranks.
  int size() const noexcept { return world_; }

  //! Calls f(LocalTransport&) on `size()` new threads at once (rank r on thread r; f must be
  //! safe to call concurrently) and joins them. Each call starts from fresh state.
  //!
  //! If a rank fails (an exception leaves f), every rank blocked in, or later entering, a
  //! collective of this run (any group or sub-group) throws qcoll::Error
  //! "qcoll: peer rank R failed: <message>" instead of hanging, R being the rank that failed
  //! first in time. A rank that returns from f while peers wait for it in a collective of a
  //! group it belongs to makes those peers throw as well. After joining all threads, run()
  //! rethrows the original exception object of that first failing rank R (the root cause, and
  //! the rank named in its peers' messages; when several ranks fail independently at about the
  //! same time, whichever recorded its failure first); the other ranks' exceptions are dropped.
  //! A thread that cannot be started counts as a failure of its rank (std::system_error).
  template <class F>
  void run(F&& f) {
    auto state = std::make_shared<detail::LocalRunState>(world_);
    std::vector<int> ranks(static_cast<std::size_t>(world_));
    for (int r = 0; r < world_; ++r) ranks[static_cast<std::size_t>(r)] = r;
    auto top = std::make_shared<detail::LocalGroupState>(std::move(ranks), nodes_);
    state->add_group(top);

    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(world_));
    try {
      for (int r = 0; r < world_; ++r) {
        threads.emplace_back([&f, r, state, top] {
          try {
            LocalTransport t(r, top, state);
            f(t);
            state->returned(r);
          } catch (const detail::LocalPeerFailure& e) {
            // A failure of this run's peers, unless the run was never aborted (then it came from
            // elsewhere, e.g. a nested run, and counts as this rank's own failure).
            state->fail(r, std::current_exception(), !state->aborted.load(), e.what());
          } catch (const std::exception& e) {
            state->fail(r, std::current_exception(), true, e.what());
          } catch (...) {
            state->fail(r, std::current_exception(), true, "unknown exception");
          }
        });
      }
    } catch (const std::exception& e) {
      state->fail(static_cast<int>(threads.size()), std::current_exception(), true, e.what());
    }
    for (auto& t : threads) t.join();

    // No lock needed: every thread that could write the state has been joined.
    if (state->first_failure >= 0)
      std::rethrow_exception(state->errors[static_cast<std::size_t>(state->first_failure)]);
  }

 private:
  int world_;
  std::vector<int> nodes_;
};

QCOLL_NAMESPACE_END
