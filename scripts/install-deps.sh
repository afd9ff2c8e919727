#!/usr/bin/env bash
# Installs the Debian packages kvwire needs to build and test. Idempotent and quiet when
# everything is present; run as root (or via sudo) on Debian 12.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config make git
  libboost-dev libboost-system-dev
  libprotobuf-dev protobuf-compiler
  libabsl-dev
  libgtest-dev libgmock-dev
  libibverbs-dev librdmacm-dev rdma-core
  libssl-dev
  clang libclang-rt-14-dev clang-format
)
if [[ $# -gt 0 ]]; then packages+=("$@"); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "install-deps: installing ${missing[*]}" >&2
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
