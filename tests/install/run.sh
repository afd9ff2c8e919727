#!/usr/bin/env bash
# Usage: run.sh BUILD_DIR WORK_DIR CMAKE CXX GENERATOR MAKE_PROGRAM [EXTRA_FLAGS]
# (ctest passes these; see CMakeLists.txt beside this file.)
#
# 1. cmake --install BUILD_DIR into WORK_DIR/prefix (a staging prefix, not the system);
# 2. configures and builds consumer/ with CMAKE_PREFIX_PATH=WORK_DIR/prefix and runs it;
# 3. compiles consumer/pkgconfig_main.cc with `pkg-config --cflags --libs kvwire` and runs it.
set -euo pipefail

build=$1 work=$2 cmake=$3 cxx=$4 generator=$5 make_program=$6 flags=${7:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=$work/prefix

step() { echo "--- install test: $*"; }

rm -rf "$work"
mkdir -p "$work"

step "cmake --install $build --prefix $prefix"
"$cmake" --install "$build" --prefix "$prefix"

step "find_package(kvwire) consumer"
"$cmake" -S "$here/consumer" -B "$work/consumer" -G "$generator" \
  -DCMAKE_MAKE_PROGRAM="$make_program" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags"
# It must have found the staged package, not one installed on the system.
kvwire_dir=$(sed -n 's/^kvwire_DIR:PATH=//p' "$work/consumer/CMakeCache.txt")
if [[ $kvwire_dir != "$prefix"/* ]]; then
  echo "install test: find_package(kvwire) used $kvwire_dir, not the staging prefix" >&2
  exit 1
fi
"$cmake" --build "$work/consumer"
# No LD_LIBRARY_PATH: CMake gives the consumer an RPATH to the imported library.
"$work/consumer/kvwire-consumer"

step "pkg-config consumer"
pc=$(find "$prefix" -name kvwire.pc -print -quit)
[[ -n $pc ]] || { echo "install test: no kvwire.pc under $prefix" >&2; exit 1; }
PKG_CONFIG_PATH=$(dirname "$pc")
export PKG_CONFIG_PATH
pkg_flags=$(pkg-config --cflags --libs kvwire)
echo "pkg-config --cflags --libs kvwire: $pkg_flags"
# shellcheck disable=SC2086  # the flags are meant to split into words
"$cxx" -std=c++17 $flags "$here/consumer/pkgconfig_main.cc" -o "$work/pkgconfig-consumer" \
  $pkg_flags
LD_LIBRARY_PATH=$(pkg-config --variable=libdir kvwire) "$work/pkgconfig-consumer"
