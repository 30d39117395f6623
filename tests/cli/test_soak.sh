#!/usr/bin/env bash
# `qkv soak`: the first 600 cases of a fixed seed pass; a single case reruns alone and passes; bad options
# exit 2 with one line.
set -uo pipefail

# shellcheck source=harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"
unset QKV_SIMD_TARGET

run() {
  "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
}

# A fixed count of random cases of a fixed seed on every target and 1 and 2 threads, all within the
# tolerance rule: a count, not a time, so that every machine runs the same cases (40 s to 90 s of
# one core). A failure's report (the case and the command that repeats it) is the message.
# Under the sanitizers (the asan test preset sets QKV_SOAK_CASES) a case runs ten times slower, and
# fewer cases are what they are there for: memory errors, not rounding.
cases=${QKV_SOAK_CASES:-600}
run "$QKV_BIN" soak --seed 20261201 --cases "$cases"
[[ $rc -eq 0 ]] || fail "qkv soak --seed 20261201 --cases $cases exited $rc: $(tail -c 4000 "$tmp/err")"
grep -qE "^soak: seed 20261201, $cases cases in [0-9.]+ s, 0 failed" "$tmp/out" || fail "soak summary: $(cat "$tmp/out")"

run "$QKV_BIN" soak --seed 20261201 --case 3 --threads 1
[[ $rc -eq 0 ]] || fail "qkv soak --case 3 exited $rc: $(cat "$tmp/err")"
grep -qE '^soak: seed 20261201, 1 cases in ' "$tmp/out" || fail "--case runs one case: $(cat "$tmp/out")"

for bad in "--seconds -1" "--threads 0" "--seed x" "--cases -3" "--cases 5 --seconds 5"; do
  # shellcheck disable=SC2086
  run "$QKV_BIN" soak $bad
  [[ $rc -eq 2 ]] || fail "qkv soak $bad exited $rc, expected 2"
  [[ $(wc -l <"$tmp/err") -eq 1 ]] || fail "qkv soak $bad: expected a one-line error, got: $(cat "$tmp/err")"
  grep -q -- "${bad%% *}" "$tmp/err" || fail "qkv soak $bad: the error does not name ${bad%% *}: $(cat "$tmp/err")"
done

finish test_soak
