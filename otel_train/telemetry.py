"""Telemetry scalars every N steps: process RSS and CPU, CUDA caching-allocator memory, NVML clocks,
temperature, power and utilisation.

Sources are checked when the sampler is built (``init`` raises :class:`ConfigError` for one that
can't work here); once running, sampling never raises and never synchronizes a device.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from otel_train import _report, api
from otel_train.errors import ConfigError

Probe = Callable[[], dict[str, int | float]]


def _process_probe() -> Probe:
    try:
        import psutil
    except ImportError:
        raise ConfigError(
            "telemetry source 'process' needs psutil: pip install 'otel-train[telemetry]' "
            "(or remove 'process' from telemetry_sources)"
        ) from None
    proc = psutil.Process()
    proc.cpu_percent(None)  # the first call only primes the counter (it returns 0.0)

    def probe() -> dict[str, int | float]:
        return {"process.rss_bytes": proc.memory_info().rss, "process.cpu_percent": proc.cpu_percent(None)}

    return probe


def _cuda_probe() -> Probe:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "telemetry source 'cuda' needs a CUDA device, but torch.cuda.is_available() is False here "
            "(remove 'cuda' from telemetry_sources / OTEL_TRAIN_TELEMETRY_SOURCES)"
        )
    cuda = torch.cuda

    def probe() -> dict[str, int | float]:
        # Caching-allocator counters are host-side bookkeeping: reading them doesn't sync the device.
        device = cuda.current_device()
        return {
            "cuda.memory_allocated_bytes": cuda.memory_allocated(device),
            "cuda.memory_reserved_bytes": cuda.memory_reserved(device),
            "cuda.max_memory_allocated_bytes": cuda.max_memory_allocated(device),
        }

    return probe


def _nvml_device_id() -> str | int:
    """This rank's GPU as NVML sees it: LOCAL_RANK, mapped through CUDA_VISIBLE_DEVICES when set."""
    index = int(os.environ.get("LOCAL_RANK", "0") or 0)
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if index < len(visible):
        entry = visible[index]
        return int(entry) if entry.isdigit() else entry  # a GPU-/MIG- UUID otherwise
    return index


class _Nvml:
    """One NVML device handle; each metric is skipped quietly where the device doesn't support it."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise ConfigError(
                "telemetry source 'nvml' needs nvidia-ml-py: pip install 'otel-train[telemetry]' "
                "(or remove 'nvml' from telemetry_sources)"
            ) from None
        self._nvml = pynvml
        device = _nvml_device_id()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise ConfigError(
                f"telemetry source 'nvml' can't start NVML ({exc}): no NVIDIA driver or GPU here "
                "(remove 'nvml' from telemetry_sources)"
            ) from None
        try:
            if isinstance(device, int):
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(device)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(device)
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise ConfigError(
                f"telemetry source 'nvml' can't open GPU {device!r} ({exc}): check LOCAL_RANK and "
                "CUDA_VISIBLE_DEVICES"
            ) from None

        self._reads = self._metrics()

    def _metrics(self) -> dict[str, Callable[[], int | float]]:
        nvml, handle = self._nvml, self._handle
        return {
            "nvml.sm_clock_mhz": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "nvml.mem_clock_mhz": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
            "nvml.temperature_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "nvml.power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "nvml.gpu_util_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
            "nvml.mem_util_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).memory,
        }

    def probe(self) -> dict[str, int | float]:
        values: dict[str, int | float] = {}
        for key, read in self._reads.items():
            try:
                values[key] = read()
            except self._nvml.NVMLError:
                continue
        return values

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


class TelemetrySampler:
    """Records telemetry scalars every ``every`` steps (a ``step_listeners`` entry via :meth:`on_step`)."""

    def __init__(self, sources: tuple[str, ...], every: int) -> None:
        self.every = every
        self._nvml: _Nvml | None = None
        self._probes: list[Probe] = []
        try:
            for source in sources:
                if source == "process":
                    self._probes.append(_process_probe())
                elif source == "cuda":
                    self._probes.append(_cuda_probe())
                elif source == "nvml":
                    self._nvml = _Nvml()
                    self._probes.append(self._nvml.probe)
                else:
                    raise ConfigError(
                        f"unknown telemetry source {source!r}: expected process, cuda or nvml "
                        "(fix telemetry_sources / OTEL_TRAIN_TELEMETRY_SOURCES)"
                    )
        except ConfigError:
            self.close()
            raise

    def sample(self) -> dict[str, Any]:
        """Read every source now (what :meth:`on_step` records)."""
        values: dict[str, Any] = {}
        for probe in self._probes:
            values.update(probe())
        return values

    def on_step(self, step: int) -> None:
        """Record the scalars when ``step`` is a multiple of ``every``; never raises."""
        if self.every <= 0 or step % self.every:
            return
        try:
            values = self.sample()
            if values:
                api.log_trace_scalar(values)
        except Exception as exc:  # noqa: BLE001 - telemetry must never break training
            _report.report(f"telemetry sampling:{type(exc).__name__}",
                           f"telemetry sampling failed at step {step}: {_report.describe(exc)}; training goes on")

    def close(self) -> None:
        """Release NVML; the sampler records nothing afterwards."""
        self._probes = []
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None
