#pragma once
// A single-layer tanh RNN, as torch.nn.RNN(In, H, batch_first=True): forward, backward through
// time, initialisation. Also the forward/backward argument structs that qkv's recurrent layers share.
//
// Shapes: x [B, T, In], h0 [B, H], lengths [B], y [B, T, H], h_n [B, H].
//   h_t = tanh(W_ih x_t + b_ih + W_hh h_{t−1} + b_hh)      t = 0 .. len_b − 1,  h_{−1} = h0
//   y[b, t] = h_t for t < len_b and 0 past it;  h_n[b] = h_{len_b − 1} (h0 when len_b = 0)
// W_ih [H, In], W_hh [H, H], b_ih [H], b_hh [H]. A reversed layer (config.reverse) reads each
// sequence from its last valid token to its first (t = len_b − 1 .. 0, h_{len_b} = h0), as the
// backward direction of a bidirectional torch.nn.RNN does; y[b, t] is then the state after reading
// x[b, t .. len_b − 1].
//
// Cost and threads: the input projections of every step are one linear_forward over [B·T, In];
// the recurrence is T sequential steps, each a batched matrix-vector product W_hh h split over
// (batch element, block of rows) tasks, so one long sequence (B = 1) still uses several threads
// when H is large. Dot products are accumulated in float64 in a fixed order: any thread count
// gives bit-identical results.

#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv {

// What a recurrent layer's forward reads.
template <class T>
struct RecurrentInputs {
  TensorView<const T> x;  // [B, T, In]
  // [B, H] ([2, B, H] for a bidirectional layer); zeros when absent.
  std::optional<TensorView<const T>> h0 = std::nullopt;
  // [B], each in [0, T]: sequence b is x[b, :len_b], and positions past it are padding; all T when absent.
  std::optional<TensorView<const int64_t>> lengths = std::nullopt;
};

// What a recurrent layer's forward returns.
template <class T>
struct RecurrentOutputs {
  Tensor<T> y;    // [B, T, H]: the state after each token, 0 past a sequence's length
  Tensor<T> h_n;  // [B, H] ([2, B, H] for a bidirectional layer): the state after each sequence's last step
};

// The gradients that reach a recurrent layer from above; y past a sequence's length is a constant
// 0, so dy there is ignored.
template <class T>
struct RecurrentOutputGradients {
  TensorView<const T> dy;                                  // [B, T, H]
  std::optional<TensorView<const T>> dh_n = std::nullopt;  // [B, H]; 0 when absent
};

// Accumulated by the backward (+=); a gradient that is not given is not computed.
template <class T>
struct RecurrentInputGradients {
  std::optional<TensorView<T>> dx = std::nullopt;   // [B, T, In]
  std::optional<TensorView<T>> dh0 = std::nullopt;  // [B, H]
};

struct RnnConfig {
  int64_t input_size = 0;   // In, >= 0
  int64_t hidden_size = 0;  // H, >= 1
  bool bias = true;         // b_ih and b_hh are learned
  bool reverse = false;     // read each sequence from its end to its start
};

// What the forward leaves for the backward. A cache may be reused across calls.
template <class T>
struct RnnCache {
  Tensor<T> x;                   // [B, T, In]: the input, as given
  Tensor<T> h0;                  // [B, H]: the initial state (zeros when none was given)
  Tensor<T> h;                   // [B, T, H]: the states h_t, 0 past a sequence's length (= y)
  std::vector<int64_t> lengths;  // [B]: len_b
};

template <class T>
class Rnn {
 public:
  // Throws ValueError when input_size < 0 or hidden_size < 1. Every parameter is drawn from
  // U(−1/√H, 1/√H) as torch.nn.RNN does, in the order W_ih, W_hh, b_ih, b_hh; gradients start at 0.
  Rnn(const RnnConfig& config, Rng& rng);

  const RnnConfig& config() const { return config_; }

  RecurrentOutputs<T> forward(const RecurrentInputs<T>& inputs, RnnCache<T>& cache) const;

  // Back through time, from the last step to the first: dx and dh0 += theirs, and every parameter
  // gradient += its ∂L/∂W, for L = <dy, y> + <dh_n, h_n>.
  void backward(const RnnCache<T>& cache, const RecurrentOutputGradients<T>& output_grads,
                const RecurrentInputGradients<T>& input_grads);

  void zero_grad();

  // {"weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"} as PyTorch names them (with a
  // "_reverse" suffix for a reversed layer); no biases without config.bias.
  std::vector<ParameterRef<T>> parameters();
  std::vector<ParameterRef<const T>> parameters() const;

 private:
  RnnConfig config_;
  Parameter<T> w_ih_, w_hh_, b_ih_, b_hh_;
};

}  // namespace qkv
