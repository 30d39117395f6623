#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "experiments.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/viz/explorer.hpp"

namespace qkv::cli {

std::string join_sizes(const std::vector<int64_t>& sizes) { return fmt::format("{}", fmt::join(sizes, ", ")); }

std::string command_line(std::string_view name, const ExperimentOptions& options) {
  std::string command =
      fmt::format("qkv experiment {}{} --seed {}", name, options.quick ? " --quick" : "", options.seed);
  // Commas without spaces: the list must stay one shell word.
  if (!options.sizes.empty()) command += fmt::format(" --sizes {}", fmt::join(options.sizes, ","));
  if (options.steps) command += fmt::format(" --steps {}", *options.steps);
  if (!options.corpus.empty()) command += fmt::format(" --corpus {}", options.corpus.string());
  return command;
}

void ExtraFiles::stage(const std::filesystem::path& directory, const std::string& name, std::string_view bytes) {
  staged_.stage(directory / name, bytes);
  names_.push_back(name);
}

std::string stage_attention(ExtraFiles& files, const std::filesystem::path& directory, const std::string& name,
                            const std::vector<Tensor<float>>& layers, const std::vector<std::string>& tokens,
                            const std::string& title) {
  const Shape& one = layers.front().shape();  // [1, H, T, T]
  std::vector<float> values;
  for (const Tensor<float>& layer : layers) values.insert(values.end(), layer.values().begin(), layer.values().end());
  const Tensor<float> attention({static_cast<int64_t>(layers.size()), one[1], one[2], one[3]}, std::move(values));
  std::string lines;
  for (const std::string& token : tokens) lines += token + "\n";
  ExplorerOptions explorer;
  for (size_t l = 0; l < layers.size(); ++l) explorer.layer_names.push_back(fmt::format("block {}", l));
  explorer.query_tokens = tokens;
  explorer.key_tokens = tokens;
  explorer.title = title;
  explorer.source = name + ".npy";
  files.stage(directory, name + ".npy", encode_npy(attention.cview()));
  files.stage(directory, name + "_tokens.txt", lines);
  files.stage(directory, name + ".html", render_explorer_html(attention.cview(), explorer));
  return fmt::format(
      "The trained model's attention, every layer and head ({}): open [{}.html]({}.html), or draw it again with "
      "`qkv explore {}.npy --tokens-file {}_tokens.txt -o page.html` (or `-o grid.png`).\n\n",
      title, name, name, name, name);
}

double mean(const std::vector<double>& values) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  return std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
}

double median(std::vector<double> values) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

uint64_t derive_seed(uint64_t seed, uint64_t stream, uint64_t substream) {
  // splitmix64's finaliser on each part in turn: nearby inputs give unrelated outputs.
  const auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  return mix(mix(mix(seed) ^ stream) ^ substream);
}

std::vector<double> running_mean(const std::vector<double>& values, int64_t window) {
  std::vector<double> out(values.size());
  double sum = 0.0;
  for (size_t i = 0; i < values.size(); ++i) {
    sum += values[i];
    if (static_cast<int64_t>(i) >= window) sum -= values[i - static_cast<size_t>(window)];
    out[i] = sum / static_cast<double>(std::min<int64_t>(static_cast<int64_t>(i) + 1, window));
  }
  return out;
}

PlotPanel make_panel(std::string title, std::string x_label, std::string y_label, AxisScale x_scale,
                     AxisScale y_scale) {
  PlotPanel panel;
  panel.title = std::move(title);
  panel.x_label = std::move(x_label);
  panel.y_label = std::move(y_label);
  panel.x_scale = x_scale;
  panel.y_scale = y_scale;
  return panel;
}

PlotSeries measured(std::string label, std::vector<double> x, std::vector<double> y) {
  return {.label = std::move(label), .x = std::move(x), .y = std::move(y), .markers = true, .dashed = false};
}

PlotSeries reference(std::string label, std::vector<double> x, std::vector<double> y) {
  return {.label = std::move(label), .x = std::move(x), .y = std::move(y), .markers = false, .dashed = true};
}

}  // namespace qkv::cli
