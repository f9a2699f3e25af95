# accelerate_c/checkpointing/directory.py: where checkpoints live and how one is recognised. A checkpoint is a
# directory with a valid checkpoint.json (written last, so its presence marks a complete checkpoint); automatic
# naming (ProjectConfiguration) puts them in `{project_dir}/checkpoints/checkpoint_{iteration}`, keeps at most
# `total_limit` of them and loads the newest complete one; interrupted saves leave hidden temp folders (atomic.py)
# that listings skip and the next automatic save removes. What a saved dataloader position says (DataPosition).
# Not for: what a checkpoint holds or the order of a save (session.py), the crash-safe publication (atomic.py).
from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Optional

from . import atomic
from . import schema
from .files import check_name
from .format import CheckpointError, check_format, read_json, read_state

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
CHECKPOINT_FORMAT = "accelerate_c.checkpoint"
CHECKPOINT_VERSION = 2   # 1: one model.safetensors/optimizer state file written by the main process
_AUTO_RE = re.compile(r"^checkpoint_(\d+)$")


def is_coordinator(accelerator: Any) -> bool:
    """The process that writes the shared files and publishes the checkpoint (each node's under save_on_each_node)."""
    if getattr(accelerator.project_configuration, "save_on_each_node", False):
        return bool(getattr(accelerator, "is_local_main_process", accelerator.is_main_process))
    return bool(accelerator.is_main_process)


def list_checkpoints(checkpoints_dir: str) -> list[tuple[int, str]]:
    """Complete `checkpoint_{N}` folders under checkpoints_dir, sorted by N (temp/partial ones skipped)."""
    if not os.path.isdir(checkpoints_dir):
        return []
    found = []
    for name in os.listdir(checkpoints_dir):
        m = _AUTO_RE.match(name)
        path = os.path.join(checkpoints_dir, name)
        if m and os.path.isfile(os.path.join(path, CHECKPOINT_FILE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(checkpoints_dir: str) -> Optional[str]:
    found = list_checkpoints(checkpoints_dir)
    return found[-1][1] if found else None


def read_checkpoint_info(checkpoint_dir: str) -> dict:
    """The validated checkpoint.json of a checkpoint directory."""
    path = os.path.join(checkpoint_dir, CHECKPOINT_FILE)
    if not os.path.isfile(path):
        pickled = [f for f in ("optimizer.bin", "random_states_0.pkl", "pytorch_model.bin")
                   if os.path.isfile(os.path.join(checkpoint_dir, f))]
        hint = (f" It holds {pickled}: an HF Accelerate (pickle) checkpoint, which accelerate_c does not "
                "unpickle." if pickled else " (not a checkpoint, or its save did not finish)")
        raise CheckpointError(f"checkpoint file {path} is missing.{hint}")
    doc = read_json(path)
    if isinstance(doc, dict) and doc.get("format") == CHECKPOINT_FORMAT and doc.get("version") == 1:
        raise CheckpointError(f"checkpoint file {path} has format version 1 (written by an accelerate_c before "
                              f"universal checkpoints); this accelerate_c reads version {CHECKPOINT_VERSION}. Load it "
                              "with the accelerate_c that wrote it and save_state again to convert it.")
    check_format(path, doc, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, "checkpoint index")
    schema.check(doc, schema.CHECKPOINT, path)
    if not 1 <= doc["world_size"] <= len(doc["files"]):   # every rank writes files of its own
        raise CheckpointError(f"checkpoint file {path}: world_size is {doc['world_size']}, not a process count "
                              f"of a checkpoint of {len(doc['files'])} files")
    for name in doc["files"]:
        check_name(name, f"checkpoint file {path}: files")
    return doc


def listed_files(checkpoint_dir: str) -> list[str]:
    """The files the checkpoint.json of an existing checkpoint lists (none when there is none or it is unreadable):
    what a new save into the same directory must not carry over. Only plain file names of that directory: a
    listed "../x" or "/abs" is ignored, so a foreign checkpoint.json can never make a save delete outside it."""
    try:
        files = read_json(os.path.join(checkpoint_dir, CHECKPOINT_FILE)).get("files", {})
    except (CheckpointError, AttributeError):
        return []
    return [n for n in files if _is_plain(n)] if isinstance(files, dict) else []


def _is_plain(name: object) -> bool:
    try:
        check_name(name, "")
    except CheckpointError:
        return False
    return True


def _auto_root(pc: Any) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(pc.project_dir)), "checkpoints")


