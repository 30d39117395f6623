#include "qkv/core/rng.hpp"

#include <cmath>
#include <numbers>

namespace qkv {
namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

template <class T, class Draw>
void fill_each(TensorView<T> out, Draw draw) {
  const int64_t n = out.numel();
  if (n == 0) return;
  Shape counter = out.shape;
  std::array<int64_t, kMaxRank> index{};
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t offset = 0;
    for (int a = 0; a < out.rank(); ++a) offset += index[static_cast<size_t>(a)] * out.strides[static_cast<size_t>(a)];
    out.data[offset] = static_cast<T>(draw());
    for (int a = out.rank() - 1; a >= 0; --a) {
      if (++index[static_cast<size_t>(a)] < counter[a]) break;
      index[static_cast<size_t>(a)] = 0;
    }
  }
}

}  // namespace

Rng::Rng(uint64_t seed) {
  for (uint64_t& word : state_) word = splitmix64(seed);
}

uint64_t Rng::next_u64() {
  const uint64_t result = rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

double Rng::uniform(double low, double high) { return low + (high - low) * uniform(); }

double Rng::normal() {
  if (has_spare_normal_) {
    has_spare_normal_ = false;
    return spare_normal_;
  }
  // 1 - uniform() lies in (0, 1], so the logarithm is finite.
  const double radius = std::sqrt(-2.0 * std::log(1.0 - uniform()));
  const double angle = 2.0 * std::numbers::pi * uniform();
  spare_normal_ = radius * std::sin(angle);
  has_spare_normal_ = true;
  return radius * std::cos(angle);
}

template <class T>
void Rng::fill_uniform(TensorView<T> out, double low, double high) {
  fill_each(out, [&] { return uniform(low, high); });
}

template <class T>
void Rng::fill_normal(TensorView<T> out, double mean, double stddev) {
  fill_each(out, [&] { return mean + stddev * normal(); });
}

template void Rng::fill_uniform(TensorView<float>, double, double);
template void Rng::fill_uniform(TensorView<double>, double, double);
template void Rng::fill_normal(TensorView<float>, double, double);
template void Rng::fill_normal(TensorView<double>, double, double);

}  // namespace qkv
