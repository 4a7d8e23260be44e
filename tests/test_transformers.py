"""The Transformers TraceCallback on a real (tiny, CPU, built from config) Trainer.train."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

# huggingface_hub reads HF_HUB_OFFLINE once, at import: set it for the import only, so it does not
# leak into the environment of every later test's subprocesses (Phoenix hangs at startup with it).
_offline_was_set = "HF_HUB_OFFLINE" in os.environ
os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    transformers = pytest.importorskip("transformers")
finally:
    if not _offline_was_set:
        del os.environ["HF_HUB_OFFLINE"]
import torch  # noqa: E402

import otel_train as ot  # noqa: E402
from otel_train import phases  # noqa: E402
from otel_train import schema as S  # noqa: E402
from otel_train.phases import HOOK_SPAN  # noqa: E402
from otel_train.transformers import TraceCallback, instrument  # noqa: E402


class CountSteps(transformers.TrainerCallback):
    """Implements one event: only that event may get hook spans."""

    def __init__(self) -> None:
        self.calls = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.calls += 1


def _trainer(out: Path, callbacks: list[Any]) -> transformers.Trainer:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=4, per_device_train_batch_size=2, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=4,
        logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    return transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4],
                                callbacks=callbacks)


def _records(root: Path) -> list[dict[str, Any]]:
    files = sorted((root / S.STRUCTURED_LOGS_DIR).glob("*" + S.FILE_SUFFIX))
    assert files, "no trace file written"
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def _spans(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(trace_id, span_id) -> {"start", "end"}; asserts every span ended and sits inside its parent."""
    spans: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r[S.KIND] == S.SPAN_START:
            spans[r[S.TRACE_ID], r[S.SPAN_ID]] = {"start": r}
        elif r[S.KIND] == S.SPAN_END:
            spans[r[S.TRACE_ID], r[S.SPAN_ID]]["end"] = r
    assert not [s["start"][S.NAME] for s in spans.values() if "end" not in s], "a span never ended"
    for span in spans.values():
        span["parent"] = spans.get((span["start"][S.TRACE_ID], span["start"].get(S.PARENT_SPAN_ID, "")))
        parent = span["parent"]
        if parent is not None:
            assert parent["start"][S.SEQ] < span["start"][S.SEQ] < span["end"][S.SEQ] < parent["end"][S.SEQ]
    return spans


def _named(spans: dict[tuple[str, str], dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return sorted((s for s in spans.values() if s["start"][S.NAME] == name), key=lambda s: s["start"][S.SEQ])


@pytest.fixture
def traced(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    ot.init(tmp_path, enabled=True, **getattr(request, "param", {}))
    yield tmp_path
    ot.shutdown()


def test_train_writes_steps_phases_eval_and_checkpoint(traced: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    trainer = _trainer(traced / "out", [TraceCallback()])
    result = trainer.train()
    ot.shutdown()
    records = _records(traced)
    spans = _spans(records)

    steps = _named(spans, phases.STEP)
    assert [s["start"][S.STEP] for s in steps] == [0, 1, 2, 3]
    for step in steps:
        assert step["parent"] is None and step["end"][S.STATUS] == S.STATUS_OK
        kids = [k["start"][S.NAME] for k in sorted((s for s in spans.values() if s["parent"] is step),
                                                    key=lambda s: s["start"][S.SEQ])]
        # Two micro-batches (gradient accumulation 2), then one optimizer step.
        assert kids == [phases.FORWARD, phases.BACKWARD, phases.FORWARD, phases.BACKWARD, phases.OPTIMIZER]
        inside = [r for r in records if step["start"][S.SEQ] <= r[S.SEQ] <= step["end"][S.SEQ]]
        assert {r[S.STEP] for r in inside} == {step["start"][S.STEP]}
        scalars = [r for r in inside if r[S.KIND] == S.SCALAR]
        assert len(scalars) == 1 and scalars[0][S.VALUES]["batch_size"] == 2

    evals = _named(spans, phases.EVAL)
    assert [(e["start"][S.STEP], e["start"][S.ATTRS]["stage"]) for e in evals] == [(1, "train"), (3, "train")]
    for e in evals:  # between steps, with the evaluation's forward passes inside
        assert e["parent"] is None
        assert any(s["parent"] is e and s["start"][S.NAME] == phases.FORWARD for s in spans.values())
    checkpoints = _named(spans, phases.CHECKPOINT)
    assert [c["start"][S.STEP] for c in checkpoints] == [3] and checkpoints[0]["parent"] is None
    assert checkpoints[0]["start"][S.SEQ] > evals[1]["end"][S.SEQ]
    assert (traced / "out" / "checkpoint-4").is_dir()
    assert not _named(spans, HOOK_SPAN)
    assert not trainer.model._forward_hooks and not trainer.model._forward_pre_hooks  # removed at train end

    # Tracing does not change training: same seed, same loss without the callback.
    plain = _trainer(tmp_path_factory.mktemp("plain"), []).train()
    assert result.training_loss == plain.training_loss


@pytest.mark.parametrize("traced", [{"trace_hooks": True}], indirect=True)
def test_instrument_traces_implemented_hooks(traced: Path) -> None:
    counter = CountSteps()
    trainer = _trainer(traced / "out", [counter])
    instrument(trainer)
    trainer.train()
    ot.shutdown()
    spans = _spans(_records(traced))
    mine = [h for h in _named(spans, HOOK_SPAN) if h["start"][S.ATTRS]["callback"] == "CountSteps"]
    assert len(mine) == counter.calls == 4
    assert {h["start"][S.ATTRS]["hook"] for h in mine} == {"on_step_end"}
    # CountSteps runs before TraceCallback in the list: its on_step_end is inside the step.
    assert all(h["parent"]["start"][S.NAME] == phases.STEP for h in mine)
    assert not [h for h in _named(spans, HOOK_SPAN)
                if h["start"][S.ATTRS]["callback"] in ("TraceCallback", "TransformersTraceCallback")]


def test_does_nothing_when_tracing_is_off(tmp_path: Path) -> None:
    assert not ot.is_enabled()
    trainer = _trainer(tmp_path / "out", [TraceCallback()])
    trainer.train()
    assert not trainer.model._forward_hooks and not trainer.model._forward_pre_hooks
    assert not (tmp_path / S.STRUCTURED_LOGS_DIR).exists()
