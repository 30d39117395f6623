# The two commands of README.md. `demo` installs only what the library, the qkv command line and
# the Python package need (scripts/install-deps.sh demo), builds the qkv binary and the Python
# module (build/release/python) and runs the seed's example; `test` installs everything the tests
# use as well (scripts/install-deps.sh test), builds it all and runs every test through CTest.
# Both configure with the `release` CMake preset (Ninja).

JOBS ?= $(shell nproc)
BUILD_DIR := build/release
QKV := $(BUILD_DIR)/apps/qkv

.PHONY: demo test build clean

# A first configure leaves out the tests and benchmarks, whose libraries `demo` does not install;
# a build directory that `make test` configured keeps them.
demo:
	scripts/install-deps.sh demo
	if [ -f $(BUILD_DIR)/CMakeCache.txt ]; then cmake --preset release; \
	else cmake --preset release -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCH=OFF; fi
	cmake --build --preset release -j $(JOBS) --target qkv_cli qkv_python
	$(QKV) demo

test: build
	ctest --preset release -j $(JOBS)

build:
	scripts/install-deps.sh test
	cmake --preset release -DQKV_BUILD_TESTS=ON -DQKV_BUILD_BENCH=ON
	cmake --build --preset release -j $(JOBS)

clean:
	rm -rf build
