#include "qkv/nn/embedding.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"

namespace qkv {
namespace {

// ids' shape followed by D.
Shape output_shape(const Shape& ids, int64_t dim) {
  std::vector<int64_t> dims(ids.dims().begin(), ids.dims().end());
  dims.push_back(dim);
  return Shape(std::span<const int64_t>(dims));
}

}  // namespace

template <class T>
Embedding<T>::Embedding(const EmbeddingConfig& config, Rng& rng) : config_(config) {
  if (config.num_embeddings < 1) {
    throw ValueError(fmt::format("num_embeddings: expected at least 1, got {}", config.num_embeddings));
  }
  if (config.dim < 1) throw ValueError(fmt::format("dim: expected at least 1, got {}", config.dim));
  weight_ = Parameter<T>(Shape{config.num_embeddings, config.dim});
  rng.fill_normal(weight_.value.view());
}

template <class T>
Tensor<T> Embedding<T>::forward(TensorView<const int64_t> ids, EmbeddingCache<T>& cache) const {
  if (ids.rank() < 1 || ids.rank() > 3) {
    throw ShapeError(fmt::format("ids: expected rank 1 to 3, got shape {}", ids.shape.str()));
  }
  cache.ids = to_tensor<int64_t, int64_t>(ids);
  const int64_t vocab = config_.num_embeddings;
  const int64_t dim = config_.dim;
  for (int64_t n = 0; n < cache.ids.numel(); ++n) {
    const int64_t id = cache.ids[n];
    if (id < 0 || id >= vocab) {
      throw ValueError(
          fmt::format("ids: expected values in [0, {}), got {} at {}", vocab, id, index_str(cache.ids.shape(), n)));
    }
  }
  Tensor<T> y(output_shape(ids.shape, dim));
  const T* table = weight_.value.data();
  for (int64_t n = 0; n < cache.ids.numel(); ++n) {
    std::copy_n(table + cache.ids[n] * dim, dim, y.data() + n * dim);
  }
  return y;
}

// y_n = W[id_n] reads one row, so ∂L/∂W[v] = Σ_{n: id_n = v} dy_n. The scatter runs in the order
// of n on one thread: rows that share an id are summed in a fixed order, and the work (N·D adds)
// is too small to be worth a parallel region.
template <class T>
void Embedding<T>::backward(const EmbeddingCache<T>& cache, TensorView<const T> dy) {
  check_shape("dy", dy.shape, output_shape(cache.ids.shape(), config_.dim));
  const int64_t dim = config_.dim;
  const TensorView<const T> dy4 = as_rank4(dy);
  const int64_t rows_per_a = dy4.shape[1] * dy4.shape[2];
  T* table = weight_.grad.data();
  for (int64_t n = 0; n < cache.ids.numel(); ++n) {
    const int64_t a = n / rows_per_a;
    const int64_t b = (n / dy4.shape[2]) % dy4.shape[1];
    const int64_t c = n % dy4.shape[2];
    T* row = table + cache.ids[n] * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] += dy4(a, b, c, d);
  }
}

template <class T>
void Embedding<T>::zero_grad() {
  weight_.zero_grad();
}

template <class T>
std::vector<ParameterRef<T>> Embedding<T>::parameters() {
  return {weight_.ref("weight")};
}

template <class T>
std::vector<ParameterRef<const T>> Embedding<T>::parameters() const {
  return {weight_.ref("weight")};
}

template struct EmbeddingCache<float>;
template struct EmbeddingCache<double>;
template class Embedding<float>;
template class Embedding<double>;

}  // namespace qkv
