"""The read cache: each process's decoded state kept beside the run, served only while its files are
the same bytes (docs/analysis.md, "Reading").

Where: ``<save_path>/.otel-train-cache/``, or ``$XDG_CACHE_HOME/otel-train/<hash of the logs path>/``
(``~/.cache`` without it) when the run directory cannot be written. One entry per process (file
``<instance>.<source>.<rank>.state``): what the reader made of its segments, and each segment's
identity when it was read: device, inode, size, ``mtime_ns``, ``ctime_ns`` (which no one can set
back: a file rewritten in place and its mtime restored still differs), and a CRC of its first and
last :data:`PRINT_BYTES` read.

* **Exact**: every segment has the identity it had: the entry is served.
* **Extended**: the segments but the last one read are exact, the last one read (the active file
  then) is the same inode, no shorter, and its first and last printed bytes are the same: the entry
  is served and the reader goes on from where it stopped, then reads newer segments.
* Anything else (a segment rewritten, truncated, replaced, renamed by a rotation, gone): a miss; the
  process is read again and the entry replaced.

An entry is written only when nothing changed while it was read and the last segment ends with a line
break (a line being written waits for the next read). Never a failure because of the cache: an
entry that cannot be read or decoded is ignored, counted (:attr:`Cache.corrupt`) and rebuilt; a cache
that cannot be written is a silent no-op. Entries are written to an ``O_EXCL | O_NOFOLLOW``
temporary and renamed; only entries owned by this user in a directory only this user can write are
read (an entry is a pickle). The directory is bounded (:data:`MAX_BYTES`, ``OTEL_TRAIN_CACHE_MB``):
past it the least recently used entries go.

**Results** (:class:`Recall`): what a command made of a run (a summary, stats, a what-if answer, a
diff, an export's counts and file), kept in the same directory (``<hash>.result``) under a key of the
command, its arguments and the code (:func:`code_identity`), with a snapshot (:func:`snapshot`) of
every input: each logs directory's entries with their identities, every other path the analysis
declared (:func:`uses`: Flight Recorder dumps) before reading it, and the files it wrote
(:func:`made`). Served only while every snapshot is the same; kept only when the inputs did not
change while the command ran.
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib.util
import os
import pickle
import stat
import sys
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from otel_train import schema
from otel_train.analysis.reading.discovery import ProcessFiles

CACHE_DIR = ".otel-train-cache"
VERSION = 1
PRINT_BYTES = 4096
MAX_BYTES = int(float(os.environ.get("OTEL_TRAIN_CACHE_MB", "512")) * 2**20)
"""The cache directory's size bound (default 512 MiB)."""

ENTRY_SUFFIXES = (".state", ".result")
"""The cache's entries: a process's read state, a command's result."""
MAX_ENTRIES = 20_000
"""A snapshot of more directory entries than this is not taken: such a command is not remembered."""
Ident = tuple[int, int, int, int, int, int, int]  # dev, ino, size, mtime_ns, ctime_ns, head crc, tail crc


@dataclass(slots=True)
class Hit:
    """A served entry: ``payload`` as stored, and where to go on reading (segment, offset), or None."""

    payload: Any
    resume: tuple[int, int] | None


def _crc(fd: int, start: int, n: int) -> int:
    return zlib.crc32(os.pread(fd, n, start)) if n > 0 else 0


def identify(path: Path) -> tuple[Ident, bool] | None:
    """A segment's identity now, and whether it ends with a line break; None when it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        size = st.st_size
        head = _crc(fd, 0, min(PRINT_BYTES, size))
        tail = _crc(fd, max(0, size - PRINT_BYTES), min(PRINT_BYTES, size))
        ends = size == 0 or os.pread(fd, 1, size - 1) == b"\n"
        return (st.st_dev, st.st_ino, size, st.st_mtime_ns, st.st_ctime_ns, head, tail), ends
    except OSError:
        return None
    finally:
        os.close(fd)


def _still(path: Path, old: Ident) -> bool:
    """Whether the segment at ``path`` is the same inode, no shorter, with the same printed bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        size = old[2]
        return ((st.st_dev, st.st_ino) == old[:2] and st.st_size >= size and stat.S_ISREG(st.st_mode)
                and _crc(fd, 0, min(PRINT_BYTES, size)) == old[5]
                and _crc(fd, max(0, size - PRINT_BYTES), min(PRINT_BYTES, size)) == old[6])
    except OSError:
        return False
    finally:
        os.close(fd)


