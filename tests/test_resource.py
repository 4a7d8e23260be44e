"""Run-context detection (explicit, torchrun, Slurm, Slurm array, submitit, default) and the OTel resource."""

from __future__ import annotations

import os
import re
import socket

import pytest
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider

from otel_train import schema
from otel_train.config import Settings, resolve_settings
from otel_train.errors import ConfigError
from otel_train.resource import (
    DEFAULT_SERVICE_NAME,
    EnvResourceDetector,
    RunContext,
    TrainingResourceDetector,
    build_resource,
    detect_run_context,
)

TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "TORCHELASTIC_RUN_ID": "rdzv-abc",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NTASKS": "16",
    "SLURM_JOB_ID": "4242",
    "SLURM_RESTART_COUNT": "1",
}
SUBMITIT_LOCAL = {
    "SUBMITIT_EXECUTOR": "local",
    "SUBMITIT_LOCAL_GLOBALID": "1",
    "SUBMITIT_LOCAL_LOCALID": "1",
    "SUBMITIT_LOCAL_NTASKS": "2",
    "SUBMITIT_LOCAL_JOB_ID": "31337",
}
GENERATED_RUN_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{8}$")


def ints(ctx: RunContext) -> tuple[int, int, int, int]:
    return ctx.rank, ctx.local_rank, ctx.world_size, ctx.attempt


def test_default_context_is_rank_0_of_1_with_an_invented_run_id() -> None:
    ctx = detect_run_context(Settings(), env={})
    assert ints(ctx) == (0, 0, 1, 0)
    assert ctx.launcher == "default" and ctx.job_id is None
    assert GENERATED_RUN_ID.match(ctx.run_id) and ctx.run_id_known is False
    assert (ctx.host, ctx.pid, ctx.source) == (socket.gethostname(), os.getpid(), "training")


def test_torchrun() -> None:
    ctx = detect_run_context(Settings(), env=TORCHRUN)
    assert ints(ctx) == (5, 1, 8, 2)
    assert (ctx.launcher, ctx.run_id, ctx.run_id_known, ctx.job_id) == ("torchrun", "rdzv-abc", True, None)


def test_torchrun_without_rdzv_id_derives_a_shared_id_from_the_master_address() -> None:
    env = {**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}
    ctx = detect_run_context(Settings(), env=env)
    peer = detect_run_context(Settings(), env={**env, "RANK": "0", "LOCAL_RANK": "0"})
    elsewhere = detect_run_context(Settings(), env={**env, "MASTER_PORT": "29501"})
    assert ctx.run_id == peer.run_id and ctx.run_id_known
    assert ctx.run_id.startswith("torchrun-") and ctx.run_id != elsewhere.run_id
    assert "none" not in ctx.run_id


def test_torchrun_id_none_inside_slurm_uses_the_slurm_job_id() -> None:
    ctx = detect_run_context(Settings(), env={**SLURM, **TORCHRUN, "TORCHELASTIC_RUN_ID": "none"})
    assert (ctx.run_id, ctx.job_id) == ("4242", "4242")
    assert ints(ctx) == (5, 1, 8, 2) and ctx.launcher == "torchrun"  # torchrun's ranks beat Slurm's


def test_slurm() -> None:
    ctx = detect_run_context(Settings(), env=SLURM)
    assert ints(ctx) == (6, 2, 16, 1)
    assert (ctx.launcher, ctx.run_id, ctx.run_id_known, ctx.job_id) == ("slurm", "4242", True, "4242")


def test_slurm_array_job_ids_include_the_task() -> None:
    env = {**SLURM, "SLURM_JOB_ID": "4250", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "8"}
    ctx = detect_run_context(Settings(), env=env)
    assert (ctx.job_id, ctx.run_id) == ("4242_8", "4242_8")


def test_submitit_slurm_executor_is_slurm_with_a_submitit_label() -> None:
    ctx = detect_run_context(Settings(), env={**SLURM, "SUBMITIT_EXECUTOR": "slurm"})
    assert ints(ctx) == (6, 2, 16, 1) and ctx.launcher == "submitit" and ctx.job_id == "4242"


def test_submitit_local_executor() -> None:
    ctx = detect_run_context(Settings(), env=SUBMITIT_LOCAL)
    assert ints(ctx) == (1, 1, 2, 0)
    assert (ctx.launcher, ctx.run_id, ctx.run_id_known, ctx.job_id) == ("submitit", "31337", True, "31337")


def test_explicit_settings_beat_every_launcher_per_field() -> None:
    settings = resolve_settings(
        env={"OTEL_TRAIN_RANK": "1", "OTEL_TRAIN_WORLD_SIZE": "2", "OTEL_TRAIN_RUN_ID": "mine", "OTEL_TRAIN_JOB_ID": "j"}
    )
    ctx = detect_run_context(settings, env={**SLURM, **TORCHRUN})
    assert (ctx.rank, ctx.world_size) == (1, 2)
    assert (ctx.local_rank, ctx.attempt) == (1, 2)  # not set explicitly: torchrun still supplies them
    assert (ctx.launcher, ctx.run_id, ctx.job_id) == ("explicit", "mine", "j")


