"""Run a callback once a module is imported (``torch.distributed`` imported after ``ot.init``)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

from otel_train import _report


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, then: Callable[[], None]) -> None:
        self._inner, self._then = inner, then

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        try:
            self._then()
        except Exception as exc:  # noqa: BLE001 - the import itself succeeded: keep it so
            _report.report_exception(f"after importing {module.__name__}", exc)


class AfterImport(importlib.abc.MetaPathFinder):
    """A finder on ``sys.meta_path`` that calls ``then()`` right after ``name`` is executed, once."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self._name, self._then = name, then
        self._busy = False

    def install(self) -> AfterImport:
        sys.meta_path.insert(0, self)
        return self

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self._name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        self.remove()
        spec.loader = _Loader(spec.loader, self._then)
        return spec
