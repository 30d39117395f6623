#!/usr/bin/env bash
# The instruction-set switch: `qkv --version` names the CPU, its caches and the SIMD target in use;
# QKV_SIMD_TARGET and --simd-target choose any target this CPU runs (any case), and every other
# value is refused with exit code 2 and one line naming the variable or the option. The targets
# come from the CPU at hand (`--version` lists them), so nothing here names one CPU's setting.
set -uo pipefail

# shellcheck source=harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"
# This test sets the variable itself; what it finds is the CPU's own list.
unset QKV_SIMD_TARGET

run() {
  "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
}

run "$QKV_BIN" --version
[[ $rc -eq 0 ]] || fail "qkv --version exited $rc: $(cat "$tmp/err")"
grep -qE '^CPU: .+; caches L1d .+, L2 .+, L3 .+$' "$tmp/out" || fail "--version names the CPU and caches: $(cat "$tmp/out")"
available=$(sed -nE 's/^SIMD target: ([A-Z0-9]+) \(available: (.*)\)$/\2/p' "$tmp/out")
best=$(sed -nE 's/^SIMD target: ([A-Z0-9]+) \(available: .*\)$/\1/p' "$tmp/out")
[[ -n $available && -n $best ]] || fail "--version names the target in use and the available ones: $(cat "$tmp/out")"
IFS=', ' read -r -a targets <<<"$available"
[[ ${targets[0]:-} == "$best" ]] || fail "the best available target runs by default: $best, not ${targets[0]:-none}"

for target in "${targets[@]}"; do
  lower=$(echo "$target" | tr '[:upper:]' '[:lower:]')
  run env QKV_SIMD_TARGET="$lower" "$QKV_BIN" --version
  grep -q "^SIMD target: $target " "$tmp/out" || fail "QKV_SIMD_TARGET=$lower runs $target: $(cat "$tmp/out" "$tmp/err")"
  run "$QKV_BIN" --simd-target "$lower" --version
  grep -q "^SIMD target: $target " "$tmp/out" || fail "--simd-target $lower runs $target: $(cat "$tmp/out" "$tmp/err")"
  # After the subcommand too, and the kernels really run it.
  run "$QKV_BIN" bench --T 16 --d 4 --heads 1 --repeats 1 --baselines none --json --simd-target "$lower"
  grep -q "\"simd\": \"$target\"" "$tmp/out" || fail "bench --simd-target $lower runs $target: $(cat "$tmp/out" "$tmp/err")"
done

# Refusals: exit 2, one line on stderr naming where the value came from and the choices.
expect_refusal() {
  local what=$1 name=$2
  shift 2
  run "$@"
  [[ $rc -eq 2 ]] || fail "$what: expected exit 2, got $rc"
  [[ $(wc -l <"$tmp/err") -eq 1 ]] || fail "$what: expected one line on stderr, got: $(cat "$tmp/err")"
  grep -q -- "$name" "$tmp/err" || fail "$what: the message names $name: $(cat "$tmp/err")"
  grep -q "${targets[0]}" "$tmp/err" || fail "$what: the message lists the choices: $(cat "$tmp/err")"
  [[ ! -s $tmp/out ]] || fail "$what: nothing on stdout, got $(cat "$tmp/out")"
}
expect_refusal "QKV_SIMD_TARGET=bogus" QKV_SIMD_TARGET env QKV_SIMD_TARGET=bogus "$QKV_BIN" bench --T 16 --repeats 1
expect_refusal "--simd-target bogus" --simd-target "$QKV_BIN" --simd-target bogus bench --T 16 --repeats 1
# A target the kernels were compiled for that this CPU cannot run, where there is one.
for compiled in AVX3 AVX2 SSE4; do
  [[ " ${targets[*]} " == *" $compiled "* ]] && continue
  expect_refusal "QKV_SIMD_TARGET=$compiled" QKV_SIMD_TARGET env QKV_SIMD_TARGET=$compiled "$QKV_BIN" --version
  grep -q "cannot run" "$tmp/err" || fail "QKV_SIMD_TARGET=$compiled: says this CPU cannot run it: $(cat "$tmp/err")"
done

# With the variable set, what lies above it is no longer listed.
lowest=${targets[-1]}
run env QKV_SIMD_TARGET="$lowest" "$QKV_BIN" --version
grep -q "^SIMD target: $lowest (available: $lowest)$" "$tmp/out" || fail "QKV_SIMD_TARGET=$lowest caps the list: $(cat "$tmp/out")"

finish test_simd_target
