// Self-attention over four tokens with the installed qkv: prints α and checks its rows sum to 1.

#include <qkv/core/rng.hpp>
#include <qkv/ops/attention.hpp>

#include <cmath>
#include <cstdio>

int main() {
  const int64_t tokens = 4, dim = 8;
  qkv::Rng rng(0);
  qkv::Tensor<float> x({tokens, dim});
  rng.fill_normal(x.view());
  qkv::Tensor<float> out({tokens, dim}), alpha({tokens, tokens});

  qkv::attention_forward<float>({.q = x.view(), .k = x.view(), .v = x.view(), .scale = {}, .mask = {}},
                                {.out = out.view(), .weights = alpha.view(), .lse = {}});

  for (int64_t i = 0; i < tokens; ++i) {
    float row_sum = 0;
    for (int64_t j = 0; j < tokens; ++j) {
      std::printf("%.3f ", alpha.view()(i, j));
      row_sum += alpha.view()(i, j);
    }
    std::printf("| sum %.3f\n", row_sum);
    if (std::abs(row_sum - 1.0f) > 1e-5f) return 1;
  }
  return 0;
}
