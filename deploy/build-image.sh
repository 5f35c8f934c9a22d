#!/usr/bin/env bash
# Builds the hookwire server image without a container engine or network:
# a statically linked binary, a scratch base and buildah (Debian package),
# written as an OCI archive, then checks the archive is a valid OCI image.
#
#   deploy/build-image.sh            # -> target/image/hookwire.oci.tar
#   HOOKWIRE_BIN=path/to/hookwire deploy/build-image.sh   # skip cargo
#
# Push it anywhere with skopeo, e.g.
#   skopeo copy oci-archive:target/image/hookwire.oci.tar docker://REGISTRY/hookwire:0.1.0
#
# Needs: cargo, make and a C compiler (jemalloc, SQLite), buildah, python3
# (strip, readelf: binutils); skopeo is used for a second opinion when
# present. Runs as root (buildah's vfs storage
# and chroot isolation need no daemon, no user namespaces, no overlayfs).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

out=${IMAGE_OUT:-target/image}
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
tag=${IMAGE_TAG:-hookwire:$version}
archive="$out/hookwire.oci.tar"
triple="$(uname -m)-unknown-linux-gnu"
# Commit time as the image's creation time: the same commit gives the same
# image digest whenever it is built.
epoch=$(git log -1 --format=%ct 2>/dev/null || echo 0)

step() { printf '==> %s\n' "$*"; }
die() { printf 'build-image: %s\n' "$*" >&2; exit 1; }

command -v buildah >/dev/null || die "buildah not found (apt-get install buildah; or make image, which runs deploy/deps.sh image)"

if [ -z "${HOOKWIRE_BIN:-}" ]; then
    step "cargo build --profile production (static, $triple)"
    # crt-static links glibc into the binary. rustup cannot add a musl target
    # offline, and glibc >= 2.34 resolves names (files, dns) without loading
    # NSS modules, so a static glibc binary runs on an empty image.
    # getrandom finds glibc's getrandom() with dlsym, which a static binary
    # cannot do, and then falls back to /dev/urandom: absent where nothing
    # mounts /dev (this script's chroot smoke test, minimal sandboxes), and
    # the first session id panics. The cfg links getrandom() directly.
    RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static --cfg getrandom_backend=\"linux_getrandom\"" \
        cargo build --profile production --locked --target "$triple" --bin hookwire
    HOOKWIRE_BIN="${CARGO_TARGET_DIR:-target}/$triple/production/hookwire"
fi
[ -x "$HOOKWIRE_BIN" ] || die "no binary at $HOOKWIRE_BIN"
if readelf -l "$HOOKWIRE_BIN" | grep -q 'program interpreter'; then
    die "$HOOKWIRE_BIN is dynamically linked; a scratch image has no loader"
fi

step "staging the root filesystem"
ctx="$out/context"
rm -rf "$ctx"
umask 022
mkdir -p "$ctx/rootfs/usr/local/bin" "$ctx/rootfs/etc/ssl/certs" "$ctx/data"
chmod 0750 "$ctx/data"
# Symbols stay (readable panics); debug info goes (most of the size).
strip --strip-debug -o "$ctx/rootfs/usr/local/bin/hookwire" "$HOOKWIRE_BIN"
# The user named by USER 65532, so tools that map ids to names find one.
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' \
    >"$ctx/rootfs/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$ctx/rootfs/etc/group"
# Kubernetes mounts /etc/hosts and /etc/resolv.conf; this makes the lookup
# order explicit instead of glibc's built-in default.
printf 'hosts: files dns\n' >"$ctx/rootfs/etc/nsswitch.conf"
# TLS to hook servers and model providers (https:// endpoints).
[ -f /etc/ssl/certs/ca-certificates.crt ] || die "no CA bundle (apt-get install ca-certificates)"
cp /etc/ssl/certs/ca-certificates.crt "$ctx/rootfs/etc/ssl/certs/"
cp deploy/images/hookwire-scratch.Dockerfile "$ctx/Dockerfile"
find "$ctx/rootfs" "$ctx/data" -exec touch -h -d "@$epoch" {} +

step "buildah build $tag"
# Private storage under target/: nothing touches the host's image store, and
# vfs works where overlayfs mounts are not allowed.
store="$out/buildah"
rm -rf "$store"
trap 'rm -rf "$store"' EXIT
bah=(buildah --root "$store/root" --runroot "$store/run" --storage-driver vfs)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
"${bah[@]}" build --quiet --isolation chroot --format oci --timestamp "$epoch" \
    --identity-label=false \
    --label "org.opencontainers.image.title=hookwire" \
    --label "org.opencontainers.image.version=$version" \
    --label "org.opencontainers.image.revision=$revision" \
    -f "$ctx/Dockerfile" -t "$tag" "$ctx" >/dev/null
rm -f "$archive"
"${bah[@]}" push --quiet "$tag" "oci-archive:$archive:$tag"

step "checking $archive"
python3 - "$archive" "$tag" <<'EOF'
# Walks the OCI layout (image-spec: index.json -> manifest -> config and
# layers), checking every blob against its digest and size, and the config
# and files a Kubernetes pod relies on.
import gzip, hashlib, io, json, sys, tarfile

