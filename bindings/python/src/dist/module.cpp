// qkv._dist: ring attention over MPI (qkv/dist/ring_attention.hpp) on numpy arrays, on the
// caller's mpi4py communicator. A module apart from qkv._qkv, built only where Open MPI and
// mpi4py's C headers are found (bindings/python/CMakeLists.txt), so that `import qkv` never needs
// MPI. qkv/dist.py is its Python face.
//
// Every argument is read on each rank first, with the GIL held; then the ranks agree
// (dist::all_or_none) before any array is sent. A rank whose arguments are wrong therefore makes
// every rank raise the same exception, "rank R: <argument>: ...", and none of them waits for it.
// The arguments are taken as Python objects, not typed, so that pybind11 raises no TypeError on
// one rank before that agreement.

#include <fmt/format.h>
#include <mpi.h>
#include <mpi4py/mpi4py.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../arrays.hpp"
#include "../attention_args.hpp"
#include "qkv/core/error.hpp"
#include "qkv/dist/ring_attention.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv::python {
namespace {

std::string repr(const py::object& value) { return py::repr(value).cast<std::string>(); }

// comm=: None (MPI.COMM_WORLD) or an mpi4py MPI.Comm. Checked on this rank alone: without a
// communicator there are no ranks to agree with.
MPI_Comm comm_of(const py::object& comm) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    throw Error(
        fmt::format("comm: expected MPI to be running, got it {} (mpi4py starts it on import unless "
                    "mpi4py.rc.initialize is False)",
                    finalized ? "finalized" : "not initialized"));
  }
  const py::object given = comm.is_none() ? py::module_::import("mpi4py.MPI").attr("COMM_WORLD") : comm;
  if (!PyObject_TypeCheck(given.ptr(), &PyMPIComm_Type)) {
    throw py::type_error(fmt::format("comm: expected an mpi4py MPI.Comm, got {}", Py_TYPE(given.ptr())->tp_name));
  }
  const MPI_Comm* handle = PyMPIComm_Get(given.ptr());
  if (handle == nullptr) throw py::error_already_set();
  if (*handle == MPI_COMM_NULL) throw ValueError("comm: expected a communicator, got MPI.COMM_NULL");
  return *handle;
}

dist::ShardLayout layout_of(const py::object& layout) {
  if (py::isinstance<py::str>(layout)) {
    const std::string name = layout.cast<std::string>();
    if (name == "contiguous") return dist::ShardLayout::contiguous;
    if (name == "zigzag") return dist::ShardLayout::zigzag;
  }
  throw ValueError(fmt::format("layout: expected \"contiguous\" or \"zigzag\", got {}", repr(layout)));
}

// tq=, tk=: None (the sum of every rank's shard) or the whole sequence's length, an int >= 0.
std::optional<int64_t> length_of(const py::object& length, std::string_view name) {
  if (length.is_none()) return std::nullopt;
  if (!PyBool_Check(length.ptr()) && PyIndex_Check(length.ptr())) {
    const int64_t value = length.cast<int64_t>();
    if (value >= 0) return value;
  }
  throw ValueError(fmt::format("{}: expected None or an int >= 0, got {}", name, repr(length)));
}

std::optional<double> real_or_none(const py::object& value, std::string_view name) {
  if (value.is_none()) return std::nullopt;
  if (PyBool_Check(value.ptr()) || !PyNumber_Check(value.ptr())) {
    throw ValueError(fmt::format("{}: expected None or a number, got {}", name, repr(value)));
  }
  return value.cast<double>();
}

bool flag_of(const py::object& value, std::string_view name) {
  if (PyBool_Check(value.ptr()) || py::isinstance(value, py::module_::import("numpy").attr("bool_"))) {
    return value.cast<bool>();
  }
  throw ValueError(fmt::format("{}: expected True or False, got {}", name, repr(value)));
}

// The keyword arguments that the forward and the backward share, as qkv.attention names them.
struct RingRequest {
  MPI_Comm comm = MPI_COMM_NULL;
  dist::ShardLayout layout = dist::ShardLayout::contiguous;
  std::optional<int64_t> tq, tk;
  ForwardRequest forward;
};

