#!/usr/bin/env python3
"""Checks what schema validation cannot see in a rendered kustomization:
that the pieces point at each other and keep the platform rules.

    kubectl kustomize deploy/k8s/overlays/jaeger | python3 deploy/check_wiring.py NAME

- every Service selects a Deployment whose pods expose each targetPort;
- every ConfigMap a pod mounts is in the render (hashed names line up);
- each hook endpoint and the OTLP endpoint in hookwire's config/env name a
  Service of the render, on a port it exposes (cluster DNS addressing);
- hookwire's probes are native gRPC, and its termination grace period
  covers the preStop pause, server.shutdown_grace and 10s to wind down;
- every pod runs non-root with a read-only root filesystem, no privilege
  escalation and no capabilities;
- no Service relies on session affinity (sessions live in the store);
- the store and the replica count agree: on SQLite (the default: no
  HOOKWIRE_STORE, no postgres `store:`) hookwire runs exactly one replica,
  Recreate strategy, no HorizontalPodAutoscaler, its data dir on a
  PersistentVolumeClaim of the render; on Postgres the URL and password come
  from a Secret (never a literal), an HPA may scale it, and when the Secret
  is in the render its URL names a Service of the render on a port it
  exposes and holds no password.
- security: hookwire authenticates callers (auth.mode is not none), every
  file its config names (tokens, JWKS, certificates) lies under a volume
  mount of its container, a NetworkPolicy guards hookwire and one guards
  each hook server, and cert-manager Certificates name an Issuer of the
  render and a Secret some pod mounts.

Prints one line per failure and exits 1 if there is any. Needs PyYAML
(installed with kubernetes-validate).
"""

from __future__ import annotations

import base64
import re
import sys
from urllib.parse import urlsplit

