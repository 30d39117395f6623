// qkv experiment NAME: runs one of the experiments that test the seed's claims and writes what it
// measured to DIR/NAME/ (results.md with the settings, results.csv and further CSVs, PNG figures),
// then prints the tables. The experiments themselves live in experiments/, one file each.
//
// Everything that can be refused is refused before any work: an unknown name, a size out of range,
// an option the experiment does not take, a --corpus that cannot be read, an --out that cannot be
// written (exit 2, one line). Ctrl-C during the run leaves DIR/NAME as it was: outputs are staged
// in temporaries and renamed into place only once all are complete.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "cli_io.hpp"
#include "commands.hpp"
#include "experiments/experiments.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/staged_files.hpp"
#include "support/interrupt.hpp"
#include "support/report.hpp"

namespace qkv::cli {
namespace {

struct CommandOptions {
  std::string name;
  std::filesystem::path out = "results";
  ExperimentOptions experiment;
};

std::vector<Experiment> all_experiments() {
  return {scaling_experiment(),   long_range_experiment(), parallel_experiment(),
          alignment_experiment(), coref_experiment(),      encoder_lm_experiment()};
}

std::string known_names() {
  std::string names;
  for (const Experiment& e : all_experiments()) names += (names.empty() ? "" : ", ") + std::string(e.name);
  return names;
}

Experiment find_experiment(const std::string& name) {
  for (const Experiment& e : all_experiments()) {
    if (e.name == name) return e;
  }
  std::vector<std::string> names;
  for (const Experiment& e : all_experiments()) names.emplace_back(e.name);
  const std::optional<std::string> near = closest_name(name, names);
  throw ValueError(fmt::format("NAME: expected one of {}, got \"{}\"{}", known_names(), name,
                               near ? fmt::format(" (did you mean {}?)", *near) : ""));
}

void check_options(const Experiment& experiment, const ExperimentOptions& options) {
  if (!options.sizes.empty() && experiment.sizes_meaning.empty()) {
    throw ValueError(fmt::format("--sizes: experiment {} sweeps no sizes, so it takes no --sizes", experiment.name));
  }
  for (const int64_t size : options.sizes) {
    if (size < experiment.min_size || size > experiment.max_size) {
      throw ValueError(fmt::format("--sizes: expected {} from {} to {} for experiment {}, got {}",
                                   experiment.sizes_meaning, experiment.min_size, experiment.max_size, experiment.name,
                                   size));
    }
  }
  if (options.steps) {
    if (!experiment.trains) {
      throw ValueError(fmt::format("--steps: experiment {} trains nothing, so it takes no --steps", experiment.name));
    }
    if (*options.steps < 1 || *options.steps > kMaxSteps) {
      throw ValueError(fmt::format("--steps: expected 1 to {} training steps, got {}", kMaxSteps, *options.steps));
    }
  }
  if (!options.corpus.empty()) {
    if (!experiment.reads_corpus) {
      throw ValueError(fmt::format("--corpus: experiment {} reads no text, so it takes no --corpus", experiment.name));
    }
    // A corpus that cannot be read is refused before DIR/NAME is created.
    std::error_code ec;
    if (!std::filesystem::is_regular_file(options.corpus, ec)) {
      throw IoError(fmt::format("--corpus: {} is not a readable file", options.corpus.string()));
    }
    std::ifstream probe(options.corpus, std::ios::binary);
    if (!probe) throw IoError(fmt::format("--corpus: cannot open {}", options.corpus.string()));
    const std::uintmax_t size = std::filesystem::file_size(options.corpus, ec);
    if (!ec && size < kMinCorpusCharacters) {
      throw ValueError(fmt::format("--corpus: expected at least {} characters in {}, got {}", kMinCorpusCharacters,
                                   options.corpus.string(), size));
    }
  }
}

// Creates DIR/NAME and proves that a file can be created in it, so that an unwritable --out is
// refused now rather than after an hour of training.
std::filesystem::path prepare_directory(const std::filesystem::path& out, std::string_view name) {
  if (out.empty()) throw IoError("--out: expected a directory, got an empty path");
  const std::filesystem::path directory = out / name;
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) throw IoError(fmt::format("--out: cannot create directory {}: {}", directory.string(), ec.message()));
  if (!std::filesystem::is_directory(directory, ec)) {
    throw IoError(fmt::format("--out: {} exists and is not a directory", directory.string()));
  }
  try {
    StagedFiles probe;
    probe.stage_path(directory / "results.md");
  } catch (const IoError& e) {
    throw IoError(fmt::format("--out: {}", e.what()));
  }
  return directory;
}

void run_experiment(const CommandOptions& command) {
  const Experiment experiment = find_experiment(command.name);
  check_options(experiment, command.experiment);
  const std::filesystem::path directory = prepare_directory(command.out, experiment.name);

  InterruptScope interrupt_scope;
  try {
    ExtraFiles extra;
    ExperimentOptions options = command.experiment;
    options.directory = directory;
    options.extra_files = &extra;
    const Report report = experiment.run(options);
    // Signals only raise a flag from here on, so the files are written whole even after a Ctrl-C.
    // The report first: rendering its figures is what can still fail, and the extra files (models,
    // heatmaps) stay as they were when it does.
    report.write(directory);
    extra.commit();
    fmt::print("{}", report.tables_markdown());
    for (const std::string& file : extra.names()) fmt::print("wrote {}\n", (directory / file).string());
    for (const std::string& file : report.file_names()) fmt::print("wrote {}\n", (directory / file).string());
    std::fflush(stdout);
  } catch (const Interrupted& e) {
    fmt::print(stderr, "\nqkv: {}; nothing was written to {}\n", e.what(), directory.string());
    std::fflush(stderr);
    exit_by_signal(e.signal_number());
  }
}

std::string footer() {
  std::string text = "Experiments:\n";
  for (const Experiment& e : all_experiments()) {
    const std::string sizes = e.sizes_meaning.empty()
                                  ? std::string("takes no --sizes")
                                  : fmt::format("--sizes: {}, {} to {}", e.sizes_meaning, e.min_size, e.max_size);
    text += fmt::format("  {:<11} {}\n  {:<11} {}{}{}\n", e.name, e.summary, "", sizes,
                        e.trains ? "; takes --steps" : "", e.reads_corpus ? "; takes --corpus" : "");
  }
  text +=
      "\nEach writes DIR/NAME/results.md (table and settings), results.csv and PNG figures, and prints the\n"
      "table. Progress goes to stderr. Ctrl-C leaves the previous results as they were.";
  return text;
}

}  // namespace

void register_experiment(CLI::App& app) {
  auto options = std::make_shared<CommandOptions>();
  CLI::App* cmd =
      app.add_subcommand("experiment", "run an experiment that tests a claim about attention: " + known_names());
  cmd->footer(footer());
  cmd->add_option("NAME", options->name, "the experiment: " + known_names())->required();
  cmd->add_flag("--quick", options->experiment.quick, "a small run that finishes in well under a minute");
  cmd->add_option("--out", options->out, "results go to DIR/NAME/")->type_name("DIR")->capture_default_str();
  cmd->add_option("--seed", options->experiment.seed, "seed of every random draw; a seed reproduces the numbers")
      ->check(CLI::Validator(uint64_error, "0..2^64-1"))
      ->capture_default_str();
  cmd->add_option("--sizes", options->experiment.sizes, "the swept sizes, comma-separated (see below)")
      ->delimiter(',')
      ->type_name("N,N,...");
  cmd->add_option("--steps", options->experiment.steps, "training steps of each model")->type_name("N");
  cmd->add_option("--corpus", options->experiment.corpus, "encoder-lm: a text file to train on")->type_name("FILE");
  cmd->callback([options] { run_experiment(*options); });
}

}  // namespace qkv::cli
