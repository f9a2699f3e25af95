# accelerate_c/checkpointing/atomic.py: crash-safe directory publication for checkpoints.
#
# Protocol (the caller writes every file into `temp_dir_for(final)` first, fsyncing each):
#   1. fsync every file and the temp directory;
#   2. if `final` does not exist: rename temp -> final, fsync the parent;
#      if it exists: carry over files the new checkpoint does not replace (hard links), then swap the two
#      directories in one step (Linux renameat2(RENAME_EXCHANGE)), or, where that is unavailable,
#      rename final -> `old_dir_for(final)`, rename temp -> final; fsync the parent; delete the old tree.
# A crash at any point leaves the previous checkpoint complete at `final`, or (only in the two-rename
# fallback, between its two renames) both complete checkpoints aside; `recover()` / `resolve_for_read()`
# then pick the new one when its commit marker is present, else the old one.
# Names: temp/old siblings start with "." and end with TMP_SUFFIX/OLD_SUFFIX, so listings ignore them.
# In use: the coordinator holds an exclusive flock on the temp folder from its creation to the end of commit()
# (hold/release; the kernel drops it when the process dies, however it dies), so `cleanup` (interrupted.py) never
# removes the folder of a save that is still running. The kill points (base/killpoints.py) mark each step.
# Not for: what goes inside a checkpoint (session.py) or multi-process coordination (session.py).
from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
from typing import Iterable, Optional

from ..base.killpoints import kill_point

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".accelerate_c-tmp"
OLD_SUFFIX = ".accelerate_c-old"
_HELD: dict[str, int] = {}  # path -> descriptor holding this process's flock on it


def hold(path: str) -> None:
    """Marks `path` (a folder or file this process writes) as in use until release() or this process's end."""
    release(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by another process (or no flock here): nothing to mark
        os.close(fd)
        return
    _HELD[os.path.abspath(path)] = fd


def release(path: str) -> None:
    fd = _HELD.pop(os.path.abspath(path), None)
    if fd is not None:
        os.close(fd)


def in_use(path: str) -> bool:
    """True while some process holds `path` (hold()): a save or save_model that is still writing it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _split(final: str) -> tuple[str, str]:
    final = os.path.abspath(os.fspath(final))
    return os.path.dirname(final), os.path.basename(final)


def temp_dir_for(final: str) -> str:
    """Deterministic (same on every rank) temporary sibling of `final`."""
    parent, base = _split(final)
    return os.path.join(parent, f".{base}{TMP_SUFFIX}")


def old_dir_for(final: str) -> str:
    parent, base = _split(final)
    return os.path.join(parent, f".{base}{OLD_SUFFIX}")


def is_internal_name(name: str) -> bool:
    """True for our temp/old siblings (never a checkpoint of their own)."""
    return name.startswith(".") and (name.endswith(TMP_SUFFIX) or name.endswith(OLD_SUFFIX))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still ordered after
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every regular file below path, then every directory (children before parents)."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            p = os.path.join(root, name)
            if os.path.isfile(p) and not os.path.islink(p):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(root)


def _rmtree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def recover(final: str, marker: str) -> None:
    """Main process, before a save: repair an interrupted replace of `final` and drop stale siblings."""
    tmp, old = temp_dir_for(final), old_dir_for(final)
    parent = os.path.dirname(tmp)
    if not os.path.lexists(final) and os.path.isdir(old):
        src = tmp if os.path.isfile(os.path.join(tmp, marker)) else old
        logger.warning("Recovering checkpoint %s from an interrupted save (%s)", final, os.path.basename(src))
        os.rename(src, final)
        fsync_dir(parent)
    for stale in (tmp, old):
        if os.path.lexists(stale):
            _rmtree(stale)


def resolve_for_read(final: str, marker: str) -> Optional[str]:
    """Read-only twin of recover(): where the complete checkpoint for `final` lives, or None."""
    if os.path.isdir(final):
        return final
    tmp, old = temp_dir_for(final), old_dir_for(final)
    if os.path.isdir(old):
        src = tmp if os.path.isfile(os.path.join(tmp, marker)) else old
        logger.warning("Checkpoint %s was interrupted while being replaced; reading %s", final, src)
        return src
    return None


def prepare_temp_dir(final: str, marker: str) -> str:
    """Main process: recover, clear any stale temp dir, create a fresh one; returns its path."""
    parent, _ = _split(final)
    os.makedirs(parent, exist_ok=True)
    recover(final, marker)
    tmp = temp_dir_for(final)
    os.mkdir(tmp)
    hold(tmp)
    kill_point("save.tmp_created")
    return tmp


def _carry_over(src_dir: str, dst_dir: str, skip: set[str]) -> None:
    """Hard-link (or copy) entries of the directory being replaced that the new checkpoint does not write."""
    for name in os.listdir(src_dir):
        if name in skip or os.path.lexists(os.path.join(dst_dir, name)):
            continue
        src, dst = os.path.join(src_dir, name), os.path.join(dst_dir, name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def commit(tmp: str, final: str, marker: str, drop_from_old: Iterable[str] = ()) -> None:
    """Publish the fully written `tmp` as `final` (see the header for the crash guarantees).

    Entries of an existing `final` are kept unless the new checkpoint writes the same name or they are
    listed in `drop_from_old` (files that belonged to the previous checkpoint)."""
    kill_point("save.before_commit")
    try:
        _commit(tmp, final, marker, drop_from_old)
    finally:
        release(tmp)


def _commit(tmp: str, final: str, marker: str, drop_from_old: Iterable[str]) -> None:
    final = os.path.abspath(final)
    parent = os.path.dirname(final)
    if os.path.lexists(final) and not os.path.isdir(final):
        raise FileExistsError(f"cannot save a checkpoint to {final}: it exists and is not a directory")
    if not os.path.lexists(final):
        fsync_tree(tmp)
        kill_point("save.before_rename")
        os.rename(tmp, final)
        fsync_dir(parent)
        return
    final = os.path.realpath(final)
    parent = os.path.dirname(final)
    drop_from_old = set(drop_from_old)
    _carry_over(final, tmp, drop_from_old)
    fsync_tree(tmp)
    cwd = os.path.realpath(os.getcwd())
    if cwd == final or cwd.startswith(final + os.sep):
        # Swapping the working directory away would strand the process: replace file by file instead.
        logger.warning("Saving into the working directory %s: files are replaced one by one, not atomically", final)
        names = sorted(os.listdir(tmp), key=lambda n: n == marker)  # marker last
        for name in set(drop_from_old) - set(names):   # files of the previous checkpoint not rewritten
            if os.path.isfile(os.path.join(final, name)):
                os.remove(os.path.join(final, name))
        for name in names:
            dst = os.path.join(final, name)
            if os.path.isdir(dst) and not os.path.islink(dst):
                shutil.rmtree(dst)
            os.replace(os.path.join(tmp, name), dst)
        fsync_dir(final)
        _rmtree(tmp)
        return
    kill_point("save.before_exchange")
    if _exchange(tmp, final):
        fsync_dir(parent)
        kill_point("save.after_exchange")
        _rmtree(tmp)          # now holds the previous checkpoint
        return
    old = old_dir_for(final)
    _rmtree(old)
    os.rename(final, old)
    fsync_dir(parent)
    kill_point("save.between_renames")
    os.rename(tmp, final)
    fsync_dir(parent)
    kill_point("save.old_left")
    _rmtree(old)
