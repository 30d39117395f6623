// qkv._qkv: the C++ library for Python. The package qkv (qkv/__init__.py) re-exports it; qkv.torch
// adapts it to PyTorch without linking libtorch.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "module.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/ops/attention.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

PYBIND11_MODULE(_qkv, m) {
  m.doc() = "qkv's C++ kernels on numpy arrays; import qkv rather than this module.";
  m.attr("__version__") = QKV_VERSION;

  // qkv's errors as Python exceptions of the builtin kinds a caller catches: shapes and values are
  // ValueErrors, files OSErrors, requests too big for the memory MemoryErrors. A translator
  // registered later is tried first, so the base comes first.
  const auto& error = py::register_exception<qkv::Error>(m, "Error", PyExc_ValueError);
  py::register_exception<qkv::ShapeError>(m, "ShapeError", error.ptr());
  py::register_exception<qkv::IoError>(m, "FileError", PyExc_OSError);
  py::register_exception<qkv::ResourceError>(m, "ResourceError", PyExc_MemoryError);

  qkv::python::add_attention(m);
  qkv::python::add_self_attention(m);
  qkv::python::add_heatmap(m);
  qkv::python::add_explorer(m);
  qkv::python::add_stored(m);

  m.def("default_scale", &qkv::default_scale, "dk"_a, "The scale attention() uses when none is given: 1/sqrt(dk).");
  m.def("get_num_threads", &qkv::max_workers, "The number of threads qkv's kernels use (OpenMP's).");
  m.def("set_num_threads", &qkv::set_max_workers, "workers"_a,
        "Makes qkv's kernels use at most `workers` threads (>= 1) for calls from this thread.");
  m.def("simd_targets", &qkv::simd_targets,
        "The SIMD instruction sets the kernels were built for that this CPU runs, best first "
        "(e.g. ['AVX3', 'AVX2', 'SSE4', 'SCALAR']).");
  m.def("simd_target", &qkv::simd_target, "The instruction set the next kernel call runs.");
  m.def("use_simd_target", &qkv::use_simd_target, "target"_a,
        "Makes every kernel run `target` (one of simd_targets()); '' goes back to the best. "
        "Process-wide: for tests and benchmarks.");
  m.def("cpu_summary", &qkv::cpu_summary, "The CPU model and its caches, in one line.");
  m.def("attention_bf16_products", &qkv::attention_bf16_products,
        "Whether this CPU, at the SIMD target in use, runs attention on bfloat16 q, k and v (out alone, blocks of "
        "more than 8 queries) with its bf16 dot product (AVX512_BF16), which rounds the weights to bfloat16; "
        "and whether bfloat16 q and k take it for the scores of every forward and backward.");
  m.def("attention_bf16_tiles", &qkv::attention_bf16_tiles,
        "Whether those bf16 products run on AMX's tiles (AMX-BF16, where the operating system grants them) rather "
        "than on AVX512_BF16's dot product; the two differ only in the order of their sums.");
}
