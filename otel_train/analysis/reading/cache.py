"""The read cache: each process's decoded state kept in this user's own cache directory, served only
while its files are the same bytes (docs/analysis.md, "Reading").

Where: ``$XDG_CACHE_HOME/otel-train/<key>/`` (``~/.cache`` without it), the key a hash of the logs
directory's resolved path, device and inode. Never in the run directory: an entry is a pickle, and
nothing a run directory holds (a tarball, a clone, a copy, a shared filesystem) is ever unpickled. One
entry per process (file ``<instance>.<source>.<rank>.state``): what the reader made of its segments,
and each segment's identity when it was read: device, inode, size, ``mtime_ns``, ``ctime_ns`` (which
no one can set back: a file rewritten in place and its mtime restored still differs), and a CRC of its
first and last :data:`PRINT_BYTES`; a CRC of the whole last segment, and of every segment changed
within :data:`RACY_NS` of the store (a rewrite in the same timestamp tick keeps its times).

* **Exact**: every segment has the identity it had (and its whole CRC, where one was kept for a
  recent change): the entry is served.
* **Extended**: the segments but the last one read are exact, the last one read (the active file
  then) is the same inode, longer, and the CRC of the bytes that were read is the same: the entry is
  served and the reader goes on from where it stopped, then reads newer segments.
* Anything else (a segment rewritten, truncated, replaced, renamed by a rotation, gone): a miss; the
  process is read again and the entry replaced.

An entry is written only when nothing changed while it was read and the last segment ends with a line
break (a line being written waits for the next read). Never a failure because of the cache: an
entry that cannot be read or decoded is ignored, counted (:attr:`Cache.corrupt`) and rebuilt; a cache
that cannot be written is a silent no-op. Entries are written (0600) to an ``O_EXCL | O_NOFOLLOW``
temporary and renamed; only entries owned by this user in directories (0700) only this user can
write are read. The whole cache is bounded (:func:`max_bytes`, ``OTEL_TRAIN_CACHE_MB``; a value that
is not a finite size is :class:`CacheSettingError`): past it the least recently used entries go.

**Results** (:class:`Recall`): what a command made of a run (a summary, stats, a what-if answer, a
diff, an export's counts and file), kept in the same directory (``<hash>.result``) under a key of the
command, its arguments and the code (:func:`code_identity`), with a snapshot (:func:`snapshot`) of
every input: each logs directory's entries with their identities, every other path the analysis
declared (:func:`uses`: Flight Recorder dumps, every level below them) before reading it, and the
files it wrote (:func:`made`). Served only while every snapshot is the same (and the whole CRC of
each file changed within :data:`RACY_NS` of the keep); kept only when the inputs did not change
while the command ran.
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib.util
import os
import pickle
import stat
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from otel_train import schema
from otel_train.analysis.reading.cache_files import (ENTRY_SUFFIXES, PRINT_BYTES, RACY_NS, CacheSettingError, Ident,
                                                     bound, cache_dir_of, identify, load_entry, max_bytes, private_dir,
                                                     racy, user_root, whole_crc, write_entry)
from otel_train.analysis.reading.discovery import ProcessFiles

__all__ = ["CACHE_DIR", "ENTRY_SUFFIXES", "PRINT_BYTES", "RACY_NS", "CacheSettingError", "Ident", "identify",
           "cache_dir_of", "max_bytes", "user_root", "whole_crc", "Cache", "Hit", "Recall", "TooBig", "snapshot", "uses", "made",
           "code_identity"]

CACHE_DIR = ".otel-train-cache"
"""Where the cache used to be (beside the run): never read any more (see the module doc)."""
VERSION = 2
MAX_ENTRIES = 20_000
"""A snapshot of more directory entries than this is not taken: such a command is not remembered."""


@dataclass(slots=True)
class Hit:
    """A served entry: ``payload`` as stored, and where to go on reading (segment, offset), or None."""

    payload: Any
    resume: tuple[int, int] | None


class Cache:
    """One run's cache directory (see the module doc); ``enabled=False`` serves and stores nothing.
    Raises :class:`CacheSettingError` (enabled only) for a bad ``OTEL_TRAIN_CACHE_MB``."""

    def __init__(self, logs: Path, *, enabled: bool = True) -> None:
        self.logs = Path(logs)
        self.enabled = enabled
        self.limit = max_bytes() if enabled else 0
        self.hits = self.extended = self.misses = self.corrupt = 0
        self._unbounded = 0  # bytes written since the last bound
        self._dir: Path | None = None
        self._tried = False

    def directory(self) -> Path | None:
        """The cache directory, made on first use (0700, in a 0700 ``otel-train`` directory); None when
        none can be made or it is not this user's alone."""
        if not self._tried:
            self._tried = True
            d = cache_dir_of(self.logs)
            if d is not None and private_dir(d.parent, base=True) and private_dir(d):
                self._dir = d
        return self._dir

    def _entry(self, pf: ProcessFiles) -> Path | None:
        d = self.directory()
        return None if d is None else d / f"{pf.instance}.{pf.source}.{pf.rank}.state"

    def lookup(self, pf: ProcessFiles) -> Hit | None:
        """The entry of ``pf`` when its files allow it (exact or extended), else None (a miss)."""
        if not self.enabled:
            return None
        entry = self._entry(pf)
        stored = load_entry(entry) if entry is not None and entry.exists() else None
        if stored is False:
            self.corrupt += 1
        if not isinstance(stored, dict):
            self.misses += 1
            return None
        try:
            hit = _match(pf, stored)
        except Exception:  # noqa: BLE001 - an entry of another shape is a miss, never a failure
            hit = None
        if hit is None:
            self.misses += 1
        elif hit.resume is None:
            self.hits += 1
        else:
            self.extended += 1
        return hit

    def store(self, pf: ProcessFiles, before: list[tuple[Ident, bool] | None], payload: Any) -> None:
        """Keep ``payload`` (what the segments made, read between ``before`` and now) when nothing
        changed meanwhile and the last segment ends with a line break."""
        if not self.enabled or not before or any(b is None for b in before) or not before[-1][1]:  # type: ignore[index]
            return
        idents = [b[0] for b in before]  # type: ignore[index]
        now = time.time_ns()
        last = len(idents) - 1
        crcs = [whole_crc(p, i[2]) if k == last or racy(i, now) else None
                for k, (p, i) in enumerate(zip(pf.paths, idents))]
        if crcs[last] is None or [identify(p) for p in pf.paths] != before:
            return  # changed while it was read (or while its CRCs were taken)
        entry = self._entry(pf)
        if entry is None:
            return
        data = pickle.dumps({"v": VERSION, "code": code_identity(), "paths": [p.name for p in pf.paths],
                             "idents": idents, "whole": crcs[last],
                             "crcs": [c if racy(i, now) else None for c, i in zip(crcs, idents)],
                             "payload": payload}, protocol=pickle.HIGHEST_PROTOCOL)
        write_entry(entry, data)
        self._unbounded += len(data)
        if self._unbounded > self.limit // 16 or self.hits + self.extended + self.misses <= 1:
            bound(self.limit)  # (a scan of the whole cache: once per 1/16 of the bound written, not per entry)
            self._unbounded = 0


