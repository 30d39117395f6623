// libFuzzer target: what attention_forward and attention_backward accept, on problems the fuzzer's
// bytes describe: the shapes of q, k, v and of every output and gradient (rank 0 to 4, dims 0 to
// 17, mostly consistent and sometimes not), mask and bias shapes that may or may not broadcast,
// packed-sequence offsets in any order, the window, scale, softcap, ALiBi slopes, sinks and dropout,
// including NaN, infinities and negative values. The problems are small, so every call takes
// microseconds. Refusals (qkv::Error) are expected. A bug is a crash, a sanitizer report, another
// exception, the reference and the fused kernel disagreeing on whether a problem is valid (the API
// validates once, for both), or a result with a NaN from inputs that hold none.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// The fuzzer's bytes, read front to back; zeros once they run out.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t next() { return at_ < size_ ? data_[at_++] : 0; }
  template <class T, size_t N>
  T pick(const T (&choices)[N]) {
    return choices[next() % N];
  }
  bool chance(int in_256) { return next() < in_256; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

constexpr int64_t kDims[] = {0, 1, 1, 2, 3, 4, 5, 7, 8, 16, 17};

qkv::Shape draw_shape(Bytes& bytes) {
  const int rank = bytes.next() % 5;
  std::vector<int64_t> dims;
  for (int d = 0; d < rank; ++d) dims.push_back(bytes.pick(kDims));
  return qkv::Shape(dims);
}

// `shape` as given, or (1 time in 8) with one dim changed or a dim added or removed.
qkv::Shape maybe_wrong(Bytes& bytes, const qkv::Shape& shape) {
  if (!bytes.chance(32)) return shape;
  std::vector<int64_t> dims(shape.dims().begin(), shape.dims().end());
  const uint8_t how = bytes.next() % 3;
  if (how == 0 && !dims.empty()) dims[bytes.next() % dims.size()] = bytes.pick(kDims);
  if (how == 1 && dims.size() < 4) dims.insert(dims.begin(), bytes.pick(kDims));
  if (how == 2 && !dims.empty()) dims.pop_back();
  return qkv::Shape(dims);
}

// A shape like `want`'s, with its last dim replaced (q's shape with v's last dim: out's).
qkv::Shape with_last(const qkv::Shape& want, int64_t last) {
  std::vector<int64_t> dims(want.dims().begin(), want.dims().end());
  if (!dims.empty()) dims.back() = last;
  return qkv::Shape(dims);
}

qkv::Shape without_last(const qkv::Shape& want) {
  std::vector<int64_t> dims(want.dims().begin(), want.dims().end());
  if (!dims.empty()) dims.pop_back();
  return qkv::Shape(dims);
}

int64_t last_dim(const qkv::Shape& s) { return s.rank() > 0 ? s.from_back(1) : 1; }

qkv::Tensor<float> values(Bytes& bytes, const qkv::Shape& shape, bool with_minus_inf = false) {
  qkv::Tensor<float> t(shape);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const auto byte = static_cast<int8_t>(bytes.next());
    t[i] = with_minus_inf && byte == -128 ? -std::numeric_limits<float>::infinity() : static_cast<float>(byte) / 16.0f;
  }
  return t;
}

bool all_finite(const qkv::Tensor<float>& t) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(t[i])) return false;
  }
  return true;
}

// One problem, its inputs owned here, and the outputs and gradients each call gets fresh.
struct Problem {
  qkv::Tensor<float> q, k, v, bias, alibi, sinks, dout;
  qkv::Tensor<uint8_t> allowed;
  qkv::Tensor<int64_t> cu_q, cu_k;
  qkv::Shape out_shape, lse_shape;
  qkv::AttentionParams<float> params;
  bool finite_inputs = true;
};

