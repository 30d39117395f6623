#pragma once
// Running an attention problem (support/attention_problems.hpp) through attention_forward and
// attention_backward in float32 or float64, and the checks every attention test shares: on every
// SIMD target, float32 within twice the naive error of the float64 reference, bit-identity.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>

#include "qkv/core/parallel.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/ops/attention.hpp"
#include "testing.hpp"

namespace qkv::testing {

struct Forward {
  Tensor<double> out, lse;
};

struct Grads {
  Tensor<double> dq, dk, dv, dbias, dsinks;
};

// With `with_lse` false the forward is asked for out alone (as in inference), which lets blocks of
// few queries take their own layout; lse is then left empty.
template <class T>
Forward run_forward(const AttentionProblem& p, AttentionImpl impl, bool with_lse = true) {
  const AttentionOperands<T> ops(p);
  const Shape& s = p.q.shape();
  Tensor<T> out({s[0], s[1], s[2], p.v.shape()[3]}), lse({s[0], s[1], s[2]});
  AttentionOutputs<T> outputs{.out = out.view(), .weights = {}, .lse = {}};
  if (with_lse) outputs.lse = lse.view();
  attention_forward(ops.params(), outputs, impl);
  return {cast<double>(out), with_lse ? cast<double>(lse) : Tensor<double>()};
}

// Gradients of L = <dout, out> through `params`, the call's params on p's operands (AttentionParams<T>,
// or StoredAttentionParams for T = float); `with_saved` hands the backward the forward's out and lse.
template <class T, class Params>
Grads backward_through(const AttentionProblem& p, const Params& params, const Tensor<double>& dout, AttentionImpl impl,
                       bool with_saved) {
  const Tensor<T> dout_t = cast<T>(dout);
  Tensor<T> dq(p.q.shape()), dk(p.k.shape()), dv(p.v.shape());
  Tensor<T> dbias = p.bias ? Tensor<T>(p.bias->shape()) : Tensor<T>();
  Tensor<T> dsinks = p.sinks ? Tensor<T>(p.sinks->shape()) : Tensor<T>();
  AttentionGradients<T> grads{.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = {}};
  if (p.bias) grads.dbias = dbias.view();
  if (p.sinks) grads.dsinks = dsinks.view();
  std::optional<AttentionSaved<T>> saved;
  const Shape& s = p.q.shape();
  Tensor<T> out({s[0], s[1], s[2], p.v.shape()[3]}), lse({s[0], s[1], s[2]});
  if (with_saved) {
    attention_forward(params, AttentionOutputs<T>{.out = out.view(), .weights = {}, .lse = lse.view()}, impl);
    saved = AttentionSaved<T>{.out = out.cview(), .lse = lse.cview()};
  }
  attention_backward(params, dout_t.view(), grads, saved, impl);
  return {cast<double>(dq), cast<double>(dk), cast<double>(dv), cast<double>(dbias), cast<double>(dsinks)};
}

// Gradients of L = <dout, out>; `with_saved` hands the backward the forward's out and lse.
template <class T>
Grads run_backward(const AttentionProblem& p, const Tensor<double>& dout, AttentionImpl impl, bool with_saved = true) {
  const AttentionOperands<T> ops(p);
  return backward_through<T>(p, ops.params(), dout, impl, with_saved);
}

inline Forward reference_forward(const AttentionProblem& p) { return run_forward<double>(p, AttentionImpl::reference); }

inline Grads reference_backward(const AttentionProblem& p, const Tensor<double>& dout) {
  return run_backward<double>(p, dout, AttentionImpl::reference, false);
}

// Runs `body` once on every SIMD target this CPU runs, the target named in any failure.
inline void on_every_target(const std::function<void()>& body) {
  for (const std::string& target : simd_targets()) {
    SCOPED_TRACE("target " + target);
    const SimdTargetScope scope(target);
    body();
  }
}

// Multiplies q and k of unit variance by 40, with scale 1: |q·k| ≈ 1600·√d (10⁴ at d = 64), where
// an ulp of a score is 10⁻³, and a backward whose scores are not, bit for bit, those its lse came
// from is off by as much in every P.
inline void make_logits_huge(AttentionProblem& p) {
  for (int64_t i = 0; i < p.q.numel(); ++i) p.q[i] *= 40.0;
  for (int64_t i = 0; i < p.k.numel(); ++i) p.k[i] *= 40.0;
  p.scale = 1.0;
}

// How an attention under test is run: its forward, with or without lse, and its backward, from the
// forward's saved out and lse or recomputing the forward itself. No forward_out_only: the forward
// without lse is held to its own rule elsewhere.
struct FusedRuns {
  std::function<Forward(bool with_lse)> forward;
  std::function<Grads(const Tensor<double>& dout, bool saved)> backward;
  bool forward_out_only = true;
};

// A fused forward and backward against the float64 reference, each tensor within the suite's
// tolerance rule (attention_tolerance), on every SIMD target this CPU runs. The forward runs with
// and without lse (the two take different layouts for few queries). The backward runs twice:
// recomputing the forward itself (it then keeps lse in two parts and the rule applies as is), and
// from a saved float32 lse, whose rounding (a relative error of up to ρ on each row's P) a softmax
// computed from scratch does not have: the rule then adds its bound.
inline void expect_matches_reference(const AttentionProblem& p, uint64_t seed, const std::string& label,
                                     const FusedRuns& runs) {
  SCOPED_TRACE(label);
  const Tensor<double> dout = random_dout(p, seed);
  const AttentionYardsticks y = attention_yardsticks(p, dout);
  const Forward want = reference_forward(p);
  const Grads gw = reference_backward(p, dout);
  const double rho = lse_rounding(want.lse);
  using R = NaiveResult;
  on_every_target([&] {
    const Forward got = runs.forward(true);
    EXPECT_TRUE(all_close("out", got.out, want.out, attention_tolerance(y, R::out, want.out)));
    EXPECT_TRUE(all_close("lse", got.lse, want.lse, attention_tolerance(y, R::lse, want.lse)));
    if (runs.forward_out_only) {
      const Forward out_only = runs.forward(false);
      EXPECT_TRUE(all_close("out without lse", out_only.out, want.out, attention_tolerance(y, R::out, want.out)));
    }
    for (const bool saved : {false, true}) {
      SCOPED_TRACE(saved ? "with the saved lse" : "recomputing the forward");
      const Grads gg = runs.backward(dout, saved);
      const double r = saved ? rho : 0.0;
      EXPECT_TRUE(all_close("dq", gg.dq, gw.dq, attention_tolerance(y, R::dq, gw.dq, r)));
      EXPECT_TRUE(all_close("dk", gg.dk, gw.dk, attention_tolerance(y, R::dk, gw.dk, r)));
      EXPECT_TRUE(all_close("dv", gg.dv, gw.dv, attention_tolerance(y, R::dv, gw.dv, r)));
      if (p.bias) {
        EXPECT_TRUE(all_close("dbias", gg.dbias, gw.dbias, attention_tolerance(y, R::dbias, gw.dbias, r)));
      }
      if (p.sinks) {
        EXPECT_TRUE(all_close("dsinks", gg.dsinks, gw.dsinks, attention_tolerance(y, R::dsinks, gw.dsinks, r)));
      }
    }
  });
}

// The fused float32 kernel against the float64 reference (expect_matches_reference).
inline void expect_float32_matches_reference(const AttentionProblem& p, uint64_t seed, const std::string& label) {
  expect_matches_reference(
      p, seed, label,
      {.forward = [&](bool with_lse) { return run_forward<float>(p, AttentionImpl::fused, with_lse); },
       .backward = [&](const Tensor<double>& dout,
                       bool saved) { return run_backward<float>(p, dout, AttentionImpl::fused, saved); }});
}

// Runs the body with parallel_for limited to `workers` threads, restoring the previous limit.
class WorkersScope {
 public:
  explicit WorkersScope(int workers) : saved_(max_workers()) { set_max_workers(workers); }
  ~WorkersScope() { set_max_workers(saved_); }
  WorkersScope(const WorkersScope&) = delete;
  WorkersScope& operator=(const WorkersScope&) = delete;

 private:
  int saved_;
};

inline bool bit_identical(const Tensor<double>& a, const Tensor<double>& b) {
  // An empty tensor's data may be null, which memcmp must not be given even for 0 bytes.
  return a.shape() == b.shape() &&
         (a.numel() == 0 || std::memcmp(a.data(), b.data(), static_cast<size_t>(a.numel()) * sizeof(double)) == 0);
}

inline bool all_finite(const Tensor<double>& t) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (std::isnan(t[i])) return false;
  }
  return true;
}

}  // namespace qkv::testing
