#!/usr/bin/env bash
# The peers' virtual environment for `make compare` (perf/compare/README.md, "The peers"): NIXL
# (nixl-cu12), Mooncake's Transfer Engine (mooncake-transfer-engine-non-cuda) and a current UCX
# (libucx-cu12, for its ucx_perftest) from PyPI, at the versions pinned in constraints.txt.
#
#   scripts/compare-venv.sh [VENV]        (default build/venv-compare; `make compare` runs it)
#
# Each peer installs on its own: one that fails leaves its error in VENV/install-errors/PEER,
# which compare.py prints as that peer's row, and the others still install. A venv whose
# constraints are those of its last install is left as it is.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${1:-build/venv-compare}
STAMP=$VENV/constraints.installed
if [[ -x $VENV/bin/python ]] && cmp -s constraints.txt "$STAMP" && [[ ! -d $VENV/install-errors ]]; then
  exit 0
fi
if ! /usr/bin/python3 -m venv "$VENV"; then
  echo "compare-venv: python3 -m venv $VENV failed (scripts/install-deps.sh --compare installs" \
    "python3-venv)" >&2
  exit 1
fi
rm -rf "$VENV/install-errors"
pip() { "$VENV/bin/pip" install --disable-pip-version-check -q -c constraints.txt "$@"; }
# One peer's packages; its error (the last lines pip printed) kept for compare.py.
install_peer() {
  local peer=$1
  shift
  local log
  log=$(mktemp)
  if ! pip "$@" >"$log" 2>&1; then
    mkdir -p "$VENV/install-errors"
    tail -5 "$log" | tr '\n' ' ' >"$VENV/install-errors/$peer"
    echo "compare-venv: $peer did not install: $(cat "$VENV/install-errors/$peer")" >&2
  fi
  rm -f "$log"
}
# nixl-cu12 declares torch, which would bring ~6 GB of CUDA wheels; NIXL's Python API imports
# torch only when it is handed tensors (never here), so nixl-cu12 goes in without its
# dependencies and numpy, the one it imports, beside it.
install_peer nixl numpy nixl-cu12 --no-deps
install_peer mooncake mooncake-transfer-engine-non-cuda
install_peer ucx libucx-cu12
cp constraints.txt "$STAMP"
