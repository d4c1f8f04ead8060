// Shared by the collective tests over `local` and `mpi`: deterministic per-rank inputs, the
// straightforward host re-computation of each quantized operation (bit-exact oracle), the fp64
// reference of the unquantized operation, and bounds derived from the formats.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <qcoll/collective/all_gather.hpp>
#include <qcoll/collective/hpz.hpp>
#include <qcoll/collective/reduce_scatter.hpp>
#include <qcoll/transport/local.hpp>

#include <string>

namespace harness {
using namespace qcoll;

// Input element i of rank r under `seed`: a Gaussian-like value (sum of four uniforms, centred),
// times a per-rank scale so ranks differ in magnitude. Any process can regenerate any rank's data.
inline float input_value(std::uint64_t seed, int rank, std::size_t i) {
  float s = 0;
  for (int k = 0; k < 4; ++k)
    s += random_unit(random_bits(seed * 131 + static_cast<std::uint64_t>(rank), 4 * i + k));
  return (s - 2.0f) * (1.0f + 0.25f * static_cast<float>(rank % 3));
}

template <class T>
std::vector<T> make_input(std::uint64_t seed, int rank, std::size_t count, std::size_t numel) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i)
    v[i] = from_float<T>(i < numel ? input_value(seed, rank, i) : 123.0f);
  return v;  // elements >= numel hold garbage (123) that must never show in results
}

// Every rank's input: make_input for ranks 0..world-1.
template <class T>
std::vector<std::vector<T>> make_inputs(std::uint64_t seed, int world, std::size_t count, std::size_t numel) {
  std::vector<std::vector<T>> all(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) all[static_cast<std::size_t>(r)] = make_input<T>(seed, r, count, numel);
  return all;
}

// 64-byte aligned workspace.
struct Workspace {
  std::vector<unsigned char> raw;
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit Workspace(std::size_t n) : raw(n + 64), bytes(n) {
    ptr = reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(raw.data()) + 63) & ~std::uintptr_t(63));
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// ---- the straightforward re-computations ------------------------------------------------------

// Quantizes x[0, n) as one message of F and decodes it back into out (as T).
template <class F, class T, class Out>
void roundtrip(const T* x, std::size_t n, const host::QuantizeOptions& o, Out* out) {
  std::vector<unsigned char> msg(packed_bytes<F>(n));
  host::quantize<F>(x, n, msg.data(), msg.size(), o);
  host::dequantize<F>(msg.data(), msg.size(), out, n);
}

// All-gather: shard q's valid elements, quantized with index_base = its offset, decoded.
template <class T, class F>
std::vector<T> reference_all_gather(const std::vector<std::vector<T>>& shards, const ShardLayout& layout,
                                    const host::QuantizeOptions& opt) {
  std::vector<T> full(layout.padded_numel(), from_float<T>(0.0f));
  for (int q = 0; q < layout.parts(); ++q) {
    host::QuantizeOptions o = opt;
    o.index_base = layout.shard_offset(q);
    roundtrip<F>(shards[static_cast<std::size_t>(q)].data(), layout.valid_in_shard(q), o,
                 full.data() + layout.shard_offset(q));
  }
  return full;
}

