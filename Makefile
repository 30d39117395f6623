# The two commands of README.md. Both install what is missing (scripts/install-deps.sh), configure
# with the `release` CMake preset (Ninja) and build; then `demo` runs the seed's example and `test`
# runs every test through CTest.

JOBS ?= $(shell nproc)
BUILD_DIR := build/release
QKV := $(BUILD_DIR)/apps/qkv

.PHONY: demo test build deps clean

demo: build
	$(QKV) demo

test: build
	ctest --preset release -j $(JOBS)

build: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)

deps:
	scripts/install-deps.sh

clean:
	rm -rf build
