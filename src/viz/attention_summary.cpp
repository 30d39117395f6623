#include "qkv/viz/attention_summary.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>

#include "qkv/core/error.hpp"

namespace qkv {
namespace {

void check_rank4(TensorView<const float> attention) {
  if (attention.rank() != 4) {
    throw ShapeError(fmt::format("attention: expected [L, H, Tq, Tk], got {}", attention.shape.str()));
  }
}

}  // namespace

Tensor<double> attention_head_mean(TensorView<const float> attention) {
  check_rank4(attention);
  const int64_t layers = attention.shape[0], heads = attention.shape[1];
  const int64_t tq = attention.shape[2], tk = attention.shape[3];
  Tensor<double> mean({layers, tq, tk});
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < tq; ++i) {
        for (int64_t j = 0; j < tk; ++j) mean[(l * tq + i) * tk + j] += attention(l, h, i, j);
      }
    }
  }
  for (double& v : mean.values()) v /= static_cast<double>(heads);
  return mean;
}

Tensor<double> attention_rollout(TensorView<const float> attention, std::string_view name) {
  check_rank4(attention);
  const int64_t layers = attention.shape[0], t = attention.shape[2];
  if (attention.shape[3] != t) {
    throw ShapeError(fmt::format("{}: rollout needs self-attention (Tq = Tk), got Tq = {} and Tk = {}", name, t,
                                 attention.shape[3]));
  }
  const Tensor<double> mean = attention_head_mean(attention);
  Tensor<double> rollout({layers, t, t});
  std::vector<double> residual(static_cast<size_t>(t * t));
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t i = 0; i < t; ++i) {
      double sum = 0.0;
      for (int64_t j = 0; j < t; ++j) {
        double& a = residual[static_cast<size_t>(i * t + j)];
        a = 0.5 * mean[(l * t + i) * t + j] + (i == j ? 0.5 : 0.0);
        sum += a;
      }
      for (int64_t j = 0; j < t; ++j) residual[static_cast<size_t>(i * t + j)] /= sum;
    }
    double* out = rollout.data() + l * t * t;
    if (l == 0) {
      std::copy(residual.begin(), residual.end(), out);
      continue;
    }
    const double* below = out - t * t;
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t k = 0; k < t; ++k) {
        const double a = residual[static_cast<size_t>(i * t + k)];
        if (a == 0.0) continue;
        for (int64_t j = 0; j < t; ++j) out[i * t + j] += a * below[k * t + j];
      }
    }
  }
  return rollout;
}

Tensor<double> attention_entropy(TensorView<const float> attention) {
  check_rank4(attention);
  const int64_t layers = attention.shape[0], heads = attention.shape[1];
  const int64_t tq = attention.shape[2], tk = attention.shape[3];
  Tensor<double> entropy({layers, heads});
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t h = 0; h < heads; ++h) {
      double total = 0.0;
      for (int64_t i = 0; i < tq; ++i) {
        for (int64_t j = 0; j < tk; ++j) {
          const double a = attention(l, h, i, j);
          if (a > 0.0) total -= a * std::log(a);
        }
      }
      entropy[l * heads + h] = total / static_cast<double>(tq);
    }
  }
  return entropy;
}

Tensor<double> attention_distance(TensorView<const float> attention) {
  check_rank4(attention);
  const int64_t layers = attention.shape[0], heads = attention.shape[1];
  const int64_t tq = attention.shape[2], tk = attention.shape[3];
  Tensor<double> distance({layers, heads});
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t h = 0; h < heads; ++h) {
      double total = 0.0;
      for (int64_t i = 0; i < tq; ++i) {
        for (int64_t j = 0; j < tk; ++j) total += attention(l, h, i, j) * static_cast<double>(std::llabs(i - j));
      }
      distance[l * heads + h] = total / static_cast<double>(tq);
    }
  }
  return distance;
}

}  // namespace qkv
