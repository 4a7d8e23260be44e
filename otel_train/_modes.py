"""Modes of what otel-train creates, whatever the umask: never group- or world-writable.

Files are created 0644 and directories 0755 (README, docs/reliability.md). Under ``umask 000`` the OS
would make them 0666 / 0777, and any local user could then plant links in a run directory; so each
file and directory we create has the group and other write bits taken off explicitly. A stricter umask
(``077``) is kept as it is. What existed before is never changed. Used by both sides (the runtime's
trace files and digests, the reading side's exports), so it imports nothing of either.
"""

from __future__ import annotations

import errno
import os
import stat

FILE_MODE = 0o644
DIR_MODE = 0o755
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def tighten_fd(fd: int) -> None:
    """Take the group and other write bits off the file or directory open at ``fd`` (when we own it)."""
    st = os.fstat(fd)
    if st.st_mode & _OTHERS_WRITE and st.st_uid == os.geteuid():
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~_OTHERS_WRITE)


def _tighten_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        tighten_fd(fd)
    finally:
        os.close(fd)


def foreign(path: str | os.PathLike[str]) -> str | None:
    """Why the existing directory ``path`` is not safe to write into, or None (also when it does not exist).

    Unsafe: writable by others (``o+w``, sticky bit or not), or owned by a user other than this one and
    root. Whoever can write into a directory can plant a link at a name this process later creates;
    files are opened ``O_NOFOLLOW`` and temporaries ``O_EXCL``, but a run directory another user controls
    is refused at ``init`` all the same (setting ``allow_shared_dir``; docs/settings.md).
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    if st.st_mode & stat.S_IWOTH:
        return f"it is writable by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_uid not in (os.geteuid(), 0):
        return f"it is owned by another user (uid {st.st_uid}; this process runs as uid {os.geteuid()})"
    return None


def make_dirs(path: str | os.PathLike[str]) -> None:
    """``path`` and its missing parents, each one this call creates made 0755 at most; raises OSError."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(directory):  # a file in the way: what os.makedirs says of a path under it
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), directory) from None
            continue  # made meanwhile by someone else: not ours to change
        _tighten_dir(directory)


def create(path: str | os.PathLike[str], flags: int = os.O_WRONLY | os.O_TRUNC) -> int:
    """Open ``path`` for writing, created 0644 at most (``O_CREAT``, ``O_CLOEXEC`` and ``O_NOFOLLOW`` added:
    a link planted at ``path`` is refused with ELOOP, never written through); the fd."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        tighten_fd(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd
