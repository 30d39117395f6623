#pragma once
// numpy arrays in and out of qkv's views, and the one way the module runs a computation.
//
// Inputs: an array whose dtype is the one wanted (native byte order), whose strides are
// non-negative multiples of its item size, whose last dim is contiguous and whose data is aligned
// is viewed without a copy; anything else (array-likes, transposed last dims, big-endian or
// unaligned data) is copied once into a C-contiguous array, which the Inputs object keeps alive.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/core/storage.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv::python {

namespace py = pybind11;

// The element types the kernels take.
enum class Precision { float32, float64 };

// The precision of operand `name` (the first float operand, q): float32 or float64; anything else
// is a ShapeError naming the argument, the dtypes `accepted` and the dtype given.
Precision precision_of(const py::object& operand, std::string_view name,
                       std::string_view accepted = "float32 or float64");

// Keeps the arrays that back the views handed to a kernel, copies included.
class Inputs {
 public:
  // `operand` as a view of T, of rank at most 4 (the op checks the ranks it takes). `name` is the
  // argument's name in errors ("q"); `of_dtype_of` names the argument whose dtype it must have.
  // Values that `rule` does not allow are refused (ValueError) unless `allow_nonfinite`.
  template <class T>
  TensorView<const T> floats(const py::object& operand, std::string_view name, std::string_view of_dtype_of,
                             bool allow_nonfinite, NonFinite rule = NonFinite::refused);

  // An operand in its storage type (qkv/core/storage.hpp), read in place as floats() reads arrays:
  // float32, float16, uint16 as bfloat16 bits (only when `bfloat16_bits`: numpy has no bfloat16
  // dtype, so a uint16 array alone is ambiguous), int8 (only with `scales`, float32 or float64
  // rounded to float32, which the op checks against the operand's shape). `scales_name` names the
  // scales' argument in errors ("k_scales"); empty where int8 is not taken. Refuses other dtypes.
  StoredView stored(const py::object& operand, std::string_view name, const py::object& scales,
                    std::string_view scales_name, bool bfloat16_bits, bool allow_nonfinite);

  // A mask: bool or integer arrays (nonzero = may attend) as `allowed`, float arrays of T's dtype
  // as `bias` (−inf masks a key; float32 is widened for float64 operands, the other way is refused).
  template <class T>
  AttentionMask<T> mask(const py::object& mask, bool causal, bool allow_nonfinite);

  // A vector of one value per head (sinks, ALiBi slopes): an array of T's dtype (float32 is widened
  // for float64 operands, the other way is refused), or numbers that are not an array (a list), taken
  // as T. Non-finite values are refused unless `allow_nonfinite`; the op checks the shape.
  template <class T>
  TensorView<const T> per_head(const py::object& values, std::string_view name, bool allow_nonfinite);

  // Token offsets (cu_seqlens): an int32 or int64 array, or integers that are not an array (a
  // list), as int64. The op checks the shape and the values.
  TensorView<const int64_t> offsets(const py::object& values, std::string_view name);

 private:
  py::array hold(py::array array);
  std::vector<py::array> held_;
};

// Refuses bf16=True when none of the stored operands (named `names`, as "q, k, v") holds bfloat16
// bits: the flag says which uint16 arrays are bfloat16, so it must name one.
void check_bf16_flag(bool bf16, std::initializer_list<const StoredView*> operands, std::string_view names);

// A new C-contiguous array of `shape` (zero-filled when `zeroed`), refused first with MemoryError
// (ResourceError) naming `what` when it would not fit in the memory available.
template <class T>
py::array_t<T> new_array(const Shape& shape, std::string_view what, bool zeroed = false);

// A writable view of an array that new_array made.
template <class T>
TensorView<T> view_of(py::array_t<T>& array);

// Runs `compute` with the GIL released, so that other Python threads run meanwhile. On the main
// thread, Ctrl-C stops it at the kernels' next task and raises KeyboardInterrupt (or whatever
// Python's SIGINT handler raises) once the GIL is back.
void run_without_gil(const std::function<void()>& compute);

// "auto", "fused" or "reference" → the implementation; ValueError naming `impl` otherwise.
AttentionImpl impl_of(std::string_view impl);

// window=: None or (left, right), each an int, -1 for unbounded (the op checks the values).
std::optional<AttentionWindow> window_of(const py::object& window);

}  // namespace qkv::python
