#pragma once
// The demo's training job: a small MLP regressing a fixed random "teacher" network, trained with
// ZeRO-3-style sharding (fp32 master weights and Adam state sharded over the ranks, bf16 weights
// and gradients on the wire) with plain collectives, with ZeRO++ (qwZ, hpZ, qgZ), and with the
// low-bit techniques beyond it (error feedback, Hadamard rotation, ZeRO-2 with qWD).
// examples/demo.cpp is the command-line front end; tests/unit/test_demo.cpp calls train_local().

#include <qcoll/collective/all_gather.hpp>
#include <qcoll/collective/delta_all_gather.hpp>
#include <qcoll/collective/hpz.hpp>
#include <qcoll/collective/reduce_scatter.hpp>
#include <qcoll/core/half.hpp>
#include <qcoll/core/rng.hpp>
#include <qcoll/format/format.hpp>
#include <qcoll/layout/shard.hpp>
#include <qcoll/layout/topology.hpp>
#include <qcoll/transport/local.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace qcoll_demo {

using qcoll::bfloat16;

//! Everything a training run depends on. `batch` is the micro-batch of one rank; the global batch
//! of a step is ranks * batch samples.
struct DemoConfig {
  int ranks = 8;           //!< world size W
  int nodes = 2;           //!< nodes N (W / N ranks per node, node-major placement)
  int steps = 40;          //!< optimizer steps
  int hidden = 1024;       //!< width of the hidden layers
  int layers = 3;          //!< weight layers (layers - 1 hidden layers)
  int batch = 16;          //!< samples per rank per step
  int input = 64;          //!< input features
  int output = 16;         //!< regression targets
  float lr = 1e-3f;        //!< Adam learning rate
  std::uint64_t seed = 1;  //!< seeds the teacher, the data and the initial weights
  int eval_samples = 512;  //!< held-out samples for the initial / final evaluation
};

//! Which techniques a run uses; all off is plain ZeRO-3.
struct Techniques {
  bool qwz = false;       //!< int8 forward weight all-gather (else bf16)
  bool hpz = false;       //!< backward weight gather from the node-local secondary shard (else all-gather)
  bool qgz = false;       //!< int4 two-hop gradient reduce-scatter (else bf16, one hop)
  bool feedback = false;  //!< error feedback on both qgZ hops (fp32 residuals)
  bool hadamard = false;  //!< Hadamard rotation (span = block) on both qgZ hops and on an int4 qwZ
  bool qwz4 = false;      //!< qwZ in int4 instead of int8
  bool zero2 = false;     //!< ZeRO-2: every rank keeps all weights (bf16), updated after each step by a
                          //!< qWD int4 all-gather of weight differences; no weight gathers (qwz/hpz unused)
};

//! Returns "" when the configuration is usable, else a message naming the bad field.
inline std::string validate(const DemoConfig& c) {
  std::ostringstream os;
  if (c.ranks < 1 || c.ranks > 1024)
    os << "--ranks must be in [1, 1024], got " << c.ranks;
  else if (c.nodes < 1 || c.ranks % c.nodes != 0)
    os << "--nodes must be >= 1 and divide --ranks (" << c.ranks << "), got " << c.nodes;
  else if (c.steps < 1)
    os << "--steps must be >= 1, got " << c.steps;
  else if (c.hidden < 1 || c.hidden > 16384)
    os << "--hidden must be in [1, 16384], got " << c.hidden;
  else if (c.layers < 1 || c.layers > 64)
    os << "--layers must be in [1, 64], got " << c.layers;
  else if (c.batch < 1 || c.batch > 65536)
    os << "--batch must be in [1, 65536], got " << c.batch;
  else if (!(c.lr > 0.0f) || !std::isfinite(c.lr))
    os << "--lr must be a positive number, got " << c.lr;
  else if (c.input < 1 || c.output < 1)
    os << "input and output sizes must be >= 1";
  else if (c.eval_samples < 1)
    os << "eval_samples must be >= 1, got " << c.eval_samples;
  return os.str();
}

