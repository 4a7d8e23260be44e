"""Flight Recorder dump files: which files under a dump path are read, and the bytes of one, bounded.

A dump path may be the one a trace file's own ``process_start`` names (its ``fr_dir``), so a trace
chooses what is opened here; every step is bounded whatever the path holds (docs/comm.md, "Flight
Recorder dumps"):

* the listing goes :data:`FR_MAX_DEPTH` directory levels down (the path itself is the first), looks
  at :data:`MAX_LISTED` entries at most, never follows a link, and keeps regular files only (by
  ``lstat``): a FIFO, a socket, a device or a link met while listing is never opened, only named;
* a file is opened ``O_RDONLY | O_NONBLOCK | O_NOFOLLOW`` (the path given itself may be a link, as
  a user's ``--fr`` may be), then ``fstat``: a descriptor that is not a regular file is closed unread;
* a file is read :data:`SNIFF_BYTES` (4 KiB) first: unless its first byte is a pickle's (``\\x80``) or JSON's
  (``{`` after blanks) it is read no further; a dump is read up to :data:`MAX_DUMP_BYTES` + 1 bytes,
  never more, whatever the file grows to meanwhile.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

FR_MAX_DEPTH = 4
"""Directory levels read under a dump path, the path itself included: the path and three levels of
folders below it. The read cache's snapshot of a dump path must look at least this deep
(``reading/cache.py``; ``snapshot(path, FR_MAX_DEPTH)`` lists exactly the folders read here), so a
remembered result covers every file the reader reads."""
MAX_LISTED = 100_000
"""Directory entries looked at under one dump path at most (a run's dumps are one file per rank and
incident; a path like ``/`` must not be walked whole)."""
MAX_DUMP_BYTES = 256 << 20
"""A file bigger than this is no dump we read (2,000 entries with stacks are a few MB)."""
SNIFF_BYTES = 4 << 10
_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(slots=True)
class Listing:
    """The regular files under a dump path (sorted, folders in name order) and what was passed over."""

    files: list[Path] = field(default_factory=list)
    refused: list[tuple[Path, str]] = field(default_factory=list)  # (path, why): non-regular entries
    notes: list[str] = field(default_factory=list)  # one line each: depth or entry limits reached
    top_is_file: bool = False


def list_dumps(path: Path) -> Listing:
    """Every regular file under ``path`` (a file or a directory), bounded as the module doc says."""
    out = Listing()
    try:
        st = os.stat(path)  # the path given may be a link (a linked fr_dir, a user's --fr)
    except OSError:
        return out
    if stat.S_ISREG(st.st_mode):
        out.files.append(path)
        out.top_is_file = True
    elif stat.S_ISDIR(st.st_mode):
        _walk(path, 1, out, [0])
    else:
        out.refused.append((path, _kind(st.st_mode)))
    return out


def _walk(folder: Path, level: int, out: Listing, seen: list[int]) -> None:
    try:
        with os.scandir(folder) as it:
            entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        seen[0] += 1
        if seen[0] > MAX_LISTED:
            if seen[0] == MAX_LISTED + 1:
                out.notes.append(f"more than {MAX_LISTED} entries: the rest not looked at")
            return
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode):
            if level < FR_MAX_DEPTH:
                _walk(Path(entry.path), level + 1, out, seen)
            elif not any("deeper than" in n for n in out.notes):
                out.notes.append(f"folders deeper than {FR_MAX_DEPTH} levels are not read (first: {entry.path})")
        elif stat.S_ISREG(mode):
            out.files.append(Path(entry.path))
        else:
            out.refused.append((Path(entry.path), _kind(mode)))


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_dump(path: Path, *, follow: bool = False) -> tuple[bytes | None, str, bool]:
    """``(data, "", True)`` for a file that may be a dump, read whole; else ``(None, why, dumpish)``:
    ``dumpish`` when it began like a pickle or JSON (a damaged dump, not some other file). ``follow``:
    ``path`` may be a link (the path the user gave); entries met while listing are never followed."""
    try:
        fd = os.open(path, _FLAGS | (0 if follow else _NOFOLLOW))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "a symbolic link: not followed", False
        return None, f"cannot read ({exc.strerror or exc})", False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{_kind(st.st_mode)}, not a regular file: not read", False
        if st.st_size > MAX_DUMP_BYTES:
            return None, f"{st.st_size} bytes: bigger than any Flight Recorder dump ({MAX_DUMP_BYTES >> 20} MiB)", False
        head = _read_up_to(fd, SNIFF_BYTES)
        first = head.lstrip()[:1]
        if head[:1] != b"\x80" and first != b"{":
            return None, "neither a pickle nor JSON: not a Flight Recorder dump", False
        data = head + _read_up_to(fd, MAX_DUMP_BYTES + 1 - len(head)) if len(head) == SNIFF_BYTES else head
        if len(data) > MAX_DUMP_BYTES:
            return None, f"grew past {MAX_DUMP_BYTES >> 20} MiB while read: bigger than any Flight Recorder dump", True
        return data, "", True
    except OSError as exc:
        return None, f"cannot read ({exc.strerror or exc})", False
    finally:
        os.close(fd)


def _read_up_to(fd: int, limit: int) -> bytes:
    parts, got = [], 0
    while got < limit:
        chunk = os.read(fd, min(limit - got, 1 << 20))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def fingerprint(path: Path) -> tuple[tuple[str, int, int, int], ...]:
    """What the files under ``path`` are now (name, size, mtime and ctime in ns), for a follower to
    tell whether to read them again: the same listing as :func:`list_dumps`, a file path included."""
    out = []
    for file in list_dumps(path).files:
        try:
            st = os.stat(file, follow_symlinks=file == path)
        except OSError:
            continue
        out.append((str(file), st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)
