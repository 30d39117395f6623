// Operands stored narrower than float32, made from numpy arrays (qkv.quantize_int8,
// qkv.to_bfloat16, qkv.from_bfloat16), and qkv.KvCache, the paged cache of qkv/ops/kv_cache.hpp.
// qkv.attention itself takes the stored operands (attention.cpp).

#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>

#include "arrays.hpp"
#include "attention_args.hpp"
#include "module.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/io/kv_cache_file.hpp"
#include "qkv/ops/kv_cache.hpp"
#include "qkv/ops/quantize.hpp"

namespace qkv::python {
namespace {

using namespace pybind11::literals;

// A float32 array of any float dtype (float64 rounded, float16 widened): what the conversions take.
TensorView<const float> float32_operand(Inputs& in, const py::object& x, std::string_view name) {
  py::array array = py::array::ensure(x);
  if (!array || array.dtype().kind() != 'f') {
    throw ShapeError(fmt::format("{}: expected a float array (float16, float32 or float64), got {}", name,
                                 array ? py::str(array.dtype()).cast<std::string>() : "no array"));
  }
  if (array.itemsize() != 4) array = array.attr("astype")("float32");
  const TensorView<const float> view = in.floats<float>(array, name, "", true);
  // None of the calls that take these has allow_nonfinite.
  check_finite(view, name);
  return view;
}

// KvCache.attend's q in float32: float64 rounded, float16 and bfloat16 bits (bf16=True) widened
// exactly, as qkv decode widens a bfloat16 --q.
TensorView<const float> query_of(Inputs& in, const py::object& q, bool bf16, Tensor<float>& widened) {
  const py::array array = py::array::ensure(q);
  if (!bf16 && !(array && array.dtype().kind() == 'u' && array.itemsize() == 2)) return float32_operand(in, q, "q");
  const StoredView view = in.stored(q, "q", py::none(), "", bf16, false);
  check_bf16_flag(bf16, {&view}, "q");
  widened = to_float32(view);
  return widened.cview();
}

template <class T>
py::array_t<T> array_of(const Tensor<T>& tensor, std::string_view what) {
  py::array_t<T> array = new_array<T>(tensor.shape(), what);
  std::copy(tensor.data(), tensor.data() + tensor.numel(), array.mutable_data());
  return array;
}

QuantizeGroup group_of(const std::string& group) {
  if (group == "channel") return QuantizeGroup::per_channel;
  if (group == "token") return QuantizeGroup::per_token;
  if (group == "tensor") return QuantizeGroup::per_tensor;
  throw ValueError(fmt::format("group: expected \"channel\", \"token\" or \"tensor\", got \"{}\"", group));
}

py::tuple quantize_int8_py(const py::object& x, const std::string& group) {
  const QuantizeGroup g = group_of(group);
  Inputs in;
  const TensorView<const float> values = float32_operand(in, x, "x");
  Int8Array result;
  run_without_gil([&] { result = quantize_int8(values, g); });
  return py::make_tuple(array_of(result.values, "values"), array_of(result.scales, "scales"));
}

py::array_t<uint16_t> to_bfloat16_py(const py::object& x) {
  Inputs in;
  const TensorView<const float> values = float32_operand(in, x, "x");
  Tensor<uint16_t> bits;
  run_without_gil([&] { bits = to_bfloat16(values); });
  return array_of(bits, "bits");
}

py::array_t<float> from_bfloat16_py(const py::object& bits) {
  Inputs in;
  const StoredView view = in.stored(bits, "bits", py::none(), "", true, true);
  if (view.type != StorageType::bfloat16) {
    throw ShapeError(fmt::format("bits: expected dtype uint16 (bfloat16 bits), got {}",
                                 py::str(py::array::ensure(bits).dtype()).cast<std::string>()));
  }
  Tensor<float> values;
  run_without_gil([&] { values = to_float32(view); });
  return array_of(values, "values");
}

// A KvCache for Python: attend() runs without the GIL, so calls from several Python threads take
// the lock, shared for those that read the cache and exclusive for those that change it.
class PyKvCache {
 public:
  PyKvCache(int64_t kv_heads, int64_t dk, int64_t dv, const std::string& dtype, int64_t page_tokens, int64_t pages)
      : cache_(KvCacheShape{.kv_heads = kv_heads,
                            .dk = dk,
                            .dv = dv,
                            .type = parse_storage(dtype, "dtype"),
                            .page_tokens = page_tokens,
                            .pages = pages}) {}
  explicit PyKvCache(KvCache cache) : cache_(std::move(cache)) {}

