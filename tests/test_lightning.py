"""The Lightning TraceCallback on a real (tiny, CPU) Trainer.fit, checked through the JSONL file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pl = pytest.importorskip("lightning.pytorch")
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import otel_train as ot  # noqa: E402
from otel_train import phases  # noqa: E402
from otel_train import schema as S  # noqa: E402
from otel_train.lightning import TraceCallback  # noqa: E402
from otel_train.phases import HOOK_SPAN  # noqa: E402

STEP_ORDER = [phases.DATA_FETCH, phases.BATCH_TO_DEVICE, phases.HOOKS_BEFORE_STEP, phases.FORWARD,
              phases.BACKWARD, phases.OPTIMIZER, phases.HOOKS_AFTER_STEP]


class TinyModule(pl.LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at = fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise RuntimeError("boom in training_step")
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AfterBatch(pl.Callback):
    """Implements one hook: only that hook may get hook spans."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.calls += 1


def _fit(root: Path, callbacks: list[pl.Callback], fail_at: int | None = None) -> tuple[pl.Trainer, TinyModule]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    model = TinyModule(fail_at)
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=True,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                         val_check_interval=2, default_root_dir=root,
                         # The sanity check runs inside isolate_rng(), which rewinds the global
                         # ``random``: span ids must not repeat after it (the runtime's ids are private).
                         num_sanity_val_steps=1,
                         callbacks=callbacks)
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    return trainer, model


def _records(root: Path) -> list[dict[str, Any]]:
    files = sorted((root / S.STRUCTURED_LOGS_DIR).glob("*" + S.FILE_SUFFIX))
    assert files, "no trace file written"
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def _key(record: dict[str, Any], field: str = S.SPAN_ID) -> tuple[str, str]:
    return record[S.TRACE_ID], record.get(field, "")


