"""Static checks of deploy/: no Docker engine runs here, so parse and cross-check every file."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from otel_train import phases, schema

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yaml"
SCHEMA = Path(__file__).parent / "data" / "compose-spec-subset.json"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
PIPELINE_PARTS = ("receivers", "processors", "exporters")


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _interpolate(text: str) -> str:
    """Compose's ``${VAR:-default}`` with no VAR set, as ``docker compose config`` would resolve it;
    a required ``${VAR:?message}`` (a secret the user exports) becomes a placeholder."""
    text = re.sub(r"\$\{[A-Z_][A-Z0-9_]*:-([^}]*)\}", r"\1", text)
    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*):\?[^}]*\}", r"set-by-user-\1", text)


def _compose(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(_interpolate(path.read_text()))


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


def _config_mounted_at(service: dict, flag_prefix: str, base: Path = DEPLOY) -> Path:
    """The file a service's ``--config=...`` style argument points at, through its mounts."""
    (arg,) = [a for a in service["command"] if a.startswith(flag_prefix)]
    container_path = arg.split("=", 1)[1]
    return base / _mounts(service)[container_path]


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


# ---------------------------------------------------------------------------------------------
# The collector tier (docs/deploy.md, "The collector tier"): node agents -> load_balancing by trace
# id -> gateways with tail_sampling -> Tempo microservices on S3. deploy/scale/ runs it in compose;
# deploy/k8s/otel-agent.yaml, otel-gateway.yaml and deploy/slurm/ run the same pipelines.

SCALE = DEPLOY / "scale"
SCALE_COMPOSE = SCALE / "docker-compose.yaml"
SLURM_AGENT = DEPLOY / "slurm" / "otel-agent.yaml"
TEMPO_ROLES = ("distributor", "ingester", "querier", "query-frontend", "compactor", "metrics-generator")
BSP_SCHEDULE_DELAY_S = 5.0  # OTEL_BSP_SCHEDULE_DELAY's default: how long a rank may hold an ended span
POLICY_TYPES = {"status_code", "boolean_attribute", "ottl_condition", "probabilistic"}
SLOW_STEP = re.compile(
    rf'^span\.name == "{phases.STEP}" and '
    r"\(span\.end_time_unix_nano - span\.start_time_unix_nano\) > (\d+)$"
)
_ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(text: str, env: Mapping[str, str] | None = None) -> str:
    """The collector's ``${env:NAME}`` and ``${env:NAME:-default}``, from ``env`` or the default.

    A reference with neither raises KeyError: the collector would not start."""
    env = env or {}

    def value(match: re.Match) -> str:
        name, default = match.groups()
        if name in env:
            return env[name]
        if default is None:
            raise KeyError(f"${{env:{name}}} is not set")
        return default

    return _ENV_REF.sub(value, text)


def _collector(path: Path, env: Mapping[str, str] | None = None) -> dict:
    return yaml.safe_load(expand_env(path.read_text(), env))


def _type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def _of_type(section: Mapping[str, Any] | None, ctype: str) -> dict[str, Any]:
    return {cid: cfg or {} for cid, cfg in (section or {}).items() if _type(cid) == ctype}


