#pragma once
// The experiments behind `qkv experiment NAME`: each puts one of the seed's claims to a measurement
// and reports what it finds as a Report (tables, figures, settings). One experiment, one file:
//   scaling.cpp     why scores are divided by √d (statistics at initialisation, then training)
//   long_range.cpp  an O(1) path between any two tokens versus an RNN's O(T) chain
//   parallel.cpp    attention's steps run in parallel, an RNN's one after the other
//   alignment.cpp   Bahdanau attention learns the word alignment of a translation
//   coref.cpp       a pronoun's attention row and its referent; value ablation against the weights
//   encoder_lm.cpp  a character-level language model, GRU against causal self-attention
// An experiment checks its options before any work (ValueError naming the option, exit 2), shows
// progress on long phases and polls for Ctrl-C through qkv::Progress.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/io/staged_files.hpp"
#include "qkv/viz/plot.hpp"
#include "support/report.hpp"

namespace qkv::cli {

// Files an experiment writes beside its Report (heatmaps with marks, trained models). The command
// renames them into DIR/NAME only after the Report's own files are in place, so a run that fails or
// is interrupted before that leaves every file of DIR/NAME as it was.
class ExtraFiles {
 public:
  // Stages `bytes` for DIR/NAME/`name`; IoError naming the file when it cannot be staged.
  void stage(const std::filesystem::path& directory, const std::string& name, std::string_view bytes);
  void commit() { staged_.commit(); }
  const std::vector<std::string>& names() const { return names_; }

 private:
  StagedFiles staged_;
  std::vector<std::string> names_;
};

// A trained model's attention on one input, staged for `qkv explore`: NAME.npy [L, H, T, T] (its
// `layers`, each [1, H, T, T], stacked from the input up), NAME_tokens.txt (one token a line, as
// --tokens-file reads) and NAME.html (the explorer page, to open at once). Returns the markdown
// paragraph that tells the reader of results.md how to open them.
std::string stage_attention(ExtraFiles& files, const std::filesystem::path& directory, const std::string& name,
                            const std::vector<Tensor<float>>& layers, const std::vector<std::string>& tokens,
                            const std::string& title);

struct ExperimentOptions {
  bool quick = false;            // --quick: a small version that finishes in well under a minute
  uint64_t seed = 0;             // --seed: every random draw of the run comes from it
  std::vector<int64_t> sizes;    // --sizes: the swept sizes; empty for the experiment's defaults
  std::optional<int64_t> steps;  // --steps: training steps, for the experiments that train
  // DIR/NAME, set by the command: where an experiment stages files that a Report does not carry
  // (trained models, marked heatmaps) through extra_files.
  std::filesystem::path directory;
  std::filesystem::path corpus;       // --corpus: a text file for encoder-lm; empty for its generated corpus
  ExtraFiles* extra_files = nullptr;  // set by the command: where files beyond the Report's are staged
};

struct Experiment {
  std::string_view name;
  std::string_view summary;
  // What --sizes sets for this experiment ("d, the dimension of q and k"), and its bounds; empty
  // for an experiment that takes no --sizes.
  std::string_view sizes_meaning;
  int64_t min_size = 1;
  int64_t max_size = 1;
  // Whether --steps applies (the experiment trains a model).
  bool trains = false;
  // Whether --corpus applies (the experiment reads a text file).
  bool reads_corpus = false;
  Report (*run)(const ExperimentOptions& options) = nullptr;
};

Experiment scaling_experiment();
Experiment long_range_experiment();
Experiment parallel_experiment();
Experiment alignment_experiment();
Experiment coref_experiment();
Experiment encoder_lm_experiment();

// The most training steps --steps accepts.
inline constexpr int64_t kMaxSteps = 100000;
// The shortest --corpus that leaves a validation tenth longer than one window.
inline constexpr uint64_t kMinCorpusCharacters = 1000;

// ---- Helpers shared by the experiments ---------------------------------------------------------

// "4, 16, 64"
std::string join_sizes(const std::vector<int64_t>& sizes);

// The command that repeats a run with these options, for results.md: "qkv experiment NAME --quick
// --seed 0 --sizes 4,16 --steps 5 --corpus FILE" (only the options that were given).
std::string command_line(std::string_view name, const ExperimentOptions& options);

// The mean and the median of samples; NaN for no samples.
double mean(const std::vector<double>& values);
double median(std::vector<double> values);

// An independent seed for one named stream of a run (a size, a chunk, a model), so that adding a
// size or a thread does not change the numbers drawn for another.
uint64_t derive_seed(uint64_t seed, uint64_t stream, uint64_t substream = 0);

// A panel with its titles and scales, to which the caller adds series.
PlotPanel make_panel(std::string title, std::string x_label, std::string y_label, AxisScale x_scale = AxisScale::linear,
                     AxisScale y_scale = AxisScale::linear);
// A measured curve (line and markers), and a dashed reference (theory, a target, a bound).
PlotSeries measured(std::string label, std::vector<double> x, std::vector<double> y);
PlotSeries reference(std::string label, std::vector<double> x, std::vector<double> y);

// out[i] = the mean of values[max(0, i − window + 1) .. i]: a curve smoothed over `window` points.
std::vector<double> running_mean(const std::vector<double>& values, int64_t window);

}  // namespace qkv::cli
