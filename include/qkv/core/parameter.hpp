#pragma once
// Learnable tensors as layers own them and as optimisers see them.
//
// A layer owns each parameter as a Parameter<T>: the value and its gradient, of one shape. It hands
// them out as ParameterRef<T>: a name and two views into the layer, which an optimiser updates in
// place and a test perturbs. Backward passes add into `grad`; zeroing is explicit (zero_grad).

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "qkv/core/tensor.hpp"

namespace qkv {

// One learnable tensor of a layer. The views point into the layer and stay valid as long as it does.
template <class T>
struct ParameterRef {
  std::string name;  // the layer's name for it, e.g. "w_q" or "weight_ih_l0"
  TensorView<T> value;
  TensorView<T> grad;  // same shape as value; the backward adds into it
};

// A value and its gradient, both contiguous, of the same shape; the gradient starts at zero.
template <class T>
struct Parameter {
  Tensor<T> value;
  Tensor<T> grad;

  Parameter() = default;
  explicit Parameter(const Shape& shape) : value(shape), grad(shape) {}

  ParameterRef<T> ref(std::string name) { return {std::move(name), value.view(), grad.view()}; }
  ParameterRef<const T> ref(std::string name) const { return {std::move(name), value.view(), grad.view()}; }
  void zero_grad() { std::fill(grad.values().begin(), grad.values().end(), T{0}); }
};

}  // namespace qkv
