#!/usr/bin/env bash
# copy_with_libs.sh <root> <file>...: copies each file and every shared library ldd lists for
# it to the same absolute path under <root> (the VM's /lib and /lib64 link into /usr).
set -euo pipefail
root=$1
shift
for f in "$@"; do
  mkdir -p "$root$(dirname "$f")"
  cp -L "$f" "$root$f"
  ldd "$f" 2>/dev/null | grep -o '/[^ ]*' || true
done | sort -u | while read -r lib; do
  dst=$root$lib
  case "$lib" in /lib/*|/lib64/*) dst=$root/usr$lib ;; esac
  [[ -e "$dst" ]] && continue
  mkdir -p "$(dirname "$dst")"
  cp -L "$lib" "$dst"
done
