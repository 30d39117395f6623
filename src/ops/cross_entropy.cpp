#include "qkv/ops/cross_entropy.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "qkv/core/detail/rows.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"

namespace qkv {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The cost of one exp() in multiply-adds, to size the tasks (core/parallel.hpp).
constexpr int64_t kExpWork = 4;

using rows::Rows;

// The leading dims of a [..., C] shape: the shape of its per-row quantities.
Shape leading_shape(const Shape& shape) { return leading_dims_with(shape, shape.rank() - 1); }

}  // namespace

template <class T>
double cross_entropy_forward(const CrossEntropyParams<T>& params, CrossEntropyCache<T>& cache,
                             std::optional<TensorView<T>> row_losses) {
  const TensorView<const T>& logits = params.logits;
  if (logits.rank() < 2 || logits.rank() > 4) {
    throw ShapeError(fmt::format("logits: expected rank 2 to 4 ([..., C]), got shape {}", logits.shape.str()));
  }
  const Shape rows_shape = leading_shape(logits.shape);
  check_shape("targets", params.targets.shape, rows_shape);
  if (row_losses) check_shape("row_losses", row_losses->shape, rows_shape);
  const int64_t classes = logits.shape.from_back(1);
  const Rows<const T> xs(logits);
  const int64_t rows = xs.count();

  Tensor<int64_t> targets = to_tensor<int64_t, int64_t>(params.targets);
  cache.targets = Tensor<int64_t>(Shape{rows}, std::move(targets.values()));
  cache.counted = 0;
  for (int64_t n = 0; n < rows; ++n) {
    int64_t& target = cache.targets[n];
    if (params.ignore_index && target == *params.ignore_index) {
      target = -1;
      continue;
    }
    if (target < 0 || target >= classes) {
      throw ValueError(fmt::format("targets: expected values in [0, {}){}, got {} at row {}", classes,
                                   params.ignore_index ? fmt::format(" or {}", *params.ignore_index) : "", target, n));
    }
    ++cache.counted;
  }

  if (!(cache.probs.shape() == Shape{rows, classes})) cache.probs = Tensor<T>(Shape{rows, classes});
  std::vector<double> losses(static_cast<size_t>(rows), 0.0);
  parallel_for_blocks(rows, classes * kExpWork, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      T* probs = cache.probs.data() + n * classes;
      const int64_t target = cache.targets[n];
      if (target < 0) {
        std::fill_n(probs, classes, T{0});
        continue;
      }
      const T* x = xs.row(n);
      double max = kNegInf;
      for (int64_t c = 0; c < classes; ++c) max = std::max(max, static_cast<double>(x[c * xs.step()]));
      // A row of −inf logits has no distribution: its probabilities are 0 and its loss is +inf.
      if (max == kNegInf) {
        std::fill_n(probs, classes, T{0});
        losses[static_cast<size_t>(n)] = std::numeric_limits<double>::infinity();
        continue;
      }
      double sum = 0.0;
      for (int64_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(x[c * xs.step()]) - max);
      for (int64_t c = 0; c < classes; ++c) {
        probs[c] = static_cast<T>(std::exp(static_cast<double>(x[c * xs.step()]) - max) / sum);
      }
      // lse − x_t = log Σ exp(x − max) − (x_t − max): both terms are small, so the difference keeps
      // its relative precision even for large logits.
      losses[static_cast<size_t>(n)] = std::log(sum) - (static_cast<double>(x[target * xs.step()]) - max);
    }
  });

  if (row_losses) {
    const TensorView<T> out4 = as_rank4(*row_losses);
    int64_t n = 0;
    for (int64_t a = 0; a < out4.shape[0]; ++a)
      for (int64_t b = 0; b < out4.shape[1]; ++b)
        for (int64_t c = 0; c < out4.shape[2]; ++c)
          for (int64_t d = 0; d < out4.shape[3]; ++d)
            out4(a, b, c, d) = static_cast<T>(losses[static_cast<size_t>(n++)]);
  }
  double total = 0.0;
  for (double loss : losses) total += loss;
  return cache.counted > 0 ? total / static_cast<double>(cache.counted) : 0.0;
}

// ∂loss_n/∂x_c = softmax_c − [c = t_n] (the derivative of lse is the softmax; that of x_t is the
// one-hot), and the mean divides by N'.
template <class T>
void cross_entropy_backward(const CrossEntropyCache<T>& cache, double dloss, TensorView<T> dlogits) {
  const int64_t rows = cache.targets.numel();
  const int64_t classes = cache.probs.shape()[1];
  if (dlogits.rank() < 2 || dlogits.rank() > 4 || leading_shape(dlogits.shape).numel() != rows ||
      dlogits.shape.from_back(1) != classes) {
    throw ShapeError(fmt::format("dlogits: expected the logits' shape ({} rows of {} classes), got {}", rows, classes,
                                 dlogits.shape.str()));
  }
  if (cache.counted == 0) return;
  const double scale = dloss / static_cast<double>(cache.counted);
  const Rows<T> dxs(dlogits);
  parallel_for_blocks(rows, classes * kExpWork, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t target = cache.targets[n];
      if (target < 0) continue;
      const T* probs = cache.probs.data() + n * classes;
      T* dx = dxs.row(n);
      for (int64_t c = 0; c < classes; ++c) {
        const double onehot = c == target ? 1.0 : 0.0;
        dx[c * dxs.step()] += static_cast<T>(scale * (static_cast<double>(probs[c]) - onehot));
      }
    }
  });
}

#define QKV_INSTANTIATE_CROSS_ENTROPY(T)                                                     \
  template double cross_entropy_forward(const CrossEntropyParams<T>&, CrossEntropyCache<T>&, \
                                        std::optional<TensorView<T>>);                       \
  template void cross_entropy_backward(const CrossEntropyCache<T>&, double, TensorView<T>);

QKV_INSTANTIATE_CROSS_ENTROPY(float)
QKV_INSTANTIATE_CROSS_ENTROPY(double)
#undef QKV_INSTANTIATE_CROSS_ENTROPY

}  // namespace qkv
