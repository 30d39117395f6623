"""Builds the extension modules qkv._qkv and, where it can, qkv._dist with the project's CMake
(bindings/python) for pip.

The package metadata is in pyproject.toml; this file only tells setuptools how to make the
extensions: configure a build folder with the library, the CLI and the tests off, build the target
qkv_python and copy the module where setuptools packs it. The version is CMake's project version.
qkv._dist (ring attention on mpi4py communicators, qkv.dist) is built too where CMake found Open
MPI and mpi4py's C headers for this interpreter, and left out, saying so, where it did not: the
package then installs without it, and `import qkv.dist` says why it cannot.

QKV_CMAKE_BUILD_DIR names an already configured build folder (e.g. build/release of `make test`)
to build the module in instead of a fresh one: nothing is recompiled that is up to date there.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def project_version():
    text = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    match = re.search(r"project\(qkv VERSION ([0-9.]+)", text)
    if not match:
        raise RuntimeError("CMakeLists.txt: no `project(qkv VERSION x.y.z` line to take the version from")
    return match.group(1)


# Each extension module and the CMake target that builds it.
TARGETS = {"qkv._qkv": "qkv_python", "qkv._dist": "qkv_python_dist"}


def dist_configured(build_dir: Path) -> bool:
    """Whether CMake configured qkv._dist in build_dir (bindings/python/CMakeLists.txt)."""
    cache = (build_dir / "CMakeCache.txt").read_text(encoding="utf-8")
    return re.search(r"^QKV_PYTHON_DIST:INTERNAL=ON$", cache, re.MULTILINE) is not None


class CMakeBuild(build_ext):
    def build_extensions(self):
        given = os.environ.get("QKV_CMAKE_BUILD_DIR")
        self.cmake_dir = Path(given).resolve() if given else Path(self.build_temp).resolve() / "cmake"
        if not given:
            subprocess.run(["cmake", "-S", str(ROOT), "-B", str(self.cmake_dir), "-G", "Ninja",
                            "-DCMAKE_BUILD_TYPE=Release", "-DQKV_BUILD_APPS=OFF", "-DQKV_BUILD_TESTS=OFF",
                            "-DQKV_BUILD_BENCH=OFF", "-DQKV_BUILD_PYTHON=ON",
                            f"-DPython3_EXECUTABLE={sys.executable}"], check=True)
        if not dist_configured(self.cmake_dir):
            print("qkv._dist is not built: CMake found no Open MPI or no mpi4py C headers for this interpreter "
                  "(Debian: libopenmpi-dev, python3-mpi4py); qkv installs without qkv.dist", file=sys.stderr)
            self.extensions = [ext for ext in self.extensions if ext.name != "qkv._dist"]
        super().build_extensions()

    def build_extension(self, ext):
        subprocess.run(["cmake", "--build", str(self.cmake_dir), "--target", TARGETS[ext.name], "-j",
                        str(os.cpu_count() or 1)], check=True)
        name = ext.name.split(".")[-1]
        built = sorted((self.cmake_dir / "python" / "qkv").glob(f"{name}*.so"))
        if len(built) != 1:
            raise RuntimeError(f"{self.cmake_dir}/python/qkv: expected one {name}*.so, found {len(built)}")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)


setup(version=project_version(), ext_modules=[Extension(name, sources=[]) for name in TARGETS],
      cmdclass={"build_ext": CMakeBuild})
