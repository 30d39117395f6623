#include "support/progress.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "support/interrupt.hpp"

namespace qkv {
namespace {

// A terminal redraws cheaply; a log file gets a line only now and then.
constexpr double kTerminalInterval = 0.25;
constexpr double kLogInterval = 10.0;

double seconds_between(std::chrono::steady_clock::time_point from, std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

Progress::Progress(std::string label, int64_t total, std::string_view unit)
    : label_(std::move(label)),
      total_(std::max<int64_t>(total, 0)),
      unit_(unit),
      out_(stderr),
      terminal_(::isatty(::fileno(stderr)) != 0),
      start_(std::chrono::steady_clock::now()),
      last_print_(start_) {}

double Progress::elapsed_seconds() const { return seconds_between(start_, std::chrono::steady_clock::now()); }

void Progress::update(int64_t done, std::string_view note) {
  throw_if_interrupted();
  const auto now = std::chrono::steady_clock::now();
  const double interval = terminal_ ? kTerminalInterval : kLogInterval;
  if (printed_ && seconds_between(last_print_, now) < interval) return;
  print(done, note, false);
}

void Progress::done(std::string_view note) { print(total_, note, true); }

void Progress::print(int64_t done, std::string_view note, bool final) {
  const double elapsed = elapsed_seconds();
  std::string line = fmt::format("{}: {}/{} {}", label_, done, total_, unit_);
  if (!final && total_ > 0)
    line += fmt::format(" ({:.0f}%)", 100.0 * static_cast<double>(done) / static_cast<double>(total_));
  line += fmt::format(", {:.1f} s", elapsed);
  if (!final && done > 0 && done < total_) {
    line += fmt::format(", ~{:.0f} s left", elapsed * static_cast<double>(total_ - done) / static_cast<double>(done));
  }
  if (!note.empty()) line += fmt::format(", {}", note);
  if (terminal_) {
    // \r and erase-line: the line is redrawn in place, and ends with a newline only when finished.
    fmt::print(out_, "\r\x1b[K{}{}", line, final ? "\n" : "");
  } else {
    fmt::print(out_, "{}\n", line);
  }
  std::fflush(out_);
  printed_ = true;
  last_print_ = std::chrono::steady_clock::now();
}

}  // namespace qkv
