#pragma once
// Adam and AdamW over a list of parameters, as torch.optim.Adam / AdamW, with global gradient-norm
// clipping as torch.nn.utils.clip_grad_norm_.
//
// For every element p with gradient g, at step t = 1, 2, ...:
//   g ← g + λ p                                   (Adam's L2 weight decay, when λ > 0 and not decoupled)
//   p ← p − lr λ p                                (AdamW's decoupled decay, when λ > 0 and decoupled)
//   m ← β₁ m + (1 − β₁) g        v ← β₂ v + (1 − β₂) g²
//   p ← p − lr · m̂ / (√v̂ + eps),  m̂ = m / (1 − β₁ᵗ),  v̂ = v / (1 − β₂ᵗ)
// The moments are kept in float64 whatever T is. Every element is updated on its own, so a step
// does not depend on the thread count; the gradient norm is summed in a fixed order.

#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/core/parameter.hpp"

namespace qkv {

struct AdamConfig {
  double lr = 1e-3;                                    // learning rate, >= 0
  double beta1 = 0.9;                                  // decay of the first moment, in [0, 1)
  double beta2 = 0.999;                                // decay of the second moment, in [0, 1)
  double eps = 1e-8;                                   // added to √v̂, > 0
  double weight_decay = 0.0;                           // λ, >= 0
  bool decoupled_weight_decay = false;                 // AdamW when set: the decay bypasses the moments
  std::optional<double> max_grad_norm = std::nullopt;  // clip the global gradient norm to this before each step
};

// √(Σ over every parameter and element of g²), in float64, parameters in list order.
template <class T>
double grad_norm(const std::vector<ParameterRef<T>>& params);

// Scales every gradient by max_norm / (norm + 1e-6) when that is below 1, as clip_grad_norm_ does
// (the 1e-6 keeps a zero gradient finite), and returns the norm before clipping. Throws ValueError
// when max_norm is not > 0 or the norm is not finite (a NaN or inf gradient cannot be clipped).
template <class T>
double clip_grad_norm(const std::vector<ParameterRef<T>>& params, double max_norm);

template <class T>
class Adam {
 public:
  // Throws ValueError naming a config field out of range, and ShapeError naming a parameter whose
  // gradient's shape differs from its value's.
  Adam(std::vector<ParameterRef<T>> params, const AdamConfig& config);

  const AdamConfig& config() const { return config_; }
  // The steps taken so far: t of the last step.
  int64_t steps() const { return steps_; }
  // Changes the learning rate of later steps (for a schedule); throws ValueError when lr < 0.
  void set_lr(double lr);

  // One update of every parameter from its current gradient (clipped first when max_grad_norm is
  // set). Returns the global gradient norm before clipping. Gradients are left as they are (or as
  // clipped): call zero_grad before the next backward.
  double step();

  // Sets every parameter's gradient to 0.
  void zero_grad();

 private:
  struct Moments {
    std::vector<double> m, v;
  };

  std::vector<ParameterRef<T>> params_;
  std::vector<Moments> moments_;
  AdamConfig config_;
  int64_t steps_ = 0;
};

}  // namespace qkv
