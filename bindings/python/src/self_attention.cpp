// qkv.SelfAttention: the multi-head self-attention layer of qkv/nn/self_attention.hpp, its
// parameters and their gradients as numpy arrays that alias the layer's own memory.

#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <variant>

#include "arrays.hpp"
#include "module.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/nn/self_attention.hpp"

namespace qkv::python {
namespace {

using namespace pybind11::literals;

template <class T>
struct Layer {
  SelfAttention<T> layer;
  SelfAttentionCache<T> cache;
  bool has_forward = false;
  std::optional<Tensor<T>> alibi_slopes;  // [H], the standard ones, when the layer uses ALiBi
};

// A numpy array over `view`'s memory that keeps `owner` (the Python layer object) alive.
template <class T>
py::array alias(TensorView<T> view, const py::object& owner) {
  std::vector<py::ssize_t> shape(view.shape.dims().begin(), view.shape.dims().end());
  std::vector<py::ssize_t> strides;
  for (int axis = 0; axis < view.rank(); ++axis) {
    strides.push_back(static_cast<py::ssize_t>(view.strides[static_cast<size_t>(axis)] * sizeof(T)));
  }
  return py::array_t<T>(shape, strides, view.data, owner);
}

class PySelfAttention {
 public:
  PySelfAttention(int64_t d_model, int64_t n_heads, bool bias, bool output_projection, bool causal, uint64_t seed,
                  const std::string& dtype, std::optional<double> softcap, const py::object& window, bool alibi)
      : window_(window_of(window)) {
    const SelfAttentionConfig config{d_model, n_heads, bias, output_projection, causal, softcap};
    Rng rng(seed);
    auto make = [&]<class T>(T) {
      auto layer = std::make_unique<Layer<T>>(Layer<T>{SelfAttention<T>(config, rng), {}, false, std::nullopt});
      if (alibi) {
        const std::vector<double> slopes = alibi_slopes(n_heads);
        layer->alibi_slopes = Tensor<T>(Shape{n_heads});
        for (int64_t h = 0; h < n_heads; ++h)
          (*layer->alibi_slopes)[h] = static_cast<T>(slopes[static_cast<size_t>(h)]);
      }
      return layer;
    };
    if (dtype == "float32") {
      layer_ = make(float{});
    } else if (dtype == "float64") {
      layer_ = make(double{});
    } else {
      throw ValueError(fmt::format("dtype: expected \"float32\" or \"float64\", got \"{}\"", dtype));
    }
  }

  py::object forward(const py::object& x, const py::object& mask, bool return_weights) {
    return std::visit([&](auto& l) { return forward_as(*l, x, mask, return_weights); }, layer_);
  }

  py::array backward(const py::object& dy) {
    return std::visit([&](auto& l) { return backward_as(*l, dy); }, layer_);
  }

  void zero_grad() {
    std::visit([](auto& l) { l->layer.zero_grad(); }, layer_);
  }

  // name → array over the values (grads = false) or the gradients, in the layer's order.
  py::dict tensors(const py::object& self, bool grads) {
    py::dict result;
    std::visit(
        [&](auto& l) {
          for (auto& ref : l->layer.parameters()) result[py::str(ref.name)] = alias(grads ? ref.grad : ref.value, self);
        },
        layer_);
    return result;
  }

  const SelfAttentionConfig& config() const {
    return std::visit([](auto& l) -> const SelfAttentionConfig& { return l->layer.config(); }, layer_);
  }
  std::string dtype() const {
    return std::holds_alternative<std::unique_ptr<Layer<float>>>(layer_) ? "float32" : "float64";
  }

 private:
  template <class T>
  py::object forward_as(Layer<T>& l, const py::object& x, const py::object& mask, bool return_weights) {
    Inputs in;
    const TensorView<const T> xv = in.floats<T>(x, "x", "the layer", false);
    AttentionMask<T> m = in.mask<T>(mask, false, false);
    m.window = window_;
    if (l.alibi_slopes) m.alibi_slopes = l.alibi_slopes->cview();
    if (xv.rank() != 2 && xv.rank() != 3) {
      throw ShapeError(
          fmt::format("x: expected rank 2 or 3 ([T, d_model] or [B, T, d_model]), got shape {}", xv.shape.str()));
    }
    const int64_t t = xv.shape.from_back(2), heads = l.layer.config().n_heads;
    std::optional<py::array_t<T>> weights;
    std::optional<TensorView<T>> weights_view;
    if (return_weights) {
      weights = new_array<T>(xv.rank() == 2 ? Shape{heads, t, t} : Shape{xv.shape[0], heads, t, t}, "weights");
      weights_view = view_of(*weights);
    }
    Tensor<T> y;
    l.has_forward = false;
    run_without_gil([&] { y = l.layer.forward(xv, l.cache, m, weights_view); });
    l.has_forward = true;
    auto result = new_array<T>(y.shape(), "y");
    std::copy(y.values().begin(), y.values().end(), result.mutable_data());
    if (weights) return py::make_tuple(result, *weights);
    return result;
  }

