#!/usr/bin/env bash
# scripts/install-deps.sh installs for `make demo` only what the library and the CLI need, and for
# `make test` the test toolchain too; anything else as its argument is refused. It runs on a copy of
# the script with stand-ins for dpkg-query (nothing is installed), apt-get and npm that only record
# what they were asked, so no package is installed and no real tree is touched.
# Usage: test_install_deps.sh SOURCE_DIR
set -uo pipefail

source_dir=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/repo/scripts" "$tmp/repo/tests/browser" "$tmp/bin"
cp "$source_dir/scripts/install-deps.sh" "$tmp/repo/scripts/"
touch "$tmp/repo/tests/browser/package-lock.json"
for tool in dpkg-query apt-get npm sudo; do
  printf '#!/bin/sh\necho "%s $*" >> "%s/calls"\n' "$tool" "$tmp" >"$tmp/bin/$tool"
  chmod +x "$tmp/bin/$tool"
done
# sudo passes its command on.
printf '#!/bin/sh\n"$@"\n' >"$tmp/bin/sudo"

failures=0
fail() {
  echo "FAIL $1"
  failures=$((failures + 1))
}

run() {
  rm -f "$tmp/calls"
  PATH="$tmp/bin:$PATH" bash "$tmp/repo/scripts/install-deps.sh" "$@" >"$tmp/out" 2>&1
  rc=$?
  installed=$(grep '^apt-get install' "$tmp/calls" 2>/dev/null || true)
}

run demo
[[ $rc -eq 0 ]] || fail "demo: exit code $rc: $(cat "$tmp/out")"
for pkg in cmake g++ libhwy-dev libcli11-dev libfmt-dev libcairo2-dev libplplot-dev pybind11-dev python3-dev python3-numpy python3-pip \
    libopenmpi-dev openmpi-bin python3-mpi4py; do
  [[ " $installed " == *" $pkg "* ]] || fail "demo does not install $pkg: $installed"
done
for pkg in python3-torch python3-pytest python3-nbconvert chromium libgtest-dev libgmock-dev libbenchmark-dev nodejs npm libxml2-utils clang; do
  [[ " $installed " != *" $pkg "* ]] || fail "demo installs $pkg, which only the tests use"
done
grep -q '^npm' "$tmp/calls" 2>/dev/null && fail "demo runs npm"

run test
[[ $rc -eq 0 ]] || fail "test: exit code $rc: $(cat "$tmp/out")"
for pkg in libcli11-dev pybind11-dev python3-torch python3-pytest python3-nbconvert python3-ipykernel chromium libgtest-dev libgmock-dev libbenchmark-dev libxml2-utils clang libclang-rt-14-dev; do
  [[ " $installed " == *" $pkg "* ]] || fail "test does not install $pkg: $installed"
done
grep -q '^npm ci' "$tmp/calls" 2>/dev/null || fail "test does not install the browser test's node modules"

for args in "" "tests" "demo test"; do
  # shellcheck disable=SC2086
  run $args
  [[ $rc -eq 2 ]] || fail "install-deps.sh ${args:-(no argument)}: exit code $rc, expected 2"
  grep -q "demo or test" "$tmp/out" || fail "install-deps.sh ${args:-(no argument)} does not say what it takes"
  [[ -z "$installed" ]] || fail "install-deps.sh ${args:-(no argument)} installed $installed"
done

if ((failures > 0)); then
  echo "test_install_deps: $failures check(s) failed"
  exit 1
fi
echo "test_install_deps: all checks passed"
