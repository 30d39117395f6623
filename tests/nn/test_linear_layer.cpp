#include "qkv/nn/linear.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/ops/linear.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::numeric_gradient;
using testing::random_tensor;
using testing::throws_naming;

constexpr double kStep = 1e-6;

Shape with_last(Shape shape, int64_t last) {
  shape[shape.rank() - 1] = last;
  return shape;
}

template <class T>
Tensor<T> copy_of(TensorView<const T> view) {
  return to_tensor<T, T>(view);
}

// The layer's parameters by name, copied.
template <class T>
Tensor<T> parameter(const Linear<T>& layer, const std::string& name) {
  for (const ParameterRef<const T>& p : layer.parameters()) {
    if (p.name == name) return copy_of(p.value);
  }
  ADD_FAILURE() << "no parameter named " << name;
  return {};
}

template <class T>
ParameterRef<T> parameter_ref(Linear<T>& layer, const std::string& name) {
  for (ParameterRef<T>& p : layer.parameters()) {
    if (p.name == name) return p;
  }
  ADD_FAILURE() << "no parameter named " << name;
  return {};
}

struct Case {
  int64_t in = 0, out = 0;
  Shape x;
};

// Small and large layers (the op runs its blocked kernels from 2^10 weights), every rank, and the
// edges: one row, one input feature, one output.
std::vector<Case> cases() {
  return {{5, 3, Shape{4, 5}},       {5, 3, Shape{2, 3, 5}}, {5, 3, Shape{2, 2, 3, 5}}, {48, 40, Shape{7, 48}},
          {48, 40, Shape{2, 5, 48}}, {1, 1, Shape{1, 1}},    {1, 1, Shape{1, 1, 1}},    {7, 1, Shape{1, 7}},
          {1, 7, Shape{1, 1, 1, 1}}, {1, 7, Shape{3, 1}},    {7, 1, Shape{2, 1, 7}},    {6, 4, Shape{0, 6}}};
}

std::string describe(const Case& c, bool bias) {
  return fmt::format("In {}, Out {}, x {}, bias {}", c.in, c.out, c.x.str(), bias);
}

// The draws of linear_init, in its order: a layer built from an Rng holds what linear_init draws
// from an Rng of the same seed into tensors of the same shapes, and leaves the Rng in the same state.
TEST(LinearLayer, DrawsAsLinearInit) {
  for (const bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "with bias" : "without bias");
    Rng layer_rng(11), op_rng(11);
    const Linear<float> layer({.in_features = 6, .out_features = 4, .bias = bias}, layer_rng);
    Tensor<float> w(Shape{4, 6}), b(Shape{4});
    linear_init<float>(w.view(), bias ? std::optional(b.view()) : std::nullopt, op_rng);
    EXPECT_TRUE(all_close("weight", parameter(layer, "weight"), w, 0.0));
    if (bias) {
      EXPECT_TRUE(all_close("bias", parameter(layer, "bias"), b, 0.0));
    }
    EXPECT_EQ(layer_rng.next_u64(), op_rng.next_u64());
  }
}

TEST(LinearLayer, NamesItsParameters) {
  Rng rng(1);
  Linear<double> plain({.in_features = 3, .out_features = 2}, rng);
  std::vector<std::string> names;
  for (const ParameterRef<double>& p : plain.parameters()) {
    names.push_back(p.name);
    EXPECT_EQ(p.grad.shape, p.value.shape) << p.name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(plain.parameters()[0].value.shape, (Shape{2, 3}));
  EXPECT_EQ(plain.parameters()[1].value.shape, (Shape{2}));

  const Linear<double> named({.in_features = 3, .out_features = 2, .weight_name = "ffn.w1", .bias_name = "ffn.b1"},
                             rng);
  names.clear();
  for (const ParameterRef<const double>& p : named.parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"ffn.w1", "ffn.b1"}));

  const Linear<double> no_bias({.in_features = 3, .out_features = 2, .bias = false, .weight_name = "w_k"}, rng);
  ASSERT_EQ(no_bias.parameters().size(), 1u);
  EXPECT_EQ(no_bias.parameters()[0].name, "w_k");

  EXPECT_TRUE(Linear<double>().parameters().empty());
}

// The layer runs the op on its own parameters: equal to the bit, in both precisions, for every
// rank and size (the blocked kernels included), through both forwards.
template <class T>
void check_forward_equals_the_op() {
  Rng rng(2);
  for (const Case& c : cases()) {
    for (const bool bias : {true, false}) {
      SCOPED_TRACE(describe(c, bias));
      const Linear<T> layer({.in_features = c.in, .out_features = c.out, .bias = bias}, rng);
      const Tensor<T> x = random_tensor<T>(c.x, rng);
      const Tensor<T> w = parameter(layer, "weight");
      const std::optional<Tensor<T>> b = bias ? std::optional(parameter(layer, "bias")) : std::nullopt;
      Tensor<T> expected(with_last(c.x, c.out));
      linear_forward<T>({.x = x.cview(), .w = w.cview(), .b = b ? std::optional(b->cview()) : std::nullopt},
                        expected.view());
      EXPECT_TRUE(all_close("y", layer.forward(x.cview()), expected, 0.0));
      Tensor<T> into(with_last(c.x, c.out), T{7});
      layer.forward(x.cview(), into.view());
      EXPECT_TRUE(all_close("y (into a view)", into, expected, 0.0));
    }
  }
}

TEST(LinearLayer, ForwardEqualsTheOpFloat) { check_forward_equals_the_op<float>(); }
TEST(LinearLayer, ForwardEqualsTheOpDouble) { check_forward_equals_the_op<double>(); }

