#pragma once
// Test helpers shared by every qkv test: comparisons that report where they fail, central finite
// differences; random tensors and the tolerance rule come from support/attention_problems.hpp,
// which `qkv soak` shares.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "qkv/core/rng.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/core/tensor.hpp"
#include "support/attention_problems.hpp"

namespace qkv::testing {

// Passes when every |actual − expected| <= tolerance; the failure message gives the max and
// mean error, the worst index and the two values there.
template <class A, class E>
::testing::AssertionResult all_close(const std::string& what, const Tensor<A>& actual, const Tensor<E>& expected,
                                     double tolerance) {
  if (!(actual.shape() == expected.shape())) {
    return ::testing::AssertionFailure() << what << ": shape " << actual.shape().str() << " differs from expected "
                                         << expected.shape().str();
  }
  const ErrorStats stats = error_stats(actual, expected);
  if (!stats.non_finite && stats.max_abs <= tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << fmt::format(
             "{}: max error {:.3e} > tolerance {:.3e} (mean error {:.3e}); worst at {}: got {:.9g}, expected {:.9g}",
             what, stats.max_abs, tolerance, stats.mean_abs, index_str(actual.shape(), stats.worst),
             static_cast<double>(actual[stats.worst]), static_cast<double>(expected[stats.worst]));
}

// Central finite differences of a scalar loss with respect to every element of a contiguous view x,
// in float64. `loss` reads x (which this function perturbs in place and restores); a view lets the
// caller perturb storage it does not own, such as a layer's parameters.
inline Tensor<double> numeric_gradient(const std::function<double()>& loss, TensorView<double> x, double step = 1e-6) {
  Tensor<double> grad(x.shape);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double saved = x.data[i];
    x.data[i] = saved + step;
    const double up = loss();
    x.data[i] = saved - step;
    const double down = loss();
    x.data[i] = saved;
    grad[i] = (up - down) / (2.0 * step);
  }
  return grad;
}

inline Tensor<double> numeric_gradient(const std::function<double()>& loss, Tensor<double>& x, double step = 1e-6) {
  return numeric_gradient(loss, x.view(), step);
}

// Passes when `call` throws E whose message contains every one of `parts` (argument names,
// expected and actual shapes); fails when it throws nothing, another type, or another message.
template <class E>
::testing::AssertionResult throws_naming(const std::function<void()>& call, const std::vector<std::string>& parts) {
  try {
    call();
  } catch (const E& e) {
    const std::string message = e.what();
    for (const std::string& part : parts) {
      if (message.find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << message << "\" does not mention \"" << part << "\"";
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw the wrong type: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// <a, b> summed in float64.
template <class T>
double dot(const Tensor<T>& a, const Tensor<T>& b) {
  double sum = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) sum += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return sum;
}

// Runs the SIMD kernels on `target` ("" = the best) for the scope's life and restores the best
// when it ends, even when a failed assertion ends it.
class SimdTargetScope {
 public:
  explicit SimdTargetScope(const std::string& target = "") { use_simd_target(target); }
  ~SimdTargetScope() { use_simd_target(""); }
  SimdTargetScope(const SimdTargetScope&) = delete;
  SimdTargetScope& operator=(const SimdTargetScope&) = delete;
};

}  // namespace qkv::testing
