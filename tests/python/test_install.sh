#!/usr/bin/env bash
# `pip install --no-build-isolation .` as README.md and docs/python.md give it, offline (--no-index),
# from a copy of the source tree: into a virtual environment that sees Debian's numpy and torch,
# and into a bare prefix. Each install must import and compute from where it went, not from the
# source or the build tree.
#   test_install.sh <python> <source dir> <configured build dir>
# The build folder is handed to setup.py (QKV_CMAKE_BUILD_DIR) so that the module the suite built is
# reused rather than compiled a second time.
set -euo pipefail
python=$1
source_dir=$2
build_dir=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir "$work/src"
tar -C "$source_dir" --exclude=./build --exclude=./.git --exclude=node_modules --exclude=./qkv.egg-info -cf - . |
  tar -C "$work/src" -xf -
export QKV_CMAKE_BUILD_DIR=$build_dir
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
unset PYTHONPATH

check_import() {  # <interpreter> <directory the package must come from>
  (cd "$work" && "$1" - "$2" <<'PY'
import sys
import numpy as np
import qkv
where = sys.argv[1]
assert qkv.__file__.startswith(where), f"qkv imported from {qkv.__file__}, expected under {where}"
q = np.ones((2, 3, 4), dtype=np.float32)
out = qkv.attention(q, q, q)
assert out.shape == (2, 3, 4) and np.allclose(out, 1.0)
print(f"qkv {qkv.__version__} from {qkv.__file__}: ok")
PY
  )
}

"$python" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install --no-build-isolation --no-index -q "$work/src" > "$work/venv-install.log" 2>&1 ||
  { cat "$work/venv-install.log" >&2; exit 1; }
check_import "$work/venv/bin/python" "$work/venv"
(cd "$work" && "$work/venv/bin/python" -c "import qkv.torch, torch; print('qkv.torch with torch', torch.__version__)")
# Where the build folder has qkv._dist, the install has it too: qkv.dist runs on one rank (MPI
# started by mpi4py alone; as root Open MPI must be told it may).
if grep -q '^QKV_PYTHON_DIST:INTERNAL=ON$' "$build_dir/CMakeCache.txt"; then
  (cd "$work" && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$work/venv/bin/python" - "$work/venv" <<'PY'
import sys
import numpy as np
import qkv.dist
assert qkv.dist.__file__.startswith(sys.argv[1]), f"qkv.dist imported from {qkv.dist.__file__}"
q = np.ones((2, 3, 4), dtype=np.float32)
assert np.allclose(qkv.dist.ring_attention(q, q, q), 1.0)
print(f"qkv.dist from {qkv.dist.__file__}: ok")
PY
  )
fi

"$python" -m pip install --no-build-isolation --no-index -q --prefix "$work/prefix" "$work/src" \
  > "$work/prefix-install.log" 2>&1 || { cat "$work/prefix-install.log" >&2; exit 1; }
# Where a prefix install goes depends on the interpreter's scheme (Debian's adds local/ and
# dist-packages): find it.
package=$(find "$work/prefix" -name __init__.py -path '*/qkv/__init__.py' | head -1)
[[ -n $package ]] || { echo "test_install: no qkv package under $work/prefix" >&2; exit 1; }
site=$(dirname "$(dirname "$package")")
PYTHONPATH=$site check_import "$python" "$site"
