"""`LocalFolder`: a directory on a local (or POSIX network) filesystem, through the OS directly.

Atomic means `rename(2)`: a record is written under a temporary name,
fsynced, then renamed over its final name, and the directory fsynced, so a
reader sees the old file or the new one and a power loss keeps one of them.
Reads are `preadv` straight into the caller's buffers; writes `writev`
straight from them. No fsspec in between: local paths keep their speed.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError
from .folder import Folder, RandomAccess, Sink, plain_name, temporary_name, too_large

__all__ = [
    "NETWORK_FILE_SYSTEMS",
    "LocalFile",
    "LocalFolder",
    "LocalSink",
    "file_system_of",
    "write_all",
]

# File system types (as /proc/self/mounts names them) whose reads cross a network link
NETWORK_FILE_SYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "cifs",
        "smb3",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.ceph",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.juicefs",
        "fuse.weka",
        "wekafs",
        "panfs",
        "orangefs",
        "9p",
        "virtiofs",
    }
)


def file_system_of(path: str | os.PathLike, mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the file system `path` lies on: the mount in `mounts` with the
    longest prefix of its resolved path (None: not Linux, or not found)."""
    try:
        where = str(Path(path).resolve())
        with open(mounts) as f:
            table = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return None
    best, kind = -1, None
    for point, fs_type in table:
        point = point.replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # of two on one point, the later is in effect
            best, kind = len(point), fs_type
    return kind


_IOV_MAX = 1024
# Never follow a link out of the folder, never block on a FIFO planted in it.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def open_plain(path: Path) -> int:
    """A read descriptor of `path` if it is a plain file, not a link (opened with
    `O_NOFOLLOW`) nor a device, FIFO or folder (`fstat`): a checkpoint folder is
    untrusted, and a link in it could point anywhere."""
    try:
        fd = os.open(path, _READ_FLAGS | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno != errno.ENOENT and os.path.islink(path)):
            raise CorruptCheckpointError(
                f"{path} is a symbolic link: files of a checkpoint must be plain files "
                "inside its folder (refused, nothing read through it)"
            ) from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(
            f"{path} is not a plain file (a folder, device or pipe): refused"
        )
    return fd


def _rest(views: list[memoryview], done: int) -> list[memoryview]:
    """What of `views` is left to write once their first `done` bytes are written."""
    rest, skip = [], done
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        rest.append(v[skip:])
        skip = 0
    return rest


