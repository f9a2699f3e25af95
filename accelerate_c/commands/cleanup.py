# `python -m accelerate_c cleanup`: removes what killed runs left on this machine: shared-memory segments in
# /dev/shm and launcher temp folders whose maker is gone (base/leftovers.py; a running job's are never touched),
# and, with --checkpoints DIR, the temp and set-aside folders of killed saves under DIR (checkpointing/
# interrupted.py: a checkpoint whose replacement was cut is put back, what a running save holds is kept).
# --dry_run lists without removing. One line per entry; exit code 0, or 1 when something could not be removed.
# Not for: deciding what is stale (the modules above), anything of a running job.
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from ..base import leftovers
from .config_flags import HelpFormatter, add_flag


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("cleanup", allow_abbrev=False, formatter_class=HelpFormatter,
                              help="remove what killed runs left (shared memory, launcher temp folders, "
                                   "interrupted checkpoint saves)",
                              description="Remove the shared-memory segments (/dev/shm/accc-*) and launcher temp "
                                          "folders (accelerate_c_launch_*) whose process is gone, and with "
                                          "--checkpoints the leftovers of killed saves under a directory. "
                                          "Entries of running jobs and saves are never touched.")
    add_flag(p, "--checkpoints", action="append", default=[], metavar="DIR",
             help="also clean the interrupted save_state / save_model leftovers under DIR (repeatable)")
    add_flag(p, "--temp_dir", default=None, help="where launcher temp folders are looked for (default: the "
             "temp directory, $TMPDIR or /tmp)")
    add_flag(p, "--dry_run", action="store_true", help="only list what would be removed")
    p.set_defaults(func=cleanup_command)
    return p


def cleanup_command(args: argparse.Namespace) -> int:
    for d in args.checkpoints:
        if not os.path.isdir(d):
            raise FileNotFoundError(f"--checkpoints {d!r}: not a directory")
    found = leftovers.stale_segments() + leftovers.stale_launch_dirs(args.temp_dir or tempfile.gettempdir())
    done = found if args.dry_run else leftovers.remove(found)
    verb = "would remove" if args.dry_run else "removed"
    for x in found:
        state = verb if x in done else "could not remove"
        print(f"{state} {x.path} ({x.what}; its process {x.pid} is gone)")
    failed = len(found) - len(done)
    for d in args.checkpoints:
        failed += _checkpoints(d, args.dry_run)
    if not found and not args.checkpoints:
        print("nothing to remove")
    return 1 if failed else 0


def _checkpoints(root: str, dry_run: bool) -> int:
    from ..checkpointing import interrupted

    items = interrupted.find(root)
    failed = 0
    for item in items:
        if not os.path.lexists(item.path):  # went with its sibling (the other half of one interrupted save)
            continue
        try:
            print(interrupted.remove(item, dry_run))
        except OSError as e:
            print(f"could not remove {item.path} ({item.what}): {e}")
            failed += 1
    if not items:
        print(f"nothing to remove under {root}")
    return failed
