"""A FUSE file system whose daemon stops answering writes while a flag file exists: a hung gcsfuse or
s3fs, for the stalled-storage tests. ``python stallfs.py MOUNTPOINT FLAG`` (foreground; fusepy).

Files live in memory; a write waits, without answering the kernel, for as long as FLAG exists.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import time

from fuse import FUSE, FuseOSError, Operations


class StallingFS(Operations):
    def __init__(self, flag: str) -> None:
        self.flag = flag
        self.files: dict[str, bytearray] = {}
        self.dirs = {"/"}
        self.lock = threading.Lock()
        self.uid, self.gid = os.getuid(), os.getgid()

    def getattr(self, path: str, fh: object = None) -> dict:
        now = time.time()
        base = dict(st_uid=self.uid, st_gid=self.gid, st_ctime=now, st_mtime=now, st_atime=now)
        if path in self.dirs:
            return dict(base, st_mode=stat.S_IFDIR | 0o755, st_nlink=2)
        if path in self.files:
            return dict(base, st_mode=stat.S_IFREG | 0o644, st_nlink=1, st_size=len(self.files[path]))
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path: str, fh: object) -> list[str]:
        prefix = path.rstrip("/") + "/"
        names = [p[len(prefix):] for p in [*self.files, *self.dirs] if p != path and os.path.dirname(p) == path]
        return [".", "..", *names]

    def mkdir(self, path: str, mode: int) -> None:
        self.dirs.add(path)

    def create(self, path: str, mode: int, fi: object = None) -> int:
        with self.lock:
            self.files.setdefault(path, bytearray())
        return 0

    def open(self, path: str, flags: int) -> int:
        return 0

    def truncate(self, path: str, length: int, fh: object = None) -> None:
        with self.lock:
            del self.files[path][length:]

    def write(self, path: str, data: bytes, offset: int, fh: object) -> int:
        while os.path.exists(self.flag):  # the daemon hangs: the kernel's request waits unanswered
            time.sleep(0.02)
        with self.lock:
            buf = self.files[path]
            buf[offset:offset + len(data)] = data
        return len(data)

    def read(self, path: str, size: int, offset: int, fh: object) -> bytes:
        return bytes(self.files[path][offset:offset + size])

    def rename(self, old: str, new: str) -> None:
        with self.lock:
            self.files[new] = self.files.pop(old)

    def unlink(self, path: str) -> None:
        self.files.pop(path, None)

    def chmod(self, path: str, mode: int) -> int:
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0

    def utimens(self, path: str, times: object = None) -> int:
        return 0


if __name__ == "__main__":
    FUSE(StallingFS(sys.argv[2]), sys.argv[1], foreground=True, direct_io=True)
