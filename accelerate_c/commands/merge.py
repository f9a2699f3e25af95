# accelerate_c/commands/merge.py: HF's import path `accelerate.commands.merge` (merge_command, merge_command_parser),
# a face over the merge-weights verb (merge_weights.py), which owns them.
# Not for: anything of its own.
from .merge_weights import merge_command, merge_command_parser  # noqa: F401
