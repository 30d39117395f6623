#include "attention_args.hpp"

#include <fmt/format.h>
#include <pybind11/numpy.h>

#include <algorithm>
#include <vector>

#include "qkv/core/error.hpp"

namespace qkv::python {

Causality causality_of(const py::object& causal) {
  if (py::isinstance<py::str>(causal)) {
    const std::string name = causal.cast<std::string>();
    if (name == "bottom-right") return {true, CausalAlignment::bottom_right};
    if (name == "top-left") return {true, CausalAlignment::top_left};
  } else if (PyBool_Check(causal.ptr()) || py::isinstance(causal, py::module_::import("numpy").attr("bool_"))) {
    return {causal.cast<bool>(), CausalAlignment::bottom_right};
  }
  throw ValueError(fmt::format("causal: expected True, False, \"bottom-right\" or \"top-left\", got {}",
                               py::repr(causal).cast<std::string>()));
}

uint64_t seed_of(const py::object& seed) {
  const auto refuse = [&] {
    return ValueError(fmt::format("seed: expected an int in [0, 2**64), got {}", py::repr(seed).cast<std::string>()));
  };
  if (PyBool_Check(seed.ptr()) || !PyIndex_Check(seed.ptr())) throw refuse();
  const auto index = py::reinterpret_steal<py::object>(PyNumber_Index(seed.ptr()));
  if (!index) throw py::error_already_set();
  const unsigned long long value = PyLong_AsUnsignedLongLong(index.ptr());
  if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw refuse();
  }
  return value;
}

template <class T>
AttentionMask<T> mask_of(Inputs& in, const ForwardRequest& r) {
  AttentionMask<T> mask = in.mask<T>(r.mask, r.causality.causal, r.allow_nonfinite);
  mask.alignment = r.causality.alignment;
  mask.window = r.window;
  if (!r.cu_seqlens_q.is_none()) mask.cu_seqlens_q = in.offsets(r.cu_seqlens_q, "cu_seqlens_q");
  if (!r.cu_seqlens_k.is_none()) mask.cu_seqlens_k = in.offsets(r.cu_seqlens_k, "cu_seqlens_k");
  return mask;
}

namespace {

// alibi="auto": the standard slopes for `heads` heads, as an array that `in` keeps alive.
template <class T>
TensorView<const T> standard_alibi_slopes(Inputs& in, int64_t heads) {
  const std::vector<double> slopes = alibi_slopes(heads);
  py::array_t<T> array(static_cast<py::ssize_t>(slopes.size()));
  std::copy(slopes.begin(), slopes.end(), array.mutable_data());
  return in.floats<T>(array, "alibi", "q", true);
}

}  // namespace

template <class T>
void set_head_options(Inputs& in, const ForwardRequest& r, int64_t heads, AttentionMask<T>& mask,
                      std::optional<TensorView<const T>>& sinks) {
  if (py::isinstance<py::str>(r.alibi)) {
    if (r.alibi.cast<std::string>() != "auto") {
      throw ValueError(
          fmt::format("alibi: expected None, \"auto\" or [H] slopes, got {}", py::repr(r.alibi).cast<std::string>()));
    }
    mask.alibi_slopes = standard_alibi_slopes<T>(in, heads);
  } else if (!r.alibi.is_none()) {
    const TensorView<const T> slopes = in.per_head<T>(r.alibi, "alibi", r.allow_nonfinite);
    // The op would name its own field, alibi_slopes.
    check_shape("alibi", slopes.shape, Shape{heads});
    mask.alibi_slopes = slopes;
  }
  if (!r.sinks.is_none()) sinks = in.per_head<T>(r.sinks, "sinks", r.allow_nonfinite);
}

template <class T>
AttentionParams<T> attention_params(Inputs& in, const py::object& q, const py::object& k, const py::object& v,
                                    const ForwardRequest& r) {
  AttentionParams<T> p{in.floats<T>(q, "q", "", r.allow_nonfinite), in.floats<T>(k, "k", "q", r.allow_nonfinite),
                       in.floats<T>(v, "v", "q", r.allow_nonfinite), r.scale, mask_of<T>(in, r)};
  p.softcap = r.softcap;
  set_head_options<T>(in, r, as_bhtd(p.q, "q").shape[1], p.mask, p.sinks);
  // p = 0 is exactly no dropout, so the op may be handed it always (and checks it).
  p.dropout = r.dropout;
  return p;
}

template AttentionMask<float> mask_of(Inputs&, const ForwardRequest&);
template AttentionMask<double> mask_of(Inputs&, const ForwardRequest&);
template void set_head_options(Inputs&, const ForwardRequest&, int64_t, AttentionMask<float>&,
                               std::optional<TensorView<const float>>&);
template AttentionParams<float> attention_params(Inputs&, const py::object&, const py::object&, const py::object&,
                                                 const ForwardRequest&);
template AttentionParams<double> attention_params(Inputs&, const py::object&, const py::object&, const py::object&,
                                                  const ForwardRequest&);

}  // namespace qkv::python
