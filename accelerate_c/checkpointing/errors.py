# accelerate_c/checkpointing/errors.py: the one exception every checkpoint reader raises (a ValueError, so
# callers that caught ValueError before keep working). Its text names the file and, where there is one, the key.
# Not for: what is checked (files.py: paths and opening; stfile.py: safetensors headers; schema.py: JSON).
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, foreign, malformed, outside its checkpoint or of an unsupported
    format version."""


class StateDictMismatch(CheckpointError, RuntimeError):
    """The checkpoint's model does not fit this one (missing or unexpected names, other shapes): found before
    anything is loaded; also a RuntimeError, which torch's load_state_dict raises for the same mismatch."""
