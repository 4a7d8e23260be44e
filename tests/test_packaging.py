"""Packaging: ``exporters/`` installs as ``otel_train.exporters`` (never a top-level ``exporters``), in the
editable install and in a built wheel; the core imports without torch; the console script runs.

Every import check runs in a subprocess with cwd=/tmp, so the repo root is not on ``sys.path`` and only
what the installed distribution provides can be imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from otel_train import __version__

REPO = Path(__file__).resolve().parents[1]
DIST = "otel-train"
OUTSIDE = "/tmp"
# What a wheel build needs from the tree; the rest (tests, .venv, runs) stays out of the copy.
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "otel_train", "exporters")
PACKAGE_ROOTS = {"otel_train": REPO / "otel_train", "otel_train/exporters": REPO / "exporters"}


def _python(code: str, *, python: str = sys.executable, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` (which prints one JSON object last) outside the repo; return that object."""
    proc = subprocess.run([python, "-c", textwrap.dedent(code)], cwd=OUTSIDE, capture_output=True, text=True,
                          timeout=60, env=env if env is not None else _env())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("OTEL_")}
    env.update(extra)
    return env


def _expected_modules() -> set[str]:
    """Every .py file of the two source trees, as the path it must have inside ``otel_train/``."""
    expected = set()
    for prefix, root in PACKAGE_ROOTS.items():
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            relative = path.relative_to(root)
            if prefix == "otel_train" and relative.parts[0] == "exporters":
                continue
            expected.add(f"{prefix}/{relative.as_posix()}")
    return expected


# (a) the editable install

def test_editable_install_maps_exporters_under_otel_train() -> None:
    found = _python("""
        import importlib.metadata as md, importlib.util, json
        import otel_train.exporters.jsonl as jsonl, otel_train.exporters.otlp as otlp
        dist = md.distribution("otel-train")
        try:
            import exporters
            top_exporters = exporters.__file__
        except ModuleNotFoundError:
            top_exporters = None
        print(json.dumps({
            "jsonl": jsonl.__file__, "otlp": otlp.__file__, "top_exporters": top_exporters,
            "direct_url": json.loads(dist.read_text("direct_url.json") or "{}"),
            "top_level": (dist.read_text("top_level.txt") or "").split(),
            "files": [str(f) for f in dist.files or ()],
        }))
    """)
    if not found["direct_url"].get("dir_info", {}).get("editable"):
        pytest.skip("otel-train is not installed in editable mode in this interpreter (the wheel test covers it)")
    assert Path(found["jsonl"]) == REPO / "exporters" / "jsonl" / "__init__.py"
    assert Path(found["otlp"]) == REPO / "exporters" / "otlp" / "__init__.py"
    assert found["top_exporters"] is None, "the distribution must not provide a top-level 'exporters'"
    assert found["top_level"] == ["otel_train"]
    assert not [f for f in found["files"] if f.split("/")[0] == "exporters"]


# (b) a built wheel, installed into a fresh venv

@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Build a wheel from a copy of the tree and install it (no deps) into a new venv: (wheel, venv)."""
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("pip and setuptools are needed in this interpreter to build and install a wheel")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    # Build from a copy: an in-tree build writes build/ and *.egg-info into the shared checkout.
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.exists():
            shutil.copy2(path, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                            "-w", str(work / "dist"), str(source)],
                           cwd=work, capture_output=True, text=True, timeout=120, env=_env())
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("otel_train-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    installed = subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                                "--no-index", "-q", str(wheel)],
                               cwd=work, capture_output=True, text=True, timeout=120, env=_env())
    assert installed.returncode == 0, installed.stderr[-3000:]
    return wheel, venv


def test_wheel_holds_exporters_under_otel_train_only(wheel_venv: tuple[Path, Path]) -> None:
    wheel, _ = wheel_venv
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/top_level.txt"))
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert not [n for n in names if n.startswith("exporters/")]
    assert top_level.split() == ["otel_train"]
    assert "otel-train = otel_train.cli:main" in entry_points
    # Every source module ships: a subpackage missing from pyproject's package list shows up here.
    missing = _expected_modules() - set(names)
    assert not missing, f"modules missing from the wheel (add their packages to pyproject.toml): {sorted(missing)}"


def test_wheel_installed_in_fresh_venv_imports_and_runs(wheel_venv: tuple[Path, Path]) -> None:
    _, venv = wheel_venv
    # The fresh venv holds only otel-train; the dependencies come from this interpreter's site-packages.
    env = _env(PYTHONPATH=sysconfig.get_paths()["purelib"])
    found = _python("""
        import json, otel_train, otel_train.exporters.jsonl.writer as writer
        try:
            import exporters
            top_exporters = exporters.__file__
        except ModuleNotFoundError:
            top_exporters = None
        print(json.dumps({"pkg": otel_train.__file__, "writer": writer.__file__, "top_exporters": top_exporters}))
    """, python=str(venv / "bin" / "python"), env=env)
    site = sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"]
    assert Path(found["pkg"]) == Path(site) / "otel_train" / "__init__.py"
    assert Path(found["writer"]) == Path(site) / "otel_train" / "exporters" / "jsonl" / "writer.py"
    assert found["top_exporters"] is None
    version = subprocess.run([str(venv / "bin" / "otel-train"), "--version"], cwd=OUTSIDE, env=env,
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"otel-train {__version__}"


# (c) no torch needed by the core

def test_core_imports_and_traces_without_torch(tmp_path: Path) -> None:
    found = _python(f"""
        import importlib.abc, json, sys

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError(f"torch is blocked in this test ({{name}})")
                return None

        sys.meta_path.insert(0, NoTorch())
        import otel_train as ot, otel_train.runtime, otel_train.cli, otel_train.analysis
        ot.init({str(tmp_path)!r}, enabled=True)
        with ot.training_step(0):
            with ot.log_trace_span("forward"):
                ot.log_trace_scalar({{"loss": 1.0}})
        ot.shutdown()
        print(json.dumps({{"torch_loaded": "torch" in sys.modules}}))
    """)
    assert found == {"torch_loaded": False}
    files = list((tmp_path / "structured_logs").glob("*.jsonl"))
    assert len(files) == 1 and files[0].read_text().count("\n") >= 6


# (d) the console script

@pytest.mark.parametrize("args", [["--help"], ["--version"]])
def test_console_script_runs(args: list[str]) -> None:
    script = shutil.which("otel-train", path=str(Path(sys.executable).parent))
    assert script is not None, f"no otel-train console script next to {sys.executable}"
    proc = subprocess.run([script, *args], cwd=OUTSIDE, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "otel-train" in proc.stdout
    if args == ["--help"]:
        assert all(command in proc.stdout for command in ("summarize", "export", "stats"))
