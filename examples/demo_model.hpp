#pragma once
// The demo's training job: a small MLP regressing a fixed random "teacher" network, trained with
// ZeRO-3-style sharding (fp32 master weights and Adam state sharded over the ranks, bf16 weights
// and gradients on the wire) with plain collectives, with ZeRO++ (qwZ, hpZ, qgZ), and with the
// low-bit techniques beyond it (error feedback, Hadamard rotation, ZeRO-2 with qWD). Each layer's
// {W, b} is one TensorGroup with its own plans; the ZeRO-3 runs prefetch the next layer's weights
// and overlap each layer's gradient reduce-scatter with the backward of the layers below it.
// examples/demo.cpp is the command-line front end; tests/unit/test_demo.cpp calls train_local().

#include <qcoll/collective/all_gather.hpp>
#include <qcoll/collective/delta_all_gather.hpp>
#include <qcoll/collective/hpz.hpp>
#include <qcoll/collective/reduce_scatter.hpp>
#include <qcoll/core/half.hpp>
#include <qcoll/core/rng.hpp>
#include <qcoll/format/format.hpp>
#include <qcoll/layout/group.hpp>
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
  bool prefetch = true;   //!< overlap: start the next layer's weight gather before computing a layer and
                          //!< the gradient reduce-scatters without waiting (start/finish); false: the
                          //!< same per-layer plans with blocking calls. Same bits either way.
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
  double loss = 0;          //!< training loss of the step's global batch (mean over ranks)
  Bytes forward;            //!< forward weight gather
  Bytes backward;           //!< backward weight gather
  Bytes gradient;           //!< gradient reduce-scatter
  Bytes update;             //!< weight-update all-gather (ZeRO-2 with qWD)
  double seconds = 0;       //!< wall time of the step (all ranks run concurrently)
  double comm_seconds = 0;  //!< time inside communication calls (blocking, start, progress, finish)
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
  //! Sums over the layers' tensor groups: data elements, padded elements, elements per shard.
  std::size_t numel = 0, padded_numel = 0, shard_numel = 0;
  std::vector<std::size_t> layer_shard_numel;  //!< elements per shard of each layer's group
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

  //! Elements of layer l's weight matrix W_l ([in][out]) and of its bias b_l ([out]).
  std::size_t w_numel(int l) const {
    return static_cast<std::size_t>(dims_[l]) * static_cast<std::size_t>(dims_[l + 1]);
  }
  std::size_t b_numel(int l) const { return static_cast<std::size_t>(dims_[l + 1]); }
  //! Offsets of W_l and b_l in the flat parameter buffer.
  std::size_t w_offset(int l) const { return w_[l]; }
  std::size_t b_offset(int l) const { return b_[l]; }
  //! Width of activation i (dims[0] = inputs, dims[layers()] = outputs).
  int dim(int i) const { return dims_[i]; }

  //! Layer l on B samples: y [B][out] = act(X [B][in] W + bias) (act: ReLU or tanh on hidden
  //! layers, identity on the last). Each sample's row is computed on its own, so running the rows
  //! in parts gives the same bits as one call.
  void forward_layer(int l, const float* W, const float* bias, const float* X, int B, float* y,
                     bool tanh_hidden = false) const {
    const int in = dims_[l], out = dims_[l + 1];
    for (int b = 0; b < B; ++b) std::memcpy(y + static_cast<std::size_t>(b) * out, bias, sizeof(float) * out);
    for (int i = 0; i < in; ++i) {
      const float* wi = W + static_cast<std::size_t>(i) * out;
      for (int b = 0; b < B; ++b)
        axpy(X[static_cast<std::size_t>(b) * in + i], wi, y + static_cast<std::size_t>(b) * out, out);
    }
    if (l + 1 < layers())
      for (std::size_t k = 0; k < static_cast<std::size_t>(B) * out; ++k)
        y[k] = tanh_hidden ? std::tanh(y[k]) : (y[k] > 0.0f ? y[k] : 0.0f);
  }

  //! Forward pass of B samples x [B][in] through parameters p; fills acts (activations of every
  //! layer, acts[0] = x) and returns the outputs acts.back() [B][out]. `tanh_hidden` selects tanh
  //! instead of ReLU for hidden layers.
  const std::vector<float>& forward(const float* p, const float* x, int B,
                                    std::vector<std::vector<float>>& acts, bool tanh_hidden = false) const {
    acts.resize(dims_.size());
    acts[0].assign(x, x + static_cast<std::size_t>(B) * dims_[0]);
    for (int l = 0; l < layers(); ++l) {
      acts[l + 1].resize(static_cast<std::size_t>(B) * dims_[l + 1]);
      forward_layer(l, p + w_[l], p + b_[l], acts[l].data(), B, acts[l + 1].data(), tanh_hidden);
    }
    return acts.back();
  }

  //! Mean squared error of outputs y [B][out] against targets t [B][out]; if dy is not null it
  //! receives the gradient of the loss with respect to y.
  double output_loss(const float* y, const float* t, int B, std::vector<float>* dy) const {
    const std::size_t n = static_cast<std::size_t>(B) * dims_.back();
    double loss = 0;
    if (dy) dy->resize(n);
    const float scale = 2.0f / static_cast<float>(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float d = y[i] - t[i];
      loss += static_cast<double>(d) * d;
      if (dy) (*dy)[i] = scale * d;
    }
    return loss / static_cast<double>(n);
  }

  //! Backward pass of layer l on B samples: adds the gradients of W_l and b_l to gW [in][out] and
  //! gb [out], given its input X [B][in] (acts[l]) and the gradient dy [B][out] of the loss with
  //! respect to its pre-activation output (the layer above's dx, already masked by the ReLU).
  //! If dx is not null, writes dx [B][in], the gradient with respect to X through the ReLU of
  //! layer l - 1 (needs W_l). Samples are accumulated in order, so running the rows in
  //! consecutive parts gives the same bits as one call.
  void backward_layer(int l, const float* W, const float* X, const float* dy, int B, float* gW, float* gb,
                      float* dx) const {
    const int in = dims_[l], o = dims_[l + 1];
    for (int b = 0; b < B; ++b) axpy(1.0f, dy + static_cast<std::size_t>(b) * o, gb, o);
    for (int i = 0; i < in; ++i) {
      float* gwi = gW + static_cast<std::size_t>(i) * o;
      for (int b = 0; b < B; ++b)
        axpy(X[static_cast<std::size_t>(b) * in + i], dy + static_cast<std::size_t>(b) * o, gwi, o);
    }
    if (dx == nullptr) return;
    for (int i = 0; i < in; ++i) {
      const float* wi = W + static_cast<std::size_t>(i) * o;
      for (int b = 0; b < B; ++b) {
        const std::size_t k = static_cast<std::size_t>(b) * in + i;
        dx[k] = X[k] > 0.0f ? dot(wi, dy + static_cast<std::size_t>(b) * o, o) : 0.0f;  // ReLU mask
      }
    }
  }

  //! Mean squared error of the outputs against targets t [B][out], and (if grad is not null) its
  //! gradient with respect to the parameters written to grad (numel() floats, overwritten).
  //! Uses the activations `acts` of a forward pass; backpropagates through parameters `p` (the
  //! same values, gathered again for the backward pass).
  double loss_and_grad(const float* p, const std::vector<std::vector<float>>& acts, const float* t, int B,
                       float* grad) const {
    std::vector<float> dy, dx;
    const double loss = output_loss(acts.back().data(), t, B, grad ? &dy : nullptr);
    if (grad == nullptr) return loss;
    std::fill(grad, grad + numel_, 0.0f);
    for (int l = layers() - 1; l >= 0; --l) {
      if (l > 0) dx.resize(static_cast<std::size_t>(B) * dims_[l]);
      backward_layer(l, p + w_[l], acts[l].data(), dy.data(), B, grad + w_[l], grad + b_[l],
                     l > 0 ? dx.data() : nullptr);
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

//! Slot granule of the demo's tensor groups: a multiple of every block size its plans use.
inline std::size_t demo_granule() {
  return qcoll::granule_for(sizeof(bfloat16), {kBlock, qcoll::Identity<bfloat16>::block});
}

//! Layout of layer l of the student of `c` over `ranks` shards: one tensor group {W_l, b_l}, each
//! tensor in its own slot of whole blocks.
inline qcoll::TensorGroup demo_layer_group(const DemoConfig& c, int l) {
  const Mlp model = Mlp::student(c);
  return qcoll::TensorGroup({model.w_numel(l), model.b_numel(l)}, c.ranks, demo_granule());
}

namespace detail {

inline Bytes operator+(Bytes a, Bytes b) { return Bytes{a.intra + b.intra, a.inter + b.inter}; }
inline Bytes operator-(Bytes a, Bytes b) { return Bytes{a.intra - b.intra, a.inter - b.inter}; }
template <class Sub>
Bytes bytes_of(const Sub& t) {
  return Bytes{t.counters().intra_node, t.counters().inter_node};
}

//! One rank's run with forward-gather format FwdF and gradient formats GradF1 / GradF2.
template <class FwdF, class GradF1, class GradF2, class Transport>
RunResult train_rank(Transport& world, const qcoll::Topology& topo, const DemoConfig& c, Techniques tech,
                     qcoll::Hops hops) {
  using Sub = decltype(world.split(0, 0));
  using Bf16 = qcoll::Identity<bfloat16>;
  using Gather = qcoll::QuantizedAllGather<bfloat16, FwdF, Transport>;
  using Hpz = qcoll::SecondaryShard<bfloat16, Bf16, Transport>;
  using Reduce = qcoll::QuantizedReduceScatter<bfloat16, GradF1, GradF2, Transport>;
  using Qwd = qcoll::DeltaAllGather<bfloat16, qcoll::Int4<kBlock>, Transport>;
  const int W = world.size(), r = world.rank();
  const Mlp model = Mlp::student(c);
  const Task task(c);
  const int L = model.layers();
  const bool zero3 = !tech.zero2, prefetch = tech.prefetch;

  // `metrics` carries the loss values and the evaluation weights, so its traffic stays out of the
  // training counters.
  Sub metrics = world.split(0, r);
  // Hadamard rotation over a whole block (span 2^8 = kBlock), the same seed on every rank.
  const qcoll::Rotation rotation{tech.hadamard ? 8u : 0u, c.seed + 5};
  static_assert(kBlock == 256, "the rotation spans one block");
  // Gradients are rounded to nearest: with Adam, stochastic rounding's extra variance inflates the
  // second moment and slows training more than nearest rounding's bias does.
  const qcoll::HopOptions grad_hop{qcoll::Rounding::nearest, 0, tech.qgz ? rotation : qcoll::Rotation{}};

  // One tensor group {W_l, b_l} per layer and its plans, built collectively in the same order on
  // every rank. One plan per layer and operation, so that several calls can be in flight (a plan
  // takes one at a time). Master weights and Adam state: the layer's shard, fp32.
  struct Layer {
    qcoll::TensorGroup group;
    std::unique_ptr<Gather> gather;  // ZeRO-3: forward (and, without hpZ, backward) weight gather
    std::unique_ptr<Hpz> hpz;        // ZeRO++: backward gather from the node-local secondary shard
    std::unique_ptr<Reduce> reduce;  // gradient reduce-scatter
    std::unique_ptr<Qwd> qwd;        // ZeRO-2: weight-difference all-gather
    std::unique_ptr<Workspace> ws_gather, ws_reduce, residual;
    std::size_t S = 0, P = 0, off = 0;
    std::vector<float> master, m, v, weights, grad;
    std::vector<bfloat16> shard, full, grad16, grad_shard, replica;
    typename Gather::Pending pending_gather;
    typename Hpz::Pending pending_hpz;
    typename Reduce::Pending pending_reduce;
    explicit Layer(qcoll::TensorGroup g) : group(std::move(g)) {}
  };
  std::vector<std::unique_ptr<Layer>> layers;
  const std::vector<float> init = model.init(c.seed, 0.5f);
  RunResult res;
  res.techniques = tech;
  for (int l = 0; l < L; ++l) {
    layers.push_back(std::make_unique<Layer>(demo_layer_group(c, l)));
    Layer& y = *layers.back();
    const qcoll::TensorGroup& g = y.group;
    if (zero3)
      y.gather = std::make_unique<Gather>(
          world, g, qcoll::HopOptions{qcoll::Rounding::nearest, 0, tech.qwz4 ? rotation : qcoll::Rotation{}});
    if (zero3 && tech.hpz) y.hpz = std::make_unique<Hpz>(world, topo, g);
    y.reduce = std::make_unique<Reduce>(world, topo, g, qcoll::Reduce::mean, hops,
                                        qcoll::ReduceScatterOptions{grad_hop, grad_hop});
    if (!zero3) y.qwd = std::make_unique<Qwd>(world, g);
    y.ws_gather = std::make_unique<Workspace>(std::max(
        {y.gather ? y.gather->workspace_bytes() : std::size_t{0},
         y.hpz ? y.hpz->workspace_bytes() : std::size_t{0}, y.qwd ? y.qwd->workspace_bytes() : std::size_t{0},
         y.qwd ? y.qwd->template resync_workspace_bytes<Bf16>() : std::size_t{0}}));
    y.ws_reduce = std::make_unique<Workspace>(y.reduce->workspace_bytes());
    y.residual = std::make_unique<Workspace>(tech.feedback ? y.reduce->residual_bytes() : 0);
    if (tech.feedback) y.reduce->init_residual(y.residual->data(), y.residual->size());
    y.S = g.shard_numel();
    y.P = g.padded_numel();
    y.off = g.layout().shard_offset(r);
    y.master.assign(y.S, 0.0f);
    y.m.assign(y.S, 0.0f);
    y.v.assign(y.S, 0.0f);
    // The layer's part of the initial weights: W_l and b_l pieces of this rank's shard (the
    // padding between and after them stays 0 and is never read as data).
    g.for_each_piece(r, [&](const qcoll::TensorGroup::Piece& pc) {
      const std::size_t src = (pc.tensor == 0 ? model.w_offset(l) : model.b_offset(l)) + pc.tensor_offset;
      std::copy(init.begin() + static_cast<std::ptrdiff_t>(src),
                init.begin() + static_cast<std::ptrdiff_t>(src + pc.count),
                y.master.begin() + static_cast<std::ptrdiff_t>(pc.offset - y.off));
    });
    y.weights.assign(y.P, 0.0f);
    y.grad.assign(y.P, 0.0f);
    y.shard.resize(y.S);
    y.full.resize(y.P);
    y.grad16.resize(y.P);
    y.grad_shard.resize(y.S);
    y.replica.resize(zero3 ? 0 : y.P);
    res.numel += g.data_numel();
    res.padded_numel += y.P;
    res.shard_numel += y.S;
    res.layer_shard_numel.push_back(y.S);
  }
  std::vector<float> x, t, dy, dx;
  std::vector<std::vector<float>> acts(static_cast<std::size_t>(L) + 1);

  // Held-out loss of the fp32 master weights (gathered unquantized over `metrics`, then placed in
  // the model's flat buffer).
  auto evaluate = [&]() {
    std::vector<float> flat(model.numel()), all;
    for (int l = 0; l < L; ++l) {
      const Layer& y = *layers[static_cast<std::size_t>(l)];
      all.assign(y.P, 0.0f);
      metrics.all_gather(y.master.data(), all.data(), y.S * sizeof(float));
      std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(y.group.offset(0)), model.w_numel(l),
                  flat.begin() + static_cast<std::ptrdiff_t>(model.w_offset(l)));
      std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(y.group.offset(1)), model.b_numel(l),
                  flat.begin() + static_cast<std::ptrdiff_t>(model.b_offset(l)));
    }
    const int per_rank = (c.eval_samples + W - 1) / W;
    const int first = r * per_rank, count = std::max(0, std::min(c.eval_samples - first, per_rank));
    double sums[2] = {0, 0};
    if (count > 0) {
      std::vector<std::vector<float>> eval_acts;
      task.samples(1u << 20, static_cast<std::uint64_t>(first), 1, count, x, t);
      model.forward(flat.data(), x.data(), count, eval_acts);
      sums[0] = model.loss_and_grad(flat.data(), eval_acts, t.data(), count, nullptr) * count;
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
  auto to_bf16 = [](const std::vector<float>& in, std::vector<bfloat16>& out) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = qcoll::from_float<bfloat16>(in[i]);
  };
  // Bytes handed to every transport of the training plans so far. A nonblocking exchange is
  // counted when this rank completes it, inside a call on its own handle, so the difference
  // around one call is that call's traffic.
  auto all_bytes = [&]() {
    Bytes b = bytes_of(world);
    for (const auto& y : layers) {
      b = b + bytes_of(y->reduce->intra_node()) + bytes_of(y->reduce->inter_node());
      if (y->hpz) b = b + bytes_of(y->hpz->intra_node());
    }
    return b;
  };

  res.initial_eval = evaluate();
  for (auto& y : layers)  // ZeRO-2: every replica starts as the initial weights, exactly (set-up)
    if (y->qwd) {
      to_bf16(y->master, y->shard);
      y->qwd->template resync<Bf16>(y->shard.data(), y->replica.data(), y->ws_gather->data(),
                                    y->ws_gather->size());
    }
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  const int B = c.batch, half = B / 2;
  for (int step = 0; step < c.steps; ++step) {
    StepStats st;
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    // A communication call (blocking, start, progress or finish): its time is waiting for
    // communication, its bytes belong to `phase`.
    auto comm = [&](Bytes& phase, auto&& call) {
      const Bytes before = all_bytes();
      const auto c0 = std::chrono::steady_clock::now();
      call();
      st.comm_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
      phase = phase + (all_bytes() - before);
    };
    auto layer = [&](int l) -> Layer& { return *layers[static_cast<std::size_t>(l)]; };
    // Backward weight gathers of ZeRO++ come from the node-local hpZ copy, the others from the
    // all-gather.
    bool in_backward = false;
    const auto generation = static_cast<std::uint64_t>(step);
    auto start_gather = [&](Bytes& phase, int l) {
      Layer& y = layer(l);
      comm(phase, [&] {
        if (in_backward && y.hpz)
          y.pending_hpz = y.hpz->start(y.full.data(), generation, y.ws_gather->data(), y.ws_gather->size());
        else
          y.pending_gather =
              y.gather->start(y.shard.data(), y.full.data(), y.ws_gather->data(), y.ws_gather->size());
      });
    };
    // Weights of layer l, gathered: finishes the prefetched call, or makes a blocking one.
    auto gather_weights = [&](Bytes& phase, int l) {
      Layer& y = layer(l);
      const bool from_hpz = in_backward && y.hpz;
      if (prefetch)
        comm(phase, [&] {
          if (from_hpz)
            y.hpz->finish(y.pending_hpz);
          else
            y.gather->finish(y.pending_gather);
        });
      else
        comm(phase, [&] {
          if (from_hpz)
            y.hpz->gather(y.full.data(), generation, y.ws_gather->data(), y.ws_gather->size());
          else
            (*y.gather)(y.shard.data(), y.full.data(), y.ws_gather->data(), y.ws_gather->size());
        });
    };
    // Lets the calls in flight move (LocalTransport: makes copies for peers; MPI: tests requests).
    auto progress = [&]() {
      for (auto& y : layers) {
        if (y->pending_gather.active())
          comm(in_backward ? st.backward : st.forward, [&] { y->pending_gather.progress(); });
        if (y->pending_hpz.active()) comm(st.backward, [&] { y->pending_hpz.progress(); });
        if (y->pending_reduce.active()) comm(st.gradient, [&] { y->pending_reduce.progress(); });
      }
    };

    const std::uint64_t first_id = (static_cast<std::uint64_t>(step) * W + r) * static_cast<std::uint64_t>(B);
    task.samples(0, first_id, 1, B, x, t);
    acts[0] = x;

    // Forward, layer by layer. ZeRO-3: gather the layer's weights (qwZ or bf16; with prefetch the
    // gather of layer l + 1 runs while layer l computes), keep the hpZ secondary shard, compute,
    // free the gathered weights. ZeRO-2: the replica is the weights.
    for (auto& y : layers) to_bf16(y->master, y->shard);
    if (zero3 && prefetch) start_gather(st.forward, 0);
    for (int l = 0; l < L; ++l) {
      Layer& y = layer(l);
      if (zero3) {
        gather_weights(st.forward, l);
        if (y.hpz) y.hpz->capture(y.full.data(), generation);
      }
      to_float(zero3 ? y.full : y.replica, y.weights);
      if (zero3 && prefetch && l + 1 < L) start_gather(st.forward, l + 1);
      const float* Wl = y.weights.data() + y.group.offset(0);
      const float* bl = y.weights.data() + y.group.offset(1);
      const int in = model.dim(l), out = model.dim(l + 1);
      acts[static_cast<std::size_t>(l) + 1].resize(static_cast<std::size_t>(B) * out);
      float* out_rows = acts[static_cast<std::size_t>(l) + 1].data();
      const float* in_rows = acts[static_cast<std::size_t>(l)].data();
      model.forward_layer(l, Wl, bl, in_rows, half, out_rows);
      progress();
      model.forward_layer(l, Wl, bl, in_rows + static_cast<std::size_t>(half) * in, B - half,
                          out_rows + static_cast<std::size_t>(half) * out);
      progress();
      if (zero3) std::fill(y.full.begin(), y.full.end(), bfloat16{});  // ZeRO-3 frees the gathered weights
    }

    // Backward, layer by layer in reverse: the layer's weights again (ZeRO++: from the node-local
    // hpZ secondary shard; plain: the all-gather; with prefetch started one layer ahead),
    // backpropagate, then start the reduce-scatter (mean over ranks) of the layer's gradient;
    // it completes while the layers below compute, and is finished before the optimizer step.
    in_backward = true;
    const double loss = model.output_loss(acts.back().data(), t.data(), B, &dy);
    if (zero3 && prefetch) start_gather(st.backward, L - 1);
    for (int l = L - 1; l >= 0; --l) {
      Layer& y = layer(l);
      if (zero3) {
        gather_weights(st.backward, l);
        to_float(y.full, y.weights);
      }
      if (zero3 && prefetch && l > 0) start_gather(st.backward, l - 1);
      const float* Wl = y.weights.data() + y.group.offset(0);
      float* gW = y.grad.data() + y.group.offset(0);
      float* gb = y.grad.data() + y.group.offset(1);
      std::fill(y.grad.begin(), y.grad.end(), 0.0f);
      const int in = model.dim(l), out = model.dim(l + 1);
      const float* X = acts[static_cast<std::size_t>(l)].data();
      if (l > 0) dx.resize(static_cast<std::size_t>(B) * in);
      model.backward_layer(l, Wl, X, dy.data(), half, gW, gb, l > 0 ? dx.data() : nullptr);
      progress();
      model.backward_layer(l, Wl, X + static_cast<std::size_t>(half) * in,
                           dy.data() + static_cast<std::size_t>(half) * out, B - half, gW, gb,
                           l > 0 ? dx.data() + static_cast<std::size_t>(half) * in : nullptr);
      dy.swap(dx);
      if (zero3) std::fill(y.full.begin(), y.full.end(), bfloat16{});
      to_bf16(y.grad, y.grad16);
      const qcoll::ResidualState residual{y.residual->data(), y.residual->size()};
      if (prefetch)
        comm(st.gradient, [&] {
          y.pending_reduce = tech.feedback
                                 ? y.reduce->start(y.grad16.data(), y.grad_shard.data(), y.ws_reduce->data(),
                                                   y.ws_reduce->size(), residual)
                                 : y.reduce->start(y.grad16.data(), y.grad_shard.data(), y.ws_reduce->data(),
                                                   y.ws_reduce->size());
        });
      else
        comm(st.gradient, [&] {
          if (tech.feedback)
            (*y.reduce)(y.grad16.data(), y.grad_shard.data(), y.ws_reduce->data(), y.ws_reduce->size(),
                        residual);
          else
            (*y.reduce)(y.grad16.data(), y.grad_shard.data(), y.ws_reduce->data(), y.ws_reduce->size());
        });
    }
    for (int l = L - 1; l >= 0; --l)
      if (layer(l).pending_reduce.active())
        comm(st.gradient, [&] { layer(l).reduce->finish(layer(l).pending_reduce); });

    // Adam on the own shard of every layer (the padding of the group stays 0: its gradient is 0).
    const double k = static_cast<double>(step + 1);
    const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(b1, k)));
    const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(b2, k)));
    for (auto& yp : layers) {
      Layer& y = *yp;
      y.group.for_each_piece(r, [&](const qcoll::TensorGroup::Piece& pc) {
        for (std::size_t i = pc.offset - y.off; i < pc.offset - y.off + pc.count; ++i) {
          const float g = qcoll::to_float(y.grad_shard[i]);
          y.m[i] = static_cast<float>(b1) * y.m[i] + static_cast<float>(1.0 - b1) * g;
          y.v[i] = static_cast<float>(b2) * y.v[i] + static_cast<float>(1.0 - b2) * g * g;
          y.master[i] -= c.lr * (y.m[i] * c1) / (std::sqrt(y.v[i] * c2) + static_cast<float>(eps));
        }
      });
    }
    // ZeRO-2: every replica takes the owners' updated weights, as int4 differences.
    for (auto& y : layers)
      if (y->qwd) {
        to_bf16(y->master, y->shard);
        comm(st.update, [&] {
          (*y->qwd)(y->shard.data(), y->replica.data(), y->ws_gather->data(), y->ws_gather->size());
        });
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
