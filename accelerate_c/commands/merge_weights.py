# `python -m accelerate_c merge-weights CHECKPOINT_DIR OUTPUT_DIR`: HF's `accelerate merge-weights` verb and flags
# for accelerate_c checkpoints. The model of a save_state checkpoint, written by any strategy and world size as
# per-rank pieces, becomes one `model.safetensors` (HF-named shards plus model.safetensors.index.json beyond
# 10GB), assembled one tensor at a time (the whole model is never held: HF's own merge loads it all).
# `--unsafe_serialization` writes pytorch_model.bin instead; `--remove_checkpoint_dir` deletes the checkpoint
# after a successful merge. Errors (a missing file or tensor) name it and exit non-zero. The folder
# `save_fsdp_model` writes (`pytorch_model_fsdp_<i>`, what HF's merge takes) is accepted too. HF's Python names:
# `merge_fsdp_weights` (accelerate.utils; the main process merges, every process waits) and `merge_command` /
# `merge_command_parser` (accelerate.commands.merge, the face commands/merge.py).
# Not for: the checkpoint format (checkpointing/) or optimizer state (merge keeps the model only, as HF's does).
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

MAX_SHARD = "10GB"


def merge_weights(checkpoint_dir: str, output_dir: str, safe_serialization: bool = True,
                  remove_checkpoint_dir: bool = False) -> str:
    """Merges model 0 of an accelerate_c checkpoint (or the folder save_fsdp_model wrote) into output_dir; returns
    the main file's path."""
    from ..facade.fsdp_checkpoint import FSDP_MODEL_FILE

    checkpoint_dir = os.path.abspath(checkpoint_dir)
    if os.path.isfile(os.path.join(checkpoint_dir, FSDP_MODEL_FILE)):
        out = _merge_fsdp_model_folder(checkpoint_dir, output_dir, safe_serialization)
    else:
        out = _merge_checkpoint(checkpoint_dir, output_dir, safe_serialization)
    if remove_checkpoint_dir:
        shutil.rmtree(checkpoint_dir)
    return out


def _merge_fsdp_model_folder(folder: str, output_dir: str, safe_serialization: bool) -> str:
    from ..checkpointing.model import parse_size, write_hf_model
    from ..checkpointing.stfile import TensorFile
    from ..facade.fsdp_checkpoint import FSDP_MODEL_FILE

    with TensorFile(os.path.join(folder, FSDP_MODEL_FILE)) as fh:
        specs = [(k, tuple(fh.entry(k)["shape"]), fh.tensor(k).dtype) for k in fh.keys()]
        names, _, _ = write_hf_model(output_dir, specs, fh.tensor, parse_size(MAX_SHARD), safe_serialization)
    return os.path.join(output_dir, names[0])


def _merge_checkpoint(checkpoint_dir: str, output_dir: str, safe_serialization: bool) -> str:
    from ..checkpointing import schema
    from ..checkpointing.format import _dtype_from_name, check_format, read_json
    from ..checkpointing.model import parse_size, write_hf_model
    from ..checkpointing.pieces import PieceReader
    from ..checkpointing.directory import CHECKPOINT_FILE, read_checkpoint_info
    from ..checkpointing.universal import INDEX_VERSION, MODEL_INDEX

    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist")
    meta = read_checkpoint_info(checkpoint_dir)
    if not meta.get("models"):
        raise FileNotFoundError(f"{os.path.join(checkpoint_dir, CHECKPOINT_FILE)} lists no model")
    path = os.path.join(checkpoint_dir, f"{meta['models'][0]}.json")
    index = check_format(path, read_json(path, meta["files"].get(f"{meta['models'][0]}.json")), MODEL_INDEX,
                         INDEX_VERSION, "tensor index")
    schema.check(index, schema.MODEL_INDEX, path)
    specs = [(n, tuple(e["shape"]), _dtype_from_name(e["dtype"])) for n, e in index["tensors"].items()]
    with PieceReader(checkpoint_dir, index["tensors"], meta["files"]) as reader:
        reader.validate()   # every piece file present, whole and consistent with the index before anything is written
        names, _, _ = write_hf_model(output_dir, specs, reader.read_whole, parse_size(MAX_SHARD), safe_serialization)
    return os.path.join(output_dir, names[0])


def merge_fsdp_weights(checkpoint_dir: str, output_path: str, safe_serialization: bool = True,
                       remove_checkpoint_dir: bool = False) -> None:
    """HF's `accelerate.utils.merge_fsdp_weights`: the main process merges (merge_weights), every process of a
    launched job waits for it. A directory that does not exist is HF's ValueError, with HF's hints."""
    from ..facade.fsdp_checkpoint import FSDP_MODEL_NAME
    from ..runtime.state import PartialState

    if not os.path.isdir(checkpoint_dir):
        err = f"Tried to load from {checkpoint_dir} but couldn't find a valid metadata file."
        hints = [p for p in (f"{FSDP_MODEL_NAME}_0", "optimizer_0") if os.path.exists(os.path.join(checkpoint_dir, p))]
        if hints:
            err += " However, a potential checkpoint directory exists: please pass in " + " or ".join(
                os.path.join(checkpoint_dir, h) for h in hints) + " instead."
        raise ValueError(err)
    state = PartialState()
    if state.is_main_process:
        merge_weights(checkpoint_dir, output_path, safe_serialization, remove_checkpoint_dir)
    state.wait_for_everyone()


def merge_command(args: argparse.Namespace) -> int:
    """The verb (and HF's `accelerate.commands.merge.merge_command`): 1 with the error on stderr on bad input."""
    from ..checkpointing.format import CheckpointError
    try:
        merge_fsdp_weights(args.checkpoint_directory, args.output_path, not args.unsafe_serialization,
                           args.remove_checkpoint_dir)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"accelerate_c merge-weights: error: {exc}", file=sys.stderr)
        return 1
    print(f"merged weights written to {args.output_path}")
    return 0


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """HF's name: the verb's parser, standalone when `subparsers` is None."""
    return add_parser(subparsers)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    description = ("Merge the model weights of an accelerate_c checkpoint (save_state, any strategy and world size) "
                   "or of a save_fsdp_model folder into OUTPUT_PATH/model.safetensors.")
    if subparsers is None:
        p = argparse.ArgumentParser("accelerate_c merge-weights", description=description)
    else:
        p = subparsers.add_parser("merge-weights", help="merge a sharded checkpoint's model into one safetensors file",
                                  description=description)
    p.add_argument("checkpoint_directory", help="a checkpoint directory written by save_state")
    p.add_argument("output_path", help="the folder to write model.safetensors (or its shards) into")
    p.add_argument("--unsafe_serialization", action="store_true", default=False,
                   help="write pytorch_model.bin (pickle) instead of safetensors")
    p.add_argument("--remove_checkpoint_dir", action="store_true", default=False,
                   help="delete the checkpoint directory after merging")
    p.set_defaults(func=merge_command)
    return p
