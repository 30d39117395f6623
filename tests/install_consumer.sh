#!/usr/bin/env bash
# Installs qkv into a fresh prefix and builds examples/consumer against it with
# find_package(qkv CONFIG), as any downstream user would, then runs it.
#   install_consumer.sh full <qkv build dir> <qkv source dir>
#     the build as configured: also checks the installed qkv CLI runs and that README.md's C++
#     example compiles against the installed headers and runs.
#   install_consumer.sh without-viz <qkv build dir> <qkv source dir>
#     configures and builds the library alone with -DQKV_WITH_VIZ=OFF (in a fresh build folder),
#     and checks that neither the library nor the installed headers need cairo, pango or PLplot.
set -euo pipefail
mode=$1
build_dir=$2
source_dir=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ $mode == without-viz ]]; then
  build_dir=$work/build
  cmake -S "$source_dir" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DQKV_WITH_VIZ=OFF \
    -DQKV_BUILD_APPS=OFF -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCH=OFF -DQKV_BUILD_PYTHON=OFF > "$work/qkv-configure.log"
  cmake --build "$build_dir" > "$work/qkv-build.log"
fi

# A libqkv built with sanitizers (the asan preset) needs programs built with them too.
sanitize=$(sed -n 's/^QKV_SANITIZE:STRING=//p' "$build_dir/CMakeCache.txt")
sanitize_flags=${sanitize:+-fsanitize=$sanitize}

cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/qkv/ops/attention.hpp"
# What the layers share among themselves is not part of the installed API.
test ! -e "$work/prefix/include/qkv/core/detail"
test -f "$work/prefix/lib/cmake/qkv/qkvConfig.cmake" || test -f "$work/prefix/lib/x86_64-linux-gnu/cmake/qkv/qkvConfig.cmake"
cmake -S "$source_dir/examples/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_FLAGS="$sanitize_flags" > "$work/configure.log"
cmake --build "$work/consumer" > "$work/build.log"
"$work/consumer/consumer"
libqkv=$(find "$work/prefix" -name 'libqkv.so' | head -1)

if [[ $mode == without-viz ]]; then
  test ! -e "$work/prefix/include/qkv/viz"
  if readelf -d "$libqkv" | grep -E 'NEEDED.*(cairo|pango|plplot)'; then
    echo "install_consumer: libqkv built without viz still needs the libraries above" >&2
    exit 1
  fi
  # A consumer that asks for the viz component is told it is not there.
  mkdir -p "$work/wants-viz"
  printf 'cmake_minimum_required(VERSION 3.25)\nproject(wants_viz LANGUAGES CXX)\nfind_package(qkv CONFIG REQUIRED COMPONENTS viz)\n' \
    > "$work/wants-viz/CMakeLists.txt"
  if cmake -S "$work/wants-viz" -B "$work/wants-viz/build" -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/wants-viz.log" 2>&1; then
    echo "install_consumer: find_package(qkv COMPONENTS viz) succeeded without the viz layer" >&2
    exit 1
  fi
  echo "install_consumer without viz: ok"
  exit 0
fi

"$work/prefix/bin/qkv" --version
# README.md's C++ example, as printed there, compiles against the installed headers and runs.
{
  echo '#include <vector>'
  awk '/^```cpp/{f=1; next} /^```/{f=0} f && /^#include/' "$source_dir/README.md"
  echo 'int main() {'
  awk '/^```cpp/{f=1; next} /^```/{f=0} f && !/^#include/' "$source_dir/README.md"
  echo '}'
} > "$work/readme_example.cpp"
libdir=$(dirname "$libqkv")
# shellcheck disable=SC2086 # no flags: no word
g++ -std=c++20 $sanitize_flags -I"$work/prefix/include" "$work/readme_example.cpp" -L"$libdir" -lqkv -Wl,-rpath,"$libdir" \
  -o "$work/readme_example"
"$work/readme_example"
echo "install_consumer: ok"
