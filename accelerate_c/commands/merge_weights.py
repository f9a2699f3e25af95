# `python -m accelerate_c merge-weights CHECKPOINT_DIR OUTPUT_DIR`: HF's `accelerate merge-weights` verb and flags
# for accelerate_c checkpoints. The model of a save_state checkpoint, written by any strategy and world size as
# per-rank pieces, becomes one `model.safetensors` (HF-named shards plus model.safetensors.index.json beyond
# 10GB), assembled one tensor at a time (the whole model is never held: HF's own merge loads it all).
# `--unsafe_serialization` writes pytorch_model.bin instead; `--remove_checkpoint_dir` deletes the checkpoint
# after a successful merge. Errors (a missing file or tensor) name it and exit non-zero.
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
    """Merges model 0 of an accelerate_c checkpoint into output_dir; returns the main file's path."""
    from ..checkpointing import schema
    from ..checkpointing.format import _dtype_from_name, check_format, read_json
    from ..checkpointing.model import parse_size, write_hf_model
    from ..checkpointing.pieces import PieceReader
    from ..checkpointing.directory import CHECKPOINT_FILE, read_checkpoint_info
    from ..checkpointing.universal import INDEX_VERSION, MODEL_INDEX

    checkpoint_dir = os.path.abspath(checkpoint_dir)
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
    if remove_checkpoint_dir:
        shutil.rmtree(checkpoint_dir)
    return os.path.join(output_dir, names[0])


def merge_command(args: argparse.Namespace) -> int:
    from ..checkpointing.format import CheckpointError
    try:
        out = merge_weights(args.checkpoint_directory, args.output_path, not args.unsafe_serialization,
                            args.remove_checkpoint_dir)
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"accelerate_c merge-weights: error: {exc}", file=sys.stderr)
        return 1
    print(f"merged weights written to {out}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("merge-weights", help="merge a sharded checkpoint's model into one safetensors file",
                              description="Merge the model weights of an accelerate_c checkpoint (save_state, any "
                                          "strategy and world size) into OUTPUT_PATH/model.safetensors.")
    p.add_argument("checkpoint_directory", help="a checkpoint directory written by save_state")
    p.add_argument("output_path", help="the folder to write model.safetensors (or its shards) into")
    p.add_argument("--unsafe_serialization", action="store_true", default=False,
                   help="write pytorch_model.bin (pickle) instead of safetensors")
    p.add_argument("--remove_checkpoint_dir", action="store_true", default=False,
                   help="delete the checkpoint directory after merging")
    p.set_defaults(func=merge_command)
    return p
