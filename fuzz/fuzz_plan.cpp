// libFuzzer target: the collective plans' size arithmetic and argument checks, on a one-rank
// LocalTransport, with fuzzed element counts, granules, element types, formats, workspace sizes
// and offsets, and null pointers.
//
// Input: [kind][format][type][flags][8 bytes numel][8 bytes granule][2 bytes workspace size]
// [workspace offset][values...]. kind: all-gather, one-hop or two-hop reduce-scatter. Buffers are
// real allocations of exactly the sizes the plan asks for (a caller that tells the truth); only
// sizes and the workspace are free. Contracts: construction and the size queries either throw
// qcoll::Error or give sizes that hold the plan's messages; a call either throws qcoll::Error
// having written nothing to its output, or writes the whole output with zero padding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <qcoll/collective/all_gather.hpp>
#include <qcoll/collective/reduce_scatter.hpp>
#include <qcoll/transport/local.hpp>

#include "fuzz_input.hpp"

namespace {

using namespace qcoll;

constexpr std::size_t kMaxElements = std::size_t{1} << 15;  // larger layouts are only sized, not run
constexpr std::size_t kMaxWorkspace = std::size_t{1} << 18;

//! A workspace of `bytes` bytes at `offset` bytes past a 64-byte boundary, in an allocation that
//! ends where the workspace ends (up to the 64-byte rounding of aligned_alloc).
struct Workspace {
  unsigned char* base = nullptr;
  unsigned char* ptr = nullptr;
  std::size_t bytes = 0;
  Workspace(std::size_t want, std::size_t offset) {
    const std::size_t total = (offset + want + 63) / 64 * 64;
    base = static_cast<unsigned char*>(std::aligned_alloc(64, total == 0 ? 64 : total));
    ptr = base + offset;
    bytes = (total == 0 ? 64 : total) - offset;
  }
  ~Workspace() { std::free(base); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

template <class T>
std::vector<T> values(fuzz::Reader& in, std::size_t n) {
  std::vector<T> v(n);
  for (T& x : v) {
    unsigned char b[sizeof(T)];
    for (unsigned char& c : b) c = in.u8();
    std::memcpy(&x, b, sizeof x);
  }
  return v;
}

template <class T>
bool all_bytes(const std::vector<T>& v, std::size_t from, unsigned char byte) {
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (std::size_t i = from * sizeof(T); i < v.size() * sizeof(T); ++i)
    if (p[i] != byte) return false;
  return true;
}

template <class T, class F>
void all_gather(LocalTransport& t, fuzz::Reader& in, const ShardLayout& layout, std::size_t ws_want,
                std::size_t ws_off, std::uint8_t flags) {
  using Plan = QuantizedAllGather<T, F, LocalTransport>;
  std::size_t need = 0;
  Plan* plan = nullptr;
  if (fuzz::throws_error([&] {
        plan = new Plan(t, layout);
        need = plan->workspace_bytes();
      })) {
    delete plan;
    return;
  }
  fuzz::expect(need >= 2 * plan->message_bytes(), "the all-gather workspace cannot hold its messages");
  if (layout.padded_numel() <= kMaxElements) {
    std::vector<T> shard = values<T>(in, layout.shard_numel());
    std::vector<T> full(layout.padded_numel());
    for (T& v : full) std::memset(&v, 0x5A, sizeof v);
    Workspace ws((flags & 8) != 0 ? need : ws_want, ws_off);
    const bool threw = fuzz::throws_error([&] {
      (*plan)((flags & 1) != 0 ? nullptr : shard.data(), (flags & 2) != 0 ? nullptr : full.data(), ws.ptr,
              ws.bytes);
    });
    if (threw) {
      fuzz::expect(all_bytes(full, 0, 0x5A), "a rejected all-gather wrote its output");
    } else {
      fuzz::expect(ws.bytes >= need && reinterpret_cast<std::uintptr_t>(ws.ptr) % kWorkspaceAlignment == 0,
                   "an all-gather ran on a short or misaligned workspace");
      fuzz::expect(all_bytes(full, layout.numel(), 0), "all-gather padding is not zero");
    }
  }
  delete plan;
}

template <class T, class F>
void reduce_scatter(LocalTransport& t, fuzz::Reader& in, const ShardLayout& layout, Hops hops,
                    std::size_t ws_want, std::size_t ws_off, std::uint8_t flags) {
  using Plan = QuantizedReduceScatter<T, F, F, LocalTransport>;
  std::size_t need = 0;
  Plan* plan = nullptr;
  if (fuzz::throws_error([&] {
        plan = new Plan(t, Topology::node_major(1, 1, 0), layout,
                        (flags & 16) != 0 ? Reduce::mean : Reduce::sum, hops);
        need = plan->workspace_bytes();
      })) {
    delete plan;
    return;
  }
  fuzz::expect(need >= 2 * plan->hop1_message_bytes(),
               "the reduce-scatter workspace cannot hold its messages");
  if (layout.padded_numel() <= kMaxElements) {
    std::vector<T> grad = values<T>(in, layout.padded_numel());
    std::vector<T> shard(layout.shard_numel());
    for (T& v : shard) std::memset(&v, 0x5A, sizeof v);
    Workspace ws((flags & 8) != 0 ? need : ws_want, ws_off);
    const bool threw = fuzz::throws_error([&] {
      (*plan)((flags & 1) != 0 ? nullptr : grad.data(), (flags & 2) != 0 ? nullptr : shard.data(), ws.ptr,
              ws.bytes);
    });
    if (threw) {
      fuzz::expect(all_bytes(shard, 0, 0x5A), "a rejected reduce-scatter wrote its output");
    } else {
      fuzz::expect(ws.bytes >= need && reinterpret_cast<std::uintptr_t>(ws.ptr) % kWorkspaceAlignment == 0,
                   "a reduce-scatter ran on a short or misaligned workspace");
      fuzz::expect(all_bytes(shard, layout.numel(), 0), "reduce-scatter padding is not zero");
    }
  }
  delete plan;
}

template <class T, class F>
void run(LocalTransport& t, fuzz::Reader& in, std::uint8_t kind, std::uint8_t flags, std::size_t numel,
         std::size_t granule, std::size_t ws_want, std::size_t ws_off) {
  ShardLayout* layout = nullptr;
  if (fuzz::throws_error([&] { layout = new ShardLayout(numel, 1, granule); })) return;
  switch (fuzz::pick(kind, 3)) {
    case 0: all_gather<T, F>(t, in, *layout, ws_want, ws_off, flags); break;
    case 1: reduce_scatter<T, F>(t, in, *layout, Hops::one, ws_want, ws_off, flags); break;
    default: reduce_scatter<T, F>(t, in, *layout, Hops::two, ws_want, ws_off, flags); break;
  }
  delete layout;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static LocalGroup group(1);
  fuzz::Reader in(data, size);
  const std::uint8_t kind = in.u8(), format = in.u8(), type = in.u8(), flags = in.u8();
  std::size_t numel = in.u64(), granule = in.u64();
  if ((flags & 32) == 0) numel %= kMaxElements + 1;  // mostly layouts that run
  if ((flags & 64) == 0) granule = granule % 4096 + 1;
  const std::size_t lo = in.u8(), hi = in.u8();
  const std::size_t ws_want = ((lo | hi << 8) * 4) % kMaxWorkspace;
  const std::size_t ws_off = in.u8() % 128;
  group.run([&](LocalTransport& t) {
    auto with_type = [&](auto f) {
      using F = decltype(f);
      switch (fuzz::pick(type, 3)) {
        case 0: run<float, F>(t, in, kind, flags, numel, granule, ws_want, ws_off); break;
        case 1: run<half, F>(t, in, kind, flags, numel, granule, ws_want, ws_off); break;
        default: run<bfloat16, F>(t, in, kind, flags, numel, granule, ws_want, ws_off); break;
      }
    };
    switch (fuzz::pick(format, 5)) {
      case 0: with_type(Int8<32>{}); break;
      case 1: with_type(Int4<256>{}); break;
      case 2: with_type(MxFp4{}); break;
      case 3: with_type(NvFp4{}); break;
      default: with_type(Identity<bfloat16, 32>{}); break;
    }
  });
  return 0;
}
