// qcoll-emu runtime: streams, events, graphs, memory and the block scheduler behind
// tests/emu/include/cuda_runtime.h. Test-only.
//
// Execution model
//   - Every stream (the legacy default stream, each host thread's per-thread stream, every
//     cudaStreamCreate*) is an in-order queue drained by its own OS thread, so kernels of different
//     streams run concurrently and may wait for each other through device memory (cuda_local).
//     An operation on the legacy stream first waits for the work already enqueued on every
//     blocking stream, and work on a blocking stream waits for the legacy stream's, as in CUDA.
//   - A kernel's blocks run one after the other on the stream's thread. The threads of a block
//     are fibers with their own stacks, switched cooperatively: a fiber runs until it reaches a
//     __syncthreads, a warp collective, a poll (atomic_ref load, clock read) or its end.
//     __shared__ variables are `static thread_local`: one copy per stream thread, which runs one
//     block at a time.
//   - Detectors (each reports the kernel, its launch site, the block and the source line, then
//     ends the process with status 70): a __syncthreads that a thread of the block never reaches
//     (it exited, or waits at another __syncthreads or another barrier kind); a warp collective
//     called by a lane its mask does not name, whose mask names a lane that exited or never
//     arrives (it waits elsewhere), that mixes sites, operations or masks, or that reads a lane
//     outside the mask; a block whose threads all wait with none able to continue; __trap().
//   - Graph capture records operations as nodes that depend on the previous operation of their
//     stream (and on events recorded in the capture); a replay runs the nodes in an order that
//     respects exactly those dependencies and otherwise prefers the latest-captured node, so a
//     missing dependency changes the order of execution.

#include <cuda_runtime.h>

#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// ---------------------------------------------------------------------------------------------
// Context switch
// ---------------------------------------------------------------------------------------------

#if defined(__x86_64__)
extern "C" void qcoll_emu_switch(void** save_sp, void* load_sp);
extern "C" void qcoll_emu_fiber_entry();
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores
// the stack pointer in *save_sp, and resumes the context whose stack pointer is load_sp.
asm(R"(
  .text
  .globl qcoll_emu_switch
  .type qcoll_emu_switch,@function
qcoll_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size qcoll_emu_switch, .-qcoll_emu_switch

  .globl qcoll_emu_fiber_entry
  .type qcoll_emu_fiber_entry,@function
qcoll_emu_fiber_entry:
  movq %r12, %rdi
  andq $-16, %rsp
  callq *%r13
  ud2
  .size qcoll_emu_fiber_entry, .-qcoll_emu_fiber_entry
)");
#endif

namespace qcoll_emu {
namespace detail {

__thread ThreadCoords* tl_coords = nullptr;

namespace {

[[noreturn]] void fatal(const std::string& msg) {
  std::fprintf(stderr, "qcoll-emu: %s\n", msg.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(70);
}

std::string hex(unsigned v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

std::string lanes(unsigned m) {
  std::string s;
  for (int i = 0; i < 32; ++i)
    if ((m >> i) & 1u) {
      int j = i;
      while (j + 1 < 32 && ((m >> (j + 1)) & 1u)) ++j;
      if (!s.empty()) s += ",";
      s += std::to_string(i);
      if (j > i) s += "-" + std::to_string(j);
      i = j;
    }
  return s.empty() ? "none" : s;
}

std::string site(const char* file, int line) { return std::string(file) + ":" + std::to_string(line); }

bool same_site(const char* f1, int l1, const char* f2, int l2) {
  return l1 == l2 && (f1 == f2 || std::strcmp(f1, f2) == 0);
}

// ---------------------------------------------------------------------------------------------
// Fibers and the block scheduler
// ---------------------------------------------------------------------------------------------

constexpr std::size_t kStackBytes = 128 * 1024;
constexpr std::size_t kGuardBytes = 4096;
constexpr int kMaxThreads = 1024;

//! Stacks for the fibers of one block, reused by later kernels (a free list shared by all
//! stream threads).
struct StackSet {
  std::vector<char*> stacks;
  char* get(int i) {
    while (static_cast<int>(stacks.size()) <= i) {
      void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
      if (p == MAP_FAILED) fatal("cannot map a fiber stack");
      if (mprotect(p, kGuardBytes, PROT_NONE) != 0) fatal("cannot protect a fiber stack's guard page");
      stacks.push_back(static_cast<char*>(p) + kGuardBytes);
    }
    return stacks[static_cast<std::size_t>(i)];
  }
};
std::mutex& stack_mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::vector<StackSet*>& stack_pool() {
  static auto* v = new std::vector<StackSet*>;
  return *v;
}
StackSet* acquire_stacks() {
  std::lock_guard<std::mutex> lk(stack_mu());
  if (stack_pool().empty()) return new StackSet;
  StackSet* s = stack_pool().back();
  stack_pool().pop_back();
  return s;
}
void release_stacks(StackSet* s) {
  std::lock_guard<std::mutex> lk(stack_mu());
  stack_pool().push_back(s);
}

enum class FiberState { ready, barrier, warp, done };

struct Fiber {
  void* sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  ThreadCoords coords{};
  FiberState state = FiberState::ready;
  int index = 0;  // linear thread index in the block
  const char* file = nullptr;
  int line = 0;
  int bar_pred = 0, bar_result = 0;
  std::uint64_t value = 0, result = 0;
  int arg = 0;  // this lane's source lane, delta or lane mask (may differ between lanes)
  unsigned spins = 0;
};

struct WarpPending {
  WarpOp op;
  unsigned mask, arrived;
  int width;
  const char* file;
  int line;
};

struct KernelLaunch {
  const char* file;
  int line;
  dim3 grid, block;
  std::string signature;
  std::function<void()> body;
};

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::shfl: return "__shfl_sync";
    case WarpOp::shfl_up: return "__shfl_up_sync";
    case WarpOp::shfl_down: return "__shfl_down_sync";
    case WarpOp::shfl_xor: return "__shfl_xor_sync";
    case WarpOp::any: return "__any_sync";
    case WarpOp::all: return "__all_sync";
    case WarpOp::ballot: return "__ballot_sync";
    case WarpOp::syncwarp: return "__syncwarp";
  }
  return "?";
}
const char* bar_name(BarrierOp op) {
  switch (op) {
    case BarrierOp::sync: return "__syncthreads";
    case BarrierOp::sync_or: return "__syncthreads_or";
    case BarrierOp::sync_and: return "__syncthreads_and";
    case BarrierOp::sync_count: return "__syncthreads_count";
  }
  return "?";
}

struct BlockRun {
  const KernelLaunch* kernel = nullptr;
  uint3 block_idx{};
  std::vector<Fiber> fibers;
  int n = 0, exited = 0;
  Fiber* cur = nullptr;
  void* sched_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t sched_uc;
#endif
  // the barrier being filled
  int bar_count = 0, bar_acc = 0;
  BarrierOp bar_op = BarrierOp::sync;
  const char* bar_file = nullptr;
  int bar_line = 0;
  std::vector<std::vector<WarpPending>> warps;
  std::vector<unsigned> warp_exited;  // lanes of each warp that have exited

