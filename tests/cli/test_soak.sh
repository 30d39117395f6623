#!/usr/bin/env bash
# `qkv soak`: a single case of a fixed seed reruns alone and passes; bad options exit 2 with one
# line.
set -uo pipefail

# shellcheck source=harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"
unset QKV_SIMD_TARGET

run() {
  "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
}

# A timed random run is not part of the suite yet: about 5% of random cases (1 in 20 at seed 7,
# 60 s) exceed the tolerance rule, by 1.1-2.4x on small problems at logits near 1 and by up to 40x
# at logits of 10^3-10^4, on every target. `qkv soak --seed 7 --keep-going` lists them.
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
