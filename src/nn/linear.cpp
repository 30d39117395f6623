#include "qkv/nn/linear.hpp"

#include <fmt/format.h>

#include "qkv/core/error.hpp"
#include "qkv/ops/linear.hpp"

namespace qkv {

template <class T>
Linear<T>::Linear(const LinearConfig& config, Rng& rng) : config_(config) {
  if (config.in_features < 1) {
    throw ValueError(fmt::format("in_features: expected at least 1, got {}", config.in_features));
  }
  if (config.out_features < 1) {
    throw ValueError(fmt::format("out_features: expected at least 1, got {}", config.out_features));
  }
  weight_ = Parameter<T>(Shape{config.out_features, config.in_features});
  if (config.bias) bias_ = Parameter<T>(Shape{config.out_features});
  linear_init<T>(weight_.value.view(), config.bias ? std::optional(bias_.value.view()) : std::nullopt, rng);
}

// The op would blame a wrong In on the weight, which the caller did not pass.
template <class T>
void Linear<T>::check_input(std::string_view name, const Shape& x) const {
  if (x.rank() < 2 || x.rank() > 4 || x.from_back(1) != config_.in_features) {
    throw ShapeError(fmt::format("{}: expected rank 2 to 4 with last dim {} ([..., In]), got shape {}", name,
                                 config_.in_features, x.str()));
  }
}

template <class T>
Tensor<T> Linear<T>::forward(TensorView<const T> x) const {
  check_input("x", x.shape);
  Shape shape = x.shape;
  shape[x.rank() - 1] = config_.out_features;
  Tensor<T> y(shape);
  forward(x, y.view());
  return y;
}

template <class T>
void Linear<T>::forward(TensorView<const T> x, TensorView<T> y) const {
  check_input("x", x.shape);
  linear_forward<T>(
      {.x = x, .w = weight_.value.cview(), .b = config_.bias ? std::optional(bias_.value.cview()) : std::nullopt}, y);
}

template <class T>
void Linear<T>::backward(TensorView<const T> x, TensorView<const T> dy, std::optional<TensorView<T>> dx) {
  check_input("x", x.shape);
  linear_backward<T>(
      {.x = x, .w = weight_.value.cview(), .b = config_.bias ? std::optional(bias_.value.cview()) : std::nullopt}, dy,
      {.dx = dx, .dw = weight_.grad.view(), .db = config_.bias ? std::optional(bias_.grad.view()) : std::nullopt});
}

template <class T>
void Linear<T>::zero_grad() {
  weight_.zero_grad();
  bias_.zero_grad();
}

template <class T>
std::vector<ParameterRef<T>> Linear<T>::parameters() {
  if (config_.out_features < 1) return {};
  std::vector<ParameterRef<T>> result = {weight_.ref(config_.weight_name)};
  if (config_.bias) result.push_back(bias_.ref(config_.bias_name));
  return result;
}

template <class T>
std::vector<ParameterRef<const T>> Linear<T>::parameters() const {
  if (config_.out_features < 1) return {};
  std::vector<ParameterRef<const T>> result = {weight_.ref(config_.weight_name)};
  if (config_.bias) result.push_back(bias_.ref(config_.bias_name));
  return result;
}

template class Linear<float>;
template class Linear<double>;

}  // namespace qkv