  std::string where() const {
    std::ostringstream os;
    os << "kernel launched at " << kernel->file << ":" << kernel->line << " (" << kernel->signature
       << "), block (" << block_idx.x << "," << block_idx.y << "," << block_idx.z << ") of " << n
       << " threads";
    return os.str();
  }
  std::string thread_name(const Fiber& f) const {
    std::ostringstream os;
    os << "thread " << f.index << " (warp " << f.index / 32 << ", lane " << f.index % 32 << ")";
    return os.str();
  }
  std::string doing(const Fiber& f) const {
    switch (f.state) {
      case FiberState::done: return "has exited";
      case FiberState::ready: return "is runnable";
      case FiberState::barrier: return std::string("waits at a barrier at ") + site(f.file, f.line);
      case FiberState::warp: return std::string("waits in a warp collective at ") + site(f.file, f.line);
    }
    return "?";
  }
};

__thread BlockRun* tl_block = nullptr;

void to_scheduler(BlockRun& b, Fiber& me) {
#if defined(__x86_64__)
  qcoll_emu_switch(&me.sp, b.sched_sp);
#else
  swapcontext(&me.uc, &b.sched_uc);
#endif
}

void check_warp_exit(BlockRun& b, const Fiber& me) {
  const int w = me.index / 32, lane = me.index % 32;
  for (const WarpPending& p : b.warps[static_cast<std::size_t>(w)])
    if ((p.mask >> lane) & 1u)
      fatal(b.where() + ": " + b.thread_name(me) + " exited, but lanes " + lanes(p.arrived) +
            " wait for it in " + op_name(p.op) + " at " + site(p.file, p.line) + " (mask " + hex(p.mask) +
            ")");
}

void fiber_main(void* arg) {
  BlockRun& b = *tl_block;
  Fiber& me = *static_cast<Fiber*>(arg);
  b.kernel->body();
  me.state = FiberState::done;
  ++b.exited;
  b.warp_exited[static_cast<std::size_t>(me.index / 32)] |= 1u << (me.index % 32);
  if (b.bar_count > 0)
    fatal(b.where() + ": " + b.thread_name(me) + " exited while " + std::to_string(b.bar_count) + " of " +
          std::to_string(b.n) + " threads wait at " + bar_name(b.bar_op) + " at " +
          site(b.bar_file, b.bar_line) + " (a barrier every thread of the block must reach)");
  check_warp_exit(b, me);
  to_scheduler(b, me);
  fatal("a finished fiber was resumed");
}

#if !defined(__x86_64__)
void fiber_main_uc(unsigned hi, unsigned lo) {
  fiber_main(reinterpret_cast<void*>((static_cast<std::uintptr_t>(hi) << 32) | lo));
}
#endif

void start_fiber(Fiber& f, char* stack) {
#if defined(__x86_64__)
  auto* top = reinterpret_cast<std::uint64_t*>(stack + kStackBytes - 64);
  top -= 8;
  top[0] = 0x037F00001F80ull;  // MXCSR (default) | x87 control word (default) << 32
  top[1] = 0;                  // r15
  top[2] = 0;                  // r14
  top[3] = reinterpret_cast<std::uint64_t>(&fiber_main);  // r13: function
  top[4] = reinterpret_cast<std::uint64_t>(&f);           // r12: argument
  top[5] = 0;                                             // rbx
  top[6] = 0;                                             // rbp
  top[7] = reinterpret_cast<std::uint64_t>(&qcoll_emu_fiber_entry);
  f.sp = top;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = stack;
  f.uc.uc_stack.ss_size = kStackBytes;
  f.uc.uc_link = nullptr;
  const auto v = reinterpret_cast<std::uintptr_t>(&f);
  makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_main_uc), 2, static_cast<unsigned>(v >> 32),
              static_cast<unsigned>(v));
#endif
}

[[noreturn]] void report_stuck(BlockRun& b) {
  std::ostringstream os;
  os << b.where() << ": every remaining thread waits and none can continue (deadlock).";
  if (b.bar_count > 0)
    os << " " << b.bar_count << " of " << b.n << " threads wait at " << bar_name(b.bar_op) << " at "
       << site(b.bar_file, b.bar_line) << ".";
  for (std::size_t w = 0; w < b.warps.size(); ++w)
    for (const WarpPending& p : b.warps[w]) {
      os << " Warp " << w << ": lanes " << lanes(p.arrived) << " wait in " << op_name(p.op) << " at "
         << site(p.file, p.line) << " with mask " << hex(p.mask) << ", lanes " << lanes(p.mask & ~p.arrived)
         << " never arrive";
      for (int l = 0; l < 32; ++l)
        if (((p.mask & ~p.arrived) >> l) & 1u) {
          const Fiber& f = b.fibers[w * 32 + static_cast<std::size_t>(l)];
          os << " (lane " << l << " " << b.doing(f) << ")";
          break;
        }
      os << ".";
    }
  fatal(os.str());
}

void run_block(BlockRun& b, StackSet& stacks) {
  tl_block = &b;
  for (int i = 0; i < b.n; ++i) start_fiber(b.fibers[static_cast<std::size_t>(i)], stacks.get(i));
  for (;;) {
    bool ran = false, all_done = true;
    for (Fiber& f : b.fibers) {
      if (f.state == FiberState::ready) {
        ran = true;
        b.cur = &f;
        tl_coords = &f.coords;
#if defined(__x86_64__)
        qcoll_emu_switch(&b.sched_sp, f.sp);
#else
        swapcontext(&b.sched_uc, &f.uc);
#endif
        tl_coords = nullptr;
        b.cur = nullptr;
      }
      all_done = all_done && f.state == FiberState::done;
    }
    if (all_done) break;
    if (!ran) report_stuck(b);
  }
  tl_block = nullptr;
}

void run_kernel(const KernelLaunch& k) {
  const int n = static_cast<int>(k.block.x * k.block.y * k.block.z);
  StackSet* stacks = acquire_stacks();
  BlockRun b;
  b.kernel = &k;
  b.n = n;
  b.fibers.resize(static_cast<std::size_t>(n));
  b.warps.resize(static_cast<std::size_t>((n + 31) / 32));
  b.warp_exited.resize(b.warps.size());
  for (unsigned z = 0; z < k.grid.z; ++z)
    for (unsigned y = 0; y < k.grid.y; ++y)
      for (unsigned x = 0; x < k.grid.x; ++x) {
        b.block_idx = uint3{x, y, z};
        b.exited = 0;
        b.bar_count = 0;
        std::fill(b.warp_exited.begin(), b.warp_exited.end(), 0u);
        for (int i = 0; i < n; ++i) {
          Fiber& f = b.fibers[static_cast<std::size_t>(i)];
          f.state = FiberState::ready;
          f.index = i;
          f.spins = 0;
          const unsigned u = static_cast<unsigned>(i);
          f.coords =
              ThreadCoords{uint3{u % k.block.x, u / k.block.x % k.block.y, u / (k.block.x * k.block.y)},
                           b.block_idx, k.block, k.grid};
        }
        run_block(b, *stacks);
      }
  release_stacks(stacks);
}

BlockRun& in_kernel(const char* what) {
  if (tl_block == nullptr || tl_block->cur == nullptr) outside_kernel(what);
  return *tl_block;
}

}  // namespace