//! Bytes one rank handed to the transports for other ranks, split by destination.
struct Bytes {
  std::uint64_t intra = 0;  //!< to ranks on the same node
  std::uint64_t inter = 0;  //!< to ranks on other nodes
};

//! One optimizer step as seen by rank 0.
struct StepStats {
  double loss = 0;     //!< training loss of the step's global batch (mean over ranks)
  Bytes forward;       //!< forward weight gather
  Bytes backward;      //!< backward weight gather
  Bytes gradient;      //!< gradient reduce-scatter
  Bytes update;        //!< weight-update all-gather (ZeRO-2 with qWD)
  double seconds = 0;  //!< wall time of the step (all ranks run concurrently)
  Bytes total() const {
    return Bytes{forward.intra + backward.intra + gradient.intra + update.intra,
                 forward.inter + backward.inter + gradient.inter + update.inter};
  }
};

//! What a run reports (identical on every rank except the byte counts, which are rank 0's in
//! train_local()).
struct RunResult {
  Techniques techniques;
  std::vector<StepStats> steps;
  double initial_eval = 0;  //!< held-out loss of the initial weights
  double final_eval = 0;    //!< held-out loss of the trained fp32 master weights
  std::size_t numel = 0, padded_numel = 0, shard_numel = 0;
};

// --------------------------------------------------------------------------------------------
// Model
// --------------------------------------------------------------------------------------------

//! Uniform float in [-a, a) for stream `seed`, element `index`.
inline float uniform(std::uint64_t seed, std::uint64_t index, float a) {
  return (qcoll::random_unit(qcoll::random_bits(seed, index)) * 2.0f - 1.0f) * a;
}

//! y[0, n) += s * x[0, n). Eight-wide blocks so the compiler vectorizes them at -O2.
inline void axpy(float s, const float* __restrict x, float* __restrict y, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    y[i + 0] += s * x[i + 0];
    y[i + 1] += s * x[i + 1];
    y[i + 2] += s * x[i + 2];
    y[i + 3] += s * x[i + 3];
    y[i + 4] += s * x[i + 4];
    y[i + 5] += s * x[i + 5];
    y[i + 6] += s * x[i + 6];
    y[i + 7] += s * x[i + 7];
  }
  for (; i < n; ++i) y[i] += s * x[i];
}

//! Sum of a[i] * b[i] over [0, n), with eight partial sums.
inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

//! Fully connected ReLU network dims[0] -> dims[1] -> ... -> dims[L]; the last layer is linear.
//! Parameters live in one flat buffer: for each layer, W as [in][out] (row i holds the weights
//! from input i) followed by the bias [out].
class Mlp {
 public:
  explicit Mlp(std::vector<int> dims) : dims_(std::move(dims)) {
    std::size_t at = 0;
    for (std::size_t l = 0; l + 1 < dims_.size(); ++l) {
      w_.push_back(at);
      at += static_cast<std::size_t>(dims_[l]) * static_cast<std::size_t>(dims_[l + 1]);
      b_.push_back(at);
      at += static_cast<std::size_t>(dims_[l + 1]);
    }
    numel_ = at;
  }
  static Mlp student(const DemoConfig& c) {
    std::vector<int> d{c.input};
    for (int l = 1; l < c.layers; ++l) d.push_back(c.hidden);
    d.push_back(c.output);
    return Mlp(d);
  }
  static Mlp teacher(const DemoConfig& c) { return Mlp({c.input, 32, c.output}); }

  std::size_t numel() const { return numel_; }
  int layers() const { return static_cast<int>(w_.size()); }
  int in_dim() const { return dims_.front(); }
  int out_dim() const { return dims_.back(); }

