#pragma once
// A small seedable random number generator whose stream is the same on every platform and
// compiler (the standard library's distributions are not), so a seed reproduces results exactly.
// Engine: xoshiro256** seeded through splitmix64. Normals: Box-Muller on two uniforms.

#include <cstdint>

#include "qkv/core/tensor.hpp"

namespace qkv {

class Rng {
 public:
  explicit Rng(uint64_t seed);

  uint64_t next_u64();
  // Uniform in [0, 1) with 53 random bits.
  double uniform();
  // Uniform in [low, high).
  double uniform(double low, double high);
  // Standard normal.
  double normal();

  // Fills every element of `out` with independent draws.
  template <class T>
  void fill_uniform(TensorView<T> out, double low, double high);
  template <class T>
  void fill_normal(TensorView<T> out, double mean = 0.0, double stddev = 1.0);

 private:
  uint64_t state_[4];
  double spare_normal_ = 0.0;
  bool has_spare_normal_ = false;
};

}  // namespace qkv
