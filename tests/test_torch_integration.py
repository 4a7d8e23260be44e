"""Plain-PyTorch integration: batch stats, forward/optimizer/data spans, torch.compile, no device syncs."""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import otel_train as ot
from otel_train import integration_spans, phases, schema
from otel_train import torch as ott
from otel_train.analysis.records import Reader, find_process_files


def test_batch_stats_reads_shapes_of_nested_batches() -> None:
    batch = {"x": torch.zeros(8, 3, 4), "y": [torch.zeros(8), "label"], "meta": 5}
    assert integration_spans.batch_stats(batch) == {
        "batch_size": 8,
        "input0.numel": 96,
        "input0.dim0": 8,
        "input0.dim1": 3,
        "input0.dim2": 4,
        "input1.numel": 8,
        "input1.dim0": 8,
    }


def test_batch_stats_is_bounded_and_ignores_non_tensors() -> None:
    many = [torch.zeros(2, 1) for _ in range(100)]
    stats = integration_spans.batch_stats(many, max_tensors=2)
    assert set(stats) == {"batch_size", "input0.numel", "input0.dim0", "input0.dim1",
                          "input1.numel", "input1.dim0", "input1.dim1"}
    assert integration_spans.batch_stats([1, "a", None, {"k": 2.0}]) == {}
    # A scalar tensor has no batch dimension; a later tensor provides it.
    Pair = collections.namedtuple("Pair", "a b")
    assert integration_spans.batch_stats(Pair(torch.tensor(1.0), torch.zeros(4)))["batch_size"] == 4


def test_batch_stats_never_reads_tensor_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_a: object, **_k: object) -> None:
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    monkeypatch.setattr(torch.Tensor, "__bool__", forbidden)
    assert integration_spans.batch_stats((torch.ones(5, 2),))["input0.numel"] == 10


def test_is_compiling_false_in_eager() -> None:
    assert integration_spans.is_compiling() is False


# ---------------------------------------------------------------------------------------------------
# Spans on real trace files.


@contextlib.contextmanager
def traced_run(path: Path, **settings: Any) -> Iterator[None]:
    ot.init(save_path=str(path), enabled=True, **settings)
    try:
        yield
    finally:
        ot.shutdown()


def read_records(path: Path) -> list[dict[str, Any]]:
    reader = Reader()
    records = [r for pf in find_process_files(path) for r in reader.records(pf)]
    assert reader.malformed_lines == 0
    return records


def small_setup(samples: int = 24, batch: int = 4) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(samples, 6), torch.randn(samples, 1))
    return model, optimizer, DataLoader(data, batch_size=batch)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, steps: int) -> None:
    batches = iter(ott.traced(loader))
    for step in range(steps):
        with ot.training_step(step):
            x, y = ott.batch_to_device(next(batches), "cpu")
            ott.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()


STEP_PHASES = [phases.DATA_FETCH, phases.BATCH_TO_DEVICE, phases.FORWARD, phases.BACKWARD, phases.OPTIMIZER]


def test_phases_nest_in_order_under_their_step(tmp_path: Path) -> None:
    model, optimizer, loader = small_setup()
    with traced_run(tmp_path), ott.instrument(model, optimizer):
        train(model, optimizer, loader, steps=3)
    records = read_records(tmp_path)
    steps = {r["span_id"]: r for r in records if r["kind"] == schema.SPAN_START and r["name"] == phases.STEP}
    assert sorted(r["step"] for r in steps.values()) == [0, 1, 2]
    for step_span, step_rec in steps.items():
        children = [r for r in records if r.get("parent_span_id") == step_span and r["kind"] == schema.SPAN_START]
        assert [c["name"] for c in children] == STEP_PHASES
        assert all(c["step"] == step_rec["step"] for c in children)
        ends = [r for r in records if r["kind"] == schema.SPAN_END and r["span_id"] in {c["span_id"] for c in children}]
        assert {e["status"] for e in ends} == {schema.STATUS_OK}
        stats = [r for r in records if r["kind"] == schema.SCALAR and r["span_id"] == step_span]
        assert stats[0]["values"] == {"batch_size": 4, "input0.numel": 24, "input0.dim0": 4, "input0.dim1": 6,
                                      "input1.numel": 4, "input1.dim0": 4, "input1.dim1": 1}


