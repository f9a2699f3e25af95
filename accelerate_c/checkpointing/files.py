# accelerate_c/checkpointing/files.py: how a checkpoint's files are named and opened. Every name a checkpoint's own
# metadata gives (checkpoint.json's lists, the indexes' piece files, a state file's tensor file) must be a plain
# file name inside the checkpoint directory (no "/", no "..", no leading "."); every file is opened with
# O_NOFOLLOW | O_NONBLOCK and must be a regular file (a symbolic link, a FIFO, a device or a directory in its
# place is a named error: a FIFO can never hang a load), and read with a size limit where its size is not
# known. Not for: what the bytes mean (stfile.py, format.py, schema.py).
from __future__ import annotations

import errno
import os
import re
import stat
from typing import Optional

from .errors import CheckpointError

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
MAX_JSON_BYTES = 1 << 28   # 256 MiB: far above any index a model of 10^6 tensors needs


def check_name(name: object, where: str) -> str:
    """`name` (read from `where`) as a plain file name of the checkpoint directory, else a CheckpointError."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise CheckpointError(f"{where} names {name!r}, which is not a plain file name inside the checkpoint "
                              "(paths, '..' and hidden names are refused)")
    return name


def member(directory: str, name: object, where: str, suffix: str = "") -> str:
    """The path of the checkpoint file `name + suffix` (`name` read from `where`), confined to `directory`."""
    return os.path.join(directory, check_name(name, where) + suffix)


def open_regular(path: str, expected_size: Optional[int] = None) -> int:
    """A read-only descriptor of the regular file at `path` (not followed if a link); its size checked when known."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint file {path} is a symbolic link, not a regular file; checkpoint files "
                                  "are read without following links") from None
        raise CheckpointError(f"checkpoint file {path} cannot be opened: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"checkpoint file {path} is not a regular file ({_kind(st.st_mode)})")
    if expected_size is not None and st.st_size != expected_size:
        os.close(fd)
        raise CheckpointError(f"checkpoint file {path} has {st.st_size} bytes but {expected_size} were written "
                              "(truncated or replaced?)")
    return fd


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    """Exactly n bytes at offset, else a CheckpointError (the file is shorter than its header says)."""
    parts, done = [], 0
    while done < n:
        chunk = os.pread(fd, n - done, offset + done)
        if not chunk:
            raise CheckpointError(f"checkpoint file {path}: short read at byte {offset + done} (truncated?)")
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def read_bytes(path: str, limit: int = MAX_JSON_BYTES, expected_size: Optional[int] = None) -> bytes:
    """The whole regular file at `path`, at most `limit` bytes."""
    fd = open_regular(path, expected_size)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes, more than the {limit} allowed for it")
        return pread_exact(fd, size, 0, path)
    finally:
        os.close(fd)
