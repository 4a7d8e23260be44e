"""TelemetrySampler: source checks at construction, scalars every N steps, never raising at run time.

This machine has no GPU: 'cuda' and 'nvml' are tested for the ConfigError they must raise here, and the
NVML read path with a stand-in pynvml module (the real one cannot start without a driver)."""

from __future__ import annotations

import sys
import types

import pytest

from otel_train import _report, telemetry
from otel_train.errors import ConfigError


def test_process_source_samples_rss_and_cpu() -> None:
    sampler = telemetry.TelemetrySampler(("process",), every=2)
    values = sampler.sample()
    assert values["process.rss_bytes"] > 10_000_000
    assert values["process.cpu_percent"] >= 0.0
    sampler.close()
    assert sampler.sample() == {}


def test_on_step_records_every_n_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[dict] = []
    monkeypatch.setattr(telemetry.api, "log_trace_scalar", logged.append)
    sampler = telemetry.TelemetrySampler(("process",), every=3)
    for step in range(7):
        sampler.on_step(step)
    assert len(logged) == 3 and all("process.rss_bytes" in v for v in logged)  # steps 0, 3, 6


def test_psutil_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # makes `import psutil` raise ImportError
    with pytest.raises(ConfigError, match=r"otel-train\[telemetry\]"):
        telemetry.TelemetrySampler(("process",), every=1)


def test_cuda_unavailable_is_a_config_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ConfigError, match="torch.cuda.is_available"):
        telemetry.TelemetrySampler(("process", "cuda"), every=1)


def test_nvml_without_driver_is_a_config_error() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    with pytest.raises(ConfigError, match="nvml"):
        telemetry.TelemetrySampler(("nvml",), every=1)


def test_unknown_source_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'tpu'"):
        telemetry.TelemetrySampler(("tpu",), every=1)


def _fake_pynvml(fail_power: bool) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    calls: dict[str, object] = {}
    nvml.NVMLError = NVMLError
    nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM, nvml.NVML_TEMPERATURE_GPU = 1, 2, 0
    nvml.nvmlInit = lambda: calls.setdefault("init", True)
    nvml.nvmlShutdown = lambda: calls.setdefault("shutdown", True)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: calls.setdefault("index", i)
    nvml.nvmlDeviceGetHandleByUUID = lambda u: calls.setdefault("uuid", u)
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: 1980 if kind == 1 else 2619
    nvml.nvmlDeviceGetTemperature = lambda h, kind: 41

    def power(handle: object) -> int:
        if fail_power:
            raise NVMLError("Not Supported")
        return 123_456

    nvml.nvmlDeviceGetPowerUsage = power
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=97, memory=40)
    nvml.calls = calls
    return nvml


def test_nvml_probe_maps_local_rank_and_skips_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml(fail_power=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    sampler = telemetry.TelemetrySampler(("nvml",), every=1)
    assert fake.calls["index"] == 6
    assert sampler.sample() == {
        "nvml.sm_clock_mhz": 1980, "nvml.mem_clock_mhz": 2619, "nvml.temperature_c": 41,
        "nvml.gpu_util_percent": 97, "nvml.mem_util_percent": 40,
    }
    sampler.close()
    assert fake.calls["shutdown"] is True


def test_nvml_uuid_and_power(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml(fail_power=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8d1c")
    sampler = telemetry.TelemetrySampler(("nvml",), every=1)
    assert fake.calls["uuid"] == "GPU-8d1c"
    assert sampler.sample()["nvml.power_w"] == pytest.approx(123.456)


def test_on_step_never_raises_and_reports_once(capsys: pytest.CaptureFixture[str]) -> None:
    sampler = telemetry.TelemetrySampler(("process",), every=1)

    def broken() -> dict:
        raise OSError("/proc vanished")

    sampler._probes = [broken]
    _report.reset()
    for step in range(3):
        sampler.on_step(step)
    assert capsys.readouterr().err.count("/proc vanished") == 1
    assert _report.counts() == {"telemetry sampling:OSError": 3}