  //! Random initial parameters (uniform, variance-preserving for ReLU; smaller last layer; zero
  //! biases), a pure function of `seed`.
  std::vector<float> init(std::uint64_t seed, float last_gain) const {
    std::vector<float> p(numel_, 0.0f);
    for (int l = 0; l < layers(); ++l) {
      const bool last = l + 1 == layers();
      const float a =
          std::sqrt((last ? 3.0f : 6.0f) / static_cast<float>(dims_[l])) * (last ? last_gain : 1.0f);
      const std::size_t n = static_cast<std::size_t>(dims_[l]) * static_cast<std::size_t>(dims_[l + 1]);
      for (std::size_t i = 0; i < n; ++i) p[w_[l] + i] = uniform(seed, w_[l] + i, a);
    }
    return p;
  }

  //! Forward pass of B samples x [B][in] through parameters p; fills acts (activations of every
  //! layer, acts[0] = x) and returns the outputs acts.back() [B][out]. `tanh_hidden` selects tanh
  //! instead of ReLU for hidden layers.
  const std::vector<float>& forward(const float* p, const float* x, int B,
                                    std::vector<std::vector<float>>& acts, bool tanh_hidden = false) const {
    acts.resize(dims_.size());
    acts[0].assign(x, x + static_cast<std::size_t>(B) * dims_[0]);
    for (int l = 0; l < layers(); ++l) {
      const int in = dims_[l], out = dims_[l + 1];
      std::vector<float>& y = acts[l + 1];
      y.resize(static_cast<std::size_t>(B) * out);
      const float* X = acts[l].data();
      for (int b = 0; b < B; ++b)
        std::memcpy(&y[static_cast<std::size_t>(b) * out], p + b_[l], sizeof(float) * out);
      for (int i = 0; i < in; ++i) {
        const float* wi = p + w_[l] + static_cast<std::size_t>(i) * out;
        for (int b = 0; b < B; ++b)
          axpy(X[static_cast<std::size_t>(b) * in + i], wi, &y[static_cast<std::size_t>(b) * out], out);
      }
      if (l + 1 < layers())
        for (float& v : y) v = tanh_hidden ? std::tanh(v) : (v > 0.0f ? v : 0.0f);
    }
    return acts.back();
  }

  //! Mean squared error of the outputs against targets t [B][out], and (if grad is not null) its
  //! gradient with respect to the parameters written to grad (numel() floats, overwritten).
  //! Uses the activations `acts` of a forward pass; backpropagates through parameters `p` (the
  //! same values, gathered again for the backward pass).
  double loss_and_grad(const float* p, const std::vector<std::vector<float>>& acts, const float* t, int B,
                       float* grad) const {
    const int out = dims_.back();
    const std::size_t n = static_cast<std::size_t>(B) * out;
    const std::vector<float>& y = acts.back();
    double loss = 0;
    std::vector<float> dy(n);
    const float scale = 2.0f / static_cast<float>(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float d = y[i] - t[i];
      loss += static_cast<double>(d) * d;
      dy[i] = scale * d;
    }
    loss /= static_cast<double>(n);
    if (grad == nullptr) return loss;
    std::fill(grad, grad + numel_, 0.0f);
    std::vector<float> dx;
    for (int l = layers() - 1; l >= 0; --l) {
      const int in = dims_[l], o = dims_[l + 1];
      const float* X = acts[l].data();
      float* gb = grad + b_[l];
      for (int b = 0; b < B; ++b) axpy(1.0f, &dy[static_cast<std::size_t>(b) * o], gb, o);
      for (int i = 0; i < in; ++i) {
        float* gwi = grad + w_[l] + static_cast<std::size_t>(i) * o;
        for (int b = 0; b < B; ++b)
          axpy(X[static_cast<std::size_t>(b) * in + i], &dy[static_cast<std::size_t>(b) * o], gwi, o);
      }
      if (l == 0) break;
      dx.assign(static_cast<std::size_t>(B) * in, 0.0f);
      for (int i = 0; i < in; ++i) {
        const float* wi = p + w_[l] + static_cast<std::size_t>(i) * o;
        for (int b = 0; b < B; ++b) {
          const std::size_t k = static_cast<std::size_t>(b) * in + i;
          dx[k] = X[k] > 0.0f ? dot(wi, &dy[static_cast<std::size_t>(b) * o], o) : 0.0f;  // ReLU mask
        }
      }
      dy.swap(dx);
    }
    return loss;
  }

