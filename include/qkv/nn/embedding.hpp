#pragma once
// A lookup table of learned vectors, as torch.nn.Embedding: forward, backward, initialisation.
//
// Shapes: ids [...] (rank 1 to 3, int64, each in [0, V)), weight [V, D], y [..., D].
//   y[..., :] = weight[ids[...], :]
// The backward scatters dy back into the rows of dweight that the forward read; an id that occurs
// several times collects the sum of its rows of dy, added in the order of the ids (row-major), so
// the result does not depend on the thread count.

#include <cstdint>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv {

struct EmbeddingConfig {
  int64_t num_embeddings = 0;  // V: ids run over [0, V)
  int64_t dim = 0;             // D: features per vector
};

// What the forward leaves for the backward: which rows it read.
template <class T>
struct EmbeddingCache {
  Tensor<int64_t> ids;  // [...]: the ids, as given
};

template <class T>
class Embedding {
 public:
  // Throws ValueError when num_embeddings < 1 or dim < 1. The weight is drawn from N(0, 1), row by
  // row, as torch.nn.Embedding initialises it; its gradient starts at zero.
  Embedding(const EmbeddingConfig& config, Rng& rng);

  const EmbeddingConfig& config() const { return config_; }

  // ids [...] → y [..., D]. Throws ShapeError for a rank outside 1 to 3 and ValueError naming the
  // first id outside [0, V) and its index.
  Tensor<T> forward(TensorView<const int64_t> ids, EmbeddingCache<T>& cache) const;

  // dy [..., D] = ∂L/∂y → dweight[ids[...], :] += dy[..., :].
  void backward(const EmbeddingCache<T>& cache, TensorView<const T> dy);

  void zero_grad();

  // {"weight"} [V, D].
  std::vector<ParameterRef<T>> parameters();
  std::vector<ParameterRef<const T>> parameters() const;

 private:
  EmbeddingConfig config_;
  Parameter<T> weight_;
};

}  // namespace qkv
