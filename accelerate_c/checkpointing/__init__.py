# accelerate_c/checkpointing: save_state/load_state (universal checkpoints: logical tensors written by every rank
# in parallel, loadable under any strategy and world size) and save_model. Format: JSON (structure, indexes) +
# safetensors (tensor bytes), never pickle; atomic publication. docs/checkpoints.md describes the layout.
# The Accelerator's methods call these module functions with itself as the first argument.
from .format import CheckpointError, FORMAT_VERSION, decode, encode, read_state, write_state
from .model import parse_size, save_model
from .directory import (CHECKPOINT_FILE, DataPosition, latest_checkpoint, list_checkpoints, read_checkpoint_info,
                        read_data_position)
from .loading import load_state
from .session import save_state

__all__ = ["CheckpointError", "FORMAT_VERSION", "decode", "encode", "read_state", "write_state", "parse_size",
           "save_model", "CHECKPOINT_FILE", "DataPosition", "latest_checkpoint", "list_checkpoints",
           "load_state", "read_checkpoint_info", "read_data_position", "save_state"]
