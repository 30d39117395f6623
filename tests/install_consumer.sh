#!/usr/bin/env bash
# Installs the qkv build into a fresh prefix, builds examples/consumer against it with
# find_package(qkv CONFIG), runs it, checks the installed qkv CLI runs, and builds and runs the
# C++ example of README.md against the installed headers.
# Usage: install_consumer.sh <qkv build dir> <qkv source dir>
set -euo pipefail
build_dir=$1
source_dir=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/qkv/attention.hpp"
test -f "$work/prefix/lib/cmake/qkv/qkvConfig.cmake" || test -f "$work/prefix/lib/x86_64-linux-gnu/cmake/qkv/qkvConfig.cmake"
cmake -S "$source_dir/examples/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/consumer" > "$work/build.log"
"$work/consumer/consumer"
"$work/prefix/bin/qkv" --version

# README.md's C++ example, as printed there, compiles against the installed headers and runs.
{
  echo '#include <vector>'
  awk '/^```cpp/{f=1; next} /^```/{f=0} f && /^#include/' "$source_dir/README.md"
  echo 'int main() {'
  awk '/^```cpp/{f=1; next} /^```/{f=0} f && !/^#include/' "$source_dir/README.md"
  echo '}'
} > "$work/readme_example.cpp"
libdir=$(dirname "$(find "$work/prefix" -name 'libqkv.so' | head -1)")
g++ -std=c++20 -I"$work/prefix/include" "$work/readme_example.cpp" -L"$libdir" -lqkv -Wl,-rpath,"$libdir" \
  -o "$work/readme_example"
"$work/readme_example"
echo "install_consumer: ok"