  // The cache of a file that save() (or qkv decode --cache-file) wrote; what does not make a
  // cache is refused as the file's error.
  static std::unique_ptr<PyKvCache> load(const std::string& path) {
    std::optional<KvCache> cache;
    run_without_gil([&] {
      KvCacheState state = read_kv_cache_file(path);
      try {
        cache = KvCache::from_state(std::move(state));
      } catch (const IoError&) {
        throw;
      } catch (const Error& e) {
        throw IoError(fmt::format("{}: {}", path, e.what()));
      }
    });
    return std::make_unique<PyKvCache>(std::move(*cache));
  }

  void save(const std::string& path) {
    run_without_gil([&] {
      KvCacheState state;
      {
        std::shared_lock lock(mutex_);
        state = cache_.state();
      }
      write_kv_cache_file(path, state);
    });
  }

  int64_t add_sequence() {
    std::unique_lock lock(mutex_);
    return cache_.add_sequence();
  }

  void remove_sequence(int64_t id) {
    std::unique_lock lock(mutex_);
    cache_.remove_sequence(id);
  }

  void compact() {
    run_without_gil([&] {
      std::unique_lock lock(mutex_);
      cache_.compact();
    });
  }

  int64_t length(int64_t id) {
    std::shared_lock lock(mutex_);
    return cache_.length(id);
  }

  int64_t free_pages() {
    std::shared_lock lock(mutex_);
    return cache_.free_pages();
  }

  void append(int64_t id, const py::object& k, const py::object& v, const py::object& k_scales,
              const py::object& v_scales, bool bf16) {
    // float64, what numpy makes by default, is rounded to float32 as every other float input is.
    const auto narrowed = [](const py::object& x) -> py::object {
      const py::array array = py::array::ensure(x);
      if (array && array.dtype().kind() == 'f' && array.itemsize() == 8) return array.attr("astype")("float32");
      return x;
    };
    // The cache checks the values itself, with no remedy to offer: append has no allow_nonfinite.
    Inputs in;
    const StoredView ks = in.stored(narrowed(k), "k", k_scales, "k_scales", bf16, true);
    const StoredView vs = in.stored(narrowed(v), "v", v_scales, "v_scales", bf16, true);
    check_bf16_flag(bf16, {&ks, &vs}, "k, v");
    run_without_gil([&] {
      std::unique_lock lock(mutex_);
      cache_.append(id, ks, vs);
    });
  }

  py::array_t<float> keys(int64_t id) { return read(id, true); }
  py::array_t<float> values(int64_t id) { return read(id, false); }

