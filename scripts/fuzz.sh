#!/usr/bin/env bash
# Runs one libFuzzer target (a file reader, the attention API's argument checks, or the CLI's
# attend and attend-backward on arguments and files of the fuzzer's making) for a while:
#   scripts/fuzz.sh npy|npz|model_file|attention_args|attend_cli SECONDS
# It builds the target in build/fuzz (clang; every object with the fuzzer's coverage and ASan +
# UBSan, which abort on the first error; the kernels for Highway's scalar target alone, because what
# the fuzzers look for, input that a reader or an argument check gets wrong, is the same on every
# target, while each SIMD target's kernels run under ASan + UBSan in the asan preset's suite and its
# `qkv soak`: all of them made this build 14 minutes of CI's hour, the scalar one 2), starts from
# the committed seed corpus tests/fuzz/corpus/TARGET (and its dictionary tests/fuzz/TARGET.dict),
# keeps what it finds in a scratch corpus that is removed afterwards, and prints libFuzzer's final
# figures: executions, executions per second and coverage. A crash leaves its input as
# build/fuzz/crash-* and exits non-zero; turn it into a regression test.
set -euo pipefail

usage="usage: scripts/fuzz.sh npy|npz|model_file|attention_args|attend_cli SECONDS"
if (($# != 2)) || [[ ! "$1" =~ ^(npy|npz|model_file|attention_args|attend_cli)$ ]] || [[ ! "$2" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: expected a target (npy, npz, model_file, attention_args or attend_cli) and a whole number of" \
    "seconds, got: ${*:-nothing}" >&2
  echo "$usage" >&2
  exit 2
fi
target=$1
seconds=$2
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build/fuzz"
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -DHWY_COMPILE_ONLY_SCALAR"

# Configured every time (a second or two), so that a build tree made with other flags takes these.
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="$flags" -DQKV_WITH_VIZ=ON -DQKV_BUILD_APPS=OFF -DQKV_BUILD_TESTS=OFF \
  -DQKV_BUILD_BENCH=OFF -DQKV_BUILD_PYTHON=OFF -DQKV_BUILD_FUZZ=ON > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log" >&2; exit 1; }
cmake --build "$build" --target "fuzz_$target" > "$build.build.log" 2>&1 || { cat "$build.build.log" >&2; exit 1; }

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
dictionary=()
[[ -f "$root/tests/fuzz/$target.dict" ]] && dictionary=(-dict="$root/tests/fuzz/$target.dict")
# -rss_limit_mb: a reader must refuse a huge shape before allocating it, so an input that makes it
# allocate gigabytes is a finding; -max_len: the readers' interesting structure fits in 64 KiB.
# The CLI's inputs are kept to 16 KiB, whose arrays attend in well under a second whatever their
# shapes, and its messages go nowhere (-close_fd_mask: libFuzzer keeps its own report).
options=(-max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$build/")
if [[ $target == attend_cli ]]; then
  options+=(-max_len=16384 -close_fd_mask=3)
else
  options+=(-max_len=65536)
fi
cd "$build"
"./tests/fuzz/fuzz_$target" "$scratch" "$root/tests/fuzz/corpus/$target" "${dictionary[@]}" "${options[@]}" \
  2>"$scratch.log" ||
  { tail -60 "$scratch.log" >&2; rm -f "$scratch.log"; exit 1; }
grep -E "^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::new_units_added|stat::peak_rss_mb)" \
  "$scratch.log" | sed "s/^/fuzz $target: /"
rm -f "$scratch.log"
