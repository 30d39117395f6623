#pragma once
// An encoder-decoder with attention, as in Bahdanau, Cho and Bengio (2015), "Neural machine
// translation by jointly learning to align and translate", built from qkv's layers with explicit
// forward and backward passes. Shapes: B sentences, Ts source and Tt target positions, E embedding
// width, He encoder state per direction, Hd decoder state, A additive attention width, Vs and Vt
// vocabulary sizes.
//
//   encoder   x_j = E_s[src_j]                                                      [B, Ts, E]
//             h_j = [→h_j; ←h_j] = BiGRU(x)_j   (the annotations)                   [B, Ts, 2He]
//             m   = [→h_{len−1}; ←h_0]          (both directions' final states)     [B, 2He]
//   decoder   s_0 = tanh(W_init m + b_init)                                         [B, Hd]
//   step i    c_i = Σ_j α_ij h_j,  α_i = softmax_j(e_ij) over j < len   (the query is s_{i−1})
//             s_i = GRU([E_t[y_{i−1}]; c_i], s_{i−1})
//             logits_i = W_out [s_i; c_i; E_t[y_{i−1}]] + b_out                     [B, Vt]
//
// Scores e_ij of the decoder state against each annotation:
//   additive    e_ij = wᵀ tanh(W_q s_{i−1} + W_k h_j)        (Bahdanau's; W_k h_j computed once per
//               sentence, as the paper notes it can be: additive_attention_forward would redo it at
//               every step, so the step has its own loop, tested against that reference)
//   scaled_dot  e_ij = (W_q s_{i−1} + b_q) · h_j / √(2He)     (attention_forward_reference, Tq = 1)
//   none        no attention: c_i = m at every step, the encoder-decoder of Cho et al. (2014) whose
//               whole source must pass through one fixed-size vector
// Training uses teacher forcing (y_{i−1} is the reference token); greedy_decode feeds back the
// argmax. Token ids 0, 1 and 2 are <pad>, <bos> and <eos> in both vocabularies.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/io/model_file.hpp"
#include "qkv/nn/adam.hpp"
#include "qkv/nn/embedding.hpp"
#include "qkv/nn/gru.hpp"
#include "qkv/nn/linear.hpp"

namespace qkv::cli {

// A [B, D] view seen as [B, 1, 1, D]: one query (or one output row) per batch entry and one head,
// as attention_forward reads it.
template <class T>
TensorView<T> as_b11d(TensorView<T> view) {
  return {view.data,
          Shape{view.shape[0], 1, 1, view.shape[1]},
          {view.strides[0], view.strides[1], view.strides[1], view.strides[1]}};
}

// A [B, T, D] view seen as [B, 1, T, D]: the keys of one head.
template <class T>
TensorView<T> as_b1td(TensorView<T> view) {
  return {view.data,
          Shape{view.shape[0], 1, view.shape[1], view.shape[2]},
          {view.strides[0], view.strides[0], view.strides[1], view.strides[2]}};
}

inline constexpr int64_t kPadId = 0;
inline constexpr int64_t kBosId = 1;
inline constexpr int64_t kEosId = 2;
inline constexpr int64_t kSpecialTokens = 3;
// A decoder target that the loss skips (past a sentence's <eos>).
inline constexpr int64_t kIgnoreTarget = -1;

// Words and their ids: the three special tokens first, then the words in the order given.
class Vocabulary {
 public:
  Vocabulary() = default;
  // Throws ValueError for an empty, duplicate or whitespace-holding word, or one spelled like a special.
  explicit Vocabulary(std::vector<std::string> words);

  int64_t size() const { return static_cast<int64_t>(words_.size()); }
  const std::string& word(int64_t id) const { return words_[static_cast<size_t>(id)]; }
  std::optional<int64_t> find(std::string_view word) const;
  // The ids of `words`; ValueError "WHAT: unknown word "x" (known: a, b, ...)" for the first unknown one.
  std::vector<int64_t> encode(const std::vector<std::string>& words, std::string_view what) const;
  // The words of `ids` (specials spelled <pad>, <bos>, <eos>).
  std::vector<std::string> decode(const std::vector<int64_t>& ids) const;
  // The words after the specials, space-separated: how a model file stores them.
  std::string joined() const;