path, ref = sys.argv[1], sys.argv[2]
problems = []
with tarfile.open(path) as oci:
    names = set(oci.getnames())
    def blob(desc):
        algo, hexd = desc["digest"].split(":")
        data = oci.extractfile(f"blobs/{algo}/{hexd}").read()
        if hashlib.sha256(data).hexdigest() != hexd or len(data) != desc["size"]:
            problems.append(f"blob {desc['digest']} does not match its digest or size")
        return data
    layout = json.load(oci.extractfile("oci-layout"))
    if layout.get("imageLayoutVersion") != "1.0.0":
        problems.append(f"oci-layout version {layout}")
    index = json.load(oci.extractfile("index.json"))
    (mdesc,) = index["manifests"]
    if mdesc["mediaType"] != "application/vnd.oci.image.manifest.v1+json":
        problems.append(f"manifest media type {mdesc['mediaType']}")
    manifest = json.loads(blob(mdesc))
    config = json.loads(blob(manifest["config"]))
    c = config["config"]
    expect = {
        "os": (config.get("os"), "linux"),
        "user": (c.get("User"), "65532:65532"),
        "entrypoint": (c.get("Entrypoint"), ["/usr/local/bin/hookwire", "serve"]),
        "ports": (sorted(c.get("ExposedPorts", {})), ["50051/tcp", "9464/tcp"]),
        "data dir": ([e for e in c.get("Env", []) if e.startswith("HOOKWIRE_DATA_DIR=")],
                     ["HOOKWIRE_DATA_DIR=/var/lib/hookwire"]),
        "volumes": (sorted(c.get("Volumes") or {}), ["/var/lib/hookwire"]),
    }
    for what, (got, want) in expect.items():
        if got != want:
            problems.append(f"config {what}: {got!r}, expected {want!r}")
    files, packed, unpacked = {}, 0, 0
    for desc, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"]):
        data = blob(desc)
        packed += len(data)
        raw = gzip.decompress(data) if desc["mediaType"].endswith("gzip") else data
        unpacked += len(raw)
        if "sha256:" + hashlib.sha256(raw).hexdigest() != diff_id:
            problems.append(f"layer {desc['digest']} does not match diff_id {diff_id}")
        with tarfile.open(fileobj=io.BytesIO(raw)) as layer:
            files.update({m.name.lstrip("./"): m for m in layer.getmembers()})
    binary = files.get("usr/local/bin/hookwire")
    if binary is None or not binary.mode & 0o111:
        problems.append("layer lacks an executable usr/local/bin/hookwire")
    for f in ("etc/passwd", "etc/group", "etc/ssl/certs/ca-certificates.crt"):
        if f not in files:
            problems.append(f"layer lacks {f}")
    # A bare start writes its SQLite file here, as the server's user.
    data = files.get("var/lib/hookwire")
    if data is None or not data.isdir() or (data.uid, data.gid) != (65532, 65532):
        problems.append("layer lacks var/lib/hookwire as a directory owned by 65532:65532")
if problems:
    sys.exit("OCI image check failed:\n  " + "\n  ".join(problems))
mib = 1024 * 1024
print(f"valid OCI image {ref}: manifest {mdesc['digest']}")
print(f"  {config['architecture']}/{config['os']}, user {c['User']}, entrypoint {' '.join(c['Entrypoint'])}")
print(f"  {len(manifest['layers'])} layer(s): {packed / mib:.1f} MiB compressed, {unpacked / mib:.1f} MiB unpacked;"
      f" binary {binary.size / mib:.1f} MiB")
EOF
if command -v skopeo >/dev/null; then
    skopeo inspect --format 'skopeo: {{.Architecture}}/{{.Os}} digest {{.Digest}} layers {{len .Layers}}' \
        "oci-archive:$archive"
fi

# Run the image's binary from its own root filesystem, as its user, with
# nothing else around it: proves it needs no libc or loader from a base.
if [ "$(id -u)" = 0 ] && command -v chroot >/dev/null; then
    step "smoke test: hookwire --help inside the image's root filesystem"
    chroot --userspec=65532:65532 "$ctx/rootfs" /usr/local/bin/hookwire --help >/dev/null
    # A start as the image runs it (its data directory, no config): the demo
    # agent on SQLite in the image's data directory, on free loopback ports
    # (without auth: hookwire refuses 0.0.0.0).
    step "smoke test: a bare 'hookwire serve' with the image's environment"
    mkdir -p "$ctx/rootfs/var/lib/hookwire"
    chown 65532:65532 "$ctx/rootfs/var/lib/hookwire"
    log="$out/bare-start.log"
    env -i HOOKWIRE_DATA_DIR=/var/lib/hookwire \
        "$(command -v chroot)" --userspec=65532:65532 "$ctx/rootfs" /usr/local/bin/hookwire serve \
        --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 >"$log" 2>&1 &
    served=$!
    for _ in $(seq 100); do
        grep -q "hookwire serving" "$log" && break
        kill -0 "$served" 2>/dev/null || break
        sleep 0.1
    done
    grep -q "hookwire serving" "$log" || { cat "$log" >&2; die "a bare start did not serve"; }
    kill -TERM "$served"
    wait "$served" || die "a bare start did not exit cleanly on SIGTERM"
    [ -f "$ctx/rootfs/var/lib/hookwire/hookwire.db" ] || die "a bare start kept no sessions in /var/lib/hookwire"
fi
printf 'image: %s (%s)\n' "$archive" "$(du -h "$archive" | cut -f1)"
