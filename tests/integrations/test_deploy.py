"""deploy/k8s against Kubernetes' schemas and against the server's own contract: the core objects validate for
Kubernetes 1.33 (kubernetes-validate's bundled schemas, strict: no unknown fields), the Gateway API objects carry the
fields the manifests rely on, every container flag parses with the server's CLI, and ports, probe paths, volumes
and metric names match what the server serves and exports."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from loraplex.frontend.entrypoints import native_api
from loraplex.frontend.entrypoints.cli import build_arg_parser
from loraplex.frontend.metrics import Metrics
from loraplex.protocol.config import ServerConfig

from scripts import image

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.33.0"
GATEWAY_KINDS = {("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute")}
EPP_METRIC_FLAGS = ("--total-queued-requests-metric", "--kv-cache-usage-percentage-metric", "--lora-info-metric")


def load_all() -> list[dict]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = load_all()


def one(kind: str, name: str) -> dict:
    found = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def server_config() -> ServerConfig:
    args = container(one("Deployment", "loraplex"))["args"]
    return ServerConfig.from_kwargs(**vars(build_arg_parser().parse_args(args)))


@pytest.mark.parametrize(
    "doc",
    [d for d in DOCS if (d["apiVersion"], d["kind"]) not in GATEWAY_KINDS],
    ids=lambda d: f"{d['kind']}/{d['metadata']['name']}",
)
def test_core_objects_validate(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validator_catches_a_bad_object():  # the check above can fail
    bad = yaml.safe_load(yaml.safe_dump(one("Deployment", "loraplex")))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_every_object_is_known():
    kinds = {(d["apiVersion"], d["kind"]) for d in DOCS}
    assert GATEWAY_KINDS <= kinds
    assert {("apps/v1", "Deployment"), ("v1", "Service")} <= kinds


def test_inference_pool_fields():
    pool = one("InferencePool", "loraplex")
    spec = pool["spec"]
    assert set(spec) == {"targetPorts", "selector", "endpointPickerRef"}
    assert len(spec["targetPorts"]) == 1 and isinstance(spec["targetPorts"][0]["number"], int)
    assert set(spec["selector"]) == {"matchLabels"} and spec["selector"]["matchLabels"]
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"}
    assert ref["failureMode"] in ("FailOpen", "FailClose") and isinstance(ref["port"]["number"], int)


def test_http_route_fields():
    route = one("HTTPRoute", "loraplex")
    (parent,) = route["spec"]["parentRefs"]
    assert parent["kind"] == "Gateway" and parent["group"] == "gateway.networking.k8s.io" and parent["name"]
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        "loraplex",
    )
    for match in rule["matches"]:
        assert match["path"]["type"] in ("Exact", "PathPrefix") and match["path"]["value"].startswith("/")
    assert rule["timeouts"]["request"].endswith("s")


def test_container_flags_parse_with_the_server_cli():
    config = server_config()  # every --flag known, every value valid (ServerConfig validates itself)
    assert config.lora_enabled and config.lora_resolver_dir and config.host == "0.0.0.0"
    bogus = [*container(one("Deployment", "loraplex"))["args"], "--no-such-flag"]
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(bogus)


def test_ports_and_probes_match_the_server():
    config = server_config()
    deployment = one("Deployment", "loraplex")
    c = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == config.port
    served = {(route.method, route.path) for route in native_api.routes}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["port"] in ("http", config.port) and ("GET", get["path"]) in served, probe
    service = one("Service", "loraplex")
    (svc_port,) = service["spec"]["ports"]
    assert svc_port["targetPort"] in ("http", config.port)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    pool = one("InferencePool", "loraplex")["spec"]
    assert pool["targetPorts"][0]["number"] == config.port
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    assert ("GET", "/metrics") in served and config.api_key is None  # the EPP scrapes /metrics without a key


def test_grace_period_outlasts_the_drain():
    config = server_config()
    pod = one("Deployment", "loraplex")["spec"]["template"]["spec"]
    pre_stop = container({"spec": {"template": {"spec": pod}}})["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < pre_stop <= 10  # long enough for the endpoints to drop the pod, short beside the drain
    # The grace period counts from preStop: the sleep, the drain, then stopping the scheduler and workers.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + config.shutdown_timeout + 10


def test_paths_sit_on_volumes():
    config = server_config()
    spec = one("Deployment", "loraplex")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container({"spec": {"template": {"spec": spec}}})["volumeMounts"]}

    def volume_of(path: str) -> dict:
        mount = max((m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")), key=len)
        return volumes[mounts[mount]]

    for path in (config.model_path, config.lora_resolver_dir):
        claim = volume_of(path)["persistentVolumeClaim"]["claimName"]
        one("PersistentVolumeClaim", claim)


def test_endpoint_picker_reads_exported_metrics():
    exported = {m.name for m in Metrics("m").registry.collect()}
    args = container(one("Deployment", "loraplex-epp"))["args"]
    named = {flag_value(args, flag) for flag in EPP_METRIC_FLAGS}
    assert named == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:lora_requests_info"}
    assert named <= exported, named - exported
    assert flag_value(args, "--pool-name") == one("InferencePool", "loraplex")["metadata"]["name"]
    ref = one("InferencePool", "loraplex")["spec"]["endpointPickerRef"]
    epp_service = one("Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    config_map = one("ConfigMap", "loraplex-epp")
    plugins = yaml.safe_load(config_map["data"][Path(flag_value(args, "--config-file")).name])
    assert "lora-affinity-scorer" in {p["type"] for p in plugins["plugins"]}


def containerfile_instruction(name: str) -> str:
    """The argument of the last `NAME ...` instruction of deploy/Containerfile (its final stage's)."""
    lines = [line for line in image.CONTAINERFILE.read_text().splitlines() if line.startswith(name + " ")]
    return lines[-1][len(name) + 1 :]


def test_the_manifest_runs_the_image_the_script_builds():
    c = container(one("Deployment", "loraplex"))
    target = flag_value(c["args"], "--device")  # the GPU pods run the CUDA image
    assert c["image"] == image.default_tag(target) == f"loraplex:{image.version()}-{target}"
    assert c["command"] == json.loads(containerfile_instruction("ENTRYPOINT"))
    # the image's user is a number (runAsNonRoot can only check numbers), and it is not root
    assert c["securityContext"]["runAsNonRoot"] is True
    assert int(containerfile_instruction("USER").split(":")[0]) > 0


def test_the_image_volumes_are_mounted():
    volumes = set(json.loads(containerfile_instruction("VOLUME")))
    mounts = {m["mountPath"] for m in container(one("Deployment", "loraplex"))["volumeMounts"]}
    assert volumes <= mounts
