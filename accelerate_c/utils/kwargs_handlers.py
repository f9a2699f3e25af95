# accelerate_c/utils/kwargs_handlers.py: HF's import path `accelerate_c.utils.kwargs_handlers`, a face: the name is the
# module accelerate_c.base.kwargs_handlers itself (the same object: private names and
# monkeypatching reach the real code).
# Not for: imports from inside accelerate_c, which name accelerate_c.base.kwargs_handlers.
import importlib
import sys

sys.modules[__name__] = importlib.import_module("accelerate_c.base.kwargs_handlers")