// L = <dy, y> is linear in x, W and b, so central differences are exact up to the rounding of the
// two evaluations over 2h: a few ε·Σ|terms| / h, far below 1e-7 at these sizes.
TEST(LinearLayer, GradientsMatchFiniteDifferences) {
  Rng rng(3);
  for (const Case& c : cases()) {
    if (c.in * c.out > 64) continue;  // every element is perturbed: the small layers suffice
    for (const bool bias : {true, false}) {
      SCOPED_TRACE(describe(c, bias));
      Linear<double> layer({.in_features = c.in, .out_features = c.out, .bias = bias}, rng);
      Tensor<double> x = random_tensor<double>(c.x, rng);
      const Tensor<double> dy = random_tensor<double>(with_last(c.x, c.out), rng);
      const auto loss = [&] { return testing::dot(layer.forward(x.cview()), dy); };
      Tensor<double> dx(c.x);
      layer.backward(x.cview(), dy.cview(), dx.view());
      EXPECT_TRUE(all_close("dx", dx, numeric_gradient(loss, x, kStep), 1e-7));
      for (const char* name : {"weight", "bias"}) {
        if (!bias && std::string(name) == "bias") continue;
        const ParameterRef<double> p = parameter_ref(layer, name);
        const Tensor<double> analytic = copy_of<double>(p.grad);
        EXPECT_TRUE(all_close(fmt::format("d{}", name), analytic, numeric_gradient(loss, p.value, kStep), 1e-7));
      }
    }
  }
}

// The backward adds into dx and into the parameter gradients; zero_grad clears the latter. Without
// dx only the parameters' gradients are computed.
TEST(LinearLayer, BackwardAccumulates) {
  Rng rng(4);
  Linear<double> layer({.in_features = 5, .out_features = 3}, rng);
  const Tensor<double> x = random_tensor<double>(Shape{2, 4, 5}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{2, 4, 3}, rng);
  Tensor<double> once(x.shape());
  layer.backward(x.cview(), dy.cview(), once.view());
  const Tensor<double> dw = copy_of<double>(parameter_ref(layer, "weight").grad);
  const Tensor<double> db = copy_of<double>(parameter_ref(layer, "bias").grad);

  Tensor<double> dx = once;
  layer.backward(x.cview(), dy.cview(), dx.view());
  Tensor<double> twice_dx = once, twice_dw = dw, twice_db = db;
  for (double& v : twice_dx.values()) v *= 2.0;
  for (double& v : twice_dw.values()) v *= 2.0;
  for (double& v : twice_db.values()) v *= 2.0;
  EXPECT_TRUE(all_close("dx", dx, twice_dx, 0.0));
  EXPECT_TRUE(all_close("dweight", copy_of<double>(parameter_ref(layer, "weight").grad), twice_dw, 0.0));
  EXPECT_TRUE(all_close("dbias", copy_of<double>(parameter_ref(layer, "bias").grad), twice_db, 0.0));

  layer.zero_grad();
  EXPECT_TRUE(
      all_close("dweight", copy_of<double>(parameter_ref(layer, "weight").grad), Tensor<double>(dw.shape()), 0.0));
  EXPECT_TRUE(all_close("dbias", copy_of<double>(parameter_ref(layer, "bias").grad), Tensor<double>(db.shape()), 0.0));
  layer.backward(x.cview(), dy.cview(), std::nullopt);
  EXPECT_TRUE(all_close("dweight without dx", copy_of<double>(parameter_ref(layer, "weight").grad), dw, 0.0));
  EXPECT_TRUE(all_close("dbias without dx", copy_of<double>(parameter_ref(layer, "bias").grad), db, 0.0));
}

TEST(LinearLayer, RefusesBadConfigsAndShapes) {
  Rng rng(5);
  EXPECT_TRUE(throws_naming<ValueError>([&] { const Linear<float> bad({.in_features = 0, .out_features = 3}, rng); },
                                        {"in_features", "at least 1", "got 0"}));
  EXPECT_TRUE(throws_naming<ValueError>([&] { const Linear<float> bad({.in_features = 3, .out_features = -1}, rng); },
                                        {"out_features", "at least 1", "got -1"}));

  Linear<float> layer({.in_features = 4, .out_features = 3}, rng);
  const Tensor<float> wide(Shape{2, 5}), flat(Shape{4}), deep(Shape{1, 1, 2, 5});
  for (const Tensor<float>* x : {&wide, &flat, &deep}) {
    SCOPED_TRACE(x->shape().str());
    EXPECT_TRUE(throws_naming<ShapeError>([&] { layer.forward(x->cview()); }, {"x", "last dim 4", x->shape().str()}));
    Tensor<float> y(Shape{2, 3});
    EXPECT_TRUE(throws_naming<ShapeError>([&] { layer.forward(x->cview(), y.view()); }, {"x", x->shape().str()}));
    EXPECT_TRUE(throws_naming<ShapeError>([&] { layer.backward(x->cview(), y.cview(), std::nullopt); },
                                          {"x", x->shape().str()}));
  }
  const Tensor<float> x(Shape{2, 4});
  Tensor<float> y(Shape{2, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { layer.forward(x.cview(), y.view()); }, {"y", "[2, 3]", "[2, 4]"}));
  const Tensor<float> dy(Shape{3, 3});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { layer.backward(x.cview(), dy.cview(), std::nullopt); },
                                        {"dy", "[2, 3]", "[3, 3]"}));
  const Tensor<float> good_dy(Shape{2, 3});
  Tensor<float> dx(Shape{2, 3});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { layer.backward(x.cview(), good_dy.cview(), dx.view()); },
                                        {"dx", "[2, 4]", "[2, 3]"}));
}

}  // namespace
}  // namespace qkv
