#!/usr/bin/env bash
# Installs, from Debian 12's archive, whatever qkv needs to build and test that is not yet present.
# Idempotent: when every package is already installed it only runs dpkg-query and exits.
set -euo pipefail

packages=(
  # build
  cmake ninja-build g++ make pkg-config
  # libraries the code uses
  libhwy-dev libcli11-dev libfmt-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # the independent reference the tests compare against (never linked into the library)
  python3 python3-numpy python3-torch
)

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# apt's progress is long; it is shown only when something fails.
if ! { "${sudo_cmd[@]}" apt-get update -q && "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "install-deps: apt-get failed (see above)" >&2
  exit 1
fi
echo "install-deps: done"
