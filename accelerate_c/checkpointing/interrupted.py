# accelerate_c/checkpointing/interrupted.py: what a killed save leaves in the file system, and its removal.
#   save_state: `.<name>.accelerate_c-tmp` (the temp folder of an unfinished save, or after the swap the previous
#     checkpoint not yet deleted) and `.<name>.accelerate_c-old` (the previous checkpoint set aside where
#     renameat2 is missing) next to the checkpoint `<name>` (atomic.py);
#   save_model: `<file>.accelerate_c-tmp` (a shard or index not yet renamed) and `.accelerate_c-pieces` (the pieces
#     of a sharded export) in the export folder (model.py).
# The next save to the same path removes them (atomic.recover; finish_hf_model calls remove_model_leftovers);
# `python -m accelerate_c cleanup --checkpoints DIR` finds them under DIR and removes them with the same rules:
# a checkpoint whose replacement was cut between its two renames is put back in place (atomic.recover), never
# deleted; what a running save still holds (atomic.hold) is skipped. A load never reads any of them (directory.py:
# listings skip hidden names; an explicit path is read as given, or, only when it is missing, the one complete
# checkpoint a cut replacement left aside, atomic.resolve_for_read).
# Not for: shared memory or the launcher's temp folders (base/leftovers.py).
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from . import atomic
from .directory import CHECKPOINT_FILE

PIECES_DIR = ".accelerate_c-pieces"


@dataclass(frozen=True)
class Interrupted:
    path: str
    what: str       # "save_state temp folder", "checkpoint set aside", "save_model temp file", "save_model pieces"
    in_use: bool    # a running save holds it: never removed


def _final_of(name: str) -> str:
    """`.X.accelerate_c-tmp` / `.X.accelerate_c-old` -> `X`."""
    for suffix in (atomic.TMP_SUFFIX, atomic.OLD_SUFFIX):
        if name.endswith(suffix):
            return name[1:-len(suffix)]
    return name


def _classify(parent: str, name: str) -> Interrupted | None:
    path = os.path.join(parent, name)
    if os.path.islink(path):
        return None
    if os.path.isdir(path) and atomic.is_internal_name(name):
        what = "save_state temp folder" if name.endswith(atomic.TMP_SUFFIX) else "checkpoint set aside"
        tmp = atomic.temp_dir_for(os.path.join(parent, _final_of(name)))
        return Interrupted(path, what, atomic.in_use(tmp))
    if os.path.isdir(path) and name == PIECES_DIR:
        return Interrupted(path, "save_model pieces", atomic.in_use(path))
    if os.path.isfile(path) and name.endswith(atomic.TMP_SUFFIX) and not name.startswith("."):
        return Interrupted(path, "save_model temp file", atomic.in_use(path))
    return None


def find(root: str) -> list[Interrupted]:
    """Every leftover of a killed save under `root` (links are not followed; leftovers are not entered)."""
    found = []
    for parent, dirs, files in os.walk(os.path.abspath(root)):
        for name in sorted(dirs + files):
            item = _classify(parent, name)
            if item is not None:
                found.append(item)
        dirs[:] = [d for d in dirs if _classify(parent, d) is None]
    return found


def remove(item: Interrupted, dry_run: bool = False) -> str:
    """Removes (or, for a checkpoint a cut replacement left aside, puts back) one leftover; returns what it did
    (with `dry_run`, only what it would do)."""
    if item.in_use:
        return f"{'would keep' if dry_run else 'kept'} {item.path} ({item.what}: a running save holds it)"
    parent, name = os.path.split(item.path)
    line = f"{'would remove' if dry_run else 'removed'} {item.path} ({item.what})"
    if item.what in ("save_state temp folder", "checkpoint set aside"):
        final = os.path.join(parent, _final_of(name))
        if not os.path.lexists(final) and os.path.isdir(atomic.old_dir_for(final)):
            line = f"{'would put' if dry_run else 'put'} back {final} (its replacement was interrupted)"
        if not dry_run:
            atomic.recover(final, CHECKPOINT_FILE)
    elif not dry_run and os.path.isdir(item.path):
        shutil.rmtree(item.path, ignore_errors=True)
    elif not dry_run and os.path.lexists(item.path):
        os.remove(item.path)
    return line


def remove_model_leftovers(save_directory: str) -> None:
    """save_model's leftovers directly in `save_directory` that no running save holds (after a save finished)."""
    for name in sorted(os.listdir(save_directory)):
        item = _classify(save_directory, name)
        if item is not None and item.what.startswith("save_model") and not item.in_use:
            remove(item)