def _match(pf: ProcessFiles, stored: dict) -> Hit | None:
    idents, crcs = stored.get("idents"), stored.get("crcs")
    if stored.get("v") != VERSION or stored.get("code") != code_identity() or not isinstance(idents, list) \
            or not idents or len(idents) > len(pf.paths) or not isinstance(crcs, list) or len(crcs) != len(idents):
        return None  # another version of the code pickled another layout of the state: never served
    now = [identify(p) for p in pf.paths[:len(idents)]]
    if any(n is None for n in now):
        return None
    last = len(idents) - 1
    exact = [n[0] == old and (c is None or whole_crc(p, old[2]) == c)  # type: ignore[index]
             for n, old, c, p in zip(now, idents, crcs, pf.paths)]
    if all(exact) and len(idents) == len(pf.paths):
        return Hit(stored["payload"], None)
    if not all(exact[:-1]):
        return None
    cur, old = now[last][0], idents[last]  # type: ignore[index]
    grew = cur[:2] == old[:2] and cur[2] > old[2] and whole_crc(pf.paths[last], old[2]) == stored.get("whole")
    if not (exact[-1] or grew):
        return None  # rewritten (same size or not), truncated or replaced: read again
    return Hit(stored["payload"], (last, old[2]))


# ---------------------------------------------------------------------------------------------
# Results: what a command made of unchanged inputs (see the module doc; docs/analysis.md, "Reading")


