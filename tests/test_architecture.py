"""The house rules, read from the source with ``ast``: no import cycle, one-way data flow, small functions.

See docs/architecture.md: the analysis side never imports the tracing runtime, the export formats are
leaves that share only the layout module, and no function in ``otel_train/analysis`` is over 60 lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_ANALYSIS_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    """Module name -> file, with the repository's ``exporters/`` installed as ``otel_train.exporters``."""
    out: dict[str, Path] = {}
    for base, prefix in ((ROOT / "otel_train", "otel_train"), (ROOT / "exporters", "otel_train.exporters")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, *, type_checking: bool = False) -> set[str]:
    """Every otel_train module ``name`` imports, at module level or inside functions; under
    ``if TYPE_CHECKING:`` too when ``type_checking``. ``from P import m`` where ``P.m`` is a module depends
    on ``P.m``, as ``import P.m`` does, not on the names ``P/__init__.py`` defines."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    skip = set() if type_checking else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = [f"{base}.{alias.name}" for alias in node.names]
            targets = submodules if all(m in MODULES for m in submodules) else [base, *submodules]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                targets = [arg.value]
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}
TYPED_GRAPH = {name: _imports(name, path, type_checking=True) for name, path in MODULES.items()}
"""The imports a type checker follows: ``TYPE_CHECKING`` ones counted."""


def _cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    graph = GRAPH if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _closure(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_modules_were_found() -> None:
    assert "otel_train.analysis.spans" in MODULES and "otel_train.exporters.jsonl.writer" in MODULES


def test_no_import_cycle() -> None:
    assert _cycles() == []


def test_no_cycles_counting_type_checking_outside_analysis() -> None:
    """No cycle that holds a module outside ``otel_train.analysis``, ``TYPE_CHECKING`` imports counted.
    (The analysis side's own cycles are test_no_import_cycle's until they are gone there too.)"""
    outside = [c for c in _cycles(TYPED_GRAPH) if not all(m.startswith("otel_train.analysis") for m in c)]
    assert outside == []


def test_type_checking_imports_are_counted() -> None:
    """The package's ``__init__`` names its public functions' homes for type checkers only: counted."""
    assert "otel_train.runtime" in TYPED_GRAPH["otel_train"]
    assert "otel_train.runtime" not in GRAPH["otel_train"]


def test_cycle_finder_finds_a_planted_cycle() -> None:
    GRAPH["otel_train.schema"].add("otel_train.analysis.spans")
    try:
        assert any("otel_train.schema" in c for c in _cycles())
    finally:
        GRAPH["otel_train.schema"].discard("otel_train.analysis.spans")


RUNTIME_SIDE = ("otel_train.runtime", "otel_train.api", "otel_train.tracers", "otel_train.exporters",
                "otel_train.lifecycle", "otel_train.handlers", "otel_train.watchdog")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(("otel_train.analysis", "otel_train.cli"))))
def test_reading_a_trace_never_starts_tracing(name: str) -> None:
    bad = sorted(d for d in _closure(name) if d.startswith(RUNTIME_SIDE))
    assert bad == [], f"{name} reaches the tracing runtime through {bad}"


def test_export_formats_are_leaves() -> None:
    leaves = [n for n in MODULES if n.startswith("otel_train.analysis.export.") and n.rsplit(".", 1)[1] != "layout"]
    assert leaves, "otel_train/analysis/export/ has no format modules"
    for leaf in leaves:
        siblings = {d for d in GRAPH[leaf] if d.startswith("otel_train.analysis.export")}
        assert siblings <= {"otel_train.analysis.export.layout"}, f"{leaf} imports {siblings}"


def test_reading_is_the_bottom_layer() -> None:
    """otel_train/analysis/reading/ turns files into records and knows nothing above it: it imports
    only the shared vocabulary (schema, sketch) and its own modules; records.py only re-exports it."""
    reading = [n for n in MODULES if n.startswith("otel_train.analysis.reading")]
    assert len(reading) > 1, "otel_train/analysis/reading/ has no modules"
    allowed = {"otel_train", "otel_train.schema", "otel_train.sketch"}
    for name in reading:
        above = {d for d in GRAPH[name] if d not in allowed and not d.startswith("otel_train.analysis.reading")}
        assert above == set(), f"{name} imports {above}"
    shim = {d for d in GRAPH["otel_train.analysis.records"] if not d.startswith("otel_train.analysis.reading")}
    assert shim <= {"otel_train", "otel_train.analysis"}, shim


def test_no_long_functions_in_analysis() -> None:
    long = []
    for name, path in MODULES.items():
        if not name.startswith("otel_train.analysis"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_ANALYSIS_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_code_cites_only_files_inside_the_repository() -> None:
    outside = re.compile(r"CONTRACT\.md|\.\./shared")
    hits = [f"{p.relative_to(ROOT)}" for p in MODULES.values() if outside.search(p.read_text())]
    assert hits == []


KNOWN_DUPLICATE_CLASSES = {"Thresholds", "LiveProcess", "Plan", "_Segment"}
"""Class names the analysis side still defines in two modules: the only ones allowed, until renamed there."""


def test_no_two_classes_share_a_name() -> None:
    """One class name, one meaning: no two modules of otel_train/ and exporters/ define a class of the
    same name (a module-level alias kept for a documented name is not a class definition)."""
    homes: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                homes.setdefault(node.name, []).append(name)
    shared = {cls: sorted(mods) for cls, mods in homes.items() if len(mods) > 1}
    assert {cls: mods for cls, mods in shared.items() if cls not in KNOWN_DUPLICATE_CLASSES} == {}
