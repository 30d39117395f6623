// `qkv attend --distributed ring` and `attend-backward --distributed ring` (attend_distributed.hpp).
// Built with MPI only (apps/CMakeLists.txt); without it ring_available() is false and attend.cpp
// refuses --distributed.

#include "attend_distributed.hpp"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cli_io.hpp"
#include "qkv/core/error.hpp"
#include "qkv/dist/ring_attention.hpp"

namespace qkv::cli {

bool ring_available() { return true; }

namespace {

using dist::all_or_none;
using dist::ShardLayout;
using dist::TokenRange;

// MPI for the length of one run: initialised on entry, finalised on every way out, an error
// included (each rank then exits 2 with the error that all_or_none gave every rank alike).
class MpiSession {
 public:
  MpiSession() {
    int ready = 0;
    MPI_Initialized(&ready);
    if (!ready) MPI_Init(nullptr, nullptr);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~MpiSession() {
    int done = 0;
    MPI_Finalized(&done);
    if (!done) MPI_Finalize();
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  int rank_ = 0, size_ = 1;
};

constexpr std::string_view kRankField = "{rank}";

bool per_rank(const std::string& path) { return path.find(kRankField) != std::string::npos; }

std::string for_rank(std::string path, int rank) {
  for (size_t at = path.find(kRankField); at != std::string::npos; at = path.find(kRankField, at)) {
    path.replace(at, kRankField.size(), std::to_string(rank));
  }
  return path;
}

// An array's shape, sent as int64s: its rank, then its dims.
void broadcast_shape(Shape& shape, int root) {
  int64_t dims[5] = {shape.rank(), 0, 0, 0, 0};
  for (int a = 0; a < shape.rank(); ++a) dims[a + 1] = shape[a];
  MPI_Bcast(dims, 5, MPI_INT64_T, root, MPI_COMM_WORLD);
  shape = Shape(std::span<const int64_t>(dims + 1, static_cast<size_t>(dims[0])));
}

// A small array (slopes, sink logits) that rank 0 reads and every rank gets.
Tensor<float> read_on_rank0_for_all(const std::string& path, std::string_view arg, int rank) {
  Tensor<float> t;
  all_or_none(MPI_COMM_WORLD, [&] {
    if (rank == 0) t = load_float32(path, arg);
  });
  Shape shape = t.shape();
  broadcast_shape(shape, 0);
  if (rank != 0) t = Tensor<float>(shape);
  MPI_Bcast(t.data(), static_cast<int>(t.numel()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  return t;
}

// The rows of one token of a [.., T, D] array: outer·D floats at stride T·D. As an MPI type, so that
// a shard travels in one message whatever its length.
int64_t outer_of(const Shape& shape) {
  int64_t outer = 1;
  for (int a = 0; a + 2 < shape.rank(); ++a) outer *= shape[a];
  return outer;
}

// The shard of an input for this rank: read from its own file ({rank}), or read whole by rank 0 and
// sent to each rank. `tokens` is set to the whole sequence's length.
Tensor<float> read_shard(const std::string& path, std::string_view arg, const MpiSession& mpi, ShardLayout layout,
                         int64_t& tokens, bool allow_nonfinite) {
  Tensor<float> mine;
  const auto check = [&](const Tensor<float>& t) {
    if (t.shape().rank() < 2) {
      throw ShapeError(fmt::format("{}: expected shape [..., T, D], got {}", arg, t.shape().str()));
    }
    if (!allow_nonfinite) check_input_finite(t.cview(), arg);
  };
  if (per_rank(path)) {
    all_or_none(MPI_COMM_WORLD, [&] {
      mine = load_float32(for_rank(path, mpi.rank()), arg);
      check(mine);
    });
    const int64_t length = mine.shape()[mine.shape().rank() - 2];
    MPI_Allreduce(&length, &tokens, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    return mine;
  }
  Tensor<float> whole;
  all_or_none(MPI_COMM_WORLD, [&] {
    if (mpi.rank() != 0) return;
    whole = load_float32(path, arg);
    check(whole);
  });
  Shape shape = whole.shape();
  broadcast_shape(shape, 0);
  tokens = shape[shape.rank() - 2];
  const int64_t d = shape[shape.rank() - 1];
  const int64_t rows = outer_of(shape);
  for (int r = 0; r < mpi.size(); ++r) {
    const std::vector<TokenRange> ranges = dist::shard_ranges(tokens, mpi.size(), r, layout);
    if (mpi.rank() == 0) {
      Tensor<float> shard = dist::take_shard(whole.cview(), ranges);
      if (r == 0) {
        mine = std::move(shard);
      } else {
        MPI_Send(shard.data(), static_cast<int>(shard.numel()), MPI_FLOAT, r, 0, MPI_COMM_WORLD);
      }
    } else if (r == mpi.rank()) {
      Shape own = shape;
      own[own.rank() - 2] = dist::shard_length(tokens, mpi.size(), r, layout);
      mine = Tensor<float>(own);
      if (rows * own[own.rank() - 2] * d > 0) {
        MPI_Recv(mine.data(), static_cast<int>(mine.numel()), MPI_FLOAT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      }
    }
  }
  return mine;
}

// An lse [.., T] seen as [.., T, 1], so that its tokens are rows like every other array's.
Tensor<float> as_rows(Tensor<float> t) {
  std::vector<int64_t> dims(t.shape().dims().begin(), t.shape().dims().end());
  dims.push_back(1);
  return Tensor<float>(Shape(dims), std::move(t.values()));
}

Tensor<float> from_rows(Tensor<float> t) {
  std::vector<int64_t> dims(t.shape().dims().begin(), t.shape().dims().end());
  dims.pop_back();
  return Tensor<float>(Shape(dims), std::move(t.values()));
}

// The outputs of one run: each rank's shard goes to its own file ({rank}) or, gathered, into one
// whole file on rank 0. Planned before the work and committed after it, on every rank or none.
class ShardOutputs {
 public:
  ShardOutputs(const MpiSession& mpi, ShardLayout layout) : mpi_(mpi), layout_(layout) {}

  void plan(std::string_view arg, const std::string& path) {
    if (path.empty()) return;
    if (per_rank(path)) {
      files_.plan(arg, for_rank(path, mpi_.rank()));
    } else if (mpi_.rank() == 0) {
      files_.plan(arg, path);
    }
    planned_.emplace_back(arg, path);
  }

  bool planned(std::string_view arg) const {
    for (const auto& [a, path] : planned_) {
      if (a == arg) return true;
    }
    return false;
  }

  // This rank's shard of `arg`: [.., t_r, D], or an lse [.., t_r] (`per_token`), or with `tokens`
  // 0 an array that every rank holds alike.
  void set(std::string_view arg, Tensor<float> values, int64_t tokens, bool per_token = false) {
    const auto found = std::find_if(planned_.begin(), planned_.end(), [&](const auto& p) { return p.first == arg; });
    if (found == planned_.end()) return;
    if (per_rank(found->second) || tokens == 0) {
      if (per_rank(found->second) || mpi_.rank() == 0) files_.set(arg, std::move(values));
      return;
    }
    const Tensor<float> shard = per_token ? as_rows(std::move(values)) : std::move(values);
    Shape shape = shard.shape();
    shape[shape.rank() - 2] = tokens;
    Tensor<float> whole = mpi_.rank() == 0 ? Tensor<float>(shape) : Tensor<float>();
    const int64_t d = shape[shape.rank() - 1], outer = outer_of(shape);
    for (int r = 0; r < mpi_.size(); ++r) {
      const std::vector<TokenRange> ranges = dist::shard_ranges(tokens, mpi_.size(), r, layout_);
      const int64_t length = dist::shard_length(tokens, mpi_.size(), r, layout_);
      if (mpi_.rank() == 0) {
        Tensor<float> received;
        const Tensor<float>* part = &shard;
        if (r != 0) {
          Shape own = shape;
          own[own.rank() - 2] = length;
          received = Tensor<float>(own);
          if (received.numel() > 0) {
            MPI_Recv(received.data(), static_cast<int>(received.numel()), MPI_FLOAT, r, 1, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
          }
          part = &received;
        }
        const float* src = part->data();
        for (int64_t o = 0; o < outer; ++o)
          for (const TokenRange& range : ranges)
            for (int64_t t = range.start; t < range.start + range.length; ++t, src += d)
              std::memcpy(whole.data() + (o * tokens + t) * d, src, static_cast<size_t>(d) * sizeof(float));
      } else if (r == mpi_.rank() && shard.numel() > 0) {
        MPI_Send(shard.data(), static_cast<int>(shard.numel()), MPI_FLOAT, 0, 1, MPI_COMM_WORLD);
      }
    }
    if (mpi_.rank() == 0) files_.set(arg, per_token ? from_rows(std::move(whole)) : std::move(whole));
  }

  OutputFiles& files() { return files_; }

 private:
  const MpiSession& mpi_;
  ShardLayout layout_;
  OutputFiles files_;
  std::vector<std::pair<std::string_view, std::string>> planned_;
};

}  // namespace

void run_ring(const RingRunOptions& o) {
  const MpiSession mpi;
  const ShardLayout layout = o.layout == "zigzag" ? ShardLayout::zigzag : ShardLayout::contiguous;
  ShardOutputs outputs(mpi, layout);
  all_or_none(MPI_COMM_WORLD, [&] {
    const bool inputs_per_rank = per_rank(o.q);
    for (const auto& [arg, path] : {std::pair<std::string_view, const std::string&>{"--k", o.k}, {"--v", o.v}}) {
      if (per_rank(path) != inputs_per_rank) {
        throw ValueError(fmt::format("{}: expected {} {{rank}} in its path, as --q, got {}", arg,
                                     inputs_per_rank ? "a" : "no", path));
      }
    }
    if (o.backward && per_rank(o.dout) != inputs_per_rank) {
      throw ValueError(fmt::format("--dout: expected {} {{rank}} in its path, as --q, got {}",
                                   inputs_per_rank ? "a" : "no", o.dout));
    }
    outputs.plan("-o", o.out);
    outputs.plan("--lse", o.lse);
    outputs.plan("--dq", o.dq);
    outputs.plan("--dk", o.dk);
    outputs.plan("--dv", o.dv);
    outputs.plan("--dsinks", o.sinks.empty() ? std::string() : o.dsinks);
  });
  int64_t tq = 0, tk = 0, tv = 0, tdout = 0;
  const Tensor<float> q = read_shard(o.q, "--q", mpi, layout, tq, o.allow_nonfinite);
  const Tensor<float> k = read_shard(o.k, "--k", mpi, layout, tk, o.allow_nonfinite);
  const Tensor<float> v = read_shard(o.v, "--v", mpi, layout, tv, o.allow_nonfinite);
  all_or_none(MPI_COMM_WORLD, [&] {
    if (tv != tk) throw ShapeError(fmt::format("--v: expected Tk = {} tokens, as --k, got {}", tk, tv));
  });
  Tensor<float> alibi, sinks;
  AttentionParams<float> params{.q = q.cview(), .k = k.cview(), .v = v.cview(), .scale = o.scale, .mask = {}};
  params.mask.causal = o.causal;
  params.mask.alignment = o.alignment;
  params.mask.window = o.window;
  params.softcap = o.softcap;
  if (o.alibi == "auto") {
    const int64_t heads = q.shape().rank() >= 3 ? q.shape()[q.shape().rank() - 3] : 1;
    const std::vector<double> slopes = alibi_slopes(heads);
    alibi = Tensor<float>(Shape{heads}, std::vector<float>(slopes.begin(), slopes.end()));
  } else if (!o.alibi.empty()) {
    alibi = read_on_rank0_for_all(o.alibi, "--alibi", mpi.rank());
  }
  if (!o.alibi.empty()) params.mask.alibi_slopes = alibi.cview();
  if (!o.sinks.empty()) {
    sinks = read_on_rank0_for_all(o.sinks, "--sinks", mpi.rank());
    params.sinks = sinks.cview();
  }
  const dist::RingShards shards{.tq = tq, .tk = tk, .layout = layout};
  const Shape& qs = q.shape();
  std::vector<int64_t> out_dims(qs.dims().begin(), qs.dims().end());
  out_dims.back() = v.shape().from_back(1);
  const std::vector<int64_t> lse_dims(qs.dims().begin(), qs.dims().end() - 1);
  Tensor<float> out{Shape(out_dims)}, lse{Shape(lse_dims)};
  dist::ring_attention_forward(params, shards, {.out = out.view(), .weights = {}, .lse = lse.view()}, MPI_COMM_WORLD);
  if (!o.backward) {
    outputs.set("-o", std::move(out), tq);
    outputs.set("--lse", std::move(lse), tq, true);
  } else {
    const Tensor<float> dout = read_shard(o.dout, "--dout", mpi, layout, tdout, o.allow_nonfinite);
    all_or_none(MPI_COMM_WORLD, [&] {
      if (tdout != tq) throw ShapeError(fmt::format("--dout: expected Tq = {} tokens, as --q, got {}", tq, tdout));
    });
    Tensor<float> dq(q.shape()), dk(k.shape()), dv(v.shape());
    Tensor<float> dsinks = o.sinks.empty() ? Tensor<float>() : Tensor<float>(sinks.shape());
    AttentionGradients<float> grads{.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = {}};
    if (!o.sinks.empty()) grads.dsinks = dsinks.view();
    dist::ring_attention_backward(params, shards, dout.cview(), grads,
                                  AttentionSaved<float>{.out = out.cview(), .lse = lse.cview()}, MPI_COMM_WORLD);
    outputs.set("--dq", std::move(dq), tq);
    outputs.set("--dk", std::move(dk), tk);
    outputs.set("--dv", std::move(dv), tk);
    if (!o.sinks.empty()) outputs.set("--dsinks", std::move(dsinks), 0);
  }
  all_or_none(MPI_COMM_WORLD, [&] { outputs.files().commit(); });
}

}  // namespace qkv::cli
