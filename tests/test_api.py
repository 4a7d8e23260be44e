"""The public API (README "Python API") against real files written through the real OTel SDK."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import otel_train as ot
from otel_train import runtime

HEX32 = set("0123456789abcdef")


def records(save_path: Path) -> list[dict]:
    files = sorted(glob.glob(str(save_path / "structured_logs" / "*.jsonl")))
    assert len(files) == 1, files
    with open(files[0], encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def spans_by_name(recs: list[dict], kind: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for rec in recs:
        if rec["kind"] == kind:
            out.setdefault(rec["name"], []).append(rec)
    return out


@pytest.fixture
def run(tmp_path: Path):
    ot.init(save_path=tmp_path, enabled=True)
    yield tmp_path
    ot.shutdown()


def test_disabled_is_a_noop_without_threads_or_files(tmp_path: Path) -> None:
    threads = threading.active_count()
    ot.init(save_path=tmp_path)  # enabled defaults to False
    assert not ot.is_enabled()
    with ot.log_trace_span("forward", x=1) as span:
        assert not span.is_recording()
    ot.log_trace_instant("i")
    ot.log_trace_scalar({"loss": 1.0})
    ot.shutdown()
    assert threading.active_count() == threads
    assert not (tmp_path / "structured_logs").exists()


def test_sdk_disabled_env_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    ot.init(save_path=tmp_path, enabled=True)
    assert not ot.is_enabled()
    assert not (tmp_path / "structured_logs").exists()


def test_env_only_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_ENABLED", "1")
    monkeypatch.setenv("OTEL_TRAIN_SAVE_PATH", str(tmp_path))
    monkeypatch.setenv("OTEL_TRAIN_SOURCE", "pretrain")
    ot.init()
    try:
        assert ot.is_enabled()
        with ot.log_trace_span("forward"):
            pass
    finally:
        ot.shutdown()
    (path,) = glob.glob(str(tmp_path / "structured_logs" / "pretrain.global_rank_0.*.jsonl"))
    assert {r["source"] for r in map(json.loads, open(path))} == {"pretrain"}


def test_keyword_beats_config_beats_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_SOURCE", "from_env")
    ot.init(save_path=tmp_path, config={"enabled": True, "source": "from_config"}, source="from_kwarg")
    ot.shutdown()
    assert glob.glob(str(tmp_path / "structured_logs" / "from_kwarg.global_rank_0.*.jsonl"))


@pytest.mark.parametrize("kwargs, needle", [
    ({"enabled": True, "bogus_key": 1}, "bogus_key"),
    ({"enabled": True, "backup_count": -1}, "backup_count"),
    ({"enabled": True, "max_file_size_mb": "big"}, "max_file_size_mb"),
    ({"enabled": True, "save_path": None}, "save_path"),
    # Issue 11: these escaped init as OverflowError, ValueError (embedded null byte), UnicodeEncodeError.
    ({"enabled": True, "save_path": "/tmp/x", "max_file_size_mb": 1e308}, "max_file_size_mb"),
    ({"enabled": True, "save_path": "/tmp/a\0b"}, "save_path"),
    ({"enabled": True, "save_path": "/tmp/x", "run_id": "run-\udcff"}, "run_id"),
])
def test_init_is_strict(kwargs: dict, needle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRAIN_SAVE_PATH", raising=False)
    with pytest.raises(ot.ConfigError) as err:
        ot.init(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)
    assert not ot.is_enabled()


def test_unwritable_directory_raises_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ot.ConfigError, match="writable"):
        ot.init(save_path=blocker / "run", enabled=True)
    assert not ot.is_enabled()


def test_failing_handler_factory_raises_config_error(tmp_path: Path) -> None:
    def factory(**_: object) -> None:
        raise RuntimeError("no database")

    with pytest.raises(ot.ConfigError, match="no database"):
        ot.init(save_path=tmp_path, enabled=True, handlers=[factory])
    assert not ot.is_enabled()


def test_init_twice_raises_and_shutdown_is_idempotent(run: Path) -> None:
    with pytest.raises(ot.ConfigError, match="already"):
        ot.init(save_path=run, enabled=True)
    ot.shutdown()
    ot.shutdown()
    assert not ot.is_enabled()


def test_span_context_manager_records_start_and_end(run: Path) -> None:
    with ot.log_trace_span("outer", kind_of="x"):
        with ot.log_trace_span("inner", layer=3):
            pass
    ot.shutdown()
    recs = records(run)
    starts, ends = spans_by_name(recs, "span_start"), spans_by_name(recs, "span_end")
    outer_s, inner_s = starts["outer"][0], starts["inner"][0]
    outer_e, inner_e = ends["outer"][0], ends["inner"][0]
    assert outer_s["event"] == "outer_start" and outer_e["event"] == "outer_end"
    assert inner_s["parent_span_id"] == outer_s["span_id"]
    assert "parent_span_id" not in outer_s
    assert inner_s["trace_id"] == outer_s["trace_id"]
    for s, e in ((outer_s, outer_e), (inner_s, inner_e)):
        assert (s["trace_id"], s["span_id"]) == (e["trace_id"], e["span_id"])
        assert e["status"] == "ok" and e["dur_ms"] >= 0 and e["ts"] >= s["ts"]
    assert inner_s["attrs"] == {"layer": 3} and inner_e["attrs"] == {"layer": 3}
    assert inner_s["caller"].startswith(__file__ + ":") and inner_s["caller"].endswith(":test_span_context_manager_records_start_and_end")
    seqs = [r["seq"] for r in recs]
    assert seqs == list(range(1, len(recs) + 1))


def test_error_marks_span_and_reraises_unchanged(run: Path) -> None:
    original = KeyError("missing")
    with pytest.raises(KeyError) as err:
        with ot.log_trace_span("load"):
            raise original
    assert err.value is original
    ot.shutdown()
    (end,) = spans_by_name(records(run), "span_end")["load"]
    assert end["status"] == "error"
    assert end["error"]["type"] == "KeyError" and "missing" in end["error"]["message"]


def test_decorator_sync_and_async(run: Path) -> None:
    @ot.log_trace_span("sync_fn", role="a")
    def add(a: int, b: int) -> int:
        return a + b

    @ot.log_trace_span("async_fn")
    async def mul(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a * b

    assert add(2, 3) == 5 and add.__name__ == "add"
    assert asyncio.run(mul(2, 3)) == 6
    ot.shutdown()
    ends = spans_by_name(records(run), "span_end")
    assert len(ends["sync_fn"]) == 1 and ends["sync_fn"][0]["attrs"] == {"role": "a"}
    assert len(ends["async_fn"]) == 1 and ends["async_fn"][0]["status"] == "ok"


def test_decorator_applied_before_init_traces_after_init(tmp_path: Path) -> None:
    @ot.log_trace_span("early")
    def work() -> int:
        return 7

    assert work() == 7  # not traced: tracing is off
    ot.init(save_path=tmp_path, enabled=True)
    assert work() == 7
    ot.shutdown()
    assert len(spans_by_name(records(tmp_path), "span_end")["early"]) == 1


def test_instant_and_scalar_carry_enclosing_span_and_step(run: Path) -> None:
    ot.set_step(5, epoch=1, iteration=50)
    with ot.log_trace_span("forward"):
        ot.log_trace_instant("nan_guard", tripped=False)
        ot.log_trace_scalar({"loss": 0.25, "tokens": 4096, "skipped": False})
    ot.shutdown()
    recs = records(run)
    fwd = spans_by_name(recs, "span_start")["forward"][0]
    (instant,) = [r for r in recs if r["kind"] == "instant" and r["name"] == "nan_guard"]
    (scalar,) = [r for r in recs if r["kind"] == "scalar"]
    for rec in (instant, scalar):
        assert (rec["trace_id"], rec["span_id"]) == (fwd["trace_id"], fwd["span_id"])
        assert (rec["step"], rec["epoch"], rec["iteration"]) == (5, 1, 50)
    assert instant["event"] == "nan_guard" and instant["attrs"] == {"tripped": False}
    assert scalar["event"] == "scalar" and scalar["values"] == {"loss": 0.25, "tokens": 4096, "skipped": False}


def test_scalar_rejects_non_numbers_naming_the_key(run: Path) -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="'loss'"):
        ot.log_trace_scalar({"lr": 0.1, "loss": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="'name'"):
        ot.log_trace_scalar({"name": "adam"})
    with pytest.raises(TypeError):
        ot.log_trace_scalar([("loss", 1.0)])  # type: ignore[arg-type]


def test_scalar_type_check_holds_when_disabled() -> None:
    with pytest.raises(TypeError, match="'x'"):
        ot.log_trace_scalar({"x": "1"})


def test_nonfinite_scalars_are_kept_as_text(run: Path) -> None:
    ot.log_trace_scalar({"loss": float("nan"), "grad": float("inf")})
    ot.shutdown()
    (scalar,) = [r for r in records(run) if r["kind"] == "scalar"]
    assert scalar["values"] == {"loss": "nan", "grad": "inf"}


def test_step_context_tags_and_relative_step(run: Path) -> None:
    with ot.training_step(100, epoch=2):
        ot.add_step_tag("checkpoint")
        ot.add_step_tag("checkpoint")
        with ot.log_trace_span("forward"):
            pass
    with ot.training_step(101):
        with ot.log_trace_span("forward"):
            pass
    ot.shutdown()
    recs = records(run)
    fwd = spans_by_name(recs, "span_start")["forward"]
    assert (fwd[0]["step"], fwd[0]["relative_step"], fwd[0]["epoch"], fwd[0]["tags"]) == (100, 0, 2, ["checkpoint"])
    assert (fwd[1]["step"], fwd[1]["relative_step"], fwd[1]["epoch"]) == (101, 1, 2)
    assert "tags" not in fwd[1]
    steps = spans_by_name(recs, "span_start")["step"]
    assert [s["step"] for s in steps] == [100, 101]
    forward_parents = {f["parent_span_id"] for f in fwd}
    assert forward_parents == {s["span_id"] for s in steps}


def test_set_step_rejects_non_integers() -> None:
    with pytest.raises(TypeError):
        ot.set_step(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "error"), [(None, TypeError), (2**63, ValueError), (2**53 + 1, ValueError),
                                              (-1, ValueError), ("3", TypeError), (True, TypeError)])
def test_set_step_takes_ints_from_0_to_2_53(value: object, error: type, run: Path) -> None:
    """Issue 11: set_step(2**63) was accepted and written (readers reject it); None raised int()'s message."""
    with pytest.raises(error, match=r"otel_train.set_step: step must be an int from 0 to 2\*\*53"):
        ot.set_step(value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="epoch"):
        ot.set_step(1, epoch=-3)
    ot.set_step(2**53, epoch=0, iteration=2**53)  # the bounds themselves are fine
    ot.shutdown()
    assert max(r.get("step", 0) for r in records(run)) == 2**53


