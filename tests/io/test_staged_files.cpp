// Output files written all or nothing (qkv/io/staged_files.hpp).

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "files.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/staged_files.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using qkv::testing::names_in;
using qkv::testing::read_file;
using qkv::testing::TempDir;
using qkv::testing::throws_naming;

TEST(StagedFiles, CommitRenamesEveryFileAndAbandonRemovesTheTemporaries) {
  TempDir dir;
  {
    StagedFiles files;
    files.stage(dir.path() / "a.txt", "alpha");
    std::ofstream(files.stage_path(dir.path() / "b.txt")) << "beta";
    EXPECT_EQ(names_in(dir.path()).size(), 2u);
    EXPECT_TRUE(throws_naming<IoError>([&] { files.stage(dir.path() / "a.txt", "again"); }, {"a.txt", "staged twice"}));
    files.commit();
    EXPECT_EQ(files.size(), 0u);
  }
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"a.txt", "b.txt"}));
  EXPECT_EQ(read_file(dir.path() / "b.txt"), "beta");
  {
    StagedFiles files;
    files.stage(dir.path() / "a.txt", "replaced");
    files.stage(dir.path() / "c.txt", "gamma");
  }  // destroyed without commit
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"a.txt", "b.txt"}));
  EXPECT_EQ(read_file(dir.path() / "a.txt"), "alpha");
}

TEST(StagedFiles, RefusesADirectoryThatDoesNotExist) {
  TempDir dir;
  StagedFiles files;
  EXPECT_TRUE(
      throws_naming<IoError>([&] { files.stage(dir.path() / "no" / "a.txt", "x"); }, {"no/a.txt", "cannot write"}));
}

}  // namespace
}  // namespace qkv
