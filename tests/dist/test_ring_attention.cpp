// Ring attention (qkv/dist/ring_attention.hpp) under mpirun with P ranks (tests/CMakeLists.txt runs
// this program for P = 1 to 4): every rank draws the same whole problem, takes its shards, runs the
// ring and compares its shard of the results with the float64 reference of the whole problem.
// Checks never stop a test early (EXPECT, not ASSERT): a rank that left a test would leave the
// others waiting in the ring.

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/core/error.hpp"
#include "qkv/dist/ring_attention.hpp"
#include "testing.hpp"

namespace qkv::testing {
namespace {

using dist::ShardLayout;
using dist::TokenRange;

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// Rows `ranges` of a [B, H, T, D] (or [.., T, Tk]) tensor along its second to last axis.
template <class T>
Tensor<T> rows_of(const Tensor<T>& whole, const std::vector<TokenRange>& ranges) {
  const Shape& s = whole.shape();
  const int axis = s.rank() - 2;
  int64_t outer = 1;
  for (int a = 0; a < axis; ++a) outer *= s[a];
  const int64_t t = s[axis], inner = s[axis + 1];
  int64_t length = 0;
  for (const TokenRange& r : ranges) length += r.length;
  Shape shape = s;
  shape[axis] = length;
  Tensor<T> part(shape);
  T* dst = part.data();
  for (int64_t o = 0; o < outer; ++o)
    for (const TokenRange& r : ranges)
      for (int64_t i = r.start; i < r.start + r.length; ++i, dst += inner)
        std::memcpy(dst, whole.data() + (o * t + i) * inner, static_cast<size_t>(inner) * sizeof(T));
  return part;
}

// Rows of the lse [B, H, T].
Tensor<double> lse_rows(const Tensor<double>& lse, const std::vector<TokenRange>& ranges) {
  const Shape& s = lse.shape();
  Tensor<double> as_rows(Shape{s[0] * s[1], s[2], 1}, lse.values());
  Tensor<double> part = rows_of(as_rows, ranges);
  return Tensor<double>(Shape{s[0], s[1], part.shape()[1]}, part.values());
}

struct RingRun {
  Tensor<float> out, lse, dq, dk, dv, dsinks;
};

// This rank's inputs of the whole problem `p` and the ring's results on them.
struct RingInputs {
  const AttentionProblem* p;
  dist::RingShards shards;
  std::vector<TokenRange> q_ranges, k_ranges;
  Tensor<float> q, k, v, dout, alibi, sinks;
  std::optional<Tensor<uint8_t>> allowed;

  RingInputs(const AttentionProblem& problem, ShardLayout layout, const Tensor<double>& dout_whole)
      : p(&problem),
        shards{.tq = problem.q.shape()[2], .tk = problem.k.shape()[2], .layout = layout},
        q_ranges(dist::shard_ranges(shards.tq, world_size(), world_rank(), layout)),
        k_ranges(dist::shard_ranges(shards.tk, world_size(), world_rank(), layout)),
        q(cast<float>(rows_of(problem.q, q_ranges))),
        k(cast<float>(rows_of(problem.k, k_ranges))),
        v(cast<float>(rows_of(problem.v, k_ranges))),
        dout(cast<float>(rows_of(dout_whole, q_ranges))) {
    if (problem.alibi) alibi = cast<float>(*problem.alibi);
    if (problem.sinks) sinks = cast<float>(*problem.sinks);
    // A mask [.., Tq, Tk] is cut to this rank's query rows; a mask broadcast along Tq is kept.
    if (problem.allowed) {
      const Shape& s = problem.allowed->shape();
      allowed = s.rank() >= 2 && s[s.rank() - 2] == shards.tq ? rows_of(*problem.allowed, q_ranges) : *problem.allowed;
    }
  }