def test_unencodable_text_is_written_with_replacement_characters(run: Path) -> None:
    """Issue 11: a span named os.fsdecode(b"...\\xff...") was dropped (seq gap); one bad tag lost its step."""
    name = os.fsdecode(b"load_shard_\xff.bin")
    ot.set_step(1)
    with ot.log_trace_span(name, path=name):
        ot.add_step_tag(os.fsdecode(b"bad\xfetag"))
        ot.log_trace_instant(name, **{name: name})
    with ot.log_trace_span("forward"):
        ot.log_trace_scalar({name: 1.0})
    ot.shutdown()
    recs = records(run)
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1))
    events = [r["event"] for r in recs]
    assert events[1:] == ["load_shard_\ufffd.bin_start", "load_shard_\ufffd.bin", "load_shard_\ufffd.bin_end",
                          "forward_start", "scalar", "forward_end", "process_end"]
    assert recs[2]["tags"] == ["bad\ufffdtag"] and recs[-2]["tags"] == ["bad\ufffdtag"]
    assert recs[2]["attrs"] == {"load_shard_\ufffd.bin": "load_shard_\ufffd.bin"}
    assert recs[-1]["attrs"]["dropped_records"] == 0


class _Unprintable:
    def __str__(self) -> str:
        raise KeyError("str() of a user object")

    __repr__ = __str__


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise KeyError("str() of the exception")