void draw(Bytes& bytes, Problem& p) {
  p.q = values(bytes, draw_shape(bytes));
  // k and v mostly follow q (same leading dims and Dk; a head count that divides q's), as a
  // caller's would; sometimes they are anything.
  const qkv::Shape k_shape = bytes.chance(200) ? maybe_wrong(bytes, p.q.shape()) : draw_shape(bytes);
  p.k = values(bytes, k_shape);
  p.v =
      values(bytes, bytes.chance(200) ? maybe_wrong(bytes, with_last(k_shape, bytes.pick(kDims))) : draw_shape(bytes));
  p.out_shape = maybe_wrong(bytes, with_last(p.q.shape(), last_dim(p.v.shape())));
  p.lse_shape = maybe_wrong(bytes, without_last(p.q.shape()));
  p.dout = values(bytes, p.out_shape);
  const double scales[] = {kNaN, 0.0, 1.0, 0.125, -1.0, 10.0, kInf, -kInf};
  if (bytes.chance(100)) p.params.scale = bytes.pick(scales);
  const double softcaps[] = {0.0, -1.0, 1.0, 30.0, kNaN, kInf};
  if (bytes.chance(40)) p.params.softcap = bytes.pick(softcaps);
  qkv::AttentionMask<float>& mask = p.params.mask;
  mask.causal = bytes.chance(100);
  mask.alignment = bytes.chance(128) ? qkv::CausalAlignment::top_left : qkv::CausalAlignment::bottom_right;
  const int64_t reach[] = {-2, -1, 0, 1, 3, 16};
  if (bytes.chance(50)) mask.window = qkv::AttentionWindow{.left = bytes.pick(reach), .right = bytes.pick(reach)};
  // Scores shape as q and k give it, when their ranks allow: the usual target of the masks.
  std::vector<int64_t> scores(p.q.shape().dims().begin(), p.q.shape().dims().end());
  if (!scores.empty() && p.k.shape().rank() >= 2) scores.back() = p.k.shape().from_back(2);
  if (bytes.chance(70)) {
    p.allowed = qkv::Tensor<uint8_t>(bytes.chance(200) ? maybe_wrong(bytes, qkv::Shape(scores)) : draw_shape(bytes));
    for (int64_t i = 0; i < p.allowed.numel(); ++i) p.allowed[i] = bytes.next() % 2;
    mask.allowed = p.allowed.cview();
  }
  if (bytes.chance(70)) {
    p.bias = values(bytes, bytes.chance(200) ? maybe_wrong(bytes, qkv::Shape(scores)) : draw_shape(bytes), true);
    mask.bias = p.bias.cview();
  }
  const int64_t heads = p.q.shape().rank() >= 3 ? p.q.shape().from_back(3) : 1;
  if (bytes.chance(40)) {
    p.alibi = values(bytes, maybe_wrong(bytes, qkv::Shape{heads}));
    mask.alibi_slopes = p.alibi.cview();
  }
  if (bytes.chance(40)) {
    p.sinks = values(bytes, maybe_wrong(bytes, qkv::Shape{heads}));
    p.params.sinks = p.sinks.cview();
  }
  if (bytes.chance(40)) {
    const auto offsets = [&](qkv::Tensor<int64_t>& t) {
      t = qkv::Tensor<int64_t>(qkv::Shape{1 + bytes.next() % 4});
      for (int64_t i = 0; i < t.numel(); ++i) t[i] = static_cast<int64_t>(bytes.next() % 20) - 1;
    };
    offsets(p.cu_q);
    mask.cu_seqlens_q = p.cu_q.cview();
    if (bytes.chance(220)) {
      offsets(p.cu_k);
      mask.cu_seqlens_k = p.cu_k.cview();
    }
  }
  const double rates[] = {0.0, 0.5, 0.9, 1.0, -0.1, kNaN};
  if (bytes.chance(40)) p.params.dropout = qkv::AttentionDropout{.p = bytes.pick(rates), .seed = bytes.next()};
  p.params.q = p.q.cview();
  p.params.k = p.k.cview();
  p.params.v = p.v.cview();
  p.finite_inputs = all_finite(p.q) && all_finite(p.k) && all_finite(p.v);
}

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "fuzz_attention_args: %s\n", what.c_str());
  std::abort();
}

struct Outcome {
  bool ran = false;
  std::string refusal;
};

Outcome forward(const Problem& p, qkv::AttentionImpl impl, qkv::Tensor<float>& out) {
  out = qkv::Tensor<float>(p.out_shape);
  qkv::Tensor<float> lse(p.lse_shape);
  try {
    qkv::attention_forward(p.params, qkv::AttentionOutputs<float>{.out = out.view(), .weights = {}, .lse = lse.view()},
                           impl);
  } catch (const qkv::Error& e) {
    return {false, e.what()};
  }
  return {true, ""};
}

Outcome backward(const Problem& p, qkv::AttentionImpl impl, std::vector<qkv::Tensor<float>>& grads) {
  grads.clear();
  grads.reserve(5);  // the views below point into these tensors
  for (const qkv::Shape& shape : {p.q.shape(), p.k.shape(), p.v.shape()}) grads.emplace_back(shape);
  qkv::AttentionGradients<float> g{.dq = grads[0].view(), .dk = grads[1].view(), .dv = grads[2].view(), .dbias = {}};
  if (p.params.mask.bias) {
    grads.emplace_back(p.bias.shape());
    g.dbias = grads.back().view();
  }
  if (p.params.sinks) {
    grads.emplace_back(p.sinks.shape());
    g.dsinks = grads.back().view();
  }
  try {
    qkv::attention_backward<float>(p.params, p.dout.cview(), g, std::nullopt, impl);
  } catch (const qkv::Error& e) {
    return {false, e.what()};
  }
  return {true, ""};
}

void compare(const char* pass, const Outcome& reference, const Outcome& fused) {
  if (reference.ran != fused.ran) {
    bug(std::string(pass) + ": the reference " + (reference.ran ? "ran" : "refused (" + reference.refusal + ")") +
        " and the fused kernel " + (fused.ran ? "ran" : "refused (" + fused.refusal + ")"));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes bytes(data, size);
  Problem p;
  draw(bytes, p);
  qkv::Tensor<float> out_reference, out_fused;
  const Outcome reference = forward(p, qkv::AttentionImpl::reference, out_reference);
  const Outcome fused = forward(p, qkv::AttentionImpl::fused, out_fused);
  compare("forward", reference, fused);
  if (reference.ran && p.finite_inputs && !(all_finite(out_reference) && all_finite(out_fused)))
    bug("forward: a non-finite output from finite inputs");
  std::vector<qkv::Tensor<float>> grads_reference, grads_fused;
  const Outcome reference_back = backward(p, qkv::AttentionImpl::reference, grads_reference);
  const Outcome fused_back = backward(p, qkv::AttentionImpl::fused, grads_fused);
  compare("backward", reference_back, fused_back);
  if (reference_back.ran && p.finite_inputs && all_finite(p.dout)) {
    for (const auto* grads : {&grads_reference, &grads_fused}) {
      for (const qkv::Tensor<float>& g : *grads) {
        if (!all_finite(g)) bug("backward: a non-finite gradient from finite inputs");
      }
    }
  }
  return 0;
}