def test_first_source_wins_per_field_across_launchers() -> None:
    # torchrun without a restart count: the attempt falls through to Slurm's.
    env = {**SLURM, **{k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RESTART_COUNT"}}
    assert ints(detect_run_context(Settings(), env=env)) == (5, 1, 8, 1)


def test_launcher_is_the_first_source_when_rank_is_default() -> None:
    ctx = detect_run_context(Settings(), env={"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"})
    assert ctx.launcher == "slurm" and ints(ctx) == (0, 0, 4, 0)


def test_source_comes_from_settings() -> None:
    assert detect_run_context(Settings(source="eval"), env={}).source == "eval"


@pytest.mark.parametrize(
    ("settings", "env", "names"),
    [
        (Settings(), {"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, ["SLURM_PROCID", "SLURM_NTASKS", "rank 4"]),
        (Settings(), {"RANK": "2"}, ["RANK", "world_size 1", "default"]),
        (Settings(rank=3), {"WORLD_SIZE": "2"}, ["OTEL_TRAIN_RANK", "WORLD_SIZE"]),
        (Settings(), {"RANK": "x", "WORLD_SIZE": "2"}, ["RANK", "'x'"]),
        (Settings(), {"LOCAL_RANK": "-1"}, ["LOCAL_RANK", ">= 0"]),
        (Settings(), {"WORLD_SIZE": "0"}, ["WORLD_SIZE", ">= 1", "OTEL_TRAIN_WORLD_SIZE"]),
        (Settings(), {"SLURM_RESTART_COUNT": "one"}, ["SLURM_RESTART_COUNT"]),
    ],
)
def test_bad_or_inconsistent_launcher_env_raises_one_line(settings: Settings, env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        detect_run_context(settings, env=env)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith(("SLURM_", "TORCHELASTIC_", "SUBMITIT_")) or var in ("RANK", "LOCAL_RANK"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    assert detect_run_context(Settings()).rank == 2


def context(**changes: object) -> RunContext:
    base = dict(
        rank=3, local_rank=1, world_size=4, attempt=1, job_id="77", run_id="run-1", run_id_known=True,
        source="training", host="node7", pid=1234, launcher="slurm",
    )
    return RunContext(**{**base, **changes})  # type: ignore[arg-type]


def test_resource_attributes_use_semconv_and_training_keys() -> None:
    attrs = build_resource(context(), env={}).attributes
    assert attrs[schema.RES_SERVICE_NAME] == DEFAULT_SERVICE_NAME == "otel-train"
    assert (attrs[schema.RES_HOST], attrs[schema.RES_PID]) == ("node7", 1234)
    assert (attrs[schema.RES_RANK], attrs[schema.RES_LOCAL_RANK], attrs[schema.RES_WORLD_SIZE]) == (3, 1, 4)
    assert (attrs[schema.RES_ATTEMPT], attrs[schema.RES_JOB_ID], attrs[schema.RES_RUN_ID]) == (1, "77", "run-1")
    assert attrs[schema.RES_SOURCE] == "training"
    assert attrs["telemetry.sdk.language"] == "python"


def test_resource_omits_an_unknown_job_id() -> None:
    assert schema.RES_JOB_ID not in build_resource(context(job_id=None), env={}).attributes


def test_otel_service_name_and_resource_attributes_are_honoured() -> None:
    env = {"OTEL_SERVICE_NAME": "trainer", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod, team=ml%20infra"}
    attrs = build_resource(context(), env=env).attributes
    assert attrs["service.name"] == "trainer"
    assert attrs["deployment.environment"] == "prod" and attrs["team"] == "ml infra"


def test_service_name_in_resource_attributes_replaces_the_default_but_not_otel_service_name() -> None:
    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs"}
    assert build_resource(context(), env=env).attributes["service.name"] == "from-attrs"
    env["OTEL_SERVICE_NAME"] = "from-name"
    assert build_resource(context(), env=env).attributes["service.name"] == "from-name"


def test_detected_values_beat_resource_attributes_env() -> None:
    env = {"OTEL_RESOURCE_ATTRIBUTES": "training.rank=99,training.run_id=other,host.name=elsewhere"}
    attrs = build_resource(context(), env=env).attributes
    assert (attrs["training.rank"], attrs["training.run_id"], attrs["host.name"]) == (3, "run-1", "node7")


def test_env_detector_parses_like_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = "a=1, b = x%2Cy ,malformed,c=d=e,=empty"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", raw)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "svc")
    ours = EnvResourceDetector({"OTEL_RESOURCE_ATTRIBUTES": raw, "OTEL_SERVICE_NAME": "svc"}).detect()
    sdk = OTELResourceDetector().detect()
    expected = {k: v for k, v in sdk.attributes.items() if k}  # the SDK keeps an empty key; a resource cannot use it
    assert dict(ours.attributes) == expected
    assert expected["b"] == "x,y" and expected["c"] == "d=e"


def test_training_detector_is_a_real_sdk_detector_usable_by_a_tracer_provider() -> None:
    detector = TrainingResourceDetector(context())
    assert detector.is_process_dependent()
    resource = build_resource(context(), env={})
    provider = TracerProvider(resource=resource)
    try:
        span = provider.get_tracer("t").start_span("s")
        span.end()
        assert span.resource.attributes["training.rank"] == 3  # type: ignore[attr-defined]
    finally:
        provider.shutdown()
    assert isinstance(detector.detect(), Resource)