 private:
  std::vector<std::string> words_;  // specials first
  std::unordered_map<std::string, int64_t> ids_;
};

enum class Score { none, additive, scaled_dot };

// "none", "additive", "dot"
std::string_view score_name(Score score);
std::optional<Score> score_from_name(std::string_view name);

struct Seq2SeqConfig {
  int64_t source_vocabulary = 0;  // Vs, specials included
  int64_t target_vocabulary = 0;  // Vt, specials included
  int64_t embedding = 32;         // E, both embeddings
  int64_t encoder_hidden = 32;    // He per direction: the annotations have 2He features
  int64_t decoder_hidden = 64;    // Hd
  int64_t attention_hidden = 32;  // A, read only by additive scoring
  Score score = Score::additive;
};

// Sentences padded into tensors.
struct Seq2SeqBatch {
  Tensor<int64_t> source;          // [B, Ts]: ids, <pad> past each length
  Tensor<int64_t> source_lengths;  // [B]: each in [1, Ts]
  Tensor<int64_t> decoder_input;   // [B, Tt]: <bos> y_1 .. y_n, then <pad>
  Tensor<int64_t> decoder_target;  // [B, Tt]: y_1 .. y_n <eos>, then kIgnoreTarget; Tt = max n + 1
};

// sources[b] and targets[b] are id sequences without specials. Throws ValueError for an empty
// source, a count mismatch or no sentences.
Seq2SeqBatch make_seq2seq_batch(const std::vector<std::vector<int64_t>>& sources,
                                const std::vector<std::vector<int64_t>>& targets);

// What the decoder reads from the encoder, for every step.
template <class Scalar>
struct EncoderMemory {
  Tensor<Scalar> annotations;    // [B, Ts, 2He]: h_j, 0 past each length
  Tensor<Scalar> keys;           // [B, Ts, A]: W_k h_j (additive only; empty otherwise)
  Tensor<Scalar> summary;        // [B, 2He]: m
  Tensor<uint8_t> allowed;       // [B, 1, 1, Ts]: 1 for j < len_b (the mask of attention_forward)
  std::vector<int64_t> lengths;  // [B]
};

// Gradients with respect to the memory, accumulated over the decoder steps (+=).
template <class Scalar>
struct EncoderMemoryGradients {
  Tensor<Scalar> annotations;  // [B, Ts, 2He]
  Tensor<Scalar> keys;         // [B, Ts, A] (additive only)
  Tensor<Scalar> summary;      // [B, 2He]
};

// What one attention step keeps for its backward.
template <class Scalar>
struct AttentionStepCache {
  Tensor<Scalar> query_state;  // [B, Hd]: s_{i−1}
  Tensor<Scalar> query;        // [B, 1, 1, 2He]: W_q s + b_q (scaled_dot); [B, A]: W_q s (additive)
  Tensor<Scalar> hidden;       // [B, Ts, A]: tanh(W_q s + W_k h_j) (additive), 0 past each length
  Tensor<Scalar> alpha;        // [B, Ts]: α, 0 past each length (and everywhere for none)
};

// The scoring and weighting of one decoder step: s [B, Hd] → c [B, 2He] and α [B, Ts].
template <class Scalar>
class DecoderAttention {
 public:
  DecoderAttention(Score score, int64_t query_size, int64_t key_size, int64_t hidden, Rng& rng);

  Score score() const { return score_; }
  // Fills memory.keys from memory.annotations (additive; nothing otherwise).
  void prepare(EncoderMemory<Scalar>& memory) const;
  // dmemory.keys → dmemory.annotations and dW_k (+=).
  void prepare_backward(const EncoderMemory<Scalar>& memory, EncoderMemoryGradients<Scalar>& dmemory);

  // s [B, Hd] → context [B, 2He] (overwritten); α is left in cache.alpha.
  void forward(const EncoderMemory<Scalar>& memory, TensorView<const Scalar> s, AttentionStepCache<Scalar>& cache,
               TensorView<Scalar> context) const;
  // dcontext [B, 2He] → ds [B, Hd] +=, dmemory +=, parameter gradients +=.
  void backward(const EncoderMemory<Scalar>& memory, const AttentionStepCache<Scalar>& cache,
                TensorView<const Scalar> dcontext, TensorView<Scalar> ds, EncoderMemoryGradients<Scalar>& dmemory);

  void zero_grad();
  // additive: {"w_q", "w_k", "w"}; scaled_dot: {"w_q", "b_q"}; none: {}.
  std::vector<ParameterRef<Scalar>> parameters();
  std::vector<ParameterRef<const Scalar>> parameters() const;

 private:
  Score score_;
  int64_t query_size_, key_size_, hidden_;
  // W_q (with b_q for scaled_dot), W_k and w; each empty where the score has no use for it.
  Linear<Scalar> query_, key_;
  Parameter<Scalar> w_;
};

// What one decoder step keeps for its backward.
template <class Scalar>
struct DecoderStepCache {
  AttentionStepCache<Scalar> attention;
  GruCache<Scalar> gru;
  Tensor<Scalar> readout;  // [B, Hd + 2He + E]: [s_i; c_i; x_i]
};

template <class Scalar>
struct DecoderStepOutputs {
  Tensor<Scalar> state;   // [B, Hd]: s_i
  Tensor<Scalar> logits;  // [B, Vt]
};

// What the encoder keeps for its backward.
template <class Scalar>
struct EncoderCache {
  EmbeddingCache<Scalar> embedding;
  BidirectionalGruCache<Scalar> gru;
};

// A translation of one sentence by greedy decoding.
template <class Scalar>
struct GreedyTranslation {
  std::vector<int64_t> tokens;  // the words emitted before <eos> (or before the step limit)
  bool finished = false;        // whether <eos> was emitted within the step limit
  Tensor<Scalar> alpha;         // [steps, len]: α of every step, the <eos> step included
};

template <class Scalar>
class Seq2Seq {
 public:
  // Throws ValueError naming a config field that is out of range.
  Seq2Seq(const Seq2SeqConfig& config, Rng& rng);