class TooBig(Exception):
    """A snapshot past :data:`MAX_ENTRIES`: the command is not remembered."""


def snapshot(path: Path, depth: int | None = None, *, logs: bool = False) -> Any:
    """What ``path`` is now, comparable with ``==``: None when absent; ``("f", ident)`` a regular file
    (:func:`identify`, links followed as the readers follow them); ``("d", entries)`` a directory: its
    entries' names and snapshots, sorted, ``depth`` levels down (below that, the directory's own times);
    ``depth`` None (what :func:`uses` takes): no cut, every level, so whatever a reader below the path
    reads is covered (the Flight Recorder reader's ``FR_MAX_DEPTH`` included, whatever it is set to); a
    directory met again below itself through a link is ``("loop", dev, ino)``; ``("o", kind)`` anything
    else. ``logs``: a logs directory, whose subdirectories are left out (an export's folder) unless
    named like a trace file, and those only by their own times. Raises :class:`TooBig` past
    :data:`MAX_ENTRIES` entries in all (RecursionError past Python's depth)."""
    return _snap(Path(path), 1 if logs else depth, logs, [MAX_ENTRIES], frozenset())


def _snap(path: Path, levels: int | None, logs: bool, budget: list[int], seen: frozenset) -> Any:
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
    if levels is not None and levels <= 0:
        return ("d", st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    if (st.st_dev, st.st_ino) in seen:
        return ("loop", st.st_dev, st.st_ino)
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        return ("e", exc.errno)
    budget[0] -= len(names)
    if budget[0] < 0:
        raise TooBig(str(path))
    seen = seen | {(st.st_dev, st.st_ino)}
    entries = []
    for name in names:
        snap = _snap(path / name, None if levels is None else levels - 1, False, budget, seen)
        if logs and snap is not None and snap[0] == "d" and not schema.FILE_RE.match(name):
            continue
        entries.append((name, snap))
    return ("d", tuple(entries))


def _recent_files(path: Path, snap: Any, now_ns: int) -> Iterator[tuple[Path, int]]:
    """(path, size) of each regular file in ``snap`` (of ``path``) changed within :data:`RACY_NS` of ``now_ns``."""
    if not isinstance(snap, tuple) or not snap:
        return
    if snap[0] == "f" and racy(snap[1], now_ns):
        yield path, snap[1][2]
    elif snap[0] == "d" and len(snap) == 2:
        for name, sub in snap[1]:
            yield from _recent_files(path / name, sub, now_ns)


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
        stored = load_entry(entry) if entry is not None and entry.exists() else None
        if not isinstance(stored, dict) or stored.get("v") != VERSION or stored.get("key") != self.key \
                or stored.get("code") != code_identity():
            return None
        try:
            if any(snapshot(path, logs=kind == "logs") != snap for kind, path, snap in stored["inputs"]):
                return None
            if any(whole_crc(Path(path), size) != crc for path, size, crc in stored["sums"]):
                return None  # changed within the tick its identity was kept in
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
            now = time.time_ns()
            sums = [(str(p), size, whole_crc(p, size)) for _, path, snap in inputs
                    for p, size in _recent_files(path, snap, now)]
            data = pickle.dumps({"v": VERSION, "key": self.key, "code": code_identity(), "inputs": inputs,
                                 "sums": sums, "value": value, "warnings": list(warnings)},
                                protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a result that cannot be kept is computed again next time
            return
        write_entry(entry, data)
        bound(self.store.limit)  # type: ignore[union-attr]
