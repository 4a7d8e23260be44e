"""Static checks of deploy/: no Docker engine runs here, so parse and cross-check every file."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yaml"
SCHEMA = Path(__file__).parent / "data" / "compose-spec-subset.json"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
PIPELINE_PARTS = ("receivers", "processors", "exporters")


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _interpolate(text: str) -> str:
    """Compose's ``${VAR:-default}`` with no VAR set, as ``docker compose config`` would resolve it."""
    return re.sub(r"\$\{[A-Z_][A-Z0-9_]*:-([^}]*)\}", r"\1", text)


def _compose() -> dict:
    return yaml.safe_load(_interpolate(COMPOSE.read_text()))


def _k8s_docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def _k8s_find(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _mounts(service: dict) -> dict[str, str]:
    """container path -> host source of a service's bind/volume mounts."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        out[target] = source
    return out


def pipeline_problems(config: dict) -> list[str]:
    """Collector config errors: pipelines naming undefined components, defined ones never used."""
    problems = []
    used: dict[str, set[str]] = {part: set() for part in PIPELINE_PARTS}
    pipelines = (config.get("service") or {}).get("pipelines") or {}
    if not pipelines:
        problems.append("no service.pipelines")
    for pname, pipeline in pipelines.items():
        for part in PIPELINE_PARTS:
            for component in pipeline.get(part) or []:
                used[part].add(component)
                if component not in (config.get(part) or {}):
                    problems.append(f"pipeline {pname} names undefined {part[:-1]} {component!r}")
        if not pipeline.get("receivers") or not pipeline.get("exporters"):
            problems.append(f"pipeline {pname} needs receivers and exporters")
    for part in PIPELINE_PARTS:
        for component in set(config.get(part) or {}) - used[part]:
            problems.append(f"{part[:-1]} {component!r} defined but unused")
    for ext in (config.get("service") or {}).get("extensions") or []:
        if ext not in (config.get("extensions") or {}):
            problems.append(f"service names undefined extension {ext!r}")
    return problems


def test_every_yaml_file_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 7
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), path


def test_compose_matches_compose_spec_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(_compose(), schema)


def test_schema_rejects_a_misspelt_key() -> None:
    # The schema must be able to fail: a typo inside a service is caught.
    bad = _compose()
    bad["services"]["jaeger"]["port"] = ["16686:16686"]
    with pytest.raises(jsonschema.ValidationError, match="port"):
        jsonschema.validate(bad, json.loads(SCHEMA.read_text()))


def test_compose_images_are_pinned_and_stack_is_complete() -> None:
    services = _compose()["services"]
    images = {name: svc["image"] for name, svc in services.items()}
    for name, image in images.items():
        tag = image.rsplit(":", 1)[1]
        assert tag != "latest" and re.match(r"^v?\d+\.\d+\.\d+$", tag), f"{name}: unpinned {image}"
    repos = {image.rsplit(":", 1)[0] for image in images.values()}
    assert {
        "otel/opentelemetry-collector-contrib",
        "jaegertracing/jaeger",
        "grafana/tempo",
        "grafana/grafana",
    } <= repos
    assert images["jaeger"].rsplit(":", 1)[1].startswith("2."), "Jaeger v2 expected"


def test_compose_ports() -> None:
    services = _compose()["services"]
    published = {
        svc_name: {p.rsplit(":", 2)[-1] for p in svc.get("ports", [])}
        for svc_name, svc in services.items()
    }
    assert {"4317", "4318"} <= published["otel-collector"]
    assert "16686" in published["jaeger"]
    assert "3000" in published["grafana"]
    for svc in services.values():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{port}: publish on loopback by default"


def test_compose_mounts_point_at_existing_files() -> None:
    services = _compose()["services"]
    named_volumes = set(_compose().get("volumes", {}))
    for name, svc in services.items():
        for target, source in _mounts(svc).items():
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} missing"
            else:
                assert source in named_volumes, f"{name}: undeclared volume {source}"
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown service {dep}"


def _config_mounted_at(service: dict, flag_prefix: str) -> Path:
    """The deploy/ file a service's ``--config=...`` style argument points at, through its mounts."""
    (arg,) = [a for a in service["command"] if a.startswith(flag_prefix)]
    container_path = arg.split("=", 1)[1]
    return DEPLOY / _mounts(service)[container_path]


def test_collector_pipelines_name_only_defined_components() -> None:
    config = _load(_config_mounted_at(_compose()["services"]["otel-collector"], "--config="))
    assert pipeline_problems(config) == []
    traces = config["service"]["pipelines"]["traces"]
    assert traces["processors"][0] == "memory_limiter", "memory_limiter must come first"
    assert traces["processors"][-1] == "batch"
    assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}


def test_pipeline_check_can_fail() -> None:
    config = _load(DEPLOY / "otel-collector.yaml")
    config["service"]["pipelines"]["traces"]["exporters"].append("otlp_grpc/missing")
    del config["processors"]["batch"]
    problems = pipeline_problems(config)
    assert "pipeline traces names undefined exporter 'otlp_grpc/missing'" in problems
    assert "pipeline traces names undefined processor 'batch'" in problems