 private:
  std::vector<int> dims_;
  std::vector<std::size_t> w_, b_;
  std::size_t numel_ = 0;
};

//! The synthetic task: inputs uniform with unit variance from a seeded stream, targets from a fixed
//! random teacher network (tanh hidden layer). Sample `id` is the same on every rank and run.
class Task {
 public:
  explicit Task(const DemoConfig& c)
      : c_(c), teacher_(Mlp::teacher(c)), teacher_p_(teacher_.init(c.seed * 3 + 11, 1.5f)) {}

  //! Fills x [B][in] and t [B][out] with samples first_id, first_id + stride, ...
  void samples(std::uint64_t stream, std::uint64_t first_id, std::uint64_t stride, int B,
               std::vector<float>& x, std::vector<float>& t) const {
    const int in = c_.input;
    x.resize(static_cast<std::size_t>(B) * in);
    const std::uint64_t key = c_.seed * 7 + 101 + stream;
    for (int b = 0; b < B; ++b) {
      const std::uint64_t id = first_id + static_cast<std::uint64_t>(b) * stride;
      for (int i = 0; i < in; ++i)
        x[static_cast<std::size_t>(b) * in + i] =
            uniform(key, id * static_cast<std::uint64_t>(in) + i, std::sqrt(3.0f));
    }
    std::vector<std::vector<float>> acts;
    t = teacher_.forward(teacher_p_.data(), x.data(), B, acts, /*tanh_hidden=*/true);
  }

 private:
  DemoConfig c_;
  Mlp teacher_;
  std::vector<float> teacher_p_;
};

// --------------------------------------------------------------------------------------------
// Training
// --------------------------------------------------------------------------------------------

//! A 64-byte aligned scratch buffer for the collectives' workspace.
class Workspace {
 public:
  explicit Workspace(std::size_t bytes) : bytes_((std::max<std::size_t>(bytes, 1) + 63) / 64 * 64) {
    ptr_.reset(static_cast<unsigned char*>(std::aligned_alloc(64, bytes_)));
    if (!ptr_) throw std::bad_alloc();
  }
  void* data() const { return ptr_.get(); }
  std::size_t size() const { return bytes_; }

 private:
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::size_t bytes_;
  std::unique_ptr<unsigned char, Free> ptr_;
};

//! Block size of the quantized formats, and the layout granule that makes shards whole blocks.
constexpr std::size_t kBlock = 256;

//! Layout of the flat parameter buffer of the student of `c` over `ranks` shards.
inline qcoll::ShardLayout demo_layout(const DemoConfig& c) {
  return qcoll::ShardLayout(Mlp::student(c).numel(), c.ranks,
                            qcoll::granule_for(sizeof(bfloat16), {kBlock, qcoll::Identity<bfloat16>::block}));
}

