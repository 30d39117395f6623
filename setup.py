"""Builds the extension module qkv._qkv with the project's CMake (bindings/python) for pip.

The package metadata is in pyproject.toml; this file only tells setuptools how to make the one
extension: configure a build folder with the library, the CLI and the tests off, build the target
qkv_python and copy the module where setuptools packs it. The version is CMake's project version.

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


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        given = os.environ.get("QKV_CMAKE_BUILD_DIR")
        build_dir = Path(given).resolve() if given else Path(self.build_temp).resolve() / "cmake"
        if not given:
            subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
                            "-DCMAKE_BUILD_TYPE=Release", "-DQKV_BUILD_APPS=OFF", "-DQKV_BUILD_TESTS=OFF",
                            "-DQKV_BUILD_BENCH=OFF", "-DQKV_BUILD_PYTHON=ON",
                            f"-DPython3_EXECUTABLE={sys.executable}"], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "qkv_python", "-j", str(os.cpu_count() or 1)],
                       check=True)
        built = sorted((build_dir / "python" / "qkv").glob("_qkv*.so"))
        if len(built) != 1:
            raise RuntimeError(f"{build_dir}/python/qkv: expected one _qkv*.so, found {len(built)}")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)


setup(version=project_version(), ext_modules=[Extension("qkv._qkv", sources=[])], cmdclass={"build_ext": CMakeBuild})
