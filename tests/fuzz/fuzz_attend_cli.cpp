// libFuzzer target: `qkv attend` and `qkv attend-backward` as the CLI runs them, on arguments and
// small input files that the fuzzer's bytes describe. The bytes are segments joined by kSeparator:
// the first holds the arguments after `qkv`, one per line; each further one is a file, its first
// line the file's name and the rest its contents, written into a scratch directory (on tmpfs where
// there is one, because every output is flushed to disk) that is the working directory of the run.
//
// Refusals are expected. A bug is a crash, a sanitizer report, an exit code other than 0 or 2 (1
// is the CLI's "internal error"), a refused run that leaves any file behind (outputs are written
// whole or not at all), a temporary left by a run that succeeded, or an output the .npy reader
// cannot read back.
//
// Arguments holding '/' are dropped so that every path stays in the scratch directory, and so is
// --heatmap: rendering is the heatmap tests' subject, takes milliseconds, and pango keeps caches
// that the fuzzer's per-input leak check would report.

#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "app.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/npy.hpp"

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSeparator{"\0QKVF\0", 6};
constexpr size_t kMaxArguments = 64;
constexpr size_t kMaxArgumentLength = 256;
constexpr size_t kMaxFiles = 8;

fs::path scratch;

std::vector<std::string_view> split(std::string_view text, std::string_view separator) {
  std::vector<std::string_view> parts;
  for (size_t at = 0;;) {
    const size_t next = text.find(separator, at);
    parts.push_back(text.substr(at, next == std::string_view::npos ? std::string_view::npos : next - at));
    if (next == std::string_view::npos) return parts;
    at = next + separator.size();
  }
}

bool plain_file_name(std::string_view name) {
  if (name.empty() || name.size() > 32 || name == "." || name == "..") return false;
  for (const char c : name) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

void write_file(const fs::path& path, std::string_view contents) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  for (size_t at = 0; at < contents.size();) {
    const ssize_t n = ::write(fd, contents.data() + at, contents.size() - at);
    if (n <= 0) break;
    at += static_cast<size_t>(n);
  }
  ::close(fd);
}

std::set<std::string> files_in_scratch() {
  std::set<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(scratch)) names.insert(entry.path().filename());
  return names;
}

void empty_scratch() {
  for (const fs::directory_entry& entry : fs::directory_iterator(scratch)) fs::remove_all(entry.path());
}

// The standard error that libFuzzer was started with: -close_fd_mask=2 closes fd 2 after
// LLVMFuzzerInitialize, to silence the CLI's messages, and a finding must still be heard.
int report_fd = 2;

[[noreturn]] void finding(const std::string& what) {
  const std::string line = "fuzz_attend_cli: " + what + "\n";
  [[maybe_unused]] const ssize_t written = ::write(report_fd, line.data(), line.size());
  std::abort();
}

std::string read_file(const fs::path& path) {
  std::string bytes;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) finding("cannot open the output " + path.filename().string());
  char buffer[65536];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) bytes.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  return bytes;
}

// The names StagedFiles gives its temporaries: ".TARGET.tmp.PID.XXXXXXXX".
bool temporary_name(std::string_view name) {
  return name.starts_with('.') && name.find(".tmp.") != std::string_view::npos;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  report_fd = ::dup(2);
  const char* tmpdir = std::getenv("TMPDIR");
  const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::path(tmpdir ? tmpdir : "/tmp");
  std::string pattern = (base / "qkv-fuzz-attend-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) finding("cannot create a scratch directory in " + base.string());
  scratch = pattern;
  fs::current_path(scratch);
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(scratch, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string_view> segments =
      split(std::string_view(reinterpret_cast<const char*>(data), size), kSeparator);

  std::vector<std::string> arguments{"qkv"};
  for (std::string_view line : split(segments[0], "\n")) {
    if (arguments.size() > kMaxArguments) break;
    if (line.size() > kMaxArgumentLength || line.find('/') != std::string_view::npos ||
        line.find('\0') != std::string_view::npos || line.find("heatmap") != std::string_view::npos) {
      continue;
    }
    arguments.emplace_back(line);
  }

  empty_scratch();
  for (size_t i = 1; i < segments.size() && i <= kMaxFiles; ++i) {
    const size_t newline = segments[i].find('\n');
    if (newline == std::string_view::npos) continue;
    const std::string_view name = segments[i].substr(0, newline);
    if (plain_file_name(name)) write_file(scratch / name, segments[i].substr(newline + 1));
  }
  const std::set<std::string> inputs = files_in_scratch();

  std::vector<const char*> argv;
  for (const std::string& argument : arguments) argv.push_back(argument.c_str());
  CLI::App app{"qkv attend and attend-backward, fuzzed", "qkv"};
  app.require_subcommand(1);
  qkv::cli::register_attend(app);
  qkv::cli::register_attend_backward(app);
  const int code = qkv::cli::run_app(app, static_cast<int>(argv.size()), argv.data());

  if (code != 0 && code != qkv::cli::kExitBadInput) finding("exit code " + std::to_string(code));
  for (const std::string& name : files_in_scratch()) {
    if (inputs.count(name) != 0) continue;
    if (code != 0) finding("a refused run left " + name);
    if (temporary_name(name)) finding("a run left the temporary " + name);
    // Whatever the name (even x.npz, which read_npy would open as an archive), an output is a .npy.
    try {
      qkv::decode_npy(read_file(scratch / name), name);
    } catch (const qkv::Error& e) {
      finding("the output " + name + " does not read back: " + e.what());
    }
  }
  return 0;
}
