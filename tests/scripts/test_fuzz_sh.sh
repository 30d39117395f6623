#!/usr/bin/env bash
# scripts/fuzz.sh refuses what is not a target and a whole number of seconds, saying what it takes,
# before it configures or builds anything. (CI runs each target for 30 seconds: .ci/run.)
# Usage: test_fuzz_sh.sh SOURCE_DIR
set -uo pipefail
source_dir=$1
failures=0
for args in "" "npy" "parquet 10" "npy 0" "npy ten" "npy 10 extra"; do
  # shellcheck disable=SC2086
  out=$(bash "$source_dir/scripts/fuzz.sh" $args 2>&1)
  rc=$?
  if [[ $rc -ne 2 ]]; then
    echo "FAIL fuzz.sh ${args:-(no argument)}: exit code $rc, expected 2"
    failures=$((failures + 1))
  elif [[ $out != *"npy, npz, model_file, attention_args or attend_cli"* || $out != *"seconds"* ]]; then
    echo "FAIL fuzz.sh ${args:-(no argument)}: the message does not say what it takes: $out"
    failures=$((failures + 1))
  fi
done
if ((failures > 0)); then
  exit 1
fi
echo "test_fuzz_sh: all checks passed"
