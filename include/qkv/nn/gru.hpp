#pragma once
// A single-layer GRU, as torch.nn.GRU(In, H, batch_first=True): forward and backward through time
// over whole sequences, the same cell stepped one token at a time (for a decoder), and a
// bidirectional layer made of a forward and a reversed GRU.
//
// Shapes: x [B, T, In], h0 [B, H], lengths [B], y [B, T, H], h_n [B, H] (the structs of rnn.hpp).
// PyTorch's equations and gate order (r, z, n), for t = 0 .. len_b − 1 and h_{−1} = h0:
//   r_t = σ(W_ir x_t + b_ir + W_hr h_{t−1} + b_hr)          reset gate
//   z_t = σ(W_iz x_t + b_iz + W_hz h_{t−1} + b_hz)          update gate
//   n_t = tanh(W_in x_t + b_in + r_t ∘ (W_hn h_{t−1} + b_hn))   candidate
//   h_t = (1 − z_t) ∘ n_t + z_t ∘ h_{t−1}
// W_ih = [W_ir; W_iz; W_in] [3H, In], W_hh = [W_hr; W_hz; W_hn] [3H, H], b_ih and b_hh [3H], rows
// in the order r, z, n. y[b, t] = h_t for t < len_b and 0 past it; h_n[b] = h_{len_b − 1} (h0 when
// len_b = 0). A reversed layer (config.reverse) reads each sequence from its last valid token to
// its first, as the backward direction of a bidirectional torch.nn.GRU.
//
// Cost and threads: as the RNN of rnn.hpp: one linear_forward for the input projections of every
// step, then per step a batched W_hh h split over (batch element, block of rows) tasks, with dot
// products in float64 in a fixed order (bit-identical results for any thread count).

#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/nn/rnn.hpp"

namespace qkv {

struct GruConfig {
  int64_t input_size = 0;   // In, >= 0
  int64_t hidden_size = 0;  // H, >= 1
  bool bias = true;         // b_ih and b_hh are learned
  bool reverse = false;     // read each sequence from its end to its start
};

// What the forward leaves for the backward: the gates of every step. A cache may be reused.
template <class T>
struct GruCache {
  Tensor<T> x;                   // [B, T, In]: the input, as given
  Tensor<T> h0;                  // [B, H]: the initial state (zeros when none was given)
  Tensor<T> h;                   // [B, T, H]: the states h_t, 0 past a sequence's length (= y)
  Tensor<T> r;                   // [B, T, H]: reset gate r_t
  Tensor<T> z;                   // [B, T, H]: update gate z_t
  Tensor<T> n;                   // [B, T, H]: candidate n_t
  Tensor<T> hn;                  // [B, T, H]: W_hn h_{t−1} + b_hn, the part the reset gate scales
  std::vector<int64_t> lengths;  // [B]: len_b
};

// Accumulated by step_backward (+=); a gradient that is not given is not computed.
template <class T>
struct GruStepGradients {
  std::optional<TensorView<T>> dx = std::nullopt;  // [B, In]
  std::optional<TensorView<T>> dh = std::nullopt;  // [B, H]: the gradient of the state the step read
};

template <class T>
class Gru {
 public:
  // Throws ValueError when input_size < 0 or hidden_size < 1. Every parameter is drawn from
  // U(−1/√H, 1/√H) as torch.nn.GRU does, in the order W_ih, W_hh, b_ih, b_hh; gradients start at 0.
  Gru(const GruConfig& config, Rng& rng);

  const GruConfig& config() const { return config_; }

  // Whole sequences.
  RecurrentOutputs<T> forward(const RecurrentInputs<T>& inputs, GruCache<T>& cache) const;

  // Back through time, from the last step to the first: dx and dh0 += theirs, and every parameter
  // gradient += its ∂L/∂W, for L = <dy, y> + <dh_n, h_n>.
  void backward(const GruCache<T>& cache, const RecurrentOutputGradients<T>& output_grads,
                const RecurrentInputGradients<T>& input_grads);

  // One step of the cell, for a decoder that feeds each output back: x [B, In], h [B, H] → the
  // next state h' [B, H]. The same computation as forward on sequences of one token (config.reverse
  // makes no difference); keep one cache per step for the backward.
  Tensor<T> step_forward(TensorView<const T> x, TensorView<const T> h, GruCache<T>& cache) const;

  // dh_next [B, H] = ∂L/∂h' → dx [B, In] and dh [B, H] += theirs; parameter gradients += theirs.
  void step_backward(const GruCache<T>& cache, TensorView<const T> dh_next, const GruStepGradients<T>& grads);

  void zero_grad();

  // {"weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"} as PyTorch names them (with a
  // "_reverse" suffix for a reversed layer); no biases without config.bias.
  std::vector<ParameterRef<T>> parameters();
  std::vector<ParameterRef<const T>> parameters() const;

 private:
  GruConfig config_;
  Parameter<T> w_ih_, w_hh_, b_ih_, b_hh_;
};

template <class T>
struct BidirectionalGruCache {
  GruCache<T> forward;
  GruCache<T> reverse;
};

// torch.nn.GRU(In, H, batch_first=True, bidirectional=True): a forward and a reversed GRU over the
// same input. Shapes: x [B, T, In], h0 [2, B, H] (forward direction first), lengths [B],
// y [B, T, 2H] (features [0, H) from the forward direction, [H, 2H) from the reversed one, as
// PyTorch concatenates them), h_n [2, B, H]. With lengths, the reversed direction starts at each
// sequence's last valid token, as PyTorch's packed sequences do.
template <class T>
class BidirectionalGru {
 public:
  // config describes one direction; throws ValueError when config.reverse is set. The forward
  // direction's parameters are drawn first, then the reversed one's, as PyTorch orders them.
  BidirectionalGru(const GruConfig& config, Rng& rng);

  RecurrentOutputs<T> forward(const RecurrentInputs<T>& inputs, BidirectionalGruCache<T>& cache) const;

  // dy [B, T, 2H], dh_n [2, B, H] → dx [B, T, In], dh0 [2, B, H] +=; parameter gradients +=.
  void backward(const BidirectionalGruCache<T>& cache, const RecurrentOutputGradients<T>& output_grads,
                const RecurrentInputGradients<T>& input_grads);

  void zero_grad();

  // The forward direction's parameters, then the reversed one's ("..._reverse"), as PyTorch lists them.
  std::vector<ParameterRef<T>> parameters();
  std::vector<ParameterRef<const T>> parameters() const;

  Gru<T>& direction(int index) { return index == 0 ? forward_ : reverse_; }
  const Gru<T>& direction(int index) const { return index == 0 ? forward_ : reverse_; }

 private:
  Gru<T> forward_;
  Gru<T> reverse_;
};

}  // namespace qkv