def _seconds(duration: str) -> float:
    """A Go duration as the collector writes them (``500ms``, ``15s``, ``1m``, ``2h``)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(duration))
    assert match, f"not a duration: {duration!r}"
    number, unit = match.groups()
    return float(number) * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


def _host_port(address: str) -> tuple[str, str]:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    return host, port


def _otlp_grpc_port(config: dict) -> str:
    """The port a collector (or Tempo distributor) config receives OTLP/gRPC on."""
    receivers = config.get("receivers") or (config.get("distributor") or {}).get("receivers") or {}
    return _host_port(receivers["otlp"]["protocols"]["grpc"]["endpoint"])[1]


def processor_order_problems(config: dict) -> list[str]:
    """memory_limiter first (refuse data before running out of memory), batch last, in every pipeline."""
    problems = []
    for name, pipeline in ((config.get("service") or {}).get("pipelines") or {}).items():
        kinds = [_type(p) for p in pipeline.get("processors") or []]
        if not kinds or kinds[0] != "memory_limiter":
            problems.append(f"pipeline {name}: memory_limiter must come first, got {kinds}")
        if not kinds or kinds[-1] != "batch":
            problems.append(f"pipeline {name}: batch must come last, got {kinds}")
    return problems


def agent_problems(config: dict) -> list[str]:
    """A node agent: every pipeline ends in a load_balancing exporter that routes by trace id."""
    problems = pipeline_problems(config) + processor_order_problems(config)
    for name, pipeline in ((config.get("service") or {}).get("pipelines") or {}).items():
        exporters = pipeline.get("exporters") or []
        if [_type(e) for e in exporters] != ["load_balancing"]:
            problems.append(f"pipeline {name}: an agent exports only through load_balancing, got {exporters}")
    for eid, exporter in _of_type(config.get("exporters"), "load_balancing").items():
        if exporter.get("routing_key") != "traceID":
            problems.append(f"{eid}: routing_key must be traceID (a whole trace on one gateway), "
                            f"got {exporter.get('routing_key')!r}")
        resolvers = sorted(exporter.get("resolver") or {})
        if len(resolvers) != 1 or resolvers[0] not in ("static", "dns", "k8s"):
            problems.append(f"{eid}: exactly one resolver (static, dns or k8s), got {resolvers}")
        otlp = (exporter.get("protocol") or {}).get("otlp")
        if otlp is None:
            problems.append(f"{eid}: protocol.otlp missing")
        elif "endpoint" in otlp:
            problems.append(f"{eid}: protocol.otlp.endpoint is set per gateway by the exporter; remove it")
    return problems


def slow_step_threshold_s(policies: list[dict]) -> float | None:
    """The latency above which a ``step`` span keeps its trace, from the ottl_condition policy."""
    for policy in policies:
        for condition in (policy.get("ottl_condition") or {}).get("span") or []:
            match = SLOW_STEP.match(condition)
            if policy.get("type") == "ottl_condition" and match:
                return int(match.group(1)) / 1e9
    return None


def sampling_problems(config: dict, agent_batch_timeout_s: float) -> list[str]:
    """A gateway: tail_sampling between memory_limiter and batch, with the tier's policies and timing."""
    problems = pipeline_problems(config) + processor_order_problems(config)
    for name, pipeline in ((config.get("service") or {}).get("pipelines") or {}).items():
        if "tail_sampling" not in [_type(p) for p in pipeline.get("processors") or []]:
            problems.append(f"pipeline {name}: no tail_sampling")
    samplers = list(_of_type(config.get("processors"), "tail_sampling").values())
    if len(samplers) != 1:
        return problems + [f"expected one tail_sampling processor, got {len(samplers)}"]
    sampler = samplers[0]
    policies = sampler.get("policies") or []

    def kept_by(ptype: str, test: Any) -> bool:
        return any(p.get("type") == ptype and test(p.get(ptype) or {}) for p in policies)

    for policy in policies:
        if policy.get("type") not in POLICY_TYPES:
            problems.append(f"policy {policy.get('name')!r}: unexpected type {policy.get('type')!r}")
    if not kept_by("status_code", lambda c: c.get("status_codes") == ["ERROR"]):
        problems.append("no policy keeps every trace with an ERROR span")
    if not kept_by("boolean_attribute", lambda c: (c.get("key"), c.get("value")) == (schema.ATTR_INCOMPLETE, True)):
        problems.append(f"no policy keeps every trace with an incomplete span ({schema.ATTR_INCOMPLETE}=true)")
    threshold = slow_step_threshold_s(policies)
    if threshold is None:
        problems.append(f"no policy keeps every trace whose {phases.STEP!r} span exceeds a latency threshold")
    rates = [(p.get("probabilistic") or {}).get("sampling_percentage")
             for p in policies if p.get("type") == "probabilistic"]
    if rates != [1]:
        problems.append(f"the rest must be one 1 % probabilistic sample, got {rates}")

    wait = _seconds(sampler.get("decision_wait", "30s"))
    grace = _seconds(sampler.get("decision_wait_after_root_received", "0s"))
    if grace <= BSP_SCHEDULE_DELAY_S + agent_batch_timeout_s:
        problems.append(f"decision_wait_after_root_received {grace:g}s must exceed the ranks' batch delay "
                        f"({BSP_SCHEDULE_DELAY_S:g}s) plus the agents' batch timeout ({agent_batch_timeout_s:g}s)")
    if threshold is not None and wait <= threshold + grace:
        problems.append(f"decision_wait {wait:g}s must exceed the slow-step threshold ({threshold:g}s) plus "
                        f"the root grace ({grace:g}s), or a slow step is decided before its step span arrives")
    if sampler.get("num_traces", 50000) < sampler.get("expected_new_traces_per_sec", 0) * wait:
        problems.append("num_traces holds fewer traces than expected_new_traces_per_sec x decision_wait")
    cache = sampler.get("decision_cache") or {}
    if cache.get("non_sampled_cache_size", 0) != 0:
        problems.append("non_sampled_cache_size must stay 0: a late error or incomplete span of a dropped "
                        "trace would be dropped with it")
    if not cache.get("sampled_cache_size"):
        problems.append("sampled_cache_size is 0: late spans of a kept trace would be sampled again")
    return problems


