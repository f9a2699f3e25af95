# tests/simd_levels.py: the SIMD levels this CPU runs and a context manager that pins the C extension to one,
# shared by the tests that check every level gives the same bits.
# Not for: choosing a level in the library (the extension dispatches at run time).
import contextlib
from typing import Iterator

import accelerate_c._C as C

_ORDER = ("scalar", "avx2", "avx512")
LEVELS = list(_ORDER[: _ORDER.index(C.simd_detected()) + 1])


@contextlib.contextmanager
def simd(level: str) -> Iterator[str]:
    """Runs the block with the extension's kernels at `level`, then restores the previous level."""
    old = C.simd_level()
    C.simd_level(level)
    try:
        yield level
    finally:
        C.simd_level(old)
