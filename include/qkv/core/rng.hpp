#pragma once
// A small seedable random number generator whose stream is the same on every platform and
// compiler (the standard library's distributions are not), so a seed reproduces results exactly.
// Engine: xoshiro256** seeded through splitmix64. Normals: Box-Muller on two uniforms. And a
// counter-based generator, Philox, for draws that must be found from their coordinates alone.

#include <array>
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

// Philox 4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC
// 2011): four 32-bit words that are a fixed function of a 128-bit counter and a 64-bit key. Any
// draw is computed from its counter alone, in any order, on any thread, in any implementation:
// what dropout needs to replay a mask in the backward without storing it.
inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key) {
  constexpr uint32_t kMul0 = 0xD2511F53U, kMul1 = 0xCD9E8D57U;    // the multipliers of the paper
  constexpr uint32_t kWeyl0 = 0x9E3779B9U, kWeyl1 = 0xBB67AE85U;  // the key schedule's increments
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * counter[0];
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * counter[2];
    counter = {static_cast<uint32_t>(p1 >> 32) ^ counter[1] ^ key[0], static_cast<uint32_t>(p1),
               static_cast<uint32_t>(p0 >> 32) ^ counter[3] ^ key[1], static_cast<uint32_t>(p0)};
    key = {key[0] + kWeyl0, key[1] + kWeyl1};
  }
  return counter;
}

// The dropout of attention weight (b, h, i, j): four consecutive keys share one Philox draw,
// counter (j / 4, i, h, b) and key `seed`, and key j takes word j % 4; the weight is dropped when
// that word is below `threshold` = p·2³². So the mask depends on nothing but these coordinates.
struct DropoutDraw {
  uint64_t seed = 0;
  uint32_t threshold = 0;

  std::array<uint32_t, 4> words(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return philox4x32(
        {static_cast<uint32_t>(j >> 2), static_cast<uint32_t>(i), static_cast<uint32_t>(h), static_cast<uint32_t>(b)},
        {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  }
  bool keeps(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return words(b, h, i, j)[static_cast<size_t>(j & 3)] >= threshold;
  }
};

// The threshold of dropout probability p in [0, 1): p·2³² rounded to the nearest.
inline uint32_t dropout_threshold(double p) {
  const double scaled = p * 4294967296.0 + 0.5;
  return scaled >= 4294967295.0 ? 0xFFFFFFFFU : static_cast<uint32_t>(scaled);
}

}  // namespace qkv