void outside_kernel(const char* what) { fatal(std::string(what) + " used outside a kernel"); }

int block_barrier(BarrierOp op, int predicate, const char* file, int line) {
  BlockRun& b = in_kernel("__syncthreads");
  Fiber& me = *b.cur;
  if (b.exited > 0) {
    for (const Fiber& f : b.fibers)
      if (f.state == FiberState::done)
        fatal(b.where() + ": " + b.thread_name(me) + " reaches " + bar_name(op) + " at " + site(file, line) +
              " but " + b.thread_name(f) + " has exited (a barrier every thread of the block must reach)");
  }
  if (b.bar_count == 0) {
    b.bar_op = op;
    b.bar_file = file;
    b.bar_line = line;
    b.bar_acc = op == BarrierOp::sync_and ? 1 : 0;
  } else if (b.bar_op != op || !same_site(b.bar_file, b.bar_line, file, line)) {
    fatal(b.where() + ": divergent barriers: " + b.thread_name(me) + " reaches " + bar_name(op) + " at " +
          site(file, line) + " while " + std::to_string(b.bar_count) + " threads wait at " +
          bar_name(b.bar_op) + " at " + site(b.bar_file, b.bar_line));
  }
  const int w = me.index / 32, lane = me.index % 32;
  for (const WarpPending& p : b.warps[static_cast<std::size_t>(w)])
    if ((p.mask >> lane) & 1u)
      fatal(b.where() + ": " + b.thread_name(me) + " reaches " + bar_name(op) + " at " + site(file, line) +
            " while lanes " + lanes(p.arrived) + " of its warp wait for it in " + op_name(p.op) + " at " +
            site(p.file, p.line));
  switch (op) {
    case BarrierOp::sync: break;
    case BarrierOp::sync_or: b.bar_acc |= predicate; break;
    case BarrierOp::sync_and: b.bar_acc &= predicate; break;
    case BarrierOp::sync_count: b.bar_acc += predicate; break;
  }
  me.state = FiberState::barrier;
  me.file = file;
  me.line = line;
  if (++b.bar_count == b.n) {
    for (Fiber& f : b.fibers) {
      f.state = FiberState::ready;
      f.bar_result = b.bar_acc;
    }
    b.bar_count = 0;
    return b.bar_acc;
  }
  to_scheduler(b, me);
  return me.bar_result;
}