class Cache:
    """One run's cache directory (see the module doc); ``enabled=False`` serves and stores nothing."""

    def __init__(self, logs: Path, *, enabled: bool = True) -> None:
        self.logs = Path(logs)
        self.enabled = enabled
        self.hits = self.extended = self.misses = self.corrupt = 0
        self._dir: Path | None = None
        self._tried = False

    def directory(self) -> Path | None:
        """The cache directory, made on first use (0700); None when none can be made."""
        if not self._tried:
            self._tried = True
            run = self.logs.parent if self.logs.name == schema.STRUCTURED_LOGS_DIR else self.logs
            key = hashlib.sha256(str(self.logs.resolve()).encode()).hexdigest()[:16]
            user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "otel-train" / key
            for d in (run / CACHE_DIR, user):
                if _private_dir(d):
                    self._dir = d
                    break
        return self._dir

    def _entry(self, pf: ProcessFiles) -> Path | None:
        d = self.directory()
        return None if d is None else d / f"{pf.instance}.{pf.source}.{pf.rank}.state"

    def lookup(self, pf: ProcessFiles) -> Hit | None:
        """The entry of ``pf`` when its files allow it (exact or extended), else None (a miss)."""
        if not self.enabled:
            return None
        entry = self._entry(pf) if self._exists(pf) else None
        stored = _load(entry) if entry is not None else None
        if stored is False:
            self.corrupt += 1
        if not isinstance(stored, dict):
            self.misses += 1
            return None
        hit = _match(pf, stored)
        if hit is None:
            self.misses += 1
        elif hit.resume is None:
            self.hits += 1
        else:
            self.extended += 1
        return hit

    def _exists(self, pf: ProcessFiles) -> bool:
        d = self.directory()
        return d is not None and (d / f"{pf.instance}.{pf.source}.{pf.rank}.state").exists()

    def store(self, pf: ProcessFiles, before: list[tuple[Ident, bool] | None], payload: Any) -> None:
        """Keep ``payload`` (what the segments made, read between ``before`` and now) when nothing
        changed meanwhile and the last segment ends with a line break."""
        if not self.enabled or not before or any(b is None for b in before) or not before[-1][1]:  # type: ignore[index]
            return
        if [identify(p) for p in pf.paths] != before:
            return
        entry = self._entry(pf)
        if entry is None:
            return
        data = pickle.dumps({"v": VERSION, "code": code_identity(), "paths": [p.name for p in pf.paths],
                             "idents": [b[0] for b in before], "payload": payload},  # type: ignore[index]
                            protocol=pickle.HIGHEST_PROTOCOL)
        _write(entry, data)
        _bound(entry.parent, MAX_BYTES)


def _match(pf: ProcessFiles, stored: dict) -> Hit | None:
    idents = stored.get("idents")
    if stored.get("v") != VERSION or stored.get("code") != code_identity() \
            or not isinstance(idents, list) or not idents or len(idents) > len(pf.paths):
        return None  # another version of the code pickled another layout of the state: never served
    now = [identify(p) for p in pf.paths[:len(idents)]]
    if any(n is None for n in now):
        return None
    exact = [n[0] == old for n, old in zip(now, idents)]  # type: ignore[index]
    if all(exact[:-1]) and exact[-1] and len(idents) == len(pf.paths):
        return Hit(stored["payload"], None)
    if not all(exact[:-1]) or not _still(pf.paths[len(idents) - 1], idents[-1]):
        return None
    return Hit(stored["payload"], (len(idents) - 1, idents[-1][2]))


def _private_dir(d: Path) -> bool:
    """Make ``d`` (0700) if needed; whether it is a real directory of this user that only it can write."""
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
        return os.access(d, os.W_OK | os.X_OK)
    except OSError:
        return False


def _load(entry: Path) -> dict | bool | None:
    """The stored dict; None when there is none; False when it is unreadable, foreign or corrupt."""
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        with open(fd, "rb", closefd=True) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                return False
            value = pickle.loads(f.read())
        os.utime(entry, follow_symlinks=False)  # least recently used goes first
        return value if isinstance(value, dict) else False
    except Exception:  # noqa: BLE001 - a corrupt entry is a miss, never a failure
        return False


