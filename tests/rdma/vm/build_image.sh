#!/usr/bin/env bash
# Builds (once) the soft-RoCE test VM image under $1 (a folder of the build tree):
#   $1/vmlinuz            the kernel of Debian's current linux-image-amd64 dependency
#   $1/base.cpio.gz       busybox, the rdma_rxe modules, rdma-core userspace, valgrind
#                         (memcheck only, for the leak check), /init
# The kernel package is discovered with apt-cache; it and valgrind are fetched with apt-get
# download (after apt-get update if the package lists are missing or stale); nothing is
# installed.
# Rebuilt only when the kernel version, the host's glibc or this folder's scripts change.
set -euo pipefail
out=${1:?usage: build_image.sh <cache dir>}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)

kernel_package() {
  apt-cache depends linux-image-amd64 2>/dev/null |
    awk '/Depends: linux-image-[0-9]/ { print $2; exit }'
}
pkg=$(kernel_package || true)
if [[ -z "$pkg" ]]; then
  echo "build_image: linux-image-amd64 unknown to apt-cache; running apt-get update" >&2
  apt-get update -qq >/dev/null
  pkg=$(kernel_package || true)
fi
[[ -n "$pkg" ]] || { echo "build_image: cannot discover the kernel package (apt-cache depends linux-image-amd64)" >&2; exit 1; }
kver=${pkg#linux-image-}

# The image carries the host's glibc (and the debug info of its ld.so): its version counts.
stamp="$kver $(cat "$here/build_image.sh" "$here/init" | md5sum | cut -c1-16) libc6=$(dpkg-query -W -f='${Version}' libc6)"
if [[ -f "$out/stamp" && "$(cat "$out/stamp")" == "$stamp" && -f "$out/base.cpio.gz" && -f "$out/vmlinuz" ]]; then
  echo "build_image: cached ($stamp)"
  exit 0
fi
echo "build_image: building for kernel $kver"

# --- packages --------------------------------------------------------------------------------
dl=$out/dl
mkdir -p "$dl"
# download <package> [version]: prints the path of its .deb in $dl, fetching it once.
download() {
  local deb spec=$1 glob="$1"_*.deb
  if [[ -n "${2:-}" ]]; then
    spec="$1=$2"
    glob="$1_${2#*:}_*.deb"
  fi
  deb=$(ls "$dl"/$glob 2>/dev/null | head -1 || true)
  if [[ -z "$deb" ]]; then
    # apt-get download drops privileges to _apt where it can; a root-owned folder is fine
    # because it then falls back to root (and warns).
    if ! (cd "$dl" && apt-get download -qq "$spec" 2>"$dl/download.err" >&2); then
      echo "build_image: apt-get download $spec failed ($(tail -1 "$dl/download.err")); apt-get update and retry" >&2
      apt-get update -qq >/dev/null
      (cd "$dl" && apt-get download -qq "$spec" >&2)
    fi
    deb=$(ls "$dl"/$glob | head -1)
  fi
  echo "$deb"
}
# Kernel packages of other versions are stale.
for old in "$dl"/linux-image-*.deb; do
  [[ -e "$old" && "$(basename "$old")" != "${pkg}"_* ]] && rm -f "$old"
done
deb=$(download "$pkg")
rm -rf "$out/kpkg"
dpkg-deb -x "$deb" "$out/kpkg"
cp "$out/kpkg/boot/vmlinuz-$kver" "$out/vmlinuz"
msrc=$out/kpkg/lib/modules/$kver/kernel

# --- root file system ----------------------------------------------------------------------
r=$out/rootfs
rm -rf "$r"
mkdir -p "$r"/{bin,sbin,etc,proc,sys,dev,tmp,root,mods,opt,usr/bin,usr/lib/x86_64-linux-gnu,usr/lib64}
ln -s usr/lib "$r/lib"
ln -s usr/lib64 "$r/lib64"
bb=$(command -v busybox)
cp "$bb" "$r/bin/busybox"
for a in $("$r/bin/busybox" --list); do [[ -e "$r/bin/$a" ]] || ln -s busybox "$r/bin/$a"; done

# Modules, in the order init loads them (no modprobe in the VM).
for m in net/ipv4/udp_tunnel net/ipv6/ip6_udp_tunnel crypto/crc32_generic \
         arch/x86/crypto/crc32-pclmul fs/configfs/configfs \
         drivers/infiniband/core/ib_core drivers/infiniband/core/ib_uverbs \
         drivers/infiniband/core/ib_cm drivers/infiniband/core/iw_cm \
         drivers/infiniband/core/rdma_cm drivers/infiniband/core/rdma_ucm \
         drivers/infiniband/sw/rxe/rdma_rxe drivers/net/dummy drivers/net/veth \
         net/sched/sch_netem; do
  name=$(basename "$m")
  if [[ -f "$msrc/$m.ko" ]]; then
    cp "$msrc/$m.ko" "$r/mods/$name.ko"
  elif [[ -f "$msrc/$m.ko.xz" ]]; then
    xz -dc "$msrc/$m.ko.xz" > "$r/mods/$name.ko"
  elif [[ -f "$msrc/$m.ko.zst" ]]; then
    zstd -qdc "$msrc/$m.ko.zst" > "$r/mods/$name.ko"
  else
    echo "build_image: module $m missing from $pkg (built in?)" >&2
  fi
done

# rdma-core userspace at its host paths, and iproute2's ip, rdma and tc (with netem's delay
# distribution table, for the network fault matrix of tests/netfault/).
provider=$(ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so | head -1)
[[ -f /etc/libibverbs.d/rxe.driver && -n "$provider" ]] ||
  { echo "build_image: rxe provider missing (install ibverbs-providers)" >&2; exit 1; }
tc_dist=/usr/lib/x86_64-linux-gnu/tc/normal.dist
bins=(/usr/bin/ibv_devinfo /usr/bin/ibv_devices /usr/bin/rdma /usr/bin/ip /usr/sbin/tc "$provider")
[[ -x /usr/bin/rdma ]] || { echo "build_image: /usr/bin/rdma missing (install iproute2)" >&2; exit 1; }
[[ -x /usr/sbin/tc && -f $tc_dist ]] ||
  { echo "build_image: /usr/sbin/tc or $tc_dist missing (install iproute2)" >&2; exit 1; }
mkdir -p "$r/etc/libibverbs.d" "$r/usr/lib/x86_64-linux-gnu/libibverbs"
cp /etc/libibverbs.d/rxe.driver "$r/etc/libibverbs.d/"
"$here/copy_with_libs.sh" "$r" "${bins[@]}"
mkdir -p "$r$(dirname "$tc_dist")"
cp "$tc_dist" "$r$tc_dist"
rm -f "$r/bin/ip" "$r/sbin/ip"
echo 'root:x:0:0:root:/root:/bin/sh' > "$r/etc/passwd"
echo 'root:x:0:' > "$r/etc/group"
printf '127.0.0.1 localhost\n' > "$r/etc/hosts"
# valgrind, memcheck only (tests/rdma/vm/run_in_vm.sh runs the leak check with it).
vdeb=$(download valgrind)
rm -rf "$out/vpkg"
dpkg-deb -x "$vdeb" "$out/vpkg"
mkdir -p "$r/usr/libexec/valgrind"
cp "$out/vpkg/usr/bin/valgrind.bin" "$r/usr/bin/valgrind"
for f in memcheck-amd64-linux vgpreload_core-amd64-linux.so vgpreload_memcheck-amd64-linux.so \
         default.supp; do
  cp "$out/vpkg/usr/libexec/valgrind/$f" "$r/usr/libexec/valgrind/"
done
ldd "$out/vpkg/usr/bin/valgrind.bin" | grep -q 'libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6' ||
  { echo "build_image: valgrind.bin needs more than libc (see ldd)" >&2; exit 1; }
# memcheck must redirect ld.so's strlen, which Debian strips: the debug file of the host's
# ld.so (the image runs the host's glibc) from libc6-dbg of exactly that version.
ldso=$(readlink -f /lib64/ld-linux-x86-64.so.2)
build_id=$(readelf -n "$ldso" | awk '/Build ID:/ { print $3; exit }')
[[ -n "$build_id" ]] || { echo "build_image: no build id in $ldso" >&2; exit 1; }
ddeb=$(download libc6-dbg "$(dpkg-query -W -f='${Version}' libc6)")
dbg=usr/lib/debug/.build-id/${build_id:0:2}/${build_id:2}.debug
dpkg-deb --fsys-tarfile "$ddeb" | tar -x -C "$out/vpkg" "./$dbg" ||
  { echo "build_image: $dbg (ld.so debug info) missing from $(basename "$ddeb")" >&2; exit 1; }
mkdir -p "$r/$(dirname "$dbg")"
cp "$out/vpkg/$dbg" "$r/$dbg"
cp "$here/init" "$r/init"
chmod +x "$r/init"
(cd "$r" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) > "$out/base.cpio.gz.tmp"
mv "$out/base.cpio.gz.tmp" "$out/base.cpio.gz"
rm -rf "$r" "$out/kpkg" "$out/vpkg"
echo "$stamp" > "$out/stamp"
echo "build_image: done ($(du -h "$out/base.cpio.gz" | cut -f1) initramfs, kernel $kver)"
