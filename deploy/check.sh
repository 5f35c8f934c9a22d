#!/usr/bin/env bash
# Offline checks of everything under deploy/ (the body of `make deploy-check`):
#   1. render base and every overlay with `kubectl kustomize`;
#   2. validate each render against the Kubernetes OpenAPI schemas, strictly
#      (unknown fields are errors), for the oldest and newest versions we
#      support (kubernetes-validate bundles the schemas: no cluster needed);
#   3. check the wiring inside each render (deploy/check_wiring.py);
#   4. check the shipped hookwire configs with `hookwire config check`;
#   5. lint every Dockerfile with hadolint.
# Exits non-zero on the first failing step; prints what it checked.
# The tools come from the project's virtualenv: install them with `make deps`.
set -euo pipefail

deploy=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$deploy")
cd "$root"
# Run by hand too, not only from make: the pinned tools win over the machine's.
PATH=$root/.venv/bin:$PATH

# 1.30 is the floor: preStop `sleep` (beta, on by default) first appears there.
KUBE_VERSIONS=${KUBE_VERSIONS:-"1.30.0 1.37.0"}
KUBECTL=${KUBECTL:-kubectl}

die() { printf 'deploy-check: FAIL: %s\n' "$*" >&2; exit 1; }
for tool in "$KUBECTL" kubernetes-validate hadolint python3; do
    command -v "$tool" >/dev/null || die "$tool not found: run make deps"
done

# The version this tree builds: deploy/build-image.sh tags the image with it,
# and every manifest must run exactly that release.
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
[ -n "$version" ] || die "no version in Cargo.toml"

renders=$(mktemp -d)
trap 'rm -rf "$renders"' EXIT

printf 'deploy-check: kubectl %s, kubernetes-validate %s, %s\n' \
    "$("$KUBECTL" version --client -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])')" \
    "$(kubernetes-validate --version)" "$(hadolint --version)"

for dir in deploy/k8s/base deploy/k8s/overlays/*/; do
    dir=${dir%/}
    name=$(basename "$dir")
    out="$renders/$name.yaml"
    "$KUBECTL" kustomize "$dir" >"$out" || die "kubectl kustomize $dir"
    kinds=$(python3 -c '
import collections, sys, yaml
c = collections.Counter(d["kind"] for d in yaml.safe_load_all(open(sys.argv[1])) if d)
print(", ".join(f"{n} {k}" for k, n in sorted(c.items())))' "$out")
    printf 'render   %-28s %s\n' "$dir" "$kinds"
    # cert-manager's kinds have no schema in kubernetes-validate: they are
    # checked by check_wiring.py (issuers, secrets, mounts) instead.
    python3 -c '
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
core = [d for d in docs if not d["apiVersion"].startswith("cert-manager.io/")]
yaml.safe_dump_all(core, open(sys.argv[2], "w"), sort_keys=False)' "$out" "$out.core"
    for v in $KUBE_VERSIONS; do
        # --quiet prints only problems; a warning (e.g. a deprecated API)
        # counts as a failure too.
        report=$(kubernetes-validate --strict --quiet --kubernetes-version "$v" "$out.core" 2>&1) \
            || die "kubernetes-validate $v $dir:"$'\n'"$report"
        [ -z "$report" ] || die "kubernetes-validate $v $dir:"$'\n'"$report"
    done
    printf 'validate %-28s strict, Kubernetes %s\n' "$dir" "${KUBE_VERSIONS// /, }"
    python3 "$deploy/check_wiring.py" "$dir" <"$out" || die "wiring of $dir"
    stale=$(grep -E '^ *image: hookwire' "$out" | grep -vE ":$version\$" || true)
    [ -z "$stale" ] || die "$dir runs images not tagged $version (Cargo.toml's version):"$'\n'"$stale"
    printf 'wiring   %-28s services, ports, config, probes, securityContext, store, auth, policies, certificates, images :%s\n' "$dir" "$version"
done

# The configs are checked by hookwire's own loader (unknown fields, dangling
# references, bad durations): HOOKWIRE_BIN, else a built binary in target/.
# Without one the check fails: a skipped step must not end in "OK".
bin=${HOOKWIRE_BIN:-}
if [ -z "$bin" ]; then
    for b in target/debug/hookwire target/release/hookwire target/production/hookwire; do
        [ -x "$b" ] && bin=$b && break
    done
fi
configs=$(find deploy/k8s -name config.yaml | sort)
if [ -n "$bin" ]; then
    # A checker that accepts anything proves nothing: it must reject this.
    printf 'agents: []\nnot_a_field: 1\n' >"$renders/invalid.yaml"
    if "$bin" config check "$renders/invalid.yaml" >/dev/null 2>&1; then
        die "$bin config check accepted an invalid config"
    fi
    for c in $configs; do
        # --skip-files: the tokens and certificates the configs name live in
        # the pod (Secrets), not here; check_wiring.py checks they are mounted.
        "$bin" config check --skip-files "$c" >/dev/null || die "hookwire config check $c"
        printf 'config   %-28s hookwire config check --skip-files\n' "$c"
    done
else
    die "no hookwire binary to check the configs with: build one (cargo build) or set HOOKWIRE_BIN"
fi

for f in deploy/Dockerfile deploy/images/*.Dockerfile; do
    hadolint "$f" || die "hadolint $f"
    printf 'lint     %-28s hadolint clean\n' "$f"
done
printf 'deploy-check: OK\n'
