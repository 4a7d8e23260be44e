"""The read cache's files: identities of trace files, CRCs, where the cache lives, its entries'
reading, writing and size bound (docs/analysis.md, "Reading"). :mod:`.cache` decides what is served.

The cache lives under this user's own cache directory (:func:`user_root`), never in a run directory:
an entry is a pickle, and nothing a run directory holds is ever unpickled. Directories are 0700
whatever the umask, entries 0600; only entries owned by this user in directories only this user can
write are read.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import stat
import zlib
from pathlib import Path

PRINT_BYTES = 4096
RACY_NS = 2_000_000_000
"""A file changed this close to the moment its identity was kept may change again within the same
timestamp tick (coarse file times; 2 s on some filesystems): its whole CRC is kept and checked too."""
DEFAULT_MB = 512
"""The cache's size bound without ``OTEL_TRAIN_CACHE_MB`` (MiB)."""
READ_BLOCK = 1 << 20


class CacheSettingError(ValueError):
    """``OTEL_TRAIN_CACHE_MB`` is not a finite size: the commands that use the cache say so in one line."""


def max_bytes() -> int:
    """The whole cache's size bound: ``OTEL_TRAIN_CACHE_MB`` (MiB, a finite number >= 0) or :data:`DEFAULT_MB`."""
    raw = os.environ.get("OTEL_TRAIN_CACHE_MB")
    if raw is None or not raw.strip():
        return DEFAULT_MB << 20
    try:
        mb = float(raw)
    except ValueError:
        mb = float("nan")
    if not (0 <= mb < 2**40):  # NaN, inf and negatives fail here
        raise CacheSettingError(f"OTEL_TRAIN_CACHE_MB={raw[:40]!r}: the read cache's size bound must be a number of MiB "
                                f"like {DEFAULT_MB} (0 keeps nothing); fix or unset it, or pass --no-cache")
    return int(mb * 2**20)


ENTRY_SUFFIXES = (".state", ".result", ".duckdb")
"""The cache's entries: a process's read state, a command's result, a query group's views (docs/query.md)."""
Ident = tuple[int, int, int, int, int, int, int]  # dev, ino, size, mtime_ns, ctime_ns, head crc, tail crc


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


def whole_crc(path: Path, size: int) -> int | None:
    """The CRC of the first ``size`` bytes of the regular file at ``path``; None when it cannot be read
    or is shorter. About 5 GB/s from the page cache (docs/analysis.md, "Reading")."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        crc, at = 0, 0
        while at < size:
            block = os.pread(fd, min(READ_BLOCK, size - at), at)
            if not block:
                return None
            crc, at = zlib.crc32(block, crc), at + len(block)
        return crc
    except OSError:
        return None
    finally:
        os.close(fd)


def racy(ident: Ident, now_ns: int) -> bool:
    """Whether the file changed within :data:`RACY_NS` of ``now_ns`` (a change in the same tick keeps its times)."""
    return max(ident[3], ident[4]) >= now_ns - RACY_NS


def user_root() -> Path | None:
    """``$XDG_CACHE_HOME/otel-train`` (an absolute one), else ``~/.cache/otel-train``; None without a home."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    try:
        return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "otel-train"
    except RuntimeError:  # no home directory to be found
        return None


def cache_dir_of(logs: Path) -> Path | None:
    """The cache directory of the logs directory ``logs`` (not made): a hash of its resolved path,
    device and inode under :func:`user_root`."""
    root = user_root()
    if root is None:
        return None
    resolved = Path(logs).resolve()
    try:
        st = os.stat(resolved)
        ident = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        ident = "-"
    return root / hashlib.sha256(f"{resolved}\0{ident}".encode()).hexdigest()[:16]


def private_dir(d: Path, *, base: bool = False) -> bool:
    """Make ``d`` (0700 whatever the umask; with ``base``, its missing parents too) if needed; whether
    it is a real directory of this user that only it can write."""
    try:
        missing = [d]
        while base and not missing[-1].parent.is_dir() and missing[-1].parent != missing[-1]:
            missing.append(missing[-1].parent)
        for folder in reversed(missing):
            try:
                os.mkdir(folder, 0o700)
                os.chmod(folder, 0o700, follow_symlinks=False)
            except FileExistsError:
                pass
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
        return os.access(d, os.W_OK | os.X_OK)
    except OSError:
        return False


def load_entry(entry: Path) -> dict | bool | None:
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


def write_entry(entry: Path, data: bytes) -> None:
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


def bound(limit: int) -> None:
    """Remove the least recently used entries of the whole cache (every run's directory under
    :func:`user_root`) until it holds at most ``limit`` bytes."""
    root = user_root()
    entries = []
    try:
        for sub in os.scandir(root):
            if sub.is_dir(follow_symlinks=False):
                entries += [(e.stat(follow_symlinks=False), e.path) for e in os.scandir(sub.path)
                            if e.name.endswith(ENTRY_SUFFIXES)]
    except (OSError, TypeError):
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