  py::object attend(int64_t id, const py::object& q, std::optional<double> scale, bool causal, const py::object& window,
                    std::optional<double> softcap, const py::object& sinks, const py::object& mask,
                    const py::object& alibi, bool return_lse, bool bf16) {
    Inputs in;
    Tensor<float> widened;
    const TensorView<const float> qf = query_of(in, q, bf16, widened);
    if (qf.rank() != 3) {
      throw ShapeError(
          fmt::format("q: expected [H, Tq, Dk] with Dk = {}, got shape {}", cache_.shape().dk, qf.shape.str()));
    }
    const int64_t heads = qf.shape[0], tq = qf.shape[1];
    ForwardRequest request;
    request.alibi = alibi;
    request.sinks = sinks;
    AttentionMask<float> m = in.mask<float>(mask, causal, false);
    std::optional<TensorView<const float>> sink_view;
    set_head_options<float>(in, request, heads, m, sink_view);
    const KvAttendOptions options{.scale = scale,
                                  .causal = causal,
                                  .window = window_of(window),
                                  .softcap = softcap,
                                  .sinks = sink_view,
                                  .allowed = m.allowed,
                                  .bias = m.bias,
                                  .alibi_slopes = m.alibi_slopes};
    py::array_t<float> out = new_array<float>(Shape{heads, tq, cache_.shape().dv}, "out");
    std::optional<py::array_t<float>> lse;
    AttentionOutputs<float> outputs{view_of(out), std::nullopt, std::nullopt};
    if (return_lse) {
      lse = new_array<float>(Shape{heads, tq}, "lse");
      outputs.lse = view_of(*lse);
    }
    run_without_gil([&] {
      std::shared_lock lock(mutex_);
      cache_.attend(id, qf, outputs, options);
    });
    if (lse) return py::make_tuple(out, *lse);
    return out;
  }

  py::dict shape() const {
    const KvCacheShape& s = cache_.shape();
    return py::dict("kv_heads"_a = s.kv_heads, "dk"_a = s.dk, "dv"_a = s.dv, "dtype"_a = storage_name(s.type),
                    "page_tokens"_a = s.page_tokens, "pages"_a = s.pages);
  }

 private:
  py::array_t<float> read(int64_t id, bool keys) {
    Tensor<float> values;
    run_without_gil([&] {
      std::shared_lock lock(mutex_);
      values = keys ? cache_.keys(id) : cache_.values(id);
    });
    return array_of(values, keys ? "keys" : "values");
  }

  KvCache cache_;
  std::shared_mutex mutex_;
};

constexpr const char* kQuantizeDoc =
    R"(x as int8 values and float32 scales, x ~ scales * values: attention()'s k or v with k_scales or v_scales.

x [..., T, D], a float array of rank 2 or more, finite. group: which elements share a scale:
    "channel": one per channel over the tokens, scales [..., 1, D] (for keys: an outlier channel
        then sets its own step alone);
    "token":   one per token over its channels, scales [..., T, 1] (for values);
    "tensor":  one for the whole array, scales [1, ..., 1].
values = round(x / scale) in [-127, 127] with scale = max |x| / 127 over the group (1 for a group of
zeros). Returns (values, scales).)";

constexpr const char* kKvCacheDoc = R"(A paged KV cache for autoregressive decoding (vLLM's layout).

KvCache(kv_heads, dk, dv, dtype="float16", page_tokens=256, pages=...) holds the keys and values of
any number of sequences in one pool of `pages` pages of `page_tokens` tokens each, stored as dtype
("float32", "float16", "bfloat16" or "int8", or "f32", "f16", "bf16", "i8"). A sequence grows a page
at a time without moving what it holds, and gives its pages back when removed.

    cache = qkv.KvCache(kv_heads=8, dk=64, dv=64, dtype="float16", pages=64)
    seq = cache.add_sequence()
    cache.append(seq, k, v)           # k [Hkv, n, Dk], v [Hkv, n, Dv]: the prompt, or one token
    out = cache.attend(seq, q)        # q [H, Tq, Dk], the last Tq tokens; out [H, Tq, Dv] float32

int8 keys have one scale per channel and page, values one per token; a key whose channel outgrows
its page's scale raises that scale and requantises the page's earlier keys of that channel.
save(path) and KvCache.load(path) keep a cache across runs, in the file qkv decode --cache-file reads.)";

}  // namespace

