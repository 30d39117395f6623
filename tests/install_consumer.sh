#!/usr/bin/env bash
# Installs the qkv build into a fresh prefix, builds examples/consumer against it with
# find_package(qkv CONFIG), runs it, and checks the installed qkv CLI runs.
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
echo "install_consumer: ok"