def write_all_at(fd: int, buffers: Sequence[Any], offset: int) -> None:
    """`pwritev` from `offset` until every byte is written (one call may write less)."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    for k in range(0, len(views), _IOV_MAX):
        part = views[k : k + _IOV_MAX]
        total = sum(len(v) for v in part)
        done = os.pwritev(fd, part, offset)
        while done < total:  # a short write: go on from where it stopped
            part, offset, total = _rest(part, done), offset + done, total - done
            done = os.pwritev(fd, part, offset)
        offset += done


def write_all(fd: int, buffers: Sequence[Any]) -> None:
    """`writev` until every byte is written (one call may write less)."""
    pending = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    while pending:
        part = pending[:_IOV_MAX]
        pending = _rest(part, os.writev(fd, part)) + pending[_IOV_MAX:]


class LocalFile(RandomAccess):
    """An open file descriptor, read with `preadv`."""

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        self.fd = open_plain(path)
        self._owned = True

    @classmethod
    def wrap(cls, fd: int, where: str = "") -> LocalFile:
        """A descriptor opened elsewhere, read in place (and left open by `close`)."""
        f = cls.__new__(cls)
        f.where, f.fd, f._owned = where or f"<fd {fd}>", fd, False
        return f

    def readinto(self, buffers: Sequence[memoryview], offset: int) -> int:
        views = [b for b in buffers if len(b)]
        return os.preadv(self.fd, views, offset) if views else 0

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0 and self._owned:
            os.close(self.fd)
        self.fd = -1


class LocalSink(Sink):
    """A new file created exclusively (`O_EXCL`) and filled with `writev`, or with
    `pwritev` at given offsets from several threads (`write_at`)."""

    positional = True

    def __init__(self, path: Path) -> None:
        self.name = path.name
        self.path = path
        self.file = open(path, "xb", buffering=0)  # noqa: SIM115 - closed by close/abort
        self._buffered: io.BufferedWriter | None = None

    def write(self, buffers: Sequence[Any]) -> None:
        """One `writev` for the lot when the kernel takes it all (the common case)."""
        if self._buffered is not None:
            self._buffered.flush()
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if len(v)]
        if not views:
            return
        fd = self.file.fileno()
        for k in range(0, len(views), _IOV_MAX):
            part = views[k : k + _IOV_MAX]
            n = os.writev(fd, part)
            total = sum(len(v) for v in part)
            if n < total:  # a short write: finish from where it stopped
                write_all(fd, _rest(part, n))

    def write_at(self, buffers: Sequence[Any], offset: int) -> None:
        write_all_at(self.file.fileno(), buffers, offset)

    def stream(self) -> io.BufferedWriter:
        if self._buffered is None:
            self._buffered = io.BufferedWriter(self.file)
        return self._buffered

    def close(self, *, sync: bool = True) -> None:
        if self.file.closed:
            return
        try:
            if self._buffered is not None:
                self._buffered.flush()
            if sync:
                os.fsync(self.file.fileno())
        finally:
            self.file.close()

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.path.unlink(missing_ok=True)


class LocalFolder(Folder):
    """A local directory. See the module docstring for what atomic means here."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.location = str(self.path)

    @property
    def identity(self) -> str:
        return str(self.path.resolve())

    @property
    def checkpoint_id(self) -> Path:
        return self.path

    @property
    def local_path(self) -> Path:
        return self.path

    @property
    def shared_medium(self) -> bool:
        """Whether the folder lies on a network file system (NFS, Lustre, GPFS, ...):
        there every rank's read crosses a link all of them share."""
        return file_system_of(self.path) in NETWORK_FILE_SYSTEMS

    def where(self, name: str) -> str:
        return str(self.path / name)

    def is_file(self) -> bool:
        return self.path.is_file()

    def sizes(self) -> dict[str, int]:
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return {}
        out = {}
        for entry in entries:
            try:  # plain files only: a link is no file of the checkpoint, wherever it points
                if entry.is_file(follow_symlinks=False):
                    out[entry.name] = entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
        return out

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path))
        except OSError:
            return []

    def has(self, name: str) -> bool:
        return (self.path / name).exists()

    def removable(self, name: str) -> bool:
        p = self.path / name
        return p.is_file() and not p.is_symlink()

    def read(self, name: str, limit: int | None = None) -> bytes:
        f = self.open(name)
        try:
            size = f.size()  # of the file opened: what is read, whatever a listing said
            if limit is not None and size > limit:
                raise too_large(f.where, size, limit)
            out = bytearray(size)
            got = f.readinto([memoryview(out)], 0) if size else 0
            while got < size:  # a short read (a network filesystem); the file did not grow
                n = f.readinto([memoryview(out)[got:]], got)
                if not n:
                    break
                got += n
            return bytes(out[:got])
        finally:
            f.close()

    def open(self, name: str) -> LocalFile:
        return LocalFile(self.path / plain_name(name))

    def make(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def create(self, name: str) -> LocalSink:
        return LocalSink(self.path / name)

    def write_atomically(self, name: str, write: Callable[[Sink], object], *, sync: bool) -> None:
        """`write(sink)` fills a temporary name, fsynced, then renamed over `name`."""
        sink = self.create(temporary_name(name))
        try:
            write(sink)
            sink.close(sync=sync)
        except BaseException:
            sink.abort()  # a failed write leaves nothing behind to collect
            raise
        os.replace(sink.path, self.path / name)

    def replace(self, source: str, target: str) -> None:
        os.replace(self.path / source, self.path / target)

    def remove(self, name: str) -> None:
        os.unlink(self.path / name)

    def sync(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def create_exclusive(self, name: str, data: bytes, *, sync: bool = True) -> None:
        """Atomic and exclusive: `data` is written and fsynced under a temporary name,
        then hard-linked as `name` (`link(2)` fails if `name` exists, on NFS too), so
        nobody ever reads a partial file. Where links are refused, `O_CREAT|O_EXCL`."""
        target = self.path / plain_name(name)
        sink = self.create(temporary_name(name))
        try:
            sink.write([data])
            sink.close(sync=sync)
            try:
                os.link(sink.path, target)
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links: exclusive create in place
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    write_all(fd, [data])
                    if sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            sink.abort()  # the temporary name goes, whatever happened
        if sync:
            self.sync()

    def is_folder(self) -> bool:
        return self.path.is_dir()

    def folders(self) -> list[str]:
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return []
        out = []
        for entry in entries:
            try:  # a link to a folder is no folder of this one, wherever it points
                if entry.is_dir(follow_symlinks=False):
                    out.append(entry.name)
            except OSError:
                continue
        return sorted(out)

    def child(self, name: str) -> LocalFolder:
        return LocalFolder(self.path / plain_name(name))

    def remove_if_empty(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:  # not empty (someone else's files, a new save's), or gone
            pass
