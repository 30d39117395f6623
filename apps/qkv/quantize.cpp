// qkv quantize / qkv dequantize: stored operands (float16, bfloat16, int8 with scales) made from a
// user's float arrays, and float32 arrays made back from them.
//
// File formats: float16 is numpy's '<f2'; bfloat16, which numpy has no dtype for, is its bits as
// '<u2', read as bfloat16 only when --dtype bf16 says so (a '<u2' file alone is ambiguous); int8 is
// '|i1' with its float32 scales in a second file, broadcasting to the array's shape.

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/ops/quantize.hpp"
#include "stored_input.hpp"

namespace qkv::cli {
namespace {

struct QuantizeOptions {
  std::string input;
  std::string to;
  std::string output;
  std::string scales;
  std::string group = "per-channel";
  CLI::Option* group_option = nullptr;
};

struct DequantizeOptions {
  std::string input;
  std::string scales;
  std::string dtype;
  std::string output;
};

QuantizeGroup group_of(const std::string& name) {
  if (name == "per-token") return QuantizeGroup::per_token;
  if (name == "per-tensor") return QuantizeGroup::per_tensor;
  return QuantizeGroup::per_channel;
}

void run_quantize(const QuantizeOptions& o) {
  const StorageType to = parse_storage(o.to, "--to");
  if (to == StorageType::float32) throw ValueError("--to: expected int8, f16 or bf16, got float32");
  if (to == StorageType::int8 && o.scales.empty()) {
    throw ValueError("--scales: expected a path for the scales of --to int8 (value = scale · stored), got none");
  }
  if (to != StorageType::int8 && !o.scales.empty()) {
    throw ValueError(fmt::format("--scales: expected none for --to {} (only int8 has scales), got {}", o.to, o.scales));
  }
  if (to != StorageType::int8 && o.group_option->count() > 0) {
    throw ValueError(
        fmt::format("--group: expected none for --to {} (only int8 has scales to group), got {}", o.to, o.group));
  }
  OutputFiles files;
  files.plan("-o", o.output);
  if (!o.scales.empty()) files.plan("--scales", o.scales);

  const Tensor<float> x = load_float32(o.input, "IN");
  check_finite(x.cview(), "IN");
  if (to == StorageType::int8) {
    if (x.shape().rank() < 2) {
      throw ShapeError(
          fmt::format("IN: expected rank 2 or more ([..., T, D]) for int8, got shape {}", x.shape().str()));
    }
    const Int8Array q = quantize_int8(x.cview(), group_of(o.group));
    files.set("-o", encode_npy(q.values.cview()));
    files.set("--scales", encode_npy(q.scales.cview()));
  } else if (to == StorageType::float16) {
    files.set("-o", encode_npy_bits(to_float16(x.cview(), "IN").cview(), DType::float16));
  } else {
    files.set("-o", encode_npy_bits(to_bfloat16(x.cview(), "IN").cview(), DType::uint16));
  }
  files.commit();
}

void run_dequantize(const DequantizeOptions& o) {
  if (!o.dtype.empty() && o.dtype != "bf16") {
    throw ValueError(fmt::format("--dtype: expected bf16 (what a '<u2' IN holds), got {}", o.dtype));
  }
  OutputFiles files;
  files.plan("-o", o.output);

  const StoredArray array = read_stored(o.input, o.scales, !o.dtype.empty(), {.arg = "IN", .scales_arg = "--scales"});
  if (array.type == StorageType::float32) {
    throw ShapeError(fmt::format(
        "IN: expected dtype float16 '<f2', uint16 '<u2' (with --dtype bf16) or int8 '|i1', got float32 (shape {})",
        array.shape().str()));
  }
  if (array.type == StorageType::float16 && !o.dtype.empty()) {
    throw ValueError("--dtype: expected none for a float16 ('<f2') IN, got bf16");
  }
  if (array.shape().rank() > 4) {
    throw ShapeError(fmt::format("IN: expected rank 4 or less, got shape {}", array.shape().str()));
  }
  files.set("-o", to_float32(array.view()));
  files.commit();
}

}  // namespace

void register_quantize(CLI::App& app) {
  auto o = std::make_shared<QuantizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "quantize", "Store a float array as int8 (with its scales), float16 ('<f2') or bfloat16 (its bits as '<u2')");
  cmd->add_option("IN", o->input, "float32 or float64 .npy, finite")->required();
  cmd->add_option("--to", o->to, "int8 (i8), f16 (float16) or bf16 (bfloat16)")->required();
  cmd->add_option("-o", o->output, "the stored array (.npy)")->required();
  cmd->add_option("--scales", o->scales, "with --to int8: its float32 scales (.npy), value = scale · stored");
  o->group_option =
      cmd->add_option(
             "--group", o->group,
             "which elements of [..., T, D] share an int8 scale: per-channel (scales [..., 1, D], the default: "
             "for keys), per-token ([..., T, 1]: for values) or per-tensor")
          ->check(CLI::IsMember({"per-channel", "per-token", "per-tensor"}));
  cmd->callback([o] { run_quantize(*o); });

  auto d = std::make_shared<DequantizeOptions>();
  CLI::App* de = app.add_subcommand(
      "dequantize", "The float32 values of a stored array: float16 '<f2', bfloat16 '<u2' (--dtype bf16), int8 '|i1'");
  de->add_option("IN", d->input, "the stored array (.npy)")->required();
  de->add_option("--scales", d->scales, "for int8 IN: its float32 scales, broadcasting to IN's shape");
  de->add_option("--dtype", d->dtype, "bf16: read a uint16 '<u2' IN as bfloat16 bits");
  de->add_option("-o", d->output, "the float32 values (.npy)")->required();
  de->callback([d] { run_dequantize(*d); });
}

}  // namespace qkv::cli
