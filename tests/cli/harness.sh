# Sourced by the shell tests of tests/cli: a temporary folder removed on exit, fail() to count a
# failed check with its message, and finish() to report and exit. The tests need $QKV_BIN.
: "${QKV_BIN:?QKV_BIN must name the qkv binary}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# finish NAME: exits 1 naming the count of failed checks, else prints that all passed.
finish() {
  if [[ $failures -gt 0 ]]; then
    echo "$1: $failures check(s) failed" >&2
    exit 1
  fi
  echo "$1: all checks passed"
}
