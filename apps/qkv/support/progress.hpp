#pragma once
// Progress of a long run, on stderr so that stdout keeps only the results:
//   [long-range] gru T=512 start: step 300/1000 (30%), 41 s, ~96 s left, loss 2.071
// On a terminal the line is redrawn in place a few times a second; otherwise (a log, a test) a new
// line is printed at most every few seconds, so that logs stay short. Every update is also a point
// at which a pending Ctrl-C is taken (see interrupt.hpp).

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace qkv {

class Progress {
 public:
  // `label` names the task ("[scaling] training"); `total` counts its units (steps, sizes). The
  // first update and done() are always shown.
  Progress(std::string label, int64_t total, std::string_view unit = "steps");
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // `done` units are finished; `note` ("loss 2.071") ends the line. Throws Interrupted when a
  // signal is pending.
  void update(int64_t done, std::string_view note = {});

  // The final line: every unit done, the time taken and `note`.
  void done(std::string_view note = {});

  double elapsed_seconds() const;

 private:
  void print(int64_t done, std::string_view note, bool final);

  std::string label_;
  int64_t total_;
  std::string unit_;
  std::FILE* out_;
  bool terminal_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_print_;
  bool printed_ = false;
};

}  // namespace qkv
