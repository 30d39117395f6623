// qkv translate --model FILE "SENTENCE": translates a sentence with a model that `qkv experiment
// alignment` trained and saved, and shows where the decoder looked: the attention weights α of every
// output word over the source words, as a grid in the terminal.
//
// The model file is checked whole before anything runs (include/qkv/io/model_file.hpp): a corrupt,
// truncated or foreign file, or one of another kind or version, is refused with one line naming the
// file and the problem (exit 2). So is a word the model's vocabulary does not have.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli_io.hpp"
#include "commands.hpp"
#include "experiments/seq2seq.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/text.hpp"
#include "qkv/io/model_file.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv::cli {
namespace {

// Longer sentences than this are refused: the models are trained on 4 to 15 words, and decoding
// time grows with the square of the length.
constexpr size_t kMaxWords = 256;

constexpr const char* kFooter =
    R"(The model is a file that `qkv experiment alignment` writes (DIR/alignment/model_additive.qkvm,
model_dot.qkvm, model_none.qkvm). Words are separated by spaces and read in lower case; the
model knows only its training vocabulary. The translation is greedy (the most likely word at each
step). The grid shows α: one row per output word (and the end of the sentence), one column per
source word; a model without attention (model_none) has no grid.
Example:
  qkv experiment alignment --quick --out results
  qkv translate --model results/alignment/model_additive.qkvm "the big dog sees a cat near the house")";

struct TranslateOptions {
  std::filesystem::path model;
  std::string sentence;
  std::string color = "auto";
  bool values = false;
};

std::vector<std::string> read_words(const std::string& sentence) {
  std::vector<std::string> words = split_labels(sentence);
  if (words.empty()) throw ValueError("SENTENCE: expected at least one word, got none");
  if (words.size() > kMaxWords) {
    throw ValueError(fmt::format("SENTENCE: expected at most {} words, got {}", kMaxWords, words.size()));
  }
  for (std::string& w : words) {
    std::transform(w.begin(), w.end(), w.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  }
  return words;
}

void run_translate(const TranslateOptions& o) {
  const TranslationModel translator = translation_model_from_file(read_model_file(o.model));
  const std::vector<std::string> words = read_words(o.sentence);
  const std::vector<int64_t> ids = translator.source.encode(words, "SENTENCE");
  // Room for a translation twice as long as its source, so a model that never stops still halts.
  const auto max_steps = static_cast<int64_t>(2 * words.size() + 10);
  const GreedyTranslation<float> result = translator.model.greedy_decode({ids}, max_steps).front();
  std::vector<std::string> output = translator.target.decode(result.tokens);

  const Score score = translator.model.config().score;
  fmt::print("source:      {}\n", fmt::join(words, " "));
  fmt::print("translation: {}{}\n", fmt::join(output, " "),
             result.finished ? "" : fmt::format(" … (no end of sentence within {} words)", max_steps));
  fmt::print("model:       {} ({} attention)\n", o.model.string(), score == Score::none ? "no" : score_name(score));
  if (score == Score::none) {
    fmt::print("\nThis model has no attention, so there is no alignment to show.\n");
    std::fflush(stdout);
    return;
  }
  if (result.finished) output.emplace_back("<eos>");
  HeatmapOptions heatmap;
  heatmap.row_labels = output;
  heatmap.col_labels = words;
  heatmap.vmin = 0.0;
  heatmap.vmax = 1.0;
  heatmap.annotate = o.values;
  heatmap.terminal.color = terminal_color(o.color);
  heatmap.terminal.decimals = 2;
  fmt::print("\nalignment α (rows: output words, columns: source words):\n{}",
             render_heatmap<float>(result.alpha.cview(), HeatmapFormat::terminal, heatmap));
  std::fflush(stdout);
}

}  // namespace

void register_translate(CLI::App& app) {
  auto o = std::make_shared<TranslateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "translate", "translate a sentence with a model saved by `qkv experiment alignment` and show its alignment");
  cmd->footer(kFooter);
  cmd->add_option("--model", o->model, "model file (.qkvm) written by qkv experiment alignment")
      ->required()
      ->type_name("FILE");
  cmd->add_option("SENTENCE", o->sentence, "the source sentence, words separated by spaces")->required();
  cmd->add_flag("--values", o->values, "print each weight in its cell");
  cmd->add_option("--color", o->color,
                  "colour the grid: auto (on a terminal, unless NO_COLOR is set or TERM=dumb), always, never")
      ->check(CLI::IsMember({"auto", "always", "never"}))
      ->capture_default_str();
  cmd->callback([o] { run_translate(*o); });
}

}  // namespace qkv::cli