  const Seq2SeqConfig& config() const { return config_; }

  // source [B, Ts] with lengths [B] → the memory every decoder step reads.
  EncoderMemory<Scalar> encode(TensorView<const int64_t> source, TensorView<const int64_t> lengths,
                               EncoderCache<Scalar>& cache) const;
  // s_0 [B, Hd] from memory.summary.
  Tensor<Scalar> initial_state(const EncoderMemory<Scalar>& memory) const;
  // The decoder's attention: prepare() turns hand-made annotations into a memory (tests do).
  DecoderAttention<Scalar>& attention() { return attention_; }
  const DecoderAttention<Scalar>& attention() const { return attention_; }

  // One decoder step: x = E_t[y_{i−1}] [B, E] and s_{i−1} [B, Hd] → s_i and logits_i.
  DecoderStepOutputs<Scalar> step_forward(const EncoderMemory<Scalar>& memory, TensorView<const Scalar> x,
                                          TensorView<const Scalar> s, DecoderStepCache<Scalar>& cache) const;
  // dlogits [B, Vt] and ds_next [B, Hd] (∂L/∂s_i from later steps) → dx [B, E] +=, ds [B, Hd] +=
  // (∂L/∂s_{i−1}), dmemory +=, parameter gradients +=.
  void step_backward(const EncoderMemory<Scalar>& memory, const DecoderStepCache<Scalar>& cache,
                     TensorView<const Scalar> dlogits, TensorView<const Scalar> ds_next, TensorView<Scalar> dx,
                     TensorView<Scalar> ds, EncoderMemoryGradients<Scalar>& dmemory);

  // Teacher forcing over the batch: logits [B, Tt, Vt]; keeps what backward needs.
  Tensor<Scalar> forward(const Seq2SeqBatch& batch);
  // α of every step of the last forward: [B, Tt, Ts] (0 past each source length; all 0 for none).
  const Tensor<Scalar>& attention_weights() const { return alpha_; }
  // dlogits [B, Tt, Vt] → every parameter gradient += its share.
  void backward(TensorView<const Scalar> dlogits);

  // Greedy decoding of each source sentence (ids without specials), for at most max_steps steps.
  std::vector<GreedyTranslation<Scalar>> greedy_decode(const std::vector<std::vector<int64_t>>& sources,
                                                       int64_t max_steps) const;

  void zero_grad();
  // Every parameter, named "source_embedding.weight", "encoder.weight_ih_l0", ..., "init.weight",
  // "init.bias", "attention.w_q", ..., "decoder.weight_ih_l0", ..., "readout.weight", "readout.bias".
  std::vector<ParameterRef<Scalar>> parameters();
  std::vector<ParameterRef<const Scalar>> parameters() const;

 private:
  Seq2SeqConfig config_;
  Embedding<Scalar> source_embedding_, target_embedding_;
  BidirectionalGru<Scalar> encoder_;
  DecoderAttention<Scalar> attention_;
  Gru<Scalar> decoder_;
  // W_init, b_init and W_out, b_out: declared after the decoder, as they draw after it.
  Linear<Scalar> init_, readout_;

  // The last forward, for backward.
  EncoderCache<Scalar> encoder_cache_;
  EncoderMemory<Scalar> memory_;
  Tensor<Scalar> s0_;                    // [B, Hd]
  EmbeddingCache<Scalar> target_cache_;  // of the decoder inputs
  Tensor<Scalar> target_x_;              // [B, Tt, E]
  std::vector<DecoderStepCache<Scalar>> steps_;
  Tensor<Scalar> alpha_;  // [B, Tt, Ts]
};

// The mean cross-entropy of the batch under teacher forcing; every parameter gradient is set to
// its gradient (zeroed first).
template <class Scalar>
double seq2seq_loss_and_gradients(Seq2Seq<Scalar>& model, const Seq2SeqBatch& batch);

// A trained model with the vocabularies it reads and writes: what a model file holds.
struct TranslationModel {
  Vocabulary source;
  Vocabulary target;
  Seq2Seq<float> model;
};

inline constexpr std::string_view kSeq2SeqKind = "seq2seq";

// The model file of `model` (kind "seq2seq"): its config and vocabularies as entries, its
// parameters as tensors, and `description` as the entry "description".
ModelFile to_model_file(const Seq2Seq<float>& model, const Vocabulary& source, const Vocabulary& target,
                        std::string description);
// The model a file holds; IoError (naming the file) for another kind, a missing or bad entry, or
// parameters that do not fit the config.
TranslationModel translation_model_from_file(const ModelFile& file);

}  // namespace qkv::cli
