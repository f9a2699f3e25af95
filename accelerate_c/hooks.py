# accelerate_c/hooks.py: HF's import path `accelerate_c.hooks`, a face: the name is the module
# accelerate_c.bigmodel.hooks itself (the same object: private names and monkeypatching reach the real code).
# Not for: imports from inside accelerate_c, which name accelerate_c.bigmodel.hooks.
import importlib
import sys

sys.modules[__name__] = importlib.import_module("accelerate_c.bigmodel.hooks")