def _agent_batch_timeout_s(agent: dict) -> float:
    (batch,) = _of_type(agent["processors"], "batch").values()
    return _seconds(batch["timeout"])


def _exporter_targets(config: dict) -> list[tuple[str, str, str]]:
    """(exporter id, host, port) for every OTLP endpoint and static load_balancing backend."""
    targets = []
    for eid, exporter in (config.get("exporters") or {}).items():
        if exporter and "endpoint" in exporter:
            targets.append((eid, *_host_port(exporter["endpoint"])))
        static = ((exporter or {}).get("resolver") or {}).get("static") or {}
        targets.extend((eid, *_host_port(hostname)) for hostname in static.get("hostnames") or [])
    return targets


def _exposed(service: dict) -> set[str]:
    published = {str(p).rsplit(":", 1)[-1] for p in service.get("ports", [])}
    return {str(p) for p in service.get("expose", [])} | published


def _service_config(service: dict) -> tuple[str, Path] | None:
    """("collector" | "tempo", its config file) for a collector or Tempo service of the scale stack."""
    command = service.get("command") or []
    if any(a.startswith("--config=") for a in command):
        return "collector", _config_mounted_at(service, "--config=", SCALE)
    if any(a.startswith("-config.file=") for a in command):
        return "tempo", _config_mounted_at(service, "-config.file=", SCALE)
    return None


def _tempo_target(service: dict) -> str | None:
    for arg in service.get("command") or []:
        if arg.startswith("-target="):
            return arg.split("=", 1)[1]
    return None


def compose_wiring_problems(compose: dict) -> list[str]:
    """Every mount, dependency and exporter endpoint of the scale stack points at something that exists."""
    services = compose["services"]
    named_volumes = set(compose.get("volumes") or {})
    problems = []
    for name, svc in services.items():
        for target, source in _mounts(svc).items():
            if source.startswith(".") and not (SCALE / source).exists():
                problems.append(f"{name}: mounts missing {source}")
            elif not source.startswith(".") and source not in named_volumes:
                problems.append(f"{name}: undeclared volume {source}")
        for dep in svc.get("depends_on") or []:
            if dep not in services:
                problems.append(f"{name}: depends on unknown service {dep}")
        kind_path = _service_config(svc)
        if kind_path is None or kind_path[0] != "collector":
            continue
        config = _collector(kind_path[1])
        problems += [f"{name}: {p}" for p in pipeline_problems(config)]
        for eid, host, port in _exporter_targets(config):
            target = services.get(host)
            if target is None:
                problems.append(f"{name}: {eid} sends to {host}, not a service of this stack")
                continue
            if port not in _exposed(target):
                problems.append(f"{name}: {eid} sends to {host}:{port}, which {host} does not expose")
            target_config = _service_config(target)
            if target_config is not None:
                listens = _otlp_grpc_port(yaml.safe_load(expand_env(target_config[1].read_text())))
                if listens != port:
                    problems.append(f"{name}: {eid} sends to {host}:{port}, {host} receives OTLP on {listens}")
    return problems


def tempo_problems(compose: dict, tempo: dict, tempo_text: str) -> list[str]:
    """Tempo in microservices mode: every role, enough ingesters, S3 on a service of the stack."""
    services = compose["services"]
    problems = []
    roles: dict[str, list[str]] = {}
    for name, svc in services.items():
        if (role := _tempo_target(svc)) is not None:
            roles.setdefault(role, []).append(name)
            if "-config.expand-env=true" not in svc["command"]:
                problems.append(f"{name}: -config.expand-env=true missing (the S3 keys come from the environment)")
            env = svc.get("environment") or {}
            for var in re.findall(r"\$\{([A-Z_][A-Z0-9_]*)\}", tempo_text):
                if var not in env:
                    problems.append(f"{name}: tempo.yaml needs ${{{var}}}, not in its environment")
    for role in TEMPO_ROLES:
        if role not in roles:
            problems.append(f"no Tempo {role} (microservices mode runs every role as its own service)")
    ingesters = roles.get("ingester", [])
    factor = tempo["ingester"]["lifecycler"]["ring"]["replication_factor"]
    if len(ingesters) < factor:
        problems.append(f"replication_factor {factor} needs {factor} ingesters, got {len(ingesters)}")
    wal = tempo["storage"]["trace"]["wal"]["path"]
    volumes = [[s for t, s in _mounts(services[n]).items() if wal.startswith(t + "/")] for n in ingesters]
    if any(len(v) != 1 for v in volumes) or len({v[0] for v in volumes if v}) != len(volumes):
        problems.append(f"each ingester needs its own volume under its WAL ({wal}), got {volumes}")
    trace_storage = tempo["storage"]["trace"]
    if trace_storage["backend"] != "s3":
        problems.append(f"storage backend must be s3 (object storage), got {trace_storage['backend']!r}")
    else:
        host, port = _host_port(trace_storage["s3"]["endpoint"])
        if host not in services or port not in _exposed(services[host]):
            problems.append(f"S3 endpoint {host}:{port} is not a service port of this stack")
        bucket = trace_storage["s3"]["bucket"]
        creates = re.compile(rf"mc mb .*/{re.escape(bucket)}\b")
        makes_bucket = [n for n, s in services.items() if creates.search(" ".join(s.get("entrypoint") or []))]
        if not makes_bucket:
            problems.append(f"no service creates the bucket {bucket!r}")
        for name in ingesters + roles.get("compactor", []):
            conditions = {m: c.get("condition") for m, c in (services[name].get("depends_on") or {}).items()}
            if not any(conditions.get(m) == "service_completed_successfully" for m in makes_bucket):
                problems.append(f"{name} must wait for the bucket ({', '.join(makes_bucket)})")
    for member in tempo["memberlist"]["join_members"]:
        host = _host_port(member)[0]
        if _tempo_target(services.get(host, {})) is None:
            problems.append(f"memberlist joins {member}, not a Tempo service")
    frontend_host, frontend_port = _host_port(tempo["querier"]["frontend_worker"]["frontend_address"])
    is_frontend = _tempo_target(services.get(frontend_host, {})) == "query-frontend"
    if not is_frontend or int(frontend_port) != tempo["server"]["grpc_listen_port"]:
        problems.append(f"queriers pull work from {frontend_host}:{frontend_port}, not the query-frontend's gRPC port")
    return problems


