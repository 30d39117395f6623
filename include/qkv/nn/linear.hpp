#pragma once
// A fully connected layer that owns its parameters, as torch.nn.Linear: the op of qkv/ops/linear.hpp
// with the weight and bias kept in the layer.
//
// Shapes: x [..., In] (rank 2 to 4; every leading index selects one row), weight [Out, In],
// bias [Out], y [..., Out] with x's leading dims.
//   y_n = W x_n + b    (y_n = W x_n without the bias)
// The forward and backward are linear_forward and linear_backward on the views given, so they
// choose their implementation as those do and give the same results to the bit.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv {

struct LinearConfig {
  int64_t in_features = 0;   // In
  int64_t out_features = 0;  // Out
  bool bias = true;          // b is added
  // The names parameters() gives: model files store parameters by name, so a model keeps the
  // names its files were written with.
  std::string weight_name = "weight";
  std::string bias_name = "bias";
};

template <class T>
class Linear {
 public:
  // An empty layer, without features or parameters: for a member that is built later in its
  // owner's constructor (when its draws must follow those of members declared after it), or not
  // at all (a part that the owner's config leaves out).
  Linear() = default;

  // Throws ValueError when in_features or out_features < 1. weight, then bias, are drawn by
  // linear_init (U(−1/√In, 1/√In), as torch.nn.Linear); gradients start at zero.
  Linear(const LinearConfig& config, Rng& rng);

  const LinearConfig& config() const { return config_; }

  // x [..., In] → y [..., Out].
  Tensor<T> forward(TensorView<const T> x) const;
  // The same into y [..., Out] (overwritten), a view of any layout that linear_forward reads.
  void forward(TensorView<const T> x, TensorView<T> y) const;

  // x [..., In] of the forward and dy [..., Out] = ∂L/∂y → dweight += dyᵀ x, dbias += Σ_rows dy,
  // and dx [..., In] += dy W when dx is given.
  void backward(TensorView<const T> x, TensorView<const T> dy, std::optional<TensorView<T>> dx);

  void zero_grad();

  // {weight [Out, In], bias [Out]} under config's names; the bias only when config.bias is set, and
  // nothing for a layer built by the default constructor.
  std::vector<ParameterRef<T>> parameters();
  std::vector<ParameterRef<const T>> parameters() const;

 private:
  // Throws ShapeError naming `name` when x's rank is outside 2 to 4 or its last dim is not In.
  void check_input(std::string_view name, const Shape& x) const;

  LinearConfig config_;
  Parameter<T> weight_, bias_;
};

}  // namespace qkv