std::uint64_t warp_collective(WarpOp op, unsigned mask, std::uint64_t value, int arg, int width,
                              const char* file, int line) {
  BlockRun& b = in_kernel(op_name(op));
  Fiber& me = *b.cur;
  const int w = me.index / 32, lane = me.index % 32;
  const int in_warp = std::min(32, b.n - w * 32);
  const unsigned exists = in_warp == 32 ? 0xffffffffu : ((1u << in_warp) - 1u);
  const auto call = [&] {
    return std::string(op_name(op)) + " at " + site(file, line) + " with mask " + hex(mask);
  };
  if (((mask >> lane) & 1u) == 0)
    fatal(b.where() + ": " + b.thread_name(me) + " calls " + call() + ", which does not name it");
  if ((mask & ~exists) != 0)
    fatal(b.where() + ": " + b.thread_name(me) + " calls " + call() + ", which names lanes " +
          lanes(mask & ~exists) + " that do not exist in this block");
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    fatal(b.where() + ": " + call() + ": width " + std::to_string(width) + " is not a power of two up to 32");
  if ((mask & b.warp_exited[static_cast<std::size_t>(w)]) != 0)
    fatal(b.where() + ": " + b.thread_name(me) + " calls " + call() + ", but lanes " +
          lanes(mask & b.warp_exited[static_cast<std::size_t>(w)]) + " named in the mask have exited");
  auto& pending = b.warps[static_cast<std::size_t>(w)];
  WarpPending* p = nullptr;
  for (WarpPending& q : pending)
    if ((q.mask & mask) != 0) {
      if (q.mask != mask || q.op != op || q.width != width || !same_site(q.file, q.line, file, line))
        fatal(b.where() + ": " + b.thread_name(me) + " calls " + call() + " while lanes " + lanes(q.arrived) +
              " of its warp wait in " + op_name(q.op) + " at " + site(q.file, q.line) + " with mask " +
              hex(q.mask) + (q.op == op && q.line == line ? " (same site, different mask or operand)" : ""));
      p = &q;
      break;
    }
  if (p == nullptr) {
    pending.push_back(WarpPending{op, mask, 0u, width, file, line});
    p = &pending.back();
  }
  me.value = value;
  me.arg = arg;
  me.state = FiberState::warp;
  me.file = file;
  me.line = line;
  p->arrived |= 1u << lane;
  if (p->arrived == mask) {
    Fiber* lane0 = &b.fibers[static_cast<std::size_t>(w * 32)];
    std::uint64_t vote = op == WarpOp::all ? 1 : 0;
    unsigned ballot = 0;
    for (int l = 0; l < 32; ++l)
      if ((mask >> l) & 1u) {
        const bool v = lane0[l].value != 0;
        ballot |= (v ? 1u : 0u) << l;
        if (op == WarpOp::any) vote |= v ? 1 : 0;
        if (op == WarpOp::all) vote &= v ? 1 : 0;
      }
    for (int l = 0; l < 32; ++l) {
      if (((mask >> l) & 1u) == 0) continue;
      Fiber& f = lane0[l];
      int src = l;
      const int seg = l & ~(width - 1), pos = l & (width - 1);
      switch (op) {
        case WarpOp::shfl: src = seg + (f.arg & (width - 1)); break;
        case WarpOp::shfl_up: src = pos >= f.arg ? l - f.arg : l; break;
        case WarpOp::shfl_down: src = pos + f.arg < width ? l + f.arg : l; break;
        case WarpOp::shfl_xor: src = ((l ^ f.arg) & ~(width - 1)) == seg ? (l ^ f.arg) : l; break;
        default: break;
      }
      if (((mask >> src) & 1u) == 0)
        fatal(b.where() + ": lane " + std::to_string(l) + " of warp " + std::to_string(w) + " reads lane " +
              std::to_string(src) + " in " + call() + ", but lane " + std::to_string(src) +
              " is not in the mask (its value is undefined)");
      switch (op) {
        case WarpOp::any:
        case WarpOp::all: f.result = vote; break;
        case WarpOp::ballot: f.result = ballot; break;
        case WarpOp::syncwarp: f.result = 0; break;
        default: f.result = lane0[src].value; break;
      }
      f.state = FiberState::ready;
    }
    pending.erase(pending.begin() + (p - pending.data()));
    return me.result;
  }
  to_scheduler(b, me);
  return me.result;
}

void trap(const char* file, int line) {
  if (tl_block != nullptr && tl_block->cur != nullptr)
    fatal(tl_block->where() + ": " + tl_block->thread_name(*tl_block->cur) + " executed __trap() at " +
          site(file, line));
  fatal("__trap() at " + site(file, line));
}

void spin_hint() {
  BlockRun* b = tl_block;
  if (b == nullptr || b->cur == nullptr) return;
  Fiber& me = *b->cur;
  ++me.spins;
  to_scheduler(*b, me);  // stays ready: the other threads of the block run first
  if (me.spins > 64) {
    const unsigned us = std::min(me.spins - 64, 200u);
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  } else if (me.spins > 8) {
    sched_yield();
  }
}

std::uint64_t global_timer_ns_impl() {
  spin_hint();
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

// ---------------------------------------------------------------------------------------------
// Streams, events, graphs
// ---------------------------------------------------------------------------------------------

namespace {

struct StreamImpl;
struct GraphImpl;
using StreamPtr = std::shared_ptr<StreamImpl>;

struct Dep {
  StreamPtr stream;
  std::uint64_t seq;
};

struct Op {
  std::function<void()> fn;
  std::vector<Dep> deps;
};

struct GraphNode {
  std::shared_ptr<const std::function<void()>> fn;
  std::vector<int> deps;
};

struct GraphImpl {
  std::vector<GraphNode> nodes;
};

struct StreamImpl {
  bool legacy = false, blocking = true;
  std::deque<Op> queue;
  std::uint64_t enqueued = 0, completed = 0;
  bool stop = false;
  // capture
  std::shared_ptr<GraphImpl> capture;
  std::vector<int> frontier;
  cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
  std::thread::id capture_thread;
  bool capture_origin = false;
  bool capture_invalidated = false;
};

struct EventImpl {
  StreamPtr stream;
  std::uint64_t seq = 0;
  bool recorded = false;
  std::chrono::steady_clock::time_point when{};
  std::shared_ptr<GraphImpl> capture;
  std::vector<int> capture_nodes;
};

// One lock and one condition for all queues: few streams, short critical sections.
std::mutex& mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::condition_variable& cv() {
  static auto* c = new std::condition_variable;
  return *c;
}
std::vector<StreamPtr>& live_streams() {
  static auto* v = new std::vector<StreamPtr>;
  return *v;
}

thread_local cudaError_t tl_last_error = cudaSuccess;
thread_local cudaStreamCaptureMode tl_capture_mode = cudaStreamCaptureModeGlobal;

cudaError_t fail(cudaError_t e) {
  tl_last_error = e;
  return e;
}

bool deps_done(const Op& op) {
  for (const Dep& d : op.deps)
    if (d.stream->completed < d.seq) return false;
  return true;
}

void worker(StreamPtr s) {
  std::unique_lock<std::mutex> lk(mu());
  for (;;) {
    cv().wait(lk, [&] {
      return (!s->queue.empty() && deps_done(s->queue.front())) || (s->stop && s->queue.empty());
    });
    if (s->queue.empty()) break;
    Op op = std::move(s->queue.front());
    s->queue.pop_front();
    lk.unlock();
    op.fn();
    lk.lock();
    ++s->completed;
    cv().notify_all();
  }
  auto& v = live_streams();
  v.erase(std::remove(v.begin(), v.end(), s), v.end());
}

StreamPtr make_stream(bool blocking, bool legacy) {
  auto s = std::make_shared<StreamImpl>();
  s->blocking = blocking;
  s->legacy = legacy;
  {
    std::lock_guard<std::mutex> lk(mu());
    live_streams().push_back(s);
  }
  std::thread(worker, s).detach();
  return s;
}

void retire_stream(const StreamPtr& s) {
  std::lock_guard<std::mutex> lk(mu());
  s->stop = true;
  cv().notify_all();
}

StreamPtr& legacy_stream() {
  static auto* s = new StreamPtr(make_stream(true, true));
  return *s;
}

struct PerThreadStream {
  StreamPtr s;
  ~PerThreadStream() {
    if (s) retire_stream(s);
  }
};
thread_local PerThreadStream tl_per_thread;

}  // namespace
}  // namespace detail
}  // namespace qcoll_emu