def daemonset_problems(daemonset: dict, config: dict) -> list[str]:
    """A node agent DaemonSet: the ranks of its node reach it at the node's IP on the OTLP ports."""
    spec = daemonset["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    problems = []
    ports = {str(p["containerPort"]): p for p in container.get("ports", [])}
    for protocol, cfg in config["receivers"]["otlp"]["protocols"].items():
        port = _host_port(cfg["endpoint"])[1]
        if port not in ports:
            problems.append(f"OTLP {protocol} port {port} is not a container port")
        elif not spec.get("hostNetwork") and str(ports[port].get("hostPort")) != port:
            problems.append(f"OTLP {protocol} port {port} needs hostPort {port} (or hostNetwork) to be node-local")
    return problems


def _scale_compose() -> dict:
    return _compose(SCALE_COMPOSE)


def _scale_agent() -> dict:
    return _collector(SCALE / "otel-agent.yaml")


def _scale_gateway() -> dict:
    return _collector(SCALE / "otel-gateway.yaml")


def _configmap_config(docs: list[dict]) -> dict:
    return yaml.safe_load(_k8s_find(docs, "ConfigMap")["data"]["config.yaml"])


def _slurm_agent_env() -> dict[str, str]:
    return {"OTEL_AGENT_PORT": "16912", "OTEL_AGENT_METRICS_PORT": "16913", "OTEL_GATEWAY_HOSTNAME": "gw.example"}


def _is_pinned(image: str) -> bool:
    tag = image.rsplit(":", 1)[1]
    return bool(re.fullmatch(r"v?\d+\.\d+\.\d+|RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ", tag))


def test_scale_compose_matches_schema_and_pins_images() -> None:
    compose = _scale_compose()
    jsonschema.validate(compose, json.loads(SCHEMA.read_text()))
    images = {name: svc["image"] for name, svc in compose["services"].items()}
    assert all(_is_pinned(image) for image in images.values()), images
    main = {svc["image"] for svc in _compose()["services"].values()}
    for repo in ("otel/opentelemetry-collector-contrib", "grafana/tempo", "grafana/grafana"):
        (same,) = {i for i in main if i.startswith(repo + ":")}
        assert {i for i in images.values() if i.startswith(repo + ":")} == {same}, f"{repo}: one version in deploy/"
    for svc in compose["services"].values():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{port}: publish on loopback by default"


def test_scale_compose_needs_the_minio_secret_from_the_user() -> None:
    text = SCALE_COMPOSE.read_text()
    assert "MINIO_ROOT_PASSWORD:?" in text and not re.search(r"MINIO_ROOT_PASSWORD:-", text)
    compose = _scale_compose()
    secret = compose["services"]["minio"]["environment"]["MINIO_ROOT_PASSWORD"]
    assert secret == "set-by-user-MINIO_ROOT_PASSWORD"
    tempo = (SCALE / "tempo.yaml").read_text()
    assert "${S3_SECRET_KEY}" in tempo and "supersecret" not in tempo


def test_scale_agents_route_by_trace_id_to_every_gateway() -> None:
    compose = _scale_compose()
    runs = {n: _service_config(s) for n, s in compose["services"].items()}
    agents = {n: compose["services"][n] for n, r in runs.items() if r == ("collector", SCALE / "otel-agent.yaml")}
    gateways = {n for n, r in runs.items() if r == ("collector", SCALE / "otel-gateway.yaml")}
    assert len(agents) >= 2 and len(gateways) >= 2, "two nodes and two gateways show the routing"
    agent = _scale_agent()
    assert agent_problems(agent) == []
    (balancer,) = _of_type(agent["exporters"], "load_balancing").values()
    assert {_host_port(h)[0] for h in balancer["resolver"]["static"]["hostnames"]} == gateways
    published = sorted(p.rsplit(":", 2)[-2] for s in agents.values() for p in s["ports"])
    assert len(published) == len(set(published)), "each agent (node) on its own host ports"


def test_scale_gateway_keeps_anomalous_traces_whole() -> None:
    agent, gateway = _scale_agent(), _scale_gateway()
    assert sampling_problems(gateway, _agent_batch_timeout_s(agent)) == []
    policies = {p["name"]: p for p in gateway["processors"]["tail_sampling"]["policies"]}
    assert slow_step_threshold_s(list(policies.values())) == 10.0
    kept_names = re.findall(r'span\.name == "(\w+)"', policies["checkpoint-and-eval"]["ottl_condition"]["span"][0])
    assert kept_names == [phases.CHECKPOINT, phases.EVAL]
    assert [_type(e) for e in gateway["service"]["pipelines"]["traces"]["exporters"]] == ["otlp_grpc"]


def test_scale_compose_wiring() -> None:
    compose = _scale_compose()
    assert compose_wiring_problems(compose) == []
    elsewhere = _collector(SCALE / "otel-gateway.yaml", {"TEMPO_OTLP_ENDPOINT": "tempo.example:4317"})
    assert elsewhere["exporters"]["otlp_grpc/tempo"]["endpoint"] == "tempo.example:4317"


def test_scale_tempo_runs_as_microservices_on_minio() -> None:
    compose = _scale_compose()
    text = (SCALE / "tempo.yaml").read_text()
    tempo = yaml.safe_load(text)
    assert tempo_problems(compose, tempo, text) == []
    assert tempo["ingester"]["lifecycler"]["ring"]["replication_factor"] >= 2
    assert "local-blocks" in tempo["overrides"]["defaults"]["metrics_generator"]["processors"]
    grafana = compose["services"]["grafana"]
    provisioning = SCALE / _mounts(grafana)["/etc/grafana/provisioning"]
    (ds_file,) = sorted((provisioning / "datasources").glob("*.yaml"))
    (source,) = _load(ds_file)["datasources"]
    host, port = _host_port(source["url"])
    assert _tempo_target(compose["services"][host]) == "query-frontend"
    assert int(port) == tempo["server"]["http_listen_port"]


def test_k8s_agent_daemonset_is_node_local_and_finds_the_gateways() -> None:
    docs = _k8s_docs("otel-agent.yaml")
    config = _configmap_config(docs)
    assert agent_problems(config) == []
    daemonset = _k8s_find(docs, "DaemonSet")
    assert daemonset_problems(daemonset, config) == []
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == _scale_compose()["services"]["agent-0"]["image"]
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (volume,) = pod["volumes"]
    assert volume["configMap"]["name"] == _k8s_find(docs, "ConfigMap")["metadata"]["name"]
    assert container["args"] == ["--config=" + container["volumeMounts"][0]["mountPath"] + "/config.yaml"]

    # The k8s resolver names the gateway Service, and may read its EndpointSlices.
    (balancer,) = _of_type(config["exporters"], "load_balancing").values()
    service_name, namespace = balancer["resolver"]["k8s"]["service"].split(".")
    gateway_docs = _k8s_docs("otel-gateway.yaml")
    service = _k8s_find(gateway_docs, "Service")
    assert (service["metadata"]["name"], service["metadata"]["namespace"]) == (service_name, namespace)
    assert set(balancer["resolver"]["k8s"]["ports"]) <= {p["port"] for p in service["spec"]["ports"]}
    gateway_pods = _k8s_find(gateway_docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= gateway_pods.items()
    role, binding = _k8s_find(docs, "Role"), _k8s_find(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == namespace
    assert any("discovery.k8s.io" in r["apiGroups"] and "endpointslices" in r["resources"]
               and {"get", "list", "watch"} <= set(r["verbs"]) for r in role["rules"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": daemonset["metadata"]["namespace"]}
    assert account in binding["subjects"]


def test_k8s_gateway_samples_like_compose_and_exports_to_tempo() -> None:
    docs = _k8s_docs("otel-gateway.yaml")
    config = _configmap_config(docs)
    agent = _configmap_config(_k8s_docs("otel-agent.yaml"))
    assert sampling_problems(config, _agent_batch_timeout_s(agent)) == []
    scale = _scale_gateway()
    for processor in ("tail_sampling", "batch"):
        assert config["processors"][processor] == scale["processors"][processor], f"{processor} differs from deploy/scale"
    assert config["service"]["pipelines"] == scale["service"]["pipelines"]
    deployment = _k8s_find(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert str(ports["otlp-grpc"]) == _otlp_grpc_port(config)
    assert {p["targetPort"] for p in _k8s_find(docs, "Service")["spec"]["ports"]} <= set(ports)
    # Tempo's distributor Service is "<release>-distributor" in the namespace the values file installs to.
    values_text = (DEPLOY / "k8s" / "tempo-distributed-values.yaml").read_text()
    release, namespace = re.search(r"helm install (\S+) \S+/tempo-distributed -n (\S+)", values_text).groups()
    endpoint = config["exporters"]["otlp_grpc/tempo"]["endpoint"]
    assert endpoint == f"{release}-distributor.{namespace}.svc.cluster.local:4317"
    values = yaml.safe_load(values_text)
    assert values["traces"]["otlp"]["grpc"]["enabled"] is True
    assert values["storage"]["trace"]["backend"] == "s3" and values["ingester"]["replicas"] >= 3
    assert not {"access_key", "secret_key"} & set(values["storage"]["trace"]["s3"]), "no keys in the values file"
    tempo_image = _scale_compose()["services"]["distributor"]["image"]
    assert values["tempo"]["image"]["tag"] == tempo_image.rsplit(":", 1)[1]


def test_k8s_training_pods_export_to_their_node_agent() -> None:
    agent_docs = _k8s_docs("otel-agent.yaml")
    (agent,) = _k8s_find(agent_docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    host_ports = {p["name"]: p.get("hostPort") for p in agent["ports"]}
    docs = _k8s_docs("training-job-scale.yaml")
    job, service = _k8s_find(docs, "Job"), _k8s_find(docs, "Service")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    names = list(env)
    assert names.index("NODE_IP") < names.index("OTEL_EXPORTER_OTLP_ENDPOINT"), "$(NODE_IP) must be defined first"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == f"http://$(NODE_IP):{host_ports['otlp-grpc']}"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "grpc"
    assert env["OTEL_TRAIN_RUN_ID"]["value"] == "k8s-$(JOB_UID)", "one run id on every pod: one trace per step"
    # torchrun's rendezvous: pod 0 of the Indexed Job, through the headless Service.
    assert job["spec"]["completionMode"] == "Indexed" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    nnodes = [a for a in container["command"] if a.startswith("--nnodes=")]
    assert nnodes == [f"--nnodes={job['spec']['completions']}"]
    (rdzv,) = [a.split("=", 1)[1] for a in container["command"] if a.startswith("--rdzv-endpoint=")]
    pod_zero = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert rdzv == f"{pod_zero}:{service['spec']['ports'][0]['port']}"


def test_every_agent_runs_the_same_pipeline() -> None:
    agents = {
        "deploy/scale": _scale_agent(),
        "deploy/k8s": _configmap_config(_k8s_docs("otel-agent.yaml")),
        "deploy/slurm": _collector(SLURM_AGENT, _slurm_agent_env()),
    }
    reference = agents["deploy/scale"]
    for where, config in agents.items():
        assert agent_problems(config) == [], where
        assert config["service"]["pipelines"] == reference["service"]["pipelines"], where
        assert config["processors"]["batch"] == reference["processors"]["batch"], where
        lb, ref = config["exporters"]["load_balancing"], reference["exporters"]["load_balancing"]
        assert (lb["routing_key"], lb["protocol"]) == (ref["routing_key"], ref["protocol"]), where
    assert set(agents["deploy/k8s"]["exporters"]["load_balancing"]["resolver"]) == {"k8s"}
    assert set(agents["deploy/slurm"]["exporters"]["load_balancing"]["resolver"]) == {"dns"}


def test_slurm_agent_listens_on_loopback_only() -> None:
    config = _collector(SLURM_AGENT, _slurm_agent_env())
    for protocol in config["receivers"]["otlp"]["protocols"].values():
        assert protocol["endpoint"] == "127.0.0.1:16912"
    (reader,) = config["service"]["telemetry"]["metrics"]["readers"]
    assert reader["pull"]["exporter"]["prometheus"] == {"host": "127.0.0.1", "port": 16913}
    assert config["exporters"]["load_balancing"]["resolver"]["dns"]["hostname"] == "gw.example"
    with pytest.raises(KeyError, match="OTEL_GATEWAY_HOSTNAME"):
        _collector(SLURM_AGENT, {k: v for k, v in _slurm_agent_env().items() if k != "OTEL_GATEWAY_HOSTNAME"})


def _fake(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _run_sbatch(tmp_path: Path, train_rc: int, **env: str) -> tuple[subprocess.CompletedProcess, list[str], dict]:
    """Run train.sbatch with fake srun/scontrol/otel-train: what would Slurm have started, and how?"""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.log"
    agent_env = tmp_path / "agent.env"
    # One write per hostname, as a long list is written: the script must read past the first.
    _fake(bindir, "scontrol", "echo node-a; sleep 0.1; echo node-b\n")
    _fake(bindir, "otel-train", 'echo "otel-train $*" >> "$LOG"\n')
    _fake(bindir, "srun", f"""
if [[ " $* " == *" --overlap "* ]]; then
    env | grep '^OTEL_' > "{agent_env}"
    trap 'echo "agent stopped" >> "$LOG"; exit 0' TERM
    echo "agent-step $*" >> "$LOG"
    while :; do sleep 0.05; done
fi
if [[ -n "${{OTEL_GATEWAY_HOSTNAME:-}}" ]]; then  # the agents start first, as on a real node
    for _ in $(seq 100); do grep -q '^agent-step ' "$LOG" 2>/dev/null && break; sleep 0.05; done
fi
echo "train endpoint=$OTEL_EXPORTER_OTLP_ENDPOINT $*" >> "$LOG"
exit {train_rc}
""")
    run_env = {
        "PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "LOG": str(log),
        "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2",
        "SLURM_JOB_NAME": "test", "SLURM_SUBMIT_DIR": str(ROOT), "OTEL_TRAIN_SAVE_PATH": str(tmp_path / "run"),
        **env,
    }
    result = subprocess.run(["bash", str(SBATCH), "train.py", "--lr", "0.1"], env=run_env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    lines = log.read_text().splitlines() if log.exists() else []
    exported = {}
    if agent_env.exists():
        exported = dict(line.split("=", 1) for line in agent_env.read_text().splitlines())
    return result, lines, exported


@pytest.mark.parametrize("train_rc", [0, 1])
def test_slurm_job_starts_one_agent_per_node_and_stops_it(tmp_path: Path, train_rc: int) -> None:
    gateways = "otel-gateways.example.internal"
    result, lines, agent_env = _run_sbatch(tmp_path, train_rc, OTEL_GATEWAY_HOSTNAME=gateways)
    assert result.returncode == train_rc, result.stderr
    (agent,) = [line for line in lines if line.startswith("agent-step ")]
    args = agent.split()[1:]
    assert {"--overlap", "--nodes=2", "--ntasks-per-node=1"} <= set(args)
    (config_arg,) = [a for a in args if a.startswith("--config=")]
    assert Path(config_arg.split("=", 1)[1]) == SLURM_AGENT
    # Every ${env:...} of the agent config is exported to the agent step.
    config = _collector(SLURM_AGENT, agent_env)
    port = _otlp_grpc_port(config)
    assert agent_env["OTEL_GATEWAY_HOSTNAME"] == gateways
    assert 10000 <= int(port) < 20000 and agent_env["OTEL_AGENT_METRICS_PORT"] != port
    (train,) = [line for line in lines if line.startswith("train ")]
    assert train.split()[1] == f"endpoint=http://127.0.0.1:{port}", "ranks export to their node's agent"
    assert "torchrun" in train and "--overlap" not in train
    assert lines[-1] == "agent stopped", "the agents get SIGTERM (and flush) when the job script ends"


def test_slurm_job_without_gateways_keeps_the_single_collector(tmp_path: Path) -> None:
    result, lines, agent_env = _run_sbatch(tmp_path, 0)
    assert result.returncode == 0, result.stderr
    assert not any(line.startswith("agent") for line in lines) and agent_env == {}
    (train,) = [line for line in lines if line.startswith("train ")]
    assert train.split()[1] == "endpoint=http://otel-collector.example.internal:4317"


# Broken configurations the checks above must catch: each mutation, and a piece of the problem it causes.
def _set(path: str, value: Any) -> Any:
    def mutate(config: dict) -> None:
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        index = int(last) if isinstance(node, list) else last
        if value is _DELETE:
            del node[index]
        else:
            node[index] = value
    return mutate


_DELETE = object()
_LB = "exporters.load_balancing"
_TS = "processors.tail_sampling"
_PROCESSORS = "service.pipelines.traces.processors"
_SLOW_FORWARD = 'span.name == "forward" and (span.end_time_unix_nano - span.start_time_unix_nano) > 1'
_AGENT_BREAKS = {
    "route by service": (_set(f"{_LB}.routing_key", "service"), "routing_key must be traceID"),
    "batch before memory_limiter": (_set(_PROCESSORS, ["batch", "memory_limiter"]), "memory_limiter must come first"),
    "no batch": (_set(_PROCESSORS, ["memory_limiter"]), "batch must come last"),
    "two resolvers": (_set(f"{_LB}.resolver.dns", {"hostname": "gw"}), "exactly one resolver"),
    "endpoint fixed": (_set(f"{_LB}.protocol.otlp.endpoint", "gateway-0:4317"), "protocol.otlp.endpoint"),
    "bypasses the gateways": (_set("service.pipelines.traces.exporters", ["otlp_grpc/tempo"]),
                              "only through load_balancing"),
}
_GATEWAY_BREAKS = {
    "no incomplete policy": (_set(f"{_TS}.policies.1", {"name": "x", "type": "status_code",
                                                        "status_code": {"status_codes": ["ERROR"]}}),
                             schema.ATTR_INCOMPLETE),
    "errors not kept": (_set(f"{_TS}.policies.0.status_code.status_codes", ["OK"]), "ERROR span"),
    "slow forward, not step": (_set(f"{_TS}.policies.2.ottl_condition.span", [_SLOW_FORWARD]), "'step' span exceeds"),
    "10 % of the rest": (_set(f"{_TS}.policies.4.probabilistic.sampling_percentage", 10), "1 % probabilistic"),
    "keeps everything": (_set(f"{_TS}.policies.4", {"name": "all", "type": "always_sample"}), "unexpected type"),
    "decides too early": (_set(f"{_TS}.decision_wait", "20s"), "decision_wait 20s must exceed"),
    "no root grace": (_set(f"{_TS}.decision_wait_after_root_received", _DELETE), "batch delay"),
    "drops late errors": (_set(f"{_TS}.decision_cache.non_sampled_cache_size", 10000), "non_sampled_cache_size"),
    "buffer too small": (_set(f"{_TS}.num_traces", 100), "num_traces"),
    "sampling after batch": (_set(_PROCESSORS, ["memory_limiter", "batch", "tail_sampling"]), "batch must come last"),
}


@pytest.mark.parametrize("case", sorted(_AGENT_BREAKS))
def test_agent_check_catches(case: str) -> None:
    config = _scale_agent()
    if case == "bypasses the gateways":
        config["exporters"]["otlp_grpc/tempo"] = {"endpoint": "distributor:4317"}
    mutate, expected = _AGENT_BREAKS[case]
    mutate(config)
    assert any(expected in p for p in agent_problems(config)), agent_problems(config)


@pytest.mark.parametrize("case", sorted(_GATEWAY_BREAKS))
def test_sampling_check_catches(case: str) -> None:
    config = _scale_gateway()
    assert [p["name"] for p in config["processors"]["tail_sampling"]["policies"]] == [
        "errors", "incomplete", "slow-steps", "checkpoint-and-eval", "baseline"]
    mutate, expected = _GATEWAY_BREAKS[case]
    mutate(config)
    problems = sampling_problems(config, _agent_batch_timeout_s(_scale_agent()))
    assert any(expected in p for p in problems), problems


def test_wiring_checks_catch_missing_services_and_ports() -> None:
    compose = _scale_compose()
    del compose["services"]["gateway-1"]
    compose["services"]["distributor"]["expose"] = compose["services"]["distributor"]["ports"] = []
    problems = compose_wiring_problems(compose)
    assert any("sends to gateway-1, not a service" in p for p in problems), problems
    assert any("sends to distributor:4317, which distributor does not expose" in p for p in problems), problems

    compose = _scale_compose()
    text = (SCALE / "tempo.yaml").read_text()
    tempo = yaml.safe_load(text)
    tempo["storage"]["trace"]["backend"] = "local"
    tempo["ingester"]["lifecycler"]["ring"]["replication_factor"] = 5
    del compose["services"]["compactor"]
    compose["services"]["querier"]["environment"] = {}
    problems = tempo_problems(compose, tempo, text)
    expected_problems = ("backend must be s3", "needs 5 ingesters", "no Tempo compactor",
                         "querier: tempo.yaml needs ${S3_SECRET_KEY}")
    for expected in expected_problems:
        assert any(expected in p for p in problems), (expected, problems)


def test_daemonset_check_catches_a_pod_only_port() -> None:
    docs = _k8s_docs("otel-agent.yaml")
    daemonset, config = _k8s_find(docs, "DaemonSet"), _configmap_config(docs)
    for port in daemonset["spec"]["template"]["spec"]["containers"][0]["ports"]:
        port.pop("hostPort", None)
    problems = daemonset_problems(daemonset, config)
    assert any("needs hostPort 4317" in p for p in problems), problems
    daemonset["spec"]["template"]["spec"]["hostNetwork"] = True
    assert daemonset_problems(daemonset, config) == []