namespace detail {

inline Bytes operator+(Bytes a, Bytes b) { return Bytes{a.intra + b.intra, a.inter + b.inter}; }

//! One rank's run with forward-gather format FwdF and gradient formats GradF1 / GradF2.
template <class FwdF, class GradF1, class GradF2, class Transport>
RunResult train_rank(Transport& world, const qcoll::Topology& topo, const DemoConfig& c, Techniques tech,
                     qcoll::Hops hops) {
  using Sub = decltype(world.split(0, 0));
  const int W = world.size(), r = world.rank();
  const Mlp model = Mlp::student(c);
  const Task task(c);
  const qcoll::ShardLayout layout = demo_layout(c);
  const std::size_t S = layout.shard_numel(), P = layout.padded_numel(), off = layout.shard_offset(r);
  const std::size_t valid = layout.valid_in_shard(r);

  // Plans, built collectively in the same order on every rank. `metrics` carries the loss values
  // and the evaluation weights, so its traffic stays out of the training counters.
  Sub metrics = world.split(0, r);
  // Hadamard rotation over a whole block (span 2^8 = kBlock), the same seed on every rank.
  const qcoll::Rotation rotation{tech.hadamard ? 8u : 0u, c.seed + 5};
  static_assert(kBlock == 256, "the rotation spans one block");
  qcoll::QuantizedAllGather<bfloat16, FwdF, Transport> gather(
      world, layout,
      qcoll::HopOptions{qcoll::Rounding::nearest, 0, tech.qwz4 ? rotation : qcoll::Rotation{}});
  std::optional<qcoll::SecondaryShard<bfloat16, qcoll::Identity<bfloat16>, Transport>> hpz;
  if (tech.hpz && !tech.zero2) hpz.emplace(world, topo, layout);
  // Gradients are rounded to nearest: with Adam, stochastic rounding's extra variance inflates the
  // second moment and slows training more than nearest rounding's bias does.
  const qcoll::HopOptions grad_hop{qcoll::Rounding::nearest, 0, tech.qgz ? rotation : qcoll::Rotation{}};
  qcoll::QuantizedReduceScatter<bfloat16, GradF1, GradF2, Transport> reduce(
      world, topo, layout, qcoll::Reduce::mean, hops, qcoll::ReduceScatterOptions{grad_hop, grad_hop});
  // ZeRO-2: the weight-difference all-gather keeping every rank's replica of the weights.
  std::optional<qcoll::DeltaAllGather<bfloat16, qcoll::Int4<kBlock>, Transport>> qwd;
  if (tech.zero2) qwd.emplace(world, layout);
  Workspace ws(
      std::max({gather.workspace_bytes(), hpz ? hpz->workspace_bytes() : std::size_t{0},
                reduce.workspace_bytes(), qwd ? qwd->workspace_bytes() : std::size_t{0},
                qwd ? qwd->template resync_workspace_bytes<qcoll::Identity<bfloat16>>() : std::size_t{0}}));
  Workspace residual(tech.feedback ? reduce.residual_bytes() : 0);
  if (tech.feedback) reduce.init_residual(residual.data(), residual.size());

  // fp32 master shard and Adam state, all sharded.
  std::vector<float> master(S, 0.0f), m(S, 0.0f), v(S, 0.0f);
  {
    const std::vector<float> init = model.init(c.seed, 0.5f);
    for (std::size_t i = 0; i < valid; ++i) master[i] = init[off + i];
  }
  std::vector<bfloat16> shard(S), full(P), grad16(P), grad_shard(S), replica(tech.zero2 ? P : 0);
  std::vector<float> weights(P), grad(P, 0.0f), x, t;
  std::vector<std::vector<float>> acts;

  RunResult res;
  res.techniques = tech;
  res.numel = layout.numel();
  res.padded_numel = P;
  res.shard_numel = S;

  // Held-out loss of the fp32 master weights (gathered unquantized over `metrics`).
  auto evaluate = [&]() {
    std::vector<float> all(P);
    metrics.all_gather(master.data(), all.data(), S * sizeof(float));
    const int per_rank = (c.eval_samples + W - 1) / W;
    const int first = r * per_rank, count = std::max(0, std::min(c.eval_samples - first, per_rank));
    double sums[2] = {0, 0};
    if (count > 0) {
      task.samples(1u << 20, static_cast<std::uint64_t>(first), 1, count, x, t);
      model.forward(all.data(), x.data(), count, acts);
      sums[0] = model.loss_and_grad(all.data(), acts, t.data(), count, nullptr) * count;
      sums[1] = count;
    }
    std::vector<double> gathered(2 * static_cast<std::size_t>(W));
    metrics.all_gather(sums, gathered.data(), sizeof(sums));
    double total = 0, n = 0;
    for (int q = 0; q < W; ++q) {
      total += gathered[2 * static_cast<std::size_t>(q)];
      n += gathered[2 * static_cast<std::size_t>(q) + 1];
    }
    return total / n;
  };
  auto to_float = [](const std::vector<bfloat16>& in, std::vector<float>& out) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = qcoll::to_float(in[i]);
  };
  auto snapshot = [&]() {
    Bytes b{world.counters().intra_node, world.counters().inter_node};
    return b;
  };
  auto sub_bytes = [&]() {
    Bytes b = Bytes{reduce.intra_node().counters().intra_node, reduce.intra_node().counters().inter_node} +
              Bytes{reduce.inter_node().counters().intra_node, reduce.inter_node().counters().inter_node};
    if (hpz) b = b + Bytes{hpz->intra_node().counters().intra_node, hpz->intra_node().counters().inter_node};
    return b;
  };
  auto minus = [](Bytes a, Bytes b) { return Bytes{a.intra - b.intra, a.inter - b.inter}; };