struct CUstream_st {
  qcoll_emu::detail::StreamPtr impl;
};
struct CUevent_st {
  std::shared_ptr<qcoll_emu::detail::EventImpl> impl;
};
struct CUgraph_st {
  std::shared_ptr<qcoll_emu::detail::GraphImpl> impl;
};
struct CUgraphExec_st {
  std::shared_ptr<const qcoll_emu::detail::GraphImpl> graph;
  std::vector<int> order;
};

namespace qcoll_emu {
namespace detail {
namespace {

StreamPtr resolve(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy) return legacy_stream();
  if (s == cudaStreamPerThread) {
    if (!tl_per_thread.s) tl_per_thread.s = make_stream(true, false);
    return tl_per_thread.s;
  }
  return s->impl;
}

// Called with mu() held.
bool any_capture_locked(bool (*pred)(const StreamImpl&)) {
  for (const StreamPtr& s : live_streams())
    if (s->capture && pred(*s)) return true;
  return false;
}

void invalidate_locked(bool (*pred)(const StreamImpl&)) {
  for (const StreamPtr& s : live_streams())
    if (s->capture && pred(*s)) s->capture_invalidated = true;
}

thread_local std::thread::id tl_id = std::this_thread::get_id();

//! A potentially unsafe call (allocation, synchronous copy, pointer query, ...) while streams are
//! captured: prohibited by the calling thread's capture mode as CUDA defines it; the offending
//! captures are invalidated.
cudaError_t check_unsafe_call() {
  if (tl_capture_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  std::lock_guard<std::mutex> lk(mu());
  bool bad = false;
  for (const StreamPtr& s : live_streams()) {
    if (!s->capture || !s->capture_origin || s->capture_mode == cudaStreamCaptureModeRelaxed) continue;
    const bool mine = s->capture_thread == tl_id;
    if (mine ||
        (tl_capture_mode == cudaStreamCaptureModeGlobal && s->capture_mode == cudaStreamCaptureModeGlobal)) {
      s->capture_invalidated = true;
      bad = true;
    }
  }
  return bad ? fail(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

//! Enqueues fn on stream s (or records it as a graph node while s is captured).
cudaError_t enqueue(cudaStream_t handle, std::function<void()> fn) {
  StreamPtr s = resolve(handle);
  const StreamPtr& l = legacy_stream();  // created before the lock is taken
  std::lock_guard<std::mutex> lk(mu());
  if (s->capture) {
    auto& g = *s->capture;
    g.nodes.push_back(GraphNode{std::make_shared<const std::function<void()>>(std::move(fn)), s->frontier});
    s->frontier = {static_cast<int>(g.nodes.size()) - 1};
    return cudaSuccess;
  }
  Op op{std::move(fn), {}};
  if (s->legacy) {
    if (any_capture_locked([](const StreamImpl& t) { return t.blocking; })) {
      invalidate_locked([](const StreamImpl& t) { return t.blocking; });
      return fail(cudaErrorStreamCaptureImplicit);
    }
    for (const StreamPtr& t : live_streams())
      if (t != s && t->blocking && t->enqueued > t->completed) op.deps.push_back(Dep{t, t->enqueued});
  } else if (s->blocking) {
    if (l->enqueued > l->completed) op.deps.push_back(Dep{l, l->enqueued});
  }
  s->queue.push_back(std::move(op));
  ++s->enqueued;
  cv().notify_all();
  return cudaSuccess;
}

//! Waits until stream s has completed everything enqueued so far.
cudaError_t sync_stream(const StreamPtr& s) {
  std::unique_lock<std::mutex> lk(mu());
  if (s->capture) {
    s->capture_invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  if (s->legacy && any_capture_locked([](const StreamImpl& t) { return t.blocking; })) {
    invalidate_locked([](const StreamImpl& t) { return t.blocking; });
    return fail(cudaErrorStreamCaptureImplicit);
  }
  const std::uint64_t target = s->enqueued;
  cv().wait(lk, [&] { return s->completed >= target; });
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

struct Alloc {
  std::size_t bytes;
  cudaMemoryType type;
  bool owned;
};

std::mutex& mem_mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::map<std::uintptr_t, Alloc>& allocs() {
  static auto* m = new std::map<std::uintptr_t, Alloc>;
  return *m;
}
std::vector<void*>& deferred_frees() {
  static auto* v = new std::vector<void*>;
  return *v;
}
std::size_t g_device_bytes = 0;
constexpr std::size_t kTotalDeviceBytes = std::size_t{16} << 30;

//! The allocation holding p (base and record), or none.
bool find_alloc(const void* p, std::uintptr_t& base, Alloc& a) {
  std::lock_guard<std::mutex> lk(mem_mu());
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  auto it = allocs().upper_bound(u);
  if (it == allocs().begin()) return false;
  --it;
  if (u >= it->first + std::max<std::size_t>(it->second.bytes, 1)) return false;
  base = it->first;
  a = it->second;
  return true;
}

cudaMemoryType type_of(const void* p) {
  std::uintptr_t base;
  Alloc a;
  return find_alloc(p, base, a) ? a.type : cudaMemoryTypeUnregistered;
}

//! Checks that [p, p + bytes) stays inside the allocation holding p (when p is in one).
bool in_bounds(const void* p, std::size_t bytes) {
  std::uintptr_t base;
  Alloc a;
  if (!find_alloc(p, base, a)) return true;
  return reinterpret_cast<std::uintptr_t>(p) - base + bytes <= a.bytes;
}

cudaError_t allocate(void** p, std::size_t bytes, cudaMemoryType type) {
  if (p == nullptr) return fail(cudaErrorInvalidValue);
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  const std::size_t rounded = (bytes + 255) / 256 * 256;
  void* q = std::aligned_alloc(256, rounded);
  if (q == nullptr) return fail(cudaErrorMemoryAllocation);
  // Fresh device memory holds garbage, never zeros one could rely on.
  std::memset(q, 0xA5, rounded);
  std::lock_guard<std::mutex> lk(mem_mu());
  allocs()[reinterpret_cast<std::uintptr_t>(q)] = Alloc{bytes, type, true};
  if (type == cudaMemoryTypeDevice || type == cudaMemoryTypeManaged) g_device_bytes += rounded;
  *p = q;
  return cudaSuccess;
}

//! Frees the deferred allocations once no stream has work left (cudaFree does not wait for the
//! device here, so memory a queued kernel may still touch stays mapped until then).
void release_deferred() {
  {
    std::lock_guard<std::mutex> lk(mu());
    for (const StreamPtr& s : live_streams())
      if (s->enqueued != s->completed) return;
  }
  std::vector<void*> v;
  {
    std::lock_guard<std::mutex> lk(mem_mu());
    v.swap(deferred_frees());
  }
  for (void* p : v) std::free(p);
}

cudaError_t deallocate(void* p, bool host) {
  if (p == nullptr) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lk(mem_mu());
    auto it = allocs().find(reinterpret_cast<std::uintptr_t>(p));
    if (it == allocs().end() || !it->second.owned || (it->second.type == cudaMemoryTypeHost) != host)
      return fail(cudaErrorInvalidValue);
    if (it->second.type == cudaMemoryTypeDevice || it->second.type == cudaMemoryTypeManaged)
      g_device_bytes -= (it->second.bytes + 255) / 256 * 256;
    allocs().erase(it);
    deferred_frees().push_back(p);
  }
  release_deferred();
  return cudaSuccess;
}

std::function<void()> copy_op(void* dst, const void* src, std::size_t bytes) {
  return [dst, src, bytes] { std::memmove(dst, src, bytes); };
}

cudaError_t memcpy_async(void* dst, const void* src, std::size_t bytes, cudaStream_t stream, bool sync) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr || !in_bounds(dst, bytes) || !in_bounds(src, bytes))
    return fail(cudaErrorInvalidValue);
  const bool src_pageable = type_of(src) == cudaMemoryTypeUnregistered;
  const bool dst_pageable = type_of(dst) == cudaMemoryTypeUnregistered;
  StreamPtr s = resolve(stream);
  bool capturing;
  {
    std::lock_guard<std::mutex> lk(mu());
    capturing = static_cast<bool>(s->capture);
    if (capturing && (src_pageable || dst_pageable)) {
      s->capture_invalidated = true;
      return fail(cudaErrorStreamCaptureUnsupported);  // pageable memory cannot be captured
    }
  }
  if (src_pageable && dst_pageable) {
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  }
  cudaError_t e;
  if (src_pageable) {
    // Staged at the call: the caller may reuse its buffer as soon as the call returns.
    auto staged = std::make_shared<std::vector<unsigned char>>(
        static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + bytes);
    e = enqueue(stream, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
  } else {
    e = enqueue(stream, copy_op(dst, src, bytes));
  }
  if (e != cudaSuccess) return e;
  // A copy into pageable memory returns once it is complete, as a synchronous copy does.
  if (sync || dst_pageable) return sync_stream(s);
  return cudaSuccess;
}

}  // namespace

void enqueue_kernel(const char* file, int line, dim3 grid, dim3 block, std::size_t shmem, cudaStream_t stream,
                    const char* signature, std::function<void()> body) {
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || threads > kMaxThreads || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || grid.x > 0x7fffffffu) {
    fail(cudaErrorInvalidConfiguration);
    return;
  }
  if (shmem != 0) fatal("dynamic shared memory (launch at " + site(file, line) + ") is not emulated");
  std::string sig = signature;
  const auto at = sig.find("[with P = {");
  if (at != std::string::npos) sig = "kernel(" + sig.substr(at + 11, sig.size() - at - 13) + ")";
  auto k =
      std::make_shared<KernelLaunch>(KernelLaunch{file, line, grid, block, std::move(sig), std::move(body)});
  (void)enqueue(stream, [k] { run_kernel(*k); });
}

}  // namespace detail
}  // namespace qcoll_emu

using namespace qcoll_emu::detail;

// ---------------------------------------------------------------------------------------------
// Runtime API
// ---------------------------------------------------------------------------------------------

cudaError_t cudaGetLastError() {
  const cudaError_t e = tl_last_error;
  tl_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return tl_last_error; }

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
#define QCOLL_EMU_NAME(x) \
  case x: return #x;
    QCOLL_EMU_NAME(cudaSuccess)
    QCOLL_EMU_NAME(cudaErrorInvalidValue)
    QCOLL_EMU_NAME(cudaErrorMemoryAllocation)
    QCOLL_EMU_NAME(cudaErrorInvalidConfiguration)
    QCOLL_EMU_NAME(cudaErrorInvalidDevice)
    QCOLL_EMU_NAME(cudaErrorInvalidResourceHandle)
    QCOLL_EMU_NAME(cudaErrorNotReady)
    QCOLL_EMU_NAME(cudaErrorHostMemoryAlreadyRegistered)
    QCOLL_EMU_NAME(cudaErrorHostMemoryNotRegistered)
    QCOLL_EMU_NAME(cudaErrorLaunchFailure)
    QCOLL_EMU_NAME(cudaErrorStreamCaptureUnsupported)
    QCOLL_EMU_NAME(cudaErrorStreamCaptureInvalidated)
    QCOLL_EMU_NAME(cudaErrorStreamCaptureUnmatched)
    QCOLL_EMU_NAME(cudaErrorStreamCaptureUnjoined)
    QCOLL_EMU_NAME(cudaErrorStreamCaptureImplicit)
    QCOLL_EMU_NAME(cudaErrorStreamCaptureWrongThread)
#undef QCOLL_EMU_NAME
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return "qcoll-emu error";
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return fail(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return fail(cudaErrorInvalidValue);
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice); }

