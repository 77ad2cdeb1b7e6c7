#!/usr/bin/env bash
# Builds the outbox-relay runtime image from a binary already built on this machine, without
# pulling any base image (FROM scratch + the binary + the libraries `ldd` lists + CA roots).
#
#   docker/build-local-image.sh [BINARY] [TAG]
#     BINARY  default target/release/outbox-relay (cargo build --release -p outbox-relay)
#     TAG     default localhost/outbox-relay:local
#   CONTAINER_ENGINE=podman (default) or docker
#
# Run it like the real image, e.g. (what tests/container.rs does; --runtime runc and the
# ulimits are needed on hosts with hybrid cgroups and a capped RLIMIT_NOFILE, like the CI's):
#   podman --runtime runc run --rm --network host --ulimit nofile=1024:1024 \
#     --ulimit nproc=4096:4096 -e DATABASE_URL=… -e NATS_URL=… localhost/outbox-relay:local
set -euo pipefail
cd "$(dirname "$0")/.."

binary=${1:-target/release/outbox-relay}
tag=${2:-localhost/outbox-relay:local}
engine=${CONTAINER_ENGINE:-podman}
[ -x "$binary" ] || { echo "no binary at $binary: build it with cargo build --release -p outbox-relay" >&2; exit 1; }
command -v "$engine" >/dev/null || { echo "$engine is not installed (apt-get install podman runc)" >&2; exit 1; }

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
rootfs=$context/rootfs
install -D -m 0755 "$binary" "$rootfs/usr/local/bin/outbox-relay"
# Debug information is for profiling on the host, not for the image.
strip --strip-debug "$rootfs/usr/local/bin/outbox-relay"
# Every shared library the binary loads, and the dynamic loader, at their paths.
ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | while read -r lib; do
  install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
done
# CA roots, for TLS to servers whose certificates public CAs signed.
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
install -d "$rootfs/etc" "$rootfs/tmp"
chmod 1777 "$rootfs/tmp"
echo 'relay:x:65532:65532:outbox-relay:/nonexistent:/sbin/nologin' > "$rootfs/etc/passwd"
echo 'relay:x:65532:' > "$rootfs/etc/group"
cp docker/local.Containerfile "$context/Containerfile"
"$engine" build --quiet --tag "$tag" --file "$context/Containerfile" "$context"
