"""Run context (rank, world size, attempt, run/job ids) from settings and launcher env -> OTel Resource.

Knows nothing of files. Each field is taken from the first source that has it, in the order:
explicit settings, torchrun, Slurm (also submitit's Slurm executor), submitit's local executor,
defaults (rank 0 of 1, attempt 0).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib import parse

from opentelemetry.sdk.environment_variables import OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
from opentelemetry.sdk.resources import (
    TELEMETRY_SDK_LANGUAGE,
    TELEMETRY_SDK_NAME,
    TELEMETRY_SDK_VERSION,
    Resource,
    ResourceDetector,
)
from opentelemetry.sdk.version import __version__ as otel_sdk_version

from otel_train import schema
from otel_train.config import ENV_VARS, Settings
from otel_train.errors import ConfigError

DEFAULT_SERVICE_NAME = "otel-train"

# Per launcher: which env var holds each field. Order matters: the first source with a field wins.
_TORCHRUN = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "attempt": "TORCHELASTIC_RESTART_COUNT",
}
_SLURM = {
    "rank": "SLURM_PROCID",
    "local_rank": "SLURM_LOCALID",
    "world_size": "SLURM_NTASKS",
    "attempt": "SLURM_RESTART_COUNT",
}
_SUBMITIT_LOCAL = {
    "rank": "SUBMITIT_LOCAL_GLOBALID",
    "local_rank": "SUBMITIT_LOCAL_LOCALID",
    "world_size": "SUBMITIT_LOCAL_NTASKS",
}
_INT_FIELDS = ("rank", "local_rank", "world_size", "attempt")
_DEFAULTS = {"rank": 0, "local_rank": 0, "world_size": 1, "attempt": 0}
_MIN = {"rank": 0, "local_rank": 0, "world_size": 1, "attempt": 0}


@dataclass(frozen=True, slots=True)
class RunContext:
    """Who this process is within the run; shared by the resource and every record."""

    rank: int
    local_rank: int
    world_size: int
    attempt: int
    job_id: str | None
    run_id: str
    run_id_known: bool  # False when the id was invented here (other ranks cannot know it)
    source: str
    host: str
    pid: int
    launcher: str  # "explicit" | "torchrun" | "slurm" | "submitit" | "default"


@dataclass(frozen=True, slots=True)
class _Found:
    value: int
    origin: str  # env var or setting that supplied the value, for error messages
    launcher: str


def _env_int(env: Mapping[str, str], var: str, field: str) -> int | None:
    raw = env.get(var, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < _MIN[field]:
        raise ConfigError(
            f"invalid environment variable {var}: got {raw!r}, expected a whole number >= {_MIN[field]} "
            f"(fix the launcher environment or set {ENV_VARS[field]} explicitly)"
        )
    return value


def _slurm_launcher(env: Mapping[str, str]) -> str:
    # submitit's Slurm executor runs tasks under srun and only adds SUBMITIT_EXECUTOR=slurm.
    return "submitit" if env.get("SUBMITIT_EXECUTOR", "").strip() == "slurm" else "slurm"


def _find_ints(settings: Settings, env: Mapping[str, str]) -> dict[str, _Found]:
    sources = (("torchrun", _TORCHRUN), (_slurm_launcher(env), _SLURM), ("submitit", _SUBMITIT_LOCAL))
    found: dict[str, _Found] = {}
    for field in _INT_FIELDS:
        explicit = getattr(settings, field)
        if explicit is not None:
            found[field] = _Found(explicit, f"{ENV_VARS[field]} / setting {field!r}", "explicit")
            continue
        for launcher, variables in sources:
            var = variables.get(field)
            value = None if var is None else _env_int(env, var, field)
            if value is not None:
                found[field] = _Found(value, var, launcher)
                break
        else:
            found[field] = _Found(_DEFAULTS[field], "default", "default")
    return found


def _slurm_job_id(env: Mapping[str, str]) -> str | None:
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID", "").strip(), env.get("SLURM_ARRAY_TASK_ID", "").strip()
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return env.get("SLURM_JOB_ID", "").strip() or None


def _detect_job_id(settings: Settings, env: Mapping[str, str]) -> str | None:
    return settings.job_id or _slurm_job_id(env) or env.get("SUBMITIT_LOCAL_JOB_ID", "").strip() or None


def _torchrun_run_id(env: Mapping[str, str]) -> str | None:
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != "none":  # torchrun writes the literal "none" when no --rdzv-id was given
        return run_id
    return None


def _rendezvous_run_id(env: Mapping[str, str]) -> str | None:
    """Under torchrun without an id, every rank sees the same MASTER_ADDR:MASTER_PORT: derive from it."""
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    under_torchrun = "TORCHELASTIC_RUN_ID" in env or "RANK" in env
    if not (under_torchrun and addr and port):
        return None
    return "torchrun-" + hashlib.sha256(f"{addr}:{port}".encode()).hexdigest()[:12]


def _generated_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"


def _detect_run_id(settings: Settings, env: Mapping[str, str]) -> tuple[str, bool]:
    run_id = (
        settings.run_id
        or _torchrun_run_id(env)
        or _slurm_job_id(env)
        or env.get("SUBMITIT_LOCAL_JOB_ID", "").strip()
        or _rendezvous_run_id(env)
    )
    return (run_id, True) if run_id else (_generated_run_id(), False)


def _check_ranks(found: Mapping[str, _Found]) -> None:
    rank, world = found["rank"], found["world_size"]
    if rank.value >= world.value:
        raise ConfigError(
            f"rank {rank.value} (from {rank.origin}) is not below world_size {world.value} "
            f"(from {world.origin}): the launcher environment disagrees with itself; set "
            f"{ENV_VARS['rank']} and {ENV_VARS['world_size']} explicitly or fix the launcher"
        )


def _launcher(found: Mapping[str, _Found]) -> str:
    """The source of the rank; if the rank is a default, the first source that supplied anything."""
    order = [found["rank"]] + [found[field] for field in _INT_FIELDS]
    return next((item.launcher for item in order if item.launcher != "default"), "default")


def detect_run_context(settings: Settings, env: Mapping[str, str] | None = None) -> RunContext:
    """Detect the run context; raises :class:`ConfigError` when launcher variables are bad or disagree.

    ``env=None`` reads ``os.environ``.
    """
    env = os.environ if env is None else env
    found = _find_ints(settings, env)
    _check_ranks(found)
    run_id, run_id_known = _detect_run_id(settings, env)
    return RunContext(
        rank=found["rank"].value,
        local_rank=found["local_rank"].value,
        world_size=found["world_size"].value,
        attempt=found["attempt"].value,
        job_id=_detect_job_id(settings, env),
        run_id=run_id,
        run_id_known=run_id_known,
        source=settings.source,
        host=settings.host or socket.gethostname(),
        pid=os.getpid(),
        launcher=_launcher(found),
    )


class TrainingResourceDetector(ResourceDetector):
    """Reports the run context as resource attributes (semconv keys where they exist, else ``training.*``)."""

    def __init__(self, ctx: RunContext, raise_on_error: bool = False) -> None:
        super().__init__(raise_on_error)
        self._ctx = ctx

    def detect(self) -> Resource:
        ctx = self._ctx
        attributes: dict[str, Any] = {
            schema.RES_HOST: ctx.host,
            schema.RES_PID: ctx.pid,
            schema.RES_RANK: ctx.rank,
            schema.RES_LOCAL_RANK: ctx.local_rank,
            schema.RES_WORLD_SIZE: ctx.world_size,
            schema.RES_ATTEMPT: ctx.attempt,
            schema.RES_RUN_ID: ctx.run_id,
            schema.RES_SOURCE: ctx.source,
        }
        if ctx.job_id is not None:
            attributes[schema.RES_JOB_ID] = ctx.job_id
        return Resource(attributes)

    def is_process_dependent(self) -> bool:
        return True  # process.pid


class EnvResourceDetector(ResourceDetector):
    """``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` parsed as the SDK does, from any mapping.

    The SDK's own ``OTELResourceDetector`` reads ``os.environ`` only; this one takes the mapping so that
    callers (and tests) can inject an environment.
    """

    def __init__(self, env: Mapping[str, str] | None = None, raise_on_error: bool = False) -> None:
        super().__init__(raise_on_error)
        self._env = os.environ if env is None else env

    def detect(self) -> Resource:
        attributes: dict[str, str] = {}
        for item in self._env.get(OTEL_RESOURCE_ATTRIBUTES, "").split(","):
            key, sep, value = item.partition("=")
            if sep and key.strip():  # the SDK skips malformed pairs too
                attributes[key.strip()] = parse.unquote(value.strip())
        service_name = self._env.get(OTEL_SERVICE_NAME, "").strip()
        if service_name:
            attributes[schema.RES_SERVICE_NAME] = service_name
        return Resource(attributes)


def build_resource(ctx: RunContext, env: Mapping[str, str] | None = None) -> Resource:
    """The tracer provider's resource: defaults < OTel env variables < detected run context.

    ``service.name`` defaults to ``otel-train``; ``OTEL_SERVICE_NAME`` or ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES`` replace it. Detected keys (``host.name``, ``process.pid``,
    ``training.*``) always win so that the resource matches the JSONL records.
    """
    defaults = Resource(
        {
            TELEMETRY_SDK_LANGUAGE: "python",
            TELEMETRY_SDK_NAME: "opentelemetry",
            TELEMETRY_SDK_VERSION: otel_sdk_version,
            schema.RES_SERVICE_NAME: DEFAULT_SERVICE_NAME,
        }
    )
    return defaults.merge(EnvResourceDetector(env).detect()).merge(TrainingResourceDetector(ctx).detect())