def _hostile_attrs() -> dict[str, object]:
    circular: dict[str, object] = {}
    circular["self"] = circular
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    return {"circular": circular, "deep": deep, "unprintable": _Unprintable(), "big": 2**70,
            "text": os.fsdecode(b"\xff")}


@pytest.mark.parametrize("exporters", ["jsonl", "jsonl,console", "console"])
def test_hostile_attribute_values_never_reach_training(exporters: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11: with the OTel SDK in the path these raised RecursionError / the object's own error."""
    ot.init(save_path=tmp_path, enabled=True, traces_exporter=exporters)
    attrs = _hostile_attrs()
    with ot.log_trace_span("forward", **attrs):
        ot.log_trace_instant("note", **attrs)
    with pytest.raises(_UnprintableError):  # the user's exception, unchanged
        with ot.log_trace_span("backward"):
            raise _UnprintableError()
    ot.shutdown()
    capsys.readouterr()
    if "jsonl" not in exporters:
        return
    recs = records(tmp_path)
    start, note, _, _, bwd_end = recs[1:6]
    for rec in (start, note):
        assert rec["attrs"]["circular"]["self"]["self"]  # bounded, not dropped
        assert rec["attrs"]["unprintable"] == "<unprintable _Unprintable>"
        assert rec["attrs"]["big"] in (2**70, str(2**70)) and rec["attrs"]["text"] == "\ufffd"
    assert bwd_end["status"] == "error" and bwd_end["error"]["type"].endswith("_UnprintableError")
    assert recs[-1]["attrs"]["dropped_records"] == 0


def test_one_trace_per_step_shared_across_processes(tmp_path: Path) -> None:
    """Two ranks of one run give their `step 3` span the same trace id (run id + step)."""
    code = (
        "import otel_train as ot\n"
        "ot.init(enabled=True)\n"
        "with ot.training_step(3):\n"
        "    with ot.log_trace_span('forward'):\n"
        "        pass\n"
        "ot.shutdown()\n"
    )
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   TORCHELASTIC_RUN_ID="job-42", OTEL_TRAIN_SAVE_PATH=str(tmp_path))
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    by_rank: dict[int, dict[str, dict]] = {}
    for path in glob.glob(str(tmp_path / "structured_logs" / "*.jsonl")):
        for rec in map(json.loads, open(path)):
            if rec["kind"] == "span_start":
                by_rank.setdefault(rec["rank"], {})[rec["name"]] = rec
    assert set(by_rank) == {0, 1}
    assert by_rank[0]["step"]["trace_id"] == by_rank[1]["step"]["trace_id"]
    assert by_rank[0]["step"]["span_id"] != by_rank[1]["step"]["span_id"]
    for rank in (0, 1):
        assert by_rank[rank]["forward"]["trace_id"] == by_rank[rank]["step"]["trace_id"]
        assert by_rank[rank]["step"]["run_id"] == "job-42" and by_rank[rank]["step"]["world_size"] == 2