  template <class T>
  py::array backward_as(Layer<T>& l, const py::object& dy) {
    if (!l.has_forward) throw ValueError("backward: expected a forward call first, got none");
    Inputs in;
    const TensorView<const T> dyv = in.floats<T>(dy, "dy", "the layer", false);
    check_shape("dy", dyv.shape, l.cache.x.shape());
    auto dx = new_array<T>(l.cache.x.shape(), "dx", true);
    const TensorView<T> dx_view = view_of(dx);
    run_without_gil([&] { l.layer.backward(l.cache, dyv, dx_view); });
    return dx;
  }

  std::variant<std::unique_ptr<Layer<float>>, std::unique_ptr<Layer<double>>> layer_;
  std::optional<AttentionWindow> window_;
};

constexpr const char* kSelfAttentionDoc =
    R"(Multi-head self-attention as a layer with its own parameters (float32 or float64).

    x [B, T, d_model] or [T, d_model];  H = n_heads, Dh = d_model / H
    Q = x w_q^T + b_q,  K = x w_k^T + b_k,  V = x w_v^T + b_v, split into H heads of Dh features
    y = concat_h attention(Q_h, K_h, V_h) w_o^T + b_o        (y = the concatenation without
                                                               output_projection)
Every w is [d_model, d_model] and every b [d_model] (present when bias=True). They start as a fresh
torch.nn.Linear(d_model, d_model) would, drawn from `seed`; layer.parameters() and layer.grads()
return them as numpy arrays that share the layer's memory (write into them to load weights).

softcap, window and alibi (the standard slopes) are those of qkv.attention, for every call.

    y = layer.forward(x, mask=None)   # also (y, weights [B, H, T, T]) with return_weights=True
    dx = layer.backward(dy)           # adds into layer.grads(); layer.zero_grad() resets them)";

}  // namespace

void add_self_attention(py::module_& m) {
  py::class_<PySelfAttention>(m, "SelfAttention", kSelfAttentionDoc)
      .def(py::init<int64_t, int64_t, bool, bool, bool, uint64_t, const std::string&, std::optional<double>,
                    const py::object&, bool>(),
           "d_model"_a, "n_heads"_a = 1, py::kw_only(), "bias"_a = true, "output_projection"_a = true,
           "causal"_a = false, "seed"_a = 0, "dtype"_a = "float32", "softcap"_a = py::none(), "window"_a = py::none(),
           "alibi"_a = false)
      .def("forward", &PySelfAttention::forward, "x"_a, py::kw_only(), "mask"_a = py::none(),
           "return_weights"_a = false,
           "x [B, T, d_model] or [T, d_model] -> y of x's shape (and the weights [B, H, T, T], or [H, T, T] for "
           "a rank-2 x, with return_weights). mask as in qkv.attention, broadcastable to [B, H, T, T]; it "
           "combines with the layer's causal. Keeps what backward() needs.")
      .def("__call__", &PySelfAttention::forward, "x"_a, py::kw_only(), "mask"_a = py::none(),
           "return_weights"_a = false, "The same as forward().")
      .def("backward", &PySelfAttention::backward, "dy"_a,
           "dy (the gradient of the loss with respect to the last forward's y) -> dx; every parameter's gradient "
           "is added into grads().")
      .def("zero_grad", &PySelfAttention::zero_grad, "Sets every parameter's gradient to 0.")
      .def(
          "parameters", [](py::object self) { return self.cast<PySelfAttention&>().tensors(self, false); },
          "{name: array} for w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o (those present), sharing the layer's memory.")
      .def(
          "grads", [](py::object self) { return self.cast<PySelfAttention&>().tensors(self, true); },
          "{name: array} of the parameters' gradients, sharing the layer's memory.")
      .def_property_readonly("d_model", [](const PySelfAttention& l) { return l.config().d_model; })
      .def_property_readonly("n_heads", [](const PySelfAttention& l) { return l.config().n_heads; })
      .def_property_readonly("head_dim",
                             [](const PySelfAttention& l) { return l.config().d_model / l.config().n_heads; })
      .def_property_readonly("causal", [](const PySelfAttention& l) { return l.config().causal; })
      .def_property_readonly("dtype", &PySelfAttention::dtype)
      .def("__repr__", [](const PySelfAttention& l) {
        const SelfAttentionConfig& c = l.config();
        return fmt::format(
            "qkv.SelfAttention(d_model={}, n_heads={}, bias={}, output_projection={}, causal={}, "
            "dtype='{}')",
            c.d_model, c.n_heads, c.bias ? "True" : "False", c.output_projection ? "True" : "False",
            c.causal ? "True" : "False", l.dtype());
      });
}

}  // namespace qkv::python