void add_stored(py::module_& m) {
  m.def("quantize_int8", &quantize_int8_py, kQuantizeDoc, "x"_a, "group"_a = "channel");
  m.def("to_bfloat16", &to_bfloat16_py, "x"_a,
        "x rounded to bfloat16 (nearest even), as its bits in a uint16 array: what attention(..., bf16=True) takes. "
        "ValueError (qkv.Error) for a value that is not finite or rounds past bfloat16's largest one.");
  m.def("from_bfloat16", &from_bfloat16_py, "bits"_a, "The float32 values of bfloat16 bits (a uint16 array).");

  py::class_<PyKvCache>(m, "KvCache", kKvCacheDoc)
      .def(py::init<int64_t, int64_t, int64_t, const std::string&, int64_t, int64_t>(), "kv_heads"_a, "dk"_a, "dv"_a,
           py::kw_only(), "dtype"_a = "float16", "page_tokens"_a = 256, "pages"_a)
      .def_static("load", &PyKvCache::load, "path"_a,
                  "The cache that save() (or qkv decode --cache-file) wrote to `path`: OSError (qkv.FileError) naming "
                  "the file when it is not one, is corrupt or does not make a cache.")
      .def("save", &PyKvCache::save, "path"_a,
           "Writes the whole cache (every sequence, its pages and the free ones) to `path`, all or nothing: a kv_cache "
           "model file, versioned and checksummed, its pools in the cache's own dtype (as many bytes as in memory).")
      .def("add_sequence", &PyKvCache::add_sequence, "A new, empty sequence: its id.")
      .def("remove_sequence", &PyKvCache::remove_sequence, "id"_a,
           "Gives the sequence's pages back to the pool; its id is not used again.")
      .def("compact", &PyKvCache::compact,
           "Moves the pages so that each sequence's lie in one run (in the order of their ids, the free pages "
           "after them): sequences appended in turn that grew into each other's way are read as one stream again. "
           "What each sequence holds, and its id, are unchanged.")
      .def("length", &PyKvCache::length, "id"_a, "The tokens the sequence holds.")
      .def_property_readonly("free_pages", &PyKvCache::free_pages, "Pages of the pool that no sequence holds.")
      .def_property_readonly("shape", &PyKvCache::shape, "kv_heads, dk, dv, dtype, page_tokens and pages, as a dict.")
      .def("append", &PyKvCache::append, "id"_a, "k"_a, "v"_a, py::kw_only(), "k_scales"_a = py::none(),
           "v_scales"_a = py::none(), "bf16"_a = false,
           "Appends n tokens to the sequence: k [Hkv, n, Dk] and v [Hkv, n, Dv], finite, stored in the cache's "
           "dtype. They may be float32, float64, float16, bfloat16 bits (uint16, with bf16=True) or int8 with "
           "k_scales / v_scales, as attention() takes them; an array of the cache's own dtype is copied as it is. "
           "Refused whole (MemoryError, nothing appended) when the pool has too few free pages.")
      .def("keys", &PyKvCache::keys, "id"_a, "The sequence's keys as attend() reads them: float32 [Hkv, length, Dk].")
      .def("values", &PyKvCache::values, "id"_a,
           "The sequence's values as attend() reads them: float32 [Hkv, length, Dv].")
      .def("attend", &PyKvCache::attend, "id"_a, "q"_a, py::kw_only(), "scale"_a = py::none(), "causal"_a = true,
           "window"_a = py::none(), "softcap"_a = py::none(), "sinks"_a = py::none(), "mask"_a = py::none(),
           "alibi"_a = py::none(), "return_lse"_a = false, "bf16"_a = false,
           "Attention of q [H, Tq, Dk] (H a multiple of Hkv), the sequence's last Tq tokens, over its keys and "
           "values: out [H, Tq, Dv] float32, and (out, lse [H, Tq]) with return_lse. causal: query i sees keys up "
           "to length - Tq + i; mask broadcasts to [H, Tq, length] (bool or integer: may attend; float32: a bias, "
           "-inf masks), e.g. [1, Tq, length] for a tree of draft tokens; scale, window, softcap, sinks and alibi "
           "as in attention(), ALiBi's distances counted from each query's position in the sequence. q may be "
           "float32, float64, float16 or bfloat16 bits (uint16, with bf16=True).");
}

}  // namespace qkv::python