import yaml


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "stdin"
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    errors: list[str] = []
    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    deployments = by_kind.get("Deployment", {})
    services = by_kind.get("Service", {})
    configmaps = by_kind.get("ConfigMap", {})
    secrets = by_kind.get("Secret", {})
    hpas = by_kind.get("HorizontalPodAutoscaler", {})
    pvcs = by_kind.get("PersistentVolumeClaim", {})

    workloads = list(deployments.values()) + list(by_kind.get("StatefulSet", {}).values())

    def pods_selected(selector: dict) -> list[dict]:
        return [
            dep["spec"]["template"]
            for dep in workloads
            if selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        ]

    for svc in services.values():
        sname = svc["metadata"]["name"]
        if svc["spec"].get("sessionAffinity", "None") != "None":
            errors.append(f"Service {sname}: sessionAffinity must not be needed (sessions live in the store)")
        pods = pods_selected(svc["spec"].get("selector", {}))
        if not pods:
            errors.append(f"Service {sname} selects no Deployment's or StatefulSet's pods")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in pods:
                exposed = {
                    v for c in pod["spec"]["containers"] for p in c.get("ports", [])
                    for v in (p.get("name"), p["containerPort"])
                }
                if target not in exposed:
                    errors.append(f"Service {sname} port {port['port']}: pods expose no port {target!r}")

    def service_port(url: str, what: str) -> None:
        parts = urlsplit(url)
        host = (parts.hostname or "").split(".")[0]
        if host not in services:
            errors.append(f"{what} {url}: no Service named {host!r} in this render")
        elif parts.port not in {p["port"] for p in services[host]["spec"]["ports"]}:
            errors.append(f"{what} {url}: Service {host} has no port {parts.port}")

    for dname, dep in deployments.items():
        pod = dep["spec"]["template"]["spec"]
        for vol in pod.get("volumes", []):
            cm = vol.get("configMap", {}).get("name")
            if cm and cm not in configmaps:
                errors.append(f"Deployment {dname} mounts ConfigMap {cm}, which is not in the render")
        if not pod.get("securityContext", {}).get("runAsNonRoot"):
            errors.append(f"Deployment {dname}: pod securityContext.runAsNonRoot is not true")
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            if not (sc.get("readOnlyRootFilesystem") and sc.get("allowPrivilegeEscalation") is False
                    and sc.get("capabilities", {}).get("drop") == ["ALL"]):
                errors.append(f"Deployment {dname} container {c['name']}: securityContext is not locked down")
            if "resources" not in c or "limits" not in c["resources"]:
                errors.append(f"Deployment {dname} container {c['name']}: no resource limits")

    hookwire = deployments.get("hookwire")
    if hookwire is None:
        errors.append("no Deployment named hookwire")
    else:
        pod = hookwire["spec"]["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "hookwire"]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if "grpc" not in container.get(probe, {}):
                errors.append(f"hookwire {probe} is not a native gRPC probe")
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            service_port(env["OTEL_EXPORTER_OTLP_ENDPOINT"], "OTEL_EXPORTER_OTLP_ENDPOINT")
        cm_name = next(v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v)
        config = yaml.safe_load(configmaps.get(cm_name, {}).get("data", {}).get("config.yaml", "{}"))
        for hook in config.get("hooks", []):
            service_port(hook["endpoint"], f"hook {hook['name']} endpoint")
        mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", [])]
        auth = config.get("auth", {})
        if auth.get("mode", "none") == "none":
            errors.append("hookwire config: auth.mode is none (it would refuse to start on 0.0.0.0)")
        files = [(f"auth.{k}", auth.get(k)) for k in ("tokens_file", "jwks_file")]
        files += [(f"tls.{k}", (config.get("tls") or {}).get(k)) for k in ("cert_file", "key_file", "client_ca_file")]
        for h in config.get("hooks", []):
            files += [(f"hooks[{h['name']}].tls.{k}", (h.get("tls") or {}).get(k)) for k in ("ca_file", "cert_file", "key_file")]
            files.append((f"hooks[{h['name']}].credentials.bearer_token_file",
                          (h.get("credentials") or {}).get("bearer_token_file")))
        for what, path in files:
            if path and not any(path.startswith(m) for m in mounts):
                errors.append(f"hookwire config {what} {path} is under no volume mount of the container")
        check_store(hookwire, container, config, secrets, hpas, pvcs, service_port, errors)
        grace = seconds(config.get("server", {}).get("shutdown_grace", "25s"))
        pause = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        # After the grace, cancelled runs get up to 5s to end, open
        # connections 2s to flush, the trace export up to 5s: leave 15s in
        # all before the kubelet's SIGKILL.
        budget = pod.get("terminationGracePeriodSeconds", 30)
        if budget < pause + grace + 15:
            errors.append(
                f"hookwire terminationGracePeriodSeconds {budget} is under"
                f" preStop {pause}s + shutdown_grace {grace}s + 15s"
            )

    policies = by_kind.get("NetworkPolicy", {}).values()

    def guarded(labels: dict) -> bool:
        return any(p["spec"].get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()
                   and "Ingress" in p["spec"].get("policyTypes", []) for p in policies)

    for dname, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        if (dname == "hookwire" or labels.get("app.kubernetes.io/component") == "hook") and not guarded(labels):
            errors.append(f"Deployment {dname}: no NetworkPolicy limits who reaches it")

    issuers = set(by_kind.get("Issuer", {})) | set(by_kind.get("ClusterIssuer", {}))
    mounted = {v["secret"]["secretName"] for dep in deployments.values()
               for v in dep["spec"]["template"]["spec"].get("volumes", []) if "secret" in v}
    for cname, cert in by_kind.get("Certificate", {}).items():
        spec = cert["spec"]
        if spec.get("issuerRef", {}).get("name") not in issuers:
            errors.append(f"Certificate {cname}: issuerRef names no Issuer of this render")
        secret = spec.get("secretName")
        if not secret:
            errors.append(f"Certificate {cname}: no secretName")
        elif not spec.get("isCA") and secret not in mounted:
            errors.append(f"Certificate {cname}: Secret {secret} is mounted by no pod")
    for iname, issuer in by_kind.get("Issuer", {}).items():
        ca = issuer["spec"].get("ca", {}).get("secretName")
        if ca and not any(c["spec"].get("secretName") == ca and c["spec"].get("isCA")
                          for c in by_kind.get("Certificate", {}).values()):
            errors.append(f"Issuer {iname}: CA Secret {ca} is issued by no CA Certificate here")

    for e in errors:
        print(f"  FAIL {name}: {e}")
    return 1 if errors else 0


def check_store(dep, container, config, secrets, hpas, pvcs, service_port, errors) -> None:
    env = {e["name"]: e for e in container.get("env", [])}
    store = config.get("store")
    url_in_file = store if isinstance(store, str) else (store or {}).get("url", "")
    scaled = [h for h in hpas.values() if h["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]]
    if "HOOKWIRE_STORE" in env or str(url_in_file).startswith("postgres"):
        for var in ("HOOKWIRE_STORE", "PGPASSWORD"):
            e = env.get(var)
            if e is None:
                continue
            if "value" in e:
                errors.append(f"hookwire {var} is a literal; take it from a Secret (secretKeyRef)")
                continue
            ref = e.get("valueFrom", {}).get("secretKeyRef", {})
            secret = secrets.get(ref.get("name"))
            if secret is None:
                continue  # created out of band (overlays/postgres-managed)
            data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
            data.update(secret.get("stringData", {}))
            if ref.get("key") not in data:
                errors.append(f"hookwire {var}: Secret {ref.get('name')} has no key {ref.get('key')!r}")
            elif var == "HOOKWIRE_STORE":
                url = data[ref["key"]]
                parts = urlsplit(url)
                if parts.password:
                    errors.append("hookwire store URL in the Secret carries a password; use PGPASSWORD")
                service_port(url.replace("postgres://", "tcp://", 1), "store URL")
        return
    # SQLite: one writer.
    if dep["spec"].get("replicas") != 1:
        errors.append("hookwire on SQLite must run exactly 1 replica (use a postgres overlay for more)")
    if dep["spec"].get("strategy", {}).get("type") != "Recreate":
        errors.append("hookwire on SQLite needs strategy Recreate (one pod opens the file at a time)")
    if scaled:
        errors.append("hookwire on SQLite must not be scaled by a HorizontalPodAutoscaler")
    data_dir = env.get("HOOKWIRE_DATA_DIR", {}).get("value")
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"].get("volumes", [])}
    vol = vols.get(mounts.get(data_dir or "", ""), {})
    claim = vol.get("persistentVolumeClaim", {}).get("claimName")
    if not data_dir or claim is None:
        errors.append("hookwire on SQLite: HOOKWIRE_DATA_DIR is not on a PersistentVolumeClaim (sessions would not survive the pod)")
    elif claim not in pvcs:
        errors.append(f"hookwire data volume claims {claim}, which is not in the render")


def seconds(text: str) -> float:
    """The subset of humantime durations the shipped configs use: 25s, 1m, 500ms."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m)\s*", str(text))
    if not m:
        raise SystemExit(f"cannot read duration {text!r}")
    return float(m[1]) * {"ms": 0.001, "s": 1, "m": 60}[m[2]]


if __name__ == "__main__":
    sys.exit(main())