def _spans(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(trace_id, span_id) -> {"start": record, "end": record}; every started span must have ended."""
    spans: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r[S.KIND] == S.SPAN_START:
            spans[_key(r)] = {"start": r}
        elif r[S.KIND] == S.SPAN_END:
            spans[_key(r)]["end"] = r
    unclosed = [s["start"][S.NAME] for s in spans.values() if "end" not in s]
    assert not unclosed, f"spans never ended: {unclosed}"
    return spans


def _parent(spans: dict[tuple[str, str], dict[str, Any]], span: dict[str, Any]) -> dict[str, Any] | None:
    return spans.get(_key(span["start"], S.PARENT_SPAN_ID))


def _children(spans: dict[tuple[str, str], dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    kids = [s for s in spans.values() if _parent(spans, s) is parent]
    return sorted(kids, key=lambda s: s["start"][S.SEQ])


def _assert_strictly_nested(spans: dict[tuple[str, str], dict[str, Any]]) -> None:
    for span in spans.values():
        parent = _parent(spans, span)
        if parent is not None:
            assert parent["start"][S.SEQ] < span["start"][S.SEQ] < span["end"][S.SEQ] < parent["end"][S.SEQ], (
                f"{span['start'][S.NAME]} is not inside its parent {parent['start'][S.NAME]}")


@pytest.fixture
def traced(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    ot.init(tmp_path, enabled=True, **getattr(request, "param", {}))
    yield tmp_path
    ot.shutdown()


def test_fit_writes_steps_phases_eval_and_checkpoint(traced: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    trainer, model = _fit(traced, [TraceCallback()])
    ot.shutdown()
    records = _records(traced)
    spans = _spans(records)
    _assert_strictly_nested(spans)

    steps = sorted((s for s in spans.values() if s["start"][S.NAME] == phases.STEP), key=lambda s: s["start"][S.SEQ])
    assert [s["start"][S.STEP] for s in steps] == [0, 1, 2]
    assert [s["start"][S.ITERATION] for s in steps] == [0, 1, 2]
    for step in steps:
        assert step["end"][S.STATUS] == S.STATUS_OK
        assert "parent_span_id" not in step["start"]
        kids = _children(spans, step)
        assert [k["start"][S.NAME] for k in kids] == STEP_ORDER
        # Everything written while the step was open carries its context.
        inside = [r for r in records if step["start"][S.SEQ] <= r[S.SEQ] <= step["end"][S.SEQ]]
        assert {r[S.STEP] for r in inside} == {step["start"][S.STEP]}
        assert {r[S.EPOCH] for r in inside} == {0}
        scalars = [r for r in inside if r[S.KIND] == S.SCALAR]
        assert len(scalars) == 1 and scalars[0][S.VALUES]["batch_size"] == 4
        assert scalars[0][S.SPAN_ID] in {k["start"][S.SPAN_ID] for k in kids}  # inside a phase, not loose

    evals = [s for s in spans.values() if s["start"][S.NAME] == phases.EVAL]
    assert [e["start"][S.ATTRS]["stage"] for e in evals] == ["sanity_check", "validate"]
    assert evals[1]["start"][S.STEP] == 1  # after the second batch (val_check_interval=2)
    starts = [r for r in records if r[S.KIND] == S.SPAN_START]
    assert len({r[S.SPAN_ID] for r in starts}) == len(starts)  # isolate_rng() cannot make ids repeat
    assert all("parent_span_id" not in e["start"] for e in evals)  # validation runs between steps
    checkpoints = [s for s in spans.values() if s["start"][S.NAME] == phases.CHECKPOINT]
    assert checkpoints and all(c["end"][S.STATUS] == S.STATUS_OK for c in checkpoints)
    assert list((traced / "checkpoints").glob("*.ckpt")), "ModelCheckpoint wrote no file"
    assert not [s for s in spans.values() if s["start"][S.NAME] == HOOK_SPAN]  # trace_hooks is off
    assert trainer.profiler.__class__.__name__ == "PassThroughProfiler"  # given back at teardown

    # Tracing does not change training: same seed, same weights without the callback.
    _, plain = _fit(tmp_path_factory.mktemp("plain"), [])
    for traced_p, plain_p in zip(model.parameters(), plain.parameters()):
        assert torch.equal(traced_p, plain_p)


@pytest.mark.parametrize("traced", [{"trace_hooks": True, "batch_stats_every": 2}], indirect=True)
def test_trace_hooks_spans_only_for_implemented_hooks(traced: Path) -> None:
    after = AfterBatch()
    _fit(traced, [after, TraceCallback()])
    ot.shutdown()
    spans = _spans(_records(traced))
    _assert_strictly_nested(spans)
    hooks = [s for s in spans.values() if s["start"][S.NAME] == HOOK_SPAN]
    mine = [h for h in hooks if h["start"][S.ATTRS]["callback"] == "AfterBatch"]
    assert len(mine) == after.calls == 3
    assert {h["start"][S.ATTRS]["hook"] for h in mine} == {"on_train_batch_end"}
    for h in mine:
        assert _parent(spans, h)["start"][S.NAME] == phases.HOOKS_AFTER_STEP
    assert not [h for h in hooks if h["start"][S.ATTRS]["callback"] == "TraceCallback"]
    # ModelCheckpoint's save happens inside its own hook span.
    ckpt = [s for s in spans.values() if s["start"][S.NAME] == phases.CHECKPOINT]
    assert ckpt and all(_parent(spans, c)["start"][S.ATTRS]["callback"] == "ModelCheckpoint" for c in ckpt)
    records = _records(traced)
    assert sorted(r[S.STEP] for r in records if r[S.KIND] == S.SCALAR) == [0, 2]  # every 2nd step


def test_exception_in_a_batch_closes_every_span_as_error(traced: Path) -> None:
    callback = TraceCallback()
    with pytest.raises(RuntimeError, match="boom in training_step"):
        _fit(traced, [callback], fail_at=1)
    ot.shutdown()
    spans = _spans(_records(traced))  # asserts that every span ended
    _assert_strictly_nested(spans)
    failed = [s for s in spans.values() if s["end"][S.STATUS] == S.STATUS_ERROR]
    assert {(s["start"][S.NAME], s["start"][S.STEP]) for s in failed} == {(phases.STEP, 1), (phases.FORWARD, 1)}
    assert all(s["end"][S.ERROR]["type"] == "RuntimeError" for s in failed)
    assert all(s["end"][S.STATUS] != S.STATUS_INCOMPLETE for s in spans.values())


def test_does_nothing_when_tracing_is_off(tmp_path: Path) -> None:
    assert not ot.is_enabled()
    trainer, _ = _fit(tmp_path, [TraceCallback()])
    assert trainer.profiler.__class__.__name__ == "PassThroughProfiler"
    assert not (tmp_path / S.STRUCTURED_LOGS_DIR).exists()
