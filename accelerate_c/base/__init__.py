# accelerate_c/base: the bottom layer: enums and config dataclasses (dataclasses.py, kwargs_handlers.py,
# fsdp_plugin.py), optional-package probes (imports.py), environment helpers, the dtype table (dtypes.py),
# the leftovers of killed processes (leftovers.py) and the tests' kill points (killpoints.py).
# Imports nothing of accelerate_c. Not for: anything with process state (runtime/).
