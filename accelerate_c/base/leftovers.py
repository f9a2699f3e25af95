# accelerate_c/base/leftovers.py: what a killed process can leave on this machine, named so that anyone can tell
# whether its maker still runs: the shared-memory segments in /dev/shm (`accc-<tag>-<owner>-<token>[-r]`) and
# the launcher's temp folders (`accelerate_c_launch_<owner>_<random>`), where <owner> is "<pid>-<start>-<pidns>"
# (the maker's pid, its start time in clock ticks since boot from /proc/<pid>/stat, and the inode of its pid
# namespace, so a reused pid or another container's pid is never taken for the maker). The sweeps remove the
# entries of this user whose maker is gone; an entry of a running maker, of another pid namespace, of another
# user or of any other name is never touched. Callers: comm/shm_segments.py (the next group creation), the
# launcher (at start and at the end of a job), notebook_launcher / debug_launcher (their folders),
# `python -m accelerate_c cleanup`.
# Linux only (/proc); elsewhere every maker counts as running, so nothing is removed.
# Not for: checkpoint temp folders (checkpointing/atomic.py), creating segments (comm/shm_segments.py).
from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

SHM_DIR = "/dev/shm"
LAUNCH_PREFIX = "accelerate_c_launch_"
_OWNER = r"(?P<pid>\d+)-(?P<start>\d+)-(?P<ns>\d+)"
_SHM_RE = re.compile(r"^accc-(?P<tag>[A-Za-z0-9_.]+)-" + _OWNER + r"-(?P<token>[0-9a-f]{16})(?P<region>-r)?$")
_LAUNCH_RE = re.compile(r"^" + LAUNCH_PREFIX + _OWNER + r"_[A-Za-z0-9_]+$")


def _start_ticks(pid: int) -> Optional[int]:
    """Field 22 of /proc/<pid>/stat (start time), None when the process is gone or a zombie; -1 when /proc says
    nothing readable (then it counts as running)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[-1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return -1
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19]) if len(fields) > 19 else -1


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner() -> str:
    """This process as "<pid>-<start>-<pidns>" (what the names above carry)."""
    pid = os.getpid()
    return f"{pid}-{max(0, _start_ticks(pid) or 0)}-{_pid_ns()}"


def owner_gone(pid: int, start: int, ns: int) -> bool:
    """True only when the maker is known to be gone: same pid namespace as ours, and no process `pid` (or a
    zombie, or one started at another time). Unknown (another namespace, no /proc): False."""
    if ns != _pid_ns() or ns == 0:
        return False
    now = _start_ticks(pid)
    return now is None or (now >= 0 and start > 0 and now != start)


def shm_name(tag: str, region: bool = False) -> str:
    """A fresh, unguessable segment name for a group (or, with `region`, an alloc() region) made by this process;
    `tag` (the job's master port) is reduced to letters, digits, '_' and '.'."""
    tag = re.sub(r"[^A-Za-z0-9_.]", "_", str(tag))[:40] or "0"
    return f"/accc-{tag}-{owner()}-{secrets.token_hex(8)}{'-r' if region else ''}"


@dataclass(frozen=True)
class Leftover:
    path: str
    what: str    # "shm segment" or "launcher temp folder"
    pid: int     # its maker's pid


def _mine(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.geteuid()
    except OSError:
        return False


def _find(directory: str, pattern: re.Pattern, what: str) -> list[Leftover]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    out = []
    for name in names:
        m = pattern.match(name)
        path = os.path.join(directory, name)
        if m and _mine(path) and owner_gone(int(m["pid"]), int(m["start"]), int(m["ns"])):
            out.append(Leftover(path, what, int(m["pid"])))
    return out


def stale_segments(shm_dir: str = SHM_DIR) -> list[Leftover]:
    """Our segments in /dev/shm whose maker is gone (a group or region it created and nobody unlinked)."""
    return _find(shm_dir, _SHM_RE, "shm segment")


def stale_launch_dirs(temp_dir: Optional[str] = None) -> list[Leftover]:
    """The launcher temp folders in `temp_dir` (default: tempfile.gettempdir()) whose launcher is gone."""
    return [x for x in _find(temp_dir or tempfile.gettempdir(), _LAUNCH_RE, "launcher temp folder")
            if os.path.isdir(x.path) and not os.path.islink(x.path)]


def remove(items: list[Leftover]) -> list[Leftover]:
    """Removes the given leftovers; returns those that were removed (a vanished one counts as removed)."""
    done = []
    for x in items:
        try:
            if os.path.isdir(x.path) and not os.path.islink(x.path):
                shutil.rmtree(x.path)
            else:
                os.unlink(x.path)
        except FileNotFoundError:
            pass
        except OSError:
            continue
        done.append(x)
    return done


def sweep_segments() -> list[Leftover]:
    """Removes our segments whose maker is gone; never raises."""
    try:
        return remove(stale_segments())
    except Exception:  # noqa: BLE001 - a sweep must never break the run that does it
        return []


def make_launch_dir() -> str:
    """The launcher's temp folder, named after this process; first removes the folders of launchers that are gone."""
    try:
        remove(stale_launch_dirs())
    except Exception:  # noqa: BLE001 - as above
        pass
    return tempfile.mkdtemp(prefix=f"{LAUNCH_PREFIX}{owner()}_")
