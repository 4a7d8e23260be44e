"""``ot.set_mesh``: this rank's place in the parallel layout, as one ``otel_train.mesh`` instant.

``set_mesh(mesh)`` takes a torch ``DeviceMesh`` (its dim names, sizes and this rank's coordinates);
``set_mesh(pp=(4, 1), dp=(4, 2))`` takes keyword dims as ``(size, index)`` pairs. Wrong types raise
``TypeError``, impossible values ``ValueError`` (API misuse, checked even when tracing is off); with
tracing off nothing is written. :func:`detect_meshes` wraps ``DeviceMesh.__init__`` so a mesh a
framework builds (any ``DeviceMesh`` spanning the world) is declared too, unless the script declared
one itself.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from otel_train import _report, api
from otel_train import schema as S

_declared = False  # set_mesh was called by the user in this process: detection leaves it alone


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _from_keywords(coords: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    dims, where = {}, {}
    for name, pair in coords.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(_is_index(v) for v in pair):
            raise TypeError(f"otel_train.set_mesh: {name}= must be a (size, index) pair of ints, got {pair!r:.80}")
        size, index = pair
        if size < 1 or not 0 <= index < size:
            raise ValueError(f"otel_train.set_mesh: {name}=({size}, {index}) needs size >= 1 and 0 <= index < size")
        dims[name], where[name] = int(size), int(index)
    return dims, where


def _from_device_mesh(mesh: Any) -> tuple[dict[str, int], dict[str, int]]:
    names = getattr(mesh, "mesh_dim_names", None)
    if not callable(getattr(mesh, "get_coordinate", None)) or not hasattr(mesh, "shape"):
        raise TypeError(f"otel_train.set_mesh: expected a torch DeviceMesh or keyword dims, got {type(mesh).__name__}")
    if not names:
        raise ValueError("otel_train.set_mesh: this DeviceMesh has no mesh_dim_names; build it with "
                         "init_device_mesh(..., mesh_dim_names=(...)) or pass keyword dims")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("otel_train.set_mesh: this rank is not in the DeviceMesh")
    shape = tuple(int(d) for d in mesh.shape)
    return dict(zip(names, shape)), {name: int(i) for name, i in zip(names, coordinate)}


def mesh_attrs(mesh: Any = None, /, **coords: Any) -> dict[str, Any]:
    """The ``otel_train.mesh`` instant's attrs (``dims``, ``coords``); raises on misuse."""
    if mesh is not None and coords:
        raise TypeError("otel_train.set_mesh: pass a DeviceMesh or keyword dims, not both")
    if mesh is None and not coords:
        raise TypeError("otel_train.set_mesh: pass a DeviceMesh or keyword dims, e.g. set_mesh(pp=(4, 1), dp=(4, 2))")
    dims, where = _from_device_mesh(mesh) if mesh is not None else _from_keywords(coords)
    return {"dims": dims, "coords": where}


def set_mesh(mesh: Any = None, /, **coords: Any) -> None:
    """Declare this rank's place in the parallel layout (a DeviceMesh, or dims as ``(size, index)``)."""
    global _declared
    attrs = mesh_attrs(mesh, **coords)
    if api._tracing is None:
        return
    _declared = True
    api.log_trace_instant(S.INSTANT_MESH, **attrs)


_detected: set[str] = set()


def declare_detected(mesh: Any) -> None:
    """A framework built ``mesh``: declare it unless the script declared one, or it is a sub-mesh
    (fewer ranks than the world) or was declared already (never raises)."""
    if _declared or api._tracing is None:
        return
    try:
        import torch.distributed as dist

        if int(mesh.size()) != dist.get_world_size():
            return
        attrs = mesh_attrs(mesh)
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return  # no dim names, or this rank is not in it: nothing to declare
    key = repr(sorted(attrs["dims"].items()))
    if key in _detected:
        return
    _detected.add(key)
    api.log_trace_instant(S.INSTANT_MESH, **attrs)


def detect_meshes() -> Callable[[], None]:
    """Wrap ``DeviceMesh.__init__`` (however the script imported ``init_device_mesh``, every mesh is
    built there); returns the undo."""
    global _declared
    _declared = False
    _detected.clear()
    module = sys.modules.get("torch.distributed.device_mesh")
    cls = getattr(module, "DeviceMesh", None)
    original = getattr(cls, "__init__", None) if isinstance(cls, type) else None
    if original is None or hasattr(original, "__otel_train_original__"):
        return lambda: None

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            declare_detected(self)
        except Exception as exc:  # noqa: BLE001
            _report.report_exception("declaring a DeviceMesh", exc)

    __init__.__otel_train_original__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__

    def undo() -> None:
        if cls.__dict__.get("__init__") is __init__:
            cls.__init__ = original

    return undo