RingRequest request_of(const py::dict& a, MPI_Comm comm) {
  const py::object dropout = a["dropout"];
  if (PyBool_Check(dropout.ptr()) || !PyNumber_Check(dropout.ptr())) {
    throw ValueError(fmt::format("dropout: expected a number, got {}", repr(dropout)));
  }
  return {.comm = comm,
          .layout = layout_of(a["layout"]),
          .tq = length_of(a["tq"], "tq"),
          .tk = length_of(a["tk"], "tk"),
          .forward = {.scale = real_or_none(a["scale"], "scale"),
                      .causality = causality_of(a["causal"]),
                      .window = window_of(a["window"]),
                      .mask = a["mask"],
                      .impl = "fused",
                      .return_lse = a.contains("return_lse") && flag_of(a["return_lse"], "return_lse"),
                      .return_weights = false,
                      .allow_nonfinite = flag_of(a["allow_nonfinite"], "allow_nonfinite"),
                      .softcap = real_or_none(a["softcap"], "softcap"),
                      .alibi = a["alibi"],
                      .sinks = a["sinks"],
                      .cu_seqlens_q = a["cu_seqlens_q"],
                      .cu_seqlens_k = a["cu_seqlens_k"],
                      .dropout = {dropout.cast<double>(), seed_of(a["seed"])}}};
}

// q, k and v with the request, as ring attention takes them. A float mask is refused here, where
// the argument still has its Python name (the ring would name its own field, mask.bias).
AttentionParams<float> ring_params(Inputs& in, const py::object& q, const py::object& k, const py::object& v,
                                   const RingRequest& r) {
  const AttentionParams<float> p = attention_params<float>(in, q, k, v, r.forward);
  if (p.mask.bias) {
    throw ValueError(
        "mask: expected a bool or integer mask (nonzero = may attend), got a float mask (an additive bias), which "
        "ring attention does not take");
  }
  // The ranks of q, k and v, which the outputs are shaped from; the ring checks the rest.
  as_bhtd(p.q, "q");
  as_bhtd(p.k, "k");
  as_bhtd(p.v, "v");
  return p;
}

// Runs `read` on this rank with the GIL held, then agrees with every rank of `comm` (the GIL
// released): either every rank goes on, or every rank throws the error of the lowest rank whose
// `read` threw. A Python exception (a TypeError from numpy, say) becomes qkv.Error with its text,
// as all_or_none carries qkv's kinds of error alone.
void read_on_every_rank(MPI_Comm comm, const std::function<void()>& read) {
  std::exception_ptr failed;
  try {
    read();
  } catch (const py::error_already_set& e) {
    failed = std::make_exception_ptr(Error(e.what()));
  } catch (...) {
    failed = std::current_exception();
  }
  const py::gil_scoped_release release;
  dist::all_or_none(comm, [&] {
    if (failed) std::rethrow_exception(failed);
  });
}

// The whole sequence's Tq and Tk: those given, else the sums of every rank's shards. Every rank
// sums, given or not, so that ranks which differ in that still make the same collective calls; a
// length that does not match the shards is refused by the ring's own check.
dist::RingShards shards_of(const RingRequest& r, int64_t tq_r, int64_t tk_r) {
  const int64_t mine[2] = {tq_r, tk_r};
  int64_t sums[2] = {0, 0};
  MPI_Allreduce(mine, sums, 2, MPI_INT64_T, MPI_SUM, r.comm);
  return {.tq = r.tq.value_or(sums[0]), .tk = r.tk.value_or(sums[1]), .layout = r.layout};
}

int64_t tokens_of(TensorView<const float> x, std::string_view name) { return as_bhtd(x, name).shape[2]; }

py::object ring_attention(const py::object& q, const py::object& k, const py::object& v, const py::kwargs& kwargs) {
  const MPI_Comm comm = comm_of(kwargs["comm"]);
  RingRequest r;
  Inputs in;
  std::optional<AttentionParams<float>> p;
  std::optional<py::array_t<float>> out, lse;
  read_on_every_rank(comm, [&] {
    r = request_of(kwargs, comm);
    p = ring_params(in, q, k, v, r);
    const int leading = p->q.rank() - 2;
    out = new_array<float>(leading_dims_with(p->q.shape, leading, {tokens_of(p->q, "q"), p->v.shape.from_back(1)}),
                           "out");
    if (r.forward.return_lse)
      lse = new_array<float>(leading_dims_with(p->q.shape, leading, {tokens_of(p->q, "q")}), "lse");
  });
  AttentionOutputs<float> outputs{.out = view_of(*out), .weights = std::nullopt, .lse = std::nullopt};
  if (lse) outputs.lse = view_of(*lse);
  {
    const py::gil_scoped_release release;
    const dist::RingShards shards = shards_of(r, tokens_of(p->q, "q"), tokens_of(p->k, "k"));
    dist::ring_attention_forward(*p, shards, outputs, r.comm);
  }
  if (lse) return py::make_tuple(*out, *lse);
  return std::move(*out);
}