  AttentionParams<float> params() const {
    AttentionParams<float> a{.q = q.view(), .k = k.view(), .v = v.view(), .scale = p->scale, .mask = {}};
    a.mask.causal = p->causal;
    a.mask.alignment = p->alignment;
    a.mask.window = p->window;
    if (allowed) a.mask.allowed = allowed->view();
    if (p->alibi) a.mask.alibi_slopes = alibi.view();
    a.softcap = p->softcap;
    if (p->sinks) a.sinks = sinks.view();
    return a;
  }

  RingRun run() const {
    const AttentionParams<float> a = params();
    const Shape& qs = q.shape();
    RingRun r{Tensor<float>({qs[0], qs[1], qs[2], v.shape()[3]}),
              Tensor<float>({qs[0], qs[1], qs[2]}),
              Tensor<float>(q.shape()),
              Tensor<float>(k.shape()),
              Tensor<float>(v.shape()),
              p->sinks ? Tensor<float>(p->sinks->shape()) : Tensor<float>()};
    dist::ring_attention_forward(a, shards, {.out = r.out.view(), .weights = {}, .lse = r.lse.view()}, MPI_COMM_WORLD);
    AttentionGradients<float> g{.dq = r.dq.view(), .dk = r.dk.view(), .dv = r.dv.view(), .dbias = {}};
    if (p->sinks) g.dsinks = r.dsinks.view();
    dist::ring_attention_backward(a, shards, dout.view(), g, AttentionSaved<float>{r.out.cview(), r.lse.cview()},
                                  MPI_COMM_WORLD);
    return r;
  }
};

bool same_bits(const RingRun& a, const RingRun& b) {
  const auto same = [](const Tensor<float>& x, const Tensor<float>& y) {
    return x.shape() == y.shape() &&
           (x.numel() == 0 || std::memcmp(x.data(), y.data(), static_cast<size_t>(x.numel()) * sizeof(float)) == 0);
  };
  return same(a.out, b.out) && same(a.lse, b.lse) && same(a.dq, b.dq) && same(a.dk, b.dk) && same(a.dv, b.dv) &&
         same(a.dsinks, b.dsinks);
}

// Half an ulp of the largest |lse| any block can have, max |s| + log Tk: the error that rounding a
// block's lse to float32 puts on its weight in the merge.
double block_lse_rounding(const AttentionYardsticks& y, int64_t tk) {
  double top = 0;
  const Tensor<float>& s = y.naive.front().scores;
  for (int64_t i = 0; i < s.numel(); ++i) {
    if (std::isfinite(s[i])) top = std::max(top, std::abs(static_cast<double>(s[i])));
  }
  const auto f = static_cast<float>(top + std::log(static_cast<double>(std::max<int64_t>(tk, 1))));
  return 0.5 * static_cast<double>(std::nextafter(f, std::numeric_limits<float>::infinity()) - f);
}

// The ring on problem `p` against the float64 reference, on every SIMD target. The suite's rule
// (attention_tolerance) holds for one process; the ring adds, per query row, up to 2P blocks
// (zigzag) whose out and lse are rounded to float32 before they merge, each a relative error of
// ε/2 on the block's out and of its lse's rounding on its weight: (2P)(ε/2 + ρ_block) times the
// sums magnitude of out. The gradients add up to 2P float32 partials of dq (and P of dk, dv as
// they travel), each rounded once: 2P·ε times their terms magnitude. The backward reads the saved
// float32 lse, whose ρ the rule already counts.
void expect_ring_matches_reference(const AttentionProblem& p, ShardLayout layout, uint64_t seed,
                                   const std::string& label) {
  SCOPED_TRACE(label + (layout == ShardLayout::zigzag ? ", zigzag" : ", contiguous") +
               ", P = " + std::to_string(world_size()) + ", rank " + std::to_string(world_rank()));
  const Tensor<double> dout = random_dout(p, seed);
  const AttentionYardsticks y = attention_yardsticks(p, dout);
  const Forward want = reference_forward(p);
  const Grads gw = reference_backward(p, dout);
  const double rho = lse_rounding(want.lse);
  const double blocks = 2.0 * world_size(), eps = std::numeric_limits<float>::epsilon();
  const double rho_block = block_lse_rounding(y, p.k.shape()[2]);
  using R = NaiveResult;
  const auto forward_tol = [&](R which, const Tensor<double>& exact) {
    return attention_tolerance(y, which, exact) + blocks * (eps / 2 + rho_block) * max_abs(naive_result(y.sums, which));
  };
  const auto backward_tol = [&](R which, const Tensor<double>& exact) {
    return attention_tolerance(y, which, exact, rho) + blocks * eps * max_abs(naive_result(y.terms, which));
  };
  const RingInputs in(p, layout, dout);
  on_every_target([&] {
    const RingRun got = in.run();
    const Tensor<double> want_out = rows_of(want.out, in.q_ranges), want_lse = lse_rows(want.lse, in.q_ranges);
    EXPECT_TRUE(all_close("out", cast<double>(got.out), want_out, forward_tol(R::out, want.out)));
    EXPECT_TRUE(all_close("lse", cast<double>(got.lse), want_lse, forward_tol(R::lse, want.lse)));
    EXPECT_TRUE(all_close("dq", cast<double>(got.dq), rows_of(gw.dq, in.q_ranges), backward_tol(R::dq, gw.dq)));
    EXPECT_TRUE(all_close("dk", cast<double>(got.dk), rows_of(gw.dk, in.k_ranges), backward_tol(R::dk, gw.dk)));
    EXPECT_TRUE(all_close("dv", cast<double>(got.dv), rows_of(gw.dv, in.k_ranges), backward_tol(R::dv, gw.dv)));
    if (p.sinks) {
      EXPECT_TRUE(all_close("dsinks", cast<double>(got.dsinks), gw.dsinks, backward_tol(R::dsinks, gw.dsinks)));
    }
    EXPECT_TRUE(same_bits(got, in.run())) << "a second run differs";
    const WorkersScope one_thread(1);
    EXPECT_TRUE(same_bits(got, in.run())) << "one thread differs from " << max_workers();
  });
}

AttentionProblem grouped(AttentionProblem p, int64_t kv_heads, uint64_t seed) {
  Rng rng(seed);
  const Shape& k = p.k.shape();
  p.k = random_tensor<double>({k[0], kv_heads, k[2], k[3]}, rng);
  p.v = random_tensor<double>({k[0], kv_heads, k[2], p.v.shape()[3]}, rng);
  return p;
}

constexpr ShardLayout kLayouts[] = {ShardLayout::contiguous, ShardLayout::zigzag};

TEST(RingAttention, MatchesTheReferenceOnUnevenShardsCausalOrNot) {
  for (const bool causal : {false, true}) {
    const AttentionProblem p =
        grouped(random_problem({.b = 2, .h = 4, .tq = 37, .tk = 37, .dk = 7, .dv = 5, .causal = causal}, 11), 2, 12);
    for (const ShardLayout layout : kLayouts) expect_ring_matches_reference(p, layout, 13, causal ? "causal" : "full");
  }
}

TEST(RingAttention, MatchesTheReferenceWithFewerQueriesThanKeys) {
  for (const CausalAlignment alignment : {CausalAlignment::bottom_right, CausalAlignment::top_left}) {
    for (const bool causal : {false, true}) {
      AttentionProblem p =
          random_problem({.b = 1, .h = 2, .tq = 13, .tk = 29, .dk = 16, .dv = 9, .causal = causal}, 21);
      p.alignment = alignment;
      for (const ShardLayout layout : kLayouts) {
        expect_ring_matches_reference(p, layout, 22,
                                      std::string(causal ? "causal" : "full") +
                                          (alignment == CausalAlignment::top_left ? ", top-left" : ", bottom-right"));
      }
    }
  }
}

TEST(RingAttention, MatchesTheReferenceWithWindowAlibiSoftcapAndSinks) {
  AttentionProblem p = random_problem({.b = 1, .h = 3, .tq = 41, .tk = 41, .dk = 8, .dv = 8}, 31);
  p.window = AttentionWindow{.left = 6, .right = 2};
  p.softcap = 3.0;
  const std::vector<double> slopes = alibi_slopes(3);
  p.alibi = Tensor<double>(Shape{3}, slopes);
  p.sinks = Tensor<double>(Shape{3}, {0.5, -1.0, 2.0});
  for (const ShardLayout layout : kLayouts)
    expect_ring_matches_reference(p, layout, 32, "window, ALiBi, softcap, sinks");
}

// The ring's gradients are those of the ring's own forward: central differences of
// L = Σ dout · out (summed over every rank's shard) under a perturbation of one entry of Q, K, V or
// the sinks, made on the rank whose shard holds it. The forward runs in float32, so h is large; L's
// rounding (ε Σ|dout · out|) over 2h and the h² term left differences of at most 1.5e-5 when
// this test was written, ten times under its tolerance. On every SIMD target.
TEST(RingAttention, GradientsMatchFiniteDifferencesOfTheRingForward) {
  constexpr double kStep = 1e-2, kAbsolute = 1e-4, kRelative = 1e-4;
  AttentionProblem p =
      grouped(random_problem({.b = 1, .h = 2, .tq = 11, .tk = 11, .dk = 4, .dv = 3, .causal = true}, 51), 1, 52);
  p.sinks = Tensor<double>(Shape{2}, {0.3, -0.7});
  const Tensor<double> dout = random_dout(p, 53);
  for (const ShardLayout layout : kLayouts) {
    SCOPED_TRACE(std::string(layout == ShardLayout::zigzag ? "zigzag" : "contiguous") +
                 ", P = " + std::to_string(world_size()) + ", rank " + std::to_string(world_rank()));
    RingInputs in(p, layout, dout);
    on_every_target([&] {
      const RingRun g = in.run();
      const auto loss = [&] {
        const AttentionParams<float> a = in.params();
        const Shape& qs = in.q.shape();
        Tensor<float> out({qs[0], qs[1], qs[2], in.v.shape()[3]}), lse({qs[0], qs[1], qs[2]});
        dist::ring_attention_forward(a, in.shards, {.out = out.view(), .weights = {}, .lse = lse.view()},
                                     MPI_COMM_WORLD);
        double mine = 0, all = 0;
        for (int64_t i = 0; i < out.numel(); ++i) mine += static_cast<double>(out[i]) * static_cast<double>(in.dout[i]);
        MPI_Allreduce(&mine, &all, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        return all;
      };
      // Entry (h, t, c) of a [1, H, T, C] input whose rows this rank holds in `ranges`, or -1.
      const auto local_index = [](const Tensor<float>& x, const std::vector<TokenRange>& ranges, int64_t h, int64_t t,
                                  int64_t c) -> int64_t {
        int64_t row = 0;
        for (const TokenRange& r : ranges) {
          if (t >= r.start && t < r.start + r.length) return (h * x.shape()[2] + row + t - r.start) * x.shape()[3] + c;
          row += r.length;
        }
        return -1;
      };
      struct Input {
        const char* name;
        Tensor<float>* x;
        const Tensor<float>* grad;
        const std::vector<TokenRange>* ranges;
      };
      const Input inputs[] = {
          {"q", &in.q, &g.dq, &in.q_ranges}, {"k", &in.k, &g.dk, &in.k_ranges}, {"v", &in.v, &g.dv, &in.k_ranges}};
      for (const Input& input : inputs) {
        for (const auto& [h, t, c] : {std::tuple<int64_t, int64_t, int64_t>{0, 0, 0}, {0, 5, 1}, {0, 10, 2}}) {
          const int64_t head = std::min<int64_t>(h, input.x->shape()[1] - 1);
          const int64_t at = local_index(*input.x, *input.ranges, head, t, c);
          const auto nudge = [&](double by) {
            if (at >= 0) (*input.x)[at] = static_cast<float>(static_cast<double>((*input.x)[at]) + by);
          };
          const float original = at >= 0 ? (*input.x)[at] : 0.0f;
          nudge(kStep);
          const double up = loss();
          if (at >= 0) (*input.x)[at] = original;
          nudge(-kStep);
          const double down = loss();
          if (at >= 0) (*input.x)[at] = original;
          double mine = at >= 0 ? static_cast<double>((*input.grad)[at]) : 0.0, analytic = 0;
          MPI_Allreduce(&mine, &analytic, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
          const double numeric = (up - down) / (2 * kStep);
          EXPECT_NEAR(analytic, numeric, kAbsolute + kRelative * std::abs(numeric))
              << "d" << input.name << " at head " << head << ", token " << t << ", channel " << c;
        }
      }
      for (int64_t h = 0; h < 2; ++h) {
        const float original = in.sinks[h];
        in.sinks[h] = static_cast<float>(original + kStep);
        const double up = loss();
        in.sinks[h] = static_cast<float>(original - kStep);
        const double down = loss();
        in.sinks[h] = original;
        const double numeric = (up - down) / (2 * kStep);
        EXPECT_NEAR(static_cast<double>(g.dsinks[h]), numeric, kAbsolute + kRelative * std::abs(numeric))
            << "dsinks at head " << h;
      }
    });
  }
}

// A query that may see no key of the whole sequence: out 0 and zero gradients on whichever rank
// holds it, and no NaN anywhere.
TEST(RingAttention, MatchesTheReferenceWithAMaskAndAFullyMaskedRow) {
  constexpr int64_t kT = 30, kMasked = 17;
  AttentionProblem p = random_problem({.b = 1, .h = 2, .tq = kT, .tk = kT, .dk = 6, .dv = 4, .causal = true}, 41);
  Tensor<uint8_t> allowed = random_mask({kT, kT}, 0.6, 42);
  for (int64_t j = 0; j < kT; ++j) allowed.view()(kMasked, j) = 0;
  p.allowed = allowed;
  for (const ShardLayout layout : kLayouts) {
    expect_ring_matches_reference(p, layout, 43, "mask");
    const RingInputs in(p, layout, random_dout(p, 44));
    const RingRun got = in.run();
    int64_t row = 0;
    for (const TokenRange& r : in.q_ranges) {
      for (int64_t t = r.start; t < r.start + r.length; ++t, ++row) {
        if (t != kMasked) continue;
        for (int64_t h = 0; h < 2; ++h) {
          EXPECT_EQ(got.lse.view()(0, h, row), -std::numeric_limits<float>::infinity());
          for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(got.out.view()(0, h, row, d), 0.0f);
          for (int64_t d = 0; d < 6; ++d) EXPECT_EQ(got.dq.view()(0, h, row, d), 0.0f);
        }
      }
    }
    EXPECT_TRUE(all_finite(cast<double>(got.out)) && all_finite(cast<double>(got.dq)) &&
                all_finite(cast<double>(got.dk)) && all_finite(cast<double>(got.dv)));
  }
}

// Fewer tokens than ranks (or than zigzag's 2P chunks): some shards are empty.
TEST(RingAttention, MatchesTheReferenceWithEmptyShards) {
  for (const int64_t t : {1, 3}) {
    for (const bool causal : {false, true}) {
      const AttentionProblem p =
          random_problem({.b = 1, .h = 1, .tq = t, .tk = t, .dk = 1, .dv = 2, .causal = causal}, 51);
      for (const ShardLayout layout : kLayouts)
        expect_ring_matches_reference(p, layout, 52, "T = " + std::to_string(t));
    }
  }
}

TEST(RingAttention, ShardsCoverTheSequenceOnce) {
  for (const int ranks : {1, 2, 3, 4, 7}) {
    for (const int64_t tokens : {0, 1, 5, 37, 64}) {
      for (const ShardLayout layout : kLayouts) {
        std::vector<int> seen(static_cast<size_t>(tokens), 0);
        int64_t shortest = tokens, longest = 0;
        for (int rank = 0; rank < ranks; ++rank) {
          for (const TokenRange& r : dist::shard_ranges(tokens, ranks, rank, layout)) {
            for (int64_t t = r.start; t < r.start + r.length; ++t) ++seen[static_cast<size_t>(t)];
          }
          const int64_t n = dist::shard_length(tokens, ranks, rank, layout);
          shortest = std::min(shortest, n);
          longest = std::max(longest, n);
        }
        for (const int count : seen) EXPECT_EQ(count, 1);
        EXPECT_LE(longest - shortest, layout == ShardLayout::zigzag ? 2 : 1);
      }
    }
  }
  EXPECT_THROW(dist::shard_ranges(5, 2, 2, ShardLayout::contiguous), ValueError);
  EXPECT_THROW(dist::shard_ranges(5, 0, 0, ShardLayout::contiguous), ValueError);
}

// Runs `call` on every rank and expects every rank to throw E with `text` in its message.
template <class E, class F>
void expect_every_rank_throws(F&& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "no error, expected one with \"" << text << "\"";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(RingAttention, OneRanksBadArgumentStopsEveryRank) {
  const int last = world_size() - 1;
  const AttentionProblem p = random_problem({.b = 1, .h = 2, .tq = 12, .tk = 12, .dk = 4, .dv = 4}, 61);
  const RingInputs in(p, ShardLayout::contiguous, random_dout(p, 62));
  // The last rank holds one query too many.
  Tensor<float> q_long({1, 2, in.q.shape()[2] + 1, 4});
  AttentionParams<float> a = in.params();
  if (world_rank() == last) a.q = q_long.view();
  Tensor<float> out({1, 2, in.q.shape()[2], 4});
  expect_every_rank_throws<ShapeError>(
      [&] {
        dist::ring_attention_forward(a, in.shards, {.out = out.view(), .weights = {}, .lse = {}}, MPI_COMM_WORLD);
      },
      "rank " + std::to_string(last) + ": q: expected");
  // A bias is refused on every rank alike.
  Tensor<float> bias({12, 12});
  AttentionParams<float> with_bias = in.params();
  with_bias.mask.bias = bias.view();
  expect_every_rank_throws<ValueError>(
      [&] {
        dist::ring_attention_forward(with_bias, in.shards, {.out = out.view(), .weights = {}, .lse = {}},
                                     MPI_COMM_WORLD);
      },
      "rank 0: mask.bias");
  // The ranks disagree on causality.
  if (world_size() > 1) {
    AttentionParams<float> mixed = in.params();
    mixed.mask.causal = world_rank() == 1;
    expect_every_rank_throws<ValueError>(
        [&] {
          dist::ring_attention_forward(mixed, in.shards, {.out = out.view(), .weights = {}, .lse = {}}, MPI_COMM_WORLD);
        },
        "rank 1: mask.causal: expected 0, as on rank 0, got 1");
  }
}

// What the other ranks print: their failures alone, each with its rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    fmt::print(stderr, "rank {}: {}:{}: failure\n{}\n", world_rank(), result.file_name() ? result.file_name() : "?",
               result.line_number(), result.summary());
  }
};

}  // namespace
}  // namespace qkv::testing

// Every rank runs every test; the program fails on every rank when any test failed on any rank.
// Only rank 0 prints the test list; the others print their failures.
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (qkv::testing::world_rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new qkv::testing::FailurePrinter);
  }
  const int mine = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
