"""Files the commands write (an export, the what-if heatmap, the stats CSV): only a regular file or
nothing is ever replaced, and what is made is never group- or world-writable (docs/reliability.md).

A target that exists and is not a regular file (a directory, a FIFO, a socket, a character or block
device, a symbolic link) is refused with :class:`OutputError`, one line, before anything is written:
``otel-train export RUN -o /dev/null`` run as root used to rename its temporary over the device, and a
FIFO given as ``-o`` was replaced while its reader waited forever. The target is looked at with
``lstat`` (never opened: opening a FIFO blocks), then again just before the rename. What is written goes
to a temporary beside the target (0644 at most, ``O_NOFOLLOW``: :func:`otel_train._modes.create`),
renamed into place when complete; missing folders are made 0755 at most (:func:`otel_train._modes.make_dirs`),
whatever the umask. Writing to a stream is ``-o -`` (stdout), for export.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from otel_train import _modes

STDOUT = "-"
"""The output name that means standard output (``export -o -``)."""

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symbolic link"}


class OutputError(ValueError):
    """An output target that is not a regular file (one line: what, where, how to fix); the CLI exits 2."""


def refuse_special(path: str | os.PathLike[str], what: str) -> None:
    """Raise :class:`OutputError` when ``path`` exists and is not a regular file (``what``: the option,
    e.g. ``--output``). Never opens it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError:
        return  # e.g. a parent that is not a directory: the write says what is wrong
    if stat.S_ISREG(mode):
        return
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    stream = " (or - to stream to stdout)" if what in ("--output", "-o") else ""
    raise OutputError(f"{what} {os.fspath(path)}: it is {kind}; an output only ever replaces a regular file "
                      f"or makes a new one: name a file{stream}")


@contextmanager
def replacing(path: str | os.PathLike[str], what: str, *, parents: bool = True,
              buffering: int = 1 << 20) -> Iterator[IO[bytes]]:
    """A binary file to write ``path``'s new content into: a temporary beside it, renamed over ``path``
    when the block ends without an exception (removed otherwise); ``parents``: missing folders are made.
    Raises :class:`OutputError` for a target that is not a regular file (before and again at the
    rename), OSError naming ``path``."""
    out = Path(path)
    refuse_special(out, what)
    if parents:
        _modes.make_dirs(out.parent)  # 0755 at most, whatever the umask
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fd = _modes.create(tmp)  # 0644 at most; a link planted at the temporary's name: ELOOP
        with open(fd, "wb", buffering=buffering, closefd=True) as f:
            f.raw.name = str(tmp)  # type: ignore[attr-defined]  # (writers name files beside it: export's parts)
            yield f
        refuse_special(out, what)  # made meanwhile: still never replaced
        os.replace(tmp, out)
    except OSError as exc:
        if exc.filename == str(tmp):  # name the file the user asked for, not our temporary
            raise OSError(exc.errno, exc.strerror, str(out)) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
