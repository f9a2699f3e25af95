# accelerate_c/utils/memory.py: HF's import path `accelerate_c.utils.memory`, a face: the name is the
# module accelerate_c.runtime.memory itself (the same object: private names and
# monkeypatching reach the real code).
# Not for: imports from inside accelerate_c, which name accelerate_c.runtime.memory.
import importlib
import sys

sys.modules[__name__] = importlib.import_module("accelerate_c.runtime.memory")