py::tuple ring_attention_backward(const py::object& q, const py::object& k, const py::object& v, const py::object& dout,
                                  const py::kwargs& kwargs) {
  const MPI_Comm comm = comm_of(kwargs["comm"]);
  RingRequest r;
  Inputs in;
  std::optional<AttentionParams<float>> p;
  TensorView<const float> dout_view;
  std::optional<AttentionSaved<float>> saved;
  std::optional<py::array_t<float>> dq, dk, dv, dsinks;
  read_on_every_rank(comm, [&] {
    r = request_of(kwargs, comm);
    p = ring_params(in, q, k, v, r);
    dout_view = in.floats<float>(dout, "dout", "q", r.forward.allow_nonfinite);
    const py::object out = kwargs["out"], lse = kwargs["lse"];
    if (out.is_none() != lse.is_none()) {
      throw ValueError(
          fmt::format("out, lse: expected both (what ring_attention(..., return_lse=True) returns) or neither, "
                      "got only {}",
                      out.is_none() ? "lse" : "out"));
    }
    if (!out.is_none()) {
      saved = AttentionSaved<float>{in.floats<float>(out, "out", "q", r.forward.allow_nonfinite),
                                    in.floats<float>(lse, "lse", "q", true)};
    }
    dq = new_array<float>(p->q.shape, "dq", true);
    dk = new_array<float>(p->k.shape, "dk", true);
    dv = new_array<float>(p->v.shape, "dv", true);
    if (p->sinks) dsinks = new_array<float>(p->sinks->shape, "dsinks", true);
  });
  AttentionGradients<float> grads{.dq = view_of(*dq), .dk = view_of(*dk), .dv = view_of(*dv), .dbias = std::nullopt};
  if (dsinks) grads.dsinks = view_of(*dsinks);
  {
    const py::gil_scoped_release release;
    const dist::RingShards shards = shards_of(r, tokens_of(p->q, "q"), tokens_of(p->k, "k"));
    dist::ring_attention_backward(*p, shards, dout_view, grads, saved, r.comm);
  }
  if (dsinks) return py::make_tuple(*dq, *dk, *dv, *dsinks);
  return py::make_tuple(*dq, *dk, *dv);
}

py::list shard_ranges(int64_t tokens, int ranks, int rank, const py::object& layout) {
  py::list ranges;
  for (const dist::TokenRange& range : dist::shard_ranges(tokens, ranks, rank, layout_of(layout))) {
    ranges.append(py::make_tuple(range.start, range.start + range.length));
  }
  return ranges;
}

// qkv._qkv's exception classes, which this module raises too: one `except qkv.ShapeError` catches
// the errors of both. Held for the life of the process.
struct Exceptions {
  py::handle error, shape, file, resource;
};

Exceptions& exceptions() {
  static Exceptions classes;
  return classes;
}

void translate(std::exception_ptr thrown) {
  const Exceptions& e = exceptions();
  try {
    if (thrown) std::rethrow_exception(thrown);
  } catch (const ShapeError& x) {
    PyErr_SetString(e.shape.ptr(), x.what());
  } catch (const IoError& x) {
    PyErr_SetString(e.file.ptr(), x.what());
  } catch (const ResourceError& x) {
    PyErr_SetString(e.resource.ptr(), x.what());
  } catch (const Error& x) {
    PyErr_SetString(e.error.ptr(), x.what());
  }
}

}  // namespace
}  // namespace qkv::python

PYBIND11_MODULE(_dist, m) {
  namespace py = pybind11;
  using namespace pybind11::literals;
  using qkv::python::exceptions;
  m.doc() = "Ring attention over MPI on mpi4py communicators; import qkv.dist rather than this module.";
  if (import_mpi4py() < 0) throw py::error_already_set();
  const py::module_ qkv_module = py::module_::import("qkv._qkv");
  exceptions() = {.error = py::object(qkv_module.attr("Error")).release(),
                  .shape = py::object(qkv_module.attr("ShapeError")).release(),
                  .file = py::object(qkv_module.attr("FileError")).release(),
                  .resource = py::object(qkv_module.attr("ResourceError")).release()};
  py::register_local_exception_translator(qkv::python::translate);
  m.def("ring_attention", &qkv::python::ring_attention, "q"_a, "k"_a, "v"_a);
  m.def("ring_attention_backward", &qkv::python::ring_attention_backward, "q"_a, "k"_a, "v"_a, "dout"_a);
  m.def("shard_ranges", &qkv::python::shard_ranges, "tokens"_a, "ranks"_a, "rank"_a, "layout"_a = "contiguous");
}
