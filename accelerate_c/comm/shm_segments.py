# accelerate_c/comm/shm_segments.py: creating a ShmGroup's control segment and its alloc() regions, collectively
# over the group's bootstrap process group, so that no kill leaves a name in /dev/shm for good.
# Group rank 0 first removes the segments of makers that are gone (base/leftovers.py: the next run reclaims what
# a SIGKILL left), then creates the segment (O_EXCL, 0600, a name with the job's tag, its maker's pid, start time
# and pid namespace, and a random token), the name travels by broadcast, the others attach, and the last one to
# attach unlinks it (csrc/shm/shm_seg.c); a region's name is unlinked by rank 0 once every rank has it open. An
# error or a dead peer during the exchange unlinks the name on rank 0 before the error goes up. What a SIGKILL
# inside these windows leaves carries a dead maker's pid: the next group creation, the launcher at the end of the
# job or `python -m accelerate_c cleanup` removes it. The kill points (base/killpoints.py) mark the windows.
# Not for: the collectives (shm.py), the name format and the sweeps (base/leftovers.py).
from __future__ import annotations

import os
from typing import Any

from accelerate_c import _C
from accelerate_c.base import leftovers, settings
from accelerate_c.base.killpoints import kill_point


def _fail_group(h: Any, name: Any, creator: bool) -> None:
    if h is not None:
        _C.shm_group_close(h)  # the creator unlinks the name when not everyone attached
    if creator and name is not None:
        _C.shm_unlink(name)


def open_group(grp: Any, small_bytes: int, chunk_bytes: int, tag: str) -> tuple[Any, str]:
    """Collective over `grp` (rank, size, timeout, _share, _gather): (the C handle, the segment's name)."""
    h, err, name = None, "", None
    creator = grp.rank == 0
    if creator:  # create before sharing the name, so the others can attach at once
        leftovers.sweep_segments()
        name = leftovers.shm_name(tag)
        try:
            h = _C.shm_group_open(name, True, 0, grp.size, small_bytes, chunk_bytes, grp.timeout)
        except Exception as e:
            err = f"rank 0: {e}"
        kill_point("shm.group.created")
    try:
        name, err0 = grp._share((name, err))
        if not err0 and not creator:
            kill_point("shm.group.before_attach")
            try:
                h = _C.shm_group_open(name, False, grp.rank, grp.size, small_bytes, chunk_bytes, grp.timeout)
            except Exception as e:  # every rank learns about the failure below instead of timing out
                err = f"rank {grp.rank}: {e}"
            kill_point("shm.group.attached")
        errs = grp._gather(err)
    except BaseException:  # e.g. a peer died during the exchange
        _fail_group(h, name, creator)
        raise
    if any(errs):
        _fail_group(h, name, creator)
        raise RuntimeError("ShmGroup creation failed: " + "; ".join(e for e in errs if e))
    try:
        _C.shm_group_wait_attached(h)  # a timeout unlinks the name (C)
    except BaseException:
        _C.shm_group_close(h)
        raise
    kill_point("shm.group.ready")
    return h, name


def open_region(grp: Any, total_bytes: int) -> int:
    """Collective over `grp`: a file descriptor of a fresh region of `total_bytes`, already unlinked."""
    name, err, fd = None, "", -1
    creator = grp.rank == 0
    if creator:  # create before sharing the name
        name = leftovers.shm_name(settings.env_value("MASTER_PORT", "0"), region=True)
        try:
            fd = _C.shm_region_fd(name, True, total_bytes)
        except Exception as e:
            err = f"rank 0: {e}"
        kill_point("shm.region.created")
    try:
        name, err0 = grp._share((name, err))
        if not err0 and not creator:
            kill_point("shm.region.before_attach")
            try:
                fd = _C.shm_region_fd(name, False, total_bytes)
            except Exception as e:
                err = f"rank {grp.rank}: {e}"
        errs = grp._gather(err)  # after this every rank has the region open (or knows it failed)
        if creator:
            kill_point("shm.region.before_unlink")
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        if creator and name is not None:
            _C.shm_unlink(name)
    if any(errs):
        if fd >= 0:
            os.close(fd)
        raise RuntimeError("ShmGroup.alloc failed: " + "; ".join(e for e in errs if e))
    return fd
