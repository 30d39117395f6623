#pragma once
// The one way qkv writes output files: a set of them all or nothing (StagedFiles), or one
// (write_file_atomically).
//
// A set of output files written all or nothing: each file is first written whole to a temporary
// beside its target, and only once every one is complete are they renamed into place. A run that
// fails or is interrupted before commit() leaves the targets as they were and no temporary behind.
//
// Temporaries are named ".<target name>.tmp.<pid>.<random>" in the target's directory, so that the
// rename stays within one file system (and is atomic there).

#include <filesystem>
#include <string_view>
#include <vector>

namespace qkv {

class StagedFiles {
 public:
  StagedFiles() = default;
  StagedFiles(const StagedFiles&) = delete;
  StagedFiles& operator=(const StagedFiles&) = delete;
  // Removes the temporaries of a set that was not committed.
  ~StagedFiles();

  // Creates an empty temporary for `target` and returns its path, for writers that want a path to
  // write to (PLplot does). Throws IoError naming `target` when the temporary cannot be created, or
  // when `target` was staged before in this set.
  std::filesystem::path stage_path(const std::filesystem::path& target);

  // Writes `bytes` in full to a new temporary for `target` (stage_path, then write and fsync).
  void stage(const std::filesystem::path& target, std::string_view bytes);

  // Flushes every temporary to disk and renames it over its target, in staging order. Throws IoError
  // naming the target when a temporary has vanished or a rename fails; the temporaries not yet
  // renamed are then removed, and so are the targets already renamed (a rename in one directory
  // fails only in a race), so that the set is either all new or absent.
  void commit();

  // Removes every temporary not yet committed.
  void abandon() noexcept;

  size_t size() const { return files_.size(); }

 private:
  struct File {
    std::filesystem::path target;
    std::filesystem::path temp;
  };
  std::vector<File> files_;
};

// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so the
// target either keeps its old contents or has the new ones in full (a StagedFiles of one file).
// Throws IoError naming `path` on failure.
void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

}  // namespace qkv