def test_shutdown_ends_open_spans_as_incomplete(run: Path) -> None:
    outer = ot.log_trace_span("step")
    outer.__enter__()
    inner = ot.log_trace_span("data_fetch")
    inner.__enter__()
    ot.shutdown()
    inner.__exit__(None, None, None)  # after shutdown: no second end record
    outer.__exit__(None, None, None)
    recs = records(run)
    ends = [r for r in recs if r["kind"] == "span_end"]
    assert [(e["name"], e["status"]) for e in ends] == [("data_fetch", "incomplete"), ("step", "incomplete")]
    assert recs[-1]["name"] == "process_end" and recs[-1]["attrs"]["incomplete_spans"] == 2


def test_is_enabled_tracks_lifecycle(tmp_path: Path) -> None:
    assert not ot.is_enabled()
    ot.init(save_path=tmp_path, enabled=True)
    assert ot.is_enabled() and runtime.trace_file() is not None
    ot.shutdown()
    assert not ot.is_enabled() and runtime.trace_file() is None


def test_ids_do_not_follow_the_global_random_state(run: Path) -> None:
    """Ranks seed `random` identically and Lightning restores its state: span ids must not repeat."""
    import random

    state = random.getstate()
    with ot.log_trace_span("first"):
        pass
    random.setstate(state)
    with ot.log_trace_span("second"):
        pass
    ot.shutdown()
    starts = [r for r in records(run) if r["kind"] == "span_start"]
    assert len({r["span_id"] for r in starts}) == 2 and len({r["trace_id"] for r in starts}) == 2


def test_user_otel_spans_nest_under_ours_and_attributes_set_inside_land_in_the_end_record(run: Path) -> None:
    """On the lean path our spans are OTel API spans in the OTel context: user OTel code nests under them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with ot.log_trace_span("forward") as span:
        span.set_attribute("tokens", 512)
        with provider.get_tracer("user").start_as_current_span("user_op"):
            pass
    ot.shutdown()
    (user_span,) = exporter.get_finished_spans()
    (start,) = spans_by_name(records(run), "span_start")["forward"]
    (end,) = spans_by_name(records(run), "span_end")["forward"]
    assert format(user_span.parent.span_id, "016x") == start["span_id"]
    assert format(user_span.context.trace_id, "032x") == start["trace_id"]
    assert end["attrs"] == {"tokens": 512} and "attrs" not in start


def test_bridged_log_instant_names_the_user_caller(tmp_path: Path) -> None:
    """The caller of a bridged log record is the user's logging call, not the logging package."""
    import logging

    ot.init(save_path=tmp_path, enabled=True, log_bridge=True)
    logging.getLogger("user.train").warning("loss spiked")
    ot.shutdown()
    (log,) = [r for r in records(tmp_path) if r["kind"] == "instant" and r["name"] == "log"]
    assert log["caller"].startswith(__file__ + ":")
    assert log["caller"].endswith(":test_bridged_log_instant_names_the_user_caller")
