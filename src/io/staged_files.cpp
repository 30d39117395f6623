#include "qkv/io/staged_files.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <random>
#include <string>
#include <system_error>

#include "file_descriptor.hpp"
#include "qkv/core/error.hpp"

namespace qkv {
namespace {

using io_detail::Fd;
using io_detail::os_reason;

[[noreturn]] void fail(const std::filesystem::path& target, std::string_view problem) {
  throw IoError(fmt::format("{}: {}", target.string(), problem));
}

// Opens a new temporary beside `target`; O_EXCL turns a name collision into another try.
int create_temporary(const std::filesystem::path& target, std::filesystem::path& temp) {
  const std::filesystem::path directory = target.has_parent_path() ? target.parent_path() : ".";
  std::random_device entropy;
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    // The name is cut so that the temporary's stays within NAME_MAX (255) when the target's does.
    temp =
        directory / fmt::format(".{}.tmp.{}.{:08x}", target.filename().string().substr(0, 200), ::getpid(), entropy());
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    fail(target,
         fmt::format("cannot write: {} (creating a temporary file in {})", os_reason(errno), directory.string()));
  }
  return fd;
}

// Without the fsync a crash soon after the rename could leave the new name on an empty file.
void flush_to_disk(const std::filesystem::path& target, const std::filesystem::path& temp) {
  Fd fd(::open(temp.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0)
    fail(target, fmt::format("cannot write: the temporary {} is gone: {}", temp.string(), os_reason(errno)));
  if (::fsync(fd.get()) != 0) fail(target, fmt::format("cannot write: fsync failed: {}", os_reason(errno)));
}

}  // namespace

StagedFiles::~StagedFiles() { abandon(); }

std::filesystem::path StagedFiles::stage_path(const std::filesystem::path& target) {
  const bool seen = std::any_of(files_.begin(), files_.end(), [&](const File& f) { return f.target == target; });
  if (seen) fail(target, "staged twice in one set of outputs");
  std::filesystem::path temp;
  Fd fd(create_temporary(target, temp));
  files_.push_back({.target = target, .temp = temp});
  if (const int err = fd.close(); err != 0) fail(target, fmt::format("cannot write: close failed: {}", os_reason(err)));
  return temp;
}

void StagedFiles::stage(const std::filesystem::path& target, std::string_view bytes) {
  const std::filesystem::path temp = stage_path(target);
  Fd fd(::open(temp.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC));
  if (fd.get() < 0) fail(target, fmt::format("cannot write: {}", os_reason(errno)));
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd.get(), bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(target, fmt::format("cannot write: write failed: {}", os_reason(errno)));
    written += static_cast<size_t>(n);
  }
  if (const int err = fd.close(); err != 0) fail(target, fmt::format("cannot write: close failed: {}", os_reason(err)));
}

void StagedFiles::commit() {
  size_t renamed = 0;
  try {
    for (const File& file : files_) flush_to_disk(file.target, file.temp);
    for (; renamed < files_.size(); ++renamed) {
      const File& file = files_[renamed];
      std::error_code ec;
      std::filesystem::rename(file.temp, file.target, ec);
      if (ec) fail(file.target, fmt::format("cannot write: rename failed: {}", ec.message()));
    }
    files_.clear();
  } catch (...) {
    // A rename within one directory fails only in a race; the targets renamed before it go too,
    // so that the set is never left half new.
    for (size_t i = 0; i < renamed; ++i) {
      std::error_code ignored;
      std::filesystem::remove(files_[i].target, ignored);
    }
    files_.erase(files_.begin(), files_.begin() + static_cast<std::ptrdiff_t>(renamed));
    abandon();
    throw;
  }
}

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  StagedFiles file;
  file.stage(path, bytes);
  file.commit();
}

void StagedFiles::abandon() noexcept {
  for (const File& file : files_) {
    std::error_code ignored;
    std::filesystem::remove(file.temp, ignored);
  }
  files_.clear();
}

}  // namespace qkv
