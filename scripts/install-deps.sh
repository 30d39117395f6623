#!/usr/bin/env bash
# Installs, from Debian 12's archive, whatever qkv needs that is not yet present. One argument says
# for what:
#   demo  what the library and the qkv command line need to build and run (`make demo`)
#   test  that, and everything the tests and benchmarks use besides (`make test`)
# Idempotent: when every package is already installed it only runs dpkg-query (and, for the browser
# test's node modules, compares two timestamps) and exits.
set -euo pipefail

usage="usage: scripts/install-deps.sh demo|test"
if (($# != 1)) || [[ "$1" != demo && "$1" != test ]]; then
  echo "install-deps: expected one argument, demo or test, got ${*:-none}" >&2
  echo "$usage" >&2
  exit 2
fi
mode=$1

packages=(
  # build
  cmake ninja-build g++ make pkg-config
  # libraries the code uses
  libhwy-dev libcli11-dev libfmt-dev
  # heatmaps as images (cairo + pango, CJK glyphs for any token) and the experiments' line plots
  libcairo2-dev libpango1.0-dev fonts-noto-cjk libplplot-dev plplot-driver-cairo
  # the Python package: the pybind11 module, numpy at run time, and what `pip install .` uses offline
  python3-dev pybind11-dev python3-numpy python3-pip python3-setuptools python3-wheel python3-venv
  # ring attention across processes and machines (qkv::dist, qkv attend --distributed): Open MPI,
  # and mpi4py for it from Python (qkv.dist; its C headers build the module qkv._dist)
  libopenmpi-dev openmpi-bin python3-mpi4py
)
if [[ "$mode" == test ]]; then
  packages+=(
    # tests and benchmarks
    libgtest-dev libgmock-dev libbenchmark-dev
    # the independent reference the tests compare against (never linked into the library)
    python3 python3-torch python3-pytest
    # the tutorial notebook, executed headless
    python3-nbconvert python3-ipykernel
    # PyTorch's BLAS for bench/compare_torch.py: without it Debian's torch falls back to the
    # reference BLAS (about 5 GFLOP/s here), which would make PyTorch a straw man
    libopenblas0-pthread
    # the heatmap tests: xmllint for the SVGs, Chromium for the HTML page
    libxml2-utils chromium
    # the readers' fuzz targets (scripts/fuzz.sh): clang's libFuzzer and sanitizer runtimes
    clang libclang-rt-14-dev
  )
  # npm installs the browser-test driver (playwright-core). Node.js may come from elsewhere with its
  # own npm; Debian's npm package is needed only when there is none.
  command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)
fi

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]} > 0)); then
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
fi

[[ "$mode" == test ]] || exit 0

# The browser test's node modules (tests/browser: playwright-core, which drives Debian's Chromium and
# downloads no browser), installed exactly as package-lock.json pins them, and again only when the
# lock file is newer than what is installed.
browser_tests="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/browser"
if [[ ! -d "$browser_tests/node_modules" || "$browser_tests/package-lock.json" -nt "$browser_tests/node_modules" ]]; then
  echo "install-deps: npm ci in tests/browser"
  npm ci --prefix "$browser_tests" --no-audit --no-fund --loglevel=error
  touch "$browser_tests/node_modules"
fi
