#!/usr/bin/env bash
# Builds (once) the soft-RoCE test VM image under $1 (a folder of the build tree):
#   $1/vmlinuz            the kernel of Debian's current linux-image-amd64 dependency
#   $1/base.cpio.gz       busybox, the rdma_rxe modules, rdma-core userspace, /init
# The kernel package is discovered with apt-cache and fetched with apt-get download (after
# apt-get update if the package lists are missing or stale); nothing is installed.
# Rebuilt only when the kernel version or this folder's scripts change.
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

stamp="$kver $(cat "$here/build_image.sh" "$here/init" | md5sum | cut -c1-16)"
if [[ -f "$out/stamp" && "$(cat "$out/stamp")" == "$stamp" && -f "$out/base.cpio.gz" && -f "$out/vmlinuz" ]]; then
  echo "build_image: cached ($stamp)"
  exit 0
fi
echo "build_image: building for kernel $kver"

# --- kernel ----------------------------------------------------------------------------------
dl=$out/dl
mkdir -p "$dl"
deb=$(ls "$dl"/"${pkg}"_*.deb 2>/dev/null | head -1 || true)
if [[ -z "$deb" ]]; then
  rm -f "$dl"/*.deb
  # apt-get download drops privileges to _apt where it can; a root-owned folder is fine
  # because it then falls back to root (and warns).
  if ! (cd "$dl" && apt-get download -qq "$pkg" 2>"$dl/download.err"); then
    echo "build_image: apt-get download $pkg failed ($(tail -1 "$dl/download.err")); apt-get update and retry" >&2
    apt-get update -qq >/dev/null
    (cd "$dl" && apt-get download -qq "$pkg")
  fi
  deb=$(ls "$dl"/"${pkg}"_*.deb | head -1)
fi
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
         drivers/infiniband/sw/rxe/rdma_rxe drivers/net/dummy; do
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

# rdma-core userspace at its host paths, and iproute2's ip and rdma.
provider=$(ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so | head -1)
[[ -f /etc/libibverbs.d/rxe.driver && -n "$provider" ]] ||
  { echo "build_image: rxe provider missing (install ibverbs-providers)" >&2; exit 1; }
bins=(/usr/bin/ibv_devinfo /usr/bin/ibv_devices /usr/bin/rdma /usr/bin/ip "$provider")
[[ -x /usr/bin/rdma ]] || { echo "build_image: /usr/bin/rdma missing (install iproute2)" >&2; exit 1; }
mkdir -p "$r/etc/libibverbs.d" "$r/usr/lib/x86_64-linux-gnu/libibverbs"
cp /etc/libibverbs.d/rxe.driver "$r/etc/libibverbs.d/"
"$here/copy_with_libs.sh" "$r" "${bins[@]}"
rm -f "$r/bin/ip" "$r/sbin/ip"
echo 'root:x:0:0:root:/root:/bin/sh' > "$r/etc/passwd"
echo 'root:x:0:' > "$r/etc/group"
printf '127.0.0.1 localhost\n' > "$r/etc/hosts"
cp "$here/init" "$r/init"
chmod +x "$r/init"
(cd "$r" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) > "$out/base.cpio.gz.tmp"
mv "$out/base.cpio.gz.tmp" "$out/base.cpio.gz"
rm -rf "$r" "$out/kpkg"
echo "$stamp" > "$out/stamp"
echo "build_image: done ($(du -h "$out/base.cpio.gz" | cut -f1) initramfs, kernel $kver)"
