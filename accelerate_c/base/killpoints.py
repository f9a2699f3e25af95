# accelerate_c/base/killpoints.py: the test hook ACCELERATE_C_KILL_AT=<point>[@<rank>][:launcher]. A process
# that reaches the named point (and, with @<rank>, has that RANK) SIGKILLs itself, or with ":launcher" SIGKILLs
# the launcher (ACCELERATE_C_LAUNCHER_PID) and waits for its own end (a rank gets SIGTERM when the launcher
# dies). Tests use it to kill at exact moments of start-up and save, with no timing luck (tests/test_leaks.py).
# Unset (always, outside tests) it costs one dictionary lookup per point reached; the points are not in hot loops.
# Not for: anything but tests; the points are the names in POINTS, each called once in the code where it says.
from __future__ import annotations

import os
import signal
import time

from . import settings

POINTS = {
    "launch.temp_dir": "the launcher, after creating its temp folder (commands/launch.py)",
    "shm.group.created": "group rank 0, the group's segment created, its name not yet shared (comm/shm_segments.py)",
    "shm.group.before_attach": "a group rank > 0, with the segment's name, before attaching (comm/shm_segments.py)",
    "shm.group.attached": "a group rank > 0, just after attaching (comm/shm_segments.py)",
    "shm.group.ready": "any rank, once every rank attached (comm/shm_segments.py)",
    "shm.region.created": "group rank 0, after creating an alloc() region (comm/shm_segments.py)",
    "shm.region.before_attach": "a group rank > 0, before opening an alloc() region (comm/shm_segments.py)",
    "shm.region.before_unlink": "group rank 0, every rank has the region open, before its unlink "
                                "(comm/shm_segments.py)",
    "save.tmp_created": "the coordinator of save_state, after creating the temp folder (checkpointing/atomic.py)",
    "save.mid_piece": "any writer of a safetensors file, after its header and first tensor (checkpointing/pieces.py)",
    "save.before_commit": "save_state's coordinator, every file written, before publishing (checkpointing/atomic.py)",
    "save.before_rename": "first save to a path: before renaming the temp folder to it (checkpointing/atomic.py)",
    "save.before_exchange": "a save over a checkpoint: before swapping the two folders (checkpointing/atomic.py)",
    "save.after_exchange": "after the swap, before removing the previous checkpoint (checkpointing/atomic.py)",
    "save.between_renames": "no renameat2: the previous checkpoint moved aside, the new one not yet in place "
                            "(checkpointing/atomic.py)",
    "save.old_left": "no renameat2: the new checkpoint in place, the previous one not yet removed "
                     "(checkpointing/atomic.py)",
    "save_model.tmp_written": "save_model, a shard in its temp file, before the rename (checkpointing/model.py)",
}
_parsed: dict[str, tuple[str, int | None, bool]] = {}


def _parse(raw: str) -> tuple[str, int | None, bool]:
    spec, target = raw.strip(), ""
    if ":" in spec:
        spec, target = spec.split(":", 1)
    point, rank = (spec.split("@", 1) + [""])[:2] if "@" in spec else (spec, "")
    if point not in POINTS or target not in ("", "launcher") or (rank and not rank.isdigit()):
        raise settings.SettingError(f"environment variable {settings.setting('KILL_AT').name}={raw!r}: allowed: "
                                    f"<point>[@<rank>][:launcher], <point> one of {', '.join(POINTS)}")
    return point, int(rank) if rank else None, target == "launcher"


def kill_point(name: str) -> None:
    """Called at the point `name` (a key of POINTS): kills as ACCELERATE_C_KILL_AT says when it names this point."""
    raw = settings.get("KILL_AT")
    if raw is None:
        return
    if raw not in _parsed:
        _parsed[raw] = _parse(raw)
    point, rank, launcher = _parsed[raw]
    if point != name or (rank is not None and settings.env_int("RANK", default=None) != rank):
        return
    launcher_pid = settings.get("LAUNCHER_PID") if launcher else None
    if launcher_pid is not None:
        os.kill(launcher_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60  # the launcher's death sends us SIGTERM (_bootstrap.py)
        while time.monotonic() < deadline:
            time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