  res.initial_eval = evaluate();
  if (qwd) {  // every replica starts as the initial weights, exactly (set-up, not a training step)
    for (std::size_t i = 0; i < S; ++i) shard[i] = qcoll::from_float<bfloat16>(master[i]);
    qwd->template resync<qcoll::Identity<bfloat16>>(shard.data(), replica.data(), ws.data(), ws.size());
  }
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  for (int step = 0; step < c.steps; ++step) {
    StepStats st;
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    world.reset_counters();

    // Forward: gather the weights (qwZ or bf16), keep the hpZ secondary shard, run the model.
    // ZeRO-2: the replica is the weights.
    for (std::size_t i = 0; i < S; ++i) shard[i] = qcoll::from_float<bfloat16>(master[i]);
    if (!qwd) gather(shard.data(), full.data(), ws.data(), ws.size());
    st.forward = snapshot();
    if (hpz) hpz->capture(full.data(), static_cast<std::uint64_t>(step));
    to_float(qwd ? replica : full, weights);
    const std::uint64_t first_id =
        (static_cast<std::uint64_t>(step) * W + r) * static_cast<std::uint64_t>(c.batch);
    task.samples(0, first_id, 1, c.batch, x, t);
    model.forward(weights.data(), x.data(), c.batch, acts);
    std::fill(full.begin(), full.end(), bfloat16{});  // ZeRO-3 frees the gathered weights here

    // Backward: gather the weights again (hpZ: inside the node only), backpropagate.
    Bytes sub1 = sub_bytes();
    if (hpz)
      hpz->gather(full.data(), static_cast<std::uint64_t>(step), ws.data(), ws.size());
    else if (!qwd)
      gather(shard.data(), full.data(), ws.data(), ws.size());
    st.backward = minus(snapshot(), st.forward) + minus(sub_bytes(), sub1);
    to_float(qwd ? replica : full, weights);
    const double loss = model.loss_and_grad(weights.data(), acts, t.data(), c.batch, grad.data());

    // Gradient reduce-scatter (mean over ranks) into this rank's shard.
    const Bytes before_rs = snapshot();
    Bytes sub2 = sub_bytes();
    for (std::size_t i = 0; i < P; ++i) grad16[i] = qcoll::from_float<bfloat16>(grad[i]);
    if (tech.feedback) {
      reduce(grad16.data(), grad_shard.data(), ws.data(), ws.size(),
             qcoll::ResidualState{residual.data(), residual.size()});
    } else {
      reduce(grad16.data(), grad_shard.data(), ws.data(), ws.size());
    }
    st.gradient = minus(snapshot(), before_rs) + minus(sub_bytes(), sub2);

    // Adam on the own shard.
    const double k = static_cast<double>(step + 1);
    const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(b1, k)));
    const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(b2, k)));
    for (std::size_t i = 0; i < valid; ++i) {
      const float g = qcoll::to_float(grad_shard[i]);
      m[i] = static_cast<float>(b1) * m[i] + static_cast<float>(1.0 - b1) * g;
      v[i] = static_cast<float>(b2) * v[i] + static_cast<float>(1.0 - b2) * g * g;
      master[i] -= c.lr * (m[i] * c1) / (std::sqrt(v[i] * c2) + static_cast<float>(eps));
    }
    // ZeRO-2: every replica takes the owners' updated weights, as int4 differences.
    if (qwd) {
      const Bytes before_update = snapshot();
      for (std::size_t i = 0; i < S; ++i) shard[i] = qcoll::from_float<bfloat16>(master[i]);
      (*qwd)(shard.data(), replica.data(), ws.data(), ws.size());
      st.update = minus(snapshot(), before_update);
    }

    // Global training loss: mean of the ranks' micro-batch losses.
    std::vector<double> losses(static_cast<std::size_t>(W));
    metrics.all_gather(&loss, losses.data(), sizeof(double));
    double sum = 0;
    for (double l : losses) sum += l;
    st.loss = sum / W;
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    res.steps.push_back(st);
  }
  res.final_eval = evaluate();
  return res;
}

}  // namespace detail