@pytest.mark.parametrize(("every", "expected"), [(2, [0, 2, 4]), (0, [])])
def test_batch_stats_every_n_steps(tmp_path: Path, every: int, expected: list[int]) -> None:
    model, optimizer, loader = small_setup()
    with traced_run(tmp_path, batch_stats_every=every):
        train(model, optimizer, loader, steps=5)
    scalars = [r for r in read_records(tmp_path) if r["kind"] == schema.SCALAR and "batch_size" in r["values"]]
    assert [r["step"] for r in scalars] == expected


def test_forward_exception_ends_the_span_as_error(tmp_path: Path) -> None:
    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 1:
                raise FloatingPointError("nan in activations")
            return x * 2

    model = Flaky()
    with traced_run(tmp_path), ott.instrument(model):
        with pytest.raises(FloatingPointError), ot.training_step(0):
            model(torch.ones(2))
        with ot.training_step(1):
            model(torch.ones(2))
    ends = [r for r in read_records(tmp_path) if r["kind"] == schema.SPAN_END and r["name"] == phases.FORWARD]
    assert [(e["step"], e["status"]) for e in ends] == [(0, schema.STATUS_ERROR), (1, schema.STATUS_OK)]
    assert ends[0]["error"]["type"].endswith("FloatingPointError")


def test_handle_remove_stops_spans_and_passthroughs_work(tmp_path: Path) -> None:
    model, optimizer, loader = small_setup()
    wrapped = ott.traced(loader)
    assert len(wrapped) == len(loader) == 6 and wrapped.dataset is loader.dataset
    assert len(iter(wrapped)) == 6
    with traced_run(tmp_path):
        handle = ott.instrument(model, optimizer)
        handle.remove()
        handle.remove()
        model(torch.ones(1, 6)).sum().backward()
        optimizer.step()
    names = {r.get("name") for r in read_records(tmp_path)}
    assert phases.FORWARD not in names and phases.OPTIMIZER not in names


def test_no_device_sync_and_no_tensor_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_a: object, **_k: object) -> None:
        raise AssertionError("otel-train synchronized a device or read tensor data")

    model, optimizer, _ = small_setup()
    loader = [(torch.randn(4, 6), torch.randn(4, 1)) for _ in range(2)]  # a DataLoader's seeding uses .item()
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    with traced_run(tmp_path), ott.instrument(model, optimizer):
        train(model, optimizer, loader, steps=2)
    assert sum(r["name"] == phases.FORWARD for r in read_records(tmp_path)) == 4


def test_disabled_tracing_records_nothing_and_trains(tmp_path: Path) -> None:
    model, optimizer, loader = small_setup()
    before = [p.detach().clone() for p in model.parameters()]
    with ott.instrument(model, optimizer):
        train(model, optimizer, loader, steps=2)
    assert not ot.is_enabled() and not tmp_path.joinpath("structured_logs").exists()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------------------------------------------
# torch.compile (aot_eager: dynamo + AOTAutograd without a C++ toolchain run, to keep the test fast).


def test_compiled_model_keeps_forward_spans_without_graph_breaks(tmp_path: Path) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, optimizer, loader = small_setup()
    compiled = torch.compile(model, backend="aot_eager")
    with traced_run(tmp_path), ott.instrument(compiled, optimizer):
        train(compiled, optimizer, loader, steps=3)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    ends = [r for r in read_records(tmp_path) if r["kind"] == schema.SPAN_END and r["name"] == phases.FORWARD]
    assert len(ends) == 3 and {e["status"] for e in ends} == {schema.STATUS_OK}


def test_hooks_inside_a_fullgraph_region_are_no_ops(tmp_path: Path) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    inner = nn.Linear(4, 4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(inner(x)) + 1

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)  # any graph break would raise
    x = torch.randn(2, 4)
    with traced_run(tmp_path):
        spans = integration_spans.ForwardSpans(inner)
        assert torch.equal(compiled(x), fn(x))
        assert integration_spans.batch_stats(x) and not integration_spans.is_compiling()
        spans.remove()
    forwards = [r for r in read_records(tmp_path) if r.get("name") == phases.FORWARD]
    assert len(forwards) == 2  # start + end of the eager call only
    explanation = torch._dynamo.explain(fn)(x)
    assert explanation.graph_break_count == 0
