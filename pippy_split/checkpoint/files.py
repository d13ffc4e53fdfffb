"""Writing a checkpoint directory (or a single file) safely, and finding a complete one.

Part of :mod:`pippy_split.checkpoint`: a save writes into a fresh sibling
``<path>.tmp-XXXX`` and :func:`commit` swaps it with ``<path>`` in one atomic
exchange (Linux), else two renames with a findable backup; :func:`save_file` does
the same for one file (``pippy-split train``'s ``model.pt``). The one home of
"replace atomically" in the project.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import tempfile
from typing import Any, Callable

from torch.distributed.checkpoint import FileSystemReader

from .layout import METADATA_FILE, CheckpointError


def read_metadata(path: str) -> Any:
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}", path) from e


def find_checkpoint(path: str) -> str:
    """``path`` if it is a complete checkpoint; else the backup a save left between its two renames."""
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return path
    if not os.path.exists(path):
        backups = [b for b in _siblings(path, ".old-") if os.path.isfile(os.path.join(b, METADATA_FILE))]
        if backups:
            return max(backups, key=os.path.getmtime)
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist", path)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: it is not a directory", path)
    raise CheckpointError(f"no checkpoint at {path}: the directory has no {METADATA_FILE} "
                          "(not a checkpoint written by pippy_split.checkpoint / torch.distributed.checkpoint)", path)



def _siblings(path: str, infix: str) -> list[str]:
    parent, base = os.path.split(path)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return [os.path.join(parent, n) for n in names if n.startswith(base + infix)]


def _is_replaceable(path: str) -> bool:
    """An existing ``path`` may be replaced only if it is a checkpoint or an empty directory."""
    if not os.path.lexists(path):
        return True
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, METADATA_FILE)) or not os.listdir(path)


def prepare_tmp(path: str) -> str:
    """Check ``path`` can be replaced, clear leftovers of killed saves, make the temporary directory."""
    parent, base = os.path.split(path)
    if not base:
        raise CheckpointError("the path names no directory")
    if not _is_replaceable(path):
        kind = ("a symbolic link" if os.path.islink(path) else "a file" if not os.path.isdir(path)
                else "a directory that is not a checkpoint and is not empty")
        raise CheckpointError(f"it exists and is {kind}; refusing to replace it")
    check_ancestors(parent)
    os.makedirs(parent, exist_ok=True)
    for stale in _siblings(path, ".tmp-"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=base + ".tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a checkpoint is usually shared
    return tmp


def check_ancestors(parent: str) -> None:
    """Name the file in the way when some ancestor of the directory is not a directory."""
    p = parent
    while p and not os.path.exists(p):
        up = os.path.dirname(p)
        if up == p:
            return
        p = up
    if p and not os.path.isdir(p):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), p)


def save_file(path: str, write: Callable[[Any], None]) -> str:
    """Write one file atomically: ``write(f)`` fills a sibling temporary file, which then
    replaces ``path`` (through :func:`commit`); a crash or an error part-way leaves the
    previous file as it was. Returns ``path``.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> save_file(os.path.join(d, "a.txt"), lambda f: f.write(b"hi")) == os.path.join(d, "a.txt")
        True
    """
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".tmp-", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        commit(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def commit(tmp: str, path: str) -> None:
    """Make the complete checkpoint (directory or file) in ``tmp`` be ``path``; the old one is
    never half-replaced: a file is renamed over it, a directory exchanged with it."""
    if os.path.isfile(tmp) and not os.path.isdir(path):
        os.replace(tmp, path)
    elif not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # holds the old checkpoint now
    else:
        backup = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=os.path.dirname(path))
        os.rmdir(backup)
        os.rename(path, backup)
        # A kill here leaves no ``path`` but a complete ``backup``, which load() finds.
        os.rename(tmp, path)
        shutil.rmtree(backup, ignore_errors=True)
    for stale in _siblings(path, ".old-"):  # backups of earlier interrupted saves
        shutil.rmtree(stale, ignore_errors=True)
    _fsync_dir(os.path.dirname(path))


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two directories (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False  # the filesystem (or kernel) cannot exchange: fall back to two renames
    raise OSError(code, os.strerror(code), b)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def failure_reason(path: str, e: BaseException) -> str:
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename and os.fspath(e.filename) != path else ""
        return f"{e.strerror or e}{where}"
    return str(e)

