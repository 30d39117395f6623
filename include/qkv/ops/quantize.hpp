#pragma once
// Arrays to the narrower storage types of qkv/core/storage.hpp: float16 and bfloat16 by rounding to
// nearest even, int8 by symmetric scales over groups of elements. to_float32 (core) goes back.

#include <cstdint>
#include <string_view>

#include "qkv/core/storage.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv {

// Which elements of a [..., T, D] array share an int8 scale.
enum class QuantizeGroup {
  per_channel,  // one scale per channel over the tokens, scales [..., 1, D]: for keys, whose outlier
                // channels would otherwise set the step of every channel
  per_token,    // one scale per token over its channels, scales [..., T, 1]: for values
  per_tensor,   // one scale for the whole array, scales [1, ..., 1] of the array's rank
};

struct Int8Array {
  Tensor<int8_t> values;
  Tensor<float> scales;

  StoredView stored() const { return StoredView::int8(values.cview(), scales.cview()); }
};

// x ≈ scale·q with q = round(x / scale) in [−127, 127] and scale = max |x| / 127 over each group
// (1 for a group of zeros, which then stores zeros). x must be finite and of rank 2 or more.
Int8Array quantize_int8(TensorView<const float> x, QuantizeGroup group);

// Bits of x rounded to float16 (bfloat16), contiguous. x must be finite and every value must round
// to a finite one (|x| < rounding_overflow_limit): ValueError naming `name` and the first that does
// not, as numpy's astype would store an infinity there.
Tensor<uint16_t> to_float16(TensorView<const float> x, std::string_view name = "x");
Tensor<uint16_t> to_bfloat16(TensorView<const float> x, std::string_view name = "x");

}  // namespace qkv
