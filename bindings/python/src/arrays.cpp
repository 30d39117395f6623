#include "arrays.hpp"

#include <fmt/format.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <csignal>
#include <cstring>

#include "qkv/core/cancel.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"

namespace qkv::python {
namespace {

std::string dtype_str(const py::array& array) { return py::str(array.dtype()).cast<std::string>(); }

bool is_float(const py::array& array, size_t itemsize) {
  return array.dtype().kind() == 'f' && static_cast<size_t>(array.itemsize()) == itemsize;
}

std::string shape_str(const py::array& array) {
  std::vector<int64_t> dims(array.shape(), array.shape() + array.ndim());
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

// Whether the kernels can read `array` where it is: strides that are non-negative multiples of the
// item size, a contiguous last dim, aligned data in native byte order of exactly type T.
template <class T>
bool viewable(const py::array& array) {
  if (!array.dtype().is(py::dtype::of<T>()) && !array.dtype().equal(py::dtype::of<T>())) return false;
  if (!(array.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_)) return false;
  for (py::ssize_t axis = 0; axis < array.ndim(); ++axis) {
    const py::ssize_t stride = array.strides(axis);
    if (stride < 0 || stride % static_cast<py::ssize_t>(sizeof(T)) != 0) return false;
  }
  const py::ssize_t last = array.ndim() - 1;
  return array.ndim() == 0 || array.shape(last) <= 1 || array.strides(last) == static_cast<py::ssize_t>(sizeof(T));
}

template <class T>
TensorView<const T> view_as(const py::array& array) {
  std::vector<int64_t> dims(array.shape(), array.shape() + array.ndim());
  TensorView<const T> view{static_cast<const T*>(array.data()), Shape(std::span<const int64_t>(dims)), {}};
  // numpy gives an empty array strides of 0, which no element is ever read through.
  if (array.size() == 0) return make_view(view.data, view.shape);
  for (py::ssize_t axis = 0; axis < array.ndim(); ++axis) {
    view.strides[static_cast<size_t>(axis)] = array.strides(axis) / static_cast<py::ssize_t>(sizeof(T));
  }
  return view;
}

// The operand as a numpy array; what numpy cannot make one of (a ragged list, a tensor of a dtype
// numpy lacks) is a ShapeError naming the argument, not a null array.
py::array as_array(const py::object& operand, std::string_view name) {
  py::array array = py::array::ensure(operand);
  if (!array) {
    throw ShapeError(fmt::format("{}: expected an array numpy can read, got a {}", name,
                                 py::str(py::type::of(operand).attr("__name__")).cast<std::string>()));
  }
  return array;
}

// `array` as a C-contiguous, aligned array of T that the kernels can read: itself when it is one,
// else a copy. (pybind11's array_t::ensure asks numpy for C order, not for alignment: a misaligned
// array would come back as it was.)
template <class T>
py::array readable(py::array array) {
  if (viewable<T>(array)) return array;
  array = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(array);
  if (viewable<T>(array)) return array;
  return py::array_t<T, py::array::c_style>::ensure(array.attr("copy")());
}

// qkv's tensors have rank 0 to 4; the ops check the ranks they take within that.
void check_rank_fits(const py::array& array, std::string_view name) {
  if (array.ndim() > kMaxRank) {
    throw ShapeError(fmt::format("{}: expected rank at most {}, got shape {}", name, kMaxRank, shape_str(array)));
  }
}

// Set by the SIGINT handler that run_without_gil installs; lock-free, so the handler may write it.
std::atomic<bool> sigint_pending{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_sigint(int) { sigint_pending.store(true, std::memory_order_relaxed); }

bool cancel_requested() { return sigint_pending.load(std::memory_order_relaxed); }

bool on_main_thread() {
  static const unsigned long main_thread =
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  return PyThread_get_thread_ident() == main_thread;
}

}  // namespace

Precision precision_of(const py::object& operand, std::string_view name, std::string_view accepted) {
  const py::array array = as_array(operand, name);
  if (is_float(array, 4)) return Precision::float32;
  if (is_float(array, 8)) return Precision::float64;
  throw ShapeError(fmt::format("{}: expected dtype {}, got {}", name, accepted, dtype_str(array)));
}

py::array Inputs::hold(py::array array) {
  held_.push_back(array);
  return array;
}

template <class T>
TensorView<const T> Inputs::floats(const py::object& operand, std::string_view name, std::string_view of_dtype_of,
                                   bool allow_nonfinite, NonFinite rule) {
  py::array array = as_array(operand, name);
  const std::string_view wanted = sizeof(T) == 4 ? "float32" : "float64";
  if (!is_float(array, sizeof(T))) {
    if (of_dtype_of.empty()) {
      throw ShapeError(fmt::format("{}: expected dtype {}, got {}", name, wanted, dtype_str(array)));
    }
    throw ShapeError(
        fmt::format("{}: expected dtype {} (the dtype of {}), got {}", name, wanted, of_dtype_of, dtype_str(array)));
  }
  check_rank_fits(array, name);
  const TensorView<const T> view = view_as<T>(hold(readable<T>(array)));
  if (!allow_nonfinite) check_finite(view, name, rule, "pass allow_nonfinite=True to accept them");
  return view;
}

StoredView Inputs::stored(const py::object& operand, std::string_view name, const py::object& scales,
                          std::string_view scales_name, bool bfloat16_bits, bool allow_nonfinite) {
  py::array array = as_array(operand, name);
  const char kind = array.dtype().kind();
  const auto itemsize = array.itemsize();
  const std::string accepted =
      fmt::format("float32, float16, uint16 (bfloat16 bits, with bf16=True){}", scales_name.empty() ? "" : " or int8");
  const bool int8 = kind == 'i' && itemsize == 1 && !scales_name.empty();
  if (!int8 && !scales.is_none()) {
    throw ValueError(fmt::format("{}: expected none for {} of dtype {} (only int8 has scales), got an array",
                                 scales_name, name, dtype_str(array)));
  }
  check_rank_fits(array, name);
  StoredView view;
  if (kind == 'f' && itemsize == 4) {
    view = StoredView::float32(floats<float>(array, name, "", true));
  } else if (kind == 'f' && itemsize == 2) {
    // Bits in native byte order, which viewing a '>f2' array as uint16 would not give.
    if (!array.dtype().equal(py::dtype("float16"))) array = array.attr("astype")("float16");
    view = StoredView::float16(view_as<uint16_t>(hold(readable<uint16_t>(array.view("uint16")))));
  } else if (kind == 'u' && itemsize == 2) {
    if (!bfloat16_bits) {
      throw ShapeError(
          fmt::format("{}: expected bf16=True with a uint16 array (the bits of bfloat16; numpy has no bfloat16 dtype), "
                      "got bf16=False",
                      name));
    }
    view = StoredView::bfloat16(view_as<uint16_t>(hold(readable<uint16_t>(array))));
  } else if (int8) {
    if (scales.is_none()) {
      throw ValueError(
          fmt::format("{}: expected the scales of int8 {} (value = scale * stored), got none", scales_name, name));
    }
    py::array scale_array = as_array(scales, scales_name);
    if (scale_array.dtype().kind() != 'f' || (scale_array.itemsize() != 4 && scale_array.itemsize() != 8)) {
      throw ShapeError(
          fmt::format("{}: expected dtype float32 or float64, got {}", scales_name, dtype_str(scale_array)));
    }
    if (scale_array.itemsize() == 8) scale_array = scale_array.attr("astype")("float32");
    const TensorView<const float> scale_view = floats<float>(scale_array, scales_name, "", true);
    view = StoredView::int8(view_as<int8_t>(hold(readable<int8_t>(array))), scale_view);
    // The op checks these too, under its own names (k.scales).
    broadcast_to(scale_view, view.shape, scales_name);
    check_finite(scale_view, scales_name);
  } else {
    throw ShapeError(fmt::format("{}: expected dtype {}, got {}", name, accepted, dtype_str(array)));
  }
  if (!allow_nonfinite) check_finite(view, name, "pass allow_nonfinite=True to accept them");
  return view;
}

void check_bf16_flag(bool bf16, std::initializer_list<const StoredView*> operands, std::string_view names) {
  if (!bf16) return;
  for (const StoredView* operand : operands) {
    if (operand->type == StorageType::bfloat16) return;
  }
  throw ValueError(
      fmt::format("bf16: True says which uint16 arrays hold bfloat16 bits, but none of {} is uint16", names));
}

template <class T>
AttentionMask<T> Inputs::mask(const py::object& mask, bool causal, bool allow_nonfinite) {
  AttentionMask<T> result;
  result.causal = causal;
  if (mask.is_none()) return result;
  py::array array = as_array(mask, "mask");
  check_rank_fits(array, "mask");
  const char kind = array.dtype().kind();
  if (kind == 'b' || kind == 'i' || kind == 'u') {
    // bool and uint8 hold what the kernels read (nonzero = may attend) as they are.
    if (!(kind != 'i' && array.itemsize() == 1 && viewable<uint8_t>(array.view("uint8")))) {
      array = py::array_t<uint8_t, py::array::c_style>::ensure(
          py::module_::import("numpy").attr("not_equal")(array, 0).attr("astype")("uint8"));
    } else {
      array = array.view("uint8");
    }
    result.allowed = view_as<uint8_t>(hold(array));
    return result;
  }
  if (kind != 'f' || (array.itemsize() != 4 && array.itemsize() != 8) ||
      static_cast<size_t>(array.itemsize()) > sizeof(T)) {
    throw ShapeError(fmt::format(
        "mask: expected dtype bool or an integer type (nonzero = may attend), or {} (a bias added to the "
        "scores{}), got {}",
        sizeof(T) == 4 ? "float32" : "float64 or float32", sizeof(T) == 4 ? "; the dtype of q" : "", dtype_str(array)));
  }
  if (static_cast<size_t>(array.itemsize()) < sizeof(T)) array = array.attr("astype")(py::dtype::of<T>());
  result.bias = floats<T>(array, "mask", "", allow_nonfinite, NonFinite::minus_infinity_allowed);
  return result;
}

template <class T>
TensorView<const T> Inputs::per_head(const py::object& values, std::string_view name, bool allow_nonfinite) {
  py::array array = as_array(values, name);
  const char kind = array.dtype().kind();
  // A list of Python floats is float64 to numpy, which a float32 caller did not choose.
  const bool numbers = !py::isinstance<py::array>(values) && (kind == 'f' || kind == 'i' || kind == 'u');
  if (numbers || (kind == 'f' && static_cast<size_t>(array.itemsize()) < sizeof(T))) {
    array = array.attr("astype")(py::dtype::of<T>());
  }
  return floats<T>(array, name, "q", allow_nonfinite);
}

TensorView<const int64_t> Inputs::offsets(const py::object& values, std::string_view name) {
  py::array array = as_array(values, name);
  const char kind = array.dtype().kind();
  // numpy reads an empty list as float64; it is no less a list of offsets (of the wrong shape).
  const bool numbers = !py::isinstance<py::array>(values) && (kind == 'i' || kind == 'u' || array.size() == 0);
  const bool int32_or_64 = kind == 'i' && (array.itemsize() == 4 || array.itemsize() == 8);
  if (!numbers && !int32_or_64) {
    throw ShapeError(fmt::format("{}: expected dtype int32 or int64, got {}", name, dtype_str(array)));
  }
  check_rank_fits(array, name);
  array = readable<int64_t>(array);
  return view_as<int64_t>(hold(array));
}

template <class T>
py::array_t<T> new_array(const Shape& shape, std::string_view what, bool zeroed) {
  check_allocation_fits(static_cast<double>(shape.numel()) * sizeof(T), what);
  py::array_t<T> array(std::vector<py::ssize_t>(shape.dims().begin(), shape.dims().end()));
  if (zeroed && shape.numel() > 0) std::memset(array.mutable_data(), 0, static_cast<size_t>(shape.numel()) * sizeof(T));
  return array;
}

template <class T>
TensorView<T> view_of(py::array_t<T>& array) {
  std::vector<int64_t> dims(array.shape(), array.shape() + array.ndim());
  return make_view(array.mutable_data(), Shape(std::span<const int64_t>(dims)));
}

void run_without_gil(const std::function<void()>& compute) {
  if (!on_main_thread()) {
    py::gil_scoped_release release;
    compute();
    return;
  }
  struct sigaction action {};
  struct sigaction previous {};
  action.sa_handler = on_sigint;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigint_pending.store(false, std::memory_order_relaxed);
  sigaction(SIGINT, &action, &previous);
  bool cancelled = false;
  try {
    py::gil_scoped_release release;
    const CancelScope scope(cancel_requested);
    compute();
  } catch (const Cancelled&) {
    cancelled = true;
  } catch (...) {
    sigaction(SIGINT, &previous, nullptr);
    // The error is raised; Python's handler sees the signal at its next check.
    if (sigint_pending.load(std::memory_order_relaxed)) std::raise(SIGINT);
    throw;
  }
  sigaction(SIGINT, &previous, nullptr);
  if (!sigint_pending.load(std::memory_order_relaxed)) return;
  // Hand the signal to Python's own handler, which runs once asked below.
  std::raise(SIGINT);
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  if (cancelled) {
    PyErr_SetString(PyExc_KeyboardInterrupt, "qkv: the call was interrupted and its results discarded");
    throw py::error_already_set();
  }
}

AttentionImpl impl_of(std::string_view impl) {
  if (impl == "auto") return AttentionImpl::automatic;
  if (impl == "fused") return AttentionImpl::fused;
  if (impl == "reference") return AttentionImpl::reference;
  throw ValueError(fmt::format("impl: expected \"auto\", \"fused\" or \"reference\", got \"{}\"", impl));
}

#define QKV_PYTHON_INSTANTIATE(T)                                                                                      \
  template TensorView<const T> Inputs::floats(const py::object&, std::string_view, std::string_view, bool, NonFinite); \
  template AttentionMask<T> Inputs::mask(const py::object&, bool, bool);                                               \
  template TensorView<const T> Inputs::per_head(const py::object&, std::string_view, bool);                            \
  template py::array_t<T> new_array(const Shape&, std::string_view, bool);                                             \
  template TensorView<T> view_of(py::array_t<T>&);
QKV_PYTHON_INSTANTIATE(float)
QKV_PYTHON_INSTANTIATE(double)
#undef QKV_PYTHON_INSTANTIATE
template py::array_t<uint16_t> new_array(const Shape&, std::string_view, bool);
template py::array_t<int8_t> new_array(const Shape&, std::string_view, bool);

// window=: None or (left, right), each an int, -1 for unbounded (the op checks the values).
std::optional<AttentionWindow> window_of(const py::object& window) {
  if (window.is_none()) return std::nullopt;
  const auto refuse = [&] {
    return ValueError(fmt::format("window: expected None or a pair (left, right) of ints (-1 = unbounded), got {}",
                                  py::repr(window).cast<std::string>()));
  };
  if (py::isinstance<py::str>(window) || !py::isinstance<py::sequence>(window)) throw refuse();
  const auto bounds = window.cast<py::sequence>();
  if (bounds.size() != 2) throw refuse();
  int64_t values[2];
  for (size_t side = 0; side < 2; ++side) {
    const py::object bound = bounds[side];
    // bool is an int to Python, but window=(True, False) is a mistake rather than (1, 0).
    if (PyBool_Check(bound.ptr()) || !PyIndex_Check(bound.ptr())) throw refuse();
    const auto index = py::reinterpret_steal<py::object>(PyNumber_Index(bound.ptr()));
    if (!index) throw py::error_already_set();
    const long long value = PyLong_AsLongLong(index.ptr());
    if (value == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw refuse();
    }
    values[side] = value;
  }
  return AttentionWindow{values[0], values[1]};
}

}  // namespace qkv::python
