# accelerate_c/parallelism_config.py: HF's import path `accelerate_c.parallelism_config`, a face: the name is the
# module accelerate_c.base.parallelism_config itself (the same object: private names and monkeypatching reach the
# real code).
# Not for: imports from inside accelerate_c, which name accelerate_c.base.parallelism_config.
import importlib
import sys

sys.modules[__name__] = importlib.import_module("accelerate_c.base.parallelism_config")
