# accelerate_c/utils/fsdp_utils.py: HF's import path `accelerate_c.utils.fsdp_utils`, a face: the name is the module
# accelerate_c.facade.fsdp_checkpoint itself (the same object: private names and monkeypatching reach the real code).
# Not for: imports from inside accelerate_c, which name accelerate_c.facade.fsdp_checkpoint.
import importlib
import sys

sys.modules[__name__] = importlib.import_module("accelerate_c.facade.fsdp_checkpoint")
