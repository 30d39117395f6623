#!/usr/bin/env bash
# `qkv soak` for a minute with a fixed seed: every case within tolerance on every SIMD target this
# CPU runs, the counts per target printed; a single case reruns alone; bad options exit 2 with one
# line. A fixed seed keeps a failure here reproducible with the command the soak prints.
set -uo pipefail

# shellcheck source=harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"
unset QKV_SIMD_TARGET

run() {
  "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
}

run "$QKV_BIN" soak --seconds 60 --seed 20261201
if [[ $rc -ne 0 ]]; then
  # The soak's own report names the case and the command that repeats it.
  fail "qkv soak --seconds 60 --seed 20261201 exited $rc: $(tail -5 "$tmp/err")"
else
  grep -qE '^soak: seed 20261201, [1-9][0-9]* cases in ' "$tmp/out" || fail "the soak reports its cases: $(cat "$tmp/out")"
  targets=$("$QKV_BIN" --version | sed -nE 's/^SIMD target: [A-Z0-9]+ \(available: (.*)\)$/\1/p')
  IFS=', ' read -r -a targets <<<"$targets"
  for target in "${targets[@]}"; do
    grep -qE "^  $target: [1-9][0-9]* cases × 2 thread counts" "$tmp/out" ||
      fail "no cases counted on $target: $(cat "$tmp/out")"
  done
fi

run "$QKV_BIN" soak --seed 20261201 --case 3 --threads 1
[[ $rc -eq 0 ]] || fail "qkv soak --case 3 exited $rc: $(cat "$tmp/err")"
grep -qE '^soak: seed 20261201, 1 cases in ' "$tmp/out" || fail "--case runs one case: $(cat "$tmp/out")"

for bad in "--seconds -1" "--threads 0" "--seed x"; do
  # shellcheck disable=SC2086
  run "$QKV_BIN" soak $bad
  [[ $rc -eq 2 ]] || fail "qkv soak $bad exited $rc, expected 2"
  [[ $(wc -l <"$tmp/err") -eq 1 ]] || fail "qkv soak $bad: expected a one-line error, got: $(cat "$tmp/err")"
  grep -q -- "${bad%% *}" "$tmp/err" || fail "qkv soak $bad: the error does not name ${bad%% *}: $(cat "$tmp/err")"
done

finish test_soak
