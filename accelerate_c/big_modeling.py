# accelerate_c/big_modeling.py: HF's import path `accelerate_c.big_modeling`, a face: the name is the module
# accelerate_c.bigmodel.dispatch itself (the same object: private names and monkeypatching reach the real code;
# transformers swaps its `check_device_map`).
# Not for: imports from inside accelerate_c, which name accelerate_c.bigmodel.dispatch.
import importlib
import sys

sys.modules[__name__] = importlib.import_module("accelerate_c.bigmodel.dispatch")