// The emulated device: compute capability 9.0, 4 SMs of 2048 threads (few SMs, so the kernels'
// grid-stride loops run more than once at small sizes).
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr) return fail(cudaErrorInvalidValue);
  if (device != 0) return fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = 4; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
    default: return fail(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return fail(cudaErrorInvalidValue);
  if (device != 0) return fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "qcoll-emu (CPU emulation)");
  prop->totalGlobalMem = kTotalDeviceBytes;
  prop->sharedMemPerBlock = 48 * 1024;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->multiProcessorCount = 4;
  prop->major = 9;
  prop->minor = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  {
    std::unique_lock<std::mutex> lk(mu());
    if (tl_capture_mode != cudaStreamCaptureModeRelaxed && any_capture_locked([](const StreamImpl& s) {
          return s.capture_mode != cudaStreamCaptureModeRelaxed;
        }))
      return fail(cudaErrorStreamCaptureUnsupported);
    std::vector<std::pair<StreamPtr, std::uint64_t>> targets;
    for (const StreamPtr& s : live_streams()) targets.emplace_back(s, s->enqueued);
    cv().wait(lk, [&] {
      for (const auto& t : targets)
        if (t.first->completed < t.second) return false;
      return true;
    });
  }
  release_deferred();
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lk(mem_mu());
  *total_bytes = kTotalDeviceBytes;
  *free_bytes = kTotalDeviceBytes > g_device_bytes ? kTotalDeviceBytes - g_device_bytes : 0;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  if (const cudaError_t e = check_unsafe_call()) return e;
  return allocate(p, bytes, cudaMemoryTypeDevice);
}
cudaError_t cudaMallocManaged(void** p, std::size_t bytes, unsigned) {
  if (const cudaError_t e = check_unsafe_call()) return e;
  return allocate(p, bytes, cudaMemoryTypeManaged);
}
cudaError_t cudaMallocHost(void** p, std::size_t bytes) {
  if (const cudaError_t e = check_unsafe_call()) return e;
  return allocate(p, bytes, cudaMemoryTypeHost);
}
cudaError_t cudaHostAlloc(void** p, std::size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
cudaError_t cudaMallocAsync(void** p, std::size_t bytes, cudaStream_t) {
  return allocate(p, bytes, cudaMemoryTypeDevice);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  if (p == nullptr) return cudaSuccess;
  if (type_of(p) != cudaMemoryTypeDevice) return fail(cudaErrorInvalidValue);
  return enqueue(stream, [p] { (void)deallocate(p, false); });
}
cudaError_t cudaFree(void* p) {
  if (const cudaError_t e = check_unsafe_call()) return e;
  return deallocate(p, false);
}
cudaError_t cudaFreeHost(void* p) {
  if (const cudaError_t e = check_unsafe_call()) return e;
  return deallocate(p, true);
}
cudaError_t cudaHostRegister(void* p, std::size_t bytes, unsigned) {
  if (const cudaError_t e = check_unsafe_call()) return e;
  if (p == nullptr || bytes == 0) return fail(cudaErrorInvalidValue);
  if (type_of(p) != cudaMemoryTypeUnregistered) return fail(cudaErrorHostMemoryAlreadyRegistered);
  std::lock_guard<std::mutex> lk(mem_mu());
  allocs()[reinterpret_cast<std::uintptr_t>(p)] = Alloc{bytes, cudaMemoryTypeHost, false};
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* p) {
  if (const cudaError_t e = check_unsafe_call()) return e;
  std::lock_guard<std::mutex> lk(mem_mu());
  auto it = allocs().find(reinterpret_cast<std::uintptr_t>(p));
  if (it == allocs().end() || it->second.owned) return fail(cudaErrorHostMemoryNotRegistered);
  allocs().erase(it);
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  if (attr == nullptr) return fail(cudaErrorInvalidValue);
  if (const cudaError_t e = check_unsafe_call()) return e;
  const cudaMemoryType t = type_of(p);
  attr->type = t;
  attr->device = t == cudaMemoryTypeUnregistered ? -2 : 0;
  attr->devicePointer = t == cudaMemoryTypeUnregistered ? nullptr : const_cast<void*>(p);
  attr->hostPointer =
      (t == cudaMemoryTypeHost || t == cudaMemoryTypeManaged) ? const_cast<void*>(p) : nullptr;
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind) {
  if (const cudaError_t e = check_unsafe_call()) return e;
  return memcpy_async(dst, src, bytes, nullptr, true);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind,
                            cudaStream_t stream) {
  return memcpy_async(dst, src, bytes, stream, false);
}
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (p == nullptr || type_of(p) == cudaMemoryTypeUnregistered || !in_bounds(p, bytes))
    return fail(cudaErrorInvalidValue);
  return enqueue(stream, [p, value, bytes] { std::memset(p, value, bytes); });
}
cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  if (const cudaError_t e = check_unsafe_call()) return e;
  const cudaError_t e = cudaMemsetAsync(p, value, bytes, nullptr);
  // Asynchronous except for pinned host memory, as in CUDA.
  if (e == cudaSuccess && type_of(p) == cudaMemoryTypeHost) return sync_stream(legacy_stream());
  return e;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  if (stream == nullptr) return fail(cudaErrorInvalidValue);
  *stream = new CUstream_st{make_stream((flags & cudaStreamNonBlocking) == 0, false)};
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread)
    return fail(cudaErrorInvalidResourceHandle);
  // Work already enqueued still runs; the stream's thread ends after it.
  retire_stream(stream->impl);
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return sync_stream(resolve(stream)); }
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  StreamPtr s = resolve(stream);
  std::lock_guard<std::mutex> lk(mu());
  if (s->capture) {
    s->capture_invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  return s->completed == s->enqueued ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
  if (event == nullptr) return fail(cudaErrorInvalidValue);
  *event = new CUevent_st{std::make_shared<EventImpl>()};
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (event == nullptr) return fail(cudaErrorInvalidResourceHandle);
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == nullptr) return fail(cudaErrorInvalidResourceHandle);
  StreamPtr s = resolve(stream);
  std::shared_ptr<EventImpl> e = event->impl;
  {
    std::lock_guard<std::mutex> lk(mu());
    if (s->capture) {
      e->capture = s->capture;
      e->capture_nodes = s->frontier;
      return cudaSuccess;
    }
    e->capture.reset();
  }
  const cudaError_t err = enqueue(stream, [e] { e->when = std::chrono::steady_clock::now(); });
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lk(mu());
  e->stream = s;
  e->seq = s->enqueued;
  e->recorded = true;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event == nullptr) return fail(cudaErrorInvalidResourceHandle);
  std::shared_ptr<EventImpl> e = event->impl;
  std::unique_lock<std::mutex> lk(mu());
  if (e->capture) return fail(cudaErrorStreamCaptureUnsupported);
  if (!e->recorded) return cudaSuccess;
  cv().wait(lk, [&] { return e->stream->completed >= e->seq; });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (event == nullptr) return fail(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> lk(mu());
  const auto& e = event->impl;
  if (e->capture) return fail(cudaErrorStreamCaptureUnsupported);
  return !e->recorded || e->stream->completed >= e->seq ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == nullptr || start == nullptr || end == nullptr) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lk(mu());
  for (const auto* e : {start->impl.get(), end->impl.get()}) {
    if (!e->recorded) return fail(cudaErrorInvalidResourceHandle);
    if (e->stream->completed < e->seq) return fail(cudaErrorNotReady);
  }
  *ms = std::chrono::duration<float, std::milli>(end->impl->when - start->impl->when).count();
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
  if (event == nullptr) return fail(cudaErrorInvalidResourceHandle);
  StreamPtr s = resolve(stream);
  std::shared_ptr<EventImpl> e = event->impl;
  {
    std::lock_guard<std::mutex> lk(mu());
    if (e->capture) {
      // A captured event forks or joins a capture: the stream's next node depends on it.
      if (s->capture && s->capture != e->capture) return fail(cudaErrorStreamCaptureUnsupported);
      if (!s->capture) {
        if (s->legacy) return fail(cudaErrorStreamCaptureImplicit);
        s->capture = e->capture;
        s->frontier.clear();
        s->capture_origin = false;
        s->capture_invalidated = false;
        s->capture_mode = cudaStreamCaptureModeRelaxed;
      }
      for (int n : e->capture_nodes)
        if (std::find(s->frontier.begin(), s->frontier.end(), n) == s->frontier.end())
          s->frontier.push_back(n);
      return cudaSuccess;
    }
    if (s->capture) {
      s->capture_invalidated = true;  // a captured stream cannot wait for work outside the graph
      return fail(cudaErrorStreamCaptureUnsupported);
    }
    if (!e->recorded) return cudaSuccess;
  }
  StreamPtr from = e->stream;
  const std::uint64_t seq = e->seq;
  std::lock_guard<std::mutex> lk(mu());
  s->queue.push_back(Op{[] {}, {Dep{from, seq}}});
  ++s->enqueued;
  cv().notify_all();
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  StreamPtr s = resolve(stream);
  std::lock_guard<std::mutex> lk(mu());
  if (s->legacy) return fail(cudaErrorStreamCaptureUnsupported);
  if (s->capture) return fail(cudaErrorInvalidValue);
  s->capture = std::make_shared<GraphImpl>();
  s->frontier.clear();
  s->capture_mode = mode;
  s->capture_thread = tl_id;
  s->capture_origin = true;
  s->capture_invalidated = false;
  return cudaSuccess;
}