def test_collector_exporters_reach_compose_backends() -> None:
    compose = _compose()
    config = _load(DEPLOY / "otel-collector.yaml")
    targets = {}
    for exporter in config["exporters"].values():
        host, port = exporter["endpoint"].rsplit(":", 1)
        targets[host] = port
    assert set(targets) == {"jaeger", "tempo"}
    jaeger = _load(_config_mounted_at(compose["services"]["jaeger"], "--config="))
    tempo = _load(_config_mounted_at(compose["services"]["tempo"], "-config.file="))
    assert jaeger["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":" + targets["jaeger"])
    assert tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(
        ":" + targets["tempo"]
    )
    for host, port in targets.items():
        assert port in [str(p) for p in compose["services"][host]["expose"]]


def test_jaeger_config_is_consistent() -> None:
    jaeger = _load(DEPLOY / "jaeger.yaml")
    assert pipeline_problems(jaeger) == []
    backends = jaeger["extensions"]["jaeger_storage"]["backends"]
    assert jaeger["extensions"]["jaeger_query"]["storage"]["traces"] in backends
    assert jaeger["exporters"]["jaeger_storage_exporter"]["trace_storage"] in backends
    assert jaeger["extensions"]["jaeger_query"]["http"]["endpoint"].endswith(":16686")


def test_grafana_datasource_points_at_tempo_service() -> None:
    compose = _compose()
    grafana = compose["services"]["grafana"]
    provisioning = DEPLOY / _mounts(grafana)["/etc/grafana/provisioning"]
    (ds_file,) = sorted((provisioning / "datasources").glob("*.yaml"))
    sources = {d["type"]: d for d in _load(ds_file)["datasources"]}
    tempo_url = re.match(r"^http://([a-z0-9-]+):(\d+)$", sources["tempo"]["url"])
    assert tempo_url, sources["tempo"]["url"]
    host, port = tempo_url.groups()
    assert host in compose["services"]
    tempo_cfg = _load(_config_mounted_at(compose["services"][host], "-config.file="))
    assert int(port) == tempo_cfg["server"]["http_listen_port"]
    jaeger_host, jaeger_port = sources["jaeger"]["url"].removeprefix("http://").split(":")
    assert jaeger_host in compose["services"] and jaeger_port == "16686"


def test_tempo_storage_lives_on_the_volume() -> None:
    compose = _compose()
    tempo_cfg = _load(DEPLOY / "tempo.yaml")
    data_dir = [t for t, s in _mounts(compose["services"]["tempo"]).items() if not s.startswith(".")]
    assert data_dir == ["/var/tempo"]
    for path in (tempo_cfg["storage"]["trace"]["wal"]["path"], tempo_cfg["storage"]["trace"]["local"]["path"]):
        assert path.startswith("/var/tempo/")
    assert "local-blocks" in tempo_cfg["overrides"]["defaults"]["metrics_generator"]["processors"]


def test_sbatch_script_is_valid_bash_and_sets_the_variables() -> None:
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash")
    assert re.search(r"^#SBATCH --nodes=\d+", text, re.M)
    for var in (
        "OTEL_TRAIN_ENABLED",
        "OTEL_TRAIN_SAVE_PATH",
        "OTEL_TRAIN_RUN_ID",
        "OTEL_SERVICE_NAME",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ):
        assert re.search(rf"^export {var}=", text, re.M), var
    assert "torchrun" in text and "--rdzv-id" in text
    assert "OTEL_EXPORTER_OTLP_HEADERS=" not in text, "no secrets in the script"


def test_k8s_collector_deployment_and_service_agree() -> None:
    docs = _k8s_docs("otel-collector.yaml")
    config = yaml.safe_load(_k8s_find(docs, "ConfigMap")["data"]["config.yaml"])
    assert pipeline_problems(config) == []
    deployment = _k8s_find(docs, "Deployment")
    service = _k8s_find(docs, "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(port_names)
    assert {p["port"] for p in service["spec"]["ports"]} == {4317, 4318}
    assert container["image"] == _compose()["services"]["otel-collector"]["image"]
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    assert volume["configMap"]["name"] == _k8s_find(docs, "ConfigMap")["metadata"]["name"]
    assert container["args"] == ["--config=" + container["volumeMounts"][0]["mountPath"] + "/config.yaml"]


def test_k8s_training_pod_exports_to_the_collector_service() -> None:
    collector = _k8s_docs("otel-collector.yaml")
    service = _k8s_find(collector, "Service")
    (job,) = _k8s_docs("training-job.yaml")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OTEL_TRAIN_ENABLED"] == "true"
    assert env["OTEL_TRACES_EXPORTER"] == "jsonl,otlp"
    endpoint = re.match(r"^http://([^.]+)\.([^.]+)\.svc\.cluster\.local:(\d+)$", env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint, env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    name, namespace, port = endpoint.groups()
    assert (name, namespace) == (service["metadata"]["name"], service["metadata"]["namespace"])
    grpc_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["otlp-grpc"]
    assert int(port) == grpc_port and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_TRAIN_SAVE_PATH"].startswith(container["volumeMounts"][0]["mountPath"])
