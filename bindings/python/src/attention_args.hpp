#pragma once
// The keyword arguments of qkv.attention and its backward, read into the op's AttentionParams.
// qkv._qkv (attention.cpp) and qkv._dist (dist/module.cpp, ring attention) take the same ones, by
// the same names, with the same errors.

#include <pybind11/pybind11.h>

#include <optional>
#include <string>

#include "arrays.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv::python {

// causal=: False, True (= "bottom-right") or "bottom-right" / "top-left".
struct Causality {
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::bottom_right;
};

Causality causality_of(const py::object& causal);

// seed=: an int in [0, 2**64) (a bool is a mistake, not 0 or 1).
uint64_t seed_of(const py::object& seed);

// The keyword arguments of a forward (and of the backward, which must be given the same ones).
struct ForwardRequest {
  std::optional<double> scale = std::nullopt;
  Causality causality = {};
  std::optional<AttentionWindow> window = std::nullopt;
  py::object mask = py::none();
  std::string impl = "auto";
  bool return_lse = false;
  bool return_weights = false;
  bool allow_nonfinite = false;
  std::optional<double> softcap = std::nullopt;
  py::object alibi = py::none();                                    // None, "auto" or [H] slopes
  py::object sinks = py::none();                                    // None or [H]
  py::object cu_seqlens_q = py::none(), cu_seqlens_k = py::none();  // None or [N+1] offsets
  AttentionDropout dropout = {};
  // Operands stored narrower than float32 (stored.hpp): int8 k's and v's scales, and whether
  // uint16 operands hold bfloat16 bits.
  py::object k_scales = py::none(), v_scales = py::none();
  bool bf16 = false;
};

// The mask with causality's alignment and the window, which the dot-product and the additive
// attention share.
template <class T>
AttentionMask<T> mask_of(Inputs& in, const ForwardRequest& r);

// alibi= and sinks= for `heads` query heads, into the mask's slopes and `sinks`.
template <class T>
void set_head_options(Inputs& in, const ForwardRequest& r, int64_t heads, AttentionMask<T>& mask,
                      std::optional<TensorView<const T>>& sinks);

// q, k, v and the request as the op takes them, viewed (or copied once) into arrays that `in` keeps.
template <class T>
AttentionParams<T> attention_params(Inputs& in, const py::object& q, const py::object& k, const py::object& v,
                                    const ForwardRequest& r);

}  // namespace qkv::python
