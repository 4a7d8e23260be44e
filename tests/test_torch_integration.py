"""Plain-PyTorch integration: batch stats, forward/optimizer/data spans, torch.compile, no device syncs."""

from __future__ import annotations

import collections

import pytest
import torch

from otel_train import _phases


def test_batch_stats_reads_shapes_of_nested_batches() -> None:
    batch = {"x": torch.zeros(8, 3, 4), "y": [torch.zeros(8), "label"], "meta": 5}
    assert _phases.batch_stats(batch) == {
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
    stats = _phases.batch_stats(many, max_tensors=2)
    assert set(stats) == {"batch_size", "input0.numel", "input0.dim0", "input0.dim1",
                          "input1.numel", "input1.dim0", "input1.dim1"}
    assert _phases.batch_stats([1, "a", None, {"k": 2.0}]) == {}
    # A scalar tensor has no batch dimension; a later tensor provides it.
    Pair = collections.namedtuple("Pair", "a b")
    assert _phases.batch_stats(Pair(torch.tensor(1.0), torch.zeros(4)))["batch_size"] == 4


def test_batch_stats_never_reads_tensor_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_a: object, **_k: object) -> None:
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    monkeypatch.setattr(torch.Tensor, "__bool__", forbidden)
    assert _phases.batch_stats((torch.ones(5, 2),))["input0.numel"] == 10


def test_is_compiling_false_in_eager() -> None:
    assert _phases.is_compiling() is False
