#!/usr/bin/env bash
# Before/after of two git revisions: each is built in its own folder, then
# perf/before_after.py runs the benchmark set (kvwire-perf tcp and shm at 64 KiB, 1 MiB and
# 4 MiB as `make compare` runs them, and kvwire-transfer-driver's allocations and ns per
# transfer) over both, alternating round by round in one run, and prints the medians, the
# ratio after/before, and a flag on each change worse than 10% (printed, never an exit
# failure: quote the table with the load it prints; a loaded box proves little).
#
#   perf/before_after.sh [--before REV] [--after REV] [--runs N] [--quick] [--jobs N]
#   perf/before_after.sh --builds BEFORE_BUILD_DIR AFTER_BUILD_DIR [--runs N] [--quick]
#
# Defaults: --before HEAD~1 (on main, the previous merge), --after HEAD, --runs 5. A revision
# is checked out with `git worktree` under build-before-after/<rev>/src and built in
# build-before-after/<rev>/build, configured by that revision's scripts/configure.sh (ccache
# with CCACHE_BASEDIR, as the Makefile, so a revision built elsewhere is mostly cache hits).
# Only committed states are compared: commit (or stash) what the "after" side should hold.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
before=HEAD~1 after=HEAD runs=5 quick="" jobs=${JOBS:-2} builds=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --before) before=$2; shift 2 ;;
    --after) after=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --quick) quick=--quick; shift ;;
    --jobs) jobs=$2; shift 2 ;;
    --builds) builds=("$2" "$3"); shift 3 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "before_after.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

TARGETS=(kvwire-perf kvwire-transfer-driver)

# Builds revision $1 and prints its build folder.
build_rev() {
  local rev sha dir
  rev=$1
  sha=$(git -C "$root" rev-parse --short=12 "$rev")
  dir="$root/build-before-after/$sha"
  if [[ ! -d "$dir/src" ]]; then
    mkdir -p "$dir"
    git -C "$root" worktree add --detach "$dir/src" "$sha" >&2
  fi
  if [[ ! -f "$dir/build/build.ninja" ]]; then
    (cd "$dir/src" && CCACHE_BASEDIR="$dir/src" CCACHE_NOHASHDIR=1 \
      scripts/configure.sh "$dir/build" >&2)
  fi
  CCACHE_BASEDIR="$dir/src" CCACHE_NOHASHDIR=1 nice ninja -C "$dir/build" -j"$jobs" \
    "${TARGETS[@]}" >&2
  echo "$dir/build"
}

if [[ ${#builds[@]} -eq 2 ]]; then
  before_dir=${builds[0]} after_dir=${builds[1]}
  labels="before,after"
else
  echo "building $before and $after ($(git -C "$root" rev-parse --short "$before")," \
    "$(git -C "$root" rev-parse --short "$after"))" >&2
  before_dir=$(build_rev "$before")
  after_dir=$(build_rev "$after")
  labels="$(git -C "$root" rev-parse --short "$before"),$(git -C "$root" rev-parse --short "$after")"
fi
echo "before: $before_dir"
echo "after:  $after_dir"
exec python3 "$root/perf/before_after.py" "$before_dir" "$after_dir" --runs "$runs" \
  --labels "$labels" $quick
