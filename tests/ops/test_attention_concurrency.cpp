// Calls into the attention API from several threads at once, as the Python bindings make them (they
// release the GIL): every call gives bit for bit what the same call gives alone. Each caller's
// parallel_for runs its own OpenMP team and its own scratch, and nothing the kernels keep between
// calls (the SIMD target chosen, cpu_info) may be written by one call while another reads it.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/ops/attention.hpp"
#include "support/attention_problems.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::AttentionProblem;
using testing::bit_identical;
using testing::Forward;
using testing::Grads;
using testing::random_tensor;

struct Results {
  Forward forward;
  Grads grads;
};

// The kernels' distinct paths: tiles split among threads, grouped heads with the variants, the
// split-K decode, packed sequences with dropout, and the reference.
struct Problem {
  std::string name;
  AttentionProblem p;
  AttentionImpl impl = AttentionImpl::fused;
};

std::vector<Problem> problems() {
  Rng rng(2026);
  std::vector<Problem> all;
  {
    AttentionProblem p;
    p.q = random_tensor<double>({2, 3, 200, 64}, rng);
    p.k = random_tensor<double>({2, 3, 230, 64}, rng);
    p.v = random_tensor<double>({2, 3, 230, 48}, rng);
    p.causal = true;
    all.push_back({"causal tiles", p});
  }
  {
    AttentionProblem p;
    p.q = random_tensor<double>({1, 4, 130, 16}, rng);
    p.k = random_tensor<double>({1, 2, 129, 16}, rng);
    p.v = random_tensor<double>({1, 2, 129, 16}, rng);
    p.window = AttentionWindow{.left = 40, .right = 3};
    p.softcap = 5.0;
    p.sinks = random_tensor<double>({4}, rng);
    p.bias = random_tensor<double>({1, 4, 130, 129}, rng);
    all.push_back({"gqa window softcap sinks bias", p});
  }
  {
    AttentionProblem p;
    p.q = random_tensor<double>({1, 8, 1, 64}, rng);
    p.k = random_tensor<double>({1, 2, 3000, 64}, rng);
    p.v = random_tensor<double>({1, 2, 3000, 64}, rng);
    all.push_back({"decode", p});
  }
  {
    AttentionProblem p;
    p.q = random_tensor<double>({1, 2, 150, 32}, rng);
    p.k = random_tensor<double>({1, 2, 170, 32}, rng);
    p.v = random_tensor<double>({1, 2, 170, 32}, rng);
    Tensor<int64_t> cu_q({4}), cu_k({4});
    const int64_t q_cuts[] = {0, 40, 41, 150}, k_cuts[] = {0, 60, 60, 170};
    for (int64_t n = 0; n < 4; ++n) {
      cu_q[n] = q_cuts[n];
      cu_k[n] = k_cuts[n];
    }
    p.cu_seqlens_q = cu_q;
    p.cu_seqlens_k = cu_k;
    p.causal = true;
    p.dropout = AttentionDropout{.p = 0.2, .seed = 17};
    all.push_back({"packed dropout", p});
  }
  {
    AttentionProblem p;
    p.q = random_tensor<double>({1, 2, 60, 8}, rng);
    p.k = random_tensor<double>({1, 2, 70, 8}, rng);
    p.v = random_tensor<double>({1, 2, 70, 8}, rng);
    p.allowed = testing::random_mask({1, 2, 60, 70}, 0.7, 5);
    all.push_back({"reference with a mask", p, AttentionImpl::reference});
  }
  return all;
}

Results run(const Problem& problem, const Tensor<double>& dout) {
  return {testing::run_forward<float>(problem.p, problem.impl),
          testing::run_backward<float>(problem.p, dout, problem.impl)};
}

bool same(const Results& a, const Results& b) {
  return bit_identical(a.forward.out, b.forward.out) && bit_identical(a.forward.lse, b.forward.lse) &&
         bit_identical(a.grads.dq, b.grads.dq) && bit_identical(a.grads.dk, b.grads.dk) &&
         bit_identical(a.grads.dv, b.grads.dv) && bit_identical(a.grads.dbias, b.grads.dbias) &&
         bit_identical(a.grads.dsinks, b.grads.dsinks);
}

TEST(AttentionConcurrency, CallsFromFourThreadsAtOnceMatchSerialCallsBitForBit) {
  const std::vector<Problem> all = problems();
  std::vector<Tensor<double>> douts;
  std::vector<Results> alone;
  for (size_t i = 0; i < all.size(); ++i) {
    douts.push_back(testing::random_dout(all[i].p, 100 + i));
    alone.push_back(run(all[i], douts[i]));
  }
  constexpr int kCallers = 4, kRounds = 3;
  // mismatches[c]: the problems caller c got a different result for, one entry per call.
  std::vector<std::vector<std::string>> mismatches(kCallers);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      // Half the callers on one thread: the thread count is each caller's own and changes nothing.
      if (c % 2 == 1) set_max_workers(1);
      for (int round = 0; round < kRounds; ++round) {
        for (size_t n = 0; n < all.size(); ++n) {
          const size_t i = (n + static_cast<size_t>(c)) % all.size();  // callers start on different problems
          if (!same(run(all[i], douts[i]), alone[i])) mismatches[static_cast<size_t>(c)].push_back(all[i].name);
        }
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  for (int c = 0; c < kCallers; ++c) {
    EXPECT_TRUE(mismatches[static_cast<size_t>(c)].empty())
        << "caller " << c
        << " differed from the serial result on: " << ::testing::PrintToString(mismatches[static_cast<size_t>(c)]);
  }
}

}  // namespace
}  // namespace qkv
