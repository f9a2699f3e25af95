# accelerate_c/logging.py: HF's import path `accelerate_c.logging`, a face: the name is the
# module accelerate_c.runtime.logging itself (the same object: private names and
# monkeypatching reach the real code).
# Not for: imports from inside accelerate_c, which name accelerate_c.runtime.logging.
import importlib
import sys

sys.modules[__name__] = importlib.import_module("accelerate_c.runtime.logging")
