#include "qkv/ops/residual.hpp"

#include <fmt/format.h>

#include "qkv/core/error.hpp"

namespace qkv {
namespace {

template <class T>
void check_rank(TensorView<T> view, std::string_view name) {
  if (view.rank() < 1) throw ShapeError(fmt::format("{}: expected rank 1 to 4, got a scalar", name));
}

// Calls fn(a, b, c, d) for every index of a view padded to [A, B, C, D], in row-major order.
template <class Fn>
void for_each_index(const Shape& shape4, Fn fn) {
  for (int64_t a = 0; a < shape4[0]; ++a)
    for (int64_t b = 0; b < shape4[1]; ++b)
      for (int64_t c = 0; c < shape4[2]; ++c)
        for (int64_t d = 0; d < shape4[3]; ++d) fn(a, b, c, d);
}

}  // namespace

template <class T>
void residual_forward(TensorView<const T> a, TensorView<const T> b, TensorView<T> y) {
  check_rank(a, "a");
  check_shape("b", b.shape, a.shape);
  check_shape("y", y.shape, a.shape);
  const TensorView<const T> a4 = as_rank4(a);
  const TensorView<const T> b4 = as_rank4(b);
  const TensorView<T> y4 = as_rank4(y);
  // Each element is read before it is written, so y may alias a or b element for element.
  for_each_index(a4.shape,
                 [&](int64_t i, int64_t j, int64_t k, int64_t l) { y4(i, j, k, l) = a4(i, j, k, l) + b4(i, j, k, l); });
}

template <class T>
void residual_backward(TensorView<const T> dy, const ResidualGradients<T>& grads) {
  check_rank(dy, "dy");
  if (grads.da) check_shape("da", grads.da->shape, dy.shape);
  if (grads.db) check_shape("db", grads.db->shape, dy.shape);
  const TensorView<const T> dy4 = as_rank4(dy);
  for (const std::optional<TensorView<T>>& grad : {grads.da, grads.db}) {
    if (!grad) continue;
    const TensorView<T> g4 = as_rank4(*grad);
    for_each_index(dy4.shape, [&](int64_t i, int64_t j, int64_t k, int64_t l) { g4(i, j, k, l) += dy4(i, j, k, l); });
  }
}

#define QKV_INSTANTIATE_RESIDUAL(T)                                                        \
  template void residual_forward(TensorView<const T>, TensorView<const T>, TensorView<T>); \
  template void residual_backward(TensorView<const T>, const ResidualGradients<T>&);

QKV_INSTANTIATE_RESIDUAL(float)
QKV_INSTANTIATE_RESIDUAL(double)
#undef QKV_INSTANTIATE_RESIDUAL

}  // namespace qkv
