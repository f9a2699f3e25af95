# accelerate_c/utils/random.py: HF's import path `accelerate_c.utils.random` kept as a face: this name is the module accelerate_c.runtime.random itself
# (the same object, so its private names and monkeypatching reach the real code).
# Not for: imports from inside accelerate_c (they name accelerate_c.runtime.random directly).
import importlib
import sys

sys.modules[__name__] = importlib.import_module("accelerate_c.runtime.random")
