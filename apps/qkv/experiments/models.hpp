#pragma once
// The small models the experiments train, built from qkv's layers with explicit forward and
// backward passes (as llm.c does; no autograd). Every task here is "read a sequence, answer one
// class at its end":
//
//   ids [B, T, 2] --PairEmbedding--> x [B, T, D] --reader--> logits [B, C] --cross-entropy--> loss
//
// Each position carries two ids whose embeddings are summed (a token and a flag, or a key and its
// value), so one table serves every task. Two readers answer at the last position:
//   AttentionReader  one attention layer: the last position's query against every position's key,
//                    with the score scale a free parameter (1/√D, or 1 for the unscaled variant)
//   GruReader        a GRU over the sequence; its final state answers
// Both end in a residual/LayerNorm/linear head, so that they differ only in how information
// travels along the sequence. Training runs in float32; float64 models (drawn from the same seed
// as their float32 twins) measure gradients too small for float32. All draws come from the Rng given.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/nn/adam.hpp"
#include "qkv/nn/embedding.hpp"
#include "qkv/nn/gru.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/cross_entropy.hpp"
#include "qkv/ops/layer_norm.hpp"

namespace qkv::cli {

// x[b, t] = E[ids[b, t, 0]] + E[ids[b, t, 1]]: ids [B, T, 2] → x [B, T, D].
template <class Scalar>
class PairEmbedding {
 public:
  PairEmbedding(int64_t vocabulary, int64_t dim, Rng& rng);
  Tensor<Scalar> forward(TensorView<const int64_t> ids);
  // dx [B, T, D] = ∂L/∂x → the table's gradient += its share.
  void backward(TensorView<const Scalar> dx);
  std::vector<ParameterRef<Scalar>> parameters() { return table_.parameters(); }

 private:
  Embedding<Scalar> table_;
  EmbeddingCache<Scalar> cache_;
};

// A model that reads x [B, T, D] and answers logits [B, C] at the last position. forward keeps
// what backward needs; backward adds ∂L/∂x into dx and ∂L/∂W into every parameter gradient.
template <class Scalar>
class SequenceReader {
 public:
  virtual ~SequenceReader() = default;
  virtual Tensor<Scalar> forward(TensorView<const Scalar> x) = 0;
  virtual void backward(TensorView<const Scalar> dlogits, TensorView<Scalar> dx) = 0;
  virtual std::vector<ParameterRef<Scalar>> parameters() = 0;
};

struct AttentionReaderConfig {
  int64_t dim = 0;      // D: features per position, and the width of q, k, v (one head)
  int64_t classes = 0;  // C
  double scale = 0.0;   // multiplies q·k: 1/√D is the textbook choice, 1 the unscaled one
};

// One attention layer read at the last position (causal by construction: the last token sees all):
//   q = W_Q x_{T−1} + b_Q,  k_t = W_K x_t + b_K,  v_t = W_V x_t + b_V        [B, D] / [B, T, D]
//   a = Σ_t softmax_t(scale · q·k_t) v_t,   h = LayerNorm(x_{T−1} + W_O a + b_O)
//   logits = W_C h + b_C
// Only the last query is computed: the other positions' outputs could not reach the loss.
template <class Scalar>
class AttentionReader : public SequenceReader<Scalar> {
 public:
  AttentionReader(const AttentionReaderConfig& config, Rng& rng);
  Tensor<Scalar> forward(TensorView<const Scalar> x) override;
  void backward(TensorView<const Scalar> dlogits, TensorView<Scalar> dx) override;
  std::vector<ParameterRef<Scalar>> parameters() override;

 private:
  AttentionReaderConfig config_;
  // Declared in the order they draw from the Rng.
  Linear<Scalar> query_, key_, value_, output_;
  LayerNorm<Scalar> norm_;
  Linear<Scalar> classifier_;
  // The forward's intermediates, kept for the backward.
  Tensor<Scalar> x_;       // [B, T, D]
  Tensor<Scalar> q_;       // [B, 1, D]
  Tensor<Scalar> k_, v_;   // [B, T, D]
  Tensor<Scalar> a_;       // [B, 1, D]: the attention output
  Tensor<Scalar> lse_;     // [B, 1]
  Tensor<Scalar> h_;       // [B, D]: x_{T−1} + W_O a + b_O, before the norm
  Tensor<Scalar> normed_;  // [B, D]
  LayerNormCache<Scalar> norm_cache_;
};

struct GruReaderConfig {
  int64_t dim = 0;      // D: features per position (the GRU's input)
  int64_t hidden = 0;   // H: the GRU's state
  int64_t classes = 0;  // C
};

//   h_T = GRU(x_0 .. x_{T−1}),  logits = W_C LayerNorm(h_T) + b_C
template <class Scalar>
class GruReader : public SequenceReader<Scalar> {
 public:
  GruReader(const GruReaderConfig& config, Rng& rng);
  Tensor<Scalar> forward(TensorView<const Scalar> x) override;
  void backward(TensorView<const Scalar> dlogits, TensorView<Scalar> dx) override;
  std::vector<ParameterRef<Scalar>> parameters() override;

 private:
  GruReaderConfig config_;
  Gru<Scalar> gru_;
  LayerNorm<Scalar> norm_;
  Linear<Scalar> classifier_;
  GruCache<Scalar> gru_cache_;
  LayerNormCache<Scalar> norm_cache_;
  Tensor<Scalar> h_n_;     // [B, H]
  Tensor<Scalar> normed_;  // [B, H]
};

// A batch of a task: ids [B, T, 2] and the class to answer [B].
struct Batch {
  Tensor<int64_t> ids;
  Tensor<int64_t> targets;
};

// PairEmbedding, a reader and Adam, trained on cross-entropy.
template <class Scalar>
class Classifier {
 public:
  Classifier(PairEmbedding<Scalar> embedding, std::unique_ptr<SequenceReader<Scalar>> reader, const AdamConfig& adam);
  Classifier(const Classifier&) = delete;
  Classifier& operator=(const Classifier&) = delete;

  // One step of Adam on the batch's mean cross-entropy; returns that loss (before the step).
  double train_step(const Batch& batch);
  struct Evaluation {
    double accuracy = 0.0;  // the fraction of the batch whose argmax logit is the target
    double loss = 0.0;      // the mean cross-entropy
  };
  Evaluation evaluate(const Batch& batch);
  // ∂loss/∂x [B, T, D] for the batch's mean loss, x being the embedded input; no parameter changes.
  Tensor<Scalar> input_gradient(const Batch& batch);

  int64_t parameter_count();
  int64_t reader_parameter_count();

 private:
  // The batch's mean loss; every gradient (parameters and the returned ∂loss/∂x) is filled.
  double forward_backward(const Batch& batch, Tensor<Scalar>& dx);

  PairEmbedding<Scalar> embedding_;
  std::unique_ptr<SequenceReader<Scalar>> reader_;
  Adam<Scalar> adam_;
};

// Σ of the element counts of `params`.
template <class Scalar>
int64_t count_parameters(const std::vector<ParameterRef<Scalar>>& params);

}  // namespace qkv::cli
