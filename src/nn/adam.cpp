#include "qkv/nn/adam.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"

namespace qkv {
namespace {

// Elements per parallel task of an update.
constexpr int64_t kTaskElements = int64_t{1} << 13;

// Calls fn(element) for every element of `view` in row-major order.
template <class T, class Fn>
void for_each_element(TensorView<T> view, Fn fn) {
  const TensorView<T> v4 = as_rank4(view);
  for (int64_t a = 0; a < v4.shape[0]; ++a)
    for (int64_t b = 0; b < v4.shape[1]; ++b)
      for (int64_t c = 0; c < v4.shape[2]; ++c)
        for (int64_t d = 0; d < v4.shape[3]; ++d) fn(v4(a, b, c, d));
}

// Element `flat` (row-major) of a view: layers hand out contiguous parameters, which take the
// direct path; a strided view is decomposed into its rank-4 index.
template <class T>
class FlatAccess {
 public:
  explicit FlatAccess(TensorView<T> view) : v4_(as_rank4(view)), contiguous_(view.is_contiguous()) {}
  T& operator[](int64_t flat) const {
    if (contiguous_) return v4_.data[flat];
    const int64_t d = flat % v4_.shape[3];
    const int64_t c = (flat / v4_.shape[3]) % v4_.shape[2];
    const int64_t b = (flat / (v4_.shape[3] * v4_.shape[2])) % v4_.shape[1];
    const int64_t a = flat / (v4_.shape[3] * v4_.shape[2] * v4_.shape[1]);
    return v4_(a, b, c, d);
  }

 private:
  TensorView<T> v4_;
  bool contiguous_;
};

void check_config(const AdamConfig& config) {
  const auto require = [](bool ok, const char* name, const char* expected, double got) {
    if (!ok) throw ValueError(fmt::format("{}: expected {}, got {}", name, expected, got));
  };
  require(config.lr >= 0.0 && std::isfinite(config.lr), "lr", "a finite value >= 0", config.lr);
  require(config.beta1 >= 0.0 && config.beta1 < 1.0, "beta1", "a value in [0, 1)", config.beta1);
  require(config.beta2 >= 0.0 && config.beta2 < 1.0, "beta2", "a value in [0, 1)", config.beta2);
  require(config.eps > 0.0 && std::isfinite(config.eps), "eps", "a finite value > 0", config.eps);
  require(config.weight_decay >= 0.0 && std::isfinite(config.weight_decay), "weight_decay", "a finite value >= 0",
          config.weight_decay);
  if (config.max_grad_norm) {
    require(*config.max_grad_norm > 0.0, "max_grad_norm", "a value > 0", *config.max_grad_norm);
  }
}

}  // namespace

template <class T>
double grad_norm(const std::vector<ParameterRef<T>>& params) {
  double squares = 0.0;
  for (const ParameterRef<T>& p : params) {
    for_each_element(p.grad, [&](T& g) { squares += static_cast<double>(g) * static_cast<double>(g); });
  }
  return std::sqrt(squares);
}

template <class T>
double clip_grad_norm(const std::vector<ParameterRef<T>>& params, double max_norm) {
  if (!(max_norm > 0.0)) throw ValueError(fmt::format("max_norm: expected a value > 0, got {}", max_norm));
  const double norm = grad_norm(params);
  if (!std::isfinite(norm)) {
    throw ValueError(fmt::format("gradients: expected a finite norm to clip, got {}", norm));
  }
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const ParameterRef<T>& p : params) {
      for_each_element(p.grad, [&](T& g) { g = static_cast<T>(static_cast<double>(g) * coef); });
    }
  }
  return norm;
}

template <class T>
Adam<T>::Adam(std::vector<ParameterRef<T>> params, const AdamConfig& config)
    : params_(std::move(params)), config_(config) {
  check_config(config);
  for (const ParameterRef<T>& p : params_) {
    check_shape(fmt::format("{} (grad)", p.name), p.grad.shape, p.value.shape);
    const auto n = static_cast<size_t>(p.value.numel());
    moments_.push_back({std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)});
  }
}

template <class T>
void Adam<T>::set_lr(double lr) {
  if (!(lr >= 0.0) || !std::isfinite(lr)) throw ValueError(fmt::format("lr: expected a finite value >= 0, got {}", lr));
  config_.lr = lr;
}

template <class T>
double Adam<T>::step() {
  const double norm = config_.max_grad_norm ? clip_grad_norm(params_, *config_.max_grad_norm) : grad_norm(params_);
  ++steps_;
  const double t = static_cast<double>(steps_);
  const double correction1 = 1.0 - std::pow(config_.beta1, t);
  const double correction2 = 1.0 - std::pow(config_.beta2, t);
  const double lr = config_.lr;
  const double decay = config_.weight_decay;
  for (size_t i = 0; i < params_.size(); ++i) {
    const FlatAccess<T> values(params_[i].value);
    const FlatAccess<T> grads(params_[i].grad);
    Moments& moments = moments_[i];
    const int64_t n = params_[i].value.numel();
    const int64_t tasks = (n + kTaskElements - 1) / kTaskElements;
    parallel_for(tasks, [&](int64_t task, int /*worker*/) {
      const int64_t end = std::min(n, (task + 1) * kTaskElements);
      for (int64_t e = task * kTaskElements; e < end; ++e) {
        T& value = values[e];
        double p = static_cast<double>(value);
        double g = static_cast<double>(grads[e]);
        if (decay > 0.0) {
          if (config_.decoupled_weight_decay) {
            p -= lr * decay * p;
          } else {
            g += decay * p;
          }
        }
        double& m = moments.m[static_cast<size_t>(e)];
        double& v = moments.v[static_cast<size_t>(e)];
        m = config_.beta1 * m + (1.0 - config_.beta1) * g;
        v = config_.beta2 * v + (1.0 - config_.beta2) * g * g;
        p -= lr * (m / correction1) / (std::sqrt(v / correction2) + config_.eps);
        value = static_cast<T>(p);
      }
    });
  }
  return norm;
}

template <class T>
void Adam<T>::zero_grad() {
  for (const ParameterRef<T>& p : params_) for_each_element(p.grad, [](T& g) { g = T{0}; });
}

#define QKV_INSTANTIATE_ADAM(T)                                                \
  template double grad_norm(const std::vector<ParameterRef<T>>&);              \
  template double clip_grad_norm(const std::vector<ParameterRef<T>>&, double); \
  template class Adam<T>;

QKV_INSTANTIATE_ADAM(float)
QKV_INSTANTIATE_ADAM(double)
#undef QKV_INSTANTIATE_ADAM

}  // namespace qkv