def output_dir_for(pc: Any, output_dir: Optional[str]) -> tuple[str, Optional[str]]:
    """(the absolute directory a save writes, the automatic checkpoints' root or None): `output_dir`, or under
    automatic naming `checkpoint_{iteration}`, which must not exist yet."""
    auto_root = None
    if pc.automatic_checkpoint_naming:
        if pc.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
        auto_root = _auto_root(pc)
        output_dir = os.path.join(auto_root, f"checkpoint_{pc.iteration}")
        if os.path.exists(output_dir):
            raise ValueError(f"Checkpoint directory {output_dir} ({pc.iteration}) already exists. Please manually "
                             "override `project_configuration.iteration` with what iteration to start with.")
    elif output_dir is None:
        raise ValueError("save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
    return os.path.abspath(os.path.expanduser(os.fspath(output_dir))), auto_root


def clear_interrupted(auto_root: str) -> None:
    """Creates the automatic checkpoints' root and removes the leftovers of interrupted saves in it."""
    os.makedirs(auto_root, exist_ok=True)
    for name in os.listdir(auto_root):
        if atomic.is_internal_name(name):
            shutil.rmtree(os.path.join(auto_root, name), ignore_errors=True)


def rotate(auto_root: str, total_limit: Optional[int]) -> None:
    """Deletes the oldest complete automatic checkpoints beyond total_limit (None: keeps all). Each is first renamed
    to its hidden temp name, so a save killed while deleting it never leaves a half-deleted checkpoint listed as
    complete (the leftover is an interrupted save's folder: the next save or `cleanup` removes it)."""
    if total_limit is None:
        return
    found = list_checkpoints(auto_root)
    for _, path in found[: max(0, len(found) - total_limit)]:
        logger.warning("Deleting checkpoint %s (total_limit=%d)", path, total_limit)
        aside = atomic.temp_dir_for(path)
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        os.rename(path, aside)
        shutil.rmtree(aside)


def input_dir_for(pc: Any, input_dir: Optional[str]) -> str:
    """The complete checkpoint a load reads: `input_dir` (or the checkpoint an interrupted publication left aside,
    atomic.resolve_for_read), or under automatic naming the newest complete one."""
    if input_dir is not None:
        want = os.path.abspath(os.path.expanduser(os.fspath(input_dir)))
        found = atomic.resolve_for_read(want, CHECKPOINT_FILE)
        if found is None:
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return found
    if pc.automatic_checkpoint_naming and pc.project_dir is not None:
        root = _auto_root(pc)
        found = latest_checkpoint(root)
        if found is None:
            raise ValueError(f"No complete checkpoint_N folder found in {root}")
        # Beyond HF: the next automatic save goes after the checkpoint we resumed from, instead of
        # failing on "checkpoint_0 already exists" until the user sets project_configuration.iteration.
        pc.iteration = max(pc.iteration, int(os.path.basename(found).rsplit("_", 1)[-1]) + 1)
        return found
    raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")


@dataclass
class DataPosition:
    """Where a dataloader stood when the checkpoint was saved (None where its state_dict lacks the key)."""
    epoch: Optional[int]
    batches_consumed: Optional[int]
    samples_consumed: Optional[int]
    state: Any


def read_data_position(checkpoint_dir: str, dataloader_index: int = 0, process_index: int = 0) -> DataPosition:
    """Data position saved for one dataloader of one rank. Reads the keys "epoch" and "batches_consumed"
    (and "samples_consumed") of the dataloader's state_dict; `state` is the whole decoded state_dict."""
    read_checkpoint_info(checkpoint_dir)
    states = read_state(checkpoint_dir, f"dataloader_states_{process_index}", kind="dataloaders")
    if not 0 <= dataloader_index < len(states):
        raise IndexError(f"checkpoint {checkpoint_dir} holds {len(states)} dataloader states")
    st = states[dataloader_index]
    get = (lambda k: st.get(k)) if isinstance(st, dict) else (lambda k: None)
    return DataPosition(get("epoch"), get("batches_consumed"), get("samples_consumed"), st)