// Reduce-scatter, re-computed slice by slice as the algorithm is specified (fp32 sums in source
// order, per-rank per-hop stochastic keys), returning every rank's output shard.
template <class T, class F1, class F2>
std::vector<std::vector<T>> reference_reduce_scatter(const std::vector<std::vector<T>>& grads,
                                                     const Topology& topo, const ShardLayout& layout,
                                                     Reduce op, Hops hops, const host::QuantizeOptions& opt) {
  const int W = layout.parts(), N = topo.num_nodes(), L = topo.ranks_per_node();
  const std::size_t S = layout.shard_numel();
  std::vector<std::vector<float>> acc(static_cast<std::size_t>(W), std::vector<float>(S, 0.0f));
  if (hops == Hops::one) {
    for (int r = 0; r < W; ++r)
      for (int s = 0; s < W; ++s) {
        host::QuantizeOptions o = opt;
        o.seed = detail::rank_seed(opt.seed, s, 1);
        o.index_base = layout.shard_offset(r);
        const std::size_t n = layout.valid_in_shard(r);
        std::vector<unsigned char> msg(packed_bytes<F1>(n));
        host::quantize<F1>(grads[s].data() + layout.shard_offset(r), n, msg.data(), msg.size(), o);
        host::dequantize_accumulate<F1>(msg.data(), msg.size(), acc[r].data(), n);
      }
  } else {
    // Hop 1: intermediate k = (m', j) sums chunk j of the ranks of node m' in local order.
    std::vector<std::vector<float>> partial(static_cast<std::size_t>(W), std::vector<float>(N * S, 0.0f));
    for (int k = 0; k < W; ++k) {
      const int j = topo.local_index_of(k), mk = topo.node_of(k);
      for (int i = 0; i < L; ++i) {
        const int s = topo.rank_at(mk, i);
        std::vector<T> chunk(N * S, from_float<T>(0.0f));  // reordered chunk j of rank s, padding zeroed
        for (int m = 0; m < N; ++m) {
          const int owner = topo.rank_at(m, j);
          for (std::size_t e = 0; e < layout.valid_in_shard(owner); ++e)
            chunk[m * S + e] = grads[s][layout.shard_offset(owner) + e];
        }
        host::QuantizeOptions o = opt;
        o.seed = detail::rank_seed(opt.seed, s, 1);
        o.index_base = static_cast<std::size_t>(j) * N * S;
        std::vector<unsigned char> msg(packed_bytes<F1>(N * S));
        host::quantize<F1>(chunk.data(), N * S, msg.data(), msg.size(), o);
        host::dequantize_accumulate<F1>(msg.data(), msg.size(), partial[k].data(), N * S);
      }
    }
    // Hop 2: owner (m, j) sums, over nodes m' in order, slice m of intermediate (m', j)'s partial.
    for (int r = 0; r < W; ++r) {
      const int j = topo.local_index_of(r), m = topo.node_of(r);
      const std::size_t n = layout.valid_in_shard(r);
      for (int mp = 0; mp < N; ++mp) {
        const int k = topo.rank_at(mp, j);
        host::QuantizeOptions o = opt;
        o.seed = detail::rank_seed(opt.seed, k, 2);
        o.index_base = layout.shard_offset(r);
        std::vector<unsigned char> msg(packed_bytes<F2>(n));
        host::quantize<F2>(partial[k].data() + static_cast<std::size_t>(m) * S, n, msg.data(), msg.size(), o);
        host::dequantize_accumulate<F2>(msg.data(), msg.size(), acc[r].data(), n);
      }
    }
  }
  std::vector<std::vector<T>> out(static_cast<std::size_t>(W), std::vector<T>(S, from_float<T>(0.0f)));
  for (int r = 0; r < W; ++r)
    for (std::size_t e = 0; e < layout.valid_in_shard(r); ++e)
      out[r][e] = from_float<T>(op == Reduce::mean ? acc[r][e] / static_cast<float>(W) : acc[r][e]);
  return out;
}

// fp64 reference of the unquantized reduce-scatter (rank r's slice).
template <class T>
std::vector<double> exact_reduce(const std::vector<std::vector<T>>& grads, const ShardLayout& layout, int r,
                                 Reduce op) {
  std::vector<double> out(layout.valid_in_shard(r), 0.0);
  for (const auto& g : grads)
    for (std::size_t e = 0; e < out.size(); ++e) out[e] += to_float(g[layout.shard_offset(r) + e]);
  if (op == Reduce::mean)
    for (auto& v : out) v /= layout.parts();
  return out;
}

// Largest error of a symmetric-integer reduce-scatter against the fp64 reference, derived from the
// formats: each hop-1 contribution errs by at most half a step, absmax/(2 q1) <= A/(2 q1) with A the
// largest |input|; a hop-2 partial sum of L contributions is at most L*A*(1 + 1/(2 q1)) in size, so
// re-quantizing it errs by at most that over 2 q2, N times. fp32 accumulation adds at most one
// rounding (2^-24 relative) per addition of a value bounded by W*A*(1 + ...); the final division
// and the rounding to T add their relative half-ulps. For Hops::one only the first term and the
// accumulation count.
inline double rs_bound(double A, int W, int N, int L, int q1, int q2, Hops hops, Reduce op, double result,
                       int t_bits) {
  double e = W * A / (2.0 * q1);
  if (hops == Hops::two) e += N * (L * A * (1 + 1.0 / (2 * q1))) / (2.0 * q2);
  e += 2.0 * W * W * A * (1 + 1.0 / q1) * std::ldexp(1.0, -24);
  if (op == Reduce::mean) e /= W;
  return e + (std::fabs(result) + e) * (std::ldexp(1.0, -t_bits) + std::ldexp(1.0, -23));
}

// Runs fn(t) on `world` in-process ranks placed by `ids`; returns each rank's qcoll::Error
// message, or "no error".
template <class Fn>
std::vector<std::string> errors_of(int world, const std::vector<long long>& ids, Fn&& fn) {
  std::vector<std::string> msg(static_cast<std::size_t>(world));
  LocalGroup g(world, ids);
  g.run([&](LocalTransport& t) {
    try {
      fn(t);
      msg[static_cast<std::size_t>(t.rank())] = "no error";
    } catch (const Error& e) {
      msg[static_cast<std::size_t>(t.rank())] = e.what();
    }
  });
  return msg;
}

inline bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

template <class T>
constexpr int significand_bits() {
  return std::is_same<T, float>::value ? 24 : std::is_same<T, qcoll::half>::value ? 11 : 8;
}

}  // namespace harness