//! One rank's part of a run (collective over `world`; every rank calls it with the same
//! arguments). `topo` must describe `world`.
template <class Transport>
RunResult train_rank(Transport& world, const qcoll::Topology& topo, const DemoConfig& c, Techniques tech) {
  using qcoll::Hops;
  using Bf16 = qcoll::Identity<bfloat16>;
  using I8 = qcoll::Int8<kBlock>;
  using I4 = qcoll::Int4<kBlock>;
  const Hops hops = tech.qgz ? Hops::two : Hops::one;
  if (tech.qgz) {
    if (tech.qwz4) return detail::train_rank<I4, I4, I4>(world, topo, c, tech, hops);
    if (tech.qwz) return detail::train_rank<I8, I4, I4>(world, topo, c, tech, hops);
    return detail::train_rank<Bf16, I4, I4>(world, topo, c, tech, hops);
  }
  if (tech.qwz4) return detail::train_rank<I4, Bf16, Bf16>(world, topo, c, tech, hops);
  if (tech.qwz) return detail::train_rank<I8, Bf16, Bf16>(world, topo, c, tech, hops);
  return detail::train_rank<Bf16, Bf16, Bf16>(world, topo, c, tech, hops);
}

//! Node id of every rank: node-major, ranks / nodes ranks per node.
inline std::vector<long long> node_ids(const DemoConfig& c) {
  std::vector<long long> ids(static_cast<std::size_t>(c.ranks));
  const int per_node = c.ranks / c.nodes;
  for (int q = 0; q < c.ranks; ++q) ids[static_cast<std::size_t>(q)] = q / per_node;
  return ids;
}

//! Runs training on c.ranks in-process ranks (threads) and returns rank 0's result.
inline RunResult train_local(const DemoConfig& c, Techniques tech) {
  const std::string err = validate(c);
  if (!err.empty()) throw qcoll::Error("train_local: " + err);
  const std::vector<long long> ids = node_ids(c);
  RunResult out;
  qcoll::LocalGroup group(c.ranks, ids);
  group.run([&](qcoll::LocalTransport& t) {
    const qcoll::Topology topo = qcoll::Topology::from_node_ids(ids, t.rank());
    RunResult r = train_rank(t, topo, c, tech);
    if (t.rank() == 0) out = std::move(r);
  });
  return out;
}

}  // namespace qcoll_demo
