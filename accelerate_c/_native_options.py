# _native_options.py: TEMPORARY bridge, to be replaced by the settings module. The C core no longer reads
# environment variables; this reads the four it used to read, with the C code's old semantics, and passes them
# to the extension. Called once, by the extension itself as it loads (csrc/module.c, apply_env_options), so
# every first import of accelerate_c._C passes here whichever module imports it.
# Not for: any other setting, or validation messages for users (the old C code had none: it ignored what it
# could not use, and so does this).
from __future__ import annotations

import os
import re
from typing import Any

_SPIN_MAX_US = 10_000_000  # _C.set_options' bound on both spin times
_ATOL = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def _atol(text: str) -> int:
    """C's atol: leading whitespace, an optional sign and the digits that follow; 0 when there are none."""
    m = _ATOL.match(text)
    return int(m.group(1)) if m else 0


def apply_from_env(C: Any = None) -> None:
    """ACCELERATE_C_SIMD=scalar|avx2 lowers the SIMD level (avx2 only where the CPU has it; anything else is
    ignored); ACCELERATE_C_CAST_THP turns cast_thp on iff it starts with '1'; ACCELERATE_C_SHM_SPIN_US and
    ACCELERATE_C_SHM_INNER_SPIN_US set the shm spin budgets in microseconds (read as C's atol read them; a
    negative value spun for no time, as 0 does now, and values are capped at 10 s). C: the extension module
    (default: accelerate_c._C)."""
    if C is None:
        from accelerate_c import _C as C
    env = os.environ
    simd = env.get("ACCELERATE_C_SIMD")
    if simd == "scalar":
        C.simd_level("scalar")
    elif simd == "avx2" and C.simd_detected() in ("avx2", "avx512"):
        C.simd_level("avx2")
    opts: dict = {}
    thp = env.get("ACCELERATE_C_CAST_THP")
    if thp is not None:
        opts["cast_thp"] = thp.startswith("1")
    for var, key in (("ACCELERATE_C_SHM_SPIN_US", "shm_spin_us"),
                     ("ACCELERATE_C_SHM_INNER_SPIN_US", "shm_inner_spin_us")):
        value = env.get(var)
        if value is not None:
            opts[key] = min(max(_atol(value), 0), _SPIN_MAX_US)
    if opts:
        C.set_options(**opts)
