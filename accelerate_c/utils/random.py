# accelerate_c/utils/random.py: HF's import path `accelerate_c.utils.random`, a face: the name is the
# module accelerate_c.runtime.random itself (the same object: private names and
# monkeypatching reach the real code).
# Not for: imports from inside accelerate_c, which name accelerate_c.runtime.random.
import importlib
import sys

sys.modules[__name__] = importlib.import_module("accelerate_c.runtime.random")