namespace {
void ancestors(const GraphImpl& g, int n, std::set<int>& seen) {
  if (!seen.insert(n).second) return;
  for (int d : g.nodes[static_cast<std::size_t>(n)].deps) ancestors(g, d, seen);
}
}  // namespace

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (graph == nullptr) return fail(cudaErrorInvalidValue);
  *graph = nullptr;
  StreamPtr s = resolve(stream);
  std::lock_guard<std::mutex> lk(mu());
  if (!s->capture || !s->capture_origin) return fail(cudaErrorStreamCaptureUnmatched);
  if (s->capture_mode != cudaStreamCaptureModeRelaxed && s->capture_thread != tl_id)
    return fail(cudaErrorStreamCaptureWrongThread);
  std::shared_ptr<GraphImpl> g = s->capture;
  bool invalid = s->capture_invalidated, unjoined = false;
  std::set<int> joined;
  for (int n : s->frontier) ancestors(*g, n, joined);
  for (const StreamPtr& t : live_streams()) {
    if (t == s || t->capture != g) continue;
    for (int n : t->frontier)
      if (joined.count(n) == 0) unjoined = true;
    t->capture.reset();
    t->frontier.clear();
  }
  s->capture.reset();
  s->frontier.clear();
  s->capture_origin = false;
  if (invalid) return fail(cudaErrorStreamCaptureInvalidated);
  if (unjoined) return fail(cudaErrorStreamCaptureUnjoined);
  *graph = new CUgraph_st{g};
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  if (status == nullptr) return fail(cudaErrorInvalidValue);
  StreamPtr s = resolve(stream);
  std::lock_guard<std::mutex> lk(mu());
  *status = !s->capture ? cudaStreamCaptureStatusNone
                        : (s->capture_invalidated ? cudaStreamCaptureStatusInvalidated
                                                  : cudaStreamCaptureStatusActive);
  return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (mode == nullptr) return fail(cudaErrorInvalidValue);
  std::swap(*mode, tl_capture_mode);
  return cudaSuccess;
}
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes, std::size_t* count) {
  if (graph == nullptr || count == nullptr) return fail(cudaErrorInvalidValue);
  const std::size_t n = graph->impl->nodes.size();
  if (nodes != nullptr) {
    for (std::size_t i = 0; i < std::min(n, *count); ++i)
      nodes[i] = reinterpret_cast<cudaGraphNode_t>(&graph->impl->nodes[i]);
  }
  *count = n;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (exec == nullptr || graph == nullptr) return fail(cudaErrorInvalidValue);
  auto g = std::make_shared<const GraphImpl>(*graph->impl);  // later changes of the graph do not apply
  // A topological order that prefers the latest-captured ready node: only the recorded
  // dependencies keep the capture order.
  const std::size_t n = g->nodes.size();
  std::vector<int> pending(n, 0);
  std::vector<std::vector<int>> users(n);
  for (std::size_t i = 0; i < n; ++i)
    for (int d : g->nodes[i].deps) {
      ++pending[i];
      users[static_cast<std::size_t>(d)].push_back(static_cast<int>(i));
    }
  std::set<int> ready;
  for (std::size_t i = 0; i < n; ++i)
    if (pending[i] == 0) ready.insert(static_cast<int>(i));
  std::vector<int> order;
  while (!ready.empty()) {
    const int v = *ready.rbegin();
    ready.erase(v);
    order.push_back(v);
    for (int u : users[static_cast<std::size_t>(v)])
      if (--pending[static_cast<std::size_t>(u)] == 0) ready.insert(u);
  }
  *exec = new CUgraphExec_st{g, std::move(order)};
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return fail(cudaErrorInvalidValue);
  auto g = exec->graph;
  auto order = exec->order;
  return enqueue(stream, [g, order] {
    for (int i : order) (*g->nodes[static_cast<std::size_t>(i)].fn)();
  });
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