def _write(entry: Path, data: bytes) -> None:
    tmp = entry.with_name(f".{entry.name}.{os.urandom(6).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        with open(fd, "wb", closefd=True) as f:
            f.write(data)
        os.replace(tmp, entry)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _bound(d: Path, limit: int) -> None:
    """Remove the least recently used entries of ``d`` until it holds at most ``limit`` bytes."""
    try:
        entries = [(e.stat(follow_symlinks=False), e.path) for e in os.scandir(d)
                   if e.name.endswith(ENTRY_SUFFIXES)]
    except OSError:
        return
    total = sum(st.st_size for st, _ in entries)
    for st, path in sorted(entries, key=lambda e: e[0].st_mtime_ns):
        if total <= limit:
            break
        try:
            os.unlink(path)
            total -= st.st_size
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# Results: what a command made of unchanged inputs (see the module doc; docs/analysis.md, "Reading")


class TooBig(Exception):
    """A snapshot past :data:`MAX_ENTRIES`: the command is not remembered."""


def snapshot(path: Path, depth: int = 4, *, logs: bool = False) -> Any:
    """What ``path`` is now, comparable with ``==``: None when absent; ``("f", ident)`` a regular file
    (:func:`identify`, links followed as the readers follow them); ``("d", entries)`` a directory: its
    entries' names and snapshots, sorted, ``depth`` levels down (below that, the directory's own
    times); ``("o", kind)`` anything else. ``logs``: a logs directory, whose subdirectories are left
    out (the read cache, an export's folder) unless named like a trace file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ("e", exc.errno)
    if stat.S_ISREG(st.st_mode):
        got = identify(path)
        return ("f", got[0]) if got is not None else ("e", 0)
    if not stat.S_ISDIR(st.st_mode):
        return ("o", stat.S_IFMT(st.st_mode))
    if depth <= 0:
        return ("d", st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        return ("e", exc.errno)
    if len(names) > MAX_ENTRIES:
        raise TooBig(str(path))
    entries = []
    for name in names:
        snap = snapshot(path / name, 0 if logs else depth - 1)
        if logs and snap is not None and snap[0] == "d" and not schema.FILE_RE.match(name):
            continue
        entries.append((name, snap))
    return ("d", tuple(entries))


@cache
def code_identity() -> str:
    """The code a result is made by: this package's sources (names, sizes, mtimes) and the versions of
    Python, numpy and msgspec (their module files, found without importing them)."""
    digest = hashlib.sha256(sys.version.encode())
    root = Path(__file__).resolve().parents[2]
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(folder, name))
                digest.update(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    for module in ("numpy", "msgspec"):
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        if origin:
            st = os.stat(origin)
            digest.update(f"{module}:{origin}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()


_active: contextvars.ContextVar[Recall | None] = contextvars.ContextVar("otel_train_recall", default=None)


def uses(path: str | Path) -> None:
    """Declare an input outside the logs directories (Flight Recorder dumps) before reading it: the
    result being recorded now (if any) depends on it."""
    recall = _active.get()
    if recall is not None:
        recall.inputs.append((Path(path), recall.snap(Path(path))))


def made(path: str | Path) -> None:
    """Declare a file the command wrote (an export): its result is served only while that file is
    still the one written."""
    recall = _active.get()
    if recall is not None:
        recall.outputs.append(Path(path))


class Recall:
    """One command's result for one set of inputs: :meth:`recall` it, or compute it inside
    :meth:`recording` and :meth:`keep` it (see the module doc). ``logs``: the runs' logs directories
    (the first one's cache directory holds the entry); ``args``: everything else the result depends on."""

    def __init__(self, command: str, logs: Sequence[Path], args: Mapping[str, Any], *, enabled: bool = True) -> None:
        self.logs = [Path(p).resolve() for p in logs]
        self.enabled = enabled and bool(self.logs)
        self.key = (command, tuple(map(str, self.logs)), tuple(sorted((k, repr(v)) for k, v in args.items())))
        self.inputs: list[tuple[Path, Any]] = []
        self.outputs: list[Path] = []
        self.too_big = False
        self.store = Cache(self.logs[0], enabled=self.enabled) if self.logs else None

    def snap(self, path: Path, *, logs: bool = False) -> Any:
        """:func:`snapshot`, or None and a mark that this result cannot be remembered."""
        try:
            return snapshot(path, logs=logs)
        except (TooBig, RecursionError):
            self.too_big = True
            return None

    def entry(self) -> Path | None:
        """Where this key's result is kept; None without a cache."""
        d = self.store.directory() if self.store is not None and self.enabled else None
        if d is None:
            return None
        name = hashlib.sha256(repr((self.key, code_identity())).encode()).hexdigest()[:32]
        return d / f"{name}.result"

    def recall(self) -> tuple[Any, list[str]] | None:
        """(result, the warnings it said) when one was kept for these inputs as they are now; else None."""
        entry = self.entry()
        stored = _load(entry) if entry is not None and entry.exists() else None
        if not isinstance(stored, dict) or stored.get("v") != VERSION or stored.get("key") != self.key \
                or stored.get("code") != code_identity():
            return None
        try:
            if any(snapshot(path, logs=kind == "logs") != snap for kind, path, snap in stored["inputs"]):
                return None
            return stored["value"], list(stored["warnings"])
        except Exception:  # noqa: BLE001 - an entry of another shape is a miss, never a failure
            return None

    @contextmanager
    def recording(self) -> Iterator[Recall]:
        """Compute the result inside: the logs directories are snapshot first; :func:`uses` and
        :func:`made` report to this recall."""
        self.inputs = [(p, self.snap(p, logs=True)) for p in self.logs]
        self.outputs = []
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)

    def keep(self, value: Any, warnings: Sequence[str]) -> None:
        """Store ``value`` (made inside :meth:`recording`) when every input is as it was before it was read."""
        entry = self.entry()
        if entry is None or self.too_big:
            return
        inputs = [("logs" if i < len(self.logs) else "path", path, snap) for i, (path, snap) in enumerate(self.inputs)]
        try:
            if any(snapshot(path, logs=kind == "logs") != snap for kind, path, snap in inputs):
                return  # an input changed while it was read: the result may be of neither version
            inputs += [("path", path, snapshot(path)) for path in self.outputs]
            data = pickle.dumps({"v": VERSION, "key": self.key, "code": code_identity(), "inputs": inputs,
                                 "value": value, "warnings": list(warnings)}, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a result that cannot be kept is computed again next time
            return
        _write(entry, data)
        _bound(entry.parent, MAX_BYTES)
