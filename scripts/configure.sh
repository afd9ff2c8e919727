#!/usr/bin/env bash
# Usage: scripts/configure.sh BUILD_DIR [CMAKE_ARGS...]
#
# Configures BUILD_DIR with Ninja, once. A tree that is already configured is left alone:
# ninja re-runs cmake by itself when a CMakeLists.txt changes, and re-running cmake on every
# `make` would only cost time. Delete the folder to start over with other arguments.
set -euo pipefail

dir=${1:?build directory}
shift

if [[ -f $dir/build.ninja ]]; then exit 0; fi

args=(-S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}")
# ccache, when installed (KVWIRE_CCACHE=0 turns it off): CI builds three trees from a fresh
# clone on every run, and with ccache all but the first run are mostly cache hits. The
# Makefile sets CCACHE_BASEDIR/CCACHE_NOHASHDIR so that a clone in another folder hits too;
# the prefix map keeps debug info (and so sanitizer stack traces) free of the folder name.
if [[ ${KVWIRE_CCACHE:-1} != 0 ]] && command -v ccache >/dev/null; then
  args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
         "-DCMAKE_C_FLAGS=-fdebug-prefix-map=$PWD=."
         "-DCMAKE_CXX_FLAGS=-fdebug-prefix-map=$PWD=.")
fi
echo "configure: cmake ${args[*]} $*"
cmake "${args[@]}" "$@"
